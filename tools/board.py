"""Measure .tflite files on a board: copy them and tools/board_runner.py over ssh (Yocto) or adb (Android/AAOS),
run them with the VX delegate and on the CPU, and keep the board's answer as a record.

    ZOO_TARGET=ssh://root@imx8mp.local[:22] python -m tools.board build/conformer/model_int8_pc.tflite [...]
    ZOO_TARGET=adb://SERIAL python -m tools.board ... [--runs 50] [--threads 4] [-o board.json]

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

    def copy_commands(self, files: list[Path], folder: str) -> list[tuple[list[str], Path | None]]:
        """(command, file fed on its stdin) per file. Over ssh the file streams into `cat`: no scp or sftp server
        is needed on the board (Yocto images often run dropbear without one)."""
        if self.target.scheme == "ssh":
            return [(self.shell_command(f"cat > {shlex.quote(f'{folder}/{f.name}')}"), f) for f in files]
        return [(["adb", "-s", self.target.host, "push", str(f), f"{folder}/"], None) for f in files]

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

    def copy(self, files: list[Path], folder: str) -> None:
        for command, stdin in self.copy_commands(files, folder):
            self._run(command, f"copying {(stdin or Path(command[-2])).name}", stdin)


def measure(target: Target, models: list[Path], runs: int = 50, threads: int = 4) -> dict:
    """Run every model on the board (NPU and CPU); the record, with the board's identity and the files' sha256."""
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise BoardError(f"two files share a name ({names}); copy them from separate runs")
    transport = Transport(target)
    base = "/data/local/tmp" if target.scheme == "adb" else "/tmp"
    folder = transport.shell(f"mktemp -d {base}/zoo-board.XXXXXX", "making a work folder").strip()
    python = os.environ.get("ZOO_TARGET_PYTHON", "python3")
    try:
        transport.copy([RUNNER, *models], folder)
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
            "artifacts": {m.name: sha256_of(m) for m in models}, "results": answer["results"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.board", description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--target", default=os.environ.get("ZOO_TARGET"), help="ssh://user@host[:port] or adb://SERIAL (default: $ZOO_TARGET)")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("-o", "--output", type=Path, help="write the record here as JSON")
    args = parser.parse_args(argv)
    try:
        if not args.target:
            raise BoardError("no target: set ZOO_TARGET=ssh://user@host[:port] or adb://SERIAL, or pass --target")
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
