"""Versions of the tools each stage calls: part of every stage's up-to-date check and of every record."""
from __future__ import annotations

import platform
from importlib import metadata

STAGE_TOOLS = {
    "export": ["torch", "transformers", "timm", "onnx", "numpy"],
    "simplify": ["onnx", "onnxsim", "onnxruntime"],
    "convert": ["onnx2tf", "tensorflow", "tf-keras", "onnx", "onnxsim", "onnxruntime", "ai-edge-litert"],
    "validate": ["onnxruntime", "ai-edge-litert", "numpy"],
    "quantize": ["tensorflow", "numpy", "scikit-image", "pillow"],
    "fidelity": ["ai-edge-litert", "numpy"],
    "npu": ["tensorflow"],
    "bench": ["torch", "transformers", "timm", "onnxruntime", "ai-edge-litert", "numpy", "matplotlib"],
}


def tool_versions(stage: str) -> dict[str, str]:
    out = {}
    for dist in STAGE_TOOLS[stage]:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["python"] = platform.python_version()
    return out
