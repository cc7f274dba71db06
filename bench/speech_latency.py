"""Whisper split latency on this machine, side by side in one run: torch eager vs ONNX Runtime vs LiteRT
(fp32, and each INT8 variant the build has), per graph and for whole utterances.

    python bench/speech_latency.py build/whisper_tiny_en [--entry zoo/whisper_tiny_en.json] [--threads 2] [--runs 5]
                                   [--json out.json]

Per graph: the first validation input the export recorded, one warm-up run, then `runs` timed runs
(median). Whole utterances: greedy decoding of every validation sentence with the same loop for every
backend; the real-time factor is decode time over audio length (below 1: faster than real time).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.entry import load_entry  # noqa: E402
from tools.stages.bench import time_runs  # noqa: E402
from tools.stages.validate import load_reference, to_layout  # noqa: E402
from tools.whisper_runtime import WhisperGraphs, decode_utterance  # noqa: E402


def torch_graphs(entry, threads: int) -> dict:
    """The split's torch modules with the entry's weights, as name -> (inputs dict -> outputs list)."""
    import torch

    from tools.sources import build_module
    from tools.splits import REGISTRY
    from tools.weights import load_into

    torch.set_num_threads(threads)
    module = build_module(entry)
    load_into(entry, module)
    family = REGISTRY[entry.data["split"]["name"]].load()
    modules = family.graphs(module)

    def runner(name):
        def run(inputs):
            with torch.no_grad():
                out = modules[name](*[torch.from_numpy(inputs[n]) for n in family.GRAPH_IO[name][0]])
            return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]
        return run
    return {name: runner(name) for name in modules}


def median_ms(run, inputs: dict, runs: int) -> float:
    return round(statistics.median(time_runs(run, inputs, runs)), 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--entry", type=Path, help="the entry it was built from (default: zoo/<build folder name>.json)")
    args = parser.parse_args()

    from tools.inputs import speech_features, spoken
    from tools.logmel import SAMPLE_RATE

    exported = json.loads((args.build / "export.json").read_text())
    entry = load_entry(args.entry or Path(__file__).resolve().parent.parent / "zoo" / f"{args.build.resolve().name}.json")
    variants = [v["name"] for v in entry.data["quantization"].get("variants", [])] if entry.data["quantization"]["enabled"] else []
    lite = {b: WhisperGraphs(args.build, b, args.threads) for b in ["onnx", "fp32", *variants]}
    backends = {"torch": torch_graphs(entry, args.threads),
                **{b: {g: (lambda inputs, g=g, w=w: w.run(g, inputs)) for g in w.graphs} for b, w in lite.items()}}
    per_graph = {}
    for graph in exported["graphs"]:
        feed = load_reference(args.build / graph / "reference.npz")[0]["input"]
        per_graph[graph] = {b: median_ms(runs[graph], feed, args.runs) for b, runs in backends.items()}
    sentences = entry.data["validation"]["sentences"]
    audio = spoken(entry, sentences)
    seconds = sum(len(a) for a in audio) / SAMPLE_RATE
    features = [speech_features(entry, a)["input_features"] for a in audio]
    fp32 = lite["fp32"]
    utterances = {}
    for name, runs in backends.items():
        start = time.perf_counter()
        texts = [fp32.text(decode_utterance(lambda graph, inputs, runs=runs: runs[graph](inputs), f, fp32.self_kv_shape,
                                            fp32.settings)) for f in features]
        utterances[name] = {"real_time_factor": round((time.perf_counter() - start) / seconds, 4), "transcripts": texts}
    print(f"{args.build}: {args.threads} threads, median of {args.runs} (ms); {len(sentences)} sentences, {seconds:.2f} s of audio")
    names = list(backends)
    print(f"{'graph':<14}" + "".join(f"{n:>14}" for n in names) + "   vs torch")
    for graph, times in per_graph.items():
        ratios = ", ".join(f"{n} {times['torch'] / times[n]:.2f}x" for n in names if n != "torch")
        print(f"{graph:<14}" + "".join(f"{times[n]:>14}" for n in names) + f"   {ratios}")
    print(f"{'RTF':<14}" + "".join(f"{utterances[n]['real_time_factor']:>14}" for n in names))
    if args.json:
        args.json.write_text(json.dumps({"host": platform.platform(), "threads": args.threads, "runs": args.runs,
                                         "audio_s": round(seconds, 2), "graphs_ms": per_graph, "utterances": utterances},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
