"""Named export patches: rewrites of a torch module that make it export and convert cleanly.

Like MMDeploy's rewriters, each patch has a name, is listed in an entry's `export.patches`, applied in
that order after the weights are loaded, and recorded in every build that uses it. A patch must keep
the module's outputs within the entry's tolerances; the validate stage checks that it did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

REGISTRY: dict[str, "Patch"] = {}


@dataclass(frozen=True)
class Patch:
    name: str
    applies_to: tuple[str, ...]  # source classes the patch knows how to rewrite
    apply: Callable             # torch module -> module to export, or ONNX model (rewritten in place) -> rewrites made
    summary: str
    graph: str = "torch"        # what it rewrites: the torch module before export, or the exported ONNX graph


def register(name: str, applies_to: tuple[str, ...], graph: str = "torch"):
    def wrap(fn: Callable) -> Callable:
        REGISTRY[name] = Patch(name, applies_to, fn, (fn.__doc__ or "").strip().splitlines()[0], graph)
        return fn
    return wrap


def apply_patches(module, names: list[str]):
    """Apply the named torch patches in order; refuse a patch on a source class it was not written for."""
    target = type(module).__name__  # the source class, before any patch wraps the module
    for name in names:
        patch = REGISTRY[name]
        if target not in patch.applies_to:
            raise ValueError(f"export patch {name!r} rewrites {list(patch.applies_to)}, not {target}")
        if patch.graph == "torch":
            module = patch.apply(module)
    return module


def apply_onnx_patches(model, names: list[str]) -> dict[str, int]:
    """Apply the named ONNX-graph patches in order; how many rewrites each made (a patch that finds nothing
    to rewrite is an error: the entry names it for a reason)."""
    made = {}
    for name in names:
        if REGISTRY[name].graph == "onnx":
            made[name] = REGISTRY[name].apply(model)
            if not made[name]:
                raise ValueError(f"ONNX patch {name!r} found nothing to rewrite in this graph")
    return made


from tools.patches import conformer, dab_detr, deformable_detr, onnx_layout  # noqa: E402,F401  (registration)
