"""bench: host latency of every runtime of a build, and an input-size sweep over the sizes the entry declares.

Host figures, measured on the machine that builds: an x86 host says little about the 8MP (the npu stage
estimates that). With ZOO_TARGET=ssh://user@host[:port] or adb://SERIAL the stage also times every .tflite of
the build on that board (tools.board) into board.json, which the card shows as measured on the 8MP. All runtimes run one after the other in this one process, at the
entry's thread count, on the first real validation input, one warm-up and `bench.runs` timed runs each:

- torch (the module as the entry defines it, without export patches), ONNX Runtime on model_sim.onnx, LiteRT
  on model_fp32.tflite and on each INT8 variant (with the kernels tflite_runner picks; recorded);
- the sweep: at every declared size and the built one (the last two dimensions of the first input), torch
  and ONNX Runtime on the module exported at that size with the entry's patches (model.onnx at the built
  size), and the ONNX outputs' largest difference from torch's (validate owns the tolerances; this says
  whether a size exports well). TFLite is timed at the built size only: a conversion per size is a full
  onnx2tf run (up to 37 minutes for a DETR here). bench.png draws the sweep.
"""
from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.atomic import atomic_path
from tools.entry import Entry
from tools.stages import variant_files
from tools.stages.validate import load_reference, onnx_runner, tflite_runner
from tools.weights import sha256_of


def time_runs(run, inputs: dict, runs: int) -> list[float]:
    """Milliseconds of `runs` calls after one warm-up call (allocation, weight packing)."""
    run(inputs)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run(inputs)
        times.append((time.perf_counter() - start) * 1000)
    return times


def summary(times: list[float]) -> dict:
    return {"median_ms": round(statistics.median(times), 3), "mean_ms": round(statistics.mean(times), 3),
            "min_ms": round(min(times), 3), "runs": len(times)}


def torch_runner(graph, threads: int):
    """inputs dict -> outputs dict, with torch eager on the CPU, no gradients."""
    import torch

    torch.set_num_threads(threads)
    names = graph.output_names

    def run(inputs: dict) -> dict:
        with torch.no_grad():
            outs = graph(*[torch.from_numpy(inputs[n]) for n in graph.input_names])
        return {n: o.numpy() for n, o in zip(names, outs)}
    return run


def sized(entry: Entry, size: list[int]) -> Entry:
    """The entry with its first input's last two dimensions set to `size`."""
    data = copy.deepcopy(entry.data)
    data["inputs"][0]["shape"][-2:] = size
    return Entry(entry.path, data)


def bench(entry: Entry, build_dir: Path) -> dict:
    from tools.inputs import validation_samples
    from tools.patches import apply_patches
    from tools.sources import build_module
    from tools.stages.export import GraphInterface, write_onnx
    from tools.weights import load_into

    target = _board_target(build_dir)
    settings = entry.data["bench"]
    threads, runs = settings.get("threads", 2), settings.get("runs", 10)
    feed = load_reference(build_dir / "reference.npz")[0]["input"]
    module = build_module(entry)
    weights = load_into(entry, module)
    plain = GraphInterface(module, entry).eval()
    patched = GraphInterface(apply_patches(copy.deepcopy(module), entry.data["export"].get("patches", [])), entry).eval()

    host = {"torch": {"file": None, "kernels": "torch eager (no export patches)",
                      **summary(time_runs(torch_runner(plain, threads), feed, runs))}}
    graphs = [("onnxruntime", "model_sim.onnx", onnx_runner), ("tflite_fp32", "model_fp32.tflite", tflite_runner)]
    graphs += [(f"tflite_{f.removeprefix('model_').removesuffix('.tflite')}", f, tflite_runner) for f in variant_files(entry)]
    for name, file_name, make_runner in graphs:
        run = make_runner(build_dir / file_name, threads)
        host[name] = {"file": file_name, "sha256": sha256_of(build_dir / file_name),
                      "kernels": getattr(run, "kernels", "onnxruntime CPU"), **summary(time_runs(run, feed, runs))}

    built = list(entry.data["inputs"][0]["shape"][-2:])
    sweep = []
    sizes = sorted({tuple(s) for s in settings["input_sizes"]} | {tuple(built)}, key=lambda s: (s[0] * s[1], s))
    for size in map(list, sizes):
        at_size = sized(entry, size)
        sample = validation_samples(at_size)[0]
        reference = torch_runner(plain, threads)(sample)
        point = {"size": size, "built": size == built, "torch": summary(time_runs(torch_runner(plain, threads), sample, runs))}
        with tempfile.TemporaryDirectory() as tmp:
            if size == built:
                onnx_path = build_dir / "model.onnx"
            else:
                import torch

                with torch.no_grad():
                    write_onnx(patched, tuple(torch.from_numpy(sample[n]) for n in patched.input_names),
                                patched.input_names, patched.output_names, at_size, Path(tmp))
                onnx_path = Path(tmp) / "model.onnx"
            run = onnx_runner(onnx_path, threads)
            outputs = run(sample)
            point["onnxruntime"] = summary(time_runs(run, sample, runs))
        point["onnx_max_abs_vs_torch"] = max(float(np.max(np.abs(outputs[n] - reference[n]))) for n in reference)
        if size == built:
            point["tflite"] = {k: host[k]["median_ms"] for k in host if k.startswith("tflite_")}
        sweep.append(point)
    _plot(entry, sweep, build_dir / "bench.png", threads)
    return {"threads": threads, "runs": runs, "input": entry.data["inputs"][0]["name"], "built_size": built,
            "weights": weights["kind"], "host_latency": host, "sweep": sweep, "plot": "bench.png",
            "sweep_note": "TFLite is timed at the built size only: another size needs its own conversion",
            "board": _measure_on_board(target, build_dir)}


def _board_target(build_dir: Path):
    """The board ZOO_TARGET names (checked before any timing), or None."""
    import os

    from tools.board import BoardError, Target
    from tools.stages import StageError

    try:
        return Target.parse(os.environ["ZOO_TARGET"]) if os.environ.get("ZOO_TARGET") else None
    except BoardError as exc:
        raise StageError(f"{build_dir.name}: {exc}; unset ZOO_TARGET to benchmark on the host only") from None


def _measure_on_board(target, build_dir: Path) -> str | None:
    """Every .tflite of the build timed on the target board into board.json (tools.board's record, which the
    card shows as measured on the 8MP); the file's name, or None without a target."""
    from tools.atomic import write_json
    from tools.board import BoardError, build_models, measure
    from tools.stages import StageError

    if target is None:
        return None
    try:
        record = measure(target, build_models(build_dir))
    except BoardError as exc:
        raise StageError(f"{build_dir.name}: measuring on {target}: {exc}; unset ZOO_TARGET to benchmark on the host only") from None
    write_json(build_dir / "board.json", record)
    return "board.json"


def _plot(entry: Entry, sweep: list[dict], path: Path, threads: int) -> None:
    """Latency against input size, one line per runtime, the TFLite graphs as points at the built size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{p['size'][0]}x{p['size'][1]}" for p in sweep]
    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for runtime, marker in (("torch", "o"), ("onnxruntime", "s")):
        axes.plot(labels, [p[runtime]["median_ms"] for p in sweep], marker=marker, label=runtime)
    for p in sweep:
        for name, ms in p.get("tflite", {}).items():
            axes.scatter([f"{p['size'][0]}x{p['size'][1]}"], [ms], marker="^", zorder=3, label=name.replace("_", " "))
    axes.set_xlabel(f"input {entry.data['inputs'][0]['name']} (last two dimensions)")
    axes.set_ylabel("median latency, ms")
    axes.set_title(f"{entry.id}: host latency, {threads} threads (measured, not the 8MP)", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png")
    plt.close(figure)
