"""Named graph splits: how a model that runs as several graphs (Whisper: encoder, cross K/V, decoder step)
is cut, fed and decoded.

An entry names a split in `split.name`; each graph then goes through simplify, convert, validate (and INT8)
in a folder of its own, build/<id>/<graph>/. A split is code reviewed into the repository, like an export
patch: a JSON-only entry can choose one, never bring one. The registry holds names only; torch is imported
when a split's module is.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class Split:
    name: str
    module: str                    # tools.splits.<module>: graphs(), reference_run(), runtime settings
    applies_to: tuple[str, ...]    # source classes it knows how to cut
    graphs: tuple[str, ...]        # graph names, in the order they run
    summary: str

    def load(self):
        return import_module(f"tools.splits.{self.module}")


REGISTRY = {s.name: s for s in [
    Split("whisper_kv_cache", "whisper", ("WhisperForConditionalGeneration",), ("encoder", "cross_kv", "decoder_step"),
          "Whisper as an 8MP runs it: encoder (NPU), cross-attention K/V once per utterance, decoder step with a "
          "sliding self-attention cache as explicit input and output (CPU); static shapes, int32 ids"),
]}


def graphs_of(entry_data: dict) -> tuple[str, ...]:
    """The graph names of an entry: its split's, or none for a single-graph entry."""
    split = entry_data.get("split")
    return REGISTRY[split["name"]].graphs if split else ()
