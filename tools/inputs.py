"""Real inputs for validation: photographs or espeak-ng speech, preprocessed exactly as the entry's `inputs` declare."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.entry import ROOT, Entry, EntryError


def read_image(entry: Entry, ref: str, json_path: str = "$.validation.samples") -> np.ndarray:
    """An HxWx3 uint8 RGB photograph from 'skimage:<name>' or 'file:<path>'."""
    from PIL import Image

    kind, _, name = ref.partition(":")
    if kind == "skimage":
        import skimage.data

        loader = getattr(skimage.data, name, None)
        if loader is None or not callable(loader):
            raise EntryError(entry.path, json_path, f"scikit-image ships no image {name!r}")
        image = loader()
        image = np.asarray(image[0] if isinstance(image, tuple) else image)  # stereo pairs: the left view
    else:
        path = Path(name) if Path(name).is_absolute() else ROOT / name
        try:
            image = np.asarray(Image.open(path).convert("RGB"))
        except OSError as exc:
            raise EntryError(entry.path, json_path, f"cannot read image {path}: {exc}") from None
    if image.dtype == bool:
        image = image.astype(np.uint8) * 255
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=2)
    return np.ascontiguousarray(image[..., :3])


def preprocess_image(image: np.ndarray, spec: dict) -> np.ndarray:
    """uint8 HxWx3 -> float32 1x3xHxW for the declared input shape, resize, scale, mean and std."""
    from PIL import Image

    _, channels, height, width = spec["shape"]
    pre = spec["preprocess"]
    method = {"bilinear": Image.BILINEAR, "nearest": Image.NEAREST}[pre.get("resize", "bilinear")]
    resized = np.asarray(Image.fromarray(image).resize((width, height), method), dtype=np.float32)
    x = resized / np.float32(pre.get("scale", 1.0))
    if "mean" in pre:
        x = x - np.asarray(pre["mean"], dtype=np.float32)
    if "std" in pre:
        x = x / np.asarray(pre["std"], dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None, :channels]).astype(np.float32)


def spoken(entry: Entry, sentences: list[str]) -> list[np.ndarray]:
    """16 kHz float audio of each sentence, spoken by espeak-ng with the entry's validation voice and rate."""
    import tempfile

    from tools.speech import speak

    validation = entry.data["validation"]
    with tempfile.TemporaryDirectory() as tmp:
        return [speak(text, Path(tmp) / f"{i}.wav", validation.get("voice", "en-us"), validation.get("words_per_minute", 150))
                for i, text in enumerate(sentences)]


def features_of(spec: dict, audio: np.ndarray) -> np.ndarray:
    """One declared speech input (batch of one) from 16 kHz audio, by its front end."""
    from tools.logmel import log_mel, nemo_mel

    n_mels = spec["preprocess"].get("n_mels", 80)
    if spec["preprocess"]["kind"] == "nemo_mel":
        return nemo_mel(audio, spec["shape"][1], n_mels)[None]
    return log_mel(audio, n_mels)[None]


def speech_features(entry: Entry, audio: np.ndarray) -> dict[str, np.ndarray]:
    return {spec["name"]: features_of(spec, audio) for spec in entry.data["inputs"]}


def validation_samples(entry: Entry) -> list[dict[str, np.ndarray]]:
    """One dict of named model inputs per declared validation sample (photograph or spoken sentence)."""
    if "sentences" in entry.data["validation"]:
        return [speech_features(entry, audio) for audio in spoken(entry, entry.data["validation"]["sentences"])]
    samples = []
    for ref in entry.data["validation"]["samples"]:
        image = read_image(entry, ref)
        samples.append({spec["name"]: preprocess_image(image, spec) for spec in entry.data["inputs"]})
    return samples
