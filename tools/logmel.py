"""Speech front ends in numpy alone, so that transcribing with the .tflite graphs needs no torch.

log_mel (Whisper): 16 kHz mono float audio -> (n_mels, 3000) features: padded or cut to 30 s, centred STFT
(periodic Hann window of 400 samples, hop 160), power spectrum, Slaney-normalised mel filters up to 8 kHz,
log10, floored at 8 below the maximum, scaled by (x + 4) / 4. The tests hold it to WhisperFeatureExtractor.

nemo_mel (NeMo's Conformers, transformers' Parakeet): (frames, n_mels) features of a fixed window: pre-emphasis
0.97, centred 512-point STFT with zero padding (symmetric Hann window of 400 samples, hop 160), power, the same
Slaney mel filters, natural log of (x + 2^-24), each band normalised to zero mean and unit variance over the
utterance's frames; frames past the utterance are zero. The tests hold it to ParakeetFeatureExtractor.
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


NEMO_N_FFT = 512
NEMO_WINDOW = 400
NEMO_PREEMPHASIS = 0.97
NEMO_LOG_GUARD = 2.0 ** -24
NEMO_STD_EPSILON = 1e-5


def nemo_mel(audio: np.ndarray, frames: int, n_mels: int = 80) -> np.ndarray:
    """float32 (frames, n_mels) NeMo features of 16 kHz mono audio, zero-padded or cut to frames - 1 hops."""
    samples = (frames - 1) * HOP
    audio = np.asarray(audio, dtype=np.float64)[:samples]
    length = audio.shape[0]
    emphasised = np.concatenate([audio[:1], audio[1:] - NEMO_PREEMPHASIS * audio[:-1]])
    signal = np.pad(emphasised, (NEMO_N_FFT // 2, samples - length + NEMO_N_FFT // 2))
    window = np.zeros(NEMO_N_FFT)
    offset = (NEMO_N_FFT - NEMO_WINDOW) // 2
    window[offset:offset + NEMO_WINDOW] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(NEMO_WINDOW) / (NEMO_WINDOW - 1))
    spectrum = np.fft.rfft(np.lib.stride_tricks.sliding_window_view(signal, NEMO_N_FFT)[::HOP] * window, axis=-1)
    features = np.log((np.abs(spectrum) ** 2) @ mel_filters(n_mels, NEMO_N_FFT) + NEMO_LOG_GUARD)
    valid = length // HOP  # frames of the utterance itself
    if valid < 2:
        raise ValueError(f"{length} samples are too short for NeMo features: at least {2 * HOP} are needed")
    mean = features[:valid].mean(0)
    std = np.sqrt(((features[:valid] - mean) ** 2).sum(0) / (valid - 1))
    features = (features - mean) / (std + NEMO_STD_EPSILON)
    features[valid:] = 0.0
    return features.astype(np.float32)
