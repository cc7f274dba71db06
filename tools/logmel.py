"""Whisper's log-mel front end in numpy alone, so that transcribing with the .tflite graphs needs no torch.

16 kHz mono float audio -> (n_mels, 3000) features: padded or cut to 30 s, centred STFT (periodic Hann
window of 400 samples, hop 160), power spectrum, Slaney-normalised mel filters up to 8 kHz, log10, floored
at 8 below the maximum, scaled by (x + 4) / 4. The tests hold it to transformers' WhisperFeatureExtractor.
"""
from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
WINDOW_SECONDS = 30


def _hz_to_mel(hz):
    """Slaney's mel scale: linear to 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    log_part = 15.0 + 27.0 * np.log(np.maximum(hz, 1e-10) / 1000.0) / np.log(6.4)
    return np.where(hz < 1000.0, 3.0 * hz / 200.0, log_part)


def _mel_to_hz(mel):
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel < 15.0, 200.0 * mel / 3.0, 1000.0 * np.exp(np.log(6.4) * (mel - 15.0) / 27.0))


def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """(n_fft // 2 + 1, n_mels) triangular filters, each scaled to unit area (Slaney normalisation)."""
    bins = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    rising = (bins[:, None] - edges[None, :-2]) / (edges[1:-1] - edges[:-2])
    falling = (edges[None, 2:] - bins[:, None]) / (edges[2:] - edges[1:-1])
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (edges[2:] - edges[:-2]))


def log_mel(audio: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """float32 (n_mels, 3000) log-mel features of up to 30 s of 16 kHz mono audio."""
    samples = WINDOW_SECONDS * SAMPLE_RATE
    audio = np.asarray(audio, dtype=np.float64)[:samples]
    audio = np.pad(audio, (0, samples - audio.shape[0]))
    padded = np.pad(audio, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2
    mel = np.log10(np.maximum(power @ mel_filters(n_mels), 1e-10)).T[:, :-1]
    mel = np.maximum(mel, mel.max() - 8.0)
    return ((mel + 4.0) / 4.0).astype(np.float32)
