"""quantize: full-integer INT8 variants of the fp32 .tflite, calibrated once on real data.

The fp32 graph that validation checked is calibrated with TFLite's calibrator (the step TFLiteConverter
runs inside), then each declared variant is written by the MLIR quantizer: per-tensor or per-channel
weights, float32 or int8 model I/O, the declared ops or tensors left in float. One calibration serves all
variants. Activations are int8 only (the VX delegate rejects every INT16 output) and a variant with an
INT16 or INT64 tensor is refused. Ops still computing in float are recorded: on an 8MP they run on the CPU.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.atomic import atomic_path
from tools.calibration import calibration_set, overlap_with_validation
from tools.entry import Entry
from tools.npu import computes_in_float
from tools.stages import int8_variants
from tools.tflite_graph import read_graph

REJECTED_TYPES = ("INT16", "INT64", "UINT16", "UINT64")


def channel_last_feed(sample: dict, graph) -> dict:
    """Torch-layout inputs in the layout the .tflite's inputs take (onnx2tf makes images NHWC)."""
    from tools.stages.validate import to_layout_input

    wanted = {name: graph.tensors[i].shape for name, i in graph.signature_inputs.items()}
    return {name: to_layout_input(array, tuple(wanted[name])) for name, array in sample.items()}


def float_ops(graph) -> list[dict]:
    """Ops of an INT8 graph that still compute in float (any float32 activation in or out), edges excluded."""
    return [{"index": op.index, "op": op.name, "output": graph.tensors[op.outputs[0]].name}
            for op in graph.ops if computes_in_float(graph, op)]


def calibrated(fp32: bytes, feeds: list[dict]) -> bytes:
    """The fp32 graph with the value ranges that TFLite's calibrator recorded over `feeds` (signature-keyed)."""
    from tensorflow.lite.python.optimize import calibrator

    return calibrator.Calibrator(calibrator.add_intermediate_tensors(fp32)).calibrate(lambda: iter(feeds))


def int8_graph(calibrated_graph: bytes, variant: dict, keep: dict) -> bytes:
    """One full-integer variant of a calibrated graph, written by the MLIR quantizer."""
    import tensorflow as tf
    from tensorflow.lite.python import convert

    io = tf.int8 if variant.get("io", "float32") == "int8" else tf.float32
    return convert.mlir_quantize(calibrated_graph, disable_per_channel=variant["weights"] == "per-tensor",
                                 input_data_type=io, output_data_type=io,
                                 denylisted_ops=keep.get("ops"), denylisted_nodes=keep.get("tensors"))


def kept_float(entry: Entry, variant: dict, graph) -> dict:
    """What stays float in one variant: the entry's keep_float and the variant's own. Every tensor named must be
    an op output of the fp32 graph: the quantizer would ignore a stale name and quantize the op after all."""
    from tools.stages import StageError

    common, own = entry.data["quantization"].get("keep_float", {}), variant.get("keep_float", {})
    keep = {k: sorted({*common.get(k, ()), *own.get(k, ())}) for k in ("ops", "tensors") if common.get(k) or own.get(k)}
    written = {graph.tensors[i].name for op in graph.ops for i in op.outputs}
    unknown = [t for t in keep.get("tensors", ()) if t not in written]
    if unknown:
        raise StageError(f"{entry.path}: quantization keep_float of variant {variant['name']} names tensors that no op of "
                         f"model_fp32.tflite writes: {unknown[:3]}; copy them from `python -m tools.npu "
                         f"<build>/model_fp32.tflite --json report.json` (ops[].output) or drop them")
    return keep


def quantize(entry: Entry, build_dir: Path) -> dict:
    from tools.stages import StageError

    spec = entry.data["quantization"]
    calibration = calibration_set(entry, build_dir)
    shared = overlap_with_validation(entry, calibration)
    if shared:
        raise StageError(f"entry {entry.id!r}: calibration data overlaps the validation data: {'; '.join(shared)}; "
                         "choose other calibration samples (quantization.calibration)")
    fp32 = (build_dir / "model_fp32.tflite").read_bytes()
    graph = read_graph(fp32)
    feeds = [channel_last_feed(sample, graph) for sample in calibration.samples]
    ranged = calibrated(fp32, feeds)
    variants = {}
    for variant in int8_variants(entry):
        keep = kept_float(entry, variant, graph)
        model = int8_graph(ranged, variant, keep)
        quantized = read_graph(model)
        bad = sorted({f"{t.name} ({t.type})" for t in quantized.tensors_of_type(*REJECTED_TYPES)})
        if bad:
            raise StageError(f"entry {entry.id!r}: variant {variant['name']} has tensors the NPU rejects: {bad[:5]}; "
                             "find the op that makes them and keep it float or patch it")
        name = f"model_{variant['name']}.tflite"
        with atomic_path(build_dir / name) as tmp:
            tmp.write_bytes(model)
        types = {t.type for t in quantized.tensors if not t.constant}
        variants[variant["name"]] = {"file": name, **variant, "keep_float": keep, "bytes": len(model), "ops": dict(sorted(quantized.op_histogram().items())),
                                     "activation_types": sorted(types), "float_ops": float_ops(quantized)}
    return {"quantizer": "tflite calibrator + mlir_quantize", "activations": "int8", "calibration": calibration.record(),
            "keep_float": spec.get("keep_float", {}), "variants": variants}
