"""publish: copy a built and checked entry into dist/<id>/ and list it in dist/index.json.

    python -m tools.publish ID [--build BUILD_DIR] [--dist DIST_DIR]

Refuses a build from random weights, one whose validation (or INT8 fidelity) failed, one whose artifacts
changed after the card was written, and one whose sources (entry file, stage code) changed since it was
built. The index entry is made only from the card and the files, so the same build always gives the same
bytes. Files over GIT_SIZE_LIMIT are listed in dist/<id>/.gitignore: they are served from the mirrors in
dist/mirrors.json (release assets, a model hub), never committed to git history.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import jsonschema

from tools.atomic import atomic_path, write_json
from tools.entry import ROOT, EntryError, load_entry
from tools.provenance import changed_sources
from tools.weights import sha256_of

GIT_SIZE_LIMIT = 16 * 1024 * 1024
INDEX_SCHEMA = ROOT / "schema" / "dist-index.schema.json"
# What a speech entry's runtime reads besides its graphs (tools/transcribe.py): shapes and decoding settings,
# and the tokenizer (Whisper) or the CTC labels. Published with every variant.
SPEECH_RUNTIME = ("export.json", "tokenizer.json", "labels.json")


def _variant_files(card: dict) -> dict:
    """Variant name -> the build files it is made of, INT8 variants first: the first is the index's default (the
    NPU runs INT8 only). A trial INT8 variant is never published, nor one that lost words (a speech entry whose
    INT8 failure is declared known still builds). A split entry's variant is one file per graph (an INT8
    variant runs its fp32 .tflite for the graphs it leaves float)."""
    speech = card.get("speech", {}).get("backends", {})
    if "graphs" in card:
        built = {a["path"] for a in card["artifacts"]}
        int8 = [name for name, b in speech.items() if b.get("passed") is True and not b.get("trial")]
        files = {name: [f"{g}/model_{name}.tflite" if f"{g}/model_{name}.tflite" in built else f"{g}/model_fp32.tflite"
                        for g in card["graphs"]] for name in int8}
        return {**files, "fp32": [f"{g}/model_fp32.tflite" for g in card["graphs"]], "onnx": [f"{g}/model.onnx" for g in card["graphs"]]}
    trials = {name for name, v in card.get("fidelity", {}).get("variants", {}).items() if v.get("trial")}
    int8 = {name: [v["file"]] for name, v in card.get("quantization", {}).get("variants", {}).items()
            if name not in trials and speech.get(name, {}).get("passed") is not False}
    return {**int8, "fp32": ["model_fp32.tflite"], "onnx": ["model.onnx"]}


def _runtime_files(card: dict, build_dir: Path) -> list[str]:
    return [name for name in SPEECH_RUNTIME if "speech" in card and (build_dir / name).is_file()]


class PublishError(RuntimeError):
    pass


def _refusals(card: dict, entry, build_dir: Path) -> list[str]:
    problems = []
    if card["weights"]["kind"] != "trained":
        problems.append("it was built from random weights (card.json weights.kind = "
                        f"{card['weights']['kind']!r}); random-weight builds are never published")
    for where, section in card.get("graphs", {"": card}).items():
        prefix = f"graphs.{where}." if where else ""
        if not section["validation"]["passed"]:
            problems.append(f"its validation failed (card.json {prefix}validation.passed = false)")
        if section.get("fidelity", {}).get("passed") is False:
            problems.append(f"its INT8 fidelity gate failed (card.json {prefix}fidelity.passed = false)")
    if card.get("speech", {}).get("passed") is False:
        problems.append("its transcripts disagree with torch's or an INT8 variant lost words (card.json speech.passed = false)")
    for artifact in card["artifacts"]:
        path = build_dir / artifact["path"]
        if not path.is_file() or sha256_of(path) != artifact["sha256"]:
            problems.append(f"{path} is missing or differs from the card's sha256 {artifact['sha256']}")
    changed = changed_sources(card["provenance"]["sources"], entry)
    if changed:
        problems.append(f"its sources changed since it was built: {', '.join(changed)}; rebuild with doit build:{entry.id}")
    return problems


def _mirror_urls(dist_dir: Path, entry_id: str, name: str, sha256: str) -> list[str]:
    """The file's place beside the index first (relative), then each mirror template from dist/mirrors.json."""
    mirrors = dist_dir / "mirrors.json"
    templates = json.loads(mirrors.read_text())["url_templates"] if mirrors.exists() else []
    return [f"{entry_id}/{name}"] + [t.format(id=entry_id, name=name, sha256=sha256) for t in templates]


def _file_record(dist_dir: Path, entry_id: str, name: str) -> dict:
    """A published file, by its name in dist/<id>/ ('model_fp32.tflite', or 'encoder/model_fp32.tflite' for a
    graph of a split entry)."""
    path = dist_dir / entry_id / name
    sha = sha256_of(path)
    return {"name": name, "bytes": path.stat().st_size, "sha256": sha, "urls": _mirror_urls(dist_dir, entry_id, name, sha)}


def _copy(src: Path, dst: Path) -> None:
    if dst.is_file() and sha256_of(dst) == sha256_of(src):
        return
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def _plots(card: dict) -> list[str]:
    """The figures card.md shows (the bench stage's latency plot)."""
    return [card["host_latency"]["plot"]] if "host_latency" in card else []


def index_entry(card: dict, dist_dir: Path, runtime: list[str]) -> dict:
    entry_id = card["id"]
    built = {a["path"] for a in card["artifacts"]}
    variants = {v: {"files": [_file_record(dist_dir, entry_id, f) for f in [*files, *runtime]]}
                for v, files in _variant_files(card).items() if set(files) <= built}
    documents = [_file_record(dist_dir, entry_id, n) for n in ("card.md", "card.json", *_plots(card), "provenance.json")]
    weights = card["weights"]
    return {
        "title": card["title"],
        "task": card["task"],
        "license": card["license"],
        "non_commercial_weights": not card["license"].get("weights_commercial_use", True),
        "weights": {"kind": weights["kind"], "declared": weights["declared"], "sha256_loaded": weights["sha256_loaded"]},
        "tools": card["tools"],
        "git_commit": card["provenance"]["git_commit"],
        "built": card["generated"],
        "default_variant": next(iter(variants)),
        "variants": variants,
        "documents": documents,
    }


def read_index(dist_dir: Path) -> dict:
    path = dist_dir / "index.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"$schema": "../schema/dist-index.schema.json", "index_version": 1, "entries": {}}


def publish(entry_id: str, build_root: Path, dist_dir: Path, zoo_dir: Path) -> dict:
    """Copy the build of `entry_id` into dist_dir and update the index; return its index entry."""
    entry = load_entry(zoo_dir / f"{entry_id}.json")
    build_dir = build_root / entry_id
    card_path = build_dir / "card.json"
    if not card_path.exists():
        raise PublishError(f"refusing to publish {entry_id}: no {card_path}; run doit build:{entry_id} first")
    card = json.loads(card_path.read_text())
    problems = _refusals(card, entry, build_dir)
    if problems:
        raise PublishError(f"refusing to publish {entry_id}: " + "; ".join(problems))
    folder = dist_dir / entry_id
    built = {a["path"] for a in card["artifacts"]}
    runtime = _runtime_files(card, build_dir)
    graph_files = {f for files in _variant_files(card).values() if set(files) <= built for f in files}
    for name in sorted(graph_files) + runtime + ["card.md", "card.json", *_plots(card)]:
        _copy(build_dir / name, folder / name)
    write_json(folder / "provenance.json", {
        "id": entry_id, "built": card["generated"], "host": card["host"], "weights": card["weights"],
        "source": card["source"], "export": card.get("export") or {g: s["export"] for g, s in card["graphs"].items()},
        "tools": card["tools"], "provenance": card["provenance"]})
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and not p.name.startswith(".") and p.name != "SHA256SUMS")
    with atomic_path(folder / "SHA256SUMS") as tmp:
        tmp.write_text("".join(f"{sha256_of(folder / name)}  {name}\n" for name in files))
    big = [name for name in files if (folder / name).stat().st_size > GIT_SIZE_LIMIT]
    ignore = folder / ".gitignore"
    if big:
        with atomic_path(ignore) as tmp:
            tmp.write_text(f"# over {GIT_SIZE_LIMIT // 2**20} MiB: served from the mirrors, not git\n" + "".join(f"{n}\n" for n in big))
    elif ignore.exists():
        ignore.unlink()
    index = read_index(dist_dir)
    index["entries"][entry_id] = index_entry(card, dist_dir, runtime)
    index["entries"] = dict(sorted(index["entries"].items()))
    jsonschema.Draft202012Validator(json.loads(INDEX_SCHEMA.read_text())).validate(index)
    write_json(dist_dir / "index.json", index)
    return index["entries"][entry_id]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.publish", description=__doc__.split("\n\n")[0])
    parser.add_argument("id")
    parser.add_argument("--build", default=os.environ.get("ZOO_BUILD", "build"), help="build folder (default: build)")
    parser.add_argument("--dist", default=os.environ.get("ZOO_DIST", str(ROOT / "dist")), help="dist folder (default: dist)")
    parser.add_argument("--zoo", default=os.environ.get("ZOO_DIR", str(ROOT / "zoo")), help="zoo folder (default: zoo)")
    args = parser.parse_args(argv)
    try:
        record = publish(args.id, Path(args.build), Path(args.dist), Path(args.zoo))
    except (PublishError, EntryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    files = [f for v in record["variants"].values() for f in v["files"]]
    print(f"published {args.id}: variants {sorted(record['variants'])}, {sum(f['bytes'] for f in files):,} bytes "
          f"-> {Path(args.dist) / args.id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
