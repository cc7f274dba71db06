"""How much of Whisper's encoder attention an int8 softmax output keeps: the reason its attention core stays float.

    python bench/whisper_attention_mass.py [zoo/whisper_tiny_en.json]

TFLite's int8 SOFTMAX writes probabilities in fixed steps of 1/256 (scale 1/256, zero point -128), so a
probability below 1/512 becomes 0. Over 1500 keys a diffuse attention row has most of its entries there. This
runs the entry's encoder (its trained weights) in torch on the validation sentences and prints, per layer, the
mean share of each query's attention mass held by such entries and the share of queries that lose more than half.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.entry import load_entry  # noqa: E402
from tools.inputs import speech_features, spoken  # noqa: E402
from tools.sources import build_module  # noqa: E402
from tools.weights import load_into  # noqa: E402

STEP = 1 / 256


def main(argv: list[str] | None = None) -> int:
    entry = load_entry((argv or sys.argv[1:] or ["zoo/whisper_tiny_en.json"])[0])
    model = build_module(entry)
    load_into(entry, model)
    model.config._attn_implementation = "eager"  # attention probabilities are returned by the eager path only
    encoder = model.eval().model.encoder
    utterances = spoken(entry, entry.data["validation"]["sentences"])
    with torch.no_grad():
        runs = [encoder(torch.from_numpy(speech_features(entry, a)["input_features"]), output_attentions=True).attentions
                for a in utterances]
    for layer in range(len(runs[0])):
        probs = torch.cat([run[layer] for run in runs])
        lost = (probs * (probs < STEP / 2)).sum(-1)
        print(f"layer {layer}: mean attention mass rounded to 0 by int8 softmax {lost.mean():.3f}; "
              f"queries losing more than half {(lost > 0.5).float().mean():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
