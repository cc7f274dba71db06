"""export: build the torch module, load its weights, apply the export patches, write ONNX and the torch reference.

The torch outputs on the real validation inputs are saved beside the graph (reference.npz), so that the
later stages compare against torch without importing it again.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from tools.atomic import atomic_path
from tools.entry import Entry, EntryError
from tools.inputs import validation_samples
from tools.patches import REGISTRY, apply_patches
from tools.sources import build_module, forward_arguments
from tools.weights import load_into


class GraphInterface(torch.nn.Module):
    """The exported callable: positional tensors in the entry's input order -> the entry's outputs in order."""

    def __init__(self, module, entry: Entry):
        super().__init__()
        self.inner = module
        self.entry = entry
        self.input_names = [spec["name"] for spec in entry.data["inputs"]]
        self.output_names = entry.data["outputs"]

    def forward(self, *tensors):
        out = self.inner(**dict(zip(self.input_names, tensors)))
        if isinstance(out, torch.Tensor):  # timm models return their one output as a plain tensor
            if len(self.output_names) != 1:
                raise EntryError(self.entry.path, "$.outputs",
                                 f"the model returns one tensor; declare one output name, not {self.output_names}")
            out = {self.output_names[0]: out}
        missing = [n for n in self.output_names if n not in out or out[n] is None]
        if missing:
            available = [k for k in out.keys() if out[k] is not None]
            raise EntryError(self.entry.path, "$.outputs", f"the model gives no output {missing}; it gives {available}")
        return tuple(out[n] for n in self.output_names)


def export(entry: Entry, build_dir: Path) -> dict:

    module = build_module(entry)
    accepted = forward_arguments(module)
    input_names = [spec["name"] for spec in entry.data["inputs"]]
    for i, name in enumerate(input_names):
        if name not in accepted:
            raise EntryError(entry.path, f"$.inputs[{i}].name",
                             f"{type(module).__name__}.forward takes no argument {name!r}; it takes {accepted}")
    weights = load_into(entry, module)
    patch_names = entry.data["export"].get("patches", [])
    try:
        patched = apply_patches(module, patch_names)
    except ValueError as exc:
        raise EntryError(entry.path, "$.export.patches", str(exc)) from None
    output_names = entry.data["outputs"]
    graph = GraphInterface(patched, entry).eval()

    samples = validation_samples(entry)
    reference = {}
    with torch.no_grad():
        for i, sample in enumerate(samples):
            outs = graph(*[torch.from_numpy(sample[n]) for n in input_names])
            for name in input_names:
                reference[f"{i}/input/{name}"] = sample[name]
            for name, value in zip(output_names, outs):
                reference[f"{i}/output/{name}"] = value.numpy().astype(np.float32)
        example = tuple(torch.from_numpy(samples[0][n]) for n in input_names)
        onnx_path = build_dir / "model.onnx"
        with atomic_path(onnx_path) as tmp:
            torch.onnx.export(graph, example, str(tmp), opset_version=entry.data["export"]["opset"],
                              input_names=input_names, output_names=output_names, dynamo=False,
                              do_constant_folding=True)
            model = onnx.load(str(tmp))
            onnx.checker.check_model(model)
    with atomic_path(build_dir / "reference.npz") as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, **reference)
    return {
        "weights": weights,
        "patches": [{"name": n, "summary": REGISTRY[n].summary, "graph": REGISTRY[n].graph} for n in patch_names],
        "opset": entry.data["export"]["opset"],
        "exporter": "torch.onnx.export (TorchScript, dynamo=False)",
        "inputs": {spec["name"]: spec["shape"] for spec in entry.data["inputs"]},
        "outputs": {n: list(reference[f"0/output/{n}"].shape) for n in output_names},
        "samples": entry.data["validation"]["samples"],
        "onnx_nodes": len(model.graph.node),
        "parameters": int(sum(p.numel() for p in module.parameters())),
    }
