"""The convert stage's .tflite rewrites: a GATHER's negative-index fix-up (onnx2tf's LESS, CAST, MUL, ADD) goes
only where the indices are proven non-negative, and every output stays bit-identical."""
from __future__ import annotations

import numpy as np
import pytest

from tools.tflite_graph import read_graph
from tools.tflite_rewrites import rewrite_file

ROWS = 12


def _fixed_up_gather(path, indices_of):
    """A .tflite that gathers rows of `table` at indices_of(index) behind onnx2tf's fix-up, written as onnx2tf
    writes it (ops/Gather.py): index + cast(index < 0) * rows."""
    import tensorflow as tf

    table = np.random.default_rng(0).standard_normal((ROWS, 4)).astype(np.float32)

    def model(x, index):
        index = indices_of(tf, index)
        index = index + tf.cast(index < 0, tf.int32) * ROWS
        return tf.gather(x + table, index)

    module = tf.Module()
    module.f = tf.function(model, input_signature=[tf.TensorSpec((ROWS, 4), tf.float32), tf.TensorSpec((3, 5), tf.int32)])
    converter = tf.lite.TFLiteConverter.from_concrete_functions([module.f.get_concrete_function()], module)
    path.write_bytes(converter.convert())
    return path


def _run(path, x, index):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    interpreter.allocate_tensors()
    for detail in interpreter.get_input_details():
        interpreter.set_tensor(detail["index"], x if detail["dtype"] == np.float32 else index)
    interpreter.invoke()
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


LOW, HIGH = np.zeros((3, 5), np.int32), np.full((3, 5), ROWS - 1, np.int32)
CASES = {  # name: (indices the graph computes, whether they are provably >= 0)
    "clamped": (lambda tf, i: tf.minimum(tf.maximum(i, LOW), HIGH), True),
    "clamped, then a row below": (lambda tf, i: tf.maximum(i, LOW) * 2 - 1, False),
    "raised above zero, then shifted back to it": (lambda tf, i: tf.maximum(i, LOW + 3) - 3, True),
    "a model input": (lambda tf, i: i, False),
}


@pytest.mark.parametrize("case", CASES)
def test_the_fixup_goes_only_where_the_indices_are_proven_non_negative(tmp_path, case):
    indices_of, provable = CASES[case]
    source = _fixed_up_gather(tmp_path / "source.tflite", indices_of)
    before = read_graph(source).op_histogram()
    assert before["LESS"] == 1 and before["CAST"] == 1
    made = rewrite_file(source, tmp_path / "rewritten.tflite")
    after = read_graph(tmp_path / "rewritten.tflite").op_histogram()
    assert made == {"drop_nonnegative_gather_index_fixups": int(provable)}
    assert after["LESS"] == (0 if provable else 1)
    assert after["GATHER"] == 1 and sum(before.values()) - sum(after.values()) == (4 if provable else 0)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    # indices beyond both ends: the clamps and the kept fix-ups must do their work in both graphs
    index = rng.integers(-ROWS // 2, ROWS // 2, (3, 5)).astype(np.int32)
    assert np.array_equal(_run(source, x, index), _run(tmp_path / "rewritten.tflite", x, index))


def test_a_rewritten_graph_keeps_only_the_op_codes_it_uses_and_calibrates(tmp_path):
    """LiteRT's calibrator resolves every operator code in the file: one left without ops (LESS) made it fail."""
    from ai_edge_litert import schema_py_generated as schema

    from tools.stages.quantize import calibrated

    source = _fixed_up_gather(tmp_path / "source.tflite", CASES["clamped"][0])
    rewrite_file(source, tmp_path / "rewritten.tflite")
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel((tmp_path / "rewritten.tflite").read_bytes(), 0))
    used = {op.opcodeIndex for graph in model.subgraphs for op in graph.operators}
    assert used == set(range(len(model.operatorCodes)))
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.standard_normal((ROWS, 4)).astype(np.float32), "index": HIGH.copy()} for _ in range(2)]
    assert calibrated((tmp_path / "rewritten.tflite").read_bytes(), feeds)
