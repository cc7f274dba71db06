"""CTC speech models over their built graphs, in numpy: features in, label ids and text out.

Greedy CTC decoding: the most likely label of each output frame, repeats merged, blanks dropped. Labels are
SentencePiece pieces; '▁' starts a word. `build_dir/export.json` holds the blank id and the graph's shapes,
`build_dir/labels.json` the labels (absent when a random-weights build had no archive to read them from:
text is then the ids).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from tools.whisper_runtime import GRAPH_FILES

WORD_START = "\u2581"


def greedy_ids(logits: np.ndarray, blank: int) -> list[int]:
    """(frames, labels) scores -> label ids: per-frame argmax, repeats merged, blanks dropped."""
    best = np.asarray(logits).argmax(-1)
    keep = np.concatenate([[True], best[1:] != best[:-1]]) & (best != blank)
    return [int(i) for i in best[keep]]


def labels_text(ids: list[int], labels: list[str] | None) -> str:
    if labels is None:
        return " ".join(f"<{i}>" for i in ids)
    return "".join(labels[i] for i in ids).replace(WORD_START, " ").strip()


class CTCGraph:
    """A built single-graph CTC entry run by LiteRT (fp32 or an INT8 variant) or ONNX Runtime."""

    def __init__(self, build_dir: Path | str, backend: str = "fp32", threads: int | None = None):
        from tools.stages.validate import onnx_runner, tflite_runner, to_layout

        build_dir = Path(build_dir)
        record = json.loads((build_dir / "export.json").read_text())
        self.blank = record["decoding"]["blank"]
        (self.input_name, self.input_shape), = record["inputs"].items()
        (self.output_name, self.output_shape), = record["outputs"].items()
        self.file = build_dir / GRAPH_FILES.get(backend, f"model_{backend}.tflite")
        if not self.file.exists():
            raise ValueError(f"{self.file} does not exist")
        self.files = {"model": self.file}  # as WhisperGraphs.files: graph -> the file it runs
        self.runner = (onnx_runner if backend == "onnx" else tflite_runner)(self.file, threads)
        self.runners = {"model": self.runner}  # as WhisperGraphs.runners
        self._to_layout = to_layout
        labels = build_dir / "labels.json"
        self.labels = json.loads(labels.read_text()) if labels.exists() else None
        self.timings: list[float] = []
        self.last_logits: np.ndarray | None = None

    def logits(self, features: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        got = self.runner({self.input_name: features})[self.output_name]
        self.timings.append(time.perf_counter() - start)
        return self._to_layout(np.asarray(got), tuple(self.output_shape))[0]

    def latency_ms(self) -> dict:
        """Median forward time, in ms, over the runs so far."""
        return {"forward_ms": round(1000 * float(np.median(self.timings)), 2)}

    def decode(self, features: np.ndarray) -> list[int]:
        self.last_logits = self.logits(features)
        return greedy_ids(self.last_logits, self.blank)

    def text(self, ids: list[int]) -> str:
        return labels_text(ids, self.labels)


def near_tie_frames(reference: np.ndarray, logits: np.ndarray, atol: float, rtol: float) -> int | None:
    """Frames whose best label differs from the reference's, when every one of them is a near-tie: the two
    labels' reference scores within the graph's validated tolerance of each other (either could come out of
    a graph that matches within it). None when a frame differs by more: a real disagreement."""
    ref_best, best = reference.argmax(-1), logits.argmax(-1)
    frames = np.nonzero(ref_best != best)[0]
    top = reference[frames, ref_best[frames]]
    margin = top - reference[frames, best[frames]]
    return int(frames.size) if np.all(margin <= 2 * (atol + rtol * np.abs(top))) else None
