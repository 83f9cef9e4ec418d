"""eval.accuracy on the embedded tiny model with the bundled tasks: end to end, offline, sparse == dense where it
must be, and the pieces (mode switching, result pairing, logit agreement)."""

import json

import pytest
import torch

from eval import accuracy, default_model
from eval.logit_agreement import agreement_sequences, logit_agreement
from eval.modes import attention_mode, indexer_backends_in_use, set_attention_mode
from eval.offline import OFFLINE_SWITCHES
from eval_isolation import isolate, no_network


@pytest.fixture(scope="module")
def eval_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-accuracy")
    with pytest.MonkeyPatch.context() as patch:
        isolate(patch, root)
        default_model.ensure_default_model()
        yield root


@pytest.fixture
def isolated(eval_root, monkeypatch):
    isolate(monkeypatch, eval_root)
    return eval_root


@pytest.fixture
def tiny(isolated):
    return default_model.load_default_model()


def test_accuracy_command_end_to_end_offline(isolated, monkeypatch, capsys):
    no_network(monkeypatch)
    output = isolated / "accuracy.json"
    result = accuracy.run_command(["--model", "embedded", "--limit", "6", "--agreement-sequences", "2",
                                   "--agreement-positions", "32", "--retrieval-lengths", "none", "--output", str(output)])
    assert all(__import__("os").environ[name] == "1" for name in OFFLINE_SWITCHES)

    saved = json.loads(output.read_text())
    assert saved["kind"] == "accuracy" and saved["modes"] == ["sparse", "dense"] and saved["partial"] is False
    assert saved["tasks"] == list(accuracy.DEFAULT_TASKS_EMBEDDED) and saved["limit"] == 6
    assert saved["model"] == "embedded default" and saved["dtype"] == "float32" and saved["retrieval_by_length"] is None
    retrieval = saved["comparison"]["m3_kv_retrieval_short"]["acc"]
    assert set(retrieval) == {"sparse", "dense", "difference", "paired"}
    assert retrieval["difference"] == pytest.approx(retrieval["sparse"] - retrieval["dense"])
    paired = retrieval["paired"]
    assert set(paired) == {"samples", "both_correct", "only_sparse_correct", "only_dense_correct", "both_wrong", "p_value"}
    assert paired["samples"] == 6 == paired["both_correct"] + paired["only_sparse_correct"] + paired["only_dense_correct"] + paired["both_wrong"]
    assert 0.0 <= paired["p_value"] <= 1.0
    perplexity = saved["comparison"]["m3_pd_perplexity"]
    assert set(perplexity) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert all(row["paired"] is None and row["sparse"] > 0 and row["dense"] > 0 for row in perplexity.values())

    agreement = saved["logit_agreement"]
    assert agreement["length"] == 4 * 4 * 16 and agreement["topk_window_tokens"] == 64 and agreement["sequences"] == 2
    within, beyond = agreement["within_topk"], agreement["beyond_topk"]
    assert within["max_abs_logit_diff"] < 1e-5 and within["top1_agreement"] == 1.0  # all pages kept: sparse == dense
    assert beyond["max_abs_logit_diff"] > 1e-3 and beyond["kl_max"] > 0  # pages dropped: the modes really differ
    assert result["comparison"] == saved["comparison"]

    printed = capsys.readouterr().out
    assert "| task" in printed and "| sparse" in printed and "McNemar p" in printed
    assert "Δ (sparse − dense)" in printed and "only sparse / only dense correct" in printed
    retrieval_row = next(line for line in printed.splitlines() if line.startswith("| m3_kv_retrieval_short"))
    cells = [cell.strip() for cell in retrieval_row.strip("|").split("|")]
    assert cells[:2] == ["m3_kv_retrieval_short", "acc"] and cells[5] == "6"
    assert f"{paired['p_value']:.3g}" == cells[7]
    assert "(all pages kept)" in printed and "(pages dropped)" in printed


def test_default_model_is_the_trained_one_with_the_retrieval_by_length_report(isolated, monkeypatch, capsys):
    no_network(monkeypatch)
    from eval.trained_model import trained_model_dir

    output = isolated / "accuracy-default-model.json"
    accuracy.run_command(["--limit", "2", "--agreement-length", "0", "--retrieval-lengths", "1024",
                          "--retrieval-documents", "1", "--output", str(output)])
    saved = json.loads(output.read_text())
    assert saved["model"] == str(trained_model_dir()) and saved["tasks"] == list(accuracy.DEFAULT_TASKS_EMBEDDED)
    retrieval = saved["retrieval_by_length"]
    assert list(retrieval["lengths"]) == ["1024"] and retrieval["variants"][0] == "dense"
    assert set(retrieval["lengths"]["1024"]) == {"dense", "sparse", "sparse-bf16-index", "untrained-indexer",
                                                 "sliding-window"}
    printed = capsys.readouterr().out
    assert "Retrieval accuracy per context length" in printed and "Indexer recall" in printed


INTERRUPTIBLE = ["--model", "embedded", "--tasks", "m3_kv_retrieval_short", "--limit", "2", "--agreement-length", "0"]


def test_an_interrupted_run_keeps_the_finished_mode(isolated, monkeypatch, capsys):
    """Ctrl-C during the second mode's lm-eval run: valid JSON marked partial, with the first mode's metrics."""
    no_network(monkeypatch)
    output = isolated / "accuracy-interrupted-mode.json"
    real_run, calls = accuracy.run_lm_eval, []

    def interrupted_second_mode(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)

    monkeypatch.setattr(accuracy, "run_lm_eval", interrupted_second_mode)
    with pytest.raises(SystemExit) as exited:
        accuracy.run_command([*INTERRUPTIBLE, "--retrieval-lengths", "none", "--output", str(output)])
    assert exited.value.code == 130
    assert "interrupted: the finished parts are in" in capsys.readouterr().err
    written = json.loads(output.read_text())
    assert written["partial"] is True and written["kind"] == "accuracy" and written["model"] == "embedded default"
    assert list(written["metrics_by_mode"]) == ["sparse"] and list(written["lm_eval_seconds"]) == ["sparse"]
    assert 0.0 <= written["metrics_by_mode"]["sparse"]["m3_kv_retrieval_short"]["acc"] <= 1.0
    assert "comparison" not in written and written["environment"]


def test_an_interrupted_retrieval_report_keeps_the_comparison_and_the_finished_lengths(isolated, monkeypatch, capsys):
    """Ctrl-C after the first retrieval length: the comparison and that length are on disk, marked partial."""
    from eval import retrieval_accuracy

    no_network(monkeypatch)
    output = isolated / "accuracy-interrupted-retrieval.json"

    def interrupted_after_one_length(model, tokenizer, *, lengths, after_length, **kwargs):
        after_length({"lengths": {lengths[0]: {"dense": {"accuracy": 1.0}}}, "complete": False})
        raise KeyboardInterrupt

    monkeypatch.setattr(retrieval_accuracy, "evaluate_retrieval_accuracy", interrupted_after_one_length)
    with pytest.raises(SystemExit) as exited:
        accuracy.run_command([*INTERRUPTIBLE, "--retrieval-lengths", "1024,2048", "--output", str(output)])
    assert exited.value.code == 130
    written = json.loads(output.read_text())
    assert written["partial"] is True and set(written["comparison"]) == {"m3_kv_retrieval_short"}
    assert written["retrieval_by_length"] == {"lengths": {"1024": {"dense": {"accuracy": 1.0}}}, "complete": False}


def test_lm_eval_gives_identical_results_when_every_position_keeps_all_its_pages(tiny):
    model, tokenizer = tiny
    model.config.index_topk_blocks = 48  # 768 tokens: the short retrieval prompts have at most 660
    result = accuracy.evaluate_accuracy(model, tokenizer, tasks=["m3_kv_retrieval_short"], limit=8, agreement_length=0)
    retrieval = result["comparison"]["m3_kv_retrieval_short"]["acc"]
    assert retrieval["difference"] == 0 and retrieval["paired"]["samples"] == 8
    assert retrieval["paired"]["only_sparse_correct"] == retrieval["paired"]["only_dense_correct"] == 0
    assert retrieval["paired"]["p_value"] == 1.0
    assert result["logit_agreement"] is None


def test_sparse_equals_dense_to_fp32_rounding_on_short_inputs(tiny):
    model, _ = tiny
    window = model.config.index_topk_blocks * model.config.index_block_size
    ids = torch.randint(3, model.config.vocab_size, (2, window), generator=torch.Generator().manual_seed(0))
    logits = {}
    for mode in ("sparse", "dense"):
        with attention_mode(model, mode), torch.no_grad():
            logits[mode] = model(ids).logits
    torch.testing.assert_close(logits["sparse"], logits["dense"], atol=1e-5, rtol=0)


def test_logit_agreement_rejects_inputs_inside_the_window(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="must exceed topk"):
        logit_agreement(model, agreement_sequences(tokenizer, model.config.vocab_size, 64, 1))


def test_switching_modes_leaves_no_page_selector_state_behind(tiny):
    model, _ = tiny
    ids = torch.randint(3, model.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(1))
    set_attention_mode(model, "sparse-torch")
    with torch.no_grad():
        model(ids)
    used = model.model.page_selector
    assert used._score_storage and indexer_backends_in_use(model) == ["torch"]
    set_attention_mode(model, "sparse")
    assert model.model.page_selector is not used and not model.model.page_selector._score_storage
    assert model.config.indexer_backend == "auto" and model.model.page_selector.config is model.config
    with attention_mode(model, "dense"):
        assert all(layer.self_attn.config.attention_mode == "dense" for layer in model.model.layers)
    assert model.config.attention_mode == "sparse" and model.config.indexer_backend == "auto"  # restored
    with pytest.raises(ValueError, match="mode must be one of"):
        set_attention_mode(model, "linear")


def _samples(values, metric="acc", filter_name="none"):
    return [{"doc_id": i, "filter": filter_name, "metrics": [metric], metric: v} for i, v in enumerate(values)]


def test_compare_modes_pairs_samples_by_doc_id_and_skips_perplexity_samples():
    sparse = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A"},
                          "p": {"word_perplexity,none": 10.0}},
              "samples": {"t": _samples([1, 0, 1, 0]), "p": [{"doc_id": 0, "filter": "none", "metrics": ["word_perplexity"],
                                                              "word_perplexity": (-3.0, 2)}]}}
    dense = {"results": {"t": {"alias": "t", "acc,none": 0.25}, "p": {"word_perplexity,none": 9.0}},
             # lm-eval may list samples in another order: pairing is by doc_id
             "samples": {"t": list(reversed(_samples([1, 0, 0, 0]))), "p": []}}
    comparison = accuracy.compare_modes(sparse, dense, ("sparse", "dense"))
    row = comparison["t"]["acc"]
    assert row["difference"] == pytest.approx(0.25)
    assert row["paired"] == {"samples": 4, "both_correct": 1, "only_sparse_correct": 1, "only_dense_correct": 0,
                             "both_wrong": 2, "p_value": 1.0}
    assert comparison["p"]["word_perplexity"] == {"sparse": 10.0, "dense": 9.0, "difference": 1.0, "paired": None}
    table = accuracy.accuracy_table(comparison, ("sparse", "dense"))
    assert "| t " in table and "1 / 0" in table


def test_unknown_task_is_a_clear_error(isolated):
    with pytest.raises(ValueError, match="unknown task.*no_such_task"):
        accuracy.TaskSession(["m3_kv_retrieval_short", "no_such_task"])


@pytest.mark.parametrize("value", ["0", "2048,x", ""])
def test_bad_retrieval_lengths_name_the_argument(value, capsys):
    with pytest.raises(SystemExit):
        accuracy.build_parser().parse_args(["--retrieval-lengths", value])
    assert "--retrieval-lengths" in capsys.readouterr().err
