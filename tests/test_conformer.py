"""Conformer-CTC: NeMo .nemo archives read as data through the key map, the NeMo front end against transformers'
ParakeetFeatureExtractor, greedy CTC decoding, the 2-D convolution patch, and a tiny build from an archive the
test writes, through the whole doit pipeline to transcripts and the torch-free transcribe command.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile

import jsonschema
import numpy as np
import pytest
import torch
import yaml

from conftest import RANDOM, ROOT, DoitRun, tiny_entry_data, write_entry
from tools.ctc_runtime import greedy_ids, labels_text, near_tie_frames
from tools.entry import EntryError, load_entry

ENTRY = ROOT / "zoo" / "conformer.json"
WORDS = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", "please", "turn", "off", "light", "kitchen",
         "before", "you", "leave", "weather", "will", "be", "sun", "tomorrow", "with", "a", "breeze", "from", "west"]
# 128 SentencePiece-style labels: word pieces that start a word, then letters and suffixes that continue one.
LABELS = (["<unk>"] + [f"\u2581{w}" for w in WORDS] + list("abcdefghijklmnopqrstuvwxyz") + [f"\u2581{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
          + ["s", "ed", "ing", "ly", "er", "est", "'", "n't"])
LABELS += [f"x{i}" for i in range(128 - len(LABELS))]

# NeMo's names for the conformer_ctc family's weights (ConformerEncoder + ConvASRDecoder), written out here
# independently of tools/keymaps.py so that the key map is checked against them.
NEMO_NAMES = [
    (r"^encoder\.subsampling\.layers\.(\d+)\.", r"encoder.pre_encode.conv.\1."),
    (r"^encoder\.subsampling\.linear\.", "encoder.pre_encode.out."),
    (r"\.self_attn\.q_proj\.", ".self_attn.linear_q."), (r"\.self_attn\.k_proj\.", ".self_attn.linear_k."),
    (r"\.self_attn\.v_proj\.", ".self_attn.linear_v."), (r"\.self_attn\.o_proj\.", ".self_attn.linear_out."),
    (r"\.self_attn\.relative_k_proj\.", ".self_attn.linear_pos."),
    (r"\.self_attn\.bias_u$", ".self_attn.pos_bias_u"), (r"\.self_attn\.bias_v$", ".self_attn.pos_bias_v"),
    (r"\.conv\.norm\.", ".conv.batch_norm."),
    (r"^ctc_head\.", "decoder.decoder_layers.0."),
]


def _nemo_state(module) -> dict:
    state = {}
    for key, tensor in module.state_dict().items():
        for pattern, target in NEMO_NAMES:
            key = re.sub(pattern, target, key)
        state[key] = tensor.clone()
    # Buffers NeMo saves beside the weights: the front end's window and filters, the position table.
    state.update({"preprocessor.featurizer.window": torch.hann_window(400), "preprocessor.featurizer.fb": torch.rand(1, 80, 257),
                  "encoder.pos_enc.pe": torch.rand(1, 9999, 4)})
    return state


def _write_nemo(path, state, labels=LABELS, payload: bytes | None = None):
    """A .nemo archive as NeMo's save_to writes it: model_config.yaml and model_weights.ckpt in a tar."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    config = {"decoder": {"vocabulary": list(labels), "num_classes": len(labels)}, "sample_rate": 16000}
    with tarfile.open(path, "w:gz") as archive:
        for name, blob in (("model_config.yaml", yaml.safe_dump(config).encode()),
                           ("model_weights.ckpt", payload if payload is not None else buffer.getvalue())):
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(blob)
            archive.addfile(info, io.BytesIO(blob))
    return path


def _tiny_data(new_id: str, archive) -> dict:
    data = tiny_entry_data("conformer", new_id)
    data["weights"] = {"kind": "local", "path": str(archive), "format": "nemo", "key_map": "nemo_conformer_ctc",
                       "sha256": hashlib.sha256(archive.read_bytes()).hexdigest()}
    return data


def _tiny_module(seed: int = 1):
    from tools.families.conformer_ctc import build

    torch.manual_seed(seed)
    config = {**json.loads(ENTRY.read_text())["source"]["config"], **json.loads(ENTRY.read_text())["smoke"]["config"]}
    module = build(config).eval()
    for layer in module.encoder.layers:  # trained-looking BatchNorm statistics, not the initial 0 / 1
        layer.conv.norm.running_mean.uniform_(-0.5, 0.5)
        layer.conv.norm.running_var.uniform_(0.5, 2.0)
    return module


def test_nemo_archive_loads_through_the_key_map_into_the_family(tmp_path):
    from tools.sources import build_module
    from tools.weights import load_into

    original = _tiny_module()
    archive = _write_nemo(tmp_path / "tiny.nemo", _nemo_state(original))
    path = write_entry(tmp_path / "zoo", _tiny_data("cf_load", archive))
    entry = load_entry(path)
    module = build_module(entry)
    record = load_into(entry, module)
    assert record["kind"] == "trained" and record["key_map"] == "nemo_conformer_ctc"
    features = torch.randn(1, 401, 80)
    with torch.no_grad():
        assert torch.equal(module(input_features=features).logits, original(input_features=features).logits)


def test_striding_subsampling_is_full_convolutions_and_the_model_is_the_small_class():
    from tools.sources import build_module

    module = build_module(load_entry(ENTRY))
    convs = [m for m in module.encoder.subsampling.layers if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.groups, c.stride) for c in convs] == [(1, 176, 1, (2, 2)), (176, 176, 1, (2, 2))]
    assert 10e6 < sum(p.numel() for p in module.parameters()) < 30e6
    with torch.no_grad():
        assert module(input_features=torch.randn(1, 1001, 80)).logits.shape == (1, 251, 129)  # 40 ms per frame


@pytest.mark.parametrize("case", ["pickle payload", "not an archive", "unknown key"])
def test_bad_nemo_archives_are_refused_with_one_clear_error(tmp_path, case):
    from tools.sources import build_module
    from tools.weights import load_into

    marker = tmp_path / "pwned"
    state = _nemo_state(_tiny_module())
    if case == "pickle payload":
        class Payload:
            def __reduce__(self):
                import os
                return os.system, (f"touch {marker}",)
        archive = _write_nemo(tmp_path / "bad.nemo", {}, payload=_pickled(Payload()))
    elif case == "not an archive":
        archive = tmp_path / "bad.nemo"
        archive.write_bytes(b"PK\x03\x04 a zip, not a tar")
    else:
        state["encoder.layers.0.extra_thing.weight"] = torch.zeros(1)
        archive = _write_nemo(tmp_path / "bad.nemo", state)
    entry = load_entry(write_entry(tmp_path / "zoo", _tiny_data("cf_bad", archive)))
    with pytest.raises(EntryError) as error:
        load_into(entry, build_module(entry))
    expected = {"pickle payload": ("$.weights.format", "weights_only"), "not an archive": ("$.weights.format", "not a .nemo"),
                "unknown key": ("$.weights.key_map", "extra_thing")}[case]
    assert error.value.json_path == expected[0] and expected[1] in error.value.message
    assert not marker.exists(), "the payload ran"


def _pickled(obj) -> bytes:
    import pickle

    return pickle.dumps(obj)


@pytest.mark.parametrize("seconds", [0.6, 3.4, 12.0])
def test_nemo_features_match_transformers_parakeet_feature_extractor(tmp_path, seconds):
    from transformers import ParakeetFeatureExtractor

    from tools.logmel import nemo_mel
    from tools.speech import speak

    audio = speak("The quick brown fox jumps over the lazy dog, and then it runs into the forest to rest for a while.",
                  tmp_path / "s.wav")
    audio = np.pad(audio, (0, max(0, int(seconds * 16000) - len(audio))))[:int(seconds * 16000)]
    frames = 1001  # 10 s: the speech is padded (0.6 s, 3.4 s) or cut (12 s)
    reference = ParakeetFeatureExtractor()(audio[:(frames - 1) * 160], sampling_rate=16000, padding="max_length",
                                           max_length=(frames - 1) * 160, return_tensors="np")["input_features"][0]
    ours = nemo_mel(audio, frames)
    assert ours.shape == reference.shape == (frames, 80)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)


def test_greedy_ctc_merges_repeats_drops_blanks_and_joins_word_pieces():
    blank = 4
    labels = ["\u2581he", "llo", "\u2581wor", "ld"]
    path = [0, 0, blank, 1, 1, blank, blank, 2, 3, 3, blank, 3]  # a blank between two 3s keeps both
    logits = np.eye(5)[path] * 3.0
    assert greedy_ids(logits, blank) == [0, 1, 2, 3, 3]
    assert labels_text([0, 1, 2, 3], labels) == "hello world"
    assert labels_text([0, 1], None) == "<0> <1>"


def test_near_tie_frames_forgive_only_flips_within_the_tolerance():
    reference = np.array([[1.0, 0.99995, 0.0], [0.0, 2.0, 0.0]])
    flipped = np.array([[0.99990, 1.0, 0.0], [0.0, 2.0, 0.0]])
    assert near_tie_frames(reference, reference, 1e-4, 0) == 0
    assert near_tie_frames(reference, flipped, 1e-4, 0) == 1
    assert near_tie_frames(reference, flipped, 1e-6, 0) is None
    assert near_tie_frames(reference, np.array([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]), 1e-4, 0) is None


def test_conv2d_patch_keeps_the_conformer_outputs():
    from tools.patches import apply_patches

    module = _tiny_module()
    features = torch.randn(1, 401, 80)
    with torch.no_grad():
        before = module(input_features=features).logits
        after = apply_patches(module, ["conformer_conv_module_as_conv2d"])(input_features=features).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """A tiny Conformer-CTC from a .nemo archive written here, through the whole doit pipeline."""
    base = tmp_path_factory.mktemp("conformer")
    run = DoitRun(base)
    archive = _write_nemo(base / "tiny.nemo", _nemo_state(_tiny_module()))
    write_entry(run.zoo, _tiny_data("cf_tiny", archive))
    return run, run("run", "build", env=RANDOM)


def test_tiny_build_runs_every_stage_and_reruns_nothing(tiny_build):
    run, first = tiny_build
    stages = ("export", "simplify", "convert", "validate", "quantize", "fidelity", "npu", "bench", "speech", "card")
    assert first.ran == {f"{s}:cf_tiny" for s in stages}
    assert not run("run", "build", env=RANDOM).ran


def test_tiny_graph_is_static_int64_free_builtin_with_depthwise_convolutions(tiny_build):
    from tools.tflite_graph import read_graph

    run, _ = tiny_build
    out = run.build / "cf_tiny"
    validation = json.loads((out / "validation.json").read_text())
    assert validation["passed"]
    tflite = read_graph(out / "model_fp32.tflite")
    assert not [t.name for t in tflite.tensors if t.type == "INT64" or t.dynamic]
    assert all(op.builtin for op in tflite.ops)
    names = [op.name for op in tflite.ops]
    assert names.count("DEPTHWISE_CONV_2D") == 2, "one depthwise convolution per block"
    assert list(tflite.tensors[tflite.signature_inputs["input_features"]].shape) == [1, 401, 80]


def test_tiny_build_transcribes_with_the_archive_labels_and_the_card_shows_it(tiny_build):
    run, _ = tiny_build
    out = run.build / "cf_tiny"
    assert json.loads((out / "labels.json").read_text()) == LABELS
    speech = json.loads((out / "speech.json").read_text())
    exported = json.loads((out / "export.json").read_text())
    assert speech["passed"] and speech["trained_weights"], "weights from an archive count as trained"
    for backend in ("onnx", "fp32"):
        assert speech["backends"][backend]["equal_to_torch"] == [True] * len(exported["torch"]["decoded"])
        assert speech["backends"][backend]["forward_ms"] > 0
    texts = speech["backends"]["fp32"]["transcripts"]
    assert all(t and not t.startswith("<") for t in texts), "text from the archive's labels, not ids"
    card = json.loads((out / "card.json").read_text())
    jsonschema.validate(card, json.loads((ROOT / "schema" / "card.schema.json").read_text()))
    assert card["speech"]["passed"] and card["export"]["patches"][0]["name"] == "conformer_conv_module_as_conv2d"
    estimate = card["npu"]["estimates"]["model_int8_pc.tflite"]["lf-6.6"]
    assert estimate["label"] == "estimated, not measured" and estimate["npu"]["range_ms"][0] < estimate["npu"]["ms"]
    assert "model_fp32.tflite" not in card["npu"]["estimates"], "the cost model was fitted on int8 graphs only"
    markdown = (out / "card.md").read_text()
    assert "forward ms" in markdown and texts[0] in markdown and "trial" in markdown
    assert "8MP latency: estimated, not measured" in markdown


def test_transcribe_runs_the_ctc_graph_without_torch(tiny_build, tmp_path):
    from test_whisper import _transcribe
    from tools.speech import speak

    run, _ = tiny_build
    out = run.build / "cf_tiny"
    speech = json.loads((out / "speech.json").read_text())
    speak(speech["sentences"][0], tmp_path / "s.wav")
    proc = _transcribe(out, tmp_path / "s.wav")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == speech["backends"]["fp32"]["transcripts"][0]
    assert "forward" in proc.stderr and "real-time factor" in proc.stderr
    subprocess.run(["sox", "-n", "-r", "16000", "-c", "1", "-b", "16", str(tmp_path / "long.wav"), "trim", "0", "5"], check=True)
    proc = _transcribe(out, tmp_path / "long.wav")
    assert proc.returncode == 0 and "hears its first 4.0 s" in proc.stderr


def test_published_ctc_model_is_fetched_and_transcribes_without_torch(tiny_build, tmp_path):
    from test_whisper import _transcribe
    from tools import fetch, publish
    from tools.speech import speak

    run, _ = tiny_build
    dist = tmp_path / "dist"
    record = publish.publish("cf_tiny", run.build, dist, run.zoo)
    assert list(record["variants"]) == ["fp32", "onnx"], "the trial INT8 variant is never published"
    assert [f["name"] for f in record["variants"]["fp32"]["files"]] == ["model_fp32.tflite", "export.json", "labels.json"]
    out = tmp_path / "models"
    assert fetch.main(["cf_tiny", "--index", str(dist / "index.json"), "-o", str(out), "--retries", "0"]) == 0
    speech = json.loads((run.build / "cf_tiny" / "speech.json").read_text())
    speak(speech["sentences"][0], tmp_path / "s.wav")
    proc = _transcribe(out / "cf_tiny", tmp_path / "s.wav")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == speech["backends"]["fp32"]["transcripts"][0]


@pytest.mark.parametrize("words_kept", [True, False])
def test_a_released_int8_variant_is_published_only_if_it_kept_the_words(tiny_build, tmp_path, words_kept):
    import shutil

    from tools import publish

    run, _ = tiny_build
    build = tmp_path / "build"
    shutil.copytree(run.build / "cf_tiny", build / "cf_tiny")
    card_path = build / "cf_tiny" / "card.json"
    card = json.loads(card_path.read_text())
    card["fidelity"]["variants"]["int8_pc"].pop("trial")  # as if the entry released it
    card["speech"]["backends"]["int8_pc"].pop("trial")
    card["speech"]["backends"]["int8_pc"]["passed"] = words_kept  # lost words under a declared known failure
    card_path.write_text(json.dumps(card))
    record = publish.publish("cf_tiny", build, tmp_path / "dist", run.zoo)
    assert ("int8_pc" in record["variants"]) == words_kept
    assert record["default_variant"] == ("int8_pc" if words_kept else "fp32")
