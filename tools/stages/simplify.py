"""simplify: onnxsim (constant folding, dead-node removal, shape inference), with onnxsim's own check."""
from __future__ import annotations

from pathlib import Path

from tools.atomic import atomic_path
from tools.entry import Entry


def simplify(entry: Entry, build_dir: Path) -> dict:
    import onnx
    import onnxsim

    from tools.stage import StageError

    model = onnx.load(str(build_dir / "model.onnx"))
    try:
        simplified, check_ok = onnxsim.simplify(model, check_n=1)
    except Exception as exc:  # noqa: BLE001 - onnxsim surfaces ONNX Runtime and checker errors of the graph
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StageError(f"entry {entry.id!r}: onnxsim could not simplify model.onnx: {first}") from None
    if not check_ok:
        raise StageError(f"entry {entry.id!r}: onnxsim's check failed: the simplified graph differs from model.onnx")
    with atomic_path(build_dir / "model_sim.onnx") as tmp:
        onnx.save(simplified, str(tmp))
    return {"nodes_before": len(model.graph.node), "nodes_after": len(simplified.graph.node), "onnxsim_check": check_ok}
