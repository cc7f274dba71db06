"""Shared fixtures: tiny variants of the real zoo entries, and doit run in a temporary folder."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.smoke import smoke_entry_data  # noqa: E402


def tiny_entry_data(base: str, new_id: str) -> dict:
    """The real entry shrunk by its own smoke section (a few layers, 96x96 images): builds in about a minute."""
    return smoke_entry_data(json.loads((ROOT / "zoo" / f"{base}.json").read_text()), new_id)


def write_entry(zoo: Path, data: dict) -> Path:
    zoo.mkdir(parents=True, exist_ok=True)
    path = zoo / f"{data['id']}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def zero_weights_of_op(model: bytes, op_index: int) -> bytes:
    """A copy of the .tflite with the constant weights (input 1) of one op set to zero, in place."""
    from tensorflow.lite.python import schema_py_generated as schema

    data = bytearray(model)
    root = schema.Model.GetRootAsModel(data, 0)
    graph = root.Subgraphs(0)
    weights = graph.Tensors(graph.Operators(op_index).Inputs(1))
    view = root.Buffers(weights.Buffer()).DataAsNumpy()  # a view into `data`
    view[:] = 0
    return bytes(data)


class DoitRun:
    """doit on a zoo and build folder of the test's own, with its own state database."""

    def __init__(self, base: Path, relative_build: bool = False):
        self.zoo, self.build, self.db = base / "zoo", base / "build", base / "doit.db"
        # As a user runs it: `build/` relative to the working folder (the repository root here).
        self.build_arg = os.path.relpath(self.build, ROOT) if relative_build else str(self.build)

    def __call__(self, *args: str, env: dict | None = None, check: bool = True):
        full_env = {**os.environ, "ZOO_DIR": str(self.zoo), "ZOO_BUILD": self.build_arg, **(env or {})}
        full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
        command, *rest = args
        proc = subprocess.run([sys.executable, "-m", "doit", command, "-f", str(ROOT / "dodo.py"),
                               "--db-file", str(self.db), *rest],
                              cwd=ROOT, env=full_env, capture_output=True, text=True)
        proc.ran = set(re.findall(r"^\.  (\S+)", proc.stdout, re.M))
        proc.skipped = set(re.findall(r"^-- (\S+)", proc.stdout, re.M))
        if check and proc.returncode != 0:
            raise AssertionError(f"doit {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return proc


@pytest.fixture
def doit_run(tmp_path):
    return DoitRun(tmp_path)


RANDOM = {"ZOO_WEIGHTS": "random", "HF_HUB_OFFLINE": "1"}


def _write_tiny_zoo(run: DoitRun, checkpoint):
    dn = tiny_entry_data("dn_detr", "dn_tiny")
    dn["weights"] = {"kind": "local", "path": str(checkpoint), "format": "safetensors",
                     "sha256": hashlib.sha256(checkpoint.read_bytes()).hexdigest()}
    write_entry(run.zoo, dn)
    write_entry(run.zoo, tiny_entry_data("deformable_detr", "dd_tiny"))


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The two tiny entries built serially, and once more from scratch with two doit processes.

    Tiny DN-DETR loads a checkpoint saved here (trained weights, as far as the build can tell); tiny
    Deformable DETR is built from random weights by opt-in. The parallel run names its build folder relative to
    the repository root, as a user does. Tests may change the serial build, never the parallel one.
    """
    import torch

    from tools.entry import load_entry
    from tools.sources import build_module

    base = tmp_path_factory.mktemp("pipeline")
    data = tiny_entry_data("dn_detr", "dn_tiny")
    module = build_module(load_entry(write_entry(base / "src", data)))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    module.save_pretrained(base / "ckpt")
    checkpoint = base / "ckpt" / "model.safetensors"
    serial, parallel = DoitRun(base / "serial"), DoitRun(base / "parallel", relative_build=True)
    for run in (serial, parallel):
        _write_tiny_zoo(run, checkpoint)
    first = serial("run", "build", env=RANDOM)
    parallel("run", "-n", "2", "build", env=RANDOM)
    return serial, parallel, first
