"""NeMo .nemo archives read as data: the state dict, the model config and the CTC labels.

A .nemo file is a tar archive holding model_config.yaml and model_weights.ckpt (a torch state dict). Members
are read in memory, never extracted (no path in the archive can reach the disk); the checkpoint loads with
torch.load(weights_only=True) and the YAML with yaml.safe_load, so that an archive can never run code.
"""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

CONFIG = "model_config.yaml"
WEIGHTS = "model_weights.ckpt"


class NemoFormatError(ValueError):
    pass


def _member(path: Path, name: str) -> bytes:
    try:
        with tarfile.open(path) as archive:
            for member in archive.getmembers():
                if member.isfile() and Path(member.name).name == name and Path(member.name).parent in (Path("."), Path("")):
                    return archive.extractfile(member).read()
    except (tarfile.TarError, OSError) as exc:
        raise NemoFormatError(f"{path} is not a .nemo (tar) archive: {exc}") from None
    raise NemoFormatError(f"{path} holds no {name} at its top level")


def read_state_dict(path: Path) -> dict:
    import pickle

    import torch

    try:
        return torch.load(io.BytesIO(_member(path, WEIGHTS)), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as exc:
        raise NemoFormatError(f"{path}: {WEIGHTS} does not load with torch.load(weights_only=True): "
                              f"{str(exc).splitlines()[0]}") from None


def read_config(path: Path) -> dict:
    import yaml

    try:
        config = yaml.safe_load(_member(path, CONFIG))
    except yaml.YAMLError as exc:
        raise NemoFormatError(f"{path}: {CONFIG} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise NemoFormatError(f"{path}: {CONFIG} is not a mapping")
    return config


def ctc_labels(path: Path) -> list[str]:
    """The CTC head's labels, blank excluded (decoder.vocabulary), in id order."""
    labels = read_config(path).get("decoder", {}).get("vocabulary")
    if not isinstance(labels, list) or not all(isinstance(t, str) for t in labels):
        raise NemoFormatError(f"{path}: {CONFIG} has no list of strings at decoder.vocabulary")
    return labels

