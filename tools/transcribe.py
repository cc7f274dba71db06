"""Transcribe a WAV file with a built speech entry's .tflite graphs alone: no torch, no TensorFlow.

    python -m tools.transcribe build/whisper_tiny_en speech.wav [--variant fp32] [--threads 2]
    python -m tools.transcribe build/conformer speech.wav

Reads the build folder's export.json (graph shapes and decoding settings) and tokenizer.json or labels.json,
computes the features in numpy, runs the graphs with LiteRT (Whisper: the encoder, the cross K/V graph and the
decoder step; a CTC model: its one graph, decoded greedily), and prints the text and the time each part took.
The WAV must be 16-bit mono at 16 kHz (sox can convert one).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.transcribe", description=__doc__.split("\n\n")[0])
    parser.add_argument("build_dir", type=Path, help="a built speech entry, e.g. build/whisper_tiny_en")
    parser.add_argument("wav", type=Path, help="16-bit mono 16 kHz WAV (Whisper hears 30 s, a CTC entry its declared window)")
    parser.add_argument("--variant", default="fp32", help="which .tflite: fp32 (default) or an INT8 variant")
    parser.add_argument("--threads", type=int, default=None, help="LiteRT threads (default: all cores)")
    args = parser.parse_args(argv)

    from tools.speech import read_wav

    record = args.build_dir / "export.json"
    if not record.exists():
        print(f"error: {args.build_dir} holds no export.json: build the entry first (doit build:<id>)", file=sys.stderr)
        return 1
    try:
        audio = read_wav(args.wav)
    except (OSError, ValueError, EOFError) as exc:
        print(f"error: {args.wav}: {exc}", file=sys.stderr)
        return 1
    if json.loads(record.read_text()).get("decoding", {}).get("kind") == "ctc_greedy":
        return _transcribe_ctc(args, audio)
    return _transcribe_whisper(args, audio)


def _transcribe_ctc(args, audio) -> int:
    from tools.ctc_runtime import CTCGraph
    from tools.logmel import HOP, SAMPLE_RATE, nemo_mel

    try:
        graph = CTCGraph(args.build_dir, args.variant, args.threads)
    except ValueError as exc:
        print(f"error: {args.build_dir} has no variant {args.variant!r}: {exc}", file=sys.stderr)
        return 1
    frames, n_mels = graph.input_shape[1:]
    if len(audio) > (frames - 1) * HOP:
        print(f"warning: {args.wav} is {len(audio) / SAMPLE_RATE:.1f} s long; the graph hears its first "
              f"{(frames - 1) * HOP / SAMPLE_RATE:.1f} s", file=sys.stderr)
    start = time.perf_counter()
    try:
        features = nemo_mel(audio, frames, n_mels)[None]
    except ValueError as exc:
        print(f"error: {args.wav}: {exc}", file=sys.stderr)
        return 1
    features_s = time.perf_counter() - start
    print(graph.text(graph.decode(features)))
    total = time.perf_counter() - start
    seconds = len(audio) / SAMPLE_RATE
    print(f"graph: {graph.file.name}", file=sys.stderr)
    print(f"audio {seconds:.2f} s | features {features_s * 1000:.1f} ms | forward {graph.timings[0] * 1000:.1f} ms | "
          f"total {total * 1000:.1f} ms, real-time factor {total / seconds:.3f}", file=sys.stderr)
    return 0


def _transcribe_whisper(args, audio) -> int:
    from tools.logmel import SAMPLE_RATE, WINDOW_SECONDS, log_mel
    from tools.whisper_runtime import WhisperGraphs

    try:
        graphs = WhisperGraphs(args.build_dir, args.variant, args.threads)
    except (KeyError, ValueError) as exc:  # an export.json of another kind of entry, or a missing .tflite
        print(f"error: {args.build_dir} is not a built Whisper split entry: {exc}", file=sys.stderr)
        return 1
    if args.variant != "fp32" and all(p.name == "model_fp32.tflite" for p in graphs.files.values()):
        print(f"error: {args.build_dir} has no variant {args.variant!r} in any graph", file=sys.stderr)
        return 1
    if len(audio) > WINDOW_SECONDS * SAMPLE_RATE:
        print(f"warning: {args.wav} is {len(audio) / SAMPLE_RATE:.1f} s long; Whisper hears its first {WINDOW_SECONDS} s",
              file=sys.stderr)
    start = time.perf_counter()
    features = log_mel(audio, graphs.graphs["encoder"]["inputs"]["input_features"][1])[None]
    features_s = time.perf_counter() - start
    ids = graphs.decode(features)
    total = time.perf_counter() - start
    print(graphs.text(ids))
    t = graphs.timings
    print("graphs: " + ", ".join(f"{g} {p.name}" for g, p in graphs.files.items()), file=sys.stderr)
    seconds = len(audio) / SAMPLE_RATE
    print(f"audio {seconds:.2f} s | log-mel {features_s * 1000:.1f} ms | encoder {t['encoder'][0] * 1000:.1f} ms | "
          f"cross K/V {t['cross_kv'][0] * 1000:.1f} ms | decoder {len(t['decoder_step'])} steps, "
          f"{sum(t['decoder_step']) * 1000:.1f} ms | total {total * 1000:.1f} ms, real-time factor {total / seconds:.3f}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
