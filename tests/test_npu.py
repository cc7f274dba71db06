"""The VX-delegate placement rules on small graphs built to hit each kind of rule, partition counting, and the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from tools.npu import analyse, load_rules


def _tflite(tmp_path, fn, signature, name="model", int16=False):
    """Convert a tf.function to a .tflite file (16x8 quantized when int16)."""
    import tensorflow as tf

    concrete = tf.function(fn, input_signature=signature).get_concrete_function()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete], tf.Module())
    if int16:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_ops = [tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8]
        shape = [d or 1 for d in signature[0].shape]
        converter.representative_dataset = lambda: ([np.random.default_rng(i).normal(size=shape).astype(np.float32)] for i in range(4))
    path = tmp_path / f"{name}.tflite"
    path.write_bytes(converter.convert())
    return path


def _spec(shape, dtype="float32"):
    import tensorflow as tf

    return tf.TensorSpec(shape, getattr(tf, dtype))


def _by_op(report):
    out = {}
    for p in report["ops"]:
        out.setdefault(p["op"], []).append(p)
    return out


def test_int64_gather_indices_fall_back_and_int32_ones_do_not(tmp_path):
    import tensorflow as tf

    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    for dtype, placement in (("int64", "CPU"), ("int32", "NPU")):
        path = _tflite(tmp_path, lambda i: tf.gather(table, i) * 2.0, [_spec([3], dtype)], name=dtype)
        gather = _by_op(analyse(path))["GATHER"][0]
        assert gather["placement"] == placement
        assert ("any input is INT64 (BROADCAST_TO excepted)" in gather["reasons"]) == (dtype == "int64")


def test_int16_activations_put_every_node_on_the_cpu(tmp_path):
    import tensorflow as tf

    weights = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    path = _tflite(tmp_path, lambda x: tf.nn.relu(tf.matmul(x, weights)), [_spec([1, 8])], int16=True)
    report = analyse(path)
    fc = _by_op(report)["FULLY_CONNECTED"][0]
    assert fc["placement"] == "CPU" and "any output is INT16" in fc["reasons"]
    assert report["summary"]["macs_npu_pct"] == 0.0


def test_dynamic_shapes_fall_back(tmp_path):
    import tensorflow as tf

    path = _tflite(tmp_path, lambda x: tf.reshape(x * 2.0, [-1, 2]), [_spec([None, 4])])
    reshape = _by_op(analyse(path))["RESHAPE"][0]
    assert reshape["placement"] == "CPU"
    assert any("shape is not static" in r for r in reshape["reasons"])


def test_unregistered_op_falls_back_and_splits_the_graph_in_two_partitions(tmp_path):
    import tensorflow as tf

    path = _tflite(tmp_path, lambda x: tf.math.cumsum(x + 1.0, axis=1) * 3.0, [_spec([1, 16])])
    report = analyse(path)
    assert [(p["op"], p["placement"]) for p in report["ops"]] == [("ADD", "NPU"), ("CUMSUM", "CPU"), ("MUL", "NPU")]
    assert report["fallbacks"] == {"CUMSUM": {"count": 1, "reasons": {"CUMSUM is not registered in the VX delegate": 1}}}
    assert report["summary"]["partitions"] == 2 and report["summary"]["cpu_subsets"] == 1
    assert report["summary"]["crossing_tensors"] == 2  # ADD's output to the CPU, CUMSUM's back to the NPU


def test_partition_boundaries_are_priced_by_their_stated_prior(tmp_path):
    import tensorflow as tf

    from tools.estimate import estimate, load_model

    model = load_model()
    overhead = model["npu"]["coefficients"]["overhead_ms"]
    split = estimate(analyse(_tflite(tmp_path, lambda x: tf.math.cumsum(x + 1.0, axis=1) * 3.0, [_spec([1, 16])])), model)
    whole = estimate(analyse(_tflite(tmp_path, lambda x: (x + 1.0) * 3.0, [_spec([1, 16])], name="whole")), model)
    boundaries = split["boundaries"]
    assert boundaries["partitions"] == 2 and boundaries["crossing_bytes"] == 2 * 16 * 4  # two float [1, 16] copies
    assert boundaries["ms"] == pytest.approx(overhead + 128 / 4e6, abs=1e-3) and "prior, not fitted" in boundaries["basis"]
    assert whole["boundaries"]["ms"] == 0
    assert split["npu"]["ms"] == pytest.approx(whole["npu"]["ms"] + boundaries["ms"], abs=0.01)


def test_independent_npu_ops_on_both_sides_of_a_cpu_op_join_one_partition(tmp_path):
    import tensorflow as tf

    # a + 1 and a * 2 do not depend on the CUMSUM: TFLite puts them in one delegate partition.
    path = _tflite(tmp_path, lambda a: (a + 1.0, tf.math.cumsum(a, axis=1), a * 2.0), [_spec([1, 16])])
    summary = analyse(path)["summary"]
    assert summary["partitions"] == 1 and summary["ops_npu"] == 2


def test_a_conditional_op_stays_on_the_npu_when_its_condition_holds(tmp_path):
    import tensorflow as tf

    const = _tflite(tmp_path, lambda x: tf.reshape(x, [2, 4]) + 1.0, [_spec([1, 8])], name="const")
    assert _by_op(analyse(const))["RESHAPE"][0]["placement"] == "NPU"
    fed = _tflite(tmp_path, lambda x, shape: tf.reshape(x, shape) + 1.0, [_spec([1, 8]), _spec([2], "int32")], name="fed")
    reshape = _by_op(analyse(fed))["RESHAPE"][0]
    assert reshape["placement"] == "CPU" and "input 1 must be constant" in reshape["reasons"]


def test_an_op_the_older_bsp_lacks_falls_back_there_only(tmp_path):
    import tensorflow as tf

    path = _tflite(tmp_path, lambda a, b: tf.math.squared_difference(a, b), [_spec([1, 8]), _spec([1, 8])])
    assert analyse(path, "lf-6.6")["summary"]["ops_npu"] == 1
    old = analyse(path, "lf-5.15")
    assert old["fallbacks"]["SQUARED_DIFFERENCE"]["reasons"] == {"SQUARED_DIFFERENCE is not registered in the lf-5.15 delegate": 1}


def test_macs_of_a_convolution_and_a_dense_layer(tmp_path):
    import tensorflow as tf

    kernel = np.ones((3, 3, 4, 8), np.float32)
    dense = np.ones((8, 5), np.float32)
    path = _tflite(tmp_path, lambda x: tf.matmul(tf.reshape(tf.nn.conv2d(x, kernel, 1, "VALID"), [-1, 8]), dense),
                   [_spec([1, 6, 6, 4])])
    ops = _by_op(analyse(path))
    assert ops["CONV_2D"][0]["macs"] == 4 * 4 * 8 * (3 * 3 * 4)  # output positions x channels x kernel volume
    assert ops["FULLY_CONNECTED"][0]["macs"] == 16 * 5 * 8


def test_every_check_the_rules_name_is_implemented():
    from tools.npu import check_fails
    from tools.tflite_graph import Graph, Op, Tensor

    t = Tensor(0, "t", "FLOAT32", (1, 4, 4, 4), False, 0)
    graph = Graph([], [t, t], (), (), {})
    op = Op(0, "X", True, (0, 1, 1, 1), (0,))
    for rule in load_rules()["ops"].values():
        for check in rule.get("checks", []):
            check_fails(graph, op, check)  # raises KeyError for a check with no code


def test_cli_prints_the_summary_and_names_bad_arguments(tmp_path):
    import tensorflow as tf

    path = _tflite(tmp_path, lambda x: tf.math.cumsum(x, axis=1), [_spec([1, 4])])
    run = lambda *a: subprocess.run([sys.executable, "-m", "tools.npu", *a], cwd=ROOT, capture_output=True, text=True)  # noqa: E731
    ok = run(str(path), "--json", str(tmp_path / "r.json"))
    assert ok.returncode == 0 and "CUMSUM x1: CUMSUM is not registered in the VX delegate (1)" in ok.stdout
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["ops"] == 1
    missing = run(str(tmp_path / "nope.tflite"))
    assert missing.returncode == 1 and "nope.tflite: no such file" in missing.stderr
    bad = run(str(path), "--bsp", "lf-4.0")
    assert bad.returncode == 1 and "unknown BSP 'lf-4.0'; the rules know ['lf-5.15', 'lf-6.6']" in bad.stderr


@pytest.mark.parametrize("name", ["tiny_resnet8_cifar_32", "ds_cnn_kws"])
def test_estimate_prices_a_graph_as_the_fit_saw_it(tmp_path, name):
    """The 8MP estimate of a model the cost model was fitted on: the MACs the estimate sums by class from the
    placement are those the fit read, so it reproduces the fit's own prediction, within its stated range of
    the published latency."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fit_cost_model as bench

    from tools.estimate import estimate, load_model

    path = bench.int8_tflite(bench.build(name), tmp_path / f"{name}.tflite")
    model = load_model()
    result = estimate(analyse(path), model)
    row = bench.features(path)
    for target, key in (("npu", "npu"), ("cpu", "cpu_4_threads")):
        c = model[target]["coefficients"]
        fitted = (c["overhead_ms"] + row["dense_macs"] / 1e6 * c["ms_per_m_dense_macs"]
                  + row["depthwise_macs"] / 1e6 * c["ms_per_m_depthwise_macs"] + row["bytes"] / 1e6 * c.get("ms_per_mb", 0))
        assert result[key]["ms"] == pytest.approx(fitted, abs=0.01)
        published = bench.PUBLISHED[name][0 if target == "npu" else 1]
        low, high = result[key]["range_ms"]
        assert low <= result[key]["ms"] <= high and low / 1.5 <= published <= high * 1.5
    assert result["label"] == "estimated, not measured" and result["cpu_fallback_macs"] == 0
    assert result["float_ops"]["count"] == 0, "an int8-I/O graph computes nothing in float"
    assert result["boundaries"]["ms"] == 0, "a wholly delegated graph, as the fit saw it: no boundary to price"
    assert set(model["npu"]["loo_relative_errors"]) == set(bench.PUBLISHED), "the committed fit covers every published model"


def test_cost_model_fit_and_leave_one_out_on_a_synthetic_table():
    """Latencies made from known rates: the fit finds them and every leave-one-out error is nil; a model
    published 50 % slower than the rates say stands out as the one the others predict worst. Of the two
    candidate models, the one the latencies were made with is chosen: with a bytes term the MAC-only model
    cannot follow them; without one, both fit and the smaller is kept."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fit_cost_model as bench

    macs_only = bench.CANDIDATES["macs"]
    rates = np.array([0.4, 0.003, 0.02])  # overhead ms, ms per M dense MACs, ms per M depthwise MACs
    rows = [{"model": f"m{i}", "dense_macs": d * 1e6, "depthwise_macs": w * 1e6, "bytes": b * 1e6} for i, (d, w, b) in
            enumerate(((10, 1, 2), (300, 20, 9), (4000, 30, 30), (600, 300, 4), (50, 5, 40), (2500, 0, 12), (80, 2, 1)))]
    for row in rows:
        row["npu_ms"] = float(bench.design([row], macs_only) @ rates)
    assert np.allclose(bench.fit(rows, "npu", macs_only), rates, rtol=1e-6)
    assert np.allclose(bench.leave_one_out(rows, "npu", macs_only), 0, atol=1e-6)
    assert bench.fitted(rows, "npu")["candidate"] == "macs"

    with_bytes = [{**row, "npu_ms": row["npu_ms"] + 0.05 * row["bytes"] / 1e6} for row in rows]
    chosen = bench.fitted(with_bytes, "npu")
    assert chosen["candidate"] == "macs_and_bytes" and chosen["loo_max_abs"] < 1e-4
    assert chosen["coefficients"]["ms_per_mb"] == pytest.approx(0.05, rel=1e-4)
    assert chosen["candidates"]["macs"]["loo_median_abs"] > 0.05

    rows[3]["npu_ms"] *= 1.5
    errors = bench.leave_one_out(rows, "npu", macs_only)
    assert int(np.argmax(np.abs(errors))) == 3 and errors[3] < -0.2


def test_float_ops_of_a_mixed_precision_graph_are_priced_at_the_cpu_rates():
    """The VX delegate accepts float ops, but its float path is slower than the A53s: the estimate prices an op
    that computes in float at the CPU rates, wherever the rules place it, and says how many there were."""
    from tools.estimate import estimate, load_model

    model = load_model()
    npu, cpu = model["npu"]["coefficients"], model["cpu"]["coefficients"]
    summary = {"partitions": 1, "crossing_tensors": 0, "crossing_bytes": 0}
    op = {"op": "FULLY_CONNECTED", "placement": "NPU", "macs": 500_000_000, "bytes": 2_000_000, "reasons": []}
    int8 = estimate({"ops": [{**op, "float": False}], "summary": summary}, model)
    mixed = estimate({"ops": [{**op, "float": True}], "summary": summary}, model)
    rate = lambda c: 500 * c["ms_per_m_dense_macs"] + 2 * c.get("ms_per_mb", 0)  # noqa: E731
    assert int8["npu"]["ms"] == pytest.approx(npu["overhead_ms"] + rate(npu), abs=0.01)
    assert mixed["npu"]["ms"] == pytest.approx(npu["overhead_ms"] + rate(cpu), abs=0.01)
    assert mixed["npu"]["ms"] > 5 * int8["npu"]["ms"]
    assert (int8["float_ops"]["count"], mixed["float_ops"]["count"], mixed["float_ops"]["macs"]) == (0, 1, 500_000_000)
    assert mixed["cpu_4_threads"]["ms"] == int8["cpu_4_threads"]["ms"]


def test_a_reshape_moves_no_bytes_and_a_graph_beyond_the_fit_says_by_how_much(tmp_path):
    """A RESHAPE is a view on the NPU: it adds no bytes to the op's count, where the ADD beside it moves its
    tensors. A graph whose MACs exceed every fitted model's is flagged with the multiple; one inside is not."""
    import tensorflow as tf

    from tools.estimate import estimate, load_model

    path = _tflite(tmp_path, lambda x: tf.reshape(x + 1.0, [4, 64]) * 3.0, [_spec([1, 256])])
    ops = _by_op(analyse(path))
    assert ops["RESHAPE"][0]["bytes"] == 0
    assert ops["ADD"][0]["bytes"] >= 2 * 256 * 4
    model = load_model()
    largest = max(r["dense_macs"] for r in model["models"])
    summary = {"partitions": 1, "crossing_tensors": 0, "crossing_bytes": 0}
    op = {"op": "FULLY_CONNECTED", "placement": "NPU", "float": False, "bytes": 1000, "reasons": []}
    big = estimate({"ops": [{**op, "macs": 3 * largest}], "summary": summary}, model)
    small = estimate({"ops": [{**op, "macs": largest // 10}], "summary": summary}, model)
    assert big["beyond_fit"] == {"dense_macs": 3.0} and small["beyond_fit"] == {}
