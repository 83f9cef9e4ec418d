"""The shipped trained tiny model and the per-length retrieval evaluation (``eval.retrieval_accuracy``), on CPU."""

import json
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import minimax_m3  # noqa: F401  (registers the Auto classes)
from eval import retrieval_accuracy as ra
from eval.recall import indexer_recall
from eval.synthetic_retrieval import RetrievalDataConfig, RetrievalDataGenerator
from eval.trained_model import trained_model_dir


@pytest.fixture(scope="module")
def trained():
    path = trained_model_dir()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def test_shipped_checkpoint_is_small_and_has_its_card():
    path = trained_model_dir()
    assert sum(f.stat().st_size for f in path.iterdir()) <= 3 * 1024 * 1024
    card = (path / "README.md").read_text()
    assert "python -m eval.train_tiny" in card and "| after stage |" in card
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "minimax_m3" and config["tie_word_embeddings"] is True
    summary = json.loads((path / "training_summary.json").read_text())
    assert {"1", "2"} <= set(summary["stages"])


def test_trained_indexer_selects_the_pass_key_page_and_the_model_answers(trained):
    model, tokenizer = trained
    generator = RetrievalDataGenerator(tokenizer, RetrievalDataConfig(queries=1, max_pairs=1, min_answer_distance=2048,
                                                                      task_weights=(0, 1)))
    ids, [(task, needle, answer_start)] = generator.sample_document(random.Random(5), 3072)
    assert task == "passkey" and answer_start - needle > 16 * 128  # outside the 16 most recent pages
    input_ids = torch.tensor([ids[:answer_start]])
    value = torch.tensor(ids[answer_start: answer_start + 5])
    with torch.no_grad():
        model.config.attention_mode = "sparse"
        output = model(input_ids, output_page_selections=True)
    needle_page = needle // 128
    for selection in output.page_selections:  # [1, T, groups, 16] per sparse layer
        question = selection[0, -1]
        assert (question == needle_page).any(), f"no KV group of the question's last token selected page {needle_page}"
        assert (question[:, -1] == (answer_start - 1) // 128).all()  # the local page, forced into the last slot
    assert int(output.logits[0, -1].argmax()) == int(value[0])  # the first digit of the pass key, read sparsely

    recalls = indexer_recall(model, input_ids)
    assert [r.layer for r in recalls] == [1, 2]
    for layer in recalls:
        assert 0.0 < layer.recall <= 1.0 + 1e-6 and layer.recall_beyond_topk is not None
        assert layer.rows_beyond_topk == 2 * (answer_start - 16 * 128)  # 2 KV groups x tokens with > 16 pages


def test_documents_are_deterministic_and_well_formed(trained):
    _, tokenizer = trained
    documents = ra.make_documents(tokenizer, 1024, 3, seed=7)
    assert documents == ra.make_documents(tokenizer, 1024, 3, seed=7)
    assert [d["task"] for d in documents] == ["key_value"] * 3 + ["passkey"] * 3
    for document in documents:
        assert document["context"].endswith("Answer:")
        assert len(document["choices"]) == ra.NUM_CHOICES == len(set(document["choices"]))
        value = document["choices"][document["answer"]]
        if document["task"] == "key_value":
            key = re.search(r"What is the value of (\S+)\?", document["context"]).group(1)
            assert f"The value of {key} is {value}." in document["context"]
            assert all(f"is {other}." in document["context"] for other in document["choices"])  # in-document values
        else:
            assert f"The pass key is {value}." in document["context"]
        assert document["needle_distance"] >= ra.DATA_CONFIG.min_answer_distance


def test_encode_pair_is_lm_evals(trained):
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = trained
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1)
    for context, continuation in [("Question: What is the pass key?\nAnswer:", " 12345"), ("a b ", "c"), ("x", " 9")]:
        assert ra.encode_pair(tokenizer, context, continuation) == tuple(lm._encode_pair(context, continuation))


@pytest.mark.parametrize("variant", ["dense", "sparse"])
def test_own_loop_gives_lm_evals_numbers(trained, tmp_path, variant):
    """The GPU report's scoring loop and lm-eval, on the same documents: the same log-likelihoods and answers."""
    pytest.importorskip("lm_eval")
    from eval.accuracy import TaskSession, run_lm_eval

    model, tokenizer = trained
    documents = ra.make_documents(tokenizer, 512, 2, seed=3)
    ra.retrieval_length_task(tmp_path, "m3_retrieval_test_512", documents)
    with ra.variant(model, variant) as configured:
        ours = ra.evaluate_variant(configured, tokenizer, documents, variant)
    session = TaskSession(["m3_retrieval_test_512"], [tmp_path])
    with ra.variant(model, variant) as configured:
        results = run_lm_eval(configured, tokenizer, ["m3_retrieval_test_512"], session, limit=None, batch_size=1,
                              max_length=4096, num_fewshot=None, bootstrap_iters=0)
    samples = sorted(results["samples"]["m3_retrieval_test_512"], key=lambda s: s["doc_id"])
    theirs = [[float(r[0]) for r in sample["filtered_resps"]] for sample in samples]
    torch.testing.assert_close(torch.tensor(ours["loglikelihoods"]), torch.tensor(theirs), atol=1e-4, rtol=1e-5)
    assert ours["correct"] == [bool(sample["acc"]) for sample in samples]
    their_greedy = [bool(sample["filtered_resps"][document["answer"]][1]) for sample, document in zip(samples, documents)]
    assert ours["greedy"] == their_greedy


def test_report_and_json_schema(trained, tmp_path):
    model, tokenizer = trained
    result = ra.evaluate_retrieval_accuracy(model, tokenizer, lengths=(512,), documents=1,
                                            variants=("dense", "sliding-window"), recall_documents=1,
                                            show_progress=False)
    assert result["complete"] and result["variants"] == ["dense", "sliding-window"]
    summary = result["lengths"][512]["sliding-window"]
    assert set(summary["by_task"]) == {"key_value", "passkey"} and summary["documents"] == 2
    assert summary["versus_dense"]["mcnemar_p"] == pytest.approx(1.0)  # 512 tokens: the window holds every page
    assert summary["greedy_versus_dense"]["mcnemar_p"] == pytest.approx(1.0)
    per_document = result["correct"][512]
    assert per_document["dense"] == per_document["sliding-window"]  # every page kept: the same outcomes
    assert all(len(values) == 2 and all(isinstance(v, bool) for v in values) for values in per_document["dense"].values())
    assert [layer["recall"] for layer in summary["recall"]] == pytest.approx([1.0, 1.0])
    assert [layer["recall_at_answer"] for layer in summary["recall"]] == pytest.approx([1.0, 1.0])
    table = ra.accuracy_table(result)
    assert table.splitlines()[0].startswith("| length | task") and "sliding-window" in table
    assert "| 512" in ra.recall_table(result)
    path = ra.plot(result, tmp_path / "plot.png")
    assert path is None or path.stat().st_size > 0


def test_an_interrupted_command_keeps_its_finished_lengths(tmp_path, monkeypatch):
    """Ctrl-C while the second length runs: the first length is on disk as valid JSON, marked not complete."""
    output = tmp_path / "retrieval.json"
    make_documents = ra.make_documents

    def interrupted_at_the_second_length(tokenizer, length, *args, **kwargs):
        if length == 640:
            raise KeyboardInterrupt
        return make_documents(tokenizer, length, *args, **kwargs)

    monkeypatch.setattr(ra, "make_documents", interrupted_at_the_second_length)
    with pytest.raises(KeyboardInterrupt):
        ra.run_command(["--lengths", "512,640", "--documents", "1", "--variants", "dense", "--recall-documents", "0",
                        "--device", "cpu", "--output", str(output)])
    written = json.loads(output.read_text())
    assert written["complete"] is False and list(written["lengths"]) == ["512"] and written["model"]
    assert set(written["lengths"]["512"]) == {"dense"} and list(written["documents"]) == ["512"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["retrieval.json"]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="variant"):
        with ra.variant(None, "banana"):
            pass
    with pytest.raises(ValueError, match="task"):
        ra.make_documents(None, 1024, 1, tasks=("trivia",))


def test_untrained_indexer_variant_reinitialises_in_place_and_restores(trained):
    model, _ = trained
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with ra.variant(model, "untrained-indexer") as configured:
        assert configured is model and model.config.attention_mode == "sparse"
        changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
        assert changed and all("index_" in name for name in changed)
        assert {name.split(".")[-2] for name in changed} == {"index_q_proj", "index_k_proj", "index_q_norm",
                                                              "index_k_norm"}
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
