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
from tools.weights import sha256_of

CARD_SCHEMA = ROOT / "schema" / "card.schema.json"
ARTIFACTS = ("model.onnx", "model_sim.onnx", "model_fp32.tflite")
RANDOM_WARNING = "RANDOM WEIGHTS: built without the trained checkpoint; outputs are meaningless and this build is never published."


def _records(build_dir: Path) -> dict:
    return {name: json.loads((build_dir / f"{name}.json").read_text())
            for name in ("export", "simplify", "convert", "validation")}


def build_card(entry: Entry, build_dir: Path) -> dict:
    rec = _records(build_dir)
    tools: dict[str, str] = {}
    for name in ("export", "simplify", "convert", "validation"):
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
                      for name in ARTIFACTS],
        "export": {k: rec["export"][k] for k in ("opset", "exporter", "patches", "inputs", "outputs", "onnx_nodes", "parameters")},
        "conversion": {k: rec["convert"][k] for k in ("converter", "flags", "ops", "op_count")},
        "validation": {k: rec["validation"][k] for k in ("passed", "samples", "stages")},
        "stages": {name: {"wall_s": rec[name]["wall_s"], "peak_rss_mib": rec[name]["peak_rss_mib"]}
                   for name in ("export", "simplify", "convert", "validation")},
        "tools": tools,
        "provenance": provenance(entry),
        "warnings": [RANDOM_WARNING] if weights["kind"] == "random" else [],
    }
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


def card(entry: Entry, build_dir: Path) -> None:
    data = build_card(entry, build_dir)
    with atomic_path(build_dir / "card.md") as tmp:
        tmp.write_text(render_markdown(data))
    write_json(build_dir / "card.json", data)
