#!/usr/bin/env python3
"""Download a prebuilt zoo model listed in dist/index.json, verified, with nothing but Python's standard library.

    python3 tools/fetch.py whisper_tiny_en --variant int8 -o models/

Each file is written to a hidden `.NAME.part` beside its final place, checked for size and sha256, and
only then renamed: what appears under the final name is always the verified file. Downloads are retried
with exponential backoff and resume where they stopped (HTTP Range). Only https:// and file:// URLs are
used (plain http:// only with --allow-http, for a mirror on the local network). Names read from the index
are checked: none may leave the output folder. Runs on Python 3.9 and newer; needs neither torch nor
TensorFlow.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

DEFAULT_INDEX = Path(__file__).resolve().parent.parent / "dist" / "index.json"
ID_PATTERN = re.compile(r"^[a-z][a-z0-9_]{1,63}$")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
BLOCK = 1 << 20


class FetchError(Exception):
    """A failure the user can act on; the message names the file and what was expected."""


class Retryable(FetchError):
    """A network failure or a short read: trying again (and resuming) may succeed."""


def _index_url(index: str) -> str:
    parsed = urllib.parse.urlparse(index)
    if parsed.scheme in ("https", "http", "file"):
        return index
    return Path(index).resolve().as_uri()


def load_index(index: str, context: ssl.SSLContext, allow_http: bool) -> tuple[dict, str]:
    """The parsed index and the URL it was read from (relative file URLs are resolved against it)."""
    url = _index_url(index)
    _check_scheme(url, allow_http)
    try:
        with _open(url, context, timeout=30) as response:
            data = json.loads(response.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise FetchError(f"cannot read the index {url}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise FetchError(f"{url} is not a zoo index: it has no 'entries' object")
    return data, url


def _check_scheme(url: str, allow_http: bool) -> None:
    scheme = urllib.parse.urlparse(url).scheme
    if scheme == "http" and not allow_http:
        raise FetchError(f"refusing plain http for {url}: use https, or --allow-http for a mirror on your own network")
    if scheme not in ("https", "file", "http"):
        raise FetchError(f"refusing {url}: only https:// and file:// URLs are fetched")


def _open(url: str, context: ssl.SSLContext, timeout: float, headers: dict | None = None):
    request = urllib.request.Request(url, headers={"User-Agent": "imx8mp-zoo-fetch/1", **(headers or {})})
    if urllib.parse.urlparse(url).scheme == "https":
        return urllib.request.urlopen(request, timeout=timeout, context=context)
    return urllib.request.urlopen(request, timeout=timeout)


def safe_target(out_dir: Path, entry_id: str, name: str) -> Path:
    """out_dir/entry_id/name, refusing any name that could land outside out_dir. A name is a plain file name, or
    a graph's folder and a file name ('encoder/model_fp32.tflite', for a model that runs as several graphs)."""
    if not ID_PATTERN.match(entry_id):
        raise FetchError(f"refusing entry id {entry_id!r}: ids are lower-case letters, digits and '_'")
    parts = name.split("/")
    if len(parts) > 2 or not all(NAME_PATTERN.match(part) for part in parts):
        raise FetchError(f"refusing file name {name!r} from the index: a name is a plain file name, or one plain "
                         "folder and a file name (no '\\', '..', leading '.' or deeper paths)")
    root = out_dir.resolve()
    folder = out_dir / entry_id
    for path in (folder, folder / parts[0], folder / name):
        if path.is_symlink():
            raise FetchError(f"refusing to write through the symbolic link {path}")
    target = (folder / name).resolve()
    if root not in target.parents:
        raise FetchError(f"refusing {name!r}: it resolves to {target}, outside {root}")
    return folder / name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


class Progress:
    """A one-line progress display, shown only when stderr is a terminal."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.shown = name, total, 0.0
        self.enabled = sys.stderr.isatty()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if self.enabled and (now - self.shown > 0.2 or done >= self.total):
            self.shown = now
            pct = 100.0 * done / self.total if self.total else 100.0
            sys.stderr.write(f"\r{self.name}: {done / 1e6:8.1f} / {self.total / 1e6:.1f} MB ({pct:5.1f}%)")
            if done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _download_once(url: str, part: Path, size: int, context: ssl.SSLContext, progress: Progress, timeout: float) -> None:
    """Append the missing bytes of `url` to `part` (resuming with a Range request when part has some)."""
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    if have == size:
        return
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        with _open(url, context, timeout, headers) as response:
            status = getattr(response, "status", 200)
            if have and status != 206:  # the server ignored the range: start over
                have = 0
            with open(part, "ab" if have else "wb") as handle:
                done = have
                for block in iter(lambda: response.read(BLOCK), b""):
                    handle.write(block)
                    done += len(block)
                    if done > size:
                        break
                    progress.update(done)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and part.exists():  # asked beyond the end: what we have is all there is
            return
        if 400 <= exc.code < 500:
            raise FetchError(f"{url}: HTTP {exc.code} {exc.reason}") from None
        raise Retryable(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLCertVerificationError):  # retrying cannot make the certificate valid
            raise FetchError(f"{url}: {reason} (use --cafile for a mirror with its own certificate)") from None
        raise Retryable(f"{url}: {reason}") from None


def fetch_file(record: dict, target: Path, index_url: str, context: ssl.SSLContext, allow_http: bool = False,
               retries: int = 4, backoff: float = 1.0, timeout: float = 60.0) -> str:
    """Download one index record to `target`, verified; return 'downloaded' or 'already present'."""
    name, size, sha = record["name"], int(record["bytes"]), record["sha256"]
    if target.is_file() and target.stat().st_size == size and sha256_file(target) == sha:
        return "already present"
    urls = [urllib.parse.urljoin(index_url, u) for u in record["urls"]]
    for url in urls:
        _check_scheme(url, allow_http)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.part")
    progress = Progress(name, size)
    errors: list[str] = []
    for url in urls:
        for attempt in range(retries + 1):
            try:
                _download_once(url, part, size, context, progress, timeout)
            except Retryable as exc:
                errors.append(str(exc))
                if attempt < retries:
                    time.sleep(backoff * 2 ** attempt)
                continue
            except FetchError as exc:
                errors.append(str(exc))
                break
            got = part.stat().st_size if part.exists() else 0
            if got < size and attempt < retries:  # the connection ended early: resume
                errors.append(f"{url}: connection ended at {got} of {size} bytes")
                time.sleep(backoff * 2 ** attempt)
                continue
            if got != size:
                part.unlink(missing_ok=True)
                errors.append(f"size mismatch for {name} from {url}: expected {size} bytes, got {got}")
                break
            actual = sha256_file(part)
            if actual != sha:
                part.unlink()
                errors.append(f"sha256 mismatch for {name} from {url}: expected {sha}, got {actual}")
                break
            os.replace(part, target)
            return "downloaded"
    kept = f"; the partial download is kept at {part} and resumes on the next run" if part.exists() else ""
    raise FetchError(f"could not fetch {name}: " + "; ".join(errors[-3:]) + kept)


def files_for(index: dict, entry_id: str, variant: str | None) -> tuple[str, list[dict]]:
    entries = index["entries"]
    if entry_id not in entries:
        raise FetchError(f"no entry {entry_id!r} in the index; it has {sorted(entries)}")
    entry = entries[entry_id]
    variant = variant or entry.get("default_variant")
    variants = entry.get("variants", {})
    if variant not in variants:
        raise FetchError(f"entry {entry_id!r} has no variant {variant!r}; it has {sorted(variants)}")
    return variant, list(variants[variant]["files"]) + list(entry.get("documents", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fetch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("id", help="zoo entry id, e.g. whisper_tiny_en")
    parser.add_argument("--variant", help="variant to fetch (default: the entry's default_variant)")
    parser.add_argument("-o", "--output", default="models", help="output folder; files land in OUTPUT/ID/ (default: models)")
    parser.add_argument("--index", default=os.environ.get("ZOO_INDEX", str(DEFAULT_INDEX)),
                        help="index file or URL (default: $ZOO_INDEX or this checkout's dist/index.json)")
    parser.add_argument("--cafile", help="extra CA certificate bundle to trust (e.g. a local mirror's)")
    parser.add_argument("--allow-http", action="store_true", help="allow plain http:// (a mirror on your own network)")
    parser.add_argument("--retries", type=int, default=4, help="retries per URL, with exponential backoff (default: 4)")
    parser.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds (default: 1)")
    args = parser.parse_args(argv)
    context = ssl.create_default_context(cafile=args.cafile)
    try:
        index, index_url = load_index(args.index, context, args.allow_http)
        variant, records = files_for(index, args.id, args.variant)
        out = Path(args.output)
        for record in records:
            target = safe_target(out, args.id, str(record.get("name", "")))
            state = fetch_file(record, target, index_url, context, args.allow_http, args.retries, args.backoff)
            print(f"{target}  {record['bytes']} bytes  sha256 {record['sha256']}  ({state})")
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (KeyError, TypeError, ValueError) as exc:  # a record without name, bytes, sha256 or urls
        print(f"error: malformed record for {args.id!r} in the index {args.index}: {type(exc).__name__} {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: partial downloads are kept as .NAME.part and resume on the next run", file=sys.stderr)
        return 130
    print(f"{args.id} ({variant}): {len(records)} files verified in {Path(args.output) / args.id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
