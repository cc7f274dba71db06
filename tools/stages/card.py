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
from tools.provenance import provenance
from tools.stages import int8_enabled, variant_files
from tools.weights import sha256_of

CARD_SCHEMA = ROOT / "schema" / "card.schema.json"
ARTIFACTS = ("model.onnx", "model_sim.onnx", "model_fp32.tflite")
RANDOM_WARNING = "RANDOM WEIGHTS: built without the trained checkpoint; outputs are meaningless and this build is never published."


def _records(build_dir: Path, names: tuple) -> dict:
    return {name: json.loads((build_dir / f"{name}.json").read_text()) for name in names}


def build_card(entry: Entry, build_dir: Path) -> dict:
    stages = ("export", "simplify", "convert", "validation") + (("quantize", "fidelity") if int8_enabled(entry) else ()) + ("npu",)
    rec = _records(build_dir, stages)
    tools: dict[str, str] = {}
    for name in stages:
        tools.update(rec[name]["tools"])
    weights = rec["export"]["weights"]
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
        "artifacts": [{"path": name, "sha256": sha256_of(build_dir / name), "bytes": (build_dir / name).stat().st_size}
                      for name in ARTIFACTS + tuple(variant_files(entry))],
        "export": {k: rec["export"][k] for k in ("opset", "exporter", "patches", "inputs", "outputs", "onnx_nodes", "parameters")},
        "conversion": {k: rec["convert"][k] for k in ("converter", "flags", "ops", "op_count")},
        "validation": {k: rec["validation"][k] for k in ("passed", "samples", "stages")},
        "stages": {name: {"wall_s": rec[name]["wall_s"], "peak_rss_mib": rec[name]["peak_rss_mib"]}
                   for name in stages},
        "tools": tools,
        "provenance": provenance(entry),
        "warnings": [RANDOM_WARNING] if weights["kind"] == "random" else [],
    }
    card["npu"] = {k: rec["npu"][k] for k in ("rules_source", "default_bsp", "graphs")}
    if int8_enabled(entry):
        card["quantization"] = {k: rec["quantize"][k] for k in ("quantizer", "activations", "calibration", "keep_float", "variants")}
        card["fidelity"] = {k: rec["fidelity"][k] for k in ("passed", "samples", "thresholds", "variants", "known_failure")
                            if k in rec["fidelity"]}
    jsonschema.Draft202012Validator(json.loads(CARD_SCHEMA.read_text())).validate(card)
    return card


def render_markdown(card: dict) -> str:
    w = card["weights"]
    lines = [f"# {card['title']} (`{card['id']}`)", ""]
    lines += [f"> **{msg}**" for msg in card["warnings"]] + ([""] if card["warnings"] else [])
    lines += [f"Task: {card['task']}. Built {card['generated']} on {card['host']['hostname']} "
              f"({card['host']['machine']}, {card['host']['cpu_count']} cores).", ""]
    src = card["source"]
    lines += ["## Source and weights", "",
              f"- Source: {src['kind']} `{src.get('class') or src.get('model')}`; config overrides: "
              f"`{json.dumps(src.get('config', {}), sort_keys=True)}`",
              f"- Weights: **{w['kind']}**; declared: {w['declared']['kind']} "
              f"{w['declared'].get('url') or w['declared'].get('repo') or w['declared'].get('path') or w['declared'].get('package')}",
              f"- sha256 declared: `{w['sha256_declared'] or 'unpinned: ' + w['declared'].get('unpinned_reason', '')}`",
              f"- sha256 loaded: `{w.get('sha256_loaded', 'none (random weights)')}`",
              f"- License: code {card['license']['code']}, weights {card['license']['weights']}"
              + ("" if card["license"].get("weights_commercial_use", True) else " (**non-commercial weights**)"), ""]
    exp = card["export"]
    lines += ["## Export", "", f"- ONNX opset {exp['opset']}, {exp['exporter']}; {exp['onnx_nodes']} nodes; "
              f"{exp['parameters']:,} parameters",
              f"- Inputs: " + ", ".join(f"`{k}` {v}" for k, v in exp["inputs"].items()),
              f"- Outputs: " + ", ".join(f"`{k}` {v}" for k, v in exp["outputs"].items()),
              "- Export patches: " + (", ".join(f"`{p['name']}` ({p['summary']})" for p in exp["patches"]) or "none"), ""]
    conv = card["conversion"]
    top = sorted(conv["ops"].items(), key=lambda kv: -kv[1])[:12]
    lines += ["## TFLite fp32 graph", "", f"- {conv['converter']}, {conv['op_count']} ops: "
              + ", ".join(f"{k} {v}" for k, v in top), ""]
    val = card["validation"]
    lines += ["## Validation against torch", "",
              f"Real inputs: {', '.join(val['samples'])}. Overall: **{'passed' if val['passed'] else 'FAILED'}**.", "",
              "| stage | output | max abs | max rel | atol | rtol | passed |", "|---|---|---|---|---|---|---|"]
    for stage, res in val["stages"].items():
        for name, o in res["outputs"].items():
            lines.append(f"| {stage} | {name} | {o['max_abs']:.3g} | {o['max_rel']:.3g} | {res['tolerance']['atol']:g} "
                         f"| {res['tolerance']['rtol']:g} | {'yes' if o['passed'] else 'NO'} |")
    if "quantization" in card:
        lines += _int8_markdown(card["quantization"], card["fidelity"])
    lines += _npu_markdown(card["npu"])
    lines += ["", "## Artifacts", "", "| file | bytes | sha256 |", "|---|---|---|"]
    lines += [f"| {a['path']} | {a['bytes']:,} | `{a['sha256']}` |" for a in card["artifacts"]]
    lines += ["", "## Build (measured in this build, on the host above)", "", "| stage | wall s | peak RSS MiB |", "|---|---|---|"]
    lines += [f"| {k} | {v['wall_s']} | {v['peak_rss_mib']} |" for k, v in card["stages"].items()]
    lines += ["", "## Tool versions", "", ", ".join(f"{k} {v}" for k, v in sorted(card["tools"].items())), ""]
    prov = card["provenance"]
    commit = prov["git_commit"] or "not in a git checkout"
    lines += ["## Provenance", "", f"- git commit: `{commit}`" + (" (with uncommitted changes)" if prov["git_dirty"] else ""),
              "- sources (sha256): " + ", ".join(f"`{p}` {d[:12]}" for p, d in prov["sources"].items()), ""]
    return "\n".join(lines)


def _npu_markdown(npu: dict) -> list[str]:
    lines = ["", "## NPU placement (VX delegate rules, static analysis: not measured on a board)", "",
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
    return lines


def _int8_markdown(quant: dict, fid: dict) -> list[str]:
    cal = quant["calibration"]
    lines = ["", "## INT8 (full-integer, int8 activations) against fp32 TFLite", "",
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
                         f"| {output} | {o['sqnr_db_min']} | {o['cosine_min']} | {'yes' if f['passed'] else 'NO'} |")
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
