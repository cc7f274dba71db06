"""Measure .tflite files on a board: copy them and tools/board_runner.py over ssh (Yocto) or adb (Android/AAOS),
run them with the VX delegate and on the CPU, and keep the board's answer as a record.

    ZOO_TARGET=ssh://root@imx8mp.local[:22] python -m tools.board build/conformer/model_int8_pc.tflite [...]
    ZOO_TARGET=adb://SERIAL python -m tools.board ... [--runs 50] [--threads 4] [-o board.json]
    ZOO_TARGET=... doit board:<id>        # every .tflite of build/<id>/ into build/<id>/board.json

ssh runs in batch mode (keys, never a password prompt); extra options (an identity file, a known-hosts file)
come from ZOO_SSH_OPTIONS, e.g. "-i ~/.ssh/board -o UserKnownHostsFile=~/.ssh/board_hosts". The board's
Python is `python3` unless ZOO_TARGET_PYTHON names another. Files go to a fresh folder under /tmp (adb:
/data/local/tmp), removed afterwards. The record says what was measured, where (the board's identity),
when, how (runner, threads, runs, delegate, graph cache) and the sha256 of every file, as measured: never
mixed with host figures or estimates.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from tools.atomic import write_json
from tools.weights import sha256_of

RUNNER = Path(__file__).with_name("board_runner.py")


class BoardError(RuntimeError):
    pass


@dataclass(frozen=True)
class Target:
    scheme: str  # ssh or adb
    host: str    # ssh: host name; adb: device serial
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, url: str) -> "Target":
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme == "ssh" and parsed.hostname:
            return cls("ssh", parsed.hostname, parsed.username, parsed.port)
        if parsed.scheme == "adb" and parsed.netloc:
            return cls("adb", parsed.netloc)
        raise BoardError(f"ZOO_TARGET {url!r}: expected ssh://user@host[:port] or adb://SERIAL")

    def __str__(self) -> str:
        if self.scheme == "adb":
            return f"adb://{self.host}"
        return f"ssh://{self.user + '@' if self.user else ''}{self.host}{':' + str(self.port) if self.port else ''}"


class Transport:
    """Commands that run a shell command on the board and copy files to it."""

    def __init__(self, target: Target):
        self.target = target
        if target.scheme == "ssh":
            options = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=15", *shlex.split(os.environ.get("ZOO_SSH_OPTIONS", ""))]
            login = f"{target.user}@{target.host}" if target.user else target.host
            self._shell = ["ssh", *options, *(["-p", str(target.port)] if target.port else []), login]
        else:
            self._shell = ["adb", "-s", target.host, "shell"]

    def shell_command(self, command: str) -> list[str]:
        return [*self._shell, command]

    def copy_command(self, file: Path, remote: str) -> tuple[list[str], Path | None]:
        """The command that puts `file` at `remote` on the board, and the file it reads on stdin. Over ssh the file
        streams into `cat`: no scp or sftp server is needed on the board (Yocto images often run dropbear)."""
        if self.target.scheme == "ssh":
            return self.shell_command(f"cat > {shlex.quote(remote)}"), file
        return ["adb", "-s", self.target.host, "push", str(file), remote], None

    def _run(self, command: list[str], what: str, stdin: Path | None = None) -> str:
        try:
            with open(stdin, "rb") if stdin else open(os.devnull, "rb") as feed:
                proc = subprocess.run(command, stdin=feed, capture_output=True, timeout=3600)
        except FileNotFoundError:
            raise BoardError(f"{command[0]} is not installed on this machine (needed for {self.target.scheme}:// targets)") from None
        except subprocess.TimeoutExpired:
            raise BoardError(f"{what} on {self.target} took over an hour") from None
        out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
        if proc.returncode != 0:
            last = (err.strip() or out.strip()).splitlines()[-1:] or ["no output"]
            raise BoardError(f"{what} on {self.target} failed (exit {proc.returncode}): {last[0]}")
        return out

    def shell(self, command: str, what: str) -> str:
        return self._run(self.shell_command(command), what)

    def copy(self, file: Path, remote: str) -> None:
        command, stdin = self.copy_command(file, remote)
        self._run(command, f"copying {file.name}", stdin)


def remote_names(models: list[Path]) -> list[str]:
    """One file name per model on the board: its own, or with its folder's name in front where two share one
    (a split entry's graphs: encoder__model_fp32.tflite)."""
    names = [m.name for m in models]
    named = [f"{m.parent.name}__{m.name}" if names.count(m.name) > 1 else m.name for m in models]
    if len(set(named)) != len(named):
        raise BoardError(f"files share a name and a folder name ({named}); measure them in separate runs")
    return named


def build_models(build: Path) -> list[Path]:
    """Every .tflite of a build folder, a split entry's graphs' folders included."""
    return sorted(build.glob("*.tflite")) + sorted(build.glob("*/*.tflite"))


def measure(target: Target, models: list[Path], runs: int = 50, threads: int = 4) -> dict:
    """Run every model on the board (NPU and CPU); the record, with the board's identity and the files' sha256."""
    names = remote_names(models)
    transport = Transport(target)
    base = "/data/local/tmp" if target.scheme == "adb" else "/tmp"
    folder = transport.shell(f"mktemp -d {base}/zoo-board.XXXXXX", "making a work folder").strip()
    python = os.environ.get("ZOO_TARGET_PYTHON", "python3")
    try:
        for file, name in [(RUNNER, RUNNER.name), *zip(models, names)]:
            transport.copy(file, f"{folder}/{name}")
        command = (f"cd {shlex.quote(folder)} && {shlex.quote(python)} board_runner.py "
                   + " ".join(shlex.quote(n) for n in names) + f" --runs {runs} --threads {threads}")
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        output = transport.shell(command, "running the models")
    finally:
        transport.shell(f"rm -rf {shlex.quote(folder)}", "removing the work folder")
    try:
        answer = json.loads(output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BoardError(f"the board's runner printed no JSON record: {output.strip()[-300:]!r}") from None
    return {"what": "latency measured on the board", "kind": "measured", "target": str(target), "when": started,
            "where": answer["identity"], "how": {"runs": runs, "threads": threads, "delegate_path": answer["delegate_path"],
                                                 "delegate_present": answer["delegate_present"], "python": python},
            "artifacts": {name: sha256_of(m) for name, m in zip(names, models)}, "results": answer["results"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.board", description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--build", type=Path, help="a build folder: every .tflite in it (and in its graphs' folders)")
    parser.add_argument("--target", default=os.environ.get("ZOO_TARGET"), help="ssh://user@host[:port] or adb://SERIAL (default: $ZOO_TARGET)")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("-o", "--output", type=Path, help="write the record here as JSON")
    args = parser.parse_args(argv)
    try:
        if not args.target:
            raise BoardError("no target: set ZOO_TARGET=ssh://user@host[:port] or adb://SERIAL, or pass --target")
        if args.build:
            args.models += build_models(args.build)
        if not args.models:
            raise BoardError(f"no .tflite files to measure{f' in {args.build}: build the entry first' if args.build else ''}")
        missing = [str(m) for m in args.models if not m.is_file()]
        if missing:
            raise BoardError(f"no such model file: {', '.join(missing)}")
        record = measure(Target.parse(args.target), args.models, args.runs, args.threads)
    except BoardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.output:
        write_json(args.output, record)
    for name, placements in record["results"].items():
        for placement, r in placements.items():
            figures = r.get("error") or (f"init {r['init_ms']:.1f} ms, first {r['first_ms']:.1f} ms, steady mean "
                                         f"{r['steady']['mean_ms']:.2f} ms (p50 {r['steady'].get('p50_ms')}, std {r['steady']['std_ms']}) "
                                         f"over {r['steady']['runs']} runs, {r['runner']}")
            print(f"{name} [{placement}] {figures}")
    print(f"board: {record['where'].get('soc_id') or 'unknown SoC'}, {record['where'].get('os')}, kernel {record['where']['kernel']}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
