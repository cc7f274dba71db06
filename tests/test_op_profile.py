"""bench/op_profile.py cuts each op out of a real .tflite faithfully: alone, fed the whole run's tensors, every op
computes what it computed in the graph."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench.op_profile import profile
from tools.tflite_graph import read_graph


def _graph(path):
    import tensorflow as tf

    weights = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    table = np.random.default_rng(1).standard_normal((10, 4)).astype(np.float32)

    def model(x, index):
        hidden = tf.nn.relu(tf.matmul(x, weights) + 1.0)  # FULLY_CONNECTED, fused ReLU
        rows = tf.gather(tf.reshape(hidden, (-1, 4)) + table[:6], index)  # RESHAPE, ADD, GATHER
        return tf.reduce_sum(rows * 2.0, 1)  # MUL, SUM

    module = tf.Module()
    module.f = tf.function(model, input_signature=[tf.TensorSpec((3, 16), tf.float32), tf.TensorSpec((5, 2), tf.int32)])
    converter = tf.lite.TFLiteConverter.from_concrete_functions([module.f.get_concrete_function()], module)
    path.write_bytes(converter.convert())
    return path


def test_every_op_alone_computes_what_it_computed_in_the_graph(tmp_path):
    path = _graph(tmp_path / "small.tflite")
    record = profile(path, threads=1, runs=2, check=True)
    graph = read_graph(path)
    assert [r["op"] for r in record["ops"]] == [op.name for op in graph.ops]
    assert {"FULLY_CONNECTED", "GATHER", "SUM"} <= {r["op"] for r in record["ops"]}
    for row in record["ops"]:
        assert row["max_abs_vs_graph"] <= 1e-5, row
        assert row["ms"] > 0
    assert record["whole_ms"] > 0
    assert record["by_type_ms"]["GATHER"] == pytest.approx(sum(r["ms"] for r in record["ops"] if r["op"] == "GATHER"), abs=1e-3)


def test_the_record_is_json(tmp_path):
    """--json writes the record as it is: shapes read from the flatbuffer are numpy integers until converted."""
    record = profile(_graph(tmp_path / "small.tflite"), threads=1, runs=1)
    again = json.loads(json.dumps(record))
    assert again["ops"][0]["outputs"][0]["shape"] == [3, 8]
