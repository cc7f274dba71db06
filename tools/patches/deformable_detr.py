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


# Levels with at most this many positions are sampled densely (see TentSamplingDeformableAttention): per query
# and head a dense level costs positions * (head_dim + points) MACs and a gathered one moves 4 * points *
# head_dim floats; at 16x16 and below the matrix products were faster than the gather in TFLite fp32.
DENSE_MAX_POSITIONS = 256


def _block(reference: torch.Tensor, size: torch.Tensor, offset: torch.Tensor) -> tuple:
    """A sample's 2x2 block along one axis: its first pixel (int32, clamped so that the block lies in the map) and
    the tent weights of the block's two pixels.

    The sample sits at reference * size - 0.5 + offset (align_corners=False). The reference is a constant for a
    static image size, so its whole pixels are split off there: what is rounded at run time, the reference's
    fraction plus the learned offset, spans a few pixels and keeps sub-pixel steps when an INT8 graph quantizes
    it (the whole coordinate, up to the map's width, would not). The clamp is int32 arithmetic, never quantized,
    against bounds of the rounded tensor's own shape (TFLite's int32 MINIMUM and MAXIMUM are 3x slower when they
    broadcast). Where the clamp moved the block by `shift` pixels, the tents are taken at the sample's distance
    from the moved block's pixels, fraction + shift and fraction + shift - 1: relu(1 - |d|) is then zero for a
    pixel the sample does not touch, so samples off the map weigh nothing without a mask, WHERE or SELECT.
    """
    base = reference * size.to(reference.dtype) - 0.5
    whole = torch.floor(base)
    near = (base - whole) + offset
    step = torch.floor(near)
    fraction = near - step
    whole, step = whole.to(torch.int32), step.to(torch.int32)
    kept = torch.minimum(torch.maximum(step, -whole), (size - 2) - whole)  # the first pixel, whole + kept, in [0, size - 2]
    distance = fraction + (step - kept).to(fraction.dtype)  # from the first pixel to the sample
    return whole + kept, torch.relu(1 - distance.abs()), torch.relu(1 - (distance - 1).abs())


class TentSamplingDeformableAttention(nn.Module):
    """Multi-scale deformable attention as int32-indexed gathers of value rows and dense matrix products, no
    grid_sample.

    Bilinear sampling with zero padding weighs pixel (x, y) by tent(x_s - x) * tent(y_s - y), where
    tent(d) = relu(1 - |d|). That one identity gives two formulations with static shapes:
    - large levels: each sampling point gathers the four value rows of its 2x2 block of pixels straight from the
      value projection's output (one GATHER of every point of every head, int32 indices from int32 arithmetic,
      the block clamped into the map) and weighs them by their tents, which are zero for pixels the sample does
      not touch: no mask, WHERE or SELECT;
    - small levels (<= DENSE_MAX_POSITIONS): the point tents make a separable weight map per query and head,
      (H x P) @ (P x W), that multiplies the level's values: matrix products only, no coordinates rounded.
    Tensors stay at rank <= 3 so that onnx2tf does not take them for images.
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        self.n_heads, self.n_levels, self.n_points = original.n_heads, original.n_levels, original.n_points
        self.d_model = original.d_model
        self.value_proj, self.output_proj = original.value_proj, original.output_proj
        self.sampling_offsets, self.attention_weights = original.sampling_offsets, original.attention_weights

    def _layout(self, shapes: list) -> tuple:
        """Which levels are gathered and which dense, and the projection rows in the order the two paths read.

        Offsets: x of the gathered (head, level, point), their y, then per dense level x and y of (head, point).
        Attention weights: per head, the gathered levels' points, then the dense levels' (one softmax over all).
        The rows are picked from the weights, a constant in the exported graph.
        """
        dense = [l for l, (h, w) in enumerate(shapes) if h * w <= DENSE_MAX_POSITIONS or min(h, w) < 2]
        gathered = [l for l in range(self.n_levels) if l not in dense]
        rows = torch.arange(self.n_heads * self.n_levels * self.n_points).view(self.n_heads, self.n_levels, -1)
        xy = lambda r, c: (r * 2 + c).reshape(-1)  # noqa: E731  (offset row of coordinate c of position r)
        order = [xy(rows[:, gathered], 0), xy(rows[:, gathered], 1)]
        for l in dense:
            order += [xy(rows[:, l], 0), xy(rows[:, l], 1)]
        return gathered, dense, torch.cat(order), rows[:, gathered + dense].reshape(-1)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                position_embeddings=None, reference_points=None, spatial_shapes=None, spatial_shapes_list=None,
                level_start_index=None, **kwargs):
        if position_embeddings is not None:
            hidden_states = hidden_states + position_embeddings
        if reference_points.shape[-1] != 2:
            raise NotImplementedError("tent sampling supports 2-d reference points (no two-stage, no box refine)")
        shapes = [(int(h), int(w)) for h, w in spatial_shapes_list]  # python ints: constants in the graph
        gathered, dense, offset_rows, weight_rows = self._layout(shapes)
        starts = np.concatenate([[0], np.cumsum([h * w for h, w in shapes])[:-1]])
        value = self.value_proj(encoder_hidden_states)
        if attention_mask is not None:
            value = value * attention_mask[..., None].to(value.dtype)
        offsets = nn.functional.linear(hidden_states, self.sampling_offsets.weight[offset_rows],
                                       self.sampling_offsets.bias[offset_rows])
        queries, heads = int(hidden_states.shape[1]), self.n_heads
        logits = nn.functional.linear(hidden_states, self.attention_weights.weight[weight_rows],
                                      self.attention_weights.bias[weight_rows])
        # (batch * queries * heads, levels * points): rank 2, so that no slice meets onnx2tf's square-axis guessing
        weights = logits.reshape(-1, self.n_levels * self.n_points).softmax(-1)
        split, rows = len(gathered) * self.n_points, queries * heads
        out = []
        for b in range(int(hidden_states.shape[0])):  # static batch: one graph per image, no batch arithmetic
            # Slices, not integer indexing (a picked index exports as a GATHER); levels cut from (positions, heads,
            # head_dim), never from (positions, channels): a level with as many positions as channels is square, and
            # onnx2tf then takes one axis for the other.
            per_head = value[b:b + 1].reshape(-1, heads, self.d_model // heads)
            levels = [per_head[s:s + h * w] for s, (h, w) in zip(starts, shapes)]
            image_offsets, image_weights = offsets[b:b + 1].flatten(0, 1), weights[b * rows:(b + 1) * rows]
            reference = reference_points[b:b + 1].flatten(0, 1)
            sampled = 0
            if gathered:
                sampled = self._gathered(per_head, shapes, gathered, image_offsets[:, :2 * heads * split],
                                         image_weights[:, :split], reference)
            if dense:
                sampled = sampled + self._dense(levels, shapes, dense, image_offsets[:, 2 * heads * split:],
                                                image_weights[:, split:], reference)
            out.append(sampled)
        return self.output_proj(torch.stack(out)), None  # attention weights are in the reordered layout: not returned

    def _gathered(self, value, shapes, which, offsets, weights, reference):
        """Sampling of the large levels: four int32-indexed value rows per point, weighted by their tents."""
        heads, points, head_dim = self.n_heads, self.n_points, self.d_model // self.n_heads
        queries, m = int(offsets.shape[0]), offsets.shape[1] // 2
        # The table is the levels' value rows as they are, row = position * heads + head: one slice of `value`
        # (positions, heads, head_dim) when the gathered levels come first, as the large ones do.
        first_of = np.concatenate([[0], np.cumsum([h * w for h, w in shapes])])
        if which == list(range(len(which))):
            table = value[:int(first_of[len(which)])]
        else:
            table = torch.cat([value[int(first_of[l]):int(first_of[l + 1])] for l in which])
        table = table.reshape(-1, head_dim)
        starts = np.concatenate([[0], np.cumsum([shapes[l][0] * shapes[l][1] for l in which])[:-1]])
        # per sampling position (head, level, point): the level's constants
        rep = lambda vals, dtype: torch.from_numpy(np.tile(np.repeat(np.array(vals, dtype=dtype), points), heads))  # noqa: E731
        widths, heights = rep([shapes[l][1] for l in which], np.int32), rep([shapes[l][0] for l in which], np.int32)
        level = rep(which, np.int64)
        x0, *tent_x = _block(reference[:, :, 0:1].flatten(1).index_select(1, level), widths, offsets[:, :m])
        y0, *tent_y = _block(reference[:, :, 1:2].flatten(1).index_select(1, level), heights, offsets[:, m:])
        first = rep(starts, np.int32) * heads + torch.from_numpy(np.repeat(np.arange(heads, dtype=np.int32),
                                                                           len(which) * points))
        first = first + y0 * (widths * heads) + x0 * heads  # row of the block's top-left pixel: (queries, m)
        a = weights.reshape(queries, m)  # (queries * heads, levels * points) -> (queries, m)
        sampled = 0
        # One gather per corner: its index is the top-left one plus a constant per position, and its rows are
        # weighted and summed on their own (a single gather of all four would need (queries, m, 4) int32 tensors,
        # whose broadcasting TFLite runs slowly, and a batched product with heads * queries tiny matrices).
        for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
            # A rank-2 index: Keras infers the values of small rank-1 int32 tensors (as if shapes) and onnx2tf then
            # fails.
            index = (first + (widths * heads * dy + heads * dx)).reshape(queries * heads, -1)
            rows = nn.functional.embedding(index, table)  # (queries * heads, levels * points, head_dim)
            weight = (tent_y[dy] * tent_x[dx] * a).reshape(queries * heads, -1, 1)
            sampled = sampled + (rows * weight).sum(1)
        return sampled.reshape(queries, heads * head_dim)

    def _dense(self, levels, shapes, which, offsets, weights, reference):
        """Sampling of the small levels: weight map (H x P) @ (P x W) per query and head, times the values."""
        heads, points, head_dim = self.n_heads, self.n_points, self.d_model // self.n_heads
        queries = int(offsets.shape[0])
        # (queries, heads * per-level (x points, y points)) -> (heads, queries, ...): heads lead the products
        sampled = 0
        for i, l in enumerate(which):
            h, w = shapes[l]
            off_x, off_y = (offsets[:, (2 * i + c) * heads * points:(2 * i + c + 1) * heads * points]
                            .reshape(queries, heads, points).transpose(0, 1) for c in (0, 1))  # (heads, queries, points)
            a = (weights[:, i * points:(i + 1) * points].reshape(queries, heads, points).transpose(0, 1)
                 .reshape(heads * queries, points, 1))
            x = (reference[:, l:l + 1, 0:1].flatten(1) * w - 0.5)[None] + off_x
            y = (reference[:, l:l + 1, 1:2].flatten(1) * h - 0.5)[None] + off_y
            # Both tents broadcast along their last axis, (hq, points, size): TFLite runs a broadcast along a
            # middle axis, (hq, size, points), about 5x slower. The product takes tent_y transposed (onnx2tf
            # writes it as BATCH_MATMUL's adj_x, no TRANSPOSE op).
            tent_x = torch.relu(1 - (x.reshape(heads * queries, points, 1) - torch.arange(w, dtype=x.dtype)).abs()) * a
            tent_y = torch.relu(1 - (y.reshape(heads * queries, points, 1) - torch.arange(h, dtype=y.dtype)).abs())
            weight_map = torch.bmm(tent_y.transpose(1, 2), tent_x).reshape(heads, queries, h * w)
            # one product per level, summed: concatenating the maps and the values would copy both
            sampled = sampled + torch.bmm(weight_map, levels[l].transpose(0, 1))  # (heads, queries, head_dim)
        return sampled.transpose(0, 1).reshape(queries, heads * head_dim)


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


@register("deformable_detr_tent_sampling", applies_to=("DeformableDetrForObjectDetection",))
def tent_sampling(module: nn.Module) -> nn.Module:
    """Replace grid_sample in multi-scale deformable attention by corner-row gathers and dense tent products."""
    if module.config.two_stage or module.config.with_box_refine:
        raise ValueError("deformable_detr_tent_sampling needs two_stage=false and with_box_refine=false")
    _replace_modules(module, "DeformableDetrMultiscaleDeformableAttention", TentSamplingDeformableAttention)
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
