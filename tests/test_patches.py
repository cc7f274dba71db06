"""Export patches give the stock module's outputs: in torch here, in ONNX and TFLite through the pipeline tests."""
from __future__ import annotations

import pytest
import torch
from transformers import DabDetrConfig, DabDetrForObjectDetection, DeformableDetrConfig, DeformableDetrForObjectDetection

from tools.patches import REGISTRY, apply_patches
from tools.patches import deformable_detr
from tools.patches.deformable_detr import GatherDeformableAttention, TentSamplingDeformableAttention, float32_reference_points


def _deformable(levels=4, points=4, heads=2, d_model=32):
    torch.manual_seed(0)
    config = DeformableDetrConfig(d_model=d_model, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, encoder_attention_heads=heads, decoder_attention_heads=heads,
                                  num_queries=12, num_feature_levels=levels, encoder_n_points=points,
                                  decoder_n_points=points, backbone="test_resnet", num_labels=5)
    return DeformableDetrForObjectDetection(config).eval()


def _sampled_by(module, levels, points, shapes, batch=2, queries=13):
    """The module's output on random queries and values, with reference points beyond [0, 1] so that samples fall
    off the maps (zero padding) and on their edges."""
    seq = sum(h * w for h, w in shapes)
    generator = torch.Generator().manual_seed(levels * 100 + points + len(shapes))
    hidden = torch.randn(batch, queries, 32, generator=generator)
    memory = torch.randn(batch, seq, 32, generator=generator)
    reference = torch.rand(batch, queries, levels, 2, generator=generator) * 1.4 - 0.2
    spatial = torch.tensor(shapes)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (spatial[:, 0] * spatial[:, 1]).cumsum(0)[:-1]])
    with torch.no_grad():
        return module(hidden, encoder_hidden_states=memory, reference_points=reference, spatial_shapes=spatial,
                      spatial_shapes_list=shapes, level_start_index=starts)[0]


CASES = [(4, 4, 2, [(11, 7), (6, 4), (3, 2), (1, 1)]), (1, 1, 1, [(11, 7)]), (3, 2, 4, [(20, 17), (6, 4), (3, 2)]),
         (2, 5, 8, [(1, 1), (2, 9)])]


@pytest.mark.parametrize("levels,points,heads,shapes", CASES)
def test_gather_attention_matches_grid_sample(levels, points, heads, shapes):
    stock = _deformable(levels, points, heads).model.encoder.layers[0].self_attn
    expected = _sampled_by(stock, levels, points, shapes)
    torch.testing.assert_close(_sampled_by(GatherDeformableAttention(stock), levels, points, shapes), expected,
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("levels,points,heads,shapes", CASES + [(4, 4, 8, [(24, 20), (17, 18), (3, 2), (1, 1)])])
@pytest.mark.parametrize("dense_max", [0, 30, 10_000])  # every level gathered, a split, every level dense
def test_tent_attention_matches_grid_sample(levels, points, heads, shapes, dense_max, monkeypatch):
    monkeypatch.setattr(deformable_detr, "DENSE_MAX_POSITIONS", dense_max)
    stock = _deformable(levels, points, heads).model.encoder.layers[0].self_attn
    patched = TentSamplingDeformableAttention(stock)
    gathered, dense, _, _ = patched._layout(shapes)
    assert not any(h < 2 or w < 2 for h, w in (shapes[l] for l in gathered))  # 1-pixel levels are always dense
    torch.testing.assert_close(_sampled_by(patched, levels, points, shapes), _sampled_by(stock, levels, points, shapes),
                               atol=2e-6, rtol=1e-5)


def test_tent_corners_are_int32_and_samples_on_pixel_centres_are_exact():
    """Samples on pixel centres (the untrained offsets' grid) are where a rounding flip could pick the other corner:
    either choice must give the pixel itself, and corners stay int32 in the map."""
    stock = _deformable(2, 2, 2).model.encoder.layers[0].self_attn
    shapes = [(9, 8), (5, 4)]
    with torch.no_grad():
        stock.sampling_offsets.weight.zero_()
        stock.sampling_offsets.bias.copy_(torch.arange(16, dtype=torch.float32) % 5 - 2)  # whole-pixel offsets
    reference = ((torch.arange(8) + 0.5) / 8).repeat(7, 1)  # pixel centres of an 8-wide map
    offset = (torch.arange(7, dtype=torch.float32) - 3)[:, None].expand(7, 8)  # whole pixels, -3..3
    first, left, right = deformable_detr._block(reference, torch.tensor(8, dtype=torch.int32), offset)
    assert first.dtype == torch.int32 and int(first.min()) == 0 and int(first.max()) == 6
    sample = torch.arange(8) + offset
    inside = (sample >= 0) & (sample <= 7)
    assert torch.equal(left + right, inside.float())  # a whole pixel in the map, or nothing off it
    assert torch.equal((left * first + right * (first + 1))[inside], sample[inside])  # and it is that pixel
    for dense_max in (0, 10_000):
        deformable_detr.DENSE_MAX_POSITIONS, saved = dense_max, deformable_detr.DENSE_MAX_POSITIONS
        try:
            torch.testing.assert_close(_sampled_by(TentSamplingDeformableAttention(stock), 2, 2, shapes),
                                       _sampled_by(stock, 2, 2, shapes), atol=2e-6, rtol=1e-5)
        finally:
            deformable_detr.DENSE_MAX_POSITIONS = saved


def test_float32_reference_points_match_transformers():
    encoder = _deformable().model.encoder
    shapes = [(12, 10), (6, 5), (3, 3), (2, 2)]
    ratios = torch.rand(2, 4, 2, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.5
    expected = type(encoder).get_reference_points(shapes, ratios, "cpu")
    got = float32_reference_points(shapes, ratios)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_patched_deformable_detr_gives_the_stock_detections():
    model = _deformable()
    pixels = torch.randn(1, 3, 96, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stock = model(pixel_values=pixels)
        patched = apply_patches(model, ["deformable_detr_float32_reference_points", "deformable_detr_tent_sampling",
                                        "deformable_detr_last_layer_head"])(pixels)
    torch.testing.assert_close(patched["logits"], stock.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(patched["pred_boxes"], stock.pred_boxes, atol=1e-5, rtol=1e-5)


def test_dab_detr_last_layer_head_gives_the_stock_detections():
    torch.manual_seed(0)
    model = DabDetrForObjectDetection(DabDetrConfig(hidden_size=32, encoder_layers=1, decoder_layers=3,
                                                    encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=2,
                                                    decoder_attention_heads=2, num_queries=10, num_patterns=1,
                                                    backbone="test_resnet", num_labels=7)).eval()
    pixels = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stock = model(pixel_values=pixels)
        patched = apply_patches(model, ["dab_detr_last_layer_head"])(pixels)
    torch.testing.assert_close(patched["logits"], stock.logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(patched["pred_boxes"], stock.pred_boxes, atol=1e-6, rtol=1e-6)


def test_patch_refuses_a_class_it_was_not_written_for():
    model = _deformable()
    with pytest.raises(ValueError, match="rewrites \\['DabDetrForObjectDetection'\\], not DeformableDetrForObjectDetection"):
        apply_patches(model, ["dab_detr_last_layer_head"])


def test_every_patch_has_a_summary():
    assert REGISTRY and all(p.summary and p.applies_to for p in REGISTRY.values())


def _tokens_graph():
    """Two levels of (1, 4, N) tokens, each transposed to (1, N, 4), then concatenated: DETR's flatten."""
    from onnx import TensorProto, helper

    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 4, 4])  # square: 4 positions, 4 channels
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 4, 6])
    out = helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [1, 10, 4])
    nodes = [helper.make_node("Transpose", ["a"], ["ta"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["b"], ["tb"], perm=[0, 2, 1]),
             helper.make_node("Concat", ["ta", "tb"], ["tokens"], axis=1)]
    return helper.make_model(helper.make_graph(nodes, "tokens", [a, b], [out]), opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8)


def test_tokens_are_concatenated_before_one_transpose_with_the_same_values():
    import numpy as np
    import onnx
    import onnxruntime as ort

    from tools.patches import apply_onnx_patches

    model = _tokens_graph()
    feed = {"a": np.random.default_rng(0).normal(size=(1, 4, 4)).astype(np.float32),
            "b": np.random.default_rng(1).normal(size=(1, 4, 6)).astype(np.float32)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    before = run(model)
    assert apply_onnx_patches(model, ["onnx_concat_tokens_before_transpose"]) == {"onnx_concat_tokens_before_transpose": 1}
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node] == ["Concat", "Transpose"]
    assert np.array_equal(run(model), before)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.value_info}
    assert [1, 4, 10] in shapes.values()  # the new tensor carries its shape for onnx2tf


def test_an_onnx_patch_with_nothing_to_rewrite_is_an_error():
    from onnx import TensorProto, helper

    from tools.patches import apply_onnx_patches

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])]))
    with pytest.raises(ValueError, match="found nothing to rewrite"):
        apply_onnx_patches(model, ["onnx_concat_tokens_before_transpose"])


def _pool_graph(activation: str):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 3])
    nodes = [helper.make_node(activation, ["x"], ["a"]),
             helper.make_node("MaxPool", ["a"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])]
    return helper.make_model(helper.make_graph(nodes, "pool", [x], [y]), opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8)


def test_max_pool_after_relu_is_zero_padded_with_the_same_maxima():
    import numpy as np
    import onnxruntime as ort

    from tools.patches.onnx_layout import relu_maxpool_zero_padding

    feed = {"x": np.random.default_rng(0).normal(size=(1, 2, 5, 5)).astype(np.float32)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    model = _pool_graph("Relu")
    before = run(model)
    assert relu_maxpool_zero_padding(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Relu", "Pad", "MaxPool"]
    assert [list(a.ints) for a in model.graph.node[2].attribute if a.name == "pads"] == [[0, 0, 0, 0]]
    assert np.array_equal(run(model), before)
    # Without a ReLU before it, zero padding would change the maxima of negative windows: left alone.
    assert relu_maxpool_zero_padding(_pool_graph("Neg")) == 0
