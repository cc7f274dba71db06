"""Shared fixtures: tiny variants of the real zoo entries, and doit run in a temporary folder."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A few layers, 20 queries, timm's 0.4 M-parameter test ResNet, 96x96 images: the same graph
# structure as the full entries at a size that converts in about half a minute.
TINY = {
    "dn_detr": {"hidden_size": 32, "encoder_layers": 1, "decoder_layers": 2, "encoder_ffn_dim": 64,
                "decoder_ffn_dim": 64, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                "num_queries": 20, "backbone": "test_resnet"},
    "deformable_detr": {"d_model": 32, "encoder_layers": 1, "decoder_layers": 2, "encoder_ffn_dim": 64,
                        "decoder_ffn_dim": 64, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                        "num_queries": 20, "backbone": "test_resnet"},
}
TINY_SHAPE = [1, 3, 96, 96]


def tiny_entry_data(base: str, new_id: str) -> dict:
    data = json.loads((ROOT / "zoo" / f"{base}.json").read_text())
    data["id"] = new_id
    data["$schema"] = str(ROOT / "schema" / "entry.schema.json")
    data["source"]["config"].update(TINY[base])
    data["inputs"][0]["shape"] = list(TINY_SHAPE)
    data["validation"]["samples"] = ["skimage:astronaut", "skimage:coffee"]
    return data


def write_entry(zoo: Path, data: dict) -> Path:
    zoo.mkdir(parents=True, exist_ok=True)
    path = zoo / f"{data['id']}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


class DoitRun:
    """doit on a zoo and build folder of the test's own, with its own state database."""

    def __init__(self, base: Path):
        self.zoo, self.build, self.db = base / "zoo", base / "build", base / "doit.db"

    def __call__(self, *args: str, env: dict | None = None, check: bool = True):
        full_env = {**os.environ, "ZOO_DIR": str(self.zoo), "ZOO_BUILD": str(self.build), **(env or {})}
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
