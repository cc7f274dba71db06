"""Smoke variants of zoo entries: the same graph structure at a size that builds in about a minute.

Every entry declares its `smoke` section (config overrides that shrink the model, and small input shapes).
CI builds the smoke variant of every entry that a change touches, so that a JSON-only pull request is
checked end to end (export, simplify, convert, validate, card) within CI's limit. Smoke builds measure
graphs, not accuracy: they always use random weights.

    python -m tools.smoke [--base GIT_REF] [ID ...]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.entry import ROOT, SCHEMA_PATH, ZOO_DIR, EntryError, discover

SMOKE_SAMPLES = 2


def smoke_entry_data(data: dict, new_id: str) -> dict:
    """The entry shrunk by its own `smoke` section, under a new id; its weights section is left as declared."""
    out = copy.deepcopy(data)
    out["id"] = new_id
    out["$schema"] = str(SCHEMA_PATH)
    smoke = out["smoke"]
    out["source"].setdefault("config", {}).update(smoke.get("config", {}))
    for spec, shape in zip(out["inputs"], smoke["input_shapes"]):
        spec["shape"] = list(shape)
    # the sweep keeps the declared sizes no larger than the smoke input: a tiny model at 800x800 tests nothing more
    built = out["inputs"][0]["shape"][-2:]
    out["bench"]["input_sizes"] = [s for s in out["bench"]["input_sizes"] if s[0] <= built[0] and s[1] <= built[1]] or [built]
    for key in ("samples", "sentences"):
        if key in out["validation"]:
            out["validation"][key] = out["validation"][key][:SMOKE_SAMPLES]
    # a variant's keep_float tensors name ops of the full-size graph, which a shrunk graph does not have; its
    # op types apply at any size and stay
    for variant in out.get("quantization", {}).get("variants", []):
        keep = variant.get("keep_float", {})
        keep.pop("tensors", None)
        if not keep:
            variant.pop("keep_float", None)
    return out


def with_random_weights(data: dict, folder: Path) -> dict:
    """Point the weights at a file that does not exist, so that the opt-in ZOO_WEIGHTS=random takes over."""
    data = copy.deepcopy(data)
    data["weights"] = {"kind": "local", "path": str(folder / "no-weights-in-a-smoke-build"),
                       "format": data["weights"]["format"], "sha256": None,
                       "unpinned_reason": "smoke build: random weights by design",
                       **{k: data["weights"][k] for k in ("key_map",) if k in data["weights"]}}
    return data


def changed_entry_ids(base: str, root: Path = ROOT) -> list[str]:
    """Ids of the zoo entries that differ from `base`; every entry if code under tools/ or schema/ changed."""
    diff = subprocess.run(["git", "-C", str(root), "diff", "--name-only", f"{base}...HEAD", "--", "zoo", "tools", "schema"],
                          capture_output=True, text=True)
    if diff.returncode != 0:
        raise SystemExit(f"error: git diff against {base!r} failed: {diff.stderr.strip()}")
    paths = diff.stdout.split()
    if any(not p.startswith("zoo/") for p in paths):
        return sorted(p.stem for p in (root / "zoo").glob("*.json"))
    return sorted(Path(p).stem for p in paths if p.endswith(".json") and (root / p).exists())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="entries to smoke-build (default: all, or those changed since --base)")
    parser.add_argument("--base", help="git ref to diff against: smoke-build only the entries a change touches")
    parser.add_argument("--zoo", default=str(ZOO_DIR), help="zoo folder (default: zoo/)")
    args = parser.parse_args(argv)
    entries, bad = discover(args.zoo)
    for error in bad:
        print(f"error: {error}", file=sys.stderr)
    if bad:
        return 1
    wanted = args.ids or (changed_entry_ids(args.base) if args.base else [e.id for e in entries])
    by_id = {e.id: e for e in entries}
    unknown = sorted(set(wanted) - set(by_id))
    if unknown:
        print(f"error: no zoo entries {unknown}; entries: {sorted(by_id)}", file=sys.stderr)
        return 1
    if not wanted:
        print("smoke: no zoo entry changed")
        return 0
    with tempfile.TemporaryDirectory(prefix="zoo-smoke-") as tmp:
        tmp = Path(tmp)
        for entry_id in wanted:
            data = with_random_weights(smoke_entry_data(by_id[entry_id].data, f"{entry_id}_smoke"), tmp)
            (tmp / "zoo").mkdir(exist_ok=True)
            (tmp / "zoo" / f"{entry_id}_smoke.json").write_text(json.dumps(data, indent=2))
        env = {**os.environ, "ZOO_DIR": str(tmp / "zoo"), "ZOO_BUILD": str(tmp / "build"), "ZOO_WEIGHTS": "random"}
        print(f"smoke: building {', '.join(wanted)}", flush=True)
        code = subprocess.run([sys.executable, "-m", "doit", "run", "-f", str(ROOT / "dodo.py"),
                               "--db-file", str(tmp / "doit.db"), "build"], cwd=ROOT, env=env).returncode
        if code != 0:
            print(f"smoke: FAILED (doit exit {code}); the error above names the entry and the stage", file=sys.stderr)
            return code
        for entry_id in wanted:
            card = json.loads((tmp / "build" / f"{entry_id}_smoke" / "card.json").read_text())
            graphs = list(card.get("graphs", {"model": card}).values())  # a split entry validates each graph
            worst = max(o["max_abs"] for g in graphs for s in g["validation"]["stages"].values() for o in s["outputs"].values())
            print(f"smoke: {entry_id}_smoke passed validation (worst max abs {worst:.2g}, "
                  f"{sum(g['conversion']['op_count'] for g in graphs)} TFLite ops in {len(graphs)} graph(s))")
        return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except EntryError as exc:
        sys.exit(f"error: {exc}")
