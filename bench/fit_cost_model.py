"""Fit an 8MP latency model on NXP's published latencies and report its leave-one-out error.

    python bench/fit_cost_model.py [--write tools/data/imx8mp_cost_model.json]

NXP's eIQ Model Zoo v1.4 publishes benchmark_model latencies on the 8MP (VX delegate on the NPU, and 4 A53
threads) for int8 models (../shared/reference/imx8mp_npu_facts.md, section 2.1). This script rebuilds the
architectures among them that a library or a short published definition fixes exactly: from TensorFlow's
Keras, MobileNet V1 0.25 at 128 and (as Visual Wake Words) at 96, MobileNet V2 1.0 at 224 and ResNet50 at 224;
from MLPerf Tiny, ResNet-8 on CIFAR and DS-CNN keyword spotting; from deepface, its facial-expression model
and FaceNet512 (Inception-ResNet-v1; same layers and parameter count as deepface's builder). Weights are
random (latency depends on the graph, not the weight values); the files are full-integer int8 .tflite like
NXP's, with the table's I/O types, and tools.npu reads their MACs per op class and bytes per op. Two models
are fitted, for the NPU and for the CPU (4 threads) each:

    macs:            t = overhead + dense MACs / dense rate + depthwise MACs / depthwise rate
    macs_and_bytes:  the same + bytes read and written by the ops / bandwidth

by non-negative least squares on relative error. Each published model is then predicted by a fit on the
others (leave-one-out); the candidate with the lower median error is written, with both candidates'
errors. Eight points fit three or four parameters: the error band is wide and the card says so.
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
    "deepface_emotion_48": (2.02, 3.12, "LF6.1.1_1.0.0"),
    "facenet512_160": (10.01, 97.37, "LF6.1.1_1.0.0"),
}
# Model I/O types where the table says other than int8 in and out.
IO = {"deepface_emotion_48": ("uint8", "float32"), "facenet512_160": ("uint8", "uint8")}


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


def _deepface_emotion(k):
    """deepface's facial-expression classifier (FER-2013, 48x48 grey): five convolutions, two 1024-wide dense layers."""
    layers = k.layers
    return k.Sequential([
        k.Input((48, 48, 1)), layers.Conv2D(64, 5, activation="relu"), layers.MaxPooling2D(5, 2),
        layers.Conv2D(64, 3, activation="relu"), layers.Conv2D(64, 3, activation="relu"), layers.AveragePooling2D(3, 2),
        layers.Conv2D(128, 3, activation="relu"), layers.Conv2D(128, 3, activation="relu"), layers.AveragePooling2D(3, 2),
        layers.Flatten(), layers.Dense(1024, activation="relu"), layers.Dense(1024, activation="relu"),
        layers.Dense(7, activation="softmax")])


def _inception_resnet_v1(k, dimension: int = 512):
    """FaceNet's Inception-ResNet-v1 at 160x160 with a 512-wide embedding (deepface's Facenet512 layout): a
    convolution stem, 5 x block35, reduction A, 10 x block17, reduction B, 5 + 1 x block8, pooled bottleneck."""
    layers = k.layers

    def conv(x, filters, kernel, stride=1, padding="same"):
        x = layers.Conv2D(filters, kernel, stride, padding=padding, use_bias=False)(x)
        return layers.ReLU()(layers.BatchNormalization(scale=False, epsilon=1e-3)(x))

    def residual(x, branches, scale, relu=True):
        mixed = layers.Concatenate()([branch(x) for branch in branches])
        up = layers.Conv2D(x.shape[-1], 1)(mixed)
        x = layers.Add()([x, layers.Lambda(lambda t: t * scale)(up)])
        return layers.ReLU()(x) if relu else x

    def chain(*steps):
        def run(x):
            for filters, kernel in steps:
                x = conv(x, filters, kernel)
            return x
        return run

    inputs = k.Input((160, 160, 3))
    x = conv(conv(inputs, 32, 3, 2, "valid"), 32, 3, padding="valid")
    x = layers.MaxPooling2D(3, 2)(conv(x, 64, 3))
    x = conv(conv(conv(x, 80, 1, padding="valid"), 192, 3, padding="valid"), 256, 3, 2, "valid")
    for _ in range(5):
        x = residual(x, [chain((32, 1)), chain((32, 1), (32, 3)), chain((32, 1), (32, 3), (32, 3))], 0.17)
    x = layers.Concatenate()([conv(x, 384, 3, 2, "valid"), conv(chain((192, 1), (192, 3))(x), 256, 3, 2, "valid"),
                              layers.MaxPooling2D(3, 2)(x)])
    for _ in range(10):
        x = residual(x, [chain((128, 1)), chain((128, 1), (128, (1, 7)), (128, (7, 1)))], 0.1)
    x = layers.Concatenate()([conv(chain((256, 1))(x), 384, 3, 2, "valid"), conv(chain((256, 1))(x), 256, 3, 2, "valid"),
                              conv(chain((256, 1), (256, 3))(x), 256, 3, 2, "valid"), layers.MaxPooling2D(3, 2)(x)])
    for i in range(6):
        x = residual(x, [chain((192, 1)), chain((192, 1), (192, (1, 3)), (192, (3, 1)))], 0.2 if i < 5 else 1.0, relu=i < 5)
    x = layers.Dense(dimension, use_bias=False)(layers.GlobalAveragePooling2D()(x))
    return k.Model(inputs, layers.BatchNormalization(scale=False, epsilon=1e-3)(x))


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
        "deepface_emotion_48": lambda: _deepface_emotion(k),
        "facenet512_160": lambda: _inception_resnet_v1(k),
    }[name]()


def int8_tflite(model, path: Path, io: tuple[str, str] = ("int8", "int8")) -> Path:
    """Full-integer int8 with the model I/O types the table gives (int8 unless IO says otherwise), as NXP's zoo
    converts (TFLiteConverter, per-channel), at batch 1: the static shapes the delegate sees once benchmark_model
    has allocated the tensors."""
    import tensorflow as tf

    shape = (1, *model.input_shape[1:])
    rng = np.random.default_rng(0)
    function = tf.function(lambda x: model(x, training=False), input_signature=[tf.TensorSpec(shape, tf.float32)])
    converter = tf.lite.TFLiteConverter.from_concrete_functions([function.get_concrete_function()], model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([rng.standard_normal(shape).astype(np.float32)] for _ in range(4))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type, converter.inference_output_type = (getattr(tf, t) for t in io)
    path.write_bytes(converter.convert())
    return path


def features(path: Path) -> dict:
    """What the cost model reads of a graph, counted as tools.npu counts it for an estimate: MACs per op class,
    and the bytes every op reads and writes (weights included)."""
    from tools.estimate import op_class
    from tools.npu import analyse

    ops = analyse(path)["ops"]
    by_class = {"dense": 0, "depthwise": 0, None: 0}
    for op in ops:
        by_class[op_class(op["op"])] += op["macs"]
    return {"dense_macs": int(by_class["dense"]), "depthwise_macs": int(by_class["depthwise"]),
            "bytes": int(sum(op["bytes"] for op in ops)), "ops": len(ops)}


# The candidate models: which features each prices. The one whose leave-one-out error is lower is written.
CANDIDATES = {"macs": ("dense_macs", "depthwise_macs"), "macs_and_bytes": ("dense_macs", "depthwise_macs", "bytes")}
COEFFICIENT = {"dense_macs": "ms_per_m_dense_macs", "depthwise_macs": "ms_per_m_depthwise_macs", "bytes": "ms_per_mb"}


# No NPU op computes faster than the NPU's peak, 2.3 TOPS = 1.15e9 int8 MACs per ms (NXP's figure, facts file
# section 5): without this floor the fit on these eight models prices dense MACs at nothing and bytes alone.
FLOORS = {"npu": {"dense_macs": 1e6 / 1.15e9}}


def design(rows: list[dict], columns: tuple[str, ...]) -> np.ndarray:
    return np.array([[1.0, *(r[c] / 1e6 for c in columns)] for r in rows])


def fit(rows: list[dict], target: str, columns: tuple[str, ...]) -> np.ndarray:
    """Coefficients (ms, then ms per million of each column) minimising relative error, none below its floor."""
    from scipy.optimize import lsq_linear

    x, y = design(rows, columns), np.array([r[f"{target}_ms"] for r in rows])
    floors = [0.0, *(FLOORS.get(target, {}).get(c, 0.0) for c in columns)]
    return lsq_linear(x / y[:, None], np.ones(len(rows)), bounds=(floors, np.inf)).x


def leave_one_out(rows: list[dict], target: str, columns: tuple[str, ...]) -> list[float]:
    """Relative error of each model's prediction from a fit on the other models."""
    errors = []
    for i, row in enumerate(rows):
        coef = fit(rows[:i] + rows[i + 1:], target, columns)
        predicted = float((design([row], columns) @ coef)[0])
        errors.append(predicted / row[f"{target}_ms"] - 1)
    return errors


def fitted(rows: list[dict], target: str) -> dict:
    """Every candidate's leave-one-out errors, and the coefficients of the one with the lower median error."""
    tried = {}
    for name, columns in CANDIDATES.items():
        errors = leave_one_out(rows, target, columns)
        tried[name] = {"loo_relative_errors": {r["model"]: round(e, 4) for r, e in zip(rows, errors)},
                       "loo_median_abs": round(float(np.median(np.abs(errors))), 4),
                       "loo_max_abs": round(float(np.max(np.abs(errors))), 4)}
    chosen = min(tried, key=lambda name: (tried[name]["loo_median_abs"], len(CANDIDATES[name])))
    columns = CANDIDATES[chosen]
    coefficients = dict(zip(("overhead_ms", *(COEFFICIENT[c] for c in columns)), map(float, fit(rows, target, columns))))
    return {"candidate": chosen, "coefficients": coefficients, **tried[chosen],
            "candidates": {name: {k: v for k, v in t.items() if k != "loo_relative_errors"} for name, t in tried.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write the fitted model and its leave-one-out errors here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (npu_ms, cpu_ms, bsp) in PUBLISHED.items():
            start = time.perf_counter()
            path = int8_tflite(build(name), Path(tmp) / f"{name}.tflite", IO.get(name, ("int8", "int8")))
            rows.append({"model": name, **features(path), "npu_ms": npu_ms, "cpu_ms": cpu_ms, "bsp": bsp})
            print(f"built {name}: {rows[-1]['dense_macs'] / 1e6:.1f} M dense + {rows[-1]['depthwise_macs'] / 1e6:.1f} M "
                  f"depthwise MACs, {rows[-1]['bytes'] / 1e6:.1f} MB, {rows[-1]['ops']} ops ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr)
    result = {"source": SOURCE, "fitted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "tools": {p: metadata.version(p) for p in ("tensorflow", "tf-keras", "scipy")}, "models": rows,
              **{target: fitted(rows, target) for target in ("npu", "cpu")}}
    print(f"{'model':24s} {'dense M':>8s} {'dw M':>6s} {'MB':>6s} | {'NPU ms':>7s} {'LOO est':>8s} {'err':>6s} | "
          f"{'CPU ms':>7s} {'LOO est':>8s} {'err':>6s}")
    for r in rows:
        cells = []
        for target in ("npu", "cpu"):
            e = result[target]["loo_relative_errors"][r["model"]]
            cells.append(f"{r[f'{target}_ms']:7.3f} {r[f'{target}_ms'] * (1 + e):8.3f} {e:+6.0%}")
        print(f"{r['model']:24s} {r['dense_macs'] / 1e6:8.1f} {r['depthwise_macs'] / 1e6:6.1f} {r['bytes'] / 1e6:6.1f} | "
              + " | ".join(cells))
    for target in ("npu", "cpu"):
        t = result[target]
        tried = "; ".join(f"{name}: median {c['loo_median_abs']:.0%}, max {c['loo_max_abs']:.0%}" for name, c in t["candidates"].items())
        coefficients = ", ".join(f"{k} {v:.4g}" for k, v in t["coefficients"].items())
        print(f"{target.upper()}: chose {t['candidate']} ({coefficients}); leave-one-out |error| {tried}")
    if args.write:
        from tools.atomic import write_json

        write_json(args.write, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
