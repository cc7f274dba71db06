"""INT8: the fidelity metrics on known arrays, calibration sets (building, hashing, the validation overlap
check), entry rules, and the layer-by-layer report on a tiny INT8 graph with one layer damaged on purpose."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from conftest import ROOT, tiny_entry_data, write_entry, zero_weights_of_op
from tools.calibration import calibration_set, overlap_with_validation
from tools.entry import EntryError, load_entry
from tools.metrics import agreement, cosine, detections, match_detections, sqnr_db


def test_sqnr_of_a_known_noise_level():
    reference = np.ones(1000)
    assert sqnr_db(reference, reference + 0.1) == pytest.approx(20.0)  # 1000 / (1000 * 0.01)
    assert sqnr_db(reference, reference + 0.01) == pytest.approx(40.0)
    assert sqnr_db(reference, reference) == math.inf
    assert sqnr_db(np.zeros(4), np.ones(4)) == -math.inf


def test_cosine_of_known_directions():
    a = np.array([1.0, 0.0, 0.0])
    assert cosine(a, 3 * a) == pytest.approx(1.0)
    assert cosine(a, -a) == pytest.approx(-1.0)
    assert cosine(a, np.array([0.0, 2.0, 0.0])) == pytest.approx(0.0)


def _logits(*best: tuple[int, float], classes: int = 3) -> np.ndarray:
    """One row per query whose class `c` has probability p under a sigmoid; the others far below."""
    rows = np.full((len(best), classes), -10.0)
    for row, (c, p) in zip(rows, best):
        row[c] = math.log(p / (1 - p))
    return rows


def test_detections_keep_queries_above_the_score_threshold():
    boxes = np.array([[0.5, 0.5, 0.2, 0.2], [0.2, 0.2, 0.1, 0.1], [0.8, 0.8, 0.1, 0.1]])
    found = detections(_logits((0, 0.9), (1, 0.2), (2, 0.6)), boxes, "sigmoid", 0.3)
    assert [(label, round(score, 3)) for label, score, _ in found] == [(0, 0.9), (2, 0.6)]
    assert np.allclose(found[0][2], [0.4, 0.4, 0.6, 0.6])  # cx, cy, w, h -> x0, y0, x1, y1


def test_detection_matching_counts_same_class_overlaps_only():
    reference = detections(_logits((0, 0.9), (1, 0.8), (2, 0.7)),
                           np.array([[0.5, 0.5, 0.2, 0.2], [0.2, 0.2, 0.1, 0.1], [0.8, 0.8, 0.1, 0.1]]), "sigmoid", 0.3)
    test = detections(_logits((0, 0.85), (1, 0.8), (0, 0.7)),  # same box; box moved by half its width; wrong class
                      np.array([[0.5, 0.5, 0.2, 0.2], [0.25, 0.2, 0.1, 0.1], [0.8, 0.8, 0.1, 0.1]]), "sigmoid", 0.3)
    counts = match_detections(reference, test, iou_threshold=0.5)
    assert counts == {"reference": 3, "test": 3, "matched": 1, "iou_sum": pytest.approx(1.0)}
    result = agreement(counts)
    assert (result["precision"], result["recall"], result["mean_iou"]) == (pytest.approx(1 / 3), pytest.approx(1 / 3), pytest.approx(1.0))
    loose = match_detections(reference, test, iou_threshold=0.3)  # IoU of the moved box: 0.005 / 0.015 = 1/3
    assert loose["matched"] == 2 and loose["iou_sum"] == pytest.approx(1 + 1 / 3)


def test_two_empty_detection_sets_agree_and_one_empty_set_does_not():
    assert agreement(match_detections([], [], 0.5))["recall"] == 1.0
    one = [(0, 0.9, np.array([0, 0, 1, 1.0]))]
    assert agreement(match_detections(one, [], 0.5))["recall"] == 0.0
    assert agreement(match_detections([], one, 0.5))["precision"] == 0.0


@pytest.fixture
def int8_entry(tmp_path):
    def make(**calibration):
        data = tiny_entry_data("dn_detr", "dn_q")
        data["quantization"]["calibration"] = {**data["quantization"]["calibration"], **calibration}
        return load_entry(write_entry(tmp_path / "zoo", data))
    return make


def test_calibration_set_is_counted_hashed_and_reproducible(int8_entry):
    entry = int8_entry(samples=["skimage:rocket", "skimage:coins"], count=5, seed=3)
    first, again = calibration_set(entry), calibration_set(entry)
    assert len(first.samples) == 5 and first.sha256 == again.sha256
    assert [s["ref"] for s in first.sources] == ["skimage:rocket", "skimage:coins"]
    assert first.samples[0]["pixel_values"].shape == (1, 3, 96, 96)
    assert not np.array_equal(first.samples[2]["pixel_values"], first.samples[0]["pixel_values"])  # a crop, not a copy
    assert calibration_set(int8_entry(samples=["skimage:rocket", "skimage:coins"], count=5, seed=4)).sha256 != first.sha256
    assert overlap_with_validation(entry, first) == []


def test_a_validation_photo_under_another_name_is_found(int8_entry, tmp_path):
    import skimage.data
    from PIL import Image

    Image.fromarray(skimage.data.astronaut()).save(tmp_path / "copy.png")  # lossless: the same pixels, another name
    entry = int8_entry(samples=["skimage:rocket", f"file:{tmp_path / 'copy.png'}"], count=2)
    assert overlap_with_validation(entry, calibration_set(entry)) == [
        f"calibration sample 1 (= validation sample skimage:astronaut)",
        f"file:{tmp_path / 'copy.png'} (= validation sample skimage:astronaut)"]


def test_a_validation_input_inside_an_npy_calibration_file_is_found(int8_entry, tmp_path):
    from tools.inputs import validation_samples

    probe = int8_entry()
    rows = np.concatenate([np.zeros((1, 3, 96, 96), np.float32), validation_samples(probe)[1]["pixel_values"]])
    np.save(tmp_path / "calib.npy", rows)
    entry = int8_entry(kind="npy", path=str(tmp_path / "calib.npy"), count=2)
    assert overlap_with_validation(entry, calibration_set(entry)) == [
        "calib.npy[1] (= validation sample skimage:coffee)", "calibration sample 1 (= validation sample skimage:coffee)"]


def test_calibration_npy_of_the_wrong_shape_names_file_and_shape(int8_entry, tmp_path):
    np.save(tmp_path / "calib.npy", np.zeros((4, 3, 32, 32), np.float32))
    entry = int8_entry(kind="npy", path=str(tmp_path / "calib.npy"))
    with pytest.raises(EntryError, match=r"quantization\.calibration\.path: .*calib\.npy holds shape \(4, 3, 32, 32\); "
                                         r"expected \(N, 3, 96, 96\)"):
        calibration_set(entry)


def test_calibration_glob_without_files_is_an_entry_error(int8_entry, tmp_path):
    entry = int8_entry(kind="files", glob=str(tmp_path / "nothing" / "*.jpg"))
    with pytest.raises(EntryError, match=r"quantization\.calibration\.glob: no file matches"):
        calibration_set(entry)


@pytest.mark.parametrize("change,path,message", [
    (lambda q: q.pop("fidelity"), "$.quantization", "'fidelity' is required here"),
    (lambda q: q["variants"].append({"name": "int8_pt", "weights": "per-channel"}), "$.quantization.variants", "unique"),
    (lambda q: q["variants"].__setitem__(0, {"name": "int16_act", "weights": "per-tensor"}), "$.quantization.variants[0].name", "int8_"),
    (lambda q: q["calibration"].pop("samples"), "$.quantization.calibration.samples", "needs 'samples'"),
    (lambda q: q["fidelity"].__setitem__("outputs", {"scores": {"min_sqnr_db": 10}}), "$.quantization.fidelity.outputs.scores", "no output"),
])
def test_bad_quantization_sections_are_named(tmp_path, change, path, message):
    data = tiny_entry_data("dn_detr", "dn_q")
    change(data["quantization"])
    with pytest.raises(EntryError) as err:
        load_entry(write_entry(tmp_path, data))
    assert err.value.json_path == path and message in err.value.message


def test_layer_report_points_at_the_damaged_layer(built, tmp_path):
    from tools.stages.fidelity import layer_report
    from tools.stages.validate import load_reference
    from tools.tflite_graph import read_graph

    _, parallel, _ = built  # the build no test changes
    build = parallel.build / "dn_tiny"
    int8 = build / "model_int8_pt.tflite"
    feed = load_reference(build / "reference.npz")[0]["input"]
    healthy = layer_report(build / "model_fp32.tflite", int8, feed, 20.0, 5)
    convs = [op.index for op in read_graph(int8).ops if op.name == "CONV_2D"]
    target = convs[2]
    assert healthy["first_diverging"] is None or healthy["first_diverging"]["op_index"] > target
    damaged = tmp_path / "damaged.tflite"
    damaged.write_bytes(zero_weights_of_op(int8.read_bytes(), target))
    report = layer_report(build / "model_fp32.tflite", damaged, feed, 20.0, 5)
    assert report["first_diverging"]["op_index"] == target and report["first_diverging"]["op"] == "CONV_2D"
    assert report["first_diverging"]["sqnr_db"] < 3


def test_int8_variants_hold_int8_activations_only(built):
    from tools.tflite_graph import read_graph

    _, parallel, _ = built
    record = json.loads((parallel.build / "dn_tiny" / "quantize.json").read_text())
    assert set(record["variants"]) == {"int8_pt", "int8_pc"}
    for name, variant in record["variants"].items():
        graph = read_graph(parallel.build / "dn_tiny" / variant["file"])
        assert not graph.tensors_of_type("INT16", "INT64")
        assert "INT8" in variant["activation_types"]
        scales = {t.scales for t in graph.tensors if t.constant and t.type == "INT8"}
        assert (max(scales) > 1) == (variant["weights"] == "per-channel")


def _int8_product(tmp_path, second_is_relu: bool):
    """An INT8 graph of one product of two run-time tensors, the second a ReLU output (zero point -128) or a
    signed one, calibrated and quantized by the quantize stage's own functions; with its fp32 graph."""
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    from tools.stages.quantize import calibrated, int8_graph

    def product(a, b):
        return tf.matmul(a - 0.5, tf.nn.relu(b) if second_is_relu else b - 0.5)

    specs = [tf.TensorSpec((64, 16, 4), tf.float32), tf.TensorSpec((64, 4, 16), tf.float32)]
    module = tf.Module()
    module.product = tf.function(product, input_signature=specs)
    tf.saved_model.save(module, str(tmp_path / "saved"), signatures=module.product.get_concrete_function())
    fp32 = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "saved")).convert()
    names = list(Interpreter(model_content=fp32).get_signature_runner().get_input_details())
    rng = np.random.default_rng(0)
    feeds = [{names[0]: rng.random((64, 16, 4), dtype=np.float32), names[1]: rng.random((64, 4, 16), dtype=np.float32)}
             for _ in range(4)]
    (tmp_path / "fp32.tflite").write_bytes(fp32)
    (tmp_path / "int8.tflite").write_bytes(int8_graph(calibrated(fp32, feeds), {"weights": "per-channel"}, {}))
    return tmp_path / "fp32.tflite", tmp_path / "int8.tflite", feeds[0]


def test_a_variant_keeps_float_what_it_and_the_entry_name_and_refuses_a_stale_name(tmp_path):
    """Mixed precision per variant: the entry's keep_float and the variant's own are both applied (the named
    product computes in float, the graph's other ops stay int8); a tensor name that no op writes is an
    error naming the entry file, the variant and the field, not an op silently left in int8."""
    from tools.stages import StageError
    from tools.stages.quantize import calibrated, float_ops, int8_graph, kept_float
    from tools.tflite_graph import read_graph

    fp32_path, _, feed = _int8_product(tmp_path, second_is_relu=False)
    fp32 = fp32_path.read_bytes()
    graph = read_graph(fp32)
    product = next(graph.tensors[op.outputs[0]].name for op in graph.ops if op.name == "BATCH_MATMUL")
    data = tiny_entry_data("dn_detr", "dn_keep")
    data["quantization"]["keep_float"] = {"ops": ["SOFTMAX"]}
    data["quantization"]["variants"] = [{"name": "int8_mixed", "weights": "per-channel", "keep_float": {"tensors": [product]}},
                                        {"name": "int8_stale", "weights": "per-channel", "keep_float": {"tensors": ["no/such/op"]}}]
    entry = load_entry(write_entry(tmp_path / "zoo", data))
    mixed, stale = entry.data["quantization"]["variants"]
    keep = kept_float(entry, mixed, graph)
    assert keep == {"ops": ["SOFTMAX"], "tensors": [product]}
    quantized = read_graph(int8_graph(calibrated(fp32, [feed]), mixed, keep))
    assert [op["op"] for op in float_ops(quantized)] == ["BATCH_MATMUL"]
    assert any(t.type == "INT8" for t in quantized.tensors if not t.constant), "the rest of the graph is int8"
    with pytest.raises(StageError) as refused:
        kept_float(entry, stale, graph)
    message = str(refused.value)
    assert "dn_keep.json" in message and "int8_stale" in message and "no/such/op" in message and "tools.npu" in message


@pytest.mark.parametrize("second_is_relu", [True, False])
def test_int8_products_run_on_kernels_that_compute_them(tmp_path, second_is_relu):
    """XNNPACK treats a run-time second operand of an int8 BATCH_MATMUL as symmetric: with a ReLU output there
    (zero point -128) its product is noise. The runner then takes the builtin kernels, which agree with fp32."""
    from ai_edge_litert.interpreter import Interpreter

    from tools.stages.validate import tflite_runner, xnnpack_miscomputes

    fp32, int8, feed = _int8_product(tmp_path, second_is_relu)
    flagged = xnnpack_miscomputes(Interpreter(model_path=str(int8)))
    assert bool(flagged) == second_is_relu
    expected = next(iter(tflite_runner(fp32)(feed).values()))
    run = tflite_runner(int8)
    assert run.kernels == ("builtin" if second_is_relu else "xnnpack")
    assert sqnr_db(expected, next(iter(run(feed).values()))) > 30
    if second_is_relu:  # what XNNPACK itself makes of it: the reason for the rule
        forced = Interpreter(model_path=str(int8)).get_signature_runner()
        raw = next(iter(forced(**feed).values()))
        assert sqnr_db(expected, _dequantized(forced, raw)) < 10


def _dequantized(runner, raw: np.ndarray) -> np.ndarray:
    from tools.stages.validate import dequantize

    return dequantize(raw, next(iter(runner.get_output_details().values())))
