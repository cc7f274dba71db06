"""Build the torch module an entry's `source` section names, from an allow-list of kinds.

Only classes that transformers lists in its own auto registry, names that timm lists, or families this
repository defines (tools/families) can be built: a JSON-only contribution never runs code of its own, and
remote code is never trusted.
"""
from __future__ import annotations

import dataclasses

from tools.entry import Entry, EntryError

# Arguments transformers' configs take at construction without keeping a field of that name.
CONFIG_INIT_ARGUMENTS = {"num_labels", "backbone", "use_timm_backbone", "backbone_kwargs"}


def _transformers_model_classes() -> set[str]:
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for attr in dir(modeling_auto):
        if attr.startswith("MODEL") and attr.endswith("_MAPPING_NAMES"):
            for value in getattr(modeling_auto, attr).values():
                names.update(value if isinstance(value, (list, tuple)) else [value])
    return names


def _build_transformers(entry: Entry):
    import transformers

    spec = entry.data["source"]
    name = spec["class"]
    if name not in _transformers_model_classes():
        raise EntryError(entry.path, "$.source.class",
                         f"{name!r} is not a model class in transformers {transformers.__version__}'s auto registry")
    model_cls = getattr(transformers, name)
    overrides = dict(spec.get("config", {}))
    config_cls = model_cls.config_class
    # Config classes keep unknown keyword arguments silently: check names so that a typo is an error.
    known = {f.name for f in dataclasses.fields(config_cls)} | CONFIG_INIT_ARGUMENTS
    for key in overrides:
        if key not in known:
            raise EntryError(entry.path, f"$.source.config.{key}",
                             f"{config_cls.__name__} has no field {key!r}; fields: {sorted(known)}")
    try:
        config = config_cls(**overrides)
    except (TypeError, ValueError) as exc:
        raise EntryError(entry.path, "$.source.config", f"{config_cls.__name__} rejects it: {exc}") from None
    return model_cls(config)


# create_model arguments that would load weights or configs from elsewhere (timm unpickles checkpoint files):
# weights come only through the entry's `weights` section, which loads them as data.
TIMM_REFUSED_ARGUMENTS = {"pretrained", "checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"}


def _build_timm(entry: Entry):
    import timm

    spec = entry.data["source"]
    name = spec["model"]
    if name not in timm.list_models():
        raise EntryError(entry.path, "$.source.model", f"{name!r} is not a model name in timm {timm.__version__}")
    for key in spec.get("config", {}):
        if key in TIMM_REFUSED_ARGUMENTS:
            raise EntryError(entry.path, f"$.source.config.{key}",
                             f"{key!r} would load weights or settings outside the entry; declare weights in $.weights")
    try:
        return timm.create_model(name, pretrained=False, **spec.get("config", {}))
    except TypeError as exc:
        raise EntryError(entry.path, "$.source.config", f"timm.create_model({name!r}) rejects it: {exc}") from None


def _build_zoo(entry: Entry):
    from tools.families import REGISTRY

    spec = entry.data["source"]
    family = REGISTRY.get(spec["family"])
    if family is None:
        raise EntryError(entry.path, "$.source.family", f"{spec['family']!r} is not a zoo family; families: {sorted(REGISTRY)}")
    module = family.load()
    config = spec.get("config", {})
    for key in config:
        if key not in module.CONFIG_KEYS:
            raise EntryError(entry.path, f"$.source.config.{key}",
                             f"family {family.name!r} has no setting {key!r}; settings: {sorted(module.CONFIG_KEYS)}")
    try:
        return module.build(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise EntryError(entry.path, "$.source.config", f"family {family.name!r} rejects it: {exc}") from None


BUILDERS = {"transformers": _build_transformers, "timm": _build_timm, "zoo": _build_zoo}


def build_module(entry: Entry):
    """The entry's torch module with freshly initialised weights, in eval mode."""
    import torch

    torch.manual_seed(0)
    module = BUILDERS[entry.data["source"]["kind"]](entry)
    return module.eval()


def forward_arguments(module) -> list[str]:
    """Names the module's forward accepts, to check the entry's declared inputs against."""
    import inspect

    return list(inspect.signature(module.forward).parameters)
