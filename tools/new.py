"""Write a starting zoo entry for a model that an allow-listed source kind can build.

    python -m tools.new ID --from transformers:DeformableDetrForObjectDetection
    python -m tools.new ID --from timm:mobilenetv3_large_100

The entry names the model, its task, inputs, outputs and default tolerances, with a smoke section. What only
the contributor can know is left as FILL-IN, which `doit check` refuses until it is replaced: the licenses
of code and weights, and the trained weights (hub repo + revision, URL + sha256, or package + file).
CONTRIBUTING.md walks from here to a pull request.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.calibration import CALIBRATION_PHOTOS
from tools.entry import ID_PATTERN, PLACEHOLDER, ZOO_DIR

# transformers auto-mapping -> (zoo task, the model's output fields, default input side)
TRANSFORMERS_TASKS = {
    "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES": ("object-detection", ["logits", "pred_boxes"], 512),
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES": ("image-classification", ["logits"], 224),
}
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
SMOKE_SIDE = 64


class ScaffoldError(ValueError):
    pass


def _transformers_spec(name: str) -> dict:
    from transformers.models.auto import modeling_auto

    for mapping, (task, outputs, side) in TRANSFORMERS_TASKS.items():
        if name in getattr(modeling_auto, mapping).values():
            return {"source": {"kind": "transformers", "class": name, "config": {}}, "task": task,
                    "input": "pixel_values", "side": side, "norm": IMAGENET, "outputs": outputs}
    from tools.sources import _transformers_model_classes

    if name in _transformers_model_classes():
        raise ScaffoldError(f"{name} is in transformers' registry, but not for a task this scaffold writes "
                            f"({', '.join(t for t, _, _ in TRANSFORMERS_TASKS.values())}); write the entry by hand")
    raise ScaffoldError(f"{name!r} is not a model class in transformers' auto registry")


def _timm_spec(name: str) -> dict:
    import timm

    if name not in timm.list_models():
        raise ScaffoldError(f"{name!r} is not a model name in timm {timm.__version__}")
    cfg = timm.models.get_pretrained_cfg(name)
    side = cfg.input_size[-1] if cfg else 224
    norm = {"mean": list(cfg.mean), "std": list(cfg.std)} if cfg else IMAGENET
    return {"source": {"kind": "timm", "model": name, "config": {}}, "task": "image-classification",
            "input": "x", "side": side, "norm": norm, "outputs": ["logits"]}


def scaffold(entry_id: str, origin: str) -> dict:
    kind, _, name = origin.partition(":")
    if not ID_PATTERN.match(entry_id):
        raise ScaffoldError(f"id {entry_id!r}: use lower-case letters, digits and '_' (2-64 characters, a letter first)")
    builders = {"transformers": _transformers_spec, "timm": _timm_spec}
    if kind not in builders or not name:
        raise ScaffoldError(f"--from {origin!r}: expected transformers:<ModelClass> or timm:<model_name>")
    spec = builders[kind](name)
    side = spec["side"]
    return {
        "$schema": "../schema/entry.schema.json",
        "id": entry_id,
        "title": f"{name} ({spec['task']})",
        "task": spec["task"],
        "notes": "Written by tools.new; CONTRIBUTING.md says what to fill in and how to check it.",
        "source": spec["source"],
        "weights": {"kind": "hub", "repo": f"{PLACEHOLDER}/{PLACEHOLDER}", "revision": "0" * 40,
                    "file": "model.safetensors", "format": "safetensors", "sha256": None,
                    "unpinned_reason": f"{PLACEHOLDER}: declare the trained checkpoint and pin its sha256"},
        "inputs": [{"name": spec["input"], "shape": [1, 3, side, side], "dtype": "float32", "layout": "NCHW",
                    "preprocess": {"kind": "image", "resize": "bilinear", "scale": 255, **spec["norm"]}}],
        "outputs": spec["outputs"],
        "validation": {"samples": ["skimage:astronaut", "skimage:coffee", "skimage:chelsea"]},
        "export": {"opset": 17, "patches": []},
        "quantization": {
            "enabled": True,
            "variants": [{"name": "int8_pt", "weights": "per-tensor"}, {"name": "int8_pc", "weights": "per-channel"}],
            "calibration": {"kind": "photos", "samples": list(CALIBRATION_PHOTOS), "count": 16, "seed": 0},
            "fidelity": {"min_sqnr_db": 15, "min_cosine": 0.98},
        },
        "tolerances": {stage: {"atol": 1e-4, "rtol": 1e-3} for stage in ("onnx", "onnx_simplified", "tflite_fp32")},
        "bench": {"input_sizes": [[side // 2, side // 2], [side, side]], "threads": 2, "runs": 10},
        "smoke": {"config": {}, "input_shapes": [[1, 3, SMOKE_SIDE, SMOKE_SIDE]]},
        "license": {"code": PLACEHOLDER, "weights": PLACEHOLDER},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.new", description=__doc__.split("\n\n")[0])
    parser.add_argument("id", help="the new entry's id (and file name)")
    parser.add_argument("--from", dest="origin", required=True, help="transformers:<ModelClass> or timm:<model_name>")
    parser.add_argument("--zoo", default=str(ZOO_DIR), help="zoo folder (default: zoo/)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing entry")
    args = parser.parse_args(argv)
    path = Path(args.zoo) / f"{args.id}.json"
    if path.exists() and not args.force:
        print(f"error: {path} exists; pick another id or pass --force", file=sys.stderr)
        return 1
    try:
        data = scaffold(args.id, args.origin)
    except ScaffoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}; fill in $.license, $.weights and the smoke section's config, then: doit check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
