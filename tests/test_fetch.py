"""tools/fetch.py against a real HTTPS server on loopback: good, tampered, truncated, interrupted, hostile."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from https_mirror import HttpsMirror
from tools import fetch

PAYLOAD = os.urandom(3 * (1 << 20) + 12345)  # a few MiB: several read blocks, so a cut lands mid-file


def _record(name, data, urls):
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "urls": urls}


def _index(tmp_path, files, entry_id="tiny_model"):
    index = {"$schema": "../schema/dist-index.schema.json", "index_version": 1, "entries": {entry_id: {
        "default_variant": "fp32", "variants": {"fp32": {"files": files}}, "documents": []}}}
    path = tmp_path / "index.json"
    path.write_text(json.dumps(index))
    return path


@pytest.fixture
def mirror(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    (served / "model.tflite").write_bytes(PAYLOAD)
    with HttpsMirror(served, tmp_path) as server:
        server.served = served
        yield server


def _fetch(index, out, mirror, *extra):
    return fetch.main(["tiny_model", "--index", str(index), "-o", str(out), "--cafile", str(mirror.cafile),
                       "--backoff", "0.01", *extra])


def test_good_download_is_verified_and_renamed(tmp_path, mirror, capsys):
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])])
    assert _fetch(index, tmp_path / "out", mirror) == 0
    assert (tmp_path / "out" / "tiny_model" / "model.tflite").read_bytes() == PAYLOAD
    assert not list((tmp_path / "out" / "tiny_model").glob(".*"))
    assert "(downloaded)" in capsys.readouterr().out
    assert _fetch(index, tmp_path / "out", mirror) == 0  # second run: verified in place, nothing downloaded
    assert "(already present)" in capsys.readouterr().out
    assert len(mirror.log) == 1


def test_runs_on_the_standard_library_alone(tmp_path, mirror):
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])])
    # -S: no site-packages at all, so neither torch, TensorFlow nor anything else installed is importable.
    proc = subprocess.run([sys.executable, "-S", str(ROOT / "tools" / "fetch.py"), "tiny_model", "--index", str(index),
                           "-o", str(tmp_path / "out"), "--cafile", str(mirror.cafile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "tiny_model" / "model.tflite").read_bytes() == PAYLOAD


def test_tampered_file_is_refused_and_nothing_is_left(tmp_path, mirror, capsys):
    tampered = bytearray(PAYLOAD)
    tampered[1000] ^= 0xFF
    (mirror.served / "model.tflite").write_bytes(bytes(tampered))
    record = _record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])
    assert _fetch(_index(tmp_path, [record]), tmp_path / "out", mirror) == 1
    err = capsys.readouterr().err
    actual = hashlib.sha256(bytes(tampered)).hexdigest()
    assert f"sha256 mismatch for model.tflite from {mirror.url}/model.tflite: expected {record['sha256']}, got {actual}" in err
    assert not (tmp_path / "out" / "tiny_model").exists() or not list((tmp_path / "out" / "tiny_model").iterdir())


def test_truncated_file_is_a_size_error(tmp_path, mirror, capsys):
    (mirror.served / "model.tflite").write_bytes(PAYLOAD[:-100])
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])])
    assert _fetch(index, tmp_path / "out", mirror, "--retries", "1") == 1
    err = capsys.readouterr().err
    assert f"expected {len(PAYLOAD)} bytes, got {len(PAYLOAD) - 100}" in err
    assert not (tmp_path / "out" / "tiny_model" / "model.tflite").exists()


def test_interrupted_download_resumes_with_a_range_request(tmp_path, mirror):
    half = len(PAYLOAD) // 2
    mirror.cut("model.tflite", half)
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])])
    assert _fetch(index, tmp_path / "out", mirror) == 0
    assert (tmp_path / "out" / "tiny_model" / "model.tflite").read_bytes() == PAYLOAD
    ranges = [r for _, r in mirror.log]
    assert ranges[0] is None and ranges[1] is not None
    resumed_at = int(ranges[1][len("bytes="):].rstrip("-"))
    assert 0 < resumed_at <= half  # the second request asked only for what was missing


def test_partial_file_from_an_earlier_run_is_resumed(tmp_path, mirror):
    folder = tmp_path / "out" / "tiny_model"
    folder.mkdir(parents=True)
    (folder / ".model.tflite.part").write_bytes(PAYLOAD[:777])
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])])
    assert _fetch(index, tmp_path / "out", mirror) == 0
    assert (folder / "model.tflite").read_bytes() == PAYLOAD
    assert mirror.log == [("model.tflite", "bytes=777-")]


def test_next_url_is_tried_when_a_mirror_serves_a_bad_file(tmp_path, mirror):
    (mirror.served / "bad.tflite").write_bytes(b"x" * len(PAYLOAD))
    local = tmp_path / "local-mirror.bin"
    local.write_bytes(PAYLOAD)
    record = _record("model.tflite", PAYLOAD, [f"{mirror.url}/bad.tflite", local.as_uri()])
    assert _fetch(_index(tmp_path, [record]), tmp_path / "out", mirror) == 0
    assert (tmp_path / "out" / "tiny_model" / "model.tflite").read_bytes() == PAYLOAD


def test_relative_url_is_resolved_against_the_index(tmp_path, mirror):
    (tmp_path / "tiny_model").mkdir()
    (tmp_path / "tiny_model" / "model.tflite").write_bytes(PAYLOAD)
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, ["tiny_model/model.tflite"])])
    assert _fetch(index, tmp_path / "out", mirror) == 0
    assert (tmp_path / "out" / "tiny_model" / "model.tflite").read_bytes() == PAYLOAD


@pytest.mark.parametrize("name", ["../escaped.tflite", "/tmp/escaped.tflite", "sub/../../escaped.tflite", "..", ".hidden",
                                  "a\\..\\escaped", "a/b/escaped.tflite", "sub/.hidden", "sub/", "/escaped"])
def test_names_from_the_index_cannot_leave_the_output_folder(tmp_path, mirror, capsys, name):
    index = _index(tmp_path, [_record(name, PAYLOAD, [f"{mirror.url}/model.tflite"])])
    assert _fetch(index, tmp_path / "out", mirror) == 1
    assert f"refusing file name {name!r}" in capsys.readouterr().err
    assert mirror.log == [] and not (tmp_path / "escaped.tflite").exists()


def test_symlinked_entry_folder_is_refused(tmp_path, mirror, capsys):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tiny_model").symlink_to(outside)
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])])
    assert _fetch(index, tmp_path / "out", mirror) == 1
    assert "refusing to write through the symbolic link" in capsys.readouterr().err
    assert not list(outside.iterdir())


def test_a_graph_folder_name_lands_in_its_folder_and_a_symlinked_one_is_refused(tmp_path, mirror, capsys):
    index = _index(tmp_path, [_record("encoder/model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])])
    assert _fetch(index, tmp_path / "out", mirror) == 0
    assert (tmp_path / "out" / "tiny_model" / "encoder" / "model.tflite").read_bytes() == PAYLOAD
    assert not list((tmp_path / "out" / "tiny_model" / "encoder").glob(".*")), "no partial file left"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (tmp_path / "out2" / "tiny_model").mkdir(parents=True)
    (tmp_path / "out2" / "tiny_model" / "encoder").symlink_to(outside)
    assert _fetch(index, tmp_path / "out2", mirror) == 1
    assert "refusing to write through the symbolic link" in capsys.readouterr().err
    assert not list(outside.iterdir())


def test_hostile_entry_id_is_refused(tmp_path, mirror, capsys):
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])], entry_id="../up")
    assert fetch.main(["../up", "--index", str(index), "-o", str(tmp_path / "out")]) == 1
    assert "refusing entry id '../up'" in capsys.readouterr().err


@pytest.mark.parametrize("url,message", [
    ("ftp://127.0.0.1/model.tflite", "only https:// and file:// URLs are fetched"),
    ("http://127.0.0.1:9/model.tflite", "refusing plain http"),
])
def test_wrong_scheme_is_refused(tmp_path, mirror, capsys, url, message):
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [url])])
    assert _fetch(index, tmp_path / "out", mirror) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "tiny_model" / "model.tflite").exists()


def test_untrusted_certificate_is_refused(tmp_path, mirror, capsys):
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])])
    assert fetch.main(["tiny_model", "--index", str(index), "-o", str(tmp_path / "out"), "--retries", "0"]) == 1
    assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err


def test_unknown_entry_and_variant_are_named(tmp_path, mirror, capsys):
    index = _index(tmp_path, [_record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])])
    assert _fetch(index, tmp_path / "out", mirror, "--variant", "int8") == 1
    assert "entry 'tiny_model' has no variant 'int8'; it has ['fp32']" in capsys.readouterr().err
    assert fetch.main(["nope_model", "--index", str(index)]) == 1
    assert "no entry 'nope_model' in the index; it has ['tiny_model']" in capsys.readouterr().err


def test_malformed_index_record_is_an_error_not_a_traceback(tmp_path, mirror, capsys):
    record = _record("model.tflite", PAYLOAD, [f"{mirror.url}/model.tflite"])
    del record["sha256"]
    assert _fetch(_index(tmp_path, [record]), tmp_path / "out", mirror) == 1
    assert "malformed record for 'tiny_model'" in capsys.readouterr().err
