"""Host latency of built graphs, side by side in one run: ONNX Runtime vs TFLite fp32 vs each TFLite INT8
variant (LiteRT, XNNPACK), per entry.

    python bench/host_latency.py build/dn_detr build/deformable_detr [--zoo zoo] [--threads 2] [--runs 10] [--json out.json]

Feeds the first validation input of each build (a real photograph), one warm-up run per graph, then `runs`
rounds that each run every graph once (interleaved, so that the host's drifting load slows all of them alike).
Prints median and mean per graph, the TFLite/ONNX Runtime and INT8/fp32 ratios per entry and, for two or more
entries, each entry's TFLite latency relative to the first (the median of the per-round ratios) beside the
ratio of their MAC counts. Two counts: the graph's (its convolutions and matrix products, as the TFLite file
has them) and, with --zoo, the source model's (one forward of the entry's PyTorch model as declared, no export
patch, in torch). The source count is the ideal, latency that follows the model's arithmetic: a lowering can
add products of its own (tent sampling's dense levels are about 3.2 G of Deformable DETR's 54.4 G graph MACs
at 512x512), and counting those would raise the bar with the work the lowering chose. Writes the figures as a
JSON record with the host, the tool versions and the sha256 of every graph it timed.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.stages.validate import load_reference, onnx_runner, tflite_runner  # noqa: E402
from tools.weights import sha256_of  # noqa: E402

RUNTIMES = (("onnxruntime", "model_sim.onnx", onnx_runner), ("tflite_fp32", "model_fp32.tflite", tflite_runner))


def graphs(build: Path) -> list[tuple]:
    """ONNX Runtime, TFLite fp32, and every INT8 variant the build's quantize record lists."""
    record = build / "quantize.json"
    int8 = json.loads(record.read_text())["variants"] if record.exists() else {}
    return [*RUNTIMES, *((f"tflite_{name}", v["file"], tflite_runner) for name, v in int8.items())]


def graph_macs(path: Path) -> int:
    """Multiply-accumulates of the graph's convolutions and matrix products (tools.npu counts them per op)."""
    from tools.npu import macs
    from tools.tflite_graph import read_graph

    graph = read_graph(path)
    return sum(macs(graph, op) for op in graph.ops)


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """FLOPs of CPU scaled-dot-product attention, which torch's counter does not register (its CUDA kernels only)."""
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def torch_macs(module, inputs: dict) -> int:
    """Multiply-accumulates of one forward: convolutions, matrix products and attention, as torch's FLOP counter
    counts them. grid_sample's interpolation is not counted: 4 corners x head_dim per sampling point, about 0.1 G
    per encoder layer of Deformable DETR at 512x512, 1 % of its count."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    for parameter in module.parameters():  # no autograd, and none of the counter's module hooks on leaves
        parameter.requires_grad_(False)
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        module(**{name: torch.from_numpy(value) for name, value in inputs.items()})
    return counter.get_total_flops() // 2


def source_macs(build: Path, zoo: Path) -> int:
    """MACs of the build's entry (zoo/<id>.json) as its source declares it, unpatched, on the build's first input.
    Weights do not change the count: the module is built from its config, never loaded."""
    from tools.entry import load_entry
    from tools.sources import build_module

    entry = load_entry(zoo / f"{json.loads((build / 'export.json').read_text())['entry']}.json")
    return torch_macs(build_module(entry).eval(), load_reference(build / "reference.npz")[0]["input"])


def measure(builds: list[Path], threads: int, runs: int, zoo: Path | None = None) -> dict:
    """Time every graph of each build in one run, interleaved: each of `runs` rounds runs every graph once, so
    that a host whose load drifts slows all of them alike (on the 2-core build machine, timing one entry's runs
    and then the next's gave Deformable / DN-DETR ratios from 2.1x to 4.1x minutes apart). Each entry's TFLite
    ratio to the first is the median of its per-round ratios; the record keeps every round's."""
    record = {"what": "host latency, ms per inference", "threads": threads, "runs": runs, "order": "interleaved rounds",
              "host": {"machine": platform.machine(), "platform": platform.platform(), "processor": platform.processor()},
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "tools": {d: metadata.version(d) for d in ("onnxruntime", "ai-edge-litert", "numpy")}, "entries": {}}
    timed = []  # (build, runtime name, file name, runner, inputs), each warmed up once
    for build in builds:
        inputs = load_reference(build / "reference.npz")[0]["input"]
        for name, file_name, make_runner in graphs(build):
            run = make_runner(build / file_name, threads)
            run(inputs)  # allocation, weight packing
            timed.append((build, name, file_name, run, inputs))
    times = {(build, name): [] for build, name, *_ in timed}
    for _ in range(runs):
        for build, name, _, run, inputs in timed:
            start = time.perf_counter()
            run(inputs)
            times[build, name].append((time.perf_counter() - start) * 1000)
    for build in builds:
        results = {}
        for _, name, file_name, run, _ in [t for t in timed if t[0] == build]:
            t = times[build, name]
            results[name] = {"file": file_name, "sha256": sha256_of(build / file_name),
                             "kernels": getattr(run, "kernels", "onnxruntime"), "median_ms": round(statistics.median(t), 2),
                             "mean_ms": round(statistics.mean(t), 2), "min_ms": round(min(t), 2),
                             "times_ms": [round(x, 3) for x in t]}
            print(f"{build.name:>24} {name:>12}: median {results[name]['median_ms']:9.1f} ms  "
                  f"mean {results[name]['mean_ms']:9.1f} ms  ({results[name]['kernels']})", flush=True)
        results["macs"] = graph_macs(build / "model_fp32.tflite")
        if zoo is not None:
            results["source_macs"] = source_macs(build, zoo)
        results["tflite_over_onnxruntime"] = round(results["tflite_fp32"]["median_ms"] / results["onnxruntime"]["median_ms"], 3)
        print(f"{build.name:>24} TFLite fp32 / ONNX Runtime: {results['tflite_over_onnxruntime']:.2f}x")
        for name in [n for n in results if n.startswith("tflite_int8")]:
            results[f"{name}_over_fp32"] = round(results[name]["median_ms"] / results["tflite_fp32"]["median_ms"], 3)
            print(f"{build.name:>24} {name} / TFLite fp32: {results[f'{name}_over_fp32']:.2f}x")
        record["entries"][str(build)] = results
    first = builds[0]
    for build in builds[1:]:
        rounds = [a / b for a, b in zip(times[build, "tflite_fp32"], times[first, "tflite_fp32"])]
        ratio = statistics.median(rounds)
        macs = record["entries"][str(build)]["macs"] / record["entries"][str(first)]["macs"]
        record.setdefault("tflite_ratio_to_first", {})[str(build)] = round(ratio, 3)
        record.setdefault("tflite_ratio_to_first_rounds", {})[str(build)] = [round(r, 3) for r in rounds]
        record.setdefault("mac_ratio_to_first", {})[str(build)] = round(macs, 3)
        print(f"TFLite fp32 {build} / {first}: {ratio:.2f}x latency (median of {runs} rounds, {min(rounds):.2f}-"
              f"{max(rounds):.2f}), {macs:.2f}x the graph's MACs (latency ratio / MAC ratio: {ratio / macs:.2f})")
        if zoo is not None:
            source = record["entries"][str(build)]["source_macs"] / record["entries"][str(first)]["source_macs"]
            record.setdefault("source_mac_ratio_to_first", {})[str(build)] = round(source, 3)
            print(f"TFLite fp32 {build} / {first}: {source:.2f}x the source model's MACs "
                  f"(latency ratio / MAC ratio: {ratio / source:.2f})")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", type=Path)
    parser.add_argument("--zoo", type=Path, help="the entries' folder: also count each source model's MACs in torch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    record = measure(args.builds, args.threads, args.runs, args.zoo)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
