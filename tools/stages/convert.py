"""convert: onnx2tf turns the simplified ONNX graph into an fp32 .tflite with NHWC inputs.

onnx2tf fetches a sample-image file from the web for models with 3-channel 4-D inputs, even for fp32;
that file is made here from real photographs instead, in the folder onnx2tf runs in. onnxsim already ran
as its own stage, so onnx2tf is told not to run it again. A graph with any non-builtin op (Select TF / Flex,
custom) is rejected: neither LiteRT nor the board's runtime can run it. The graph then gets the rewrites of
tools.tflite_rewrites (ops proven to compute nothing are removed; the record says how many each made).
onnx2tf's full log goes to convert.log; a failure quotes its error lines.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

from tools.atomic import atomic_path
from tools.entry import Entry
from tools.tflite_graph import read_graph
from tools.tflite_rewrites import rewrite_file

ONNX2TF_SAMPLE_FILE = "calibration_image_sample_data_20x128x128x3_float32.npy"
DEFAULT_FLAGS = {"not_use_onnxsim": True, "copy_onnx_input_output_names_to_tflite": True}


def write_sample_images(folder: Path) -> Path:
    """20 RGB crops of 128x128 from scikit-image's photographs, float32 in [0, 1], as onnx2tf expects."""
    import skimage.data
    from PIL import Image

    photos = [skimage.data.astronaut(), skimage.data.coffee(), skimage.data.chelsea(), skimage.data.rocket()]
    crops = []
    for i in range(20):
        photo = photos[i % len(photos)]
        size = min(photo.shape[:2]) // (1 + i // len(photos))
        crops.append(np.asarray(Image.fromarray(photo[:size, :size]).resize((128, 128)), dtype=np.float32) / 255)
    path = folder / ONNX2TF_SAMPLE_FILE
    np.save(path, np.stack(crops).astype(np.float32))
    return path


@contextlib.contextmanager
def _in_folder_logged_to(path: Path, log: Path):
    """cd into `path` and send everything written to stdout and stderr (Python's and native code's) to `log`."""
    old = os.getcwd()
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as handle:
        os.dup2(handle.fileno(), 1), os.dup2(handle.fileno(), 2)
        os.chdir(path)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
            os.chdir(old)


def _log_errors(log: Path, count: int = 3) -> str:
    """The last lines of onnx2tf's log that report an error, for the one-line failure message."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
             if re.search(r"ERROR|Error|error:", ln) and "computation_placer" not in ln]
    return " | ".join(lines[-count:]) or "no error line in the log"


def convert(entry: Entry, build_dir: Path) -> dict:
    import onnx2tf

    from tools.stages import StageError

    flags = {**DEFAULT_FLAGS, **entry.data["export"].get("converter", {}).get("onnx2tf", {})}
    if "replace_to_pseudo_operators" in flags:  # onnx2tf's CLI lower-cases these names; its Python API silently does not
        flags["replace_to_pseudo_operators"] = [name.lower() for name in flags["replace_to_pseudo_operators"]]
    source = (build_dir / "model_sim.onnx").resolve()
    with tempfile.TemporaryDirectory(dir=build_dir, prefix=".onnx2tf-") as work:
        work = Path(work).resolve()  # onnx2tf runs inside it: a relative path would point elsewhere there
        write_sample_images(work)
        log = build_dir / "convert.log"
        with _in_folder_logged_to(work, log):
            try:
                onnx2tf.convert(input_onnx_file_path=str(source), output_folder_path=str(work / "out"), **flags)
            except SystemExit as exc:  # onnx2tf ends with sys.exit(1) on a failed op conversion
                raise StageError(f"entry {entry.id!r}: onnx2tf gave up (exit {exc.code}): {_log_errors(log)}; "
                                 f"full log: {log}") from None
        produced = work / "out" / f"{source.stem}_float32.tflite"
        if not produced.exists():
            raise StageError(f"entry {entry.id!r}: onnx2tf wrote no {produced.name}: {_log_errors(log)}; full log: {log}")
        graph = read_graph(produced)
        custom = sorted({op.name for op in graph.ops if not op.builtin})
        if custom:
            raise StageError(f"entry {entry.id!r}: the .tflite holds non-builtin ops {custom} (Select TF / custom): "
                             "LiteRT and the board cannot run them; add an export patch or an onnx2tf replacement")
        with atomic_path(build_dir / "model_fp32.tflite") as tmp:
            rewrites = rewrite_file(produced, tmp)
            ops = read_graph(tmp).op_histogram()
    return {"converter": "onnx2tf", "flags": flags, "tflite_rewrites": rewrites, "ops": dict(sorted(ops.items())),
            "op_count": sum(ops.values())}
