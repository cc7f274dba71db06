"""simplify: onnxsim (constant folding, dead-node removal, shape inference), with onnxsim's own check.

Every max pool that follows a ReLU is then padded with an explicit zero Pad instead of its own -inf pads
(tools/patches/onnx_layout.py says why: the -inf wrecks INT8 calibration). onnxsim's `fuse_pad_into_pool`
is skipped, as it would fold such a Pad back into MaxPool's pads (wrong in general: those mean -inf).

The entry's ONNX-graph patches (tools/patches, graph "onnx") are applied here, on the simplified graph:
only there are all shapes static, which their pattern matching needs. Validation checks the result.
"""
from __future__ import annotations

from pathlib import Path

from tools.atomic import atomic_path
from tools.entry import Entry, EntryError
from tools.patches import apply_onnx_patches
from tools.patches.onnx_layout import relu_maxpool_zero_padding

SKIPPED_OPTIMIZERS = ["fuse_pad_into_pool"]


def simplify(entry: Entry, build_dir: Path) -> dict:
    import onnx
    import onnxsim

    from tools.stages import StageError

    model = onnx.load(str(build_dir / "model.onnx"))
    try:
        simplified, check_ok = onnxsim.simplify(model, check_n=1, skipped_optimizers=SKIPPED_OPTIMIZERS)
    except Exception as exc:  # noqa: BLE001 - onnxsim surfaces ONNX Runtime and checker errors of the graph
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StageError(f"entry {entry.id!r}: onnxsim could not simplify model.onnx: {first}") from None
    if not check_ok:
        raise StageError(f"entry {entry.id!r}: onnxsim's check failed: the simplified graph differs from model.onnx")
    zero_padded_pools = relu_maxpool_zero_padding(simplified)
    try:
        rewrites = apply_onnx_patches(simplified, entry.data["export"].get("patches", []))
    except ValueError as exc:
        raise EntryError(entry.path, "$.export.patches", str(exc)) from None
    onnx.checker.check_model(simplified)
    with atomic_path(build_dir / "model_sim.onnx") as tmp:
        onnx.save(simplified, str(tmp))
    return {"nodes_before": len(model.graph.node), "nodes_after": len(simplified.graph.node), "onnxsim_check": check_ok,
            "skipped_optimizers": SKIPPED_OPTIMIZERS, "relu_maxpool_zero_padding": zero_padded_pools, "onnx_patches": rewrites}
