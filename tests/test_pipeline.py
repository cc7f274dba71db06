"""Tiny variants of both entries through the whole doit pipeline, and its incremental behaviour.

The tiny entries are the real ones shrunk by their smoke sections (the `built` fixture in conftest).
"""
from __future__ import annotations

import hashlib
import json
import os

import jsonschema
import pytest

from tools.tflite_graph import read_graph

from conftest import RANDOM, ROOT, DoitRun, tiny_entry_data, write_entry
STAGES = ("export", "simplify", "convert", "validate", "quantize", "fidelity", "npu", "bench", "card")


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


def test_deformable_attention_is_tent_sampled_not_a_grid_sample_decomposition(built):
    serial, _, _ = built
    conversion = json.loads((serial.build / "dd_tiny" / "card.json").read_text())["conversion"]
    ops = conversion["ops"]
    # The smoke build's 16x32 level is gathered (one GATHER per corner of the 2x2 block in each attention layer:
    # 1 encoder + 2 decoder), its smaller levels are dense matrix products.
    assert ops["GATHER"] == 3 * 4 and ops["BATCH_MATMUL"] >= 3 * 2
    # Tent sampling's clamped indices are provably >= 0: onnx2tf's negative-index fix-up (LESS, CAST, MUL, ADD)
    # went from before every gather whose indices are computed. (The first decoder layer samples where its
    # learned query embeddings point, image-independent: its indices fold to constants and had no fix-up.)
    fp32 = read_graph(serial.build / "dd_tiny" / "model_fp32.tflite")
    computed = [op for op in fp32.ops if op.name == "GATHER" and not fp32.tensors[op.inputs[1]].constant]
    assert len(computed) >= 2 * 4 and "LESS" not in ops
    assert conversion["tflite_rewrites"] == {"drop_nonnegative_gather_index_fixups": len(computed)}
    # Each dense level's weight map is one product per computed attention layer (3 dense levels here) that takes
    # the y tents transposed (adj_x): both tents are built as (rows, points, size), broadcast along their last
    # axis, which TFLite runs ~5x faster than along a middle one, and no TRANSPOSE op is written for them.
    producer = {t: op for op in fp32.ops for t in op.outputs}
    maps = [op for op in fp32.ops if op.name == "BATCH_MATMUL" and op.options.get("AdjX")]
    assert len(maps) == len(computed) // 4 * 3
    assert not [t for op in maps for t in op.inputs if t in producer and producer[t].name == "TRANSPOSE"]
    assert "GATHER_ND" not in ops and not {"TILE", "WHERE", "SELECT", "SELECT_V2", "RANGE"} & set(ops)
    assert sum(ops.values()) < 700  # onnx2tf's grid_sample lowering alone made thousands of ops
    graph = read_graph(serial.build / "dd_tiny" / "model_int8_pc.tflite")
    for op in graph.ops:
        if op.name == "GATHER":  # value rows picked by int32 indices made by int32 arithmetic, in the INT8 graph too
            assert graph.tensors[op.inputs[1]].type == "INT32"
    assert not graph.tensors_of_type("INT64")


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


def test_build_writes_int8_variants_a_fidelity_record_and_their_card(built):
    serial, _, _ = built
    build = serial.build / "dn_tiny"
    fidelity = json.loads((build / "fidelity.json").read_text())
    assert fidelity["passed"] and set(fidelity["variants"]) == {"int8_pt", "int8_pc"}
    for variant in fidelity["variants"].values():
        assert variant["outputs"]["logits"]["sqnr_db_min"] >= 15 and variant["detection"]["recall"] >= 0.8
        assert variant["layers"]["compared"] > 100
    card = json.loads((build / "card.json").read_text())
    assert card["fidelity"]["passed"] and card["quantization"]["calibration"]["count"] == 16
    assert {a["path"] for a in card["artifacts"]} >= {"model_int8_pt.tflite", "model_int8_pc.tflite"}
    assert "## INT8 (full-integer, int8 activations) against fp32 TFLite" in (build / "card.md").read_text()


def test_npu_report_covers_every_graph_and_reaches_the_card(built):
    serial, _, _ = built
    npu = json.loads((serial.build / "dd_tiny" / "npu.json").read_text())
    assert set(npu["graphs"]) == {"model_fp32.tflite", "model_int8_pt.tflite", "model_int8_pc.tflite"}
    newest = npu["graphs"]["model_int8_pt.tflite"]["lf-6.6"]["summary"]
    # Tent sampling keeps every op of deformable attention on the NPU (no TILE, WHERE, SELECT, COS).
    assert newest["ops_npu"] == newest["ops"] and newest["partitions"] == 1
    card = (serial.build / "dd_tiny" / "card.md").read_text()
    assert "## NPU placement (VX delegate rules, static analysis: not measured on a board)" in card


def test_known_int8_failure_is_measured_shown_and_does_not_stop_the_build(built):
    serial, _, _ = built
    fidelity = json.loads((serial.build / "dd_tiny" / "fidelity.json").read_text())
    card = (serial.build / "dd_tiny" / "card.md").read_text()
    assert "known_failure" in fidelity["thresholds"]
    assert ("Fidelity gate: **FAILED** (a known failure" in card) == (not fidelity["passed"])


def test_changed_calibration_reruns_only_the_int8_stages_and_card(built):
    serial, _, _ = built
    old = json.loads((serial.build / "dn_tiny" / "quantize.json").read_text())["calibration"]["sha256"]
    _edit(serial, "dn_tiny", lambda d: d["quantization"]["calibration"].__setitem__("seed", 7))
    assert serial("run", "build", env=RANDOM).ran == _tasks("dn_tiny", "quantize", "fidelity", "npu", "bench", "card")
    assert json.loads((serial.build / "dn_tiny" / "quantize.json").read_text())["calibration"]["sha256"] != old


def test_int8_below_the_gate_fails_the_build_with_the_numbers(built):
    serial, _, _ = built
    _edit(serial, "dn_tiny", lambda d: d["quantization"]["fidelity"].__setitem__("min_sqnr_db", 150))
    failed = serial("run", "build:dn_tiny", env=RANDOM, check=False)
    assert failed.returncode != 0 and failed.ran == _tasks("dn_tiny", "fidelity")
    assert "fidelity: entry 'dn_tiny': INT8 fidelity below the entry's thresholds: int8_pt output 'logits': SQNR" in failed.stderr
    assert "dB < 150 dB" in failed.stderr
    _edit(serial, "dn_tiny", lambda d: d["quantization"]["fidelity"].__setitem__("min_sqnr_db", 15))
    assert serial("run", "build:dn_tiny", env=RANDOM).ran == _tasks("dn_tiny", "fidelity", "card")


def test_calibration_that_overlaps_validation_is_refused(built):
    serial, _, _ = built
    original = json.loads((serial.zoo / "dn_tiny.json").read_text())["quantization"]["calibration"]["samples"]
    _edit(serial, "dn_tiny", lambda d: d["quantization"]["calibration"].__setitem__("samples", ["skimage:rocket", "skimage:astronaut"]))
    failed = serial("run", "build:dn_tiny", env=RANDOM, check=False)
    assert failed.returncode != 0
    assert ("quantize: entry 'dn_tiny': calibration data overlaps the validation data: "
            "calibration sample 1 (= validation sample skimage:astronaut)") in failed.stderr
    _edit(serial, "dn_tiny", lambda d: d["quantization"]["calibration"].__setitem__("samples", original))
    assert "quantize:dn_tiny" in serial("run", "build:dn_tiny", env=RANDOM).ran


def test_converter_upgrade_reruns_convert_and_after(built, tmp_path):
    serial, _, _ = built
    # A newer onnx2tf, as importlib.metadata sees it: a dist-info found first on the path.
    fake = tmp_path / "site" / "onnx2tf-9.9.9.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: onnx2tf\nVersion: 9.9.9\n")
    env = {**RANDOM, "PYTHONPATH": f"{fake.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    before = _sha(serial.build / "dn_tiny" / "model_fp32.tflite")
    upgraded = serial("run", "build:dn_tiny", env=env)
    # INT8 reruns only if the fp32 graph it starts from came out different.
    same = _sha(serial.build / "dn_tiny" / "model_fp32.tflite") == before
    int8 = () if same else ("quantize", "fidelity", "npu", "bench")
    assert upgraded.ran == _tasks("dn_tiny", "convert", "validate", *int8, "card")
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


def test_bench_times_every_runtime_and_sweeps_the_declared_sizes(built):
    serial, _, _ = built
    out = serial.build / "dn_tiny"
    bench = json.loads((out / "bench.json").read_text())
    data = json.loads((serial.zoo / "dn_tiny.json").read_text())
    assert set(bench["host_latency"]) == {"torch", "onnxruntime", "tflite_fp32", "tflite_int8_pt", "tflite_int8_pc"}
    assert all(r["median_ms"] > 0 and r["runs"] == data["bench"]["runs"] for r in bench["host_latency"].values())
    assert bench["host_latency"]["tflite_int8_pt"]["sha256"] == _sha(out / "model_int8_pt.tflite")
    built_size = data["inputs"][0]["shape"][-2:]
    sizes = [p["size"] for p in bench["sweep"]]
    assert sorted(map(tuple, sizes)) == sorted({tuple(s) for s in data["bench"]["input_sizes"]} | {tuple(built_size)})
    at_built = next(p for p in bench["sweep"] if p["built"])
    assert at_built["size"] == built_size and set(at_built["tflite"]) == {"tflite_fp32", "tflite_int8_pt", "tflite_int8_pc"}
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = json.loads((out / "card.json").read_text())
    assert card["host_latency"]["host_latency"]["torch"]["median_ms"] == bench["host_latency"]["torch"]["median_ms"]
    markdown = (out / "card.md").read_text()
    assert "## Host latency (measured" in markdown and "![host latency against input size](bench.png)" in markdown


def test_host_latency_pairs_each_round_of_both_entries(built):
    """bench/host_latency.py on two real builds: every graph of both timed in the same rounds, and the entry's
    ratio to the first is the median of the per-round ratios (a drifting host load cancels in each pair)."""
    import statistics

    from bench.host_latency import measure

    serial, _, _ = built
    builds = [serial.build / "dn_tiny", serial.build / "dd_tiny"]
    record = measure(builds, threads=1, runs=3, zoo=serial.zoo)
    assert record["order"] == "interleaved rounds"
    dn, dd = (record["entries"][str(b)] for b in builds)
    assert {"onnxruntime", "tflite_fp32", "tflite_int8_pt", "tflite_int8_pc"} <= set(dd)
    assert all(len(dd[g]["times_ms"]) == 3 and min(dd[g]["times_ms"]) > 0 for g in ("onnxruntime", "tflite_fp32"))
    rounds = record["tflite_ratio_to_first_rounds"][str(builds[1])]
    # (the record rounds times to 1 us and ratios to 1e-3; a tiny graph runs in about 1 ms)
    assert rounds == pytest.approx([a / b for a, b in zip(dd["tflite_fp32"]["times_ms"], dn["tflite_fp32"]["times_ms"])],
                                   rel=1e-2)
    assert record["tflite_ratio_to_first"][str(builds[1])] == pytest.approx(statistics.median(rounds), abs=2e-3)
    assert record["mac_ratio_to_first"][str(builds[1])] == round(dd["macs"] / dn["macs"], 3)
    # and the source models' count, from each build's own entry (tests/test_source_macs.py checks the counting)
    assert min(dn["source_macs"], dd["source_macs"]) > 0
    assert record["source_mac_ratio_to_first"][str(builds[1])] == round(dd["source_macs"] / dn["source_macs"], 3)


def test_changed_bench_sizes_rerun_only_bench_and_card(built):
    serial, _, _ = built
    _edit(serial, "dn_tiny", lambda d: d["bench"].__setitem__("input_sizes", [[64, 64]]))
    assert serial("run", "build:dn_tiny", env=RANDOM).ran == _tasks("dn_tiny", "bench", "card")
    built_size = json.loads((serial.zoo / "dn_tiny.json").read_text())["inputs"][0]["shape"][-2:]
    sweep = json.loads((serial.build / "dn_tiny" / "bench.json").read_text())["sweep"]
    assert [p["size"] for p in sweep] == sorted([[64, 64], built_size], key=lambda s: s[0] * s[1])
    smaller = next(p for p in sweep if not p["built"])  # exported again at 64x64: computes what torch computes
    assert smaller["onnx_max_abs_vs_torch"] < 1e-3 and "tflite" not in smaller and smaller["torch"]["median_ms"] > 0


def test_card_front_matter_is_a_hugging_face_header(built):
    import yaml

    serial, _, _ = built
    for entry_id, random in (("dn_tiny", False), ("dd_tiny", True)):
        markdown = (serial.build / entry_id / "card.md").read_text()
        assert markdown.startswith("---\n")
        header = yaml.safe_load(markdown.split("---\n")[1])
        data = json.loads((serial.zoo / f"{entry_id}.json").read_text())
        assert header["license"] == data["license"]["weights"].lower() and header["pipeline_tag"] == "object-detection"
        assert {"imx8mp", "tflite", "int8"} <= set(header["tags"]) and ("random-weights" in header["tags"]) == random
        assert header.get("base_model") == (data["weights"]["repo"] if data["weights"]["kind"] == "hub" else None)


def test_card_refuses_a_measurement_without_its_record(built):
    serial, _, _ = built
    schema = json.loads((ROOT / "schema" / "card.schema.json").read_text())
    card = json.loads((serial.build / "dn_tiny" / "card.json").read_text())
    jsonschema.validate(card, schema)
    estimate = next(iter(next(iter(card["npu"]["estimates"].values())).values()))
    for section, key in ((card["host_latency"], "finished"), (card["host_latency"], "tools"),
                         (estimate, "label"), (estimate, "first_inference")):
        value = section.pop(key)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(card, schema)
        section[key] = value
    card["host_latency"]["figure_typed_in"] = 12.5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(card, schema)


def test_bench_with_a_board_target_measures_there_and_the_card_shows_it(built, sshd, tmp_path):
    import shutil
    import subprocess
    import sys

    serial, _, _ = built
    url, ssh_env = sshd
    build = tmp_path / "dn_tiny"
    shutil.copytree(serial.build / "dn_tiny", build)
    entry = serial.zoo / "dn_tiny.json"

    def stage(name, **env):
        proc = subprocess.run([sys.executable, "-m", "tools.stage", name, str(entry), str(build)], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, **RANDOM, **ssh_env, **env})
        assert proc.returncode == 0, proc.stderr

    stage("bench", ZOO_TARGET=url)
    stage("card")
    assert json.loads((build / "bench.json").read_text())["board"] == "board.json"
    board = json.loads((build / "board.json").read_text())
    card = json.loads((build / "card.json").read_text())
    graphs = {a["path"] for a in card["artifacts"] if a["path"].endswith(".tflite")}
    assert set(card["board"]["results"]) == graphs and card["board"]["stale"] == [] and card["board"]["target"] == url
    cpu = card["board"]["results"]["model_fp32.tflite"]["cpu"]
    assert cpu["steady"]["runs"] == board["how"]["runs"] and cpu["first_ms"] > 0 and cpu["threads"] == 4
    markdown = (build / "card.md").read_text()
    # the loopback 'board' is this machine: its figures are never headed as the 8MP's
    assert f"## Measured on a board that is not an 8MP by its SoC id ({board['when']}, {url})" in markdown and "| model_int8_pt.tflite | cpu |" in markdown
    # a graph changed after the board timed it: its figures leave the card, named as stale
    with open(build / "model_int8_pt.tflite", "ab") as f:
        f.write(b"\0")
    stage("card")
    card = json.loads((build / "card.json").read_text())
    assert set(card["board"]["results"]) == graphs - {"model_int8_pt.tflite"} and card["board"]["stale"] == ["model_int8_pt.tflite"]
    assert "| model_int8_pt.tflite | cpu |" not in (build / "card.md").read_text()
    failed = subprocess.run([sys.executable, "-m", "tools.stage", "bench", str(entry), str(build)], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, **RANDOM, **ssh_env, "ZOO_TARGET": "ftp://board"})
    assert failed.returncode == 1 and "unset ZOO_TARGET" in failed.stderr and "Traceback" not in failed.stderr


def test_card_without_a_board_record_says_not_measured(built):
    serial, _, _ = built
    markdown = (serial.build / "dn_tiny" / "card.md").read_text()
    assert "## 8MP measured on a board\n\nNot measured" in markdown and "doit board:dn_tiny" in markdown
    assert "board" not in json.loads((serial.build / "dn_tiny" / "card.json").read_text())
