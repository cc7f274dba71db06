"""Every zoo entry is valid, and every kind of bad entry gets one clear error naming file, JSON path and fix."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT, write_entry
from tools.entry import EntryError, discover, load_entry
from tools.sources import _transformers_model_classes

ENTRIES = sorted((ROOT / "zoo").glob("*.json"))


def test_zoo_is_not_empty():
    assert {p.stem for p in ENTRIES} >= {"dn_detr", "deformable_detr", "whisper_tiny_en"}


@pytest.mark.parametrize("path", ENTRIES, ids=lambda p: p.stem)
def test_every_entry_validates(path):
    entry = load_entry(path)
    assert entry.id == path.stem
    assert entry.data["$schema"] == "../schema/entry.schema.json"
    if entry.data["source"]["kind"] == "transformers":
        assert entry.data["source"]["class"] in _transformers_model_classes()
    weights = entry.data["weights"]
    assert weights["sha256"] is not None or len(weights["unpinned_reason"]) > 10
    # Full size: what the cards and benchmarks use (NeMo features: a 10 s window, 100 frames a second).
    expected = {"image": [1, 3, 512, 512], "log_mel": [1, 80, 3000], "nemo_mel": [1, 1001, 80]}
    assert entry.data["inputs"][0]["shape"] == expected[entry.data["inputs"][0]["preprocess"]["kind"]]


def _good() -> dict:
    return json.loads((ROOT / "zoo" / "dn_detr.json").read_text())


def _error_for(tmp_path: Path, data, name="dn_detr") -> EntryError:
    path = tmp_path / f"{name}.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(EntryError) as info:
        load_entry(path)
    assert str(path) in str(info.value)
    return info.value


def _mutate(fn):
    data = _good()
    fn(data)
    return data


BAD = {
    "missing field": (lambda d: d.pop("tolerances"), "$", "'tolerances' is required"),
    "wrong type": (lambda d: d["export"].__setitem__("opset", "17"), "$.export.opset", "expected integer"),
    "typo key": (lambda d: d.__setitem__("tolerence", d.pop("tolerances")), "$", "unknown key(s) ['tolerence']"),
    "nested typo": (lambda d: d["tolerances"]["onnx"].__setitem__("atl", 1), "$.tolerances.onnx", "unknown key(s) ['atl']"),
    "unknown source kind": (lambda d: d["source"].__setitem__("kind", "pickle"), "$.source.kind", "'pickle' is not one of"),
    "negative dimension": (lambda d: d["inputs"][0]["shape"].__setitem__(2, -512), "$.inputs[0].shape[2]", "out of range"),
    "absurd dimension": (lambda d: d["inputs"][0]["shape"].__setitem__(3, 1_000_000), "$.inputs[0].shape[3]", "out of range"),
    "branch revision": (lambda d: d.__setitem__("weights", {"kind": "hub", "repo": "a/b", "revision": "main",
                                                             "file": "m.safetensors", "format": "safetensors",
                                                             "sha256": None, "unpinned_reason": "xxxxxxxxxxxx"}),
                        "$.weights.revision", "does not match"),
    "id differs from file name": (lambda d: d.__setitem__("id", "other_model"), "$.id", "must equal the file name"),
    "missing stage tolerance": (lambda d: d["tolerances"].pop("tflite_fp32"), "$.tolerances.tflite_fp32", "needs a tolerance"),
    "unknown patch": (lambda d: d["export"]["patches"].append("make_it_fast"), "$.export.patches[1]", "unknown export patch"),
    "unknown key map": (lambda d: d["weights"].__setitem__("key_map", "nope"), "$.weights.key_map", "unknown key map"),
    "unpinned without reason": (lambda d: d["weights"].pop("unpinned_reason"), "$.weights.unpinned_reason", "say why"),
    "mean per channel": (lambda d: d["inputs"][0]["preprocess"].__setitem__("mean", [0.5]), "$.inputs[0].preprocess.mean", "needs 3 values"),
    "smoke shape rank": (lambda d: d["smoke"].__setitem__("input_shapes", [[1, 3, 96]]), "$.smoke.input_shapes", "needs one shape per input"),
    "remote code": (lambda d: d["source"].__setitem__("trust_remote_code", True), "$.source", "unknown key(s) ['trust_remote_code']"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_entry_gets_one_clear_error(tmp_path, case):
    mutate, json_path, fragment = BAD[case]
    error = _error_for(tmp_path, _mutate(mutate))
    assert error.json_path == json_path
    assert fragment in error.message


def test_malformed_json_names_line_and_column(tmp_path):
    error = _error_for(tmp_path, '{"id": "dn_detr",\n  "title": }')
    assert error.json_path == "$"
    assert "line 2, column 12" in error.message


def test_bad_entry_is_skipped_by_doit_while_the_others_get_tasks(tmp_path, doit_run):
    good = _good()
    good["$schema"] = str(ROOT / "schema" / "entry.schema.json")
    write_entry(doit_run.zoo, good)
    bad = _mutate(lambda d: d.__setitem__("tolerence", {}))
    bad["id"] = "broken"
    write_entry(doit_run.zoo, bad)
    listing = doit_run("list", "--all")
    assert "build:dn_detr" in listing.stdout
    assert "broken" not in listing.stdout
    assert "broken.json: $: unknown key(s) ['tolerence']" in listing.stderr
    assert "Traceback" not in listing.stderr
    check = doit_run("run", "check", check=False)
    assert check.returncode != 0
    assert "1 valid entries, 1 invalid" in check.stdout


def test_discover_reports_each_bad_entry(tmp_path):
    (tmp_path / "a.json").write_text("not json")
    (tmp_path / "dn_detr.json").write_text(json.dumps(_good()))
    good, bad = discover(tmp_path)
    assert [e.id for e in good] == ["dn_detr"]
    assert len(bad) == 1 and bad[0].file.endswith("a.json")


def _speech() -> dict:
    return json.loads((ROOT / "zoo" / "whisper_tiny_en.json").read_text())


SPEECH_BAD = {
    "split on another class": (lambda d: d["source"].__setitem__("class", "WhisperForAudioClassification"), "$.split.name",
                               "cuts ['WhisperForConditionalGeneration']"),
    "speech validated on photos": (lambda d: d.__setitem__("validation", {"samples": ["skimage:astronaut"]}), "$.validation",
                                   "validated on 'sentences'"),
    "log-mel bands differ from the shape": (lambda d: d["inputs"][0]["preprocess"].__setitem__("n_mels", 128), "$.inputs[0]",
                                            "n_mels channels"),
    "no static decoder length": (lambda d: d["split"].pop("max_tokens"), "$.split.max_tokens", "static length"),
    "prompt fills the cache": (lambda d: d["decoding"].__setitem__("prompt", [50257] * 8) or d["split"].__setitem__("max_tokens", 8),
                               "$.decoding.prompt", "leave room"),
    "split without decoding": (lambda d: d.pop("decoding"), "$", "'decoding' is required"),
    "photos to calibrate speech": (lambda d: d.__setitem__("quantization", {
        "enabled": True, "variants": [{"name": "int8_pt", "weights": "per-tensor"}],
        "calibration": {"kind": "photos", "samples": ["skimage:rocket"], "count": 4, "seed": 0},
        "fidelity": {"min_sqnr_db": 10, "min_cosine": 0.9}}), "$.quantization.calibration.kind", "calibrate on kind 'speech'"),
}


@pytest.mark.parametrize("case", sorted(SPEECH_BAD))
def test_bad_speech_entry_gets_one_clear_error(tmp_path, case):
    mutate, json_path, fragment = SPEECH_BAD[case]
    data = _speech()
    mutate(data)
    error = _error_for(tmp_path, data, "whisper_tiny_en")
    assert error.json_path == json_path
    assert fragment in error.message


def _ctc() -> dict:
    return json.loads((ROOT / "zoo" / "conformer.json").read_text())


CTC_BAD = {
    "ctc entry with a split": (lambda d: d.__setitem__("split", {"name": "whisper_kv_cache", "max_tokens": 64}), "$.decoding.kind",
                               "decodes with its decoder step"),
    "labels from a file that is no .nemo": (lambda d: d["weights"].__setitem__("format", "safetensors"), "$.decoding.vocabulary",
                                            "must be 'nemo'"),
    "blank outside the labels": (lambda d: d["decoding"].__setitem__("blank", 129), "$.decoding.blank", "outside the 129 labels"),
    "whisper features into a ctc model": (lambda d: d["inputs"][0].update(
        shape=[1, 80, 3000], layout="NCT", preprocess={"kind": "log_mel", "n_mels": 80}), "$.inputs", "one nemo_mel input"),
    "nemo features laid out like whisper's": (lambda d: d["inputs"][0].update(layout="NCT"), "$.inputs[0]", "laid out NTC"),
    "speech without decoding": (lambda d: d.pop("decoding"), "$.decoding", "declares how its output becomes words"),
    "whisper decoding without a split": (lambda d: d.__setitem__("decoding", _speech()["decoding"]), "$.decoding.kind",
                                         "needs the decoder step of a split"),
    "unknown zoo family": (lambda d: d["source"].__setitem__("family", "lstm_ctc"), "$.source.family", "is not one of"),
    "zoo family under a transformers source": (lambda d: d["source"].__setitem__("kind", "transformers"), "$.source", ""),
}


@pytest.mark.parametrize("case", sorted(CTC_BAD))
def test_bad_ctc_entry_gets_one_clear_error(tmp_path, case):
    mutate, json_path, fragment = CTC_BAD[case]
    data = _ctc()
    mutate(data)
    error = _error_for(tmp_path, data, "conformer")
    assert error.json_path == json_path
    assert fragment in error.message


def test_zoo_family_setting_it_does_not_have_is_named(tmp_path):
    from tools.sources import build_module

    data = _ctc()
    data["source"]["config"]["hidden_dim"] = 176
    path = tmp_path / "conformer.json"
    path.write_text(json.dumps(data))
    with pytest.raises(EntryError) as error:
        build_module(load_entry(path))
    assert error.value.json_path == "$.source.config.hidden_dim" and "hidden_size" in error.value.message
