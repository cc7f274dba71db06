"""Conformer-CTC from transformers' Parakeet modules, with NeMo's two subsampling front ends.

transformers' ParakeetForCTC is NeMo's FastConformer: its subsampling stacks depthwise-separable stride-2
convolutions ('dw_striding'). NeMo's original Conformer-CTC checkpoints (stt_en_conformer_ctc_small/medium/large)
use 'striding': full 3x3 stride-2 convolutions with ReLU. Everything after the subsampling (x-scaling,
relative positions interleaved sin/cos, macaron blocks, untied position biases per layer, BatchNorm in the
convolution module, a 1x1 convolution as CTC head) is the same in both, so only the subsampling is swapped.
"""
from __future__ import annotations

import math

from torch import nn

# Encoder settings an entry may set (ParakeetEncoderConfig fields); the others keep transformers' defaults.
ENCODER_KEYS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "conv_kernel_size",
                "subsampling_factor", "subsampling_conv_channels", "num_mel_bins", "scale_input"}
CONFIG_KEYS = ENCODER_KEYS | {"subsampling", "vocab_size"}
SUBSAMPLING = ("striding", "dw_striding")


def _striding_layers(channels: int, stages: int) -> nn.ModuleList:
    """Full 3x3 stride-2 convolutions, each followed by ReLU: NeMo's 'striding' ConvSubsampling."""
    layers = nn.ModuleList()
    for i in range(stages):
        layers.append(nn.Conv2d(1 if i == 0 else channels, channels, kernel_size=3, stride=2, padding=1))
        layers.append(nn.ReLU())
    return layers


def build(config: dict):
    """ParakeetForCTC for `config`; the blank is the last vocabulary id, as in NeMo."""
    from transformers import ParakeetCTCConfig, ParakeetForCTC

    subsampling = config.get("subsampling", "dw_striding")
    if subsampling not in SUBSAMPLING:
        raise ValueError(f"subsampling {subsampling!r} is not one of {list(SUBSAMPLING)}")
    encoder = {k: v for k, v in config.items() if k in ENCODER_KEYS}
    encoder.update(dropout=0.0, dropout_positions=0.0, layerdrop=0.0, activation_dropout=0.0, attention_dropout=0.0)
    vocab_size = config["vocab_size"]
    model = ParakeetForCTC(ParakeetCTCConfig(encoder_config=encoder, vocab_size=vocab_size, pad_token_id=vocab_size - 1))
    if subsampling == "striding":
        sub = model.encoder.subsampling
        sub.layers = _striding_layers(sub.channels, int(math.log2(model.config.encoder_config.subsampling_factor)))
    return model
