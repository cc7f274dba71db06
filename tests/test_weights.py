"""Weights resolve from each declared kind, are checked against their sha256, and load only as data."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from conftest import ROOT, tiny_entry_data, write_entry
from tools.entry import EntryError, load_entry
from tools.sources import build_module
from tools.weights import WeightsUnavailable, load_into, sha256_of


def _entry(tmp_path, weights: dict, base="dn_detr"):
    data = tiny_entry_data(base, f"{base}_w")
    data["weights"] = weights
    return load_entry(write_entry(tmp_path / "zoo", data))


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A trained-looking checkpoint written with save_pretrained, as a hub repo or a user would have it."""
    folder = tmp_path_factory.mktemp("ckpt")
    entry = _entry(folder, {"kind": "local", "path": "x", "format": "safetensors", "sha256": None,
                            "unpinned_reason": "made by the test"})
    module = build_module(entry)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    module.save_pretrained(folder / "hf")
    return folder / "hf" / "model.safetensors", module.state_dict()


def test_local_safetensors_checkpoint_loads_every_tensor(tmp_path, saved_checkpoint):
    path, expected = saved_checkpoint
    entry = _entry(tmp_path, {"kind": "local", "path": str(path), "format": "safetensors", "sha256": sha256_of(path)})
    module = build_module(entry)
    record = load_into(entry, module)
    assert record["kind"] == "trained" and record["sha256_loaded"] == sha256_of(path)
    got = module.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)  # tied weights included


def test_pinned_checksum_mismatch_stops_the_build(tmp_path, saved_checkpoint):
    path, _ = saved_checkpoint
    entry = _entry(tmp_path, {"kind": "local", "path": str(path), "format": "safetensors", "sha256": "0" * 64})
    with pytest.raises(EntryError, match="the entry pins 0000") as info:
        load_into(entry, build_module(entry))
    assert info.value.json_path == "$.weights.sha256"


def test_torch_checkpoint_loads_with_weights_only_and_refuses_code(tmp_path, saved_checkpoint):
    _, expected = saved_checkpoint
    good = tmp_path / "ckpt.pth"
    torch.save({"model": expected, "args": argparse.Namespace(lr=1e-4)}, good)
    entry = _entry(tmp_path, {"kind": "local", "path": str(good), "format": "torch", "state_dict_key": "model",
                              "sha256": None, "unpinned_reason": "made by the test"})
    module = build_module(entry)
    assert load_into(entry, module)["kind"] == "trained"

    class Payload:  # a pickle that would run code on load
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pth"
    torch.save({"model": expected, "x": Payload()}, evil)
    entry = _entry(tmp_path, {"kind": "local", "path": str(evil), "format": "torch", "state_dict_key": "model",
                              "sha256": None, "unpinned_reason": "made by the test"})
    with pytest.raises(EntryError, match="weights_only"):
        load_into(entry, build_module(entry))


def test_wrong_architecture_is_named(tmp_path, saved_checkpoint):
    path, _ = saved_checkpoint
    data = tiny_entry_data("dn_detr", "dn_detr_w")
    data["source"]["config"]["hidden_size"] = 64
    data["weights"] = {"kind": "local", "path": str(path), "format": "safetensors", "sha256": None,
                       "unpinned_reason": "made by the test"}
    entry = load_entry(write_entry(tmp_path / "zoo", data))
    with pytest.raises(EntryError, match="does not fit DabDetrForObjectDetection"):
        load_into(entry, build_module(entry))


def test_url_weights_come_from_the_cache_when_offline(tmp_path, saved_checkpoint, monkeypatch):
    path, _ = saved_checkpoint
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    entry = _entry(tmp_path, {"kind": "url", "url": "https://weights.invalid/model.safetensors",
                              "file": "model.safetensors", "format": "safetensors", "sha256": sha256_of(path)})
    with pytest.raises(WeightsUnavailable) as info:
        load_into(entry, build_module(entry))
    target = tmp_path / "cache" / "weights" / "dn_detr_w" / "model.safetensors"
    assert str(target) in str(info.value) and "ZOO_WEIGHTS=random" in str(info.value)
    assert not target.exists()  # no half-written download left behind
    target.write_bytes(path.read_bytes())
    assert load_into(entry, build_module(entry))["sha256_loaded"] == sha256_of(path)


def test_random_weights_only_on_explicit_opt_in(tmp_path, monkeypatch):
    entry = _entry(tmp_path, {"kind": "hub", "repo": "nobody/nothing", "revision": "0" * 40,
                              "file": "model.safetensors", "format": "safetensors", "sha256": None,
                              "unpinned_reason": "made by the test"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("ZOO_WEIGHTS", raising=False)
    with pytest.raises(WeightsUnavailable, match="entry 'dn_detr_w'.*nobody/nothing.*ZOO_WEIGHTS=random"):
        load_into(entry, build_module(entry))
    monkeypatch.setenv("ZOO_WEIGHTS", "random")
    record = load_into(entry, build_module(entry))
    assert record["kind"] == "random" and "ZOO_WEIGHTS=random" in record["reason"]


def test_package_weights_resolve_inside_the_installed_distribution(tmp_path):
    from importlib import metadata

    from tools.weights import resolve

    entry = _entry(tmp_path, {"kind": "package", "package": "jsonschema", "file": "jsonschema/__init__.py",
                              "format": "safetensors", "sha256": None, "unpinned_reason": "made by the test"})
    path = resolve(entry)
    assert path == metadata.distribution("jsonschema").locate_file("jsonschema/__init__.py")
    missing = _entry(tmp_path, {"kind": "package", "package": "no-such-package-here", "file": "w.bin",
                                "format": "safetensors", "sha256": None, "unpinned_reason": "made by the test"})
    with pytest.raises(WeightsUnavailable, match="pip install no-such-package-here"):
        resolve(missing)
