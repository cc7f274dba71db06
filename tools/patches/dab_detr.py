"""Export patches for transformers' DAB-DETR (the inference graph of DN-DETR)."""
from __future__ import annotations

import torch
from torch import nn

from tools.patches import register


def _inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


class DabDetrLastLayerHead(nn.Module):
    """Detection head applied to the last decoder layer only.

    The stock head runs class_embed and the box MLP over all decoder layers stacked into a 4-D
    (layers, batch, queries, hidden) tensor and then picks [-1]; onnx2tf treats that 4-D tensor as an
    image and lays it out wrongly. The last layer's output is all inference needs.
    """

    def __init__(self, detector: nn.Module):
        super().__init__()
        self.detector = detector
        self.query_dim = detector.config.query_dim

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.detector.model(pixel_values=pixel_values, return_dict=True)
        hidden = out.last_hidden_state
        logits = self.detector.class_embed(hidden)
        boxes = self.detector.bbox_predictor(hidden)
        reference = out.reference_points[-1]
        if boxes.shape[-1] == self.query_dim:  # 4-d anchors: no empty slice (a zero-size tensor the NPU rejects)
            boxes = boxes + _inverse_sigmoid(reference)
        else:
            boxes = torch.cat([boxes[..., : self.query_dim] + _inverse_sigmoid(reference), boxes[..., self.query_dim:]], -1)
        return {"logits": logits, "pred_boxes": boxes.sigmoid()}


@register("dab_detr_last_layer_head", applies_to=("DabDetrForObjectDetection",))
def last_layer_head(module: nn.Module) -> nn.Module:
    """Run the detection head on the last decoder layer only (no stacked 4-D decoder tensor)."""
    return DabDetrLastLayerHead(module)
