"""eval.synthetic_retrieval: exact lengths, answers far from the questions, the bundled task's wording and
tokenization, determinism from the seed."""

import random
from pathlib import Path

import pytest
import torch

from eval.synthetic_retrieval import (
    RetrievalDataConfig,
    RetrievalDataGenerator,
    build_retrieval_tokenizer,
    tokenizer_training_texts,
)
from eval.tasks.make_retrieval import QUESTION

TASK_DIRECTORY = Path(__file__).resolve().parents[1] / "eval" / "tasks"


@pytest.fixture(scope="module")
def tokenizer():
    return build_retrieval_tokenizer(65536)


@pytest.fixture(scope="module")
def generator(tokenizer):
    return RetrievalDataGenerator(tokenizer, RetrievalDataConfig(queries=4, max_pairs=64, min_answer_distance=256))


def test_tokenizer_is_small_deterministic_and_splits_digits(tokenizer):
    assert len(tokenizer) <= 2048
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("is 40213.")) == ["is", "Ġ", "4", "0", "2", "1", "3", "."]
    assert build_retrieval_tokenizer(65536).get_vocab() == tokenizer.get_vocab()
    assert tokenizer_training_texts() == tokenizer_training_texts()


def test_batches_are_deterministic_in_the_seed(generator):
    first = generator.sample_batch(random.Random("seed/1"), 2048, 3)
    again = generator.sample_batch(random.Random("seed/1"), 2048, 3)
    other = generator.sample_batch(random.Random("seed/2"), 2048, 3)
    for name, value in vars(first).items():
        assert (torch.equal(value, getattr(again, name)) if isinstance(value, torch.Tensor)
                else value == getattr(again, name)), name
    assert not torch.equal(first.input_ids, other.input_ids)


@pytest.mark.parametrize("length", [1024, 4096, 16384])
def test_answers_are_copies_of_lines_far_before_the_questions(generator, tokenizer, length):
    batch = generator.sample_batch(random.Random(f"far/{length}"), length, 4)
    assert batch.input_ids.shape == (4, length)
    assert set(batch.query_task) <= {"key_value", "passkey"}
    ids = batch.input_ids
    first_question = {}
    for query in range(batch.num_queries):
        sequence = int(batch.query_sequence[query])
        needle, answer = int(batch.needle_position[query]), int(batch.query_answer_position[query])
        assert ids[sequence, needle : needle + 5].tolist() == ids[sequence, answer : answer + 5].tolist()
        # the answer's line starts at least min_answer_distance tokens before the first question of its document
        question_start = answer - len(generator.question_heads[0]) if batch.query_task[query] == "key_value" else \
            answer - len(generator.passkey_question)
        first_question[sequence] = min(first_question.get(sequence, length), question_start)
    for query in range(batch.num_queries):
        sequence = int(batch.query_sequence[query])
        assert first_question[sequence] - int(batch.needle_position[query]) >= 256
    # five answer tokens per query, each pointing at its query's answer digits
    assert batch.answer_position.numel() == 5 * batch.num_queries
    assert torch.equal(batch.answer_position, batch.query_answer_position[batch.answer_query] + torch.arange(5).repeat(batch.num_queries))
    if length >= 4096:  # at long lengths most answers lie beyond the 16 most recent pages of 128 tokens
        distances = batch.query_answer_position - batch.needle_position
        assert (distances > 16 * 128).float().mean() > 0.5


def test_lines_and_questions_are_the_bundled_task_and_encode_canonically(generator, tokenizer):
    from eval.tasks import load_task_yaml

    task = load_task_yaml(TASK_DIRECTORY / "m3_kv_retrieval_long.yaml")
    assert task["doc_to_text"] == "{{context}}" + QUESTION.replace("{key}", "{{key}}")
    batch = generator.sample_batch(random.Random("text"), 4096, 2)
    for query in range(batch.num_queries):
        if batch.query_task[query] != "key_value":
            continue
        sequence, answer = int(batch.query_sequence[query]), int(batch.query_answer_position[query])
        question_ids = batch.input_ids[sequence, answer - len(generator.question_heads[0]) : answer + 6].tolist()
        text = tokenizer.decode(question_ids)
        assert text.startswith("Question: What is the value of ") and text.endswith("\n")
        assert tokenizer.encode(text) == question_ids
        key = text[len("Question: What is the value of ") : text.index("?")]
        value = text.rsplit(" ", 1)[1].strip()
        needle = int(batch.needle_position[query])
        line_ids = batch.input_ids[sequence, needle - len(tokenizer.encode(f"The value of {key} is ")) : needle + 7].tolist()
        assert tokenizer.decode(line_ids) == f"The value of {key} is {value}.\n"
        assert tokenizer.encode(f"The value of {key} is {value}.\n") == line_ids


def test_configuration_errors_name_the_field(generator, tokenizer):
    with pytest.raises(ValueError, match="max_pairs"):
        RetrievalDataConfig(queries=8, max_pairs=4)
    with pytest.raises(ValueError, match="task_weights"):
        RetrievalDataConfig(task_weights=(0, 0))
    with pytest.raises(ValueError, match="too short"):
        generator.sample_batch(random.Random(0), 300, 1)
    from eval.default_model import build_tokenizer

    with pytest.raises(ValueError, match="piecewise"):  # a tokenizer that merges digits
        RetrievalDataGenerator(build_tokenizer(["The value of x is 12345.\n" * 50]))
