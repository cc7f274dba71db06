"""Read a .tflite flatbuffer without running it: ops, tensors, types and constants, through TensorFlow's schema.

Used by every check that looks at types or ops rather than values: no interpreter, no allocation, so a
graph that does not load (or is too big to run here) can still be inspected.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


TYPE_BYTES = {"FLOAT32": 4, "FLOAT16": 2, "INT32": 4, "UINT32": 4, "INT64": 8, "UINT64": 8, "INT16": 2, "UINT16": 2,
              "INT8": 1, "UINT8": 1, "BOOL": 1, "FLOAT64": 8, "COMPLEX64": 8}
# Builtin options worth reading, by op: option class in the schema and the fields kept.
OPTIONS = {"STRIDED_SLICE": ("StridedSliceOptions", ("NewAxisMask", "EllipsisMask")),
           "BATCH_MATMUL": ("BatchMatMulOptions", ("AdjX", "AdjY"))}


@dataclass(frozen=True)
class Tensor:
    index: int
    name: str
    type: str         # FLOAT32, INT8, INT32, ...
    shape: tuple
    constant: bool    # holds data in the file (weights, biases, fixed indices)
    scales: int       # number of quantization scales: 0 float, 1 per-tensor, >1 per-channel
    dynamic: bool = False  # its shape signature has an unknown (-1) dimension

    @property
    def bytes(self) -> int:
        size = TYPE_BYTES.get(self.type, 4)
        for d in self.shape:
            size *= max(d, 0)
        return size


@dataclass(frozen=True)
class Op:
    index: int
    name: str         # builtin name (CONV_2D) or the custom code
    builtin: bool
    inputs: tuple
    outputs: tuple
    options: dict = field(default_factory=dict)  # the builtin options that placement rules read


@dataclass(frozen=True)
class Graph:
    ops: list
    tensors: list
    inputs: tuple
    outputs: tuple
    signature_inputs: dict   # signature name (the ONNX input name) -> tensor index

    def op_histogram(self) -> Counter:
        return Counter(op.name for op in self.ops)

    def tensors_of_type(self, *types: str) -> list:
        return [t for t in self.tensors if t.type in types]


def _options(schema, op, name: str) -> dict:
    if name not in OPTIONS or op.BuiltinOptions() is None:
        return {}
    cls_name, fields = OPTIONS[name]
    options = getattr(schema, cls_name)()
    table = op.BuiltinOptions()
    options.Init(table.Bytes, table.Pos)
    return {f: int(getattr(options, f)()) for f in fields}


def read_graph(source: Path | bytes) -> Graph:
    """The main subgraph of a .tflite file (or its bytes)."""
    from tensorflow.lite.python import schema_py_generated as schema

    data = source if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes()
    model = schema.Model.GetRootAsModel(data, 0)
    op_names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    type_names = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    graph = model.Subgraphs(0)
    tensors = []
    for i in range(graph.TensorsLength()):
        t = graph.Tensors(i)
        buffer = model.Buffers(t.Buffer()) if t.Buffer() < model.BuffersLength() else None
        constant = buffer is not None and (buffer.DataLength() > 0 or buffer.Size() > 0)
        quant = t.Quantization()
        signature = t.ShapeSignatureAsNumpy() if t.ShapeSignatureLength() else ()
        tensors.append(Tensor(i, (t.Name() or b"").decode(), type_names.get(t.Type(), str(t.Type())),
                              tuple(int(d) for d in t.ShapeAsNumpy()) if t.ShapeLength() else (),
                              constant, quant.ScaleLength() if quant is not None else 0,
                              any(int(d) < 0 for d in signature)))
    ops = []
    for i in range(graph.OperatorsLength()):
        op = graph.Operators(i)
        code = model.OperatorCodes(op.OpcodeIndex())
        builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
        name = op_names.get(builtin, str(builtin))
        is_builtin = name != "CUSTOM"
        if not is_builtin:
            name = (code.CustomCode() or b"?").decode()
        ops.append(Op(i, name, is_builtin, tuple(int(x) for x in op.InputsAsNumpy()) if op.InputsLength() else (),
                      tuple(int(x) for x in op.OutputsAsNumpy()) if op.OutputsLength() else (), _options(schema, op, name)))
    signature = {}
    if model.SignatureDefsLength():
        sig = model.SignatureDefs(0)
        signature = {sig.Inputs(i).Name().decode(): sig.Inputs(i).TensorIndex() for i in range(sig.InputsLength())}
    return Graph(ops, tensors, tuple(int(x) for x in graph.InputsAsNumpy()), tuple(int(x) for x in graph.OutputsAsNumpy()),
                 signature)
