"""Throughput of tools/fetch.py against plain curl, on the same file from the same loopback HTTPS server.

    python bench/fetch_throughput.py [--mib 256] [--repeats 3]

fetch.py does more than curl (sha256 of the whole file before the rename); this shows what that costs.
Runs alternate between the two so that both see the same machine state; prints MB/s and the ratio.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from https_mirror import HttpsMirror  # noqa: E402  (the loopback HTTPS server the tests use)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        served = tmp / "served" / "bench_model"
        served.mkdir(parents=True)
        data = os.urandom(args.mib << 20)
        (served / "model.bin").write_bytes(data)
        with HttpsMirror(served.parent, tmp) as mirror:
            url = f"{mirror.url}/bench_model/model.bin"
            index = tmp / "index.json"
            index.write_text(json.dumps({"index_version": 1, "entries": {"bench_model": {
                "default_variant": "x", "documents": [], "variants": {"x": {"files": [
                    {"name": "model.bin", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "urls": [url]}]}}}}}))
            commands = {
                "fetch.py": lambda out: [sys.executable, "-S", str(ROOT / "tools" / "fetch.py"), "bench_model",
                                         "--index", str(index), "-o", str(out), "--cafile", str(mirror.cafile)],
                "curl": lambda out: ["curl", "-sS", "--fail", "--cacert", str(mirror.cafile), "-o",
                                     str(out / "model.bin"), url],
            }
            seconds = {name: [] for name in commands}
            for i in range(args.repeats):
                for name, command in commands.items():
                    out = tmp / f"out-{name}-{i}"
                    out.mkdir()
                    start = time.perf_counter()
                    subprocess.run(command(out), check=True, capture_output=True)
                    seconds[name].append(time.perf_counter() - start)
    mb = len(data) / 1e6
    for name, values in seconds.items():
        print(f"{name:>9}: median {statistics.median(values):.2f} s for {mb:.0f} MB = {mb / statistics.median(values):.0f} MB/s "
              f"(runs: {', '.join(f'{v:.2f}' for v in values)})")
    ratio = statistics.median(seconds["fetch.py"]) / statistics.median(seconds["curl"])
    print(f"fetch.py / curl time: {ratio:.2f}x (fetch.py also verifies size and sha256 before the rename)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
