"""eval.default_model: created once, deterministically, atomically, under the chosen cache; reloads through Auto."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import minimax_m3  # noqa: F401  (registers the Auto classes)
from eval import default_model
from eval_isolation import isolate
from minimax_m3 import MiniMaxM3ForCausalLM


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    return tmp_path


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIMAX_M3_EVAL_CACHE", str(tmp_path / "explicit"))
    assert default_model.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("MINIMAX_M3_EVAL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_root() == tmp_path / "xdg" / "minimax-m3-eval"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: tmp_path / "home"))
    assert default_model.cache_root() == tmp_path / "home" / ".cache" / "minimax-m3-eval"
    assert default_model.default_model_dir().name == f"tiny-minimax-m3-{default_model.VERSION}"


def test_created_once_and_reloaded_through_the_auto_classes(isolated, monkeypatch):
    path = default_model.ensure_default_model()
    assert path == isolated / "eval-cache" / f"tiny-minimax-m3-{default_model.VERSION}"
    assert {"config.json", "model.safetensors", "tokenizer.json", default_model.PROVENANCE_FILE} <= {p.name for p in path.iterdir()}
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no staging directory left behind

    def must_not_rebuild(directory):
        raise AssertionError("the default model was built a second time")

    monkeypatch.setattr(default_model, "_write", must_not_rebuild)
    model, tokenizer = default_model.load_default_model()
    assert isinstance(model, MiniMaxM3ForCausalLM) and model.config.model_type == "minimax_m3"
    assert (model.config.index_block_size, model.config.index_topk_blocks) == (16, 4)
    assert model.config.layer_types == ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"]
    assert json.loads((path / "config.json").read_text())["model_type"] == "minimax_m3"

    auto_model = AutoModelForCausalLM.from_pretrained(path)
    auto_tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(auto_model) is MiniMaxM3ForCausalLM
    for (name, a), (_, b) in zip(model.state_dict().items(), auto_model.state_dict().items()):
        assert torch.equal(a, b), name
    assert len(auto_tokenizer) == model.config.vocab_size == default_model.VOCAB_SIZE
    assert (auto_tokenizer.pad_token_id, auto_tokenizer.bos_token_id, auto_tokenizer.eos_token_id) == (0, 1, 2)
    text = "The value of amber-falcon is 48213."
    assert auto_tokenizer.decode(auto_tokenizer(text)["input_ids"]) == text
    with torch.no_grad():
        logits = auto_model(auto_tokenizer(text, return_tensors="pt")["input_ids"]).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1  # not a degenerate (all-zero) model


def test_creation_is_deterministic(isolated):
    first = default_model.ensure_default_model(isolated / "a" / "model")
    second = default_model.ensure_default_model(isolated / "b" / "model")
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()
    a = MiniMaxM3ForCausalLM.from_pretrained(first).state_dict()
    b = MiniMaxM3ForCausalLM.from_pretrained(second).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_concurrent_creator_that_wins_the_rename_is_accepted(isolated, monkeypatch):
    final = isolated / "race" / "model"
    real_write = default_model._write

    def write_while_another_process_finishes_first(staging):
        real_write(staging)
        shutil.copytree(staging, final)  # the other process's rename lands before ours

    monkeypatch.setattr(default_model, "_write", write_while_another_process_finishes_first)
    assert default_model.ensure_default_model(final) == final
    assert (final / default_model.PROVENANCE_FILE).is_file()
    assert [p.name for p in final.parent.iterdir()] == ["model"]  # our staging copy was removed


def test_an_incomplete_directory_in_the_way_is_an_error(isolated):
    final = isolated / "broken" / "model"
    final.mkdir(parents=True)
    (final / "junk").write_text("x")
    with pytest.raises(RuntimeError, match="not a complete default model"):
        default_model.ensure_default_model(final)
