"""Model families this repository defines: the `zoo` source kind.

Some trained checkpoints fit no class that transformers or timm builds as is (NeMo's Conformer-CTC small
subsamples with full convolutions where transformers' Parakeet uses depthwise ones). A family is code
reviewed into the repository, like an export patch or a split: an entry can name one (`source.family`) and
set its config, never bring one. The registry holds names only; torch is imported when a family is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class Family:
    name: str
    module: str          # tools.families.<module>: build(config) -> torch module, CONFIG_KEYS
    summary: str

    def load(self):
        return import_module(f"tools.families.{self.module}")


REGISTRY = {f.name: f for f in [
    Family("conformer_ctc", "conformer_ctc",
           "Conformer encoder (macaron feed-forward, relative-position self-attention, depthwise convolution module) "
           "with a CTC head, from transformers' Parakeet modules; subsampling 'dw_striding' (FastConformer) or "
           "'striding' (Conformer: full 3x3 convolutions, as NeMo's stt_en_conformer_ctc_*)"),
]}
