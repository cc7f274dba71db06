"""The dn_detr_original key map loads a checkpoint in the DN-DETR authors' layout into the real dn_detr entry."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from tools.entry import EntryError, load_entry
from tools.keymaps import dn_detr_original
from tools.sources import build_module
from tools.weights import load_into

KEYS = Path(__file__).parent / "data" / "dn_detr_r50_original_keys.txt"


def _original_state() -> dict:
    generator = torch.Generator().manual_seed(0)
    state = {}
    for line in KEYS.read_text().splitlines():
        key, shape = re.match(r"(\S+) \((.*)\)", line).groups()
        dims = [int(d) for d in shape.split(",") if d.strip()]
        state[key] = torch.randn(dims, generator=generator)
    # In the authors' model the decoder's bbox_embed is the detector's: one tensor under two names.
    for key in [k for k in state if k.startswith("bbox_embed.")]:
        state[f"transformer.decoder.{key}"] = state[key]
    return state


@pytest.fixture(scope="module")
def original_checkpoint(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    entry = load_entry(ROOT / "zoo" / "dn_detr.json")
    path = cache / "weights" / "dn_detr" / entry.data["weights"]["file"]
    path.parent.mkdir(parents=True)
    state = _original_state()
    # The authors' checkpoints hold training state and an argparse.Namespace beside the weights.
    torch.save({"model": state, "epoch": 49, "args": argparse.Namespace(num_patterns=0, dilation=False)}, path)
    return cache, state


def test_original_checkpoint_loads_strictly_into_the_dn_detr_entry(original_checkpoint, monkeypatch):
    cache, state = original_checkpoint
    monkeypatch.setenv("ZOO_CACHE", str(cache))
    entry = load_entry(ROOT / "zoo" / "dn_detr.json")
    module = build_module(entry)
    record = load_into(entry, module)  # raises on any missing, unexpected or mis-shaped key
    assert record["kind"] == "trained" and record["key_map"] == "dn_detr_original"
    got = module.state_dict()
    # The encoder's packed in_proj is split into q, k, v by row thirds.
    packed = state["transformer.encoder.layers.3.self_attn.in_proj_weight"]
    assert torch.equal(got["model.encoder.layers.3.self_attn.q_proj.weight"], packed[:256])
    assert torch.equal(got["model.encoder.layers.3.self_attn.k_proj.weight"], packed[256:512])
    assert torch.equal(got["model.encoder.layers.3.self_attn.v_proj.bias"],
                       state["transformer.encoder.layers.3.self_attn.in_proj_bias"][512:])
    # DN-DETR's inference content query: label_enc row 91 with a zero indicator appended.
    pattern = got["model.patterns.weight"]
    assert pattern.shape == (1, 256)
    assert torch.equal(pattern[0, :255], state["label_enc.weight"][91]) and pattern[0, 255] == 0
    assert torch.equal(got["model.backbone.conv_encoder.model._backbone.layer4.2.conv3.weight"],
                       state["backbone.0.body.layer4.2.conv3.weight"])
    assert torch.equal(got["bbox_predictor.layers.2.weight"], state["bbox_embed.layers.2.weight"])
    assert torch.equal(got["model.decoder.layers.0.cross_attn.cross_attn_query_pos_proj.weight"],
                       state["transformer.decoder.layers.0.ca_qpos_proj.weight"])
    assert torch.equal(got["model.decoder.layers.5.mlp.activation_fn.weight"],
                       state["transformer.decoder.layers.5.activation.weight"])


def test_every_module_tensor_is_covered_by_the_map():
    mapped = dn_detr_original(_original_state())
    module_keys = set(build_module(load_entry(ROOT / "zoo" / "dn_detr.json")).state_dict())
    assert set(mapped) == module_keys


def test_unknown_original_key_is_an_error(original_checkpoint, tmp_path, monkeypatch):
    cache, state = original_checkpoint
    bad_cache = tmp_path / "cache"
    path = bad_cache / "weights" / "dn_detr" / "checkpoint_optimized_44.7ap.pth"
    path.parent.mkdir(parents=True)
    torch.save({"model": {**state, "transformer.decoder.extra_head.weight": torch.zeros(2)}}, path)
    monkeypatch.setenv("ZOO_CACHE", str(bad_cache))
    entry = load_entry(ROOT / "zoo" / "dn_detr.json")
    with pytest.raises(EntryError, match="extra_head") as info:
        load_into(entry, build_module(entry))
    assert info.value.json_path == "$.weights.key_map"
