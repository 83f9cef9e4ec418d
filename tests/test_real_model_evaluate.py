"""eval.real_model's sparse-vs-dense evaluation on a tiny converted Llama and made-up prose: sparse equals dense
below the top-k pages' reach, the bootstrap and the documents are well formed, and the whole run reports."""

import random

import pytest
import torch

from eval.default_model import build_tokenizer
from eval.real_model import evaluate, report
from eval.stats import bootstrap_mean_interval
from minimax_m3.from_llama import convert_llama
from test_minimax_m3_from_llama import random_llama

WORDS = ("the river ran cold under a grey sky while the old man counted his boats and the children sang of summer "
         "far away beyond the hills where nobody had gone").split()


def prose(seed, paragraphs=40):
    rng = random.Random(seed)
    return "\n\n".join(" ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
                                for _ in range(4)) for _ in range(paragraphs))


@pytest.fixture(scope="module")
def setup():
    tokenizer = build_tokenizer(vocab_size=300)
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    llama = random_llama(vocab_size=len(tokenizer))
    model = convert_llama(llama, first_sparse_layer=1, index_block_size=4, index_topk_blocks=3)
    books = {"Book A": prose(1), "Book B": prose(2)}
    return model, tokenizer, books


def test_the_bootstrap_interval_covers_the_mean_and_narrows_with_more_units():
    rng = random.Random(0)
    few = [rng.gauss(1.0, 1.0) for _ in range(10)]
    many = [rng.gauss(1.0, 1.0) for _ in range(1000)]
    small, large = bootstrap_mean_interval(few), bootstrap_mean_interval(many)
    assert small["low"] < small["mean"] < small["high"] and large["low"] < 1.0 < large["high"]
    assert large["high"] - large["low"] < (small["high"] - small["low"]) / 3
    with pytest.raises(ValueError, match="at least 2 values"):
        bootstrap_mean_interval([1.0])


def test_position_losses_are_the_models_cross_entropy(setup):
    model, _, _ = setup
    ids = torch.randint(3, 300, (2, 30))
    losses = evaluate.position_losses(model, ids)
    with torch.no_grad():
        logits = model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    torch.testing.assert_close(losses, expected.view(2, 29), atol=1e-5, rtol=1e-5)


def test_documents_hold_the_answer_among_distinct_choices(setup):
    _, tokenizer, books = setup
    for document in evaluate.needle_documents(books, tokenizer, 200, 4):
        key = document["choices"][document["answer"]]
        assert len(set(document["choices"])) == evaluate.NEEDLE_CHOICES
        assert document["context"].count(key) == 2 and document["context"].endswith("The pass key is")
        assert 0 < document["needle_distance"] < len(tokenizer.encode(document["context"])) <= 200
    for document in evaluate.continuation_documents(books, tokenizer, 200, 4):
        true = document["choices"][document["answer"]]
        book = next(text for text in books.values() if document["context"] in text)
        following = book[book.index(document["context"]) + len(document["context"]):]
        assert " ".join(following.split()[:evaluate.CONTINUATION_WORDS]) == true
        assert len(set(document["choices"])) == evaluate.CONTINUATION_CHOICES
        assert max(len(tokenizer.encode(document["context"] + " " + c)) for c in document["choices"]) <= 200


def test_the_evaluation_reports_every_part_and_sparse_equals_dense_within_the_top_k_reach(setup):
    model, tokenizer, books = setup
    reports = []
    result = evaluate.evaluate_real_model(model, tokenizer, books, lengths=(256,), windows=4, documents=3,
                                          recall_documents=1, after_part=lambda r: reports.append(r["complete"]))
    assert reports == [False, False, False, True] and result["complete"]
    part = result["lengths"]["256"]
    assert part["perplexity"]["bucket"] == 12
    buckets = part["perplexity"]["buckets"]
    assert set(buckets) == set(evaluate.VARIANTS)
    for name in ("sparse", "sparse-bf16-index", "untrained-indexer", "sliding-window"):
        assert buckets[name]["0-12"]["max_abs_difference_to_dense"] < 1e-4  # every page is read there
        beyond = buckets[name]["beyond"]["versus_dense"]["difference"]
        assert beyond["units"] == 4 and beyond["low"] <= beyond["mean"] <= beyond["high"]
    assert buckets["untrained-indexer"]["12-24"]["max_abs_difference_to_dense"] > 0
    versus = buckets["sliding-window"]["beyond"]["versus_sparse"]
    assert versus["difference"]["low"] <= versus["difference"]["mean"] <= versus["difference"]["high"]
    assert versus["perplexity_ratio"] > 0 and isinstance(versus["excludes_zero"], bool)
    assert "versus_sparse" not in buckets["sparse"]["beyond"]
    recall = part["perplexity"]["recall"]["sparse"]
    assert [row["layer"] for row in recall] == [1, 2, 3] and all(0 < row["recall"] <= 1 + 1e-6 for row in recall)
    for kind in ("needle", "continuation"):
        summary = part[kind]["summary"]
        assert set(summary) == set(evaluate.VARIANTS) and summary["dense"]["documents"] == 3
        assert "mcnemar_p" in summary["sparse"]["versus_dense"]
    answer_recall = part["needle"]["summary"]["sparse"]["recall"]  # the answer's rows of the first document
    groups = model.config.num_key_value_heads
    assert all(0 < row["recall_at_answer"] <= 1 + 1e-6 and row["answer_rows"] > 0 and row["answer_rows"] % groups == 0
               for row in answer_recall)
    assert "recall at the answer" in report.summary_table(result)
    assert len(part["perplexity"]["profile"]["dense"]) == 1  # 255 predicted positions: one full 128-position bin


def test_unknown_or_missing_dense_variants_raise(setup):
    model, tokenizer, books = setup
    with pytest.raises(ValueError, match="must include 'dense'"):
        evaluate.evaluate_real_model(model, tokenizer, books, variants=("sparse",))
    with pytest.raises(ValueError, match="lengths must be ints >= 256"):
        evaluate.evaluate_real_model(model, tokenizer, books, lengths=(100,))
