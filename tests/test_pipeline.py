"""Tiny variants of both entries through the whole doit pipeline, and its incremental behaviour.

The tiny entries are the real ones shrunk by their smoke sections (the `built` fixture in conftest).
"""
from __future__ import annotations

import hashlib
import json
import os

import jsonschema
import pytest

from conftest import RANDOM, ROOT, DoitRun, tiny_entry_data, write_entry
STAGES = ("export", "simplify", "convert", "validate", "card")


def _tasks(entry_id, *stages):
    return {f"{s}:{entry_id}" for s in stages}


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_first_build_runs_every_stage_of_both_entries(built):
    _, _, first = built
    assert first.ran == _tasks("dn_tiny", *STAGES) | _tasks("dd_tiny", *STAGES)


@pytest.mark.parametrize("entry_id", ["dn_tiny", "dd_tiny"])
def test_build_writes_validated_graphs_and_a_card(built, entry_id):
    serial, _, _ = built
    out = serial.build / entry_id
    for name in ("model.onnx", "model_sim.onnx", "model_fp32.tflite", "validation.json", "card.json", "card.md"):
        assert (out / name).stat().st_size > 0, name
    assert not list(out.glob(".*.tmp*")), "no temporary files left behind"
    card = json.loads((out / "card.json").read_text())
    jsonschema.validate(card, json.loads((ROOT / "schema" / "card.schema.json").read_text()))
    assert card["validation"]["passed"] is True
    for stage in ("onnx", "onnx_simplified", "tflite_fp32"):
        for name, result in card["validation"]["stages"][stage]["outputs"].items():
            assert result["passed"] and result["max_abs"] < 1e-4, (stage, name, result)
    assert {a["path"]: a["sha256"] for a in card["artifacts"]}["model_fp32.tflite"] == _sha(out / "model_fp32.tflite")
    assert card["tools"]["onnx2tf"] == "1.29.24" and card["tools"]["torch"] == "2.14.1"
    ops = card["conversion"]["ops"]
    assert "CUSTOM" not in ops and not any(op.startswith("Flex") for op in ops)
    assert card["stages"]["convert"]["wall_s"] > 0 and card["stages"]["export"]["peak_rss_mib"] > 0


def test_weights_provenance_is_on_the_card(built):
    serial, _, _ = built
    trained = json.loads((serial.build / "dn_tiny" / "card.json").read_text())
    assert trained["weights"]["kind"] == "trained"
    assert trained["weights"]["sha256_loaded"] == trained["weights"]["sha256_declared"]
    assert not trained["warnings"]
    random = json.loads((serial.build / "dd_tiny" / "card.json").read_text())
    assert random["weights"]["kind"] == "random"
    assert "RANDOM WEIGHTS" in (serial.build / "dd_tiny" / "card.md").read_text()


def test_deformable_attention_is_a_gather_not_a_grid_sample_decomposition(built):
    serial, _, _ = built
    ops = json.loads((serial.build / "dd_tiny" / "card.json").read_text())["conversion"]["ops"]
    assert ops["GATHER"] >= 3  # at least one per deformable attention layer: 1 encoder + 2 decoder
    assert "GATHER_ND" not in ops and ops.get("CAST", 0) <= 4
    assert sum(ops.values()) < 500  # onnx2tf's grid_sample lowering alone made thousands of ops


def test_parallel_build_gives_the_serial_results(built):
    serial, parallel, _ = built
    for entry_id in ("dn_tiny", "dd_tiny"):
        a = json.loads((serial.build / entry_id / "card.json").read_text())
        b = json.loads((parallel.build / entry_id / "card.json").read_text())
        assert a["artifacts"] == b["artifacts"]
        assert a["validation"] == b["validation"]


def test_unchanged_inputs_rebuild_nothing(built):
    serial, _, _ = built
    again = serial("run", "build", env=RANDOM)
    assert again.ran == set()
    assert _tasks("dn_tiny", *STAGES) <= again.skipped


def _edit(run: DoitRun, entry_id, fn):
    path = run.zoo / f"{entry_id}.json"
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=2))


def test_changed_tolerance_reruns_only_validate_and_card(built):
    serial, _, _ = built
    _edit(serial, "dn_tiny", lambda d: d["tolerances"]["onnx"].__setitem__("atol", 5e-5))
    assert serial("run", "build", env=RANDOM).ran == _tasks("dn_tiny", "validate", "card")


def test_breached_tolerance_fails_the_build_with_the_numbers(built):
    serial, _, _ = built
    _edit(serial, "dn_tiny", lambda d: d["tolerances"].__setitem__("tflite_fp32", {"atol": 0, "rtol": 0}))
    failed = serial("run", "build:dn_tiny", env=RANDOM, check=False)
    assert failed.returncode != 0
    assert "validate: entry 'dn_tiny': tflite_fp32 output 'logits' on skimage:astronaut: max abs" in failed.stderr
    assert "beyond atol 0 + rtol 0 * |torch|" in failed.stderr
    assert "card:dn_tiny" not in failed.ran
    _edit(serial, "dn_tiny", lambda d: d["tolerances"].__setitem__("tflite_fp32", {"atol": 1e-4, "rtol": 1e-3}))
    assert serial("run", "build:dn_tiny", env=RANDOM).ran == _tasks("dn_tiny", "validate", "card")


def test_converter_upgrade_reruns_convert_and_after(built, tmp_path):
    serial, _, _ = built
    # A newer onnx2tf, as importlib.metadata sees it: a dist-info found first on the path.
    fake = tmp_path / "site" / "onnx2tf-9.9.9.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: onnx2tf\nVersion: 9.9.9\n")
    env = {**RANDOM, "PYTHONPATH": f"{fake.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    upgraded = serial("run", "build:dn_tiny", env=env)
    assert upgraded.ran == _tasks("dn_tiny", "convert", "validate", "card")
    card = json.loads((serial.build / "dn_tiny" / "card.json").read_text())
    assert card["tools"]["onnx2tf"] == "9.9.9"


def test_changed_input_size_reruns_everything(built):
    serial, _, _ = built
    _edit(serial, "dn_tiny", lambda d: d["inputs"][0].__setitem__("shape", [1, 3, 64, 96]))
    rebuilt = serial("run", "build:dn_tiny", env=RANDOM)
    assert rebuilt.ran == _tasks("dn_tiny", *STAGES)
    card = json.loads((serial.build / "dn_tiny" / "card.json").read_text())
    assert card["export"]["inputs"]["pixel_values"] == [1, 3, 64, 96]
    assert card["validation"]["passed"]


def test_missing_weights_stop_the_build_naming_the_opt_in(tmp_path):
    run = DoitRun(tmp_path)
    write_entry(run.zoo, tiny_entry_data("deformable_detr", "dd_tiny"))
    failed = run("run", "build", env={"HF_HUB_OFFLINE": "1", "ZOO_WEIGHTS": ""}, check=False)
    assert failed.returncode != 0
    assert ("error: export: entry 'dd_tiny': trained weights unavailable: hub file "
            "SenseTime/deformable-detr@83ecd26945199939cb82806f988debdb71e6f43e/model.safetensors") in failed.stderr
    assert "set ZOO_WEIGHTS=random" in failed.stderr and "Traceback" not in failed.stderr
    assert not (run.build / "dd_tiny" / "model.onnx").exists()
