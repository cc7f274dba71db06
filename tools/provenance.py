"""What a build was made from: the entry file, the code of every stage, and the git commit.

The card records it; publish recomputes it and refuses a build whose sources have changed since.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from tools.entry import ROOT, Entry
from tools.weights import sha256_of


def _display(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def source_digests(entry: Entry) -> dict[str, str]:
    """sha256 of the entry file and of every module a stage runs, by path."""
    from tools.stages import STAGES

    files = {str(entry.path): entry.path} | {f: ROOT / f for stage in STAGES.values() for f in stage.code_files()}
    return {_display(path): sha256_of(path) for path in sorted(files.values(), key=_display)}


def changed_sources(recorded: dict[str, str], entry: Entry) -> list[str]:
    """Paths whose content differs from the recorded digests (or that appeared or vanished)."""
    now = source_digests(entry)
    return sorted(p for p in set(recorded) | set(now) if recorded.get(p) != now.get(p))


def git_state() -> dict:
    """The commit checked out at the root, and whether tracked files differ from it; nulls outside git."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return {"git_commit": None, "git_dirty": None}
    if head.returncode != 0:
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


def provenance(entry: Entry) -> dict:
    return {"sources": source_digests(entry), **git_state()}
