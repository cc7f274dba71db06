"""Fit an 8MP latency model on NXP's published latencies and report its leave-one-out error.

    python bench/fit_cost_model.py [--write tools/data/imx8mp_cost_model.json]

NXP's eIQ Model Zoo v1.4 publishes benchmark_model latencies on the 8MP (VX delegate on the NPU, and 4 A53
threads) for int8 models (../shared/reference/imx8mp_npu_facts.md, section 2.1). This script rebuilds the
architectures among them that TensorFlow's Keras builds exactly (MobileNet V1 0.25 at 128 and, as Visual Wake
Words, at 96; MobileNet V2 1.0 at 224; ResNet50 at 224) or that MLPerf Tiny defines in a few layers (ResNet-8
on CIFAR, DS-CNN keyword spotting), with random weights (latency depends on the graph, not the weight
values), as full-integer int8 .tflite files like NXP's, and reads their MACs per op class with tools.npu.
Models:

    t = overhead + dense MACs / dense rate + depthwise MACs / depthwise rate

one fit for the NPU, one for the CPU (4 threads),
by non-negative least squares on relative error. Each model is then predicted by a fit on the
others (leave-one-out); the printed error is what a card's estimate should carry. Six points fit three
parameters: the error band is wide and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SOURCE = ("NXP eIQ Model Zoo v1.4 (github.com/NXP/eiq-model-zoo, commit 58c2b002, tasks/**/README.md "
          "'Performance'), benchmark_model on i.MX 8M Plus, as compiled in ../shared/reference/imx8mp_npu_facts.md 2.1")
# name: (published NPU ms, published CPU 4-thread ms, BSP), from that table.
PUBLISHED = {
    "mobilenet_v1_0.25_128": (0.84, 2.44, "LF6.1.1_1.0.0"),
    "vww_mobilenet_v1_0.25_96": (0.483, 1.443, "LF6.1.22"),
    "mobilenet_v2_1.0_224": (6.96, 44.33, "LF6.1.36_2.1.0"),
    "resnet50_224": (25.0, 259.0, "LF6.1.36_2.1.0"),
    "tiny_resnet8_cifar_32": (0.22, 1.43, "LF6.1.22"),
    "ds_cnn_kws": (0.182, 0.383, "LF6.1.1_1.0.0"),
}


def _resnet8(k):
    """MLPerf Tiny image classification: ResNet-8 for 32x32 CIFAR-10."""
    inputs = k.Input((32, 32, 3))
    x = k.layers.ReLU()(k.layers.BatchNormalization()(k.layers.Conv2D(16, 3, padding="same")(inputs)))
    for filters, stride in ((16, 1), (32, 2), (64, 2)):
        y = k.layers.ReLU()(k.layers.BatchNormalization()(k.layers.Conv2D(filters, 3, stride, padding="same")(x)))
        y = k.layers.BatchNormalization()(k.layers.Conv2D(filters, 3, padding="same")(y))
        shortcut = x if stride == 1 else k.layers.Conv2D(filters, 1, stride)(x)
        x = k.layers.ReLU()(k.layers.Add()([y, shortcut]))
    return k.Model(inputs, k.layers.Dense(10)(k.layers.Flatten()(k.layers.AveragePooling2D(8)(x))))


def _ds_cnn(k):
    """MLPerf Tiny keyword spotting: DS-CNN on 49x10 MFCC."""
    inputs = k.Input((49, 10, 1))
    x = k.layers.ReLU()(k.layers.BatchNormalization()(k.layers.Conv2D(64, (10, 4), 2, padding="same")(inputs)))
    for _ in range(4):
        x = k.layers.ReLU()(k.layers.BatchNormalization()(k.layers.DepthwiseConv2D(3, padding="same")(x)))
        x = k.layers.ReLU()(k.layers.BatchNormalization()(k.layers.Conv2D(64, 1)(x)))
    return k.Model(inputs, k.layers.Dense(12)(k.layers.Flatten()(k.layers.AveragePooling2D((25, 5))(x))))


def build(name: str):
    import tf_keras as k

    apps = k.applications
    return {
        "mobilenet_v1_0.25_128": lambda: apps.MobileNet((128, 128, 3), alpha=0.25, weights=None),
        "vww_mobilenet_v1_0.25_96": lambda: apps.MobileNet((96, 96, 3), alpha=0.25, weights=None, classes=2),
        "mobilenet_v2_1.0_224": lambda: apps.MobileNetV2((224, 224, 3), weights=None),
        "resnet50_224": lambda: apps.ResNet50(weights=None, input_shape=(224, 224, 3)),
        "tiny_resnet8_cifar_32": lambda: _resnet8(k),
        "ds_cnn_kws": lambda: _ds_cnn(k),
    }[name]()


def int8_tflite(model, path: Path) -> Path:
    """Full-integer int8 with int8 input and output, as NXP's zoo converts (TFLiteConverter, per-channel), at
    batch 1: the static shapes the delegate sees once benchmark_model has allocated the tensors."""
    import tensorflow as tf

    shape = (1, *model.input_shape[1:])
    rng = np.random.default_rng(0)
    function = tf.function(lambda x: model(x, training=False), input_signature=[tf.TensorSpec(shape, tf.float32)])
    converter = tf.lite.TFLiteConverter.from_concrete_functions([function.get_concrete_function()], model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([rng.standard_normal(shape).astype(np.float32)] for _ in range(4))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = converter.inference_output_type = tf.int8
    path.write_bytes(converter.convert())
    return path


def features(path: Path) -> dict:
    from tools.estimate import op_class
    from tools.npu import macs
    from tools.tflite_graph import read_graph

    graph = read_graph(path)
    by_class = {"dense": 0, "depthwise": 0, None: 0}
    for op in graph.ops:
        by_class[op_class(op.name)] += macs(graph, op)
    return {"dense_macs": int(by_class["dense"]), "depthwise_macs": int(by_class["depthwise"]), "ops": len(graph.ops)}


def design(rows: list[dict]) -> np.ndarray:
    return np.array([[1.0, r["dense_macs"] / 1e6, r["depthwise_macs"] / 1e6] for r in rows])


def fit(rows: list[dict], target: str) -> np.ndarray:
    """Coefficients (ms, ms per M MACs, ...) minimising relative error, all >= 0."""
    from scipy.optimize import nnls

    x, y = design(rows), np.array([r[f"{target}_ms"] for r in rows])
    coef, _ = nnls(x / y[:, None], np.ones(len(rows)))
    return coef


def leave_one_out(rows: list[dict], target: str) -> list[float]:
    """Relative error of each model's prediction from a fit on the other models."""
    errors = []
    for i, row in enumerate(rows):
        coef = fit(rows[:i] + rows[i + 1:], target)
        predicted = float((design([row]) @ coef)[0])
        errors.append(predicted / row[f"{target}_ms"] - 1)
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write the fitted model and its leave-one-out errors here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (npu_ms, cpu_ms, bsp) in PUBLISHED.items():
            start = time.perf_counter()
            path = int8_tflite(build(name), Path(tmp) / f"{name}.tflite")
            rows.append({"model": name, **features(path), "npu_ms": npu_ms, "cpu_ms": cpu_ms, "bsp": bsp})
            print(f"built {name}: {rows[-1]['dense_macs'] / 1e6:.1f} M dense + {rows[-1]['depthwise_macs'] / 1e6:.1f} M "
                  f"depthwise MACs, {rows[-1]['ops']} ops ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    result = {"source": SOURCE, "fitted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "tools": {p: metadata.version(p) for p in ("tensorflow", "tf-keras", "scipy")}, "models": rows}
    print(f"{'model':28s} {'dense M':>9s} {'dw M':>7s} | {'NPU ms':>7s} {'LOO est':>8s} {'err':>6s} | {'CPU ms':>7s} {'LOO est':>8s} {'err':>6s}")
    loo = {t: leave_one_out(rows, t) for t in ("npu", "cpu")}
    for i, r in enumerate(rows):
        est = {t: r[f"{t}_ms"] * (1 + loo[t][i]) for t in loo}
        print(f"{r['model']:28s} {r['dense_macs'] / 1e6:9.1f} {r['depthwise_macs'] / 1e6:7.1f} | {r['npu_ms']:7.3f} "
              f"{est['npu']:8.3f} {loo['npu'][i]:+6.0%} | {r['cpu_ms']:7.2f} {est['cpu']:8.2f} {loo['cpu'][i]:+6.0%}")
    names = ("overhead_ms", "ms_per_m_dense_macs", "ms_per_m_depthwise_macs")
    for target in ("npu", "cpu"):
        errors = np.abs(loo[target])
        result[target] = {"coefficients": dict(zip(names, map(float, fit(rows, target)))),
                          "loo_relative_errors": {r["model"]: round(e, 4) for r, e in zip(rows, loo[target])},
                          "loo_median_abs": round(float(np.median(errors)), 4), "loo_max_abs": round(float(errors.max()), 4)}
        coefficients = ", ".join(f"{k} {v:.4g}" for k, v in result[target]["coefficients"].items())
        print(f"{target.upper()}: {coefficients}; leave-one-out |error| median {np.median(errors):.0%}, max {errors.max():.0%}")
    if args.write:
        from tools.atomic import write_json

        write_json(args.write, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
