"""The contributor's path: tools.new writes a starting entry, the smoke build checks it end to end, and a
JSON-only entry cannot make the build run code of its choosing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, tiny_entry_data, write_entry
from tools import new
from tools.entry import EntryError, load_entry
from tools.sources import build_module
from tools.weights import load_into


def _fill(path, **licenses):
    data = json.loads(path.read_text())
    data["license"] = licenses or {"code": "Apache-2.0", "weights": "Apache-2.0"}
    data["weights"] = {"kind": "local", "path": "weights/none.safetensors", "format": "safetensors", "sha256": None,
                       "unpinned_reason": "the test builds from random weights"}
    path.write_text(json.dumps(data, indent=2))
    return data


def test_scaffold_is_refused_until_its_placeholders_are_filled(tmp_path):
    assert new.main(["my_detr", "--from", "transformers:DeformableDetrForObjectDetection", "--zoo", str(tmp_path)]) == 0
    path = tmp_path / "my_detr.json"
    with pytest.raises(EntryError) as info:
        load_entry(path)
    assert info.value.json_path == "$.weights.repo" and "still FILL-IN" in info.value.message
    assert "$.license.code" in info.value.message and "$.license.weights" in info.value.message
    _fill(path)
    entry = load_entry(path)
    assert entry.data["task"] == "object-detection" and entry.data["outputs"] == ["logits", "pred_boxes"]
    assert entry.data["inputs"][0]["shape"] == [1, 3, 512, 512]


@pytest.mark.parametrize("args,message", [
    (["x_model", "--from", "transformers:NoSuchModel"], "'NoSuchModel' is not a model class in transformers"),
    (["x_model", "--from", "transformers:BertModel"], "not for a task this scaffold writes"),
    (["x_model", "--from", "timm:no_such_net"], "'no_such_net' is not a model name in timm"),
    (["X-Model", "--from", "timm:resnet18"], "id 'X-Model': use lower-case letters"),
    (["x_model", "--from", "keras:resnet"], "expected transformers:<ModelClass> or timm:<model_name>"),
])
def test_scaffold_errors_name_the_problem(tmp_path, capsys, args, message):
    assert new.main([*args, "--zoo", str(tmp_path)]) == 1
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_scaffold_does_not_overwrite(tmp_path, capsys):
    (tmp_path / "x_model.json").write_text("{}")
    assert new.main(["x_model", "--from", "timm:resnet18", "--zoo", str(tmp_path)]) == 1
    assert "exists" in capsys.readouterr().err and (tmp_path / "x_model.json").read_text() == "{}"


def test_json_only_timm_entry_builds_end_to_end_as_a_smoke_variant(tmp_path):
    """A new model from one JSON file: scaffold, fill in, and the smoke build CI runs passes every stage."""
    zoo = tmp_path / "zoo"
    assert new.main(["tiny_classifier", "--from", "timm:test_resnet", "--zoo", str(zoo)]) == 0
    _fill(zoo / "tiny_classifier.json")
    proc = subprocess.run([sys.executable, "-m", "tools.smoke", "tiny_classifier", "--zoo", str(zoo)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ".  card:tiny_classifier_smoke" in proc.stdout
    assert "smoke: tiny_classifier_smoke passed validation" in proc.stdout


def test_smoke_build_fails_when_a_stage_fails(tmp_path):
    zoo = tmp_path / "zoo"
    assert new.main(["tiny_classifier", "--from", "timm:test_resnet", "--zoo", str(zoo)]) == 0
    data = _fill(zoo / "tiny_classifier.json")
    data["outputs"] = ["no_such_output", "another"]
    (zoo / "tiny_classifier.json").write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "tools.smoke", "tiny_classifier", "--zoo", str(zoo)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "error: export: " in proc.stderr and "returns one tensor; declare one output name" in proc.stderr
    assert "smoke: FAILED" in proc.stderr


# --- a JSON-only pull request cannot run code -------------------------------------------------------------

def _entry_with(tmp_path, mutate):
    data = tiny_entry_data("dn_detr", "dn_detr")
    mutate(data)
    return write_entry(tmp_path / "zoo", data)


@pytest.mark.parametrize("mutate,json_path", [
    (lambda d: d["source"].__setitem__("class", "os.system"), "$.source.class"),
    (lambda d: d["source"].__setitem__("kind", "python"), "$.source.kind"),
    (lambda d: d["source"].__setitem__("trust_remote_code", True), "$.source"),
    (lambda d: d["weights"].__setitem__("format", "pickle"), "$.weights.format"),
    (lambda d: d["export"].__setitem__("patches", ["os.system"]), "$.export.patches[0]"),
    (lambda d: d["weights"].__setitem__("key_map", "builtins.exec"), "$.weights.key_map"),
])
def test_entry_naming_arbitrary_python_is_refused_when_loaded(tmp_path, mutate, json_path):
    with pytest.raises(EntryError) as info:
        load_entry(_entry_with(tmp_path, mutate))
    assert info.value.json_path == json_path


@pytest.mark.parametrize("config,json_path", [
    ({"trust_remote_code": True}, "$.source.config.trust_remote_code"),
    ({"auto_map": {"AutoModel": "evil.Model"}}, "$.source.config.auto_map"),
])
def test_transformers_config_cannot_reach_remote_code(tmp_path, config, json_path):
    path = _entry_with(tmp_path, lambda d: d["source"]["config"].update(config))
    with pytest.raises(EntryError) as info:
        build_module(load_entry(path))
    assert info.value.json_path == json_path


def test_class_outside_the_registry_is_refused_at_build(tmp_path):
    path = _entry_with(tmp_path, lambda d: d["source"].__setitem__("class", "PreTrainedModel"))
    with pytest.raises(EntryError, match="not a model class in transformers"):
        build_module(load_entry(path))


class _Payload:
    """Unpickling this runs a shell command that leaves a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_in_declared_weights_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    torch.save({"model": {"w": torch.zeros(1)}, "payload": _Payload(marker)}, evil)
    path = _entry_with(tmp_path, lambda d: d.__setitem__("weights", {
        "kind": "local", "path": str(evil), "format": "torch", "state_dict_key": "model", "sha256": None,
        "unpinned_reason": "a hostile checkpoint made by the test"}))
    entry = load_entry(path)
    with pytest.raises(EntryError, match="weights_only"):
        load_into(entry, build_module(entry))
    assert not marker.exists()


def test_timm_arguments_that_load_files_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    torch.save({"payload": _Payload(marker)}, evil)
    data = json.loads((ROOT / "zoo" / "dn_detr.json").read_text())
    data.update(id="timm_evil", source={"kind": "timm", "model": "test_resnet", "config": {"checkpoint_path": str(evil)}})
    data["inputs"][0]["name"] = "x"
    with pytest.raises(EntryError) as info:
        build_module(load_entry(write_entry(tmp_path / "zoo", data)))
    assert info.value.json_path == "$.source.config.checkpoint_path"
    assert not marker.exists()


def test_smoke_picks_the_entries_a_change_touches(tmp_path):
    from tools.smoke import changed_entry_ids

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    for name in ("zoo/a_model.json", "zoo/b_model.json", "tools/stage.py", "README.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("{}")
    git("init", "-q", "-b", "main")
    git("add", ".")
    git("commit", "-qm", "base")
    git("branch", "base")
    assert changed_entry_ids("base", tmp_path) == []
    (tmp_path / "zoo" / "b_model.json").write_text('{"id": "b_model"}')
    (tmp_path / "README.md").write_text("docs only")
    git("commit", "-qam", "touch b")
    assert changed_entry_ids("base", tmp_path) == ["b_model"]
    (tmp_path / "tools" / "stage.py").write_text("# changed")
    git("commit", "-qam", "touch code")
    assert changed_entry_ids("base", tmp_path) == ["a_model", "b_model"]
