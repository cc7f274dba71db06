"""Read CTranslate2 `model.bin` checkpoints as data, and map Whisper's into transformers' layout.

The file is a flat list of named tensors (binary version 6): a header (version, spec name, spec revision),
then per variable its name, rank, dims, dtype code and raw little-endian bytes, then aliases (tied
weights). Nothing in it is executed. CTranslate2 fuses Whisper's attention projections (q/k/v into one
matrix for self-attention, k/v for cross-attention); the key map splits them again.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

from tools.keymaps import compile_rules, renamed

SUPPORTED_BINARY_VERSION = 6
# CTranslate2's DataType codes; bfloat16 (5) is widened to float32 on read.
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.uint16}


class CTranslate2FormatError(ValueError):
    pass


class _Reader:
    def __init__(self, data: bytes, path: Path):
        self.data, self.offset, self.path = data, 0, path

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.data):
            raise CTranslate2FormatError(f"{self.path}: truncated at byte {self.offset} (wanted {size} more)")
        chunk = self.data[self.offset:self.offset + size]
        self.offset += size
        return chunk

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("H")).rstrip(b"\0").decode("utf-8")


def read_model_bin(path: Path | str) -> tuple[str, dict[str, np.ndarray]]:
    """The spec name (e.g. 'WhisperSpec') and every variable by name; aliases resolve to their target."""
    path = Path(path)
    reader = _Reader(path.read_bytes(), path)
    version = reader.unpack("I")
    if version != SUPPORTED_BINARY_VERSION:
        raise CTranslate2FormatError(f"{path}: CTranslate2 binary version {version}; this reader reads version "
                                     f"{SUPPORTED_BINARY_VERSION} (convert it again with a current CTranslate2)")
    spec = reader.string()
    reader.unpack("I")  # the spec's revision
    variables = {}
    for _ in range(reader.unpack("I")):
        name = reader.string()
        dims = [reader.unpack("I") for _ in range(reader.unpack("B"))]
        code = reader.unpack("B")
        if code not in DTYPES:
            raise CTranslate2FormatError(f"{path}: variable {name!r} has unknown dtype code {code}")
        raw = reader.take(reader.unpack("I"))
        array = np.frombuffer(raw, dtype=np.dtype(DTYPES[code]).newbyteorder("<")).reshape(dims)
        if code == 5:
            array = (array.astype(np.uint32) << 16).view(np.float32)
        variables[name] = array
    for _ in range(reader.unpack("I")):
        alias, target = reader.string(), reader.string()
        variables[alias] = variables[target]
    if reader.offset != len(reader.data):
        raise CTranslate2FormatError(f"{path}: {len(reader.data) - reader.offset} unread bytes after the aliases")
    return spec, variables


# CTranslate2 WhisperSpec -> transformers WhisperForConditionalGeneration, for the variables that are plain renames.
_WHISPER_RENAMES = [
    (r"encoder/conv([12])/(weight|bias)", r"model.encoder.conv\1.\2"),
    (r"(encoder|decoder)/layer_norm/gamma", r"model.\1.layer_norm.weight"),
    (r"(encoder|decoder)/layer_norm/beta", r"model.\1.layer_norm.bias"),
    (r"encoder/position_encodings/encodings", r"model.encoder.embed_positions.weight"),
    (r"decoder/position_encodings/encodings", r"model.decoder.embed_positions.weight"),
    (r"decoder/embeddings/weight", r"model.decoder.embed_tokens.weight"),
    (r"decoder/projection/weight", r"proj_out.weight"),
    (r"(encoder|decoder)/layer_(\d+)/self_attention/linear_1/(weight|bias)", r"model.\1.layers.\2.self_attn.out_proj.\3"),
    (r"decoder/layer_(\d+)/attention/linear_0/(weight|bias)", r"model.decoder.layers.\1.encoder_attn.q_proj.\2"),
    (r"decoder/layer_(\d+)/attention/linear_2/(weight|bias)", r"model.decoder.layers.\1.encoder_attn.out_proj.\2"),
    (r"(encoder|decoder)/layer_(\d+)/ffn/linear_0/(weight|bias)", r"model.\1.layers.\2.fc1.\3"),
    (r"(encoder|decoder)/layer_(\d+)/ffn/linear_1/(weight|bias)", r"model.\1.layers.\2.fc2.\3"),
]
_WHISPER_NORMS = {"self_attention": "self_attn_layer_norm", "attention": "encoder_attn_layer_norm", "ffn": "final_layer_norm"}
_NORM = re.compile(r"(encoder|decoder)/layer_(\d+)/(self_attention|attention|ffn)/layer_norm/(gamma|beta)\Z")
_FUSED = re.compile(r"(encoder|decoder)/layer_(\d+)/(self_attention/linear_0|attention/linear_1)/(weight|bias)\Z")
# Scalars that describe the architecture (heads, activation, ...); the entry's config declares those.
_WHISPER_SETTINGS = re.compile(r"(encoder|decoder)/(num_heads|activation|alibi|alignment_heads|alignment_layer|pre_norm|"
                               r"scale_embeddings|start_from_zero_embedding)\Z")
_COMPILED = compile_rules(_WHISPER_RENAMES)


def whisper_to_transformers(variables: dict) -> dict:
    """CTranslate2 Whisper variables -> transformers state dict (float32 torch tensors).

    Fused projections are split: self-attention q/k/v thirds, cross-attention k/v halves. Whisper's key
    projections have no bias; CTranslate2 stores zeros there, which are checked and dropped.
    """
    import torch

    out, unknown = {}, []
    for name, array in variables.items():
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)) if array.ndim else None
        norm, fused = _NORM.match(name), _FUSED.match(name)
        if _WHISPER_SETTINGS.match(name):
            continue
        if norm:
            side, layer, block, kind = norm.groups()
            out[f"model.{side}.layers.{layer}.{_WHISPER_NORMS[block]}.{'weight' if kind == 'gamma' else 'bias'}"] = tensor
        elif fused:
            side, layer, block, kind = fused.groups()
            attn = "self_attn" if block.startswith("self") else "encoder_attn"
            names = ("q_proj", "k_proj", "v_proj") if attn == "self_attn" else ("k_proj", "v_proj")
            for proj, part in zip(names, tensor.chunk(len(names), dim=0)):
                if proj == "k_proj" and kind == "bias":
                    if part.abs().max() > 0:
                        raise KeyError(f"whisper_ctranslate2: {name} has a non-zero key bias; Whisper's key projection has none")
                    continue
                out[f"model.{side}.layers.{layer}.{attn}.{proj}.{kind}"] = part.clone()
        elif (target := renamed(name, _COMPILED)) is not None:
            out[target] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise KeyError(f"whisper_ctranslate2: {len(unknown)} variables of no known Whisper layout, e.g. {unknown[:5]}")
    return out
