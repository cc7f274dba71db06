"""An 8MP latency estimate for an int8 .tflite from its NPU placement: estimated, never measured.

The model (tools/data/imx8mp_cost_model.json, fitted by bench/fit_cost_model.py on NXP's published 8MP
latencies) prices dense (convolution, fully connected, matmul) and depthwise MACs, and the bytes every op reads
and writes, at fitted NPU rates plus a per-invoke overhead; ops that fall back to the CPU are priced at the
fitted 4-thread A53 rates, and so are ops that compute in float (mixed-precision graphs). It carries the
fit's leave-one-out error, which every estimate shows as its band. Partition boundaries cannot be fitted (the
published models are wholly delegated), so they are priced by a stated prior: one more invoke overhead per
extra partition and the crossing tensors copied at 4 GB/s. A graph larger than every fitted model says by how
much (`beyond_fit`): there the band is the fit's, the estimate an extrapolation. Not modelled: what elementwise
and data-movement ops cost beyond their bytes. The first inference (the NPU graph compile) is a published range, not a fit.
"""
from __future__ import annotations

import json
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "data" / "imx8mp_cost_model.json"
DENSE = ("CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL", "TRANSPOSE_CONV")
NOT_MODELLED = ("elementwise and data-movement ops beyond the bytes they move (the fitted models are convolution networks)",
                "the first inference (NPU graph compile) of each graph, given as a published range instead")
# No published figure prices a CPU<->NPU boundary: shared/reference/imx8mp_npu_facts.md section 8 suggests the
# crossing tensors' bytes at about 4 GB/s ("pure assumption"); each extra delegate kernel adds an invoke overhead.
BOUNDARY_BYTES_PER_MS = 4e6
# Float ops of an INT8 graph (mixed precision): the VX delegate takes float tensors, but its float path is slow, so
# they are priced at the A53 rates, as where a deployment keeps them; the NPU's float path would be slower still.
FLOAT_BASIS = ("ops computing in float32 are priced at the 4-thread A53 rates: the VX delegate accepts them, but "
               "its float path is slower than the CPU (Whisper-tiny float: 5.3x slower than 4 A53 threads, "
               "imx8mp_npu_facts.md section 2.3); no boundary cost is added for them")
# The one-time OpenVX graph compile at the first invoke: too few published figures to fit, so a range with its sources
# (shared/reference/imx8mp_npu_facts.md, section 2.4).
FIRST_INFERENCE = {
    "label": "estimated from published cases, not measured",
    "range_s": [1, 60],
    "published": ["FaceNet512 on an 8MP (L6.1.1): about 40 s before the first result (NXP nxp-nnstreamer-examples issue #1)",
                  "DeepViewRT on i.MX 8 through OpenVX: loading 'can take a minute or longer' without the cache"],
    "avoid_with": {"VIV_VX_ENABLE_CACHE_GRAPH_BINARY": "1", "VIV_VX_CACHE_BINARY_GRAPH_DIR": "a writable folder kept across runs"},
    "note": "paid once per graph and cache folder; later runs load the compiled graph. The lower end is not published: "
            "1 s is a floor for small graphs, not a figure",
}


def op_class(name: str) -> str | None:
    """'dense', 'depthwise', or None (priced only through the overhead): how the cost model sees an op."""
    return "depthwise" if name == "DEPTHWISE_CONV_2D" else "dense" if name in DENSE else None


def load_model(path: Path = MODEL) -> dict:
    return json.loads(path.read_text())


def _ms(coefficients: dict, work: dict, overhead: bool) -> float:
    """Milliseconds for `work` (dense and depthwise MACs, bytes) at one side's rates; a rate the chosen fit does
    not price (tools/data/imx8mp_cost_model.json, "candidate") costs nothing."""
    return ((coefficients["overhead_ms"] if overhead else 0.0) + work["dense"] / 1e6 * coefficients["ms_per_m_dense_macs"]
            + work["depthwise"] / 1e6 * coefficients["ms_per_m_depthwise_macs"]
            + work["bytes"] / 1e6 * coefficients.get("ms_per_mb", 0.0))


def _band(ms: float, fit: dict) -> dict:
    """The estimate and the range the true latency fell in for the fitted models: a leave-one-out prediction
    was (1 + e) times the published latency, e between the fit's most negative and most positive error."""
    errors = fit["loo_relative_errors"].values()
    return {"ms": round(ms, 2), "range_ms": [round(ms / (1 + max(errors)), 2), round(ms / (1 + min(errors)), 2)],
            "loo_median_abs": fit["loo_median_abs"], "loo_max_abs": fit["loo_max_abs"]}


def _boundaries(summary: dict, npu: dict) -> dict:
    """The prior cost of the graph's partition boundaries (tools.npu's summary): labelled, never fitted."""
    extra = max(summary["partitions"] - 1, 0)
    ms = extra * npu["overhead_ms"] + summary["crossing_bytes"] / BOUNDARY_BYTES_PER_MS
    return {"partitions": summary["partitions"], "crossing_tensors": summary["crossing_tensors"],
            "crossing_bytes": summary["crossing_bytes"], "ms": round(ms, 3),
            "basis": "prior, not fitted: one invoke overhead per extra partition, crossing tensors copied at 4 GB/s "
                     "(imx8mp_npu_facts.md section 8: no published figure)"}


def beyond_fit(work: dict, model: dict) -> dict:
    """How far the graph's totals (dense and depthwise MACs, bytes) exceed the largest fitted model's: the error
    band holds for graphs like the fitted ones, and a linear model applied far beyond them extrapolates."""
    column = {"dense": "dense_macs", "depthwise": "depthwise_macs", "bytes": "bytes"}
    out = {}
    for key, name in column.items():
        largest = max(r[name] for r in model["models"])
        if largest and work[key] > largest:
            out[name] = round(work[key] / largest, 1)
    return out


def estimate(report: dict, model: dict) -> dict:
    """NPU (with CPU fallbacks and partition boundaries) and CPU-only (4 threads) latency of one int8 graph, from
    tools.npu's report."""
    work = {where: {"dense": 0, "depthwise": 0, "bytes": 0} for where in ("NPU", "CPU")}
    float_on_npu = [op for op in report["ops"] if op["placement"] == "NPU" and op.get("float")]
    for op in report["ops"]:
        where = "CPU" if op.get("float") else op["placement"]
        kind = op_class(op["op"])
        if kind:
            work[where][kind] += op["macs"]
        work[where]["bytes"] += op["bytes"]
    npu, cpu = model["npu"]["coefficients"], model["cpu"]["coefficients"]
    boundaries = _boundaries(report["summary"], npu)
    with_delegate = _ms(npu, work["NPU"], True) + _ms(cpu, work["CPU"], False) + boundaries["ms"]
    cpu_only = _ms(cpu, {k: work["NPU"][k] + work["CPU"][k] for k in work["NPU"]}, True)
    return {"label": "estimated, not measured", "model": f"bench/fit_cost_model.py, fitted {model['fitted']} on "
                                                          f"{len(model['models'])} published int8 models; {model['source']}",
            "npu": _band(with_delegate, model["npu"]), "cpu_4_threads": _band(cpu_only, model["cpu"]),
            "cpu_fallback_macs": work["CPU"]["dense"] + work["CPU"]["depthwise"], "boundaries": boundaries,
            "float_ops": {"count": len(float_on_npu), "macs": sum(op["macs"] for op in float_on_npu), "basis": FLOAT_BASIS},
            "beyond_fit": beyond_fit({k: work["NPU"][k] + work["CPU"][k] for k in work["NPU"]}, model),
            "not_modelled": list(NOT_MODELLED),
            "first_inference": FIRST_INFERENCE}
