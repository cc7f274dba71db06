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
    apply: Callable             # module -> module to export
    summary: str


def register(name: str, applies_to: tuple[str, ...]):
    def wrap(fn: Callable) -> Callable:
        REGISTRY[name] = Patch(name, applies_to, fn, (fn.__doc__ or "").strip().splitlines()[0])
        return fn
    return wrap


def apply_patches(module, names: list[str]):
    """Apply the named patches in order; refuse a patch on a class it was not written for."""
    for name in names:
        patch = REGISTRY[name]
        target = type(module).__name__
        if target not in patch.applies_to:
            raise ValueError(f"export patch {name!r} rewrites {list(patch.applies_to)}, not {target}")
        module = patch.apply(module)
    return module


from tools.patches import dab_detr, deformable_detr  # noqa: E402,F401  (registration)
