"""tools/board.py against a real SSH server on loopback (OpenSSH's sshd, started here with its own keys): the
runner is copied over, runs the model on this machine's LiteRT (no VX delegate here: CPU only), and its record
comes back. The adb path shares the runner; without a device its command lines and errors are checked.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, free_port
from tools import board
from tools.board_runner import parse_benchmark_model


@pytest.fixture(scope="module")
def tiny_tflite(tmp_path_factory):
    """A real .tflite: two dense layers, converted by TensorFlow here."""
    import tensorflow as tf

    weights = tf.random.stateless_normal((64, 64), seed=(1, 2))

    @tf.function(input_signature=[tf.TensorSpec((1, 64), tf.float32)])
    def model(x):
        return tf.nn.relu(x @ weights) @ weights

    path = tmp_path_factory.mktemp("tflite") / "tiny.tflite"
    path.write_bytes(tf.lite.TFLiteConverter.from_concrete_functions([model.get_concrete_function()], model).convert())
    return path


def test_model_runs_on_the_ssh_target_and_its_record_comes_back(sshd, tiny_tflite, tmp_path, monkeypatch):
    url, env = sshd
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = set(glob.glob("/tmp/zoo-board.*"))
    out = tmp_path / "board.json"
    assert board.main([str(tiny_tflite), "--target", url, "--runs", "7", "--threads", "2", "-o", str(out)]) == 0
    import json

    record = json.loads(out.read_text())
    assert record["kind"] == "measured" and record["target"] == url
    assert record["where"]["kernel"] == os.uname().release and record["where"]["runtimes"]
    assert record["artifacts"] == {"tiny.tflite": board.sha256_of(tiny_tflite)}
    placements = record["results"]["tiny.tflite"]
    assert set(placements) == {"cpu"}, "no VX delegate on this machine: the CPU only"
    cpu = placements["cpu"]
    assert cpu["runner"] in ("tflite_runtime", "ai_edge_litert") and cpu["threads"] == 2 and cpu["delegate"] is None
    assert cpu["steady"]["runs"] == 7 and 0 < cpu["steady"]["min_ms"] <= cpu["steady"]["p50_ms"] <= cpu["steady"]["p90_ms"]
    assert cpu["init_ms"] > 0 and cpu["first_ms"] > 0
    assert set(glob.glob("/tmp/zoo-board.*")) == before, "the work folder on the board is removed"


def test_a_build_folder_is_measured_with_each_graph_under_its_own_name(sshd, tiny_tflite, tmp_path, monkeypatch):
    import json
    import shutil

    url, env = sshd
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    build = tmp_path / "split_build"
    for graph in ("encoder", "decoder_step"):  # a split entry: the same file name in each graph's folder
        (build / graph).mkdir(parents=True)
        shutil.copy(tiny_tflite, build / graph / "model_fp32.tflite")
    assert board.main(["--build", str(build), "--target", url, "--runs", "2", "-o", str(build / "board.json")]) == 0
    record = json.loads((build / "board.json").read_text())
    assert set(record["results"]) == set(record["artifacts"]) == {"decoder_step__model_fp32.tflite", "encoder__model_fp32.tflite"}
    assert board.main(["--build", str(tmp_path / "nothing_built"), "--target", url]) == 1


def test_unreachable_board_and_bad_targets_are_one_line_errors(sshd, tiny_tflite, monkeypatch, capsys):
    url, env = sshd
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    wrong_port = url.rsplit(":", 1)[0] + f":{free_port()}"
    assert board.main([str(tiny_tflite), "--target", wrong_port, "--runs", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: making a work folder on ssh://") and "exit 255" in err and "Traceback" not in err
    assert board.main([str(tiny_tflite), "--target", "scp://board"]) == 1
    assert "expected ssh://user@host[:port] or adb://SERIAL" in capsys.readouterr().err
    monkeypatch.delenv("ZOO_TARGET", raising=False)
    assert board.main([str(tiny_tflite)]) == 1
    assert "no target: set ZOO_TARGET" in capsys.readouterr().err


def test_adb_target_pushes_and_runs_through_adb_shell(tiny_tflite, monkeypatch, capsys):
    target = board.Target.parse("adb://8MP0001")
    transport = board.Transport(target)
    assert transport.shell_command("uname -a") == ["adb", "-s", "8MP0001", "shell", "uname -a"]
    assert transport.copy_command(tiny_tflite, "/data/local/tmp/x/tiny.tflite") == (
        ["adb", "-s", "8MP0001", "push", str(tiny_tflite), "/data/local/tmp/x/tiny.tflite"], None)
    monkeypatch.setenv("PATH", "/nonexistent")  # no adb on this machine: a clear error, not a traceback
    assert board.main([str(tiny_tflite), "--target", "adb://8MP0001"]) == 1
    assert "adb is not installed on this machine" in capsys.readouterr().err


def test_runner_reads_benchmark_model_output():
    # The lines benchmark_model prints (tensorflow/lite/tools/benchmark, as the facts file quotes them).
    output = """INFO: Initialized session in 11.237ms.
INFO: count=1 first=1854321 curr=1854321 min=1854321 max=1854321 avg=1.85432e+06 std=0
INFO: count=50 first=10412 curr=10230 min=10105 max=11020 avg=10321.5 std=180 p5=10150 median=10300 p95=10700
INFO: Inference timings in us: Init: 11237, First inference: 1854321, Warmup (avg): 1.85432e+06, Inference (avg): 10321.5
"""
    parsed = parse_benchmark_model(output)
    assert parsed["init_ms"] == 11.237 and parsed["first_ms"] == 1854.321
    assert parsed["steady"] == {"runs": 50, "mean_ms": 10.322, "std_ms": 0.18, "min_ms": 10.105, "p50_ms": 10.3, "p95_ms": 10.7}
    with pytest.raises(ValueError):
        parse_benchmark_model("ERROR: Failed to verify graph")


def test_runner_runs_alone_on_the_board_side(tiny_tflite):
    """board_runner.py is copied as one file: it imports nothing from this repository."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "board_runner.py"), str(tiny_tflite), "--runs", "3"],
                          cwd=tiny_tflite.parent, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert '"cpu"' in proc.stdout and '"runs": 3' in proc.stdout


@pytest.mark.parametrize("where, heading", [
    ({"soc_id": "i.MX8MP", "soc_machine": "NXP i.MX8MPlus EVK board", "os": "Yocto", "kernel": "6.6.23"}, "## 8MP measured on a board"),
    ({"soc_id": None, "soc_machine": None, "os": "Debian", "kernel": "6.1"}, "## Measured on a board that is not an 8MP by its SoC id"),
    ({"soc_id": "i.MX8MM", "soc_machine": "NXP i.MX8MM EVK board", "os": "Yocto", "kernel": "6.6.23"}, "## Measured on a board that is not an 8MP by its SoC id"),
])
def test_card_heads_board_figures_as_the_8mps_only_on_an_8mp(where, heading):
    from tools.stages.card import _board_markdown

    steady = {"mean_ms": 5.0, "p50_ms": 4.9, "p90_ms": 5.5, "std_ms": 0.2, "runs": 50}
    board = {"when": "2026-12-04T00:00:00Z", "target": "ssh://root@board", "where": where, "stale": [],
             "how": {"delegate_present": True, "delegate_path": "/usr/lib/libvx_delegate.so"},
             "results": {"model_int8_pc.tflite": {"npu": {"runner": "benchmark_model", "threads": 4, "init_ms": 30.0,
                                                          "first_ms": 4000.0, "steady": steady, "graph_cache": None}}}}
    lines = _board_markdown({"id": "x", "board": board})
    assert lines[1].startswith(heading + " (2026-12-04T00:00:00Z")
    assert "| model_int8_pc.tflite | npu | benchmark_model | 4 | 30.0 | 4000.0 | 5.0 |" in "\n".join(lines)
