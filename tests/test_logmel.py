"""The numpy log-mel front end against transformers' WhisperFeatureExtractor, on real speech."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import WhisperFeatureExtractor

from tools.logmel import log_mel
from tools.speech import read_wav, speak

TOLERANCE = 1e-4  # the reference computes partly in float32


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    return speak("Please call Stella and ask her to bring these things.", tmp_path_factory.mktemp("s") / "s.wav")


@pytest.mark.parametrize("n_mels,seconds", [(80, None), (128, None), (80, 35.0)])
def test_log_mel_matches_the_reference_extractor(speech, n_mels, seconds):
    audio = speech if seconds is None else np.tile(speech, int(seconds * 16000 // len(speech)) + 1)[: int(seconds * 16000)]
    expected = WhisperFeatureExtractor(feature_size=n_mels)(audio, sampling_rate=16000, return_tensors="np").input_features[0]
    got = log_mel(audio, n_mels)
    assert got.shape == expected.shape == (n_mels, 3000) and got.dtype == np.float32
    assert np.abs(got - expected).max() < TOLERANCE


def test_speech_is_real_and_16khz(speech, tmp_path):
    assert 1.5 < len(speech) / 16000 < 6  # a sentence, not silence or noise
    assert np.sqrt(np.mean(speech ** 2)) > 0.01
    loud = np.abs(speech) > 0.02
    assert 0.2 < loud.mean() < 0.95  # speech pauses between words


def test_wrong_wav_format_is_named(tmp_path):
    import wave

    path = tmp_path / "stereo.wav"
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(2), handle.setsampwidth(2), handle.setframerate(44100)
        handle.writeframes(b"\0\0" * 200)
    with pytest.raises(ValueError, match="need 16-bit mono at 16000 Hz, got 16-bit, 2 channel\\(s\\) at 44100 Hz"):
        read_wav(path)
