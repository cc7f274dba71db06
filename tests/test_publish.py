"""publish copies checked builds into dist/ deterministically, refuses unfit ones, and fetch gets them back."""
from __future__ import annotations

import hashlib
import json
import shutil

import jsonschema
import pytest

from conftest import ROOT
from https_mirror import HttpsMirror
from tools import fetch, publish
from tools.publish import PublishError


@pytest.fixture
def dist(tmp_path):
    folder = tmp_path / "dist"
    folder.mkdir()
    return folder


def _publish(built, dist, entry_id="dn_tiny", build=None):
    _, parallel, _ = built
    return publish.publish(entry_id, build or parallel.build, dist, parallel.zoo)


def test_published_entry_is_listed_with_checksums_and_passes_the_schema(built, dist):
    _, parallel, _ = built
    record = _publish(built, dist)
    index = json.loads((dist / "index.json").read_text())
    jsonschema.validate(index, json.loads((ROOT / "schema" / "dist-index.schema.json").read_text()))
    assert index["entries"]["dn_tiny"] == record
    assert list(record["variants"]) == ["int8_pt", "int8_pc", "fp32", "onnx"]
    assert record["default_variant"] == "int8_pt"  # the NPU runs INT8 graphs only
    tflite = record["variants"]["fp32"]["files"][0]
    built_file = parallel.build / "dn_tiny" / "model_fp32.tflite"
    assert tflite["sha256"] == hashlib.sha256(built_file.read_bytes()).hexdigest()
    assert (dist / "dn_tiny" / "model_fp32.tflite").read_bytes() == built_file.read_bytes()
    assert tflite["urls"] == ["dn_tiny/model_fp32.tflite"]
    sums = dict(reversed(line.split("  ")) for line in (dist / "dn_tiny" / "SHA256SUMS").read_text().splitlines())
    for name, digest in sums.items():
        assert hashlib.sha256((dist / "dn_tiny" / name).read_bytes()).hexdigest() == digest
    assert {"model_int8_pt.tflite", "model_int8_pc.tflite", "model_fp32.tflite", "model.onnx", "card.md", "card.json",
            "provenance.json"} <= set(sums)
    provenance = json.loads((dist / "dn_tiny" / "provenance.json").read_text())
    assert provenance["weights"]["kind"] == "trained" and provenance["provenance"]["sources"]
    assert record["weights"]["sha256_loaded"] == provenance["weights"]["sha256_loaded"]
    assert not (dist / "dn_tiny" / ".gitignore").exists()  # tiny files: small enough for git


def test_publishing_twice_gives_the_same_bytes(built, dist):
    _publish(built, dist)
    first = {p.relative_to(dist): p.read_bytes() for p in dist.rglob("*") if p.is_file()}
    _publish(built, dist)
    again = {p.relative_to(dist): p.read_bytes() for p in dist.rglob("*") if p.is_file()}
    assert first == again


def test_random_weights_are_never_published(built, dist):
    with pytest.raises(PublishError, match="built from random weights"):
        _publish(built, dist, "dd_tiny")
    assert not (dist / "dd_tiny").exists() and not (dist / "index.json").exists()


def test_changed_sources_are_refused(built, dist):
    _, parallel, _ = built
    path = parallel.zoo / "dn_tiny.json"
    original = path.read_text()
    data = json.loads(original)
    data["notes"] = "edited after the build"
    path.write_text(json.dumps(data, indent=2))
    try:
        with pytest.raises(PublishError, match=r"sources changed since it was built: .*dn_tiny\.json"):
            _publish(built, dist)
    finally:
        path.write_text(original)
    assert not (dist / "index.json").exists()


def _copy_build(built, tmp_path):
    _, parallel, _ = built
    copy = tmp_path / "build"
    shutil.copytree(parallel.build / "dn_tiny", copy / "dn_tiny")
    return copy


def test_artifact_changed_after_the_card_is_refused(built, dist, tmp_path):
    build = _copy_build(built, tmp_path)
    tflite = build / "dn_tiny" / "model_fp32.tflite"
    data = bytearray(tflite.read_bytes())
    data[-10] ^= 1
    tflite.write_bytes(bytes(data))
    with pytest.raises(PublishError, match="model_fp32.tflite is missing or differs from the card's sha256"):
        _publish(built, dist, build=build)


@pytest.mark.parametrize("section,message", [("validation", "its validation failed"),
                                             ("fidelity", "its INT8 fidelity gate failed")])
def test_failed_checks_are_refused(built, dist, tmp_path, section, message):
    build = _copy_build(built, tmp_path)
    card_path = build / "dn_tiny" / "card.json"
    card = json.loads(card_path.read_text())
    card.setdefault(section, {})["passed"] = False
    card_path.write_text(json.dumps(card))
    with pytest.raises(PublishError, match=message):
        _publish(built, dist, build=build)


def test_files_over_the_git_limit_are_kept_out_of_git(built, dist, monkeypatch):
    _, parallel, _ = built
    build = parallel.build / "dn_tiny"
    limit = min((build / name).stat().st_size for name in ("model_fp32.tflite", "model.onnx")) - 1  # the graphs, not the cards
    assert (build / "card.md").stat().st_size <= limit
    monkeypatch.setattr(publish, "GIT_SIZE_LIMIT", limit)
    _publish(built, dist)
    ignored = (dist / "dn_tiny" / ".gitignore").read_text().splitlines()
    assert "model_fp32.tflite" in ignored and "model.onnx" in ignored and "card.md" not in ignored


def test_published_model_is_fetched_back_from_an_https_mirror(built, dist, tmp_path):
    served = tmp_path / "served"
    with HttpsMirror(served, tmp_path) as mirror:
        (dist / "mirrors.json").write_text(json.dumps({"url_templates": [mirror.url + "/{id}/{name}"]}))
        record = _publish(built, dist)
        shutil.copytree(dist / "dn_tiny", served / "dn_tiny")
        # The index alone, away from the files: fetch must use the mirror URL, not the relative one.
        index = tmp_path / "only-index" / "index.json"
        index.parent.mkdir()
        shutil.copy(dist / "index.json", index)
        out = tmp_path / "models"
        assert fetch.main(["dn_tiny", "--index", str(index), "-o", str(out), "--cafile", str(mirror.cafile),
                           "--backoff", "0.01", "--retries", "0"]) == 0
    default = record["default_variant"]
    for f in record["variants"][default]["files"] + record["documents"]:
        assert hashlib.sha256((out / "dn_tiny" / f["name"]).read_bytes()).hexdigest() == f["sha256"]
    assert {name for name, _ in mirror.log} >= {f"dn_tiny/model_{default}.tflite", "dn_tiny/card.md"}


def test_doit_lists_publish_and_fetch_tasks(built):
    _, parallel, _ = built
    listing = parallel("list", "--all").stdout
    assert "publish:dn_tiny" in listing and "fetch:dn_tiny" in listing and "board:dn_tiny" in listing
