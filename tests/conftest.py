"""Shared fixtures: tiny variants of the real zoo entries, and doit run in a temporary folder."""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
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


SSHD = shutil.which("sshd") or "/usr/sbin/sshd"  # a loopback SSH server stands in for a board


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """(ssh:// target, environment) of an OpenSSH server on loopback with its own keys, for tools.board."""
    if not os.path.exists(SSHD):
        pytest.skip("OpenSSH's sshd is not installed (scripts/setup.sh installs openssh-server)")
    home = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / key)], check=True)
    (home / "authorized_keys").write_text((home / "client_key.pub").read_text())
    port = free_port()
    (home / "sshd_config").write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {home / 'host_key'}", f"PidFile {home / 'sshd.pid'}",
        f"AuthorizedKeysFile {home / 'authorized_keys'}", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes", "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", ""]))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation folder
    server = subprocess.Popen([SSHD, "-D", "-e", "-f", str(home / "sshd_config")], stderr=subprocess.PIPE, text=True)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if server.poll() is not None:
                pytest.fail(f"sshd did not start: {server.stderr.read()}")
            time.sleep(0.1)
    env = {"ZOO_SSH_OPTIONS": f"-i {home / 'client_key'} -o UserKnownHostsFile={home / 'known_hosts'} "
                              "-o StrictHostKeyChecking=accept-new",
           "ZOO_TARGET_PYTHON": sys.executable}  # the 'board's' Python: this one, which has LiteRT
    yield f"ssh://{getpass.getuser()}@127.0.0.1:{port}", env
    server.terminate()
    server.wait(timeout=10)
