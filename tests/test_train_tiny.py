"""python -m eval.train_tiny --smoke end to end on CPU: three stages logged, a small checkpoint loadable through the
Auto classes, deterministic resume, and the refusals."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import minimax_m3  # noqa: F401  (registers the Auto classes)
from eval import train_tiny
from eval.training_curves import read_log
from eval.modes import attention_mode
from minimax_m3 import MiniMaxM3ForCausalLM

SHIPPABLE_LIMIT = 3 * 1024 * 1024
TIMING_KEYS = ("timing",)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("train-tiny") / "model"
    assert train_tiny.main(["--smoke", "--output", str(output), "--device", "cpu"]) == 0
    return output


def log_records(output: Path) -> list:
    """The log's records as its reader sees them: without those a resumed run redid."""
    return read_log(output / train_tiny.LOG_FILE)


def without_timing(records: list) -> list:
    return [{key: value for key, value in record.items() if key not in TIMING_KEYS}
            for record in records if not record["event"].startswith("command_")]


def test_smoke_run_logs_three_stages(smoke_run):
    records = log_records(smoke_run)
    assert [r["stage"] for r in records if r["event"] == "stage_end"] == [1, 2, 3]
    trained = {r["stage"] for r in records if r["event"] == "train"}
    assert trained == {1, 2, 3}
    assert all(set(r["kl_by_layer"]) == {"1", "2"} for r in records if r["event"] == "train" and r["stage"] == 2)
    stage_end_evals = [r for r in records if r["event"] == "eval" and r["kind"] == "stage_end"]
    assert {(r["stage"], r["mode"], r["length"]) for r in stage_end_evals} == {
        (stage, mode, length) for stage in (1, 2, 3) for mode in ("dense", "sparse") for length in (512, 1024)}
    for record in stage_end_evals:
        assert 0.0 <= record["accuracy"] <= 1.0 and record["queries"] >= 1
        if record["mode"] == "sparse":  # at most 8 pages of 128 tokens: every page is selected
            assert [layer["layer"] for layer in record["recall"]] == [1, 2]
            assert all(layer["recall"] == pytest.approx(1.0, abs=1e-5) for layer in record["recall"])
    summary = json.loads((smoke_run / train_tiny.SUMMARY_FILE).read_text())
    assert summary["complete"] and sorted(summary["stages"]) == ["1", "2", "3"]
    assert "| 3 |" in (smoke_run / "README.md").read_text()


def test_smoke_checkpoint_is_small_and_loads_through_the_auto_classes(smoke_run):
    shippable = [p for p in smoke_run.rglob("*") if p.is_file() and train_tiny.STATE_DIRECTORY not in p.parts]
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", train_tiny.LOG_FILE,
            train_tiny.CURVES_FILE} <= {p.name for p in shippable}
    assert sum(p.stat().st_size for p in shippable) <= SHIPPABLE_LIMIT

    model = AutoModelForCausalLM.from_pretrained(smoke_run)
    tokenizer = AutoTokenizer.from_pretrained(smoke_run)
    assert type(model) is MiniMaxM3ForCausalLM
    config = model.config
    assert (config.index_block_size, config.index_topk_blocks, config.index_head_dim) == (128, 16, 128)
    assert config.index_n_heads == config.num_key_value_heads == 2
    assert config.layer_types == ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"]
    assert config.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert (config.attention_mode, config.index_dtype) == ("sparse", "float8_e4m3fn")
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[1].block_sparse_moe.gate.weight.dtype == torch.float32
    assert len(tokenizer) == config.vocab_size <= 2048

    # the exported weights are the trained fp32 weights rounded to bf16
    trained = torch.load(smoke_run / train_tiny.STATE_DIRECTORY / "state.pt", weights_only=False)["model"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name].to(tensor.dtype)), name

    # a retrieval prompt runs through both modes; within 16 pages sparse attention equals dense
    prompt = "The value of amber-anchor is 12345.\n" * 20 + "Question: What is the value of amber-anchor?\nAnswer:"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    model = model.float()
    with torch.no_grad():
        with attention_mode(model, "dense"):
            dense = model(ids).logits
        sparse = model(ids, output_page_selections=True)
    torch.testing.assert_close(sparse.logits, dense, atol=1e-4, rtol=1e-4)
    assert sparse.page_selections[0].shape == (1, ids.shape[1], 2, 16)


def test_resume_continues_exactly(smoke_run, tmp_path):
    output = tmp_path / "resumed"
    assert train_tiny.main(["--smoke", "--output", str(output), "--device", "cpu", "--stage", "1", "--max-steps", "3"]) == 0
    interrupted = log_records(output)
    assert interrupted[-1]["event"] == "command_stop" and "--max-steps" in interrupted[-1]["reason"]
    assert not json.loads((output / train_tiny.SUMMARY_FILE).read_text())["complete"]
    AutoModelForCausalLM.from_pretrained(output)  # every command leaves a loadable model
    assert train_tiny.main(["--smoke", "--output", str(output), "--device", "cpu", "--stage", "1", "--resume"]) == 0
    resumed = without_timing(log_records(output))
    uninterrupted = without_timing(log_records(smoke_run))
    stage_one = next(i for i, r in enumerate(uninterrupted) if r["event"] == "stage_end" and r["stage"] == 1) + 1
    assert resumed == uninterrupted[:stage_one]


def test_a_resume_marks_the_records_it_redoes_and_never_cuts_the_log(tmp_path):
    output = tmp_path / "run"
    assert train_tiny.main(["--smoke", "--output", str(output), "--device", "cpu", "--stage", "1", "--max-steps", "3"]) == 0
    log = output / train_tiny.LOG_FILE
    with open(log, "a", encoding="utf-8") as handle:  # a record after the checkpoint, then one a kill cut short
        handle.write(json.dumps({"event": "train", "stage": 1, "step": 999, "loss": 1.0}) + "\n")
        handle.write('{"event": "train", "st')
    before = log.read_bytes()
    assert train_tiny.main(["--smoke", "--output", str(output), "--device", "cpu", "--stage", "1", "--max-steps", "1",
                            "--resume"]) == 0
    after = log.read_bytes()
    assert after.startswith(before)  # every byte kept
    raw = [json.loads(line) for line in after[len(before):].decode().splitlines() if line.strip()]
    marker = raw[0]
    assert marker["event"] == "superseded" and marker["to_byte"] == len(before) + 1  # the cut record's line ended
    records = log_records(output)
    assert not any(r.get("step") == 999 for r in records) and all(r["event"] != "superseded" for r in records)
    assert [r["event"] for r in records].count("command_start") == 2


def test_resuming_under_a_changed_plan_is_logged(smoke_run, tmp_path, monkeypatch):
    finished = tmp_path / "finished"
    shutil.copytree(smoke_run, finished)
    monkeypatch.setattr(train_tiny, "SMOKE_PLAN", dataclasses.replace(train_tiny.SMOKE_PLAN, log_every=2))
    assert train_tiny.main(["--smoke", "--output", str(finished), "--device", "cpu", "--resume"]) == 0
    changes = [r for r in log_records(finished) if r["event"] == "plan_changed"]
    assert [(c["fields"], c["before"], c["after"]) for c in changes] == [(["log_every"], {"log_every": 1}, {"log_every": 2})]


def test_refusals(smoke_run, tmp_path):
    with pytest.raises(ValueError, match="already holds a training state"):
        train_tiny.run_command(["--smoke", "--output", str(smoke_run), "--device", "cpu"])
    with pytest.raises(ValueError, match="no training state"):
        train_tiny.run_command(["--smoke", "--output", str(tmp_path / "empty"), "--device", "cpu", "--resume"])
    with pytest.raises(ValueError, match="needs stage 1 complete"):
        train_tiny.run_command(["--smoke", "--output", str(tmp_path / "fresh"), "--device", "cpu", "--stage", "2"])
    finished = tmp_path / "finished"
    shutil.copytree(smoke_run, finished)
    with pytest.raises(ValueError, match="plan 'smoke' with seed"):
        train_tiny.run_command(["--smoke", "--output", str(finished), "--device", "cpu", "--resume", "--seed", "7"])
    with pytest.raises(SystemExit):
        train_tiny.run_command(["--smoke", "--output", str(tmp_path / "bad"), "--stage", "4"])


def test_a_new_run_never_writes_into_a_directory_that_holds_something(smoke_run, tmp_path):
    """An exported model (no training state) or any other non-empty directory is refused before anything is
    written: its weights, log, README and summary stay byte for byte."""
    exported = tmp_path / "exported"
    shutil.copytree(smoke_run, exported, ignore=shutil.ignore_patterns(train_tiny.STATE_DIRECTORY))
    before = {path: path.read_bytes() for path in exported.rglob("*") if path.is_file()}
    assert (exported / train_tiny.LOG_FILE) in before
    with pytest.raises(ValueError, match="is not empty"):
        train_tiny.run_command(["--smoke", "--output", str(exported), "--device", "cpu", "--max-steps", "0"])
    assert {path: path.read_bytes() for path in exported.rglob("*") if path.is_file()} == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="is not empty"):
        train_tiny.run_command(["--smoke", "--output", str(other), "--device", "cpu", "--max-steps", "0"])
    assert (other / "notes.txt").read_text() == "keep" and sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_time_budget_stops_before_a_step_and_exports(tmp_path):
    output = tmp_path / "budget"
    assert train_tiny.main(["--smoke", "--output", str(output), "--device", "cpu", "--max-minutes", "0.01"]) == 0
    stop = log_records(output)[-1]
    assert stop["event"] == "command_stop" and "--max-minutes" in stop["reason"] and stop["at"]["stage_step"] == 0
    AutoModelForCausalLM.from_pretrained(output)


def test_optional_language_model_loss_adds_the_weighted_next_token_loss():
    import random

    from eval.synthetic_retrieval import RetrievalDataGenerator, build_retrieval_tokenizer

    tokenizer = build_retrieval_tokenizer(4096)
    torch.manual_seed(0)
    model = MiniMaxM3ForCausalLM(train_tiny.tiny_model_config(len(tokenizer)))
    batch = RetrievalDataGenerator(tokenizer, train_tiny.SMOKE_PLAN.data).sample_batch(random.Random(0), 512, 2)
    with torch.no_grad(), attention_mode(model, "dense"):
        answers_only = train_tiny.answer_loss(model, batch)
        combined = train_tiny.answer_loss(model, batch, lm_loss_weight=0.25)
        language_model = model(batch.input_ids, labels=batch.input_ids).loss  # transformers' shifted LM loss
        logits, _ = train_tiny.answer_logits(model, batch)
    torch.testing.assert_close(answers_only, torch.nn.functional.cross_entropy(logits, batch.answer_tokens))
    torch.testing.assert_close(combined, answers_only + 0.25 * language_model)
