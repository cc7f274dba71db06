"""Export patches for Conformer encoders (the conformer_ctc family, transformers' Parakeet modules)."""
from __future__ import annotations

import torch
from torch import nn

from tools.patches import register


def _as_conv2d(conv: nn.Conv1d) -> nn.Conv2d:
    """The same 1-D convolution over time as a 2-D one over a (1, T) map: kernel (1, k)."""
    out = nn.Conv2d(conv.in_channels, conv.out_channels, (1, conv.kernel_size[0]), padding=(0, conv.padding[0]),
                    groups=conv.groups, bias=conv.bias is not None)
    with torch.no_grad():
        out.weight.copy_(conv.weight[:, :, None, :])
        if conv.bias is not None:
            out.bias.copy_(conv.bias)
    return out


class Conv2dConvolutionModule(nn.Module):
    """The Conformer convolution module on a (batch, channels, 1, time) map: pointwise, GLU, depthwise, BatchNorm,
    SiLU, pointwise, all as 2-D convolutions.

    onnx2tf writes a grouped (depthwise) Conv1d as a Keras Conv1D layer with variables: TensorFlow then cannot
    save the model, and onnx2tf's fallback writes a .tflite without a signature. As 2-D convolutions they
    become CONV_2D and DEPTHWISE_CONV_2D with constant weights, the ops the 8MP NPU runs best.
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        self.pointwise_conv1 = _as_conv2d(original.pointwise_conv1)
        self.depthwise_conv = _as_conv2d(original.depthwise_conv)
        self.norm = nn.BatchNorm2d(original.norm.num_features, eps=original.norm.eps)
        self.norm.load_state_dict(original.norm.state_dict())
        self.norm.eval()
        self.activation = original.activation
        self.pointwise_conv2 = _as_conv2d(original.pointwise_conv2)

    def forward(self, hidden_states, attention_mask=None):
        if attention_mask is not None:
            raise NotImplementedError("conformer_conv_module_as_conv2d exports unmasked (fixed-window) utterances")
        x = hidden_states.transpose(1, 2)[:, :, None, :]
        x = nn.functional.glu(self.pointwise_conv1(x), dim=1)
        x = self.pointwise_conv2(self.activation(self.norm(self.depthwise_conv(x))))
        return x.squeeze(2).transpose(1, 2)  # a reshape; indexing [:, :, 0] converts to a GATHER


@register("conformer_conv_module_as_conv2d", applies_to=("ParakeetForCTC",))
def conv_module_as_conv2d(module: nn.Module) -> nn.Module:
    """Run each Conformer convolution module as 2-D convolutions (no grouped Conv1D, which onnx2tf cannot save)."""
    for layer in module.encoder.layers:
        layer.conv = Conv2dConvolutionModule(layer.conv)
    return module
