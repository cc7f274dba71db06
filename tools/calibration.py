"""Calibration data for INT8: real inputs, preprocessed exactly as the entry's inputs declare, hashed, and
kept apart from the validation data (a calibration sample that is also a validation sample flatters the
fidelity figures, so the build refuses it).
"""
from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.entry import ROOT, Entry, EntryError
from tools.inputs import preprocess_image, read_image, validation_samples

SECTION = "$.quantization.calibration"
# Photographs scikit-image ships that no entry validates on: the scaffold's default calibration set.
CALIBRATION_PHOTOS = ("skimage:rocket", "skimage:stereo_motorcycle", "skimage:camera", "skimage:clock",
                      "skimage:coins", "skimage:immunohistochemistry")


@dataclass(frozen=True)
class CalibrationSet:
    samples: list      # one dict of named inputs (torch layout, float32) per sample
    sources: list      # {"ref", "sha256"} of each distinct source (an image file, a photo, an array row)
    sha256: str        # content hash of every preprocessed sample, in order

    def record(self) -> dict:
        return {"count": len(self.samples), "sha256": self.sha256, "sources": self.sources}


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _sample_digest(sample: dict) -> str:
    return _digest(*(sample[name] for name in sorted(sample)))


def _crop(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A seeded random crop (half to all of each side) and horizontal flip: more samples from few photos."""
    height, width = image.shape[:2]
    h, w = int(height * rng.uniform(0.5, 1.0)), int(width * rng.uniform(0.5, 1.0))
    top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
    crop = image[top:top + h, left:left + w]
    return np.ascontiguousarray(crop[:, ::-1] if rng.random() < 0.5 else crop)


def _image_refs(entry: Entry, spec: dict, rng: np.random.Generator) -> list[str]:
    if spec["kind"] == "photos":
        return list(spec["samples"])
    pattern = spec["glob"] if Path(spec["glob"]).is_absolute() else str(ROOT / spec["glob"])
    files = sorted(glob.glob(pattern))
    if not files:
        raise EntryError(entry.path, f"{SECTION}.glob", f"no file matches {pattern}")
    if len(files) > spec["count"]:
        files = sorted(rng.choice(files, spec["count"], replace=False).tolist())
    return [f"file:{f}" for f in files]


def _image_set(entry: Entry, spec: dict) -> tuple[list, list]:
    rng = np.random.default_rng(spec["seed"])
    refs = _image_refs(entry, spec, rng)
    images = [read_image(entry, ref, SECTION) for ref in refs]
    samples = []
    for i in range(spec["count"]):
        image = images[i % len(images)]
        if i >= len(images):
            image = _crop(image, rng)
        samples.append({s["name"]: preprocess_image(image, s) for s in entry.data["inputs"]})
    return samples, [{"ref": ref, "sha256": _digest(image)} for ref, image in zip(refs, images)]


def _npy_set(entry: Entry, spec: dict) -> tuple[list, list]:
    path = Path(spec["path"]) if Path(spec["path"]).is_absolute() else ROOT / spec["path"]
    input_spec = entry.data["inputs"][0]
    try:
        rows = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise EntryError(entry.path, f"{SECTION}.path", f"cannot read {path} as a .npy array: {exc}") from None
    if rows.ndim != len(input_spec["shape"]) or tuple(rows.shape[1:]) != tuple(input_spec["shape"][1:]):
        raise EntryError(entry.path, f"{SECTION}.path", f"{path} holds shape {rows.shape}; expected (N, "
                         f"{', '.join(map(str, input_spec['shape'][1:]))}) for input {input_spec['name']!r}")
    rng = np.random.default_rng(spec["seed"])
    order = rng.permutation(len(rows))[:spec["count"]] if len(rows) > spec["count"] else np.arange(len(rows))
    samples = [{input_spec["name"]: rows[i:i + 1].astype(np.float32)} for i in order]
    return samples, [{"ref": f"{path.name}[{int(i)}]", "sha256": _sample_digest(s)} for i, s in zip(order, samples)]


def _speech_set(entry: Entry, spec: dict, build_dir: Path | None) -> tuple[list, list]:
    """Spoken calibration sentences as the graph's inputs: log-mel features for the first graph of a split; for
    a later one, what the earlier fp32 graphs in build_dir's parent compute from them."""
    from tools.inputs import speech_features, spoken
    from tools.whisper_runtime import calibration_feeds

    sentences = spec["sentences"][:spec["count"]]
    audio = spoken(entry, sentences)
    features = [speech_features(entry, a) for a in audio]
    sources = [{"ref": f"espeak:{text}", "sha256": _digest(a.astype(np.float32))} for text, a in zip(sentences, audio)]
    if entry.graph and entry.graph != entry.graphs[0]:
        features = calibration_feeds(entry.graph, build_dir.parent, [f["input_features"] for f in features],
                                     spec["count"] * 8, np.random.default_rng(spec["seed"]))
    return features, sources


def calibration_set(entry: Entry, build_dir: Path | None = None) -> CalibrationSet:
    """The entry's calibration samples, as declared in quantization.calibration (for one graph of a split
    entry, that graph's inputs: `build_dir` is its folder)."""
    spec = entry.data["quantization"]["calibration"]
    if spec["kind"] == "speech":
        samples, sources = _speech_set(entry, spec, build_dir)
    else:
        samples, sources = _npy_set(entry, spec) if spec["kind"] == "npy" else _image_set(entry, spec)
    return CalibrationSet(samples, sources, _digest(*(s[name] for s in samples for name in sorted(s))))


def overlap_with_validation(entry: Entry, calibration: CalibrationSet) -> list[str]:
    """Calibration sources that are also validation data: the same photo (by content, whatever its name),
    or the same preprocessed input; for speech, the same sentence (by its words) or the same audio."""
    if "sentences" in entry.data["validation"]:
        from tools.inputs import spoken
        from tools.whisper_runtime import normalise

        validation = entry.data["validation"]["sentences"]
        by_words = {tuple(normalise(text)): text for text in validation}
        by_audio = {_digest(a.astype(np.float32)): text for text, a in zip(validation, spoken(entry, validation))}
        shared = set()
        for src in calibration.sources:
            same = by_words.get(tuple(normalise(src["ref"].removeprefix("espeak:")))) or by_audio.get(src["sha256"])
            if same:
                shared.add(f"{src['ref']} (= validation sentence {same!r})")
        return sorted(shared)
    validation_refs = entry.data["validation"]["samples"]
    seen = {_digest(read_image(entry, ref)): ref for ref in validation_refs}
    seen.update({_sample_digest(s): ref for ref, s in zip(validation_refs, validation_samples(entry))})
    shared = [f"{src['ref']} (= validation sample {seen[src['sha256']]})" for src in calibration.sources if src["sha256"] in seen]
    shared += [f"calibration sample {i} (= validation sample {seen[d]})" for i, s in enumerate(calibration.samples)
               if (d := _sample_digest(s)) in seen]
    return sorted(set(shared))
