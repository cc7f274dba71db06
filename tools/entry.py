"""Load a zoo entry, check it against the schema and the cross-field rules, and hand out its sections.

Every problem becomes an EntryError that names the file, the JSON path and what is expected, so that a
contributor never sees a traceback from inside jsonschema or json.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / "schema" / "entry.schema.json"
ZOO_DIR = ROOT / "zoo"

ID_PATTERN = re.compile(r"^[a-z][a-z0-9_]{1,63}$")
# What tools.new writes where only the contributor knows the answer; an entry holding it is not finished.
PLACEHOLDER = "FILL-IN"

# Stages whose tolerance must be declared: each compares its graph with the torch reference.
VALIDATED_STAGES = ("onnx", "onnx_simplified", "tflite_fp32")


class EntryError(ValueError):
    """A bad entry: file, JSON path, and what is expected there."""

    def __init__(self, file: Path | str, json_path: str, message: str):
        self.file, self.json_path, self.message = str(file), json_path, message
        super().__init__(f"{file}: {json_path}: {message}")


@dataclass(frozen=True)
class Entry:
    path: Path
    data: dict
    graph: str | None = None  # one graph of a split entry (build/<id>/<graph>/), or None: the whole entry

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def graphs(self) -> tuple[str, ...]:
        """The graphs a split entry runs as, in order; () for a single-graph entry."""
        from tools.splits import graphs_of

        return graphs_of(self.data)

    def for_graph(self, name: str) -> "Entry":
        if name not in self.graphs:
            raise EntryError(self.path, "$.split.name", f"no graph {name!r}; the split has {list(self.graphs)}")
        return Entry(self.path, self.data, graph=name)

    def section(self, *keys: str) -> dict:
        """A copy of the named top-level sections (dotted keys reach one level down: 'export.opset')."""
        out = {}
        for key in keys:
            top, _, sub = key.partition(".")
            value = self.data.get(top)
            if sub:
                value = (value or {}).get(sub)
            out[key] = json.loads(json.dumps(value))
        return out

    def fingerprint(self, *keys: str) -> str:
        """Stable hash of the named sections: what a stage's up-to-date check depends on."""
        blob = json.dumps(self.section(*keys), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def _json_path(parts) -> str:
    path = "$"
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _describe(error: jsonschema.ValidationError) -> str:
    """One line a contributor can act on, for the most common schema failures."""
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        return f"unknown key(s) {extra}; allowed keys here: {allowed}"
    if error.validator == "required":
        return error.message.replace("is a required property", "is required here")
    if error.validator == "enum":
        return f"{error.instance!r} is not one of {error.validator_value}"
    if error.validator == "type":
        return f"expected {error.validator_value}, got {type(error.instance).__name__} {error.instance!r}"
    if error.validator in ("minimum", "maximum", "exclusiveMinimum"):
        return f"{error.instance!r} is out of range ({error.validator} {error.validator_value})"
    return error.message


def _schema_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    return jsonschema.Draft202012Validator(schema)


def _placeholders(value, parts=()):
    """JSON paths of every string that still holds the scaffold's placeholder."""
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in _placeholders(item, (*parts, key))]
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _placeholders(item, (*parts, i))]
    return [_json_path(parts)] if isinstance(value, str) and PLACEHOLDER in value else []


def _cross_field_checks(path: Path, data: dict) -> None:
    unfinished = _placeholders(data)
    if unfinished:
        also = f" (also at {', '.join(unfinished[1:])})" if unfinished[1:] else ""
        raise EntryError(path, unfinished[0], f"still {PLACEHOLDER}{also}; replace every {PLACEHOLDER} with the "
                         "real value (see CONTRIBUTING.md)")
    if data["id"] != path.stem:
        raise EntryError(path, "$.id", f"id {data['id']!r} must equal the file name {path.stem!r}")
    weights = data["weights"]
    if weights["sha256"] is None and "unpinned_reason" not in weights:
        raise EntryError(path, "$.weights.unpinned_reason",
                         "sha256 is null (unpinned): say why in 'unpinned_reason', or pin the sha256")
    names = [spec["name"] for spec in data["inputs"]]
    if len(set(names)) != len(names):
        raise EntryError(path, "$.inputs", f"input names must be unique, got {names}")
    for i, spec in enumerate(data["inputs"]):
        if len(spec["layout"]) != len(spec["shape"]):
            raise EntryError(path, f"$.inputs[{i}].layout",
                             f"layout {spec['layout']!r} names {len(spec['layout'])} axes but shape {spec['shape']} has {len(spec['shape'])}")
        pre = spec["preprocess"]
        wanted = "sentences" if pre["kind"] in SPEECH_FEATURES else "samples"
        if wanted not in data["validation"]:
            raise EntryError(path, "$.validation", f"{pre['kind']} input {spec['name']!r} is validated on {wanted!r}")
        if pre["kind"] in SPEECH_FEATURES:
            layout = SPEECH_FEATURES[pre["kind"]]
            mel_axis = layout.index("C")
            if spec["layout"] != layout or spec["shape"][mel_axis] != pre.get("n_mels", 80):
                raise EntryError(path, f"$.inputs[{i}]", f"{pre['kind']} features are laid out {layout} with n_mels channels "
                                 f"({pre.get('n_mels', 80)}), got layout {spec['layout']!r} and shape {spec['shape']}")
        if pre["kind"] == "image":
            if spec["layout"] != "NCHW":
                raise EntryError(path, f"$.inputs[{i}].layout", "image inputs are declared in torch's NCHW layout")
            channels = spec["shape"][1]
            for key in ("mean", "std"):
                if key in pre and len(pre[key]) != channels:
                    raise EntryError(path, f"$.inputs[{i}].preprocess.{key}",
                                     f"needs {channels} values (one per channel), got {len(pre[key])}")
    shapes = data["smoke"]["input_shapes"]
    if [len(s) for s in shapes] != [len(spec["shape"]) for spec in data["inputs"]]:
        raise EntryError(path, "$.smoke.input_shapes",
                         f"needs one shape per input with the input's rank: {[spec['shape'] for spec in data['inputs']]}, got {shapes}")
    for stage in VALIDATED_STAGES:
        if stage not in data["tolerances"]:
            raise EntryError(path, f"$.tolerances.{stage}",
                             f"the {stage} stage runs for every entry, so it needs a tolerance: {{\"atol\": ..., \"rtol\": ...}}")
    _decoding_checks(path, data)
    _quantization_checks(path, data)
    from tools import patches  # local import: the registry imports torch lazily, names only here

    for i, name in enumerate(data["export"].get("patches", [])):
        if name not in patches.REGISTRY:
            raise EntryError(path, f"$.export.patches[{i}]",
                             f"unknown export patch {name!r}; registered: {sorted(patches.REGISTRY)}")
    key_map = weights.get("key_map")
    if weights["format"] == "ctranslate2" and key_map is None:
        raise EntryError(path, "$.weights.key_map", "a ctranslate2 checkpoint needs a key map to the source's layout "
                         "(e.g. whisper_ctranslate2)")
    if key_map is not None:
        from tools import keymaps

        if key_map not in keymaps.REGISTRY:
            raise EntryError(path, "$.weights.key_map",
                             f"unknown key map {key_map!r}; registered: {sorted(keymaps.REGISTRY)}")


def _decoding_checks(path: Path, data: dict) -> None:
    """A speech entry's decoding: a split's decoder step (Whisper), or greedy CTC over one graph."""
    from tools.splits import REGISTRY

    if is_speech(data) != ("decoding" in data):
        raise EntryError(path, "$.decoding", "a speech entry declares how its output becomes words ($.decoding), "
                         "and only a speech entry does")
    if "split" not in data:
        if "decoding" in data:
            _ctc_checks(path, data)
        return
    if decoding_kind(data) != "whisper_greedy":
        raise EntryError(path, "$.decoding.kind", "a split entry decodes with its decoder step: whisper_greedy")
    split = REGISTRY[data["split"]["name"]]
    source = data["source"].get("class") or data["source"].get("model")
    if source not in split.applies_to:
        raise EntryError(path, "$.split.name", f"split {split.name!r} cuts {list(split.applies_to)}, not {source}")
    if split.name == "whisper_kv_cache" and "max_tokens" not in data["split"]:
        raise EntryError(path, "$.split.max_tokens", "the decoder step's static length is required, e.g. 64")
    decoding = data["decoding"]
    if len(decoding["prompt"]) >= data["split"].get("max_tokens", 448):
        raise EntryError(path, "$.decoding.prompt", "the prompt must leave room for tokens: shorten it or raise max_tokens")
    if decoding["tokenizer"]["sha256"] is None and "unpinned_reason" not in decoding["tokenizer"]:
        raise EntryError(path, "$.decoding.tokenizer.unpinned_reason", "sha256 is null: say why, or pin it")


def _ctc_checks(path: Path, data: dict) -> None:
    if decoding_kind(data) != "ctc_greedy":
        raise EntryError(path, "$.decoding.kind", "whisper_greedy needs the decoder step of a split: declare "
                         "$.split, or decode a CTC model with ctc_greedy")
    if any(spec["preprocess"]["kind"] != "nemo_mel" for spec in data["inputs"]) or len(data["inputs"]) != 1:
        raise EntryError(path, "$.inputs", "ctc_greedy decodes a model with one nemo_mel input")
    if data["decoding"]["vocabulary"] == "nemo_config" and data["weights"]["format"] != "nemo":
        raise EntryError(path, "$.decoding.vocabulary", "nemo_config reads the labels from a .nemo archive: "
                         "the weights' format must be 'nemo'")
    vocab_size = data["source"].get("config", {}).get("vocab_size")
    if vocab_size is not None and data["decoding"]["blank"] >= vocab_size:
        raise EntryError(path, "$.decoding.blank", f"blank id {data['decoding']['blank']} is outside the "
                         f"{vocab_size} labels of $.source.config.vocab_size")


CALIBRATION_FIELD = {"photos": "samples", "files": "glob", "npy": "path", "speech": "sentences"}
# Speech front ends (tools/logmel.py) and the layout of the features each makes.
SPEECH_FEATURES = {"log_mel": "NCT", "nemo_mel": "NTC"}


def is_speech(data: dict) -> bool:
    """Whether the entry hears speech: its inputs are features of spoken audio."""
    return any(spec["preprocess"]["kind"] in SPEECH_FEATURES for spec in data["inputs"])


def decoding_kind(data: dict) -> str | None:
    """How the entry's output becomes words: 'whisper_greedy', 'ctc_greedy', or None (not a speech entry)."""
    return data["decoding"].get("kind", "whisper_greedy") if "decoding" in data else None


def _quantization_checks(path: Path, data: dict) -> None:
    quant = data["quantization"]
    if not quant["enabled"]:
        return
    names = [v["name"] for v in quant["variants"]]
    if len(set(names)) != len(names):
        raise EntryError(path, "$.quantization.variants", f"variant names must be unique, got {names}")
    kind = quant["calibration"]["kind"]
    if CALIBRATION_FIELD[kind] not in quant["calibration"]:
        raise EntryError(path, f"$.quantization.calibration.{CALIBRATION_FIELD[kind]}",
                         f"calibration kind {kind!r} needs {CALIBRATION_FIELD[kind]!r}")
    if is_speech(data) != (kind == "speech"):
        raise EntryError(path, "$.quantization.calibration.kind",
                         "speech inputs calibrate on kind 'speech', image inputs on photos, files or npy")
    if kind == "npy" and len(data["inputs"]) != 1:
        raise EntryError(path, "$.quantization.calibration.kind", "kind 'npy' holds one array: it needs a model with a single input")
    from tools.splits import graphs_of

    graphs = graphs_of(data)
    for i, variant in enumerate(quant["variants"]):
        named = variant.get("graphs")
        if graphs and not named:
            raise EntryError(path, f"$.quantization.variants[{i}].graphs", f"say which graphs this variant quantizes, of {list(graphs)}")
        if named and not set(named) <= set(graphs):
            raise EntryError(path, f"$.quantization.variants[{i}].graphs",
                             f"{named} are not all graphs of this entry: " + (f"{list(graphs)}" if graphs else "it has one graph"))
    fidelity = quant["fidelity"]
    if "speech" in fidelity and "decoding" not in data:
        raise EntryError(path, "$.quantization.fidelity.speech", "transcript agreement needs a speech entry with $.decoding")
    for name in fidelity.get("outputs", {}) if not graphs else ():  # a split's graph outputs are the split's
        if name not in data["outputs"]:
            raise EntryError(path, f"$.quantization.fidelity.outputs.{name}",
                             f"no output {name!r}; the entry's outputs are {data['outputs']}")
    if "detection" in fidelity and (data["task"] != "object-detection" or len(data["outputs"]) < 2):
        raise EntryError(path, "$.quantization.fidelity.detection",
                         "detection agreement needs an object-detection entry whose outputs are [logits, boxes]")


def load_entry(path: Path | str) -> Entry:
    """Read and check one entry; raise EntryError on the first problem found."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise EntryError(path, "$", f"cannot read the file: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EntryError(path, "$", f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise EntryError(path, "$", "an entry is a JSON object")
    # Shallowest first, and an unknown key before the missing one it most likely misspells.
    errors = sorted(_schema_validator().iter_errors(data),
                    key=lambda e: (len(e.absolute_path), e.validator != "additionalProperties"))
    if errors:
        error = errors[0]
        raise EntryError(path, _json_path(error.absolute_path), _describe(error))
    _cross_field_checks(path, data)
    return Entry(path=path, data=data)


def discover(zoo_dir: Path | str = ZOO_DIR) -> tuple[list[Entry], list[EntryError]]:
    """All entries of a zoo folder: the good ones, and one error for each bad one."""
    good, bad = [], []
    for path in sorted(Path(zoo_dir).glob("*.json")):
        try:
            good.append(load_entry(path))
        except EntryError as exc:
            bad.append(exc)
    return good, bad
