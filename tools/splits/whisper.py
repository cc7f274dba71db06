"""Whisper split the way an 8MP runs it: encoder (NPU), cross-attention K/V once per utterance, decoder step (CPU).

Every graph has static shapes and no int64 tensor. The decoder step holds its self-attention cache as an
explicit input and output of `max_tokens - 1` slots that slide left by one each step (concat, then drop the
oldest): no scatter and no dynamic index, only Concat and Slice. An additive `attention_bias` over the
`max_tokens` positions masks the slots not yet filled. Token and position ids are int32.

Caches are packed one tensor per kind, layer-major: [2 * layers, heads, length, head_dim] with layer l's
keys at 2l and values at 2l + 1.
"""
from __future__ import annotations

import torch
from torch import nn


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, T, d] -> [heads, T, d / heads]."""
    return x.reshape(x.shape[1], heads, -1).transpose(0, 1)


class WhisperEncoderGraph(nn.Module):
    """log-mel features [1, n_mels, 3000] -> encoder hidden states [1, 1500, d_model]."""

    def __init__(self, model):
        super().__init__()
        self.encoder = model.model.encoder

    def forward(self, input_features):
        return self.encoder(input_features).last_hidden_state


class WhisperCrossKVGraph(nn.Module):
    """encoder hidden states -> every decoder layer's cross-attention keys and values, computed once."""

    def __init__(self, model):
        super().__init__()
        self.layers = model.model.decoder.layers
        self.heads = model.config.decoder_attention_heads

    def forward(self, encoder_hidden_states):
        kv = []
        for layer in self.layers:
            attn = layer.encoder_attn
            kv += [_heads(attn.k_proj(encoder_hidden_states), self.heads),
                   _heads(attn.v_proj(encoder_hidden_states), self.heads)]
        return torch.stack(kv)


class WhisperDecoderStepGraph(nn.Module):
    """One greedy step: a token, its position, the mask, the self and cross caches -> logits, the slid self cache."""

    def __init__(self, model):
        super().__init__()
        self.decoder = model.model.decoder
        self.proj_out = model.proj_out
        self.heads = model.config.decoder_attention_heads
        self.embed_scale = self.decoder.embed_scale
        self.register_buffer("logits_bias", torch.zeros(model.config.vocab_size), persistent=False)

    @staticmethod
    def _attend(attn, query, keys, values, bias=None):
        """Whisper attention of one query over [heads, T, head_dim] keys and values."""
        q = _heads(attn.q_proj(query) * attn.scaling, keys.shape[0])
        scores = q @ keys.transpose(1, 2)
        if bias is not None:
            scores = scores + bias
        out = torch.softmax(scores, dim=-1) @ values
        return attn.out_proj(out.transpose(0, 1).reshape(1, 1, -1))

    def forward(self, input_ids, position_ids, attention_bias, self_kv, cross_kv):
        decoder = self.decoder
        h = decoder.embed_tokens(input_ids) * self.embed_scale + nn.functional.embedding(position_ids, decoder.embed_positions.weight)
        slid = []
        for i, layer in enumerate(decoder.layers):
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(h)
            keys = torch.cat([self_kv[2 * i], _heads(attn.k_proj(x), self.heads)], dim=1)
            values = torch.cat([self_kv[2 * i + 1], _heads(attn.v_proj(x), self.heads)], dim=1)
            h = h + self._attend(attn, x, keys, values, attention_bias)
            slid += [keys[:, 1:], values[:, 1:]]
            x = layer.encoder_attn_layer_norm(h)
            h = h + self._attend(layer.encoder_attn, x, cross_kv[2 * i], cross_kv[2 * i + 1])
            x = layer.final_layer_norm(h)
            h = h + layer.fc2(layer.activation_fn(layer.fc1(x)))
        # With a bias, linear on the 2-D hidden state exports as one Gemm(transB) that reads the embedding table
        # the Gather reads (FULLY_CONNECTED's own layout): the tied matrix is not stored once more transposed.
        logits = nn.functional.linear(decoder.layer_norm(h)[:, 0], self.proj_out.weight, self.logits_bias)
        return logits, torch.stack(slid)


GRAPHS = {"encoder": WhisperEncoderGraph, "cross_kv": WhisperCrossKVGraph, "decoder_step": WhisperDecoderStepGraph}
GRAPH_IO = {
    "encoder": (["input_features"], ["last_hidden_state"]),
    "cross_kv": (["encoder_hidden_states"], ["cross_kv"]),
    "decoder_step": (["input_ids", "position_ids", "attention_bias", "self_kv", "cross_kv"], ["logits", "self_kv_out"]),
}


def self_kv_shape(config, max_tokens: int) -> tuple:
    heads = config.decoder_attention_heads
    return (2 * config.decoder_layers, heads, max_tokens - 1, config.d_model // heads)


def graphs(model) -> dict:
    return {name: cls(model).eval() for name, cls in GRAPHS.items()}


def reference_run(modules: dict, samples: list[dict], entry) -> tuple[dict, list[list[int]], dict]:
    """Greedy-decode every validation utterance in torch with the graph modules, keeping each graph's inputs.

    Returns {graph: [(label, inputs)]}, the decoded ids per utterance and torch's timings. The decoder step
    keeps two steps per utterance (the first prediction and the last step) to bound the reference size.
    """
    import time

    from tools.whisper_runtime import greedy_decode, settings_of

    settings = settings_of(entry)
    config = modules["decoder_step"].decoder.config
    feeds: dict[str, list] = {name: [] for name in GRAPHS}
    decoded, timings = [], {"encoder_s": [], "cross_kv_s": [], "decode_s": [], "steps": []}

    def step(inputs):
        with torch.no_grad():
            logits, self_kv = modules["decoder_step"](*[torch.from_numpy(inputs[n]) for n in GRAPH_IO["decoder_step"][0]])
        return logits.numpy(), self_kv.numpy()

    for index, sample in enumerate(samples):
        with torch.no_grad():
            start = time.perf_counter()
            hidden = modules["encoder"](torch.from_numpy(sample["input_features"]))
            timings["encoder_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            cross_kv = modules["cross_kv"](hidden)
            timings["cross_kv_s"].append(time.perf_counter() - start)
        feeds["encoder"].append((f"sentence {index}", {"input_features": sample["input_features"]}))
        feeds["cross_kv"].append((f"sentence {index}", {"encoder_hidden_states": hidden.numpy()}))
        steps: list = []
        start = time.perf_counter()
        ids = greedy_decode(step, cross_kv.numpy(), self_kv_shape(config, settings.max_tokens), settings,
                            on_step=lambda position, inputs: steps.append((position, inputs)))
        timings["decode_s"].append(time.perf_counter() - start)
        timings["steps"].append(len(steps))
        first = len(settings.prompt) - 1
        for position, inputs in (steps[first], steps[-1]) if len(steps) > first + 1 else (steps[first],):
            feeds["decoder_step"].append((f"sentence {index} step {position}", inputs))
        decoded.append(ids)
    return feeds, decoded, timings
