"""An 8MP latency estimate for an int8 .tflite from its NPU placement: estimated, never measured.

The model (tools/data/imx8mp_cost_model.json, fitted by bench/fit_cost_model.py on NXP's published 8MP
latencies) prices dense (convolution, fully connected, matmul) and depthwise MACs at a fitted NPU rate plus a
per-invoke overhead; ops that fall back to the CPU are priced at the fitted 4-thread A53 rates. It carries the
fit's leave-one-out error, which every estimate shows as its band. Not modelled: the cost of each partition
boundary, elementwise and data-movement ops beyond the fit's own average, and the first inference (the NPU
graph compile: seconds, up to minutes for large graphs, avoided on later runs by the driver's cache,
VIV_VX_ENABLE_CACHE_GRAPH_BINARY=1 with VIV_VX_CACHE_BINARY_GRAPH_DIR).
"""
from __future__ import annotations

import json
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "data" / "imx8mp_cost_model.json"
DENSE = ("CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL", "TRANSPOSE_CONV")
NOT_MODELLED = ("partition boundaries", "elementwise and data-movement ops beyond the fitted models' average",
                "first inference (NPU graph compile)")


def op_class(name: str) -> str | None:
    """'dense', 'depthwise', or None (priced only through the overhead): how the cost model sees an op."""
    return "depthwise" if name == "DEPTHWISE_CONV_2D" else "dense" if name in DENSE else None


def load_model(path: Path = MODEL) -> dict:
    return json.loads(path.read_text())


def _ms(coefficients: dict, dense: float, depthwise: float, overhead: bool) -> float:
    return ((coefficients["overhead_ms"] if overhead else 0.0) + dense / 1e6 * coefficients["ms_per_m_dense_macs"]
            + depthwise / 1e6 * coefficients["ms_per_m_depthwise_macs"])


def _band(ms: float, fit: dict) -> dict:
    """The estimate and the range the true latency fell in for the fitted models: a leave-one-out prediction
    was (1 + e) times the published latency, e between the fit's most negative and most positive error."""
    errors = fit["loo_relative_errors"].values()
    return {"ms": round(ms, 2), "range_ms": [round(ms / (1 + max(errors)), 2), round(ms / (1 + min(errors)), 2)],
            "loo_median_abs": fit["loo_median_abs"], "loo_max_abs": fit["loo_max_abs"]}


def estimate(placed: list[dict], model: dict) -> dict:
    """NPU (with CPU fallbacks) and CPU-only (4 threads) latency of one int8 graph, from tools.npu's placement."""
    macs = {(where, kind): 0 for where in ("NPU", "CPU") for kind in ("dense", "depthwise")}
    for op in placed:
        kind = op_class(op["op"])
        if kind:
            macs[op["placement"], kind] += op["macs"]
    npu, cpu = model["npu"]["coefficients"], model["cpu"]["coefficients"]
    with_delegate = (_ms(npu, macs["NPU", "dense"], macs["NPU", "depthwise"], True)
                     + _ms(cpu, macs["CPU", "dense"], macs["CPU", "depthwise"], False))
    cpu_only = _ms(cpu, macs["NPU", "dense"] + macs["CPU", "dense"], macs["NPU", "depthwise"] + macs["CPU", "depthwise"], True)
    return {"label": "estimated, not measured", "model": f"bench/fit_cost_model.py, fitted {model['fitted']} on "
                                                          f"{len(model['models'])} published int8 models; {model['source']}",
            "npu": _band(with_delegate, model["npu"]), "cpu_4_threads": _band(cpu_only, model["cpu"]),
            "cpu_fallback_macs": macs["CPU", "dense"] + macs["CPU", "depthwise"], "not_modelled": list(NOT_MODELLED)}
