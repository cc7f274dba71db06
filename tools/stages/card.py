"""card: the model card, card.json (checked against schema/card.schema.json) and card.md for people.

Every figure on the card is read from this build's stage records: nothing is typed in by hand.
A build from random weights says so in card.json's weights.kind and at the top of card.md.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path

import jsonschema

from tools.atomic import atomic_path, write_json
from tools.entry import ROOT, Entry
from tools.families import REGISTRY as FAMILIES
from tools.provenance import provenance
from tools.stages import int8_enabled, variant_files
from tools.weights import sha256_of

CARD_SCHEMA = ROOT / "schema" / "card.schema.json"
ARTIFACTS = ("model.onnx", "model_sim.onnx", "model_fp32.tflite")
RANDOM_WARNING = "RANDOM WEIGHTS: built without the trained checkpoint; outputs are meaningless and this build is never published."


def _records(build_dir: Path, names: tuple) -> dict:
    return {name: json.loads((build_dir / f"{name}.json").read_text()) for name in names}


def _graph_section(entry: Entry, folder: Path, prefix: str = "") -> dict:
    """Artifacts, export, conversion, validation, NPU placement, INT8 and stage costs of one graph's folder."""
    stages = ("export", "simplify", "convert", "validation") + (("quantize", "fidelity") if int8_enabled(entry) else ()) + ("npu",)
    rec = _records(folder, stages)
    section = {
        "artifacts": [{"path": prefix + name, "sha256": sha256_of(folder / name), "bytes": (folder / name).stat().st_size}
                      for name in ARTIFACTS + tuple(variant_files(entry))],
        "export": {k: rec["export"][k] for k in ("opset", "exporter", "patches", "inputs", "outputs", "onnx_nodes", "parameters")
                   if k in rec["export"]},
        "conversion": {k: rec["convert"][k] for k in ("converter", "flags", "tflite_rewrites", "ops", "op_count")},
        "validation": {k: rec["validation"][k] for k in ("passed", "samples", "stages")},
        "stages": {name: {"wall_s": rec[name]["wall_s"], "peak_rss_mib": rec[name]["peak_rss_mib"]}
                   for name in stages if name != "export"},
        "npu": {k: rec["npu"][k] for k in ("rules_source", "default_bsp", "graphs", "estimates")},
        "tools": {k: v for name in stages for k, v in rec[name].get("tools", {}).items()},
    }
    if int8_enabled(entry):
        section["quantization"] = {k: rec["quantize"][k] for k in ("quantizer", "activations", "calibration", "keep_float", "variants")}
        section["fidelity"] = {k: rec["fidelity"][k] for k in ("passed", "samples", "thresholds", "variants", "known_failure")
                               if k in rec["fidelity"]}
    return section


def build_card(entry: Entry, build_dir: Path) -> dict:
    exported = json.loads((build_dir / "export.json").read_text())
    weights = exported["weights"]
    card = {
        "card_version": 1,
        "id": entry.id,
        "title": entry.data["title"],
        "task": entry.data["task"],
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
                 "cpu_count": os.cpu_count() or 1},
        "source": entry.data["source"],
        "weights": weights,
        "license": entry.data["license"],
        "provenance": provenance(entry),
        "warnings": [RANDOM_WARNING] if weights["kind"] == "random" else [],
    }
    export_cost = {"export": {"wall_s": exported["wall_s"], "peak_rss_mib": exported["peak_rss_mib"]}}
    if not entry.graphs:
        section = _graph_section(entry, build_dir)
        tools = {**exported["tools"], **section.pop("tools")}
        section["stages"] = {**export_cost, **section["stages"]}
        card.update(section, tools=tools)
    else:
        graphs = {g: _graph_section(entry.for_graph(g), build_dir / g, f"{g}/") for g in entry.graphs}
        card["tools"] = {**exported["tools"], **{k: v for g in graphs.values() for k, v in g.pop("tools").items()}}
        card["artifacts"] = [a for g in graphs.values() for a in g["artifacts"]]
        card["split"] = exported["split"]
        card["graphs"] = graphs
        card["stages"] = export_cost
    if not entry.graphs:
        bench = json.loads((build_dir / "bench.json").read_text())
        card["host_latency"] = {k: bench[k] for k in ("threads", "runs", "built_size", "host_latency", "sweep", "plot",
                                                       "sweep_note", "finished", "tools")}
        card["host_latency"]["plot_sha256"] = sha256_of(build_dir / "bench.png")
        card["stages"]["bench"] = {k: bench[k] for k in ("wall_s", "peak_rss_mib")}
    if (build_dir / "board.json").exists():
        card["board"] = _board_section(json.loads((build_dir / "board.json").read_text()), card["artifacts"])
    if "decoding" in entry.data:
        speech_record = json.loads((build_dir / "speech.json").read_text())
        card["speech"] = {k: speech_record[k] for k in ("passed", "sentences", "audio_s", "trained_weights", "backends",
                                                        "known_failure") if k in speech_record}
        card["stages"]["speech"] = {k: speech_record[k] for k in ("wall_s", "peak_rss_mib")}
    jsonschema.Draft202012Validator(json.loads(CARD_SCHEMA.read_text())).validate(card)
    return card


PIPELINE_TAGS = {"object-detection": "object-detection", "image-classification": "image-classification",
                 "speech-recognition": "automatic-speech-recognition"}


def front_matter(card: dict) -> str:
    """The Hugging Face model-card header: license (the weights'), pipeline tag, base model, tags."""
    import yaml

    declared = card["weights"]["declared"]
    base_model = declared.get("base_model") or (declared["repo"] if declared["kind"] == "hub" else None)
    int8 = any(a["path"].endswith(".tflite") and "_int8" in a["path"] for a in card["artifacts"])
    tags = ["imx8mp", "vx-delegate", "tflite", "onnx", *(["int8"] if int8 else []), card["source"].get("family") or card["source"]["kind"],
            *(["random-weights"] if card["weights"]["kind"] == "random" else [])]
    header = {"license": card["license"]["weights"].lower(), "library_name": "tflite",
              "pipeline_tag": PIPELINE_TAGS[card["task"]], **({"base_model": base_model} if base_model else {}), "tags": tags}
    return "---\n" + yaml.safe_dump(header, sort_keys=False) + "---\n"


def _board_section(record: dict, artifacts: list[dict]) -> dict:
    """The board record (tools.board) for the files of this build: a result whose file has changed since it was
    measured (its sha256 is no artifact's) is left out and named under 'stale'."""
    path_of = {a["sha256"]: a["path"] for a in artifacts}
    current = {name: path_of[sha] for name, sha in record["artifacts"].items() if sha in path_of}
    return {**{k: record[k] for k in ("what", "kind", "target", "when", "where", "how")},
            "results": {current[name]: r for name, r in record["results"].items() if name in current},
            "stale": sorted(set(record["results"]) - set(current))}


def render_markdown(card: dict) -> str:
    w = card["weights"]
    lines = [front_matter(card), f"# {card['title']} (`{card['id']}`)", ""]
    lines += [f"> **{msg}**" for msg in card["warnings"]] + ([""] if card["warnings"] else [])
    lines += [f"Task: {card['task']}. Built {card['generated']} on {card['host']['hostname']} "
              f"({card['host']['machine']}, {card['host']['cpu_count']} cores).", ""]
    src = card["source"]
    lines += ["## Source and weights", "",
              f"- Source: {src['kind']} `{src.get('class') or src.get('model') or src.get('family')}`"
              + (f" ({FAMILIES[src['family']].summary})" if "family" in src else "") + "; config overrides: "
              f"`{json.dumps(src.get('config', {}), sort_keys=True)}`",
              f"- Weights: **{w['kind']}**; declared: {w['declared']['kind']} "
              f"{w['declared'].get('url') or w['declared'].get('repo') or w['declared'].get('path') or w['declared'].get('package')}",
              f"- sha256 declared: `{w['sha256_declared'] or 'unpinned: ' + w['declared'].get('unpinned_reason', '')}`",
              f"- sha256 loaded: `{w.get('sha256_loaded', 'none (random weights)')}`",
              f"- License: code {card['license']['code']}, weights {card['license']['weights']}"
              + ("" if card["license"].get("weights_commercial_use", True) else " (**non-commercial weights**)"), ""]
    if "speech" in card:
        lines += _speech_markdown(card)
    if "graphs" in card:
        for name, section in card["graphs"].items():
            lines += [f"## Graph `{name}`", ""] + _graph_markdown(section, "###")
    else:
        lines += _graph_markdown(card, "##")
    lines += _board_markdown(card)
    if "host_latency" in card:
        lines += _host_markdown(card["host_latency"], card["host"])
    lines += ["", "## Artifacts", "", "| file | bytes | sha256 |", "|---|---|---|"]
    lines += [f"| {a['path']} | {a['bytes']:,} | `{a['sha256']}` |" for a in card["artifacts"]]
    lines += ["", "## Build (measured in this build, on the host above)", "", "| stage | wall s | peak RSS MiB |", "|---|---|---|"]
    lines += [f"| {k} | {v['wall_s']} | {v['peak_rss_mib']} |" for k, v in card["stages"].items()]
    lines += [f"| {g} {k} | {v['wall_s']} | {v['peak_rss_mib']} |"
              for g, section in card.get("graphs", {}).items() for k, v in section["stages"].items()]
    lines += ["", "## Tool versions", "", ", ".join(f"{k} {v}" for k, v in sorted(card["tools"].items())), ""]
    prov = card["provenance"]
    commit = prov["git_commit"] or "not in a git checkout"
    lines += ["## Provenance", "", f"- git commit: `{commit}`" + (" (with uncommitted changes)" if prov["git_dirty"] else ""),
              "- sources (sha256): " + ", ".join(f"`{p}` {d[:12]}" for p, d in prov["sources"].items()), ""]
    return "\n".join(lines)


def _graph_markdown(section: dict, h: str) -> list[str]:
    """Export, conversion, validation, INT8 and NPU placement of one graph, under headings of level `h`."""
    exp = section["export"]
    lines = [f"{h} Export", "", f"- ONNX opset {exp.get('opset', '')}, {exp.get('exporter', 'torch.onnx.export')}; "
             f"{exp['onnx_nodes']} nodes; {exp['parameters']:,} parameters",
             "- Inputs: " + ", ".join(f"`{k}` {v}" for k, v in exp["inputs"].items()),
             "- Outputs: " + ", ".join(f"`{k}` {v}" for k, v in exp["outputs"].items()),
             "- Export patches: " + (", ".join(f"`{p['name']}` ({p['summary']})" for p in exp.get("patches", [])) or "none"), ""]
    conv = section["conversion"]
    top = sorted(conv["ops"].items(), key=lambda kv: -kv[1])[:12]
    rewrites = ", ".join(f"`{name}` x{count}" for name, count in conv["tflite_rewrites"].items() if count) or "none applied"
    lines += [f"{h} TFLite fp32 graph", "", f"- {conv['converter']}, {conv['op_count']} ops: "
              + ", ".join(f"{k} {v}" for k, v in top), f"- TFLite rewrites (ops proven idle, removed): {rewrites}", ""]
    val = section["validation"]
    lines += [f"{h} Validation against torch", "",
              f"Real inputs: {', '.join(map(str, val['samples']))}. Overall: **{'passed' if val['passed'] else 'FAILED'}**.", "",
              "| stage | output | max abs | max rel | atol | rtol | passed |", "|---|---|---|---|---|---|---|"]
    for stage, res in val["stages"].items():
        for name, o in res["outputs"].items():
            lines.append(f"| {stage} | {name} | {o['max_abs']:.3g} | {o['max_rel']:.3g} | {res['tolerance']['atol']:g} "
                         f"| {res['tolerance']['rtol']:g} | {'yes' if o['passed'] else 'NO'} |")
    if "quantization" in section:
        lines += _int8_markdown(section["quantization"], section["fidelity"], h)
    lines += _npu_markdown(section["npu"], h) + [""]
    return lines


def _speech_markdown(card: dict) -> list[str]:
    sp = card["speech"]
    random_note = "" if sp["trained_weights"] else " (random weights: the words mean nothing; only agreement counts)"
    lines = ["## Transcripts (whole utterances, greedy, measured on the host above)", "",
             f"{len(sp['sentences'])} sentences spoken by espeak-ng, {sp['audio_s']} s of audio{random_note}. "
             f"ONNX and fp32 TFLite label ids equal torch's, INT8 variants within the entry's word error rate of fp32: "
             f"**{'yes' if sp['passed'] else 'NO'}**" + (f" (known failure: {sp['known_failure']})" if "known_failure" in sp else "")
             + ".", ""]
    timings = [k for k in ("forward_ms", "encoder_ms", "cross_kv_ms", "decoder_step_ms") if k in sp["backends"]["fp32"]]
    names = {"forward_ms": "forward ms", "encoder_ms": "encoder ms", "cross_kv_ms": "cross K/V ms", "decoder_step_ms": "decoder step ms"}
    lines += ["| backend | WER vs spoken | WER vs fp32 | " + " | ".join(names[k] for k in timings) + " | real-time factor |",
              "|---|---|---|" + "---|" * len(timings) + "---|"]
    for name, b in sp["backends"].items():
        trial = " (trial: never gating, never published)" if b.get("trial") else ""
        lines.append(f"| {name}: {b['runs']}{trial} | {b['wer_vs_spoken']} | {b.get('wer_vs_fp32', '')} | "
                     + " | ".join(str(b[k]) for k in timings) + f" | {b['real_time_factor']} |")
    int8 = [name for name in sp["backends"] if name not in ("onnx", "fp32", "torch")]
    lines += ["", "| sentence spoken | fp32 TFLite transcript |" + "".join(f" {n} |" for n in int8),
              "|---|---|" + "---|" * len(int8)]
    lines += ["| " + " | ".join([s, *(sp["backends"][b]["transcripts"][i] for b in ["fp32", *int8])]) + " |"
              for i, s in enumerate(sp["sentences"])]
    if "split" not in card:
        return lines + [""]
    split = card["split"]
    return lines + ["", f"Split `{split['name']}`: {split['summary']}.", ""]


def _board_markdown(card: dict) -> list[str]:
    """8MP measured: the board record's steady-state and first-inference figures, or that none exists."""
    board = card.get("board")
    if not board or not board["results"]:
        return ["", "## 8MP measured on a board", "", "Not measured: no board record for these files"
                + (f" (stale results of changed files left out: {', '.join(board['stale'])})" if board else "")
                + f". With a board: `ZOO_TARGET=ssh://root@board doit board:{card['id']}` (or adb://SERIAL).", ""]
    where = board["where"]
    is_8mp = "8MP" in (where.get("soc_id") or "").upper() or "8MPLUS" in (where.get("soc_machine") or "").upper().replace(" ", "")
    title = "8MP measured on a board" if is_8mp else "Measured on a board that is not an 8MP by its SoC id"
    lines = ["", f"## {title} ({board['when']}, {board['target']})", "",
             f"Board: SoC {where.get('soc_id') or 'unknown'}" + (f" ({where['soc_machine']})" if where.get("soc_machine") else "")
             + f", {where.get('os')}, kernel {where.get('kernel')}; runtimes "
             + ", ".join(f"{k} {v}" for k, v in (where.get("runtimes") or {}).items()) + "; VX delegate "
             f"{'present' if board['how']['delegate_present'] else 'absent'} ({board['how']['delegate_path']}).", "",
             "| file | placement | runner | threads | init ms | first inference ms | steady mean ms | p50 ms | p90 ms | std ms | runs | graph cache |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, placements in board["results"].items():
        for placement, r in placements.items():
            if "error" in r:
                lines.append(f"| {path} | {placement} | {r['error']} |" + " |" * 9)
                continue
            st, cache = r["steady"], r.get("graph_cache")
            cached = "n/a" if cache is None else (f"on, {cache['entries_before']} entries before" if cache["enabled"] else "off")
            lines.append(f"| {path} | {placement} | {r['runner']} | {r['threads']} | {r['init_ms']} | {r['first_ms']} | "
                         f"{st['mean_ms']} | {st.get('p50_ms')} | {st.get('p90_ms')} | {st['std_ms']} | {st['runs']} | {cached} |")
    if board["stale"]:
        lines.append(f"\nLeft out, measured on files that have changed since: {', '.join(board['stale'])}.")
    return lines + [""]


def _host_markdown(bench: dict, host: dict) -> list[str]:
    """Host latency and the input-size sweep (bench stage): measured here, never the 8MP's."""
    lines = ["", f"## Host latency (measured {bench['finished']} on the host above: not the 8MP)", "",
             f"{bench['threads']} threads, median of {bench['runs']} runs after one warm-up, first validation input, "
             f"built size {bench['built_size'][0]}x{bench['built_size'][1]}.", "",
             "| runtime | file | kernels | median ms | mean ms |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['file'] or 'torch module'} | {r['kernels']} | {r['median_ms']} | {r['mean_ms']} |"
              for name, r in bench["host_latency"].items()]
    lines += ["", "Input-size sweep (each size exported again with the entry's patches; " + bench["sweep_note"] + "):", "",
              "| size | torch ms | ONNX Runtime ms | ONNX max abs vs torch | TFLite ms |", "|---|---|---|---|---|"]
    for p in bench["sweep"]:
        tflite = ", ".join(f"{k.removeprefix('tflite_')} {v}" for k, v in p.get("tflite", {}).items()) or "not converted"
        lines.append(f"| {p['size'][0]}x{p['size'][1]} | {p['torch']['median_ms']} | {p['onnxruntime']['median_ms']} | "
                     f"{p['onnx_max_abs_vs_torch']:.3g} | {tflite} |")
    return lines + ["", f"![host latency against input size]({bench['plot']})", ""]


def _npu_markdown(npu: dict, h: str) -> list[str]:
    lines = ["", f"{h} NPU placement (VX delegate rules, static analysis: not measured on a board)", "",
             f"Rules: {npu['rules_source']}.", "",
             "| graph | BSP | ops on NPU | MACs on NPU | partitions | tensors crossing NPU/CPU |", "|---|---|---|---|---|---|"]
    for graph, by_bsp in npu["graphs"].items():
        for bsp, r in by_bsp.items():
            s = r["summary"]
            macs = f"{s['macs_npu_pct']}% of {s['macs'] / 1e9:.2f} G" if s["macs"] else "no MACs"
            lines.append(f"| {graph} | {bsp} | {s['ops_npu']}/{s['ops']} ({s['ops_npu_pct']}%) | {macs} | {s['partitions']} "
                         f"| {s['crossing_tensors']} |")
    for graph, by_bsp in npu["graphs"].items():
        for bsp, r in by_bsp.items():
            for op, f in r["fallbacks"].items():
                lines.append(f"- CPU fallback in {graph} ({bsp}): {op} x{f['count']}: " + "; ".join(f["reasons"]))
    lines += _estimate_markdown(npu["estimates"], h) if npu["estimates"] else []
    return lines


def _estimate_markdown(estimates: dict, h: str) -> list[str]:
    first = next(iter(next(iter(estimates.values())).values()))
    band = lambda e: f"{e['ms']} ms ({e['range_ms'][0]}-{e['range_ms'][1]})"  # noqa: E731
    lines = ["", f"{h} 8MP latency: estimated, not measured", "",
             f"From the placement above and a cost model ({first['model']}). The range is where the published latency "
             f"lay, relative to the leave-one-out prediction, over the fitted models (largest error: NPU "
             f"{first['npu']['loo_max_abs']:.0%}, CPU {first['cpu_4_threads']['loo_max_abs']:.0%}; median "
             f"{first['npu']['loo_median_abs']:.0%} and {first['cpu_4_threads']['loo_median_abs']:.0%}). "
             f"Not modelled: {', '.join(first['not_modelled'])}.", "",
             f"The VX delegate column includes the partition boundaries' cost ({first['boundaries']['basis']}).", "",
             *[f"{graph}: {e['float_ops']['count']} ops compute in float ({e['float_ops']['macs'] / 1e9:.2f} G MACs); "
               f"{e['float_ops']['basis']}." for graph, by_bsp in estimates.items()
               for e in list(by_bsp.values())[:1] if e.get("float_ops", {}).get("count")],
             *[f"{graph} is larger than every fitted model (" + ", ".join(f"{k.replace('_', ' ')} {x}x the largest"
                                                                      for k, x in e["beyond_fit"].items())
               + "): the estimate extrapolates the fit, and its error may exceed the band."
               for graph, by_bsp in estimates.items() for e in list(by_bsp.values())[:1] if e.get("beyond_fit")],
             "", "| graph | BSP | VX delegate (NPU, CPU for fallbacks) | of which boundaries | CPU only, 4 threads |", "|---|---|---|---|---|"]
    for graph, by_bsp in estimates.items():
        lines += [f"| {graph} | {bsp} | {band(e['npu'])} | {e['boundaries']['ms']} ms ({e['boundaries']['partitions']} partition(s), "
                  f"{e['boundaries']['crossing_bytes']:,} bytes crossing) | {band(e['cpu_4_threads'])} |" for bsp, e in by_bsp.items()]
    compile_ = first["first_inference"]
    return lines + ["", f"First inference with the VX delegate (the NPU graph compile, {compile_['label']}): "
                    f"{compile_['range_s'][0]}-{compile_['range_s'][1]} s ({'; '.join(compile_['published'])}); "
                    f"{compile_['note']}. Avoid it with "
                    + ", ".join(f"`{k}` ({v})" for k, v in compile_["avoid_with"].items()) + "."]


def _int8_markdown(quant: dict, fid: dict, h: str) -> list[str]:
    cal = quant["calibration"]
    lines = ["", f"{h} INT8 (full-integer, int8 activations) against fp32 TFLite", "",
             f"Calibration: {cal['count']} samples from {', '.join(s['ref'] for s in cal['sources'])} "
             f"(content sha256 `{cal['sha256'][:16]}`), none of them a validation sample. "
             f"Fidelity gate: **{'passed' if fid['passed'] else 'FAILED'}**"
             + (f" (a known failure: {fid['known_failure']})" if "known_failure" in fid else "") + f" (min SQNR {fid['thresholds']['min_sqnr_db']} dB, "
             f"min cosine {fid['thresholds']['min_cosine']}).", "",
             "| variant | weights | I/O | bytes | float ops (CPU on the 8MP) | output | SQNR min dB | cosine min | passed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, v in quant["variants"].items():
        f = fid["variants"][name]
        for output, o in f["outputs"].items():
            lines.append(f"| {name} | {v['weights']} | {v.get('io', 'float32')} | {v['bytes']:,} | {len(v['float_ops'])} "
                         f"| {output} | {o['sqnr_db_min']} | {o['cosine_min']} | {'yes' if f['passed'] else 'NO'}"
                         f"{' (trial: not gating)' if f.get('trial') else ''} |")
    for name, f in fid["variants"].items():
        if "detection" in f:
            d = f["detection"]
            lines.append(f"\n- {name} detections vs fp32: precision {d['precision']:.3f}, recall {d['recall']:.3f}, "
                         f"mean IoU {d['mean_iou']:.3f} ({d['matched']} of {d['reference']} fp32 detections matched, "
                         f"{d['test']} INT8 detections)")
        layers = f["layers"]
        first = layers["first_diverging"]
        lines.append(f"- {name} layer by layer ({layers['compared']} activations compared, first sample): first below "
                     f"{layers['threshold_db']} dB: " + (f"`{first['tensor'][:60]}` ({first['op']}, {first['sqnr_db']} dB)" if first else "none")
                     + "; worst: " + ", ".join(f"{w['op']} `{w['tensor'][:40]}` {w['sqnr_db']} dB" for w in layers["worst"][:5]))
        floats = quant["variants"][name]["float_ops"]
        if floats:
            lines.append(f"- {name} ops left in float: " + ", ".join(sorted({o['op'] for o in floats})))
    return lines


def card(entry: Entry, build_dir: Path) -> None:
    data = build_card(entry, build_dir)
    with atomic_path(build_dir / "card.md") as tmp:
        tmp.write_text(render_markdown(data))
    write_json(build_dir / "card.json", data)
