"""Run one build stage in its own process: `python -m tools.stage STAGE ENTRY.json BUILD_DIR [GRAPH]`.

GRAPH names one graph of a split entry; BUILD_DIR is then that graph's folder.

A process per stage gives each stage its own peak-memory figure and keeps torch, TensorFlow and ONNX
Runtime from sharing one address space. Known failures print one line naming the entry and the fix.
"""
from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path


def _peak_rss_mib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, children) / 1024, 1)


def main(argv: list[str]) -> int:
    from tools.atomic import write_json
    from tools.entry import EntryError, load_entry
    from tools.stages import STAGES, StageError
    from tools.versions import STAGE_TOOLS, tool_versions
    from tools.weights import WeightsUnavailable

    name, entry_path, build_dir, *graph = argv
    stage = STAGES[name]
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    # onnx2tf runs the onnxsim executable: it must come from this environment.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    start = time.perf_counter()
    try:
        entry = load_entry(entry_path)
        entry = entry.for_graph(graph[0]) if graph else entry
        record = stage.run(entry, build_dir)
    except (EntryError, WeightsUnavailable, StageError) as exc:
        print(f"error: {name}: {exc}", file=sys.stderr)
        return 1
    if record is None:  # the stage wrote its own record (card)
        return 0
    record = {"stage": name, "entry": entry.id, **({"graph": entry.graph} if entry.graph else {}), **record,
              "wall_s": round(time.perf_counter() - start, 2), "peak_rss_mib": _peak_rss_mib(),
              "tools": tool_versions(name) if name in STAGE_TOOLS else {},
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(build_dir / stage.makes[-1], record)
    if record.get("passed") is False and "known_failure" not in record:
        print(f"error: {name}: {record['failure']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
