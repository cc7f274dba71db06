"""validate: run every graph on the real validation inputs and compare each output with torch's.

Stages: ONNX Runtime on model.onnx and model_sim.onnx, LiteRT on model_fp32.tflite. The test is
np.allclose's, |graph - torch| <= atol + rtol * |torch|, with the entry's tolerance for that stage. TFLite
tensors come back channel-last where onnx2tf moved the channel axis; they are compared in torch's layout.
A breach fails the build with the stage, output, sample, max abs and rel differences and the tolerance.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tools.entry import Entry


def channel_last(shape: tuple) -> tuple:
    """torch's NC... shape as onnx2tf lays it out: N...C."""
    return (shape[0], *shape[2:], shape[1]) if len(shape) >= 3 else tuple(shape)


def to_layout(array: np.ndarray, expected: tuple) -> np.ndarray:
    """Bring a TFLite tensor into torch's layout, by shape: as it is, or channel-last moved back."""
    if array.shape == tuple(expected):
        return array
    if array.ndim >= 3 and array.shape == channel_last(tuple(expected)):
        return np.moveaxis(array, -1, 1)
    raise ValueError(f"shape {array.shape} matches neither {tuple(expected)} nor its channel-last form")


def load_reference(path: Path) -> list[dict]:
    with np.load(path) as data:
        samples: dict[int, dict] = {}
        for key in data.files:
            index, kind, name = key.split("/", 2)
            samples.setdefault(int(index), {"input": {}, "output": {}})[kind][name] = data[key]
    return [samples[i] for i in sorted(samples)]


def onnx_runner(path: Path, threads: int | None = None):
    """inputs dict -> outputs dict, with ONNX Runtime on the CPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or os.cpu_count() or 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda inputs: dict(zip(names, session.run(names, inputs)))


def xnnpack_miscomputes(interpreter) -> list[str]:
    """Ops that XNNPACK (LiteRT 2.1.0) computes wrongly: a BATCH_MATMUL whose second operand is a run-time int8
    tensor with a nonzero zero point, which XNNPACK treats as symmetric. Measured (bench/deformable_vs_dn.py's
    layer comparison, then a two-input product): with a ReLU output as the second operand 1.2 dB SQNR under
    XNNPACK and 36 dB under the builtin kernels; as the first operand both agree. Read from the interpreter's
    own op and tensor details, so that the check needs neither TensorFlow nor torch."""
    ops = interpreter._get_ops_details()
    made = {i for op in ops for i in op["outputs"]} | {d["index"] for d in interpreter.get_input_details()}
    details = {d["index"]: d for d in interpreter.get_tensor_details()}
    wrong = []
    for op in ops:
        if op["op_name"] == "BATCH_MATMUL" and len(op["inputs"]) > 1 and op["inputs"][1] in made:
            second = details[op["inputs"][1]]
            if second["dtype"] == np.int8 and np.any(second["quantization_parameters"]["zero_points"]):
                wrong.append(f"BATCH_MATMUL op {op['index']}")
    return wrong


def tflite_runner(path: Path, threads: int | None = None, **options):
    """torch-layout float inputs dict -> float outputs dict, with LiteRT. Inputs move channel-last where the graph
    wants; an int8 input is quantized and an int8 output dequantized with the tensor's own scale and zero point.
    XNNPACK runs the graph unless it would miscompute it (xnnpack_miscomputes): then LiteRT's builtin kernels
    do; `run.kernels` says which."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    threads = threads or os.cpu_count() or 1
    interpreter = Interpreter(model_path=str(path), num_threads=threads, **options)
    kernels = "builtin" if "experimental_op_resolver_type" in options else "xnnpack"
    if kernels == "xnnpack" and xnnpack_miscomputes(interpreter):
        interpreter = Interpreter(model_path=str(path), num_threads=threads, **options,
                                  experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
        kernels = "builtin"
    runner = interpreter.get_signature_runner()
    inputs, outputs = runner.get_input_details(), runner.get_output_details()

    def run(feed: dict) -> dict:
        got = runner(**{name: _quantize(to_layout_input(feed[name], tuple(inputs[name]["shape"])), inputs[name])
                        for name in feed})
        return {name: dequantize(value, outputs[name]) for name, value in got.items()}

    run.interpreter, run.kernels = interpreter, kernels
    return run


def _quantize(array: np.ndarray, detail: dict) -> np.ndarray:
    if detail["dtype"] == np.float32 or not detail["quantization"][0]:  # float, or ids (int32) fed as they are
        return array.astype(detail["dtype"])
    scale, zero = detail["quantization"]
    info = np.iinfo(detail["dtype"])
    return np.clip(np.round(array / scale) + zero, info.min, info.max).astype(detail["dtype"])


def dequantize(array: np.ndarray, detail: dict) -> np.ndarray:
    """An int8 tensor as float, with the scale and zero point of its LiteRT tensor details; float as it is."""
    if array.dtype == np.float32 or not detail["quantization"][0]:
        return array
    scale, zero = detail["quantization"]
    return (array.astype(np.float32) - zero) * np.float32(scale)


def to_layout_input(array: np.ndarray, wanted: tuple) -> np.ndarray:
    """Feed a torch-layout input to a graph whose input may be channel-last."""
    if array.shape == wanted:
        return array
    if array.ndim >= 3 and channel_last(array.shape) == wanted:
        return np.ascontiguousarray(np.moveaxis(array, 1, -1))
    raise ValueError(f"input shape {array.shape} fits neither {wanted} nor its channel-first form")


def compare(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> dict:
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    scale = np.abs(expected.astype(np.float64))
    excess = diff - (atol + rtol * scale)
    return {
        "max_abs": float(diff.max(initial=0.0)),
        "max_rel": float((diff / np.maximum(scale, 1e-12)).max(initial=0.0)),
        "violations": int((excess > 0).sum()),
        "passed": bool((excess <= 0).all() and np.isfinite(actual).all()),
    }


STAGE_GRAPHS = (("onnx", "model.onnx", onnx_runner), ("onnx_simplified", "model_sim.onnx", onnx_runner),
                ("tflite_fp32", "model_fp32.tflite", tflite_runner))


def validate(entry: Entry, build_dir: Path) -> dict:
    references = load_reference(build_dir / "reference.npz")
    sample_names = json.loads((build_dir / "export.json").read_text())["samples"]
    results, failures = {}, []
    for stage, file_name, make_runner in STAGE_GRAPHS:
        tol = entry.data["tolerances"][stage]
        run = make_runner(build_dir / file_name)
        per_output: dict[str, dict] = {}
        for index, ref in enumerate(references):
            got = run(ref["input"])
            for name, expected in ref["output"].items():
                if name not in got:
                    raise ValueError(f"{file_name} has no output {name!r}; it has {sorted(got)}")
                cmp = compare(to_layout(np.asarray(got[name]), expected.shape), expected, tol["atol"], tol["rtol"])
                worst = per_output.get(name)
                if worst is None or cmp["max_abs"] > worst["max_abs"]:
                    per_output[name] = {**cmp, "worst_sample": sample_names[index]}
                if not cmp["passed"]:
                    failures.append(
                        f"{stage} output {name!r} on {sample_names[index]}: max abs {cmp['max_abs']:.3g}, "
                        f"max rel {cmp['max_rel']:.3g}, {cmp['violations']} elements beyond "
                        f"atol {tol['atol']:g} + rtol {tol['rtol']:g} * |torch|")
        results[stage] = {"tolerance": tol, "outputs": per_output,
                          "passed": all(o["passed"] for o in per_output.values())}
    record = {"passed": not failures, "samples": sample_names, "stages": results}
    if failures:
        record["failure"] = f"entry {entry.id!r}: " + "; ".join(failures[:5])
    return record
