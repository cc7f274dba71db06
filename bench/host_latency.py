"""Host latency of built graphs, side by side in one run: ONNX Runtime vs TFLite fp32 vs each TFLite INT8
variant (LiteRT, XNNPACK), per entry.

    python bench/host_latency.py build/dn_detr build/deformable_detr [--threads 2] [--runs 10] [--json out.json]

Feeds the first validation input of each build (a real photograph), one warm-up run per graph, then `runs`
rounds that each run every graph once (interleaved, so that the host's drifting load slows all of them alike).
Prints median and mean per graph, the TFLite/ONNX Runtime and INT8/fp32 ratios per entry and, for two or more
entries, each entry's TFLite latency relative to the first (the median of the per-round ratios) beside the
ratio of their MAC counts (the ideal: latency that follows arithmetic). Writes the figures as a JSON record
with the host, the tool versions and the sha256 of every graph it timed.
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


def measure(builds: list[Path], threads: int, runs: int) -> dict:
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
              f"{max(rounds):.2f}), {macs:.2f}x MACs (latency ratio / MAC ratio: {ratio / macs:.2f})")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    record = measure(args.builds, args.threads, args.runs)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
