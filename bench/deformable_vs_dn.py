"""Deformable DETR against DN-DETR in TFLite fp32 on this machine: whole models, and one attention layer per
sampling formulation, each measured side by side in one run.

    python bench/deformable_vs_dn.py [--before OLD_BUILD] [--no-build] [--layer] [--threads 2] [--runs 10]

Models: builds both entries (`doit build:dn_detr build:deformable_detr`, random weights unless ZOO_WEIGHTS says
otherwise; an up-to-date build is not redone), checks that they take the same input size, then times every
graph of both (and of --before, an older Deformable DETR build to compare with) and prints Deformable / DN-DETR
latency beside their MAC ratio, the ideal, and the issue's goal: at most 1.2x the MAC ratio and at most 2.5.

--layer: one full-size encoder self-attention layer (levels 64x64, 32x32, 16x16, 8x8 of a 512x512 image, 256
channels, 8 heads, 4 points) under each formulation: transformers' grid_sample as onnx2tf decomposes it, the
four-corner gather (deformable_detr_gather_sampling), tent sampling (deformable_detr_tent_sampling), and the
layer's four projections alone (the floor any sampling adds to). Each is exported, simplified and converted
with the pinned tools, checked against torch, timed, and quantized to INT8 (per-channel, calibrated on 8
other inputs) for the SQNR of its output against its fp32 graph: what each formulation's coordinate arithmetic
keeps under INT8. Writes a JSON record with --json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.host_latency import measure, time_runs  # noqa: E402

GOAL_OVER_MACS, GOAL_MAX = 1.2, 2.5
LAYER_SHAPES = [(64, 64), (32, 32), (16, 16), (8, 8)]


def build_both(build_root: Path) -> list[Path]:
    env = {**os.environ, "ZOO_WEIGHTS": os.environ.get("ZOO_WEIGHTS", "random")}
    subprocess.run([sys.executable, "-m", "doit", "build:dn_detr", "build:deformable_detr"], cwd=ROOT, env=env, check=True)
    builds = [build_root / "dn_detr", build_root / "deformable_detr"]
    sizes = [json.loads((b / "export.json").read_text())["inputs"]["pixel_values"] for b in builds]
    if sizes[0] != sizes[1]:
        raise SystemExit(f"the builds take different inputs: {sizes[0]} vs {sizes[1]}; declare one size in both entries")
    return builds


def models(args) -> dict:
    builds = [ROOT / "build" / "dn_detr", ROOT / "build" / "deformable_detr"] if args.no_build else build_both(ROOT / "build")
    record = measure(builds + ([args.before] if args.before else []), args.threads, args.runs)
    first, macs = str(builds[0]), record["entries"][str(builds[0])]["macs"]
    for name in list(record["entries"])[1:]:
        ratio, mac_ratio = record["tflite_ratio_to_first"][name], record["mac_ratio_to_first"][name]
        goal = min(GOAL_OVER_MACS * mac_ratio, GOAL_MAX)
        print(f"{Path(name).name}: {ratio:.2f}x DN-DETR's TFLite fp32 latency for {mac_ratio:.2f}x its MACs "
              f"({macs / 1e9:.1f} G); goal <= {goal:.2f}x: {'met' if ratio <= goal else 'not met'}")
    record["goal"] = {"over_mac_ratio": GOAL_OVER_MACS, "max": GOAL_MAX, "reference": first}
    return record


class _Layer:
    """One encoder self-attention layer as a module of its own: queries are the values, reference points fixed."""

    @staticmethod
    def make(attention):
        import torch

        from tools.patches.deformable_detr import float32_reference_points

        reference = float32_reference_points(LAYER_SHAPES, torch.ones(1, len(LAYER_SHAPES), 2))

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.attention = attention

            def forward(self, x):
                return self.attention(x, encoder_hidden_states=x, reference_points=reference,
                                      spatial_shapes=torch.tensor(LAYER_SHAPES), spatial_shapes_list=LAYER_SHAPES,
                                      level_start_index=None)[0]
        return Layer().eval()


def _projections_only(stock):
    """The layer with sampling replaced by reading each head's own position: what any formulation adds to."""
    import torch

    class Projections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stock = stock

        def forward(self, hidden_states, encoder_hidden_states=None, **kwargs):
            value = self.stock.value_proj(encoder_hidden_states)
            offsets = self.stock.sampling_offsets(hidden_states)
            weights = self.stock.attention_weights(hidden_states).reshape(*hidden_states.shape[:2], 8, -1).softmax(-1)
            mixed = value + offsets.mean(-1, keepdim=True) * weights.mean((-2, -1))[..., None]
            return self.stock.output_proj(mixed), None
    return Projections()


def _convert_and_time(name: str, module, x, expected, work: Path, threads: int, runs: int) -> dict:
    import numpy as np
    import onnx
    import onnx2tf
    import onnxsim
    import torch

    from tools.metrics import sqnr_db
    from tools.stages.convert import write_sample_images
    from tools.stages.quantize import calibrated, channel_last_feed, int8_graph
    from tools.stages.validate import tflite_runner
    from tools.tflite_graph import read_graph

    folder = work / name
    folder.mkdir()
    with torch.no_grad():
        torch.onnx.export(module, (x,), str(folder / "layer.onnx"), opset_version=17, input_names=["x"],
                          output_names=["y"], dynamo=False)
    simplified, _ = onnxsim.simplify(onnx.load(str(folder / "layer.onnx")))
    onnx.save(simplified, str(folder / "layer_sim.onnx"))
    write_sample_images(folder)
    start, cwd = time.perf_counter(), os.getcwd()
    os.chdir(folder)
    try:
        onnx2tf.convert(input_onnx_file_path=str(folder / "layer_sim.onnx"), output_folder_path=str(folder / "tf"),
                        not_use_onnxsim=True, copy_onnx_input_output_names_to_tflite=True, verbosity="error")
    finally:
        os.chdir(cwd)
    convert_s = time.perf_counter() - start
    path = folder / "tf" / "layer_sim_float32.tflite"
    run = tflite_runner(path, threads)
    got = run({"x": x.numpy()})["y"]
    got = got if got.shape == expected.shape else got.transpose(0, 2, 1)  # onnx2tf may keep (1, C, N)
    times = time_runs(run, {"x": x.numpy()}, runs)
    graph = read_graph(path)
    ops = graph.op_histogram()
    # INT8 (per-channel weights, int8 activations) calibrated on 8 other inputs: the layer output's SQNR
    generator = torch.Generator().manual_seed(1)
    feeds = [channel_last_feed({"x": torch.randn(x.shape, generator=generator).numpy()}, graph) for _ in range(8)]
    (folder / "layer_int8.tflite").write_bytes(int8_graph(calibrated(path.read_bytes(), feeds), {"weights": "per-channel"}, {}))
    int8_run = tflite_runner(folder / "layer_int8.tflite", threads)
    int8 = int8_run({"x": x.numpy()})["y"]
    sqnr = round(sqnr_db(got, int8 if int8.shape == expected.shape else int8.transpose(0, 2, 1)), 2)
    result = {"median_ms": round(statistics.median(times), 2), "max_abs_vs_torch": float(np.abs(got - expected).max()),
              "int8_pc_sqnr_db": sqnr, "int8_kernels": int8_run.kernels, "ops": sum(ops.values()),
              "gathers": ops.get("GATHER", 0) + ops.get("GATHER_ND", 0), "convert_s": round(convert_s, 1)}
    print(f"{name:>18}: median {result['median_ms']:8.1f} ms  max abs vs torch {result['max_abs_vs_torch']:.2e}  "
          f"INT8 SQNR {sqnr:5.1f} dB ({int8_run.kernels})  {result['ops']} ops ({result['gathers']} gathers), "
          f"converted in {result['convert_s']} s", flush=True)
    return result


def layer(args) -> dict:
    import torch
    from transformers import DeformableDetrConfig
    from transformers.models.deformable_detr.modeling_deformable_detr import DeformableDetrMultiscaleDeformableAttention

    from tools.patches.deformable_detr import GatherDeformableAttention, TentSamplingDeformableAttention

    torch.manual_seed(0)
    stock = DeformableDetrMultiscaleDeformableAttention(DeformableDetrConfig(), num_heads=8, n_points=4).eval()
    with torch.no_grad():  # trained-like offsets: a few pixels in every direction, varying with the query
        stock.sampling_offsets.weight.normal_(0, 0.02)
        stock.sampling_offsets.bias.normal_(0, 2.0)
    x = torch.randn(1, sum(h * w for h, w in LAYER_SHAPES), 256)
    formulations = {"projections only": _projections_only(stock), "gather": GatherDeformableAttention(stock),
                    "tent": TentSamplingDeformableAttention(stock)}
    if args.with_stock:
        formulations = {"stock grid_sample": stock, **formulations}
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name, attention in formulations.items():
            module = _Layer.make(attention)
            with torch.no_grad():
                expected = (_Layer.make(stock) if name != "projections only" else module)(x).numpy()
            results[name] = _convert_and_time(name, module, x, expected, Path(work), args.threads, args.runs)
    floor = results["projections only"]["median_ms"]
    for name in [n for n in results if n != "projections only"]:
        print(f"{name:>18}: sampling adds {results[name]['median_ms'] - floor:7.1f} ms to the projections' {floor:.1f} ms")
    return {"layer": {"shapes": LAYER_SHAPES, "channels": 256, "heads": 8, "points": 4, "formulations": results}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="an older deformable_detr build folder to time beside the new one")
    parser.add_argument("--no-build", action="store_true", help="time build/ as it is")
    parser.add_argument("--layer", action="store_true", help="also time one attention layer per formulation")
    parser.add_argument("--with-stock", action="store_true", help="with --layer: also onnx2tf's grid_sample lowering")
    parser.add_argument("--layer-only", action="store_true", help="only the layer comparison")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    record = {} if args.layer_only else models(args)
    if args.layer or args.layer_only:
        record.update(layer(args))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
