"""doit tasks: every zoo/*.json entry becomes export, simplify, convert, validate, (quantize, fidelity), npu, bench
and card tasks, and build:<id>. A split entry (Whisper) gets the per-graph stages once per graph, named <id>.<graph>,
and a speech task that decodes whole utterances with the graphs.

Only the translation from entries to tasks lives here; the stages are in tools/stages. Each task depends on
its input files, on the entry sections it reads, on the versions of the tools it calls and on its own code.
A bad entry is reported once, by name, and gets no tasks; the others build.
"""
import os
import sys
from pathlib import Path

from doit.tools import config_changed

from tools.entry import discover
from tools.stages import STAGES
from tools.versions import STAGE_TOOLS, tool_versions

DOIT_CONFIG = {"default_tasks": ["build"], "verbosity": 2}
ZOO = Path(os.environ.get("ZOO_DIR", "zoo"))
BUILD = Path(os.environ.get("ZOO_BUILD", "build"))

ENTRIES, BAD_ENTRIES = discover(ZOO)
for _error in BAD_ENTRIES:
    print(f"error: skipping invalid entry {_error}", file=sys.stderr)


def _stage_task(stage, entry, graph):
    """One stage of an entry, or of one graph of a split entry (task name <id>.<graph>, folder build/<id>/<graph>)."""
    name = f"{entry.id}.{graph}" if graph else entry.id
    out = BUILD / entry.id / (graph or "")
    tools = tool_versions(stage.name) if stage.name in STAGE_TOOLS else {}
    return {
        "name": name,
        "doc": f"{stage.doc} [{name}]",
        "actions": [[sys.executable, "-m", "tools.stage", stage.name, str(entry.path), str(out), *([graph] if graph else [])]],
        # normalised: doit orders tasks by matching a file_dep to a target as strings, and a split graph's
        # needs name its siblings' files through '..'
        "file_dep": [os.path.normpath(out / f) for f in stage.needs_for(entry)] + stage.code_files(),
        "targets": [os.path.normpath(out / f) for f in stage.makes_for(entry)],
        "task_dep": [f"{after}:{name}" for after in stage.after],
        "uptodate": [config_changed({"sections": entry.fingerprint(*stage.sections), "tools": tools,
                                     "env": {k: os.environ.get(k, "") for k in stage.env}})],
        "clean": True,
    }


def _make_task_creator(stage):
    def creator():
        for entry in ENTRIES:
            if stage.applies_to(entry):
                targets = stage.targets(entry)
                for graph, view in targets:
                    yield _stage_task(stage, view, graph)
                if targets[0][0]:  # a split entry: <stage>:<id> runs the stage for each of its graphs
                    yield {"name": entry.id, "doc": f"{stage.doc} [{entry.id}: every graph]", "actions": None,
                           "task_dep": [f"{stage.name}:{entry.id}.{graph}" for graph, _ in targets]}
    creator.__doc__ = stage.doc
    return creator


for _stage in STAGES.values():
    globals()[f"task_{_stage.name}"] = _make_task_creator(_stage)


def task_build():
    """All stages of an entry: ONNX, simplified ONNX, fp32 TFLite, validation, INT8 variants and fidelity, NPU
    placement, host benchmarks, (transcripts), card"""
    for entry in ENTRIES:
        yield {"name": entry.id, "doc": f"build everything for {entry.id}", "actions": None,
               "task_dep": [f"card:{entry.id}"]}


def task_check():
    """Check every zoo entry against the schema and the cross-field rules"""
    def check():
        for error in BAD_ENTRIES:
            print(f"error: {error}", file=sys.stderr)
        print(f"{len(ENTRIES)} valid entries, {len(BAD_ENTRIES)} invalid")
        return not BAD_ENTRIES
    return {"actions": [check], "verbosity": 2, "uptodate": [False]}


def task_publish():
    """Copy a built, checked entry into dist/<id>/ and list it in dist/index.json (refuses random or stale builds)"""
    for entry in ENTRIES:
        yield {"name": entry.id, "doc": f"publish {entry.id} to dist/",
               "actions": [[sys.executable, "-m", "tools.publish", entry.id, "--build", str(BUILD), "--zoo", str(ZOO)]],
               "uptodate": [False], "verbosity": 2}


def task_board():
    """Build an entry, time its .tflite files on the board ZOO_TARGET names (ssh://user@host[:port] or adb://SERIAL)
    into board.json, and render its card again with the board's figures"""
    for entry in ENTRIES:
        out = BUILD / entry.id
        yield {"name": entry.id, "doc": f"time {entry.id}'s graphs on the board (VX delegate and CPU) into board.json",
               "actions": [[sys.executable, "-m", "tools.board", "--build", str(out), "-o", str(out / "board.json")],
                           [sys.executable, "-m", "tools.stage", "card", str(entry.path), str(out)]],
               "task_dep": [f"card:{entry.id}"], "uptodate": [False], "verbosity": 2}


def task_fetch():
    """Download a published entry's default variant from dist/index.json into models/<id>/, verified"""
    for entry in ENTRIES:
        yield {"name": entry.id, "doc": f"fetch the prebuilt {entry.id} into models/",
               "actions": [[sys.executable, "tools/fetch.py", entry.id, "-o", "models"]],
               "uptodate": [False], "verbosity": 2}
