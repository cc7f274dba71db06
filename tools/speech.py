"""Real speech for validation, calibration and tests: espeak-ng speaks a sentence, sox makes it 16 kHz mono.

The same sentence gives the same samples on every run (no dither), so that the stages that speak it again agree.
"""
from __future__ import annotations

import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np

from tools.logmel import SAMPLE_RATE


def read_wav(path: Path | str) -> np.ndarray:
    """16-bit PCM mono WAV at 16 kHz -> float32 samples in [-1, 1)."""
    with wave.open(str(path)) as handle:
        if handle.getframerate() != SAMPLE_RATE or handle.getnchannels() != 1 or handle.getsampwidth() != 2:
            raise ValueError(f"{path}: need 16-bit mono at {SAMPLE_RATE} Hz, got {handle.getsampwidth() * 8}-bit, "
                             f"{handle.getnchannels()} channel(s) at {handle.getframerate()} Hz (sox can convert it)")
        return np.frombuffer(handle.readframes(handle.getnframes()), dtype="<i2").astype(np.float32) / 32768


def speak(text: str, path: Path | str, voice: str = "en-us", words_per_minute: int = 150) -> np.ndarray:
    """Say `text` with espeak-ng into a 16 kHz mono WAV at `path`; return its samples."""
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "espeak.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(raw), text],
                       check=True, capture_output=True)
        # -D: no dither. sox dithers by default when it writes 16-bit samples, so the same sentence would differ
        # by a bit or two on each run, and silence normalised per band (NeMo features) magnifies that.
        subprocess.run(["sox", "-D", str(raw), "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16", str(path)],
                       check=True, capture_output=True)
    return read_wav(path)
