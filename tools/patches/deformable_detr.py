"""Export patches for transformers' Deformable DETR."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tools.patches import register


def _inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


class GatherDeformableAttention(nn.Module):
    """Multi-scale deformable attention as one flat GATHER instead of grid_sample.

    grid_sample has no TFLite op; onnx2tf's decomposition of it is slow and came out wrong. Here every
    sampling point's four bilinear corners index one table of value rows, (batch, position, head) -> row,
    with the index computed in float (exact below 2**24) and cast to int32 once: never int64. Out-of-map
    corners get weight zero through arithmetic (abs, minimum), so no comparison, WHERE or SELECT is needed.
    Tensors stay at rank <= 3 so that onnx2tf does not mistake them for images. Same result as bilinear
    grid_sample with zero padding and align_corners=False.
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        self.n_heads, self.n_levels, self.n_points = original.n_heads, original.n_levels, original.n_points
        self.d_model = original.d_model
        self.value_proj, self.output_proj = original.value_proj, original.output_proj
        self.attention_weights = original.attention_weights
        m = self.n_heads * self.n_levels * self.n_points
        # Reorder the offset projection's rows from (head, level, point, xy) to (xy, head, level, point):
        # x and y offsets then come out as two plain halves, with no strided slice or rank-4 view.
        order = torch.arange(2 * m).view(m, 2).t().reshape(-1)
        self.sampling_offsets = nn.Linear(original.sampling_offsets.in_features, 2 * m)
        with torch.no_grad():
            self.sampling_offsets.weight.copy_(original.sampling_offsets.weight[order])
            self.sampling_offsets.bias.copy_(original.sampling_offsets.bias[order])

    def _level_constants(self, spatial_shapes_list):
        """Per sampling position m = (head, level, point): width, height, level start, head; and m's level."""
        heads, levels = self.n_heads, self.n_levels
        level_of_m = np.repeat(np.tile(np.arange(levels), heads), self.n_points)
        head_of_m = np.repeat(np.arange(heads), levels * self.n_points)
        widths = np.array([w for _, w in spatial_shapes_list], dtype=np.float32)
        heights = np.array([h for h, _ in spatial_shapes_list], dtype=np.float32)
        starts = np.concatenate([[0], np.cumsum(heights * widths)[:-1]]).astype(np.float32)
        as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
        return (as_t(widths[level_of_m]), as_t(heights[level_of_m]), as_t(starts[level_of_m]),
                as_t(head_of_m), torch.from_numpy(level_of_m.astype(np.int64)))

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                position_embeddings=None, reference_points=None, spatial_shapes=None, spatial_shapes_list=None,
                level_start_index=None, **kwargs):
        if position_embeddings is not None:
            hidden_states = hidden_states + position_embeddings
        if reference_points.shape[-1] != 2:
            raise NotImplementedError("gather sampling supports 2-d reference points (no two-stage, no box refine)")
        # Static shapes: python ints, so that sizes and offsets enter the graph as constants.
        batch, queries = int(hidden_states.shape[0]), int(hidden_states.shape[1])
        spatial_shapes_list = [(int(h), int(w)) for h, w in spatial_shapes_list]
        seq = sum(h * w for h, w in spatial_shapes_list)
        heads, head_dim = self.n_heads, self.d_model // self.n_heads
        m = heads * self.n_levels * self.n_points
        if batch * seq * heads >= 2 ** 24:
            raise ValueError("value table too large for exact float32 indices")
        width, height, start, head, level_of_m = self._level_constants(spatial_shapes_list)

        value = self.value_proj(encoder_hidden_states)
        if attention_mask is not None:
            value = value * attention_mask[..., None].to(value.dtype)
        table = value.reshape(batch * seq * heads, head_dim)  # row = (b * seq + position) * heads + head

        offsets = self.sampling_offsets(hidden_states)
        ref_x = reference_points[..., 0].index_select(2, level_of_m)  # (batch, queries, m)
        ref_y = reference_points[..., 1].index_select(2, level_of_m)
        x = ref_x * width + offsets[..., :m] - 0.5  # pixel coordinates, align_corners=False
        y = ref_y * height + offsets[..., m:] - 0.5
        logits = self.attention_weights(hidden_states).reshape(batch * queries, heads, m // heads)
        weights = logits.softmax(-1).reshape(batch, queries, m)

        x0, y0 = torch.floor(x), torch.floor(y)
        fx, fy = x - x0, y - y0
        batch_row = torch.from_numpy(np.arange(batch, dtype=np.float32) * seq).view(batch, 1, 1)
        zero = torch.zeros(())
        rows, corner_weights = [], []
        for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
            xi, yi = x0 + dx, y0 + dy
            xc = torch.minimum(torch.maximum(xi, zero), width - 1)
            yc = torch.minimum(torch.maximum(yi, zero), height - 1)
            inside = 1 - torch.minimum((xi - xc).abs() + (yi - yc).abs(), torch.ones(()))
            w = (fx if dx else 1 - fx) * (fy if dy else 1 - fy) * inside * weights
            rows.append(((batch_row + start + yc * width + xc) * heads + head).reshape(-1, 1))
            corner_weights.append(w.reshape(-1, 1))
        # Rows are ordered (batch, query, head, level, point, corner): each output head vector sums one group.
        group = self.n_levels * self.n_points * 4
        index = torch.cat(rows, 1).reshape(-1).to(torch.int32)
        w = torch.cat(corner_weights, 1).reshape(batch * queries * heads, group, 1)
        sampled = table.index_select(0, index).reshape(batch * queries * heads, group, head_dim)
        out = (sampled * w).sum(1).reshape(batch, queries, heads * head_dim)
        return self.output_proj(out), weights


def _replace_modules(root: nn.Module, cls_name: str, make) -> int:
    count = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == cls_name:
                setattr(parent, name, make(child))
                count += 1
    return count


@register("deformable_detr_gather_sampling", applies_to=("DeformableDetrForObjectDetection",))
def gather_sampling(module: nn.Module) -> nn.Module:
    """Replace grid_sample in multi-scale deformable attention by one int32-indexed GATHER."""
    if module.config.two_stage or module.config.with_box_refine:
        raise ValueError("deformable_detr_gather_sampling needs two_stage=false and with_box_refine=false")
    _replace_modules(module, "DeformableDetrMultiscaleDeformableAttention", GatherDeformableAttention)
    return module


def float32_reference_points(spatial_shapes_list, valid_ratios, device=None):
    """The encoder's reference points (pixel centres per level, scaled by the valid ratios), in float32.

    transformers builds them with torch.linspace, which the TorchScript exporter writes in float64; the
    grid is a constant for static shapes, so it is made in numpy and enters the graph as one tensor.
    """
    spatial_shapes_list = [(int(h), int(w)) for h, w in spatial_shapes_list]
    grids = []
    for height, width in spatial_shapes_list:
        ys, xs = np.meshgrid((np.arange(height, dtype=np.float32) + 0.5) / height,
                             (np.arange(width, dtype=np.float32) + 0.5) / width, indexing="ij")
        grids.append(np.stack([xs.reshape(-1), ys.reshape(-1)], -1))
    points = torch.from_numpy(np.concatenate(grids)[None])  # (1, positions, 2), already divided by size
    levels = torch.from_numpy(np.concatenate([np.full(h * w, i) for i, (h, w) in enumerate(spatial_shapes_list)]))
    # As transformers does: divide by the valid ratio of the point's own level, multiply by every level's.
    own = valid_ratios.index_select(1, levels)  # (batch, positions, 2)
    return (points / own)[:, :, None] * valid_ratios[:, None]


@register("deformable_detr_float32_reference_points", applies_to=("DeformableDetrForObjectDetection",))
def float32_reference_points_patch(module: nn.Module) -> nn.Module:
    """Build the encoder's reference points in float32 (the stock torch.linspace exports as float64)."""
    module.model.encoder.get_reference_points = float32_reference_points
    return module


class DeformableDetrLastLayerHead(nn.Module):
    """Detection head applied to the last decoder layer only.

    The stock head loops over all decoder layers, stacks their outputs into 4-D tensors and picks [-1];
    without box refinement the last layer's hidden state and the initial reference points are all it needs.
    """

    def __init__(self, detector: nn.Module):
        super().__init__()
        self.detector = detector

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.detector.model(pixel_values=pixel_values, return_dict=True)
        hidden = out.last_hidden_state
        logits = self.detector.class_embed[-1](hidden)
        delta = self.detector.bbox_embed[-1](hidden)
        boxes = torch.cat([delta[..., :2] + _inverse_sigmoid(out.init_reference_points), delta[..., 2:]], -1)
        return {"logits": logits, "pred_boxes": boxes.sigmoid()}


@register("deformable_detr_last_layer_head", applies_to=("DeformableDetrForObjectDetection",))
def last_layer_head(module: nn.Module) -> nn.Module:
    """Run the detection head on the last decoder layer only (no stacked 4-D decoder tensors)."""
    if module.config.two_stage or module.config.with_box_refine:
        raise ValueError("deformable_detr_last_layer_head needs two_stage=false and with_box_refine=false")
    return DeformableDetrLastLayerHead(module)
