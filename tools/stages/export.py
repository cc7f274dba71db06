"""export: build the torch module, load its weights, apply the export patches, write ONNX and the torch reference.

The torch outputs on the real validation inputs are saved beside the graph (reference.npz), so that the
later stages compare against torch without importing it again.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import torch

from tools.atomic import atomic_path
from tools.entry import Entry, EntryError, decoding_kind
from tools.inputs import validation_samples
from tools.patches import REGISTRY, apply_patches
from tools.sources import build_module, forward_arguments
from tools.weights import load_into, sha256_of


EXPORTER = "torch.onnx.export (TorchScript, dynamo=False)"


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
    if entry.graphs:
        return _export_split(entry, build_dir, module, weights)
    patch_names = entry.data["export"].get("patches", [])
    try:
        patched = apply_patches(module, patch_names)
    except ValueError as exc:
        raise EntryError(entry.path, "$.export.patches", str(exc)) from None
    output_names = entry.data["outputs"]
    graph = GraphInterface(patched, entry).eval()

    samples = validation_samples(entry)
    reference, forward_s = {}, []
    with torch.no_grad():
        for i, sample in enumerate(samples):
            start = time.perf_counter()
            outs = graph(*[torch.from_numpy(sample[n]) for n in input_names])
            forward_s.append(time.perf_counter() - start)
            for name in input_names:
                reference[f"{i}/input/{name}"] = sample[name]
            for name, value in zip(output_names, outs):
                reference[f"{i}/output/{name}"] = value.numpy().astype(np.float32)
        model = write_onnx(graph, tuple(torch.from_numpy(samples[0][n]) for n in input_names), input_names,
                            output_names, entry, build_dir)
    _write_reference(reference, build_dir)
    validation = entry.data["validation"]
    record = {
        "weights": weights,
        "patches": [{"name": n, "summary": REGISTRY[n].summary, "graph": REGISTRY[n].graph} for n in patch_names],
        "opset": entry.data["export"]["opset"],
        "exporter": EXPORTER,
        "inputs": {spec["name"]: spec["shape"] for spec in entry.data["inputs"]},
        "outputs": {n: list(reference[f"0/output/{n}"].shape) for n in output_names},
        "samples": validation.get("samples") or validation["sentences"],
        "onnx_nodes": len(model.graph.node),
        "parameters": int(sum(p.numel() for p in module.parameters())),
    }
    if decoding_kind(entry.data) == "ctc_greedy":
        record.update(_ctc_record(entry, build_dir, weights, [reference[f"{i}/output/{output_names[0]}"][0]
                                                              for i in range(len(samples))], forward_s))
    return record


def _ctc_record(entry: Entry, build_dir: Path, weights: dict, logits: list, forward_s: list) -> dict:
    """Torch's CTC transcripts (ids) and timings; the labels, read from the trained archive, into labels.json."""
    from tools.atomic import write_json
    from tools.ctc_runtime import greedy_ids
    from tools.nemo import NemoFormatError, ctc_labels

    blank = entry.data["decoding"]["blank"]
    labels_file = build_dir / "labels.json"
    labels = None
    if weights["kind"] == "trained":
        try:
            labels = ctc_labels(Path(weights["path"]))
        except NemoFormatError as exc:
            raise EntryError(entry.path, "$.decoding.vocabulary", str(exc)) from None
        if len(labels) + 1 != logits[0].shape[-1] or blank != len(labels):
            raise EntryError(entry.path, "$.decoding.blank", f"the archive has {len(labels)} labels and the head "
                             f"{logits[0].shape[-1]} outputs: the blank is id {len(labels)}, not {blank}")
        write_json(labels_file, labels)
    elif labels_file.exists():
        labels_file.unlink()  # a trained build's labels: not these random weights'
    return {"decoding": {"kind": "ctc_greedy", "blank": blank, "labels": len(labels) if labels else None},
            "torch": {"decoded": [greedy_ids(x, blank) for x in logits], "timings": {"forward_s": forward_s}}}


def write_onnx(graph, example: tuple, input_names: list, output_names: list, entry: Entry, build_dir: Path):
    with atomic_path(build_dir / "model.onnx") as tmp:
        torch.onnx.export(graph, example, str(tmp), opset_version=entry.data["export"]["opset"],
                          input_names=input_names, output_names=output_names, dynamo=False, do_constant_folding=True)
        model = onnx.load(str(tmp))
        onnx.checker.check_model(model)
    return model


def _write_reference(reference: dict, build_dir: Path) -> None:
    with atomic_path(build_dir / "reference.npz") as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, **reference)


def _export_split(entry: Entry, build_dir: Path, module, weights: dict) -> dict:
    """Every graph of a split entry into build/<id>/<graph>/, with inputs taken from a torch run of the whole
    model on the validation data (later graphs are fed what the earlier ones computed)."""
    from tools.atomic import write_json
    from tools.splits import REGISTRY as SPLITS

    from dataclasses import asdict

    from tools.weights import tokenizer_file
    from tools.whisper_runtime import settings_of

    split = SPLITS[entry.data["split"]["name"]]
    tokenizer = tokenizer_file(entry)
    family = split.load()
    modules = family.graphs(module)
    feeds, decoded, timings = family.reference_run(modules, validation_samples(entry), entry)
    graphs = {}
    for name in split.graphs:
        input_names, output_names = family.GRAPH_IO[name]
        folder = build_dir / name
        folder.mkdir(exist_ok=True)
        reference = {}
        with torch.no_grad():
            for i, (_, inputs) in enumerate(feeds[name]):
                outs = modules[name](*[torch.from_numpy(inputs[n]) for n in input_names])
                outs = outs if isinstance(outs, tuple) else (outs,)
                reference.update({f"{i}/input/{n}": inputs[n] for n in input_names})
                reference.update({f"{i}/output/{n}": v.numpy().astype(np.float32) for n, v in zip(output_names, outs)})
            example = tuple(torch.from_numpy(feeds[name][0][1][n]) for n in input_names)
            model = write_onnx(modules[name], example, input_names, output_names, entry, folder)
        _write_reference(reference, folder)
        graphs[name] = {
            "opset": entry.data["export"]["opset"], "exporter": EXPORTER, "patches": [],
            "inputs": {n: list(reference[f"0/input/{n}"].shape) for n in input_names},
            "input_dtypes": {n: str(reference[f"0/input/{n}"].dtype) for n in input_names},
            "outputs": {n: list(reference[f"0/output/{n}"].shape) for n in output_names},
            "samples": [label for label, _ in feeds[name]],
            "onnx_nodes": len(model.graph.node),
            "parameters": int(sum(p.numel() for p in modules[name].parameters())),
        }
        write_json(folder / "export.json", {"stage": "export", "entry": entry.id, "graph": name, **graphs[name]})
    if tokenizer is not None:
        with atomic_path(build_dir / "tokenizer.json") as tmp:
            tmp.write_bytes(tokenizer.read_bytes())
    return {
        "weights": weights,
        "split": {"name": split.name, "summary": split.summary, **entry.data["split"]},
        "graphs": graphs,
        "samples": entry.data["validation"]["sentences"],
        "decoding": asdict(settings_of(entry)),
        "tokenizer": {"declared": entry.data["decoding"]["tokenizer"], "sha256_loaded": tokenizer and sha256_of(tokenizer)},
        "torch": {"decoded": decoded, "timings": timings},
        "parameters": int(sum(p.numel() for p in module.parameters())),
    }
