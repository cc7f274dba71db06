"""Rewrites of the converted .tflite that the convert stage applies to every graph: each removes ops that it
proves compute nothing, so every graph's outputs stay bit-identical.

onnx2tf (1.29.24, ops/Gather.py) maps negative Gather indices to positive ones before every Gather whose
indices are not constants: index + cast(index < 0) * dim, four int32 ops (LESS, CAST, MUL, ADD) over the whole
index tensor. Deformable attention's gathers read 350,000 indices per encoder layer, and those four ops took
7.5 ms a layer on this host (bench/op_profile.py), 2 % of the whole model. Where the indices are provably
non-negative the fix-up adds zero: an interval analysis over the int32 ops that compute them (constants,
ADD, SUB, MUL, MAXIMUM, MINIMUM, RESHAPE) proves it, element by element, and the GATHER then reads the indices
directly. Indices the analysis cannot bound (a model input, a float cast) keep their fix-up.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

FIXUP_CHAIN = ("ADD", "MUL", "CAST", "LESS")


def _schema():
    from ai_edge_litert import schema_py_generated as schema
    return schema


class _Graph:
    """The main subgraph of a ModelT with its producers, op names and constants at hand."""

    def __init__(self, model):
        schema = _schema()
        self.model, self.graph = model, model.subgraphs[0]
        names = {code: name for name, code in vars(schema.BuiltinOperator).items() if not name.startswith("_")}
        self.name = lambda op: names.get(max(model.operatorCodes[op.opcodeIndex].builtinCode,
                                             model.operatorCodes[op.opcodeIndex].deprecatedBuiltinCode), "?")
        self.producer = {int(t): op for op in self.graph.operators for t in op.outputs}
        self.int32 = schema.TensorType.INT32
        self._bounds: dict[int, tuple] = {}

    def constant(self, index: int):
        tensor = self.graph.tensors[index]
        data = self.model.buffers[tensor.buffer].data if tensor.buffer < len(self.model.buffers) else None
        if data is None or tensor.type != self.int32:
            return None
        shape = tuple(int(d) for d in tensor.shape) if tensor.shape is not None else ()
        return np.frombuffer(bytes(bytearray(data)), dtype="<i4").astype(np.int64).reshape(shape)

    def bounds(self, index: int) -> tuple:
        """Element-wise (low, high) of an int32 tensor, float arrays broadcastable to its shape (int32 values are
        exact in float64); -inf and inf where the analysis knows no bound."""
        if index not in self._bounds:
            self._bounds[index] = self._compute_bounds(index)
        return self._bounds[index]

    def _compute_bounds(self, index: int) -> tuple:
        tensor, unknown = self.graph.tensors[index], (np.array(-np.inf), np.array(np.inf))
        value = self.constant(index)
        if value is not None:
            return value.astype(np.float64), value.astype(np.float64)
        op = self.producer.get(index)
        if tensor.type != self.int32 or op is None or getattr(op.builtinOptions, "fusedActivationFunction", 0):
            return unknown
        name = self.name(op)
        if name == "RESHAPE":
            low, high = self.bounds(int(op.inputs[0]))
            shape = tuple(int(d) for d in tensor.shape)
            low, high = np.broadcast_arrays(low, high)
            if low.size == int(np.prod(shape)):
                return low.reshape(shape), high.reshape(shape)
            return np.min(low), np.max(high)  # a broadcast bound: its extremes hold for every element
        if name not in ("ADD", "SUB", "MUL", "MAXIMUM", "MINIMUM") or len(op.inputs) != 2:
            return unknown
        a, b = self.bounds(int(op.inputs[0])), self.bounds(int(op.inputs[1]))
        if name == "ADD":
            return a[0] + b[0], a[1] + b[1]
        if name == "SUB":
            return a[0] - b[1], a[1] - b[0]
        if name == "MAXIMUM":
            return np.maximum(a[0], b[0]), np.maximum(a[1], b[1])
        if name == "MINIMUM":
            return np.minimum(a[0], b[0]), np.minimum(a[1], b[1])
        with np.errstate(invalid="ignore"):  # 0 * inf: a factor that is exactly zero makes the product zero
            products = [np.nan_to_num(x * y, nan=0.0, posinf=np.inf, neginf=-np.inf) for x in a for y in b]
        return np.minimum.reduce(np.broadcast_arrays(*products)), np.maximum.reduce(np.broadcast_arrays(*products))

    def fixed_up_indices(self, op):
        """For ADD(index, MUL(CAST(LESS(index, 0)), dim)) in either operand order: `index`, else None."""
        if self.name(op) != FIXUP_CHAIN[0]:
            return None
        for index, plus in (op.inputs, op.inputs[::-1]):
            mul = self.producer.get(int(plus))
            if mul is None or self.name(mul) != "MUL":
                continue
            for cond in mul.inputs:
                cast = self.producer.get(int(cond))
                less = self.producer.get(int(cast.inputs[0])) if cast is not None and self.name(cast) == "CAST" else None
                if less is None or self.name(less) != "LESS" or int(less.inputs[0]) != int(index):
                    continue
                zero = self.constant(int(less.inputs[1]))
                if zero is not None and not zero.any():
                    return int(index)
        return None


def drop_nonnegative_gather_index_fixups(model) -> int:
    """Point every GATHER whose fixed-up indices are proven >= 0 at the indices themselves, drop the ops left
    without a reader, and say how many gathers were rewritten."""
    g = _Graph(model)
    rewritten = 0
    for op in g.graph.operators:
        if g.name(op) != "GATHER":
            continue
        fixup = g.producer.get(int(op.inputs[1]))
        index = g.fixed_up_indices(fixup) if fixup is not None else None
        if index is not None and np.all(g.bounds(index)[0] >= 0):
            op.inputs = np.array([op.inputs[0], index, *op.inputs[2:]], dtype=np.int32)
            rewritten += 1
    if rewritten:
        _drop_unread_ops(g.graph)
        _drop_unused_op_codes(model)
    return rewritten


def _drop_unread_ops(graph) -> None:
    """Remove, until none is left, every op with outputs that no op reads and that are not graph outputs (an op
    without outputs, such as a variable assignment, acts through its state and stays)."""
    while True:
        read = {int(t) for op in graph.operators for t in op.inputs} | {int(t) for t in graph.outputs}
        kept = [op for op in graph.operators if op.outputs is None or not len(op.outputs)
                or any(int(t) in read for t in op.outputs)]
        if len(kept) == len(graph.operators):
            return
        graph.operators = kept


def _drop_unused_op_codes(model) -> None:
    """Remove the operator codes that no op uses any more: LiteRT's loaders resolve every code in the file, and
    some (the calibrator's) refuse one they have no kernel for, used or not."""
    used = sorted({op.opcodeIndex for graph in model.subgraphs for op in graph.operators})
    new_index = {old: new for new, old in enumerate(used)}
    model.operatorCodes = [model.operatorCodes[old] for old in used]
    for graph in model.subgraphs:
        for op in graph.operators:
            op.opcodeIndex = new_index[op.opcodeIndex]


def rewrite_file(source: Path, target: Path) -> dict[str, int]:
    """Apply every rewrite to the .tflite at `source`, write it to `target`; how many rewrites each made."""
    import flatbuffers

    schema = _schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(Path(source).read_bytes(), 0))
    made = {"drop_nonnegative_gather_index_fixups": drop_nonnegative_gather_index_fixups(model)}
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    Path(target).write_bytes(builder.Output())
    return made
