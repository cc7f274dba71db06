"""Export patches give the stock module's outputs: in torch here, in ONNX and TFLite through the pipeline tests."""
from __future__ import annotations

import pytest
import torch
from transformers import DabDetrConfig, DabDetrForObjectDetection, DeformableDetrConfig, DeformableDetrForObjectDetection

from tools.patches import REGISTRY, apply_patches
from tools.patches.deformable_detr import GatherDeformableAttention, float32_reference_points


def _deformable(levels=4, points=4, heads=2, d_model=32):
    torch.manual_seed(0)
    config = DeformableDetrConfig(d_model=d_model, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, encoder_attention_heads=heads, decoder_attention_heads=heads,
                                  num_queries=12, num_feature_levels=levels, encoder_n_points=points,
                                  decoder_n_points=points, backbone="test_resnet", num_labels=5)
    return DeformableDetrForObjectDetection(config).eval()


@pytest.mark.parametrize("levels,points,heads", [(4, 4, 2), (1, 1, 1), (3, 2, 4), (2, 5, 8)])
def test_gather_attention_matches_grid_sample(levels, points, heads):
    stock = _deformable(levels, points, heads).model.encoder.layers[0].self_attn
    patched = GatherDeformableAttention(stock)
    shapes = [(11, 7), (6, 4), (3, 2), (1, 1), (2, 9)][:levels]
    seq = sum(h * w for h, w in shapes)
    generator = torch.Generator().manual_seed(levels * 100 + points)
    queries = torch.randn(2, 13, 32, generator=generator)
    memory = torch.randn(2, seq, 32, generator=generator)
    # Reference points spread beyond [0, 1] so that corners fall outside the maps (zero padding).
    reference = torch.rand(2, 13, levels, 2, generator=generator) * 1.4 - 0.2
    spatial = torch.tensor(shapes)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (spatial[:, 0] * spatial[:, 1]).cumsum(0)[:-1]])
    kwargs = dict(encoder_hidden_states=memory, reference_points=reference, spatial_shapes=spatial,
                  spatial_shapes_list=shapes, level_start_index=starts)
    with torch.no_grad():
        expected, _ = stock(queries, **kwargs)
        got, _ = patched(queries, **kwargs)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


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
        patched = apply_patches(model, ["deformable_detr_float32_reference_points", "deformable_detr_gather_sampling",
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
