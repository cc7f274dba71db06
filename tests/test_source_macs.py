"""The MAC count that bench/deformable_vs_dn.py's goal rests on: the source model's arithmetic, counted in torch."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from bench.host_latency import torch_macs
from tests.conftest import tiny_entry_data, write_entry


class _ConvLinearAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.linear = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 12)

    def forward(self, x):
        tokens = self.linear(self.conv(x).flatten(2).transpose(1, 2))  # (1, 256, 12)
        q, k, v = tokens.reshape(1, 256, 3, 2, 2).permute(2, 0, 3, 1, 4)  # each (1, heads 2, 256, 2)
        return nn.functional.scaled_dot_product_attention(q, k, v)


def test_counts_convolutions_products_and_cpu_attention():
    """Every kind of arithmetic counted once: torch's own counter registers no CPU attention kernel, so a
    Transformer's attention would be missing without the mapping torch_macs adds."""
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    conv = 256 * 8 * 3 * 3 * 3
    linear = 256 * 8 * 12
    attention = 2 * (2 * 256 * 256 * 2)  # per head: Q K^T and weights @ V, each 256 x 256 x head_dim 2
    assert torch_macs(_ConvLinearAttention().eval(), {"x": x}) == conv + linear + attention


def test_tent_sampling_adds_its_dense_products_to_the_count(tmp_path):
    """The stock and gather-sampled Deformable DETR have the same count (sampling is no matrix product), and tent
    sampling's count exceeds it by exactly its dense levels' two products per query and head: the arithmetic the
    lowering adds, which is why the bench's goal counts the source model and not the converted graph."""
    from tools.entry import load_entry
    from tools.patches.deformable_detr import DENSE_MAX_POSITIONS, gather_sampling, tent_sampling
    from tools.sources import build_module

    path = write_entry(tmp_path, tiny_entry_data("deformable_detr", "dd_tiny"))
    shape = load_entry(path).data["inputs"][0]["shape"]
    x = {"pixel_values": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}

    def model(patch=None):
        torch.manual_seed(0)
        module = build_module(load_entry(path)).eval()
        return patch(module) if patch else module

    stock = torch_macs(model(), x)
    assert torch_macs(model(gather_sampling), x) == stock
    tent, calls = model(tent_sampling), []
    for attention in [m for m in tent.modules() if type(m).__name__ == "TentSamplingDeformableAttention"]:
        attention.register_forward_pre_hook(
            lambda m, args, kwargs: calls.append((m, kwargs["hidden_states"].shape[1], kwargs["spatial_shapes_list"])),
            with_kwargs=True)
    counted = torch_macs(tent, x)
    added = 0
    for attention, queries, shapes in calls:
        head_dim = attention.d_model // attention.n_heads
        for h, w in [(int(h), int(w)) for h, w in shapes if int(h) * int(w) <= DENSE_MAX_POSITIONS]:
            # weight map (h x points) @ (points x w), then (1 x h*w) @ values (h*w x head_dim)
            added += queries * attention.n_heads * (h * attention.n_points * w + h * w * head_dim)
    assert added > 0 and counted == stock + added
