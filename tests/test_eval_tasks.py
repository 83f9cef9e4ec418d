"""The bundled lm-eval tasks: reproducible data, small files, public-domain text, loadable offline from any cwd."""

import json

import pytest

from eval.tasks import BUNDLED_TAG, TASK_DIRECTORY, bundled_task_names
from eval.tasks.make_retrieval import VARIANTS, write_variant
from eval_isolation import isolate, no_network


def test_generator_reproduces_the_shipped_retrieval_data(tmp_path):
    for variant in VARIANTS:
        regenerated = write_variant(variant, tmp_path)
        assert regenerated.read_bytes() == variant.path.read_bytes(), f"{variant.path.name}: run python -m eval.tasks.make_retrieval"


def test_bundled_data_is_small():
    total = sum(path.stat().st_size for path in (TASK_DIRECTORY / "data").iterdir())
    assert total < 1_000_000, total


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_retrieval_documents_are_answerable_only_by_reading(variant):
    documents = [json.loads(line) for line in variant.path.read_text().splitlines()]
    assert len(documents) == variant.num_documents
    depths = []
    for document in documents:
        lines = document["context"].splitlines()[1:]
        pairs = dict(line[len("The value of "):-1].split(" is ") for line in lines)
        assert len(pairs) == variant.num_pairs  # distinct keys
        choices = document["choices"]
        assert len(set(choices)) == 4 and all(choice in pairs.values() for choice in choices)
        assert choices[document["answer"]] == pairs[document["key"]]
        depths.append(document["depth"])
    assert min(depths) == 0.0 and max(depths) == 1.0
    if variant.name == "long":
        # more than 2048 words, so more than M3's 16 x 128-token window under any tokenizer of words or finer
        assert min(len(d["context"].split()) for d in documents) > 2048


def test_perplexity_text_is_public_domain_prose():
    records = [json.loads(line) for line in (TASK_DIRECTORY / "data" / "public_domain.jsonl").read_text().splitlines()]
    assert len(records) >= 5
    assert all(record["year"] < 1929 for record in records)  # US public domain by publication date
    assert records[0]["text"].startswith("It is a truth universally acknowledged")
    assert sum(len(record["text"].split()) for record in records) > 2000


def test_bundled_tasks_load_offline_from_any_directory_without_a_datasets_cache(tmp_path, monkeypatch):
    isolate(monkeypatch, tmp_path)
    no_network(monkeypatch)
    from eval.offline import enforce_offline

    enforce_offline()
    from lm_eval.tasks import TaskManager

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # data paths relative to the current directory would point nowhere
    assert sorted(bundled_task_names()) == ["m3_kv_retrieval_long", "m3_kv_retrieval_short", "m3_pd_perplexity"]
    manager = TaskManager(include_path=str(TASK_DIRECTORY), include_defaults=False)
    loaded = manager.load([BUNDLED_TAG])["tasks"]
    sizes = {name: len(list(task.test_docs())) for name, task in loaded.items()}
    assert sizes == {"m3_kv_retrieval_short": 64, "m3_kv_retrieval_long": 24, "m3_pd_perplexity": 6}
    assert list(elsewhere.iterdir()) == []  # nothing written where the process runs
    short = loaded["m3_kv_retrieval_short"]
    document = next(iter(short.test_docs()))
    assert short.doc_to_text(document).endswith(f"What is the value of {document['key']}?\nAnswer:")
    assert short.doc_to_choice(document) == document["choices"]


def test_a_missing_bundled_data_file_is_named(monkeypatch, tmp_path):
    from eval.tasks import bundled_data

    monkeypatch.setattr(bundled_data, "DATA_DIRECTORY", tmp_path)
    with pytest.raises(FileNotFoundError, match="kv_retrieval_short.jsonl"):
        bundled_data.kv_retrieval_short()
