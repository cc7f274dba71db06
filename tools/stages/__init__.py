"""The build stages, one module each: a function from input files plus the entry sections it reads to output files.

STAGES says, for each stage, which entry sections and files it reads and which files it writes; dodo.py turns
that table into doit tasks, and tools.stage runs one stage in its own process.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


class StageError(RuntimeError):
    """A stage's check failed: the message names the entry, what failed and by how much (one line, no traceback)."""


@dataclass(frozen=True)
class Stage:
    name: str
    doc: str
    sections: tuple[str, ...]  # entry sections (dotted: one level down) whose change reruns the stage
    needs: tuple[str, ...]     # files in the build folder it reads
    makes: tuple[str, ...]     # files in the build folder it writes, its record last
    env: tuple[str, ...] = ()  # environment variables whose value is part of its up-to-date check
    code: tuple[str, ...] = ()  # modules besides tools/stages/<name>.py whose change reruns it (globs, from the root)
    int8_only: bool = False     # runs only for entries with quantization enabled
    needs_int8: tuple[str, ...] = ()  # files it also reads when the entry has INT8 variants
    after: tuple[str, ...] = ()  # stages that must have succeeded first, though it reads none of their files
    per_graph: bool = False      # runs once per graph of a split entry, in build/<id>/<graph>/
    split_needs: tuple[str, ...] = ()  # per graph of a split: files of the whole entry's folder it also reads
    speech_only: bool = False    # runs only for speech entries (those that declare $.decoding)
    single_only: bool = False    # runs only for single-graph entries (a split's graphs have the split's shapes)

    def applies_to(self, entry) -> bool:
        if self.speech_only and "decoding" not in entry.data:
            return False
        if self.single_only and entry.graphs:
            return False
        return not self.int8_only or int8_enabled(entry)

    def targets(self, entry) -> list:
        """(graph or None, entry view) pairs this stage runs for: each graph of a split entry, or the entry."""
        if self.per_graph and entry.graphs:
            return [(g, view) for g in entry.graphs if self.applies_to(view := entry.for_graph(g))]
        return [(None, entry)]

    def needs_for(self, entry) -> list[str]:
        files = _expand(self.needs, entry)
        if entry.graph and self.split_needs:  # '{graph}/' here: each graph that runs before this one
            earlier = entry.graphs[:entry.graphs.index(entry.graph)]
            for name in self.split_needs:
                base = name.removeprefix("{graph}/")
                files += [f"../{g}/{base}" for g in earlier] if name.startswith("{graph}/") else [f"../{name}"]
        if entry.graphs and entry.graph is None:  # a graph's INT8 files only where that graph has INT8 variants
            for graph in entry.graphs:
                view = entry.for_graph(graph)
                if int8_enabled(view):
                    files += [f"{graph}/{f}" for f in _expand(tuple(n.removeprefix("{graph}/") for n in self.needs_int8), view)]
            return files
        return files + (_expand(self.needs_int8, entry) if int8_enabled(entry) else [])

    def makes_for(self, entry) -> list[str]:
        """Its output files for this entry, its record last; 'model_{variant}.tflite' names one file per INT8 variant."""
        return _expand(self.makes, entry)

    def code_files(self) -> list[str]:
        """The stage's own module and the modules it calls, as paths relative to the repository root."""
        from tools.entry import ROOT

        files = {f"tools/stages/{self.name}.py"}
        for pattern in self.code:
            files.update(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
        return sorted(files)

    def run(self, entry, build_dir):
        return getattr(import_module(f"tools.stages.{self.name}"), self.name)(entry, build_dir)


def int8_variants(entry) -> list[dict]:
    """The declared INT8 variants that apply here: all of a single-graph entry's; of a split entry's graph, those
    whose `graphs` name it; for a whole split entry, all (each quantizes some of its graphs)."""
    quant = entry.data["quantization"]
    if not quant["enabled"]:
        return []
    variants = quant["variants"]
    return [v for v in variants if entry.graph in v.get("graphs", ())] if entry.graph else variants


def int8_enabled(entry) -> bool:
    return bool(int8_variants(entry))


def variant_files(entry) -> list[str]:
    return [f"model_{v['name']}.tflite" for v in int8_variants(entry)]


def _expand(names: tuple[str, ...], entry) -> list[str]:
    """File names for this entry: 'model_{variant}.tflite' is one per INT8 variant; '{graph}/' is each graph's
    folder of a split entry (nothing for a single-graph entry); '{split}' marks a file only split entries have,
    '{speech}' one only speech entries have, '{single}' one only single-graph entries have.
    Duplicates are dropped, order kept."""
    out = []
    for name in names:
        if name.startswith("{split}"):  # a file only split entries have
            if not entry.graphs:
                continue
            name = name.removeprefix("{split}")
        if name.startswith("{single}"):  # a file only single-graph entries have
            if entry.graphs:
                continue
            name = name.removeprefix("{single}")
        if name.startswith("{speech}"):  # a file only speech entries have
            if "decoding" not in entry.data:
                continue
            name = name.removeprefix("{speech}")
        if name.startswith("{graph}/"):
            base = name.removeprefix("{graph}/")
            if entry.graphs and entry.graph is None:
                out += [f"{g}/{f}" for g in entry.graphs for f in _expand((base,), entry.for_graph(g))]
                continue
            name = base
        for file in variant_files(entry) if name == "model_{variant}.tflite" else [name]:
            if file not in out:
                out.append(file)
    return out


ALL_SECTIONS = ("id", "title", "task", "notes", "source", "weights", "inputs", "outputs", "validation", "export",
                "split", "decoding", "quantization", "tolerances", "bench", "license")

STAGES = {s.name: s for s in [
    Stage("export", "torch -> ONNX (pinned opset, static shapes) and the torch reference outputs (every graph of a split)",
          ("source", "weights", "inputs", "outputs", "validation", "export.opset", "export.patches", "split", "decoding"),
          (), ("{graph}/model.onnx", "{graph}/reference.npz", "{graph}/export.json", "{split}tokenizer.json", "export.json"),
          env=("ZOO_WEIGHTS",),
          code=("tools/sources.py", "tools/weights.py", "tools/keymaps.py", "tools/inputs.py", "tools/speech.py",
                "tools/logmel.py", "tools/patches/*.py", "tools/splits/*.py", "tools/families/*.py", "tools/nemo.py",
                "tools/whisper_runtime.py", "tools/ctc_runtime.py")),
    Stage("simplify", "onnxsim, with its own check, then the entry's ONNX-graph patches", ("export.patches",),
          ("model.onnx",), ("model_sim.onnx", "simplify.json"), code=("tools/patches/*.py",), per_graph=True),
    Stage("convert", "onnx2tf -> fp32 .tflite with NHWC inputs, builtin ops only", ("export.converter",),
          ("model_sim.onnx",), ("model_fp32.tflite", "convert.json"), code=("tools/tflite_graph.py", "tools/tflite_rewrites.py"),
          per_graph=True),
    Stage("validate", "every graph against torch on real inputs, within the entry's tolerances", ("tolerances",),
          ("reference.npz", "model.onnx", "model_sim.onnx", "model_fp32.tflite", "export.json", "simplify.json",
           "convert.json"), ("validation.json",), per_graph=True),
    Stage("quantize", "INT8 variants of the fp32 .tflite, calibrated on real data kept apart from validation",
          ("inputs", "validation", "quantization.variants", "quantization.keep_float", "quantization.calibration"),
          ("model_fp32.tflite",), ("model_{variant}.tflite", "quantize.json"), int8_only=True, after=("validate",),
          code=("tools/calibration.py", "tools/inputs.py", "tools/npu.py", "tools/tflite_graph.py", "tools/whisper_runtime.py"),
          per_graph=True, split_needs=("export.json", "{graph}/model_fp32.tflite")),
    Stage("fidelity", "INT8 vs fp32 TFLite on the validation inputs: SQNR, cosine, task agreement, worst layers",
          ("outputs", "validation", "quantization.variants", "quantization.fidelity"),
          ("reference.npz", "export.json", "model_fp32.tflite", "model_{variant}.tflite", "quantize.json"), ("fidelity.json",),
          int8_only=True, code=("tools/metrics.py", "tools/stages/validate.py"), per_graph=True),
    Stage("npu", "VX-delegate placement of every .tflite: ops and MACs on the NPU, partitions, every fallback and why",
          (), ("model_fp32.tflite", "model_{variant}.tflite"), ("npu.json",),
          code=("tools/npu.py", "tools/data/vx_delegate_rules.json", "tools/tflite_graph.py", "tools/estimate.py",
                "tools/data/imx8mp_cost_model.json"), per_graph=True),
    Stage("speech", "whole-utterance transcripts from the ONNX and fp32 TFLite graphs against torch's: equal ids, word "
          "error rates, real-time factors; INT8 variants against fp32", ("validation", "decoding", "split", "quantization"),
          ("export.json", "{graph}/model.onnx", "{graph}/model_fp32.tflite", "{graph}/validation.json"), ("speech.json",),
          speech_only=True, needs_int8=("{graph}/model_{variant}.tflite",),
          code=("tools/whisper_runtime.py", "tools/ctc_runtime.py", "tools/inputs.py", "tools/speech.py", "tools/logmel.py", "tools/stages/validate.py")),
    Stage("bench", "host latency of torch, ONNX Runtime, TFLite fp32 and each INT8 variant, and torch and ONNX Runtime "
          "over the declared input sizes (bench.png)",
          ("source", "weights", "inputs", "validation", "export.opset", "export.patches", "bench"),
          ("reference.npz", "model.onnx", "model_sim.onnx", "model_fp32.tflite"), ("bench.png", "bench.json"),
          env=("ZOO_WEIGHTS", "ZOO_TARGET"), needs_int8=("model_{variant}.tflite",), single_only=True, after=("validate",),
          code=("tools/board.py", "tools/board_runner.py", "tools/sources.py", "tools/weights.py", "tools/keymaps.py", "tools/inputs.py", "tools/patches/*.py",
                "tools/families/*.py", "tools/stages/export.py", "tools/stages/validate.py")),
    Stage("card", "card.json (schema-checked) and card.md from the stage records", ALL_SECTIONS,
          ("export.json", "{graph}/export.json", "{graph}/simplify.json", "{graph}/convert.json",
           "{graph}/validation.json", "{graph}/model.onnx", "{graph}/model_sim.onnx", "{graph}/model_fp32.tflite",
           "{graph}/npu.json", "{speech}speech.json", "{single}bench.json", "{single}bench.png"), ("card.md", "card.json"), code=("tools/provenance.py",),
          needs_int8=("{graph}/quantize.json", "{graph}/fidelity.json", "{graph}/model_{variant}.tflite")),
]}
