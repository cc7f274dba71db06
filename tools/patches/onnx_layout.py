"""ONNX-graph rewrites: named patches an entry lists (for what no torch-side patch can reach), and the rewrite
the simplify stage applies to every graph."""
from __future__ import annotations

import numpy as np

from tools.patches import register

DETECTORS = ("DabDetrForObjectDetection", "DeformableDetrForObjectDetection")


def _infer_shapes(model, rewritten: int) -> None:
    """onnx2tf reads every tensor's shape from the graph and guesses a layout where one is missing: give the
    tensors a rewrite made their shapes."""
    import onnx

    if rewritten:
        del model.graph.value_info[:]
        model.CopyFrom(onnx.shape_inference.infer_shapes(model))


@register("onnx_concat_tokens_before_transpose", applies_to=DETECTORS, graph="onnx")
def concat_tokens_before_transpose(model):
    """Concatenate the levels' (B, C, N) tokens first and transpose once, not one Transpose(0,2,1) per level.

    DETR encoders flatten each (B, C, H, W) map into (B, H*W, C) tokens with flatten(2).transpose(1, 2), then
    concatenate the levels. When a level has H*W == C (16x16 of a 256-channel model: Deformable DETR at
    512x512) its transposed tensor is square: onnx2tf cannot tell its axes apart and writes that transpose as
    an identity, a silent layout error (logits off by 0.4). One transpose of all levels together, (B, C,
    sum H*W), is not square; the tokens are the same, in the same order, with fewer ops.
    """
    from onnx import helper

    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    rewritten = 0
    for concat in list(graph.node):
        axis = [a.i for a in concat.attribute if a.name == "axis"]
        if concat.op_type != "Concat" or axis not in ([1], [-2]):
            continue
        parts = [producers.get(name) for name in concat.input]
        if not all(p is not None and p.op_type == "Transpose" and [list(a.ints) for a in p.attribute] == [[0, 2, 1]]
                   and uses[p.output[0]] == 1 for p in parts):
            continue
        stem = f"{concat.name or concat.output[0]}_channels_first"
        position = list(graph.node).index(concat)
        for node in (*parts, concat):
            graph.node.remove(node)
        position -= len(parts)
        graph.node.insert(position, helper.make_node("Concat", [p.input[0] for p in parts], [stem], axis=2, name=f"{stem}_concat"))
        graph.node.insert(position + 1, helper.make_node("Transpose", [stem], [concat.output[0]], perm=[0, 2, 1],
                                                         name=f"{stem}_transpose"))
        rewritten += 1
    _infer_shapes(model, rewritten)
    return rewritten


def relu_maxpool_zero_padding(model) -> int:
    """Pad a max pool that follows a ReLU with an explicit zero Pad instead of MaxPool's own (-inf) pads.

    onnx2tf writes MaxPool's padding as PADV2 with a -FLT_MAX constant. The INT8 calibrator then records
    that constant in the range of the tensor before it (scale ~1e36: the quantized graph is garbage), the
    quantizer leaves the constant float, and PADV2 is a CPU op on the VX delegate. After a ReLU every value
    is >= 0 and a pooling window always holds a real value, so zero padding gives the same maxima. Applied
    to every graph by the simplify stage (not an entry option: it is always right) and counted in its record.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    rewritten = 0
    for pool in list(graph.node):
        pads = [list(a.ints) for a in pool.attribute if a.name == "pads"]
        source = producers.get(pool.input[0]) if pool.op_type == "MaxPool" else None
        if source is None or source.op_type != "Relu" or not pads or not any(pads[0]):
            continue
        begin, end = pads[0][:len(pads[0]) // 2], pads[0][len(pads[0]) // 2:]
        stem = f"{pool.name or pool.output[0]}_zero_pad"
        widths = numpy_helper.from_array(np.array([0, 0, *begin, 0, 0, *end], np.int64), f"{stem}_pads")
        graph.initializer.append(widths)
        position = list(graph.node).index(pool)
        graph.node.insert(position, helper.make_node("Pad", [pool.input[0], widths.name], [f"{stem}_out"], mode="constant",
                                                     name=stem))
        pool.input[0] = f"{stem}_out"
        for attribute in pool.attribute:
            if attribute.name == "pads":
                attribute.ints[:] = [0] * len(attribute.ints)
        rewritten += 1
    _infer_shapes(model, rewritten)
    return rewritten
