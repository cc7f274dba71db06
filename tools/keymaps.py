"""Named key maps: from a checkpoint's original key layout to the source module's state-dict keys.

Each map is a function state_dict -> state_dict, registered by name and named by an entry's
`weights.key_map`. A map must account for every key: anything it does not know is an error, so that a
checkpoint of another layout fails loudly instead of loading half its weights.
"""
from __future__ import annotations

import re

REGISTRY: dict = {}


def register(name: str):
    def wrap(fn):
        REGISTRY[name] = fn
        return fn
    return wrap


def compile_rules(rules: list[tuple[str, str]]) -> list:
    """(regex, replacement) pairs, each regex anchored at both ends."""
    return [(re.compile(pattern + r"\Z"), target) for pattern, target in rules]


def renamed(key: str, rules: list) -> str | None:
    """`key` under the first compiled rule that matches it, or None when none does."""
    for pattern, target in rules:
        if pattern.match(key):
            return pattern.sub(target, key)
    return None


def renamed_all(items, rules: list, map_name: str, layout: str) -> dict:
    """Every (key, tensor) under its renamed key; a key no rule knows is an error naming the map and the layout."""
    out, unknown = {}, []
    for key, tensor in items:
        target = renamed(key, rules)
        if target is None:
            unknown.append(key)
        else:
            out[target] = tensor
    if unknown:
        raise KeyError(f"{map_name}: {len(unknown)} keys of no known {layout} layout, e.g. {unknown[:5]}")
    return out


# DN-DETR (IDEA-Research/DN-DETR, models/DN_DAB_DETR) -> transformers DabDetrForObjectDetection.
# Renames of whole key prefixes/suffixes, tried in order; {i} is a layer index.
_DN_DETR_RULES = [
    (r"backbone\.0\.body\.(.+)", r"model.backbone.conv_encoder.model._backbone.\1"),
    (r"input_proj\.(weight|bias)", r"model.input_projection.\1"),
    (r"refpoint_embed\.weight", r"model.query_refpoint_embeddings.weight"),
    (r"class_embed\.(weight|bias)", r"class_embed.\1"),
    (r"bbox_embed\.layers\.(\d)\.(weight|bias)", r"bbox_predictor.layers.\1.\2"),
    (r"transformer\.decoder\.bbox_embed\.layers\.(\d)\.(weight|bias)", r"model.decoder.bbox_embed.layers.\1.\2"),
    (r"transformer\.encoder\.query_scale\.(.+)", r"model.encoder.query_scale.\1"),
    (r"transformer\.encoder\.layers\.(\d+)\.self_attn\.out_proj\.(.+)", r"model.encoder.layers.\1.self_attn.out_proj.\2"),
    (r"transformer\.encoder\.layers\.(\d+)\.linear([12])\.(.+)", r"model.encoder.layers.\1.fc\2.\3"),
    (r"transformer\.encoder\.layers\.(\d+)\.norm1\.(.+)", r"model.encoder.layers.\1.self_attn_layer_norm.\2"),
    (r"transformer\.encoder\.layers\.(\d+)\.norm2\.(.+)", r"model.encoder.layers.\1.final_layer_norm.\2"),
    (r"transformer\.encoder\.layers\.(\d+)\.activation\.weight", r"model.encoder.layers.\1.activation_fn.weight"),
    (r"transformer\.decoder\.norm\.(.+)", r"model.decoder.layernorm.\1"),
    (r"transformer\.decoder\.(ref_point_head|ref_anchor_head|query_scale)\.(.+)", r"model.decoder.\1.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.sa_qcontent_proj\.(.+)", r"model.decoder.layers.\1.self_attn.self_attn_query_content_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.sa_qpos_proj\.(.+)", r"model.decoder.layers.\1.self_attn.self_attn_query_pos_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.sa_kcontent_proj\.(.+)", r"model.decoder.layers.\1.self_attn.self_attn_key_content_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.sa_kpos_proj\.(.+)", r"model.decoder.layers.\1.self_attn.self_attn_key_pos_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.sa_v_proj\.(.+)", r"model.decoder.layers.\1.self_attn.self_attn_value_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.self_attn\.out_proj\.(.+)", r"model.decoder.layers.\1.self_attn.self_attn.output_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.norm1\.(.+)", r"model.decoder.layers.\1.self_attn.self_attn_layer_norm.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.ca_qcontent_proj\.(.+)", r"model.decoder.layers.\1.cross_attn.cross_attn_query_content_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.ca_qpos_proj\.(.+)", r"model.decoder.layers.\1.cross_attn.cross_attn_query_pos_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.ca_kcontent_proj\.(.+)", r"model.decoder.layers.\1.cross_attn.cross_attn_key_content_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.ca_kpos_proj\.(.+)", r"model.decoder.layers.\1.cross_attn.cross_attn_key_pos_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.ca_v_proj\.(.+)", r"model.decoder.layers.\1.cross_attn.cross_attn_value_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.ca_qpos_sine_proj\.(.+)", r"model.decoder.layers.\1.cross_attn.cross_attn_query_pos_sine_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.cross_attn\.out_proj\.(.+)", r"model.decoder.layers.\1.cross_attn.cross_attn.output_proj.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.norm2\.(.+)", r"model.decoder.layers.\1.cross_attn.cross_attn_layer_norm.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.linear([12])\.(.+)", r"model.decoder.layers.\1.mlp.fc\2.\3"),
    (r"transformer\.decoder\.layers\.(\d+)\.norm3\.(.+)", r"model.decoder.layers.\1.mlp.final_layer_norm.\2"),
    (r"transformer\.decoder\.layers\.(\d+)\.activation\.weight", r"model.decoder.layers.\1.mlp.activation_fn.weight"),
]
_DN_DETR_COMPILED = compile_rules(_DN_DETR_RULES)
_IN_PROJ = re.compile(r"transformer\.encoder\.layers\.(\d+)\.self_attn\.in_proj_(weight|bias)\Z")


@register("dn_detr_original")
def dn_detr_original(state: dict) -> dict:
    """DN-DETR's DN-DAB-DETR checkpoint keys -> transformers DabDetrForObjectDetection keys.

    Three things are more than renames:
    - the encoder's packed q/k/v `in_proj` is split into q_proj, k_proj and v_proj (row thirds);
    - at inference DN-DETR's content query is `label_enc` row `num_classes` with a 0 appended as the
      denoising indicator; transformers carries a learned content query as a single pattern, so that row
      becomes `model.patterns.weight` (the entry sets num_patterns=1). The other rows only encode noised
      ground-truth labels for training and are dropped;
    - a `module.` prefix from DistributedDataParallel is stripped.
    """
    import torch

    out, plain = {}, []
    for key, tensor in state.items():
        key = key.removeprefix("module.")
        if key == "label_enc.weight":
            content = tensor[-1]  # row num_classes: the "no label" embedding used for matching queries
            out["model.patterns.weight"] = torch.cat([content, content.new_zeros(1)])[None]
            continue
        packed = _IN_PROJ.match(key)
        if packed:
            layer, kind = packed.groups()
            for name, part in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                out[f"model.encoder.layers.{layer}.self_attn.{name}.{kind}"] = part.clone()
            continue
        plain.append((key, tensor))
    return {**out, **renamed_all(plain, _DN_DETR_COMPILED, "dn_detr_original", "DN-DETR")}


@register("whisper_ctranslate2")
def whisper_ctranslate2(state: dict) -> dict:
    """CTranslate2 WhisperSpec variables -> transformers WhisperForConditionalGeneration keys (fused q/k/v split)."""
    from tools.ctranslate2 import whisper_to_transformers

    return whisper_to_transformers(state)


# NeMo ConformerEncoder + ConvASRDecoder (EncDecCTCModelBPE) -> tools/families/conformer_ctc (Parakeet modules).
_NEMO_CONFORMER_RULES = compile_rules([
    (r"encoder\.pre_encode\.conv\.(\d+)\.(weight|bias)", r"encoder.subsampling.layers.\1.\2"),
    (r"encoder\.pre_encode\.out\.(weight|bias)", r"encoder.subsampling.linear.\1"),
    (r"encoder\.layers\.(\d+)\.(norm_feed_forward[12]|norm_self_att|norm_conv|norm_out)\.(weight|bias)",
     r"encoder.layers.\1.\2.\3"),
    (r"encoder\.layers\.(\d+)\.(feed_forward[12])\.(linear[12])\.(weight|bias)", r"encoder.layers.\1.\2.\3.\4"),
    (r"encoder\.layers\.(\d+)\.self_attn\.linear_q\.(weight|bias)", r"encoder.layers.\1.self_attn.q_proj.\2"),
    (r"encoder\.layers\.(\d+)\.self_attn\.linear_k\.(weight|bias)", r"encoder.layers.\1.self_attn.k_proj.\2"),
    (r"encoder\.layers\.(\d+)\.self_attn\.linear_v\.(weight|bias)", r"encoder.layers.\1.self_attn.v_proj.\2"),
    (r"encoder\.layers\.(\d+)\.self_attn\.linear_out\.(weight|bias)", r"encoder.layers.\1.self_attn.o_proj.\2"),
    (r"encoder\.layers\.(\d+)\.self_attn\.linear_pos\.weight", r"encoder.layers.\1.self_attn.relative_k_proj.weight"),
    (r"encoder\.layers\.(\d+)\.self_attn\.pos_bias_u", r"encoder.layers.\1.self_attn.bias_u"),
    (r"encoder\.layers\.(\d+)\.self_attn\.pos_bias_v", r"encoder.layers.\1.self_attn.bias_v"),
    (r"encoder\.layers\.(\d+)\.conv\.(pointwise_conv1|depthwise_conv|pointwise_conv2)\.(weight|bias)",
     r"encoder.layers.\1.conv.\2.\3"),
    (r"encoder\.layers\.(\d+)\.conv\.batch_norm\.(weight|bias|running_mean|running_var|num_batches_tracked)",
     r"encoder.layers.\1.conv.norm.\2"),
    (r"decoder\.decoder_layers\.0\.(weight|bias)", r"ctc_head.\1"),
])
# Buffers NeMo saves that the graph does not take as weights: the front end runs outside the graph
# (tools/logmel.py), and the relative positions are recomputed for the input's static length.
_NEMO_DROPPED = re.compile(r"(preprocessor\.featurizer\.(window|fb)|encoder\.pos_enc\.pe)\Z")


@register("nemo_conformer_ctc")
def nemo_conformer_ctc(state: dict) -> dict:
    """NeMo Conformer-CTC (stt_en_conformer_ctc_*) keys -> the conformer_ctc family's: renames only."""
    kept = ((key, tensor) for key, tensor in state.items() if not _NEMO_DROPPED.match(key))
    return renamed_all(kept, _NEMO_CONFORMER_RULES, "nemo_conformer_ctc", "NeMo Conformer-CTC")
