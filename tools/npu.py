"""Which ops of a .tflite graph the i.MX 8M Plus NPU (VX delegate) takes, which fall back to the CPU, and why.

    python -m tools.npu model.tflite [--bsp lf-6.6|lf-5.15] [--json report.json]

The rules are data (tools/data/vx_delegate_rules.json, read from the delegate's op_map.cc, with their
source): the delegate's global rules, then each op's registration (yes / conditional / no) and, for a
conditional op, named checks implemented here. Per op: placement, the reasons for a fallback, MACs and
bytes moved. Per graph: ops and MACs on the NPU, the delegate partitions TFLite would form, and the
tensors that cross between NPU and CPU. A static analysis: conditions the source states but that cannot be
checked from the file are listed in the rules, not checked.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from tools.tflite_graph import Graph, Op, read_graph

RULES = Path(__file__).resolve().parent / "data" / "vx_delegate_rules.json"
EIGHT_BIT = ("INT8", "UINT8")


def load_rules(path: Path = RULES) -> dict:
    return json.loads(path.read_text())


def _tensors(graph: Graph, indices) -> list:
    return [graph.tensors[i] for i in indices if i >= 0]


def global_reasons(graph: Graph, op: Op) -> list[str]:
    """The delegate's rules for every node (OpMapperBase::IsSupported), as the rule names of the rules file."""
    inputs, outputs = _tensors(graph, op.inputs), _tensors(graph, op.outputs)
    reasons = []
    if op.name != "BROADCAST_TO" and any(t.type == "INT64" for t in inputs):
        reasons.append("int64_input")
    if any(t.type == "STRING" for t in inputs):
        reasons.append("string_input")
    if any(len(t.shape) > 6 for t in inputs):
        reasons.append("rank_above_6")
    if any(0 in t.shape for t in inputs + outputs):
        reasons.append("zero_dim")
    if any(d > 65535 for t in inputs for d in t.shape[1:]):
        reasons.append("dim_above_65535")
    if any(t.type == "INT16" for t in outputs):
        reasons.append("int16_output")
    if any(t.type == "INT64" for t in outputs):
        reasons.append("int64_output")
    if any(t.dynamic for t in inputs + outputs):
        reasons.append("dynamic_shape")
    return reasons


def _positions(argument: str) -> list[int]:
    return [int(x) for x in argument.split(",")] if argument else []


def check_fails(graph: Graph, op: Op, check: str) -> str | None:
    """A named op-specific condition of the rules file; the reason it rejects the op, or None."""
    name, _, argument = check.partition(":")
    ins = [graph.tensors[i] if i >= 0 else None for i in op.inputs]
    present = [t for t in ins if t is not None]
    outs = _tensors(graph, op.outputs)
    if name == "const_inputs":
        missing = [p for p in _positions(argument) if p < len(ins) and ins[p] is not None and not ins[p].constant]
        return f"input {missing[0]} must be constant" if missing else None
    if name == "static_output":
        return "output shape must be static" if any(t.dynamic or not t.shape for t in outs) else None
    if name == "same_type":
        a, b = (ins[p] for p in _positions(argument))
        return f"hybrid: {a.type} input with {b.type} weights" if a.type != b.type else None
    if name == "no_int16_input":
        return "INT16 input" if any(t.type == "INT16" for t in present) else None
    if name == "no_int32_int64_input":
        return "INT32/INT64 input" if any(t.type in ("INT32", "INT64") for t in present) else None
    if name == "quantized_8bit_input":
        return "8-bit input without quantization" if any(t.type in EIGHT_BIT and not t.scales for t in present) else None
    if name == "int16_in_8bit_out":
        return "INT16 input with 8-bit output" if ins[0].type == "INT16" and outs[0].type in EIGHT_BIT else None
    if name == "grouped_conv_batch_1":
        grouped = ins[0].shape[-1] != ins[1].shape[-1]
        return "grouped convolution with batch > 1" if grouped and ins[0].shape[0] != 1 else None
    if name == "dequantize_source":
        if ins[0].type in EIGHT_BIT and ins[0].scales > 1:
            return "per-channel 8-bit to float"
        return "affine INT16/FLOAT16 to float" if ins[0].type in ("INT16", "FLOAT16") and ins[0].scales else None
    if name == "quantize_source":
        if ins[0].type in ("INT32", "INT16") and outs[0].type in EIGHT_BIT:
            return f"{ins[0].type} to 8-bit"
        return "float to per-channel 8-bit" if outs[0].scales > 1 else None
    if name == "custom_vsi_npu":
        return f"custom op {op.name} (only vsi-npu is taken)" if op.name != "vsi-npu" else None
    if name == "strided_slice_masks":
        bad = [k for k in ("NewAxisMask", "EllipsisMask") if op.options.get(k)]
        return f"{bad[0]} must be 0" if bad else None
    if name == "slice_keeps_batch":
        return "slices the batch of a rank > 3 input" if len(ins[0].shape) > 3 and ins[0].shape[0] != outs[0].shape[0] else None
    if name == "rank4_input":
        return "input must be 4-D" if len(ins[0].shape) != 4 else None
    if name == "cast_types":
        bad = {t.type for t in present + outs} & {"COMPLEX64", "UINT32", "UINT16"}
        return f"{sorted(bad)[0]} tensor" if bad else None
    if name == "no_8bit_or_bool_data":
        data = present[1:] + outs
        return "8-bit or BOOL data (quantized SELECT runs on the CPU)" if any(t.type in (*EIGHT_BIT, "BOOL") for t in data) else None
    if name == "not_both_int32":
        return "both inputs INT32" if all(t.type == "INT32" for t in present[:2]) else None
    if name == "no_bool_output":
        return "BOOL output" if any(t.type == "BOOL" for t in outs) else None
    if name == "per_tensor_8bit_input":
        return "per-channel 8-bit input" if any(t.type in EIGHT_BIT and t.scales > 1 for t in present) else None
    if name == "batch_matmul_types":
        if outs[0].type == "INT32":
            return "INT32 output"
        if {present[0].type, present[1].type} == {"FLOAT32", "INT8"}:
            return "FLOAT32 x INT8 inputs"
        return "adj_x and adj_y both set" if op.options.get("AdjX") and op.options.get("AdjY") else None
    raise KeyError(f"the rules name a check {check!r} that tools/npu.py does not implement")


def macs(graph: Graph, op: Op) -> int:
    """Multiply-accumulates of the ops that do matrix arithmetic; 0 for the rest."""
    ins, outs = _tensors(graph, op.inputs), _tensors(graph, op.outputs)
    out_elems = 1
    for d in outs[0].shape if outs else ():
        out_elems *= d
    if op.name == "CONV_2D":  # weights O, H, W, I
        _, kh, kw, cin = ins[1].shape
        return out_elems * kh * kw * cin
    if op.name == "DEPTHWISE_CONV_2D":  # weights 1, H, W, C*m
        return out_elems * ins[1].shape[1] * ins[1].shape[2]
    if op.name == "FULLY_CONNECTED":  # weights O, I
        return out_elems * ins[1].shape[-1]
    if op.name == "BATCH_MATMUL":
        return out_elems * (ins[0].shape[-2] if op.options.get("AdjX") else ins[0].shape[-1])
    if op.name == "TRANSPOSE_CONV":  # output_shape, weights O, H, W, I, input
        data = ins[2]
        elems = 1
        for d in data.shape:
            elems *= d
        return elems * ins[1].shape[0] * ins[1].shape[1] * ins[1].shape[2]
    return 0


# The conversions at a float-I/O INT8 graph's edges: they read or write float, but compute nothing in it.
FLOAT_EDGE_OPS = ("QUANTIZE", "DEQUANTIZE")
# Ops that move no data: the VX delegate's ovxlib makes a RESHAPE's output a view of its input when the types
# match (VeriSilicon/TIM-VX, src/tim/vx/internal/src/ops/vsi_nn_op_reshape.c, op_optimize @08d6ec9a). The CPU
# side counts them alike, an assumption (TFLite's RESHAPE may copy). Counted, they were a third of a transformer's bytes.
VIEW_OPS = ("RESHAPE",)


def computes_in_float(graph: Graph, op: Op) -> bool:
    """Whether an op reads or writes a float32 activation, the conversions at the graph's edges excepted."""
    return op.name not in FLOAT_EDGE_OPS and any(t.type == "FLOAT32" and not t.constant
                                                 for t in _tensors(graph, op.inputs) + _tensors(graph, op.outputs))


def place(graph: Graph, rules: dict, bsp: str) -> list[dict]:
    """Placement and reasons of every op, in execution order."""
    lacks = set(rules["bsps"][bsp]["lacks"])
    placed = []
    for op in graph.ops:
        rule = rules["ops"].get(op.name if op.builtin else "CUSTOM", {"vx": "no"})
        reasons = [rules["global_rules"][r] for r in global_reasons(graph, op)]
        if rule["vx"] == "no":
            reasons.insert(0, f"{op.name} is not registered in the VX delegate")
        elif op.name in lacks:
            reasons.insert(0, f"{op.name} is not registered in the {bsp} delegate")
        elif rule["vx"] == "conditional":
            reasons += [r for r in (check_fails(graph, op, c) for c in rule["checks"]) if r]
        tensors = _tensors(graph, op.inputs) + _tensors(graph, op.outputs)
        placed.append({"index": op.index, "op": op.name, "output": graph.tensors[op.outputs[0]].name,
                       "placement": "CPU" if reasons else "NPU", "reasons": reasons,
                       "float": computes_in_float(graph, op),
                       "macs": macs(graph, op),
                       "bytes": 0 if op.name in VIEW_OPS else sum(t.bytes for t in tensors)})
    return placed


def partitions(graph: Graph, placed: list[dict]) -> list[tuple[str, list[int]]]:
    """Node subsets as TFLite forms them for a delegate: starting from the ready nodes, each subset takes every
    node of one placement whose inputs are ready, in execution order, as long as any is; then the other placement."""
    producer = {t: op.index for op in graph.ops for t in op.outputs}
    waiting = {op.index: {producer[t] for t in op.inputs if t >= 0 and t in producer} for op in graph.ops}
    kind = {p["index"]: p["placement"] for p in placed}
    done: set[int] = set()
    subsets: list[tuple[str, list[int]]] = []
    while len(done) < len(graph.ops):
        ready = [i for i in sorted(waiting) if i not in done and waiting[i] <= done]
        current, members = kind[ready[0]], []
        while True:
            more = [i for i in sorted(waiting) if i not in done and kind[i] == current and waiting[i] <= done]
            if not more:
                break
            for i in more:
                done.add(i)
                members.append(i)
        subsets.append((current, members))
    return subsets


def crossing_tensors(graph: Graph, placed: list[dict]) -> list[int]:
    """Activations made on one side (NPU or CPU) and read on the other (tensor indices): each is a copy and a sync."""
    kind = {p["index"]: p["placement"] for p in placed}
    producer = {t: op.index for op in graph.ops for t in op.outputs}
    return sorted({t for op in graph.ops for t in op.inputs
                   if t >= 0 and t in producer and kind[producer[t]] != kind[op.index]})


def analyse(path: Path, bsp: str | None = None, rules: dict | None = None) -> dict:
    rules = rules or load_rules()
    bsp = bsp or rules["default_bsp"]
    if bsp not in rules["bsps"]:
        raise ValueError(f"unknown BSP {bsp!r}; the rules know {sorted(rules['bsps'])}")
    graph = read_graph(path)
    placed = place(graph, rules, bsp)
    on_npu = [p for p in placed if p["placement"] == "NPU"]
    total_macs = sum(p["macs"] for p in placed)
    fallbacks: dict[str, dict] = {}
    for p in placed:
        if p["placement"] == "CPU":
            f = fallbacks.setdefault(p["op"], {"count": 0, "reasons": Counter()})
            f["count"] += 1
            f["reasons"].update(p["reasons"])
    subsets = partitions(graph, placed)
    crossing = crossing_tensors(graph, placed)
    return {
        "file": str(path), "bsp": bsp, "rules": {"source": rules["source"], "bsp_source": rules["bsps"][bsp]["source"]},
        "summary": {
            "ops": len(placed), "ops_npu": len(on_npu), "ops_npu_pct": round(100 * len(on_npu) / max(len(placed), 1), 1),
            "macs": total_macs, "macs_npu_pct": round(100 * sum(p["macs"] for p in on_npu) / total_macs, 1) if total_macs else None,
            "partitions": sum(1 for k, _ in subsets if k == "NPU"), "cpu_subsets": sum(1 for k, _ in subsets if k == "CPU"),
            "crossing_tensors": len(crossing), "crossing_bytes": sum(graph.tensors[t].bytes for t in crossing),
        },
        "fallbacks": {op: {"count": f["count"], "reasons": dict(f["reasons"])} for op, f in sorted(fallbacks.items())},
        "crossing": sorted(graph.tensors[t].name for t in crossing),
        "ops": placed,
    }


def render(report: dict) -> str:
    s = report["summary"]
    lines = [f"{report['file']} (VX delegate, {report['bsp']}):",
             f"  ops on the NPU: {s['ops_npu']} of {s['ops']} ({s['ops_npu_pct']}%); MACs on the NPU: "
             f"{s['macs_npu_pct']}% of {s['macs']:,}",
             f"  delegate partitions: {s['partitions']} (CPU subsets between them: {s['cpu_subsets']}); "
             f"tensors crossing NPU/CPU: {s['crossing_tensors']}"]
    if report["fallbacks"]:
        lines.append("  CPU fallbacks:")
        for op, f in report["fallbacks"].items():
            lines.append(f"    {op} x{f['count']}: " + "; ".join(f"{r} ({n})" for r, n in f["reasons"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.npu", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--bsp", help="delegate release whose rules apply (default: the newest known)")
    parser.add_argument("--json", type=Path, help="write the full per-op report here")
    args = parser.parse_args(argv)
    if not args.model.is_file():
        print(f"error: {args.model}: no such file", file=sys.stderr)
        return 1
    try:
        report = analyse(args.model, args.bsp)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
