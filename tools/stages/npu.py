"""npu: where each .tflite of the build would run on an i.MX 8M Plus, by the VX delegate's rules (tools/npu.py).

For the newest delegate the rules know and for the lf-5.15 BSP (which lacks GELU, CAST, SHAPE, SCATTER_ND,
SQUARED_DIFFERENCE...): ops and MACs on the NPU, delegate partitions, tensors crossing NPU and CPU, and
every fallback with its reason. A static analysis of the file, not a measurement on a board.
"""
from __future__ import annotations

from pathlib import Path

from tools.entry import Entry
from tools.npu import analyse, load_rules
from tools.stages import variant_files


def npu(entry: Entry, build_dir: Path) -> dict:
    rules = load_rules()
    graphs = {}
    for name in ["model_fp32.tflite", *variant_files(entry)]:
        graphs[name] = {}
        for bsp in rules["bsps"]:
            report = analyse(build_dir / name, bsp, rules)
            graphs[name][bsp] = {k: report[k] for k in ("summary", "fallbacks")}
    return {"rules_source": rules["source"], "default_bsp": rules["default_bsp"], "graphs": graphs}
