#!/usr/bin/env python3
"""Runs ON the board: time .tflite files with the VX delegate (NPU) and on the CPU, print one JSON record.

    python3 board_runner.py model.tflite [...] [--runs 50] [--threads 4] [--delegate /usr/lib/libvx_delegate.so]

Copied to the board by tools/board.py (ssh or adb) beside the models. Needs Python 3.8+ and numpy, and either
`benchmark_model` (the BSP's /usr/bin/tensorflow-lite-*/examples/benchmark_model, used when present) or a Python
runtime (tflite_runtime, or ai_edge_litert). Per model and placement it records init time, the first inference
(on the NPU: the graph compile plus one run) apart from the steady state (mean, p50, p90, std over `runs`),
threads, the delegate, whether the driver's graph cache was on and already held a compiled graph, and the
delegate's log lines (fallbacks, partitions). The board's identity (SoC, BSP / OS release, kernel, runtime
versions) comes with it. Timings in milliseconds.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

DELEGATE = "/usr/lib/libvx_delegate.so"
BENCHMARK_GLOBS = ("/usr/bin/tensorflow-lite-*/examples/benchmark_model", "/usr/bin/benchmark_model")
CACHE_ON, CACHE_DIR = "VIV_VX_ENABLE_CACHE_GRAPH_BINARY", "VIV_VX_CACHE_BINARY_GRAPH_DIR"
DELEGATE_LOG = re.compile(r"(delegate|fallback|vx|npu)", re.I)


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip("\x00\n ")
    except OSError:
        return None


def identity() -> dict:
    os_release = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', _read("/etc/os-release") or "", re.M))
    runtimes = {}
    for name in ("tflite_runtime", "ai_edge_litert", "numpy"):
        try:
            module = __import__(name)
            runtimes[name] = getattr(module, "__version__", "unknown")
        except ImportError:
            pass
    return {"soc_id": _read("/sys/devices/soc0/soc_id"), "soc_machine": _read("/sys/devices/soc0/machine"),
            "soc_revision": _read("/sys/devices/soc0/revision"), "os": os_release.get("PRETTY_NAME"),
            "os_version": os_release.get("VERSION_ID"), "kernel": platform.release(), "arch": platform.machine(),
            "python": platform.python_version(), "runtimes": runtimes, "cpu_count": os.cpu_count()}


def graph_cache() -> dict:
    folder = os.environ.get(CACHE_DIR) or os.getcwd()
    on = os.environ.get(CACHE_ON) == "1"
    return {"enabled": on, "dir": folder if on else None, "entries_before": len(os.listdir(folder)) if on and os.path.isdir(folder) else None}


def stats(times_ms: list) -> dict:
    ordered = sorted(times_ms)
    pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]  # noqa: E731
    return {"runs": len(ordered), "mean_ms": round(statistics.fmean(ordered), 3), "p50_ms": round(pick(0.5), 3),
            "p90_ms": round(pick(0.9), 3), "std_ms": round(statistics.pstdev(ordered), 3), "min_ms": round(ordered[0], 3)}


class _StderrCapture:
    """The native stderr (fd 2) of this process into a file, so that the delegate's C++ log is kept."""

    def __enter__(self):
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile(mode="w+")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.lines = [line.rstrip() for line in self.file if line.strip()]
        self.file.close()


def _interpreter_class():
    try:
        from tflite_runtime.interpreter import Interpreter, load_delegate
        return "tflite_runtime", Interpreter, load_delegate
    except ImportError:
        from ai_edge_litert.interpreter import Interpreter, load_delegate
        return "ai_edge_litert", Interpreter, load_delegate


def run_python(model: str, runs: int, threads: int, delegate: str | None) -> dict:
    import numpy as np

    runtime, interpreter_cls, load_delegate = _interpreter_class()
    with _StderrCapture() as log:
        start = time.perf_counter()
        delegates = [load_delegate(delegate)] if delegate else []
        interpreter = interpreter_cls(model_path=model, num_threads=threads, experimental_delegates=delegates)
        interpreter.allocate_tensors()
        init_ms = (time.perf_counter() - start) * 1000
        rng = np.random.default_rng(0)
        for detail in interpreter.get_input_details():
            dtype = detail["dtype"]
            if np.issubdtype(dtype, np.integer):
                info = np.iinfo(dtype)
                value = rng.integers(max(info.min, -8), min(info.max, 8), detail["shape"], dtype=dtype)
            else:
                value = rng.standard_normal(detail["shape"]).astype(dtype)
            interpreter.set_tensor(detail["index"], value)
        start = time.perf_counter()
        interpreter.invoke()
        first_ms = (time.perf_counter() - start) * 1000
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        interpreter.invoke()
        times.append((time.perf_counter() - start) * 1000)
    return {"runner": runtime, "init_ms": round(init_ms, 3), "first_ms": round(first_ms, 3), "steady": stats(times),
            "log": [line for line in log.lines if DELEGATE_LOG.search(line)][:200]}


TIMINGS = re.compile(r"Inference timings in us: Init: ([\d.]+), First inference: ([\d.]+), Warmup \(avg\): ([\d.e+]+), "
                     r"Inference \(avg\): ([\d.e+]+)")
COUNT = re.compile(r"count=(\d+) first=([\d.]+) curr=[\d.]+ min=([\d.]+) max=[\d.]+ avg=([\d.e+]+) std=([\d.]+)"
                   r"(?: p5=[\d.]+ median=([\d.]+) p95=([\d.]+))?")


def parse_benchmark_model(output: str) -> dict:
    """benchmark_model's log -> init, first inference and steady-state figures (its lines are in microseconds;
    the measured phase is its last `count=` line). p90 is not printed: newer builds give p95 instead."""
    timings, counts = TIMINGS.search(output), COUNT.findall(output)
    if not timings or not counts:
        raise ValueError("no 'Inference timings in us' or 'count=' line in benchmark_model's output")
    init, first, _, mean = (float(v) / 1000 for v in timings.groups())
    runs, _, low, _, std, median, p95 = counts[-1]
    steady = {"runs": int(runs), "mean_ms": round(mean, 3), "std_ms": round(float(std) / 1000, 3), "min_ms": round(float(low) / 1000, 3)}
    if median:
        steady.update(p50_ms=round(float(median) / 1000, 3), p95_ms=round(float(p95) / 1000, 3))
    return {"init_ms": round(init, 3), "first_ms": round(first, 3), "steady": steady}


def run_benchmark_model(binary: str, model: str, runs: int, threads: int, delegate: str | None) -> dict:
    command = [binary, f"--graph={model}", f"--num_threads={threads}", f"--num_runs={runs}", "--warmup_runs=1"]
    if delegate:
        command.append(f"--external_delegate_path={delegate}")
    proc = subprocess.run(command, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{binary} exited {proc.returncode}: {output.strip().splitlines()[-1:]}")
    return {"runner": binary, **parse_benchmark_model(output),
            "log": [line for line in output.splitlines() if DELEGATE_LOG.search(line)][:200]}


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=4, help="CPU threads (XNNPACK), also for the CPU ops of a delegated graph")
    parser.add_argument("--delegate", default=DELEGATE, help="VX delegate library; skipped where it does not exist")
    parser.add_argument("--runner", choices=("auto", "python", "benchmark_model"), default="auto")
    args = parser.parse_args(argv)
    binaries = sorted(p for pattern in BENCHMARK_GLOBS for p in glob.glob(pattern))
    use_binary = args.runner == "benchmark_model" or (args.runner == "auto" and bool(binaries))
    if use_binary and not binaries:
        print(json.dumps({"error": "no benchmark_model on this board"}))
        return 1
    placements = {"npu": args.delegate, "cpu": None} if os.path.exists(args.delegate) else {"cpu": None}
    results = {}
    for model in args.models:
        name = os.path.basename(model)
        results[name] = {}
        for placement, delegate in placements.items():
            cache = graph_cache() if delegate else None
            try:
                if use_binary:
                    result = run_benchmark_model(binaries[-1], model, args.runs, args.threads, delegate)
                else:
                    result = run_python(model, args.runs, args.threads, delegate)
            except Exception as exc:  # noqa: BLE001 - a model that fails on the board is a result, not a crash
                result = {"error": f"{type(exc).__name__}: {exc}"}
            results[name][placement] = {"threads": args.threads, "delegate": delegate, "graph_cache": cache, **result}
    print(json.dumps({"identity": identity(), "delegate_present": os.path.exists(args.delegate),
                      "delegate_path": args.delegate, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
