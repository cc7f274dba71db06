"""npu: where each .tflite of the build would run on an i.MX 8M Plus, by the VX delegate's rules (tools/npu.py).

For the newest delegate the rules know and for the lf-5.15 BSP (which lacks GELU, CAST, SHAPE, SCATTER_ND,
SQUARED_DIFFERENCE...): ops and MACs on the NPU, delegate partitions, tensors crossing NPU and CPU, and
every fallback with its reason. A static analysis of the file, not a measurement on a board. Each INT8 graph
also gets an 8MP latency estimate (tools/estimate.py: a cost model fitted on NXP's published latencies, with
its leave-one-out error); float graphs get none (the published figures it was fitted on are int8).
"""
from __future__ import annotations

from pathlib import Path

from tools.entry import Entry
from tools.estimate import estimate, load_model
from tools.npu import analyse, load_rules
from tools.stages import variant_files


def npu(entry: Entry, build_dir: Path) -> dict:
    rules, model = load_rules(), load_model()
    graphs, estimates = {}, {}
    for name in ["model_fp32.tflite", *variant_files(entry)]:
        graphs[name] = {}
        for bsp in rules["bsps"]:
            report = analyse(build_dir / name, bsp, rules)
            graphs[name][bsp] = {k: report[k] for k in ("summary", "fallbacks")}
            if name != "model_fp32.tflite":
                estimates.setdefault(name, {})[bsp] = estimate(report, model)
    return {"rules_source": rules["source"], "default_bsp": rules["default_bsp"], "graphs": graphs, "estimates": estimates}
