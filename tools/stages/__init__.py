"""The build stages, one module each: a function from input files plus the entry sections it reads to output files.

STAGES says, for each stage, which entry sections and files it reads and which files it writes; dodo.py turns
that table into doit tasks, and tools.stage runs one stage in its own process.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class Stage:
    name: str
    doc: str
    sections: tuple[str, ...]  # entry sections (dotted: one level down) whose change reruns the stage
    needs: tuple[str, ...]     # files in the build folder it reads
    makes: tuple[str, ...]     # files in the build folder it writes, its record last
    env: tuple[str, ...] = ()  # environment variables whose value is part of its up-to-date check
    code: tuple[str, ...] = ()  # modules besides tools/stages/<name>.py whose change reruns it (globs, from the root)

    def code_files(self) -> list[str]:
        """The stage's own module and the modules it calls, as paths relative to the repository root."""
        from tools.entry import ROOT

        files = {f"tools/stages/{self.name}.py"}
        for pattern in self.code:
            files.update(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
        return sorted(files)

    def run(self, entry, build_dir):
        return getattr(import_module(f"tools.stages.{self.name}"), self.name)(entry, build_dir)


ALL_SECTIONS = ("id", "title", "task", "notes", "source", "weights", "inputs", "outputs", "validation", "export",
                "quantization", "tolerances", "bench", "license")

STAGES = {s.name: s for s in [
    Stage("export", "torch -> ONNX (pinned opset, static shapes) and the torch reference outputs",
          ("source", "weights", "inputs", "outputs", "validation", "export.opset", "export.patches"),
          (), ("model.onnx", "reference.npz", "export.json"), env=("ZOO_WEIGHTS",),
          code=("tools/sources.py", "tools/weights.py", "tools/keymaps.py", "tools/inputs.py", "tools/patches/*.py")),
    Stage("simplify", "onnxsim, with its own check", (),
          ("model.onnx",), ("model_sim.onnx", "simplify.json")),
    Stage("convert", "onnx2tf -> fp32 .tflite with NHWC inputs, builtin ops only", ("export.converter",),
          ("model_sim.onnx",), ("model_fp32.tflite", "convert.json")),
    Stage("validate", "every graph against torch on real inputs, within the entry's tolerances", ("tolerances",),
          ("reference.npz", "model.onnx", "model_sim.onnx", "model_fp32.tflite", "export.json", "simplify.json",
           "convert.json"), ("validation.json",)),
    Stage("card", "card.json (schema-checked) and card.md from the stage records", ALL_SECTIONS,
          ("export.json", "simplify.json", "convert.json", "validation.json", "model.onnx", "model_sim.onnx",
           "model_fp32.tflite"), ("card.md", "card.json"), code=("tools/provenance.py",)),
]}
