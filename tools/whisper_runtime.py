"""Whisper inference over the split graphs with numpy alone: tokens to text, and greedy decoding.

The same loop drives every backend (torch at export, ONNX Runtime and LiteRT later), so that a transcript
difference between them comes from the graphs, never from the loop. Decoding is greedy without timestamps:
the prompt is <|startoftranscript|> [<|en|> <|transcribe|>] <|notimestamps|>; the checkpoint's suppressed
tokens are never chosen, nor blank or end of text as the first token, nor any special token but the end (in Whisper's
vocabularies every special token comes after end of text).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

# Added to the scores of decoder cache slots not yet filled: large enough to zero their softmax weight, small
# enough to stay finite in float16 and to leave an int8 scale usable.
MASKED = -1e4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


@dataclass(frozen=True)
class Tokenizer:
    """The decode half of a Hugging Face byte-level BPE tokenizer.json: ids -> text."""

    tokens: dict[int, str]
    special: dict[str, int]

    @classmethod
    def from_file(cls, path: Path | str) -> "Tokenizer":
        data = json.loads(Path(path).read_text())
        tokens = {int(i): t for t, i in data["model"]["vocab"].items()}
        special = {a["content"]: int(a["id"]) for a in data["added_tokens"]}
        tokens.update({i: t for t, i in special.items()})
        return cls(tokens, special)

    def decode(self, ids: list[int]) -> str:
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        specials = set(self.special.values())
        data = bytearray(byte_of[c] for i in ids if i not in specials for c in self.tokens.get(i, ""))
        return data.decode("utf-8", errors="replace").strip()


@dataclass(frozen=True)
class DecodeSettings:
    """What greedy decoding needs to know of the checkpoint."""

    prompt: list[int]
    end: int
    max_tokens: int
    suppress: list[int] = field(default_factory=list)
    suppress_first: list[int] = field(default_factory=list)


def step_inputs(token: int, position: int, max_tokens: int, self_kv: np.ndarray, cross_kv: np.ndarray) -> dict:
    """The decoder step's named inputs at `position`: the new token fills the last of max_tokens slots."""
    bias = np.full((1, max_tokens), MASKED, dtype=np.float32)
    bias[0, max_tokens - 1 - position:] = 0
    return {"input_ids": np.array([[token]], dtype=np.int32), "position_ids": np.array([[position]], dtype=np.int32),
            "attention_bias": bias, "self_kv": self_kv, "cross_kv": cross_kv}


def greedy_decode(step: Callable[[dict], tuple], cross_kv: np.ndarray, self_kv_shape: tuple,
                  settings: DecodeSettings, on_step: Callable[[int, dict], None] | None = None) -> list[int]:
    """Token ids after the prompt, up to the end token or max_tokens in all. `step` maps the named inputs to
    (logits, self_kv); `on_step(position, inputs)` sees every step's inputs (to keep validation samples)."""
    tokens = list(settings.prompt)
    self_kv = np.zeros(self_kv_shape, dtype=np.float32)
    for position in range(settings.max_tokens):
        inputs = step_inputs(tokens[position], position, settings.max_tokens, self_kv, cross_kv)
        if on_step is not None:
            on_step(position, inputs)
        logits, self_kv = step(inputs)
        if position < len(settings.prompt) - 1:
            continue  # still reading the prompt
        scores = np.array(logits, dtype=np.float32).reshape(-1)
        scores[settings.suppress] = -np.inf
        if position == len(settings.prompt) - 1:
            scores[settings.suppress_first] = -np.inf
        scores[settings.end + 1:] = -np.inf  # Whisper's special tokens (languages, tasks, timestamps) follow the end
        chosen = int(np.argmax(scores))
        if chosen == settings.end or len(tokens) == settings.max_tokens:
            break
        tokens.append(chosen)
    return tokens[len(settings.prompt):]


def decode_utterance(run: Callable[[str, dict], list], features: np.ndarray, self_kv_shape: tuple,
                     settings: DecodeSettings, on_step: Callable[[int, dict], None] | None = None) -> list[int]:
    """Encoder, cross K/V once, then greedy decoding; `run(graph, inputs)` gives that graph's outputs in order."""
    (hidden,) = run("encoder", {"input_features": features})
    (cross_kv,) = run("cross_kv", {"encoder_hidden_states": hidden})
    return greedy_decode(lambda inputs: run("decoder_step", inputs), cross_kv, self_kv_shape, settings, on_step)


def settings_of(entry) -> DecodeSettings:
    decoding = entry.data["decoding"]
    return DecodeSettings(prompt=list(decoding["prompt"]), end=decoding["end"],
                          max_tokens=entry.data["split"]["max_tokens"], suppress=list(decoding.get("suppress", [])),
                          suppress_first=list(decoding.get("suppress_first", [])))


GRAPH_FILES = {"fp32": "model_fp32.tflite", "onnx": "model.onnx"}


class WhisperGraphs:
    """The three graphs of a built Whisper entry, run by LiteRT (or ONNX Runtime): features in, ids out.

    `build_dir/export.json` says each graph's input and output shapes in torch's layout; outputs that a
    converter laid out otherwise are brought back to it, so that the decoder's cache goes round unchanged.
    """

    def __init__(self, build_dir: Path | str, backend: str = "fp32", threads: int | None = None,
                 load: tuple[str, ...] | None = None):
        """`load`: only these graphs (a stage must not open a graph it does not declare that it reads)."""
        from tools.stages.validate import onnx_runner, tflite_runner, to_layout

        build_dir = Path(build_dir)
        record = json.loads((build_dir / "export.json").read_text())
        self.graphs = record["graphs"]
        self.settings = DecodeSettings(**record["decoding"])
        make = onnx_runner if backend == "onnx" else tflite_runner
        self.files = {name: self._file(build_dir / name, backend) for name in load or self.graphs}
        self.runners = {name: make(path, threads) for name, path in self.files.items()}
        self._to_layout = to_layout
        tokenizer = build_dir / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(tokenizer) if tokenizer.exists() else None
        self.timings: dict[str, list[float]] = {"encoder": [], "cross_kv": [], "decoder_step": []}

    @staticmethod
    def _file(folder: Path, backend: str) -> Path:
        """The graph's file for a backend; an INT8 variant that leaves this graph float runs its fp32 .tflite."""
        if backend in GRAPH_FILES:
            return folder / GRAPH_FILES[backend]
        variant = folder / f"model_{backend}.tflite"
        return variant if variant.exists() else folder / GRAPH_FILES["fp32"]

    def run(self, graph: str, inputs: dict) -> list[np.ndarray]:
        import time

        start = time.perf_counter()
        got = self.runners[graph](inputs)
        self.timings[graph].append(time.perf_counter() - start)
        return [self._to_layout(np.asarray(got[name]), tuple(shape)) for name, shape in self.graphs[graph]["outputs"].items()]

    @property
    def self_kv_shape(self) -> tuple:
        return tuple(self.graphs["decoder_step"]["inputs"]["self_kv"])

    def latency_ms(self) -> dict:
        """Median encoder and cross K/V time, mean decoder step, in ms, over the runs so far."""
        t = self.timings
        return {"encoder_ms": round(1000 * float(np.median(t["encoder"])), 2),
                "cross_kv_ms": round(1000 * float(np.median(t["cross_kv"])), 2),
                "decoder_step_ms": round(1000 * float(np.mean(t["decoder_step"])), 3) if t["decoder_step"] else None}

    def decode(self, features: np.ndarray, on_step: Callable[[int, dict], None] | None = None) -> list[int]:
        return decode_utterance(self.run, features, self.self_kv_shape, self.settings, on_step)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else " ".join(f"<{i}>" for i in ids)


def normalise(text: str) -> list[str]:
    """Words for a word error rate: lower case, punctuation dropped (apostrophes inside words kept)."""
    import re

    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).replace(" '", " ").split()


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference words): Levenshtein distance over normalised words."""
    ref, hyp = normalise(reference), normalise(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, word in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, other in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (word != other))
    return row[len(hyp)], len(ref)


def calibration_feeds(graph: str, build_dir: Path, features: list[np.ndarray], count: int,
                      rng: np.random.Generator) -> list[dict]:
    """Calibration inputs of a later graph: what the fp32 graphs before it compute from the utterances' features
    (the decoder step's inputs at every step of greedy decoding), `count` of them drawn with `rng`."""
    # the cross K/V graph's inputs need only the encoder; the decoder step's, greedy decoding through all three
    graphs = WhisperGraphs(build_dir, "fp32", load=("encoder",) if graph == "cross_kv" else None)
    feeds: list[dict] = []
    for feature in features:
        if graph == "cross_kv":
            (hidden,) = graphs.run("encoder", {"input_features": feature})
            feeds.append({"encoder_hidden_states": hidden})
        else:
            graphs.decode(feature, on_step=lambda _, inputs: feeds.append(inputs))
    if len(feeds) > count:
        feeds = [feeds[i] for i in sorted(rng.choice(len(feeds), count, replace=False))]
    return feeds
