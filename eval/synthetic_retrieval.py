"""Synthetic long-context retrieval data, generated on the fly from a seed, for training and evaluating the tiny model.

Two kinds of documents, both exactly ``length`` tokens long, so the sequences of a batch need no padding:

* **key-value** (multi-query): the bundled task's preamble, then a haystack of distractor text (paragraphs of the
  bundled public-domain prose, sampled with replacement) with ``The value of <key> is <value>.`` lines inserted at
  paragraph boundaries, then ``queries`` questions ``Question: What is the value of <key>?\\nAnswer: <value>``
  about some of the keys. The lines and the question are the bundled lm-eval task's (``eval/tasks``), so a model
  trained here reads that task's documents the same way.
* **passkey**: a preamble, the haystack with one ``The pass key is <value>. Remember it. <value> is the pass key.``
  line, then ``Question: What is the pass key?\\nAnswer: <value>``.

Keys are the bundled task's adjective-noun pairs (1,600 of them; distractor keys share words with the queried ones),
values five-digit numbers whose digits are single tokens. Every queried line starts at least
``min_answer_distance`` tokens before the questions, anywhere above that: at 4K-16K tokens most answers lie far
outside the 16 most recent pages. Only the answer digits are targets.

Documents are built from token ids of pre-encoded pieces (no tokenizer call per sample). The pieces are split at
digit boundaries, where the tokenizer's pre-tokenizer (individual digits, then byte-level) splits too, so a line's
ids are exactly the tokenizer's encoding of the line's text; the construction checks this and refuses a
tokenizer for which it fails. Only the end of a haystack cut to the exact length is not the canonical encoding.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import torch

from .tasks.make_retrieval import ADJECTIVES, KV_LINE, NOUNS, PREAMBLE, QUESTION

__all__ = [
    "TASKS",
    "RetrievalDataConfig",
    "RetrievalBatch",
    "RetrievalDataGenerator",
    "tokenizer_training_texts",
    "build_retrieval_tokenizer",
    "all_keys",
]

TASKS = ("key_value", "passkey")
VALUE_DIGITS = 5
KEY_VALUE_ANSWER_PREFIX = " "  # the question ends in "Answer:"; the value follows after one space (as lm-eval scores it)
PASSKEY_PREAMBLE = "There is a pass key hidden in the text below. Find it and remember it.\n"
PASSKEY_LINE = "The pass key is {value}. Remember it. {value} is the pass key.\n"
PASSKEY_QUESTION = "Question: What is the pass key?\nAnswer:"
TOKENIZER_VOCAB_SIZE = 1024
_PUBLIC_DOMAIN = Path(__file__).resolve().parent / "tasks" / "data" / "public_domain.jsonl"


def all_keys() -> list:
    return [f"{adjective}-{noun}" for adjective in ADJECTIVES for noun in NOUNS]


def _filler_paragraphs() -> list:
    """The bundled public-domain prose as paragraphs, each ending in one newline."""
    paragraphs = []
    with open(_PUBLIC_DOMAIN, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                text = json.loads(line)["text"]
                paragraphs.extend(p.strip() + "\n" for p in text.split("\n\n") if p.strip())
    return paragraphs


def tokenizer_training_texts(seed: int = 0) -> list:
    """Every key's line and question and a few pass-key lines (random values): what the BPE merges should cover
    beyond the bundled prose, which ``build_tokenizer`` always includes."""
    rng = random.Random(seed)
    keys = all_keys()

    def value() -> int:
        return rng.randrange(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS)

    lines = [PREAMBLE, PASSKEY_PREAMBLE]
    lines += [KV_LINE.format(key=key, value=value()) for key in keys]
    lines += [QUESTION.format(key=key) + f"{KEY_VALUE_ANSWER_PREFIX}{value()}\n" for key in keys]
    for _ in range(len(keys) // 4):
        lines.append(PASSKEY_LINE.format(value=value()) + PASSKEY_QUESTION + f"{KEY_VALUE_ANSWER_PREFIX}{value()}\n")
    return ["".join(lines)]


def build_retrieval_tokenizer(model_max_length: int):
    """The tiny model's tokenizer: the default model's byte-level BPE builder with individual digits, trained on
    the bundled prose and ``tokenizer_training_texts()`` (deterministic)."""
    from .default_model import build_tokenizer

    return build_tokenizer(tokenizer_training_texts(), vocab_size=TOKENIZER_VOCAB_SIZE, individual_digits=True,
                           model_max_length=model_max_length)


@dataclass(frozen=True)
class RetrievalDataConfig:
    """What the documents look like. ``task_weights`` are the relative frequencies of ``TASKS``."""

    queries: int = 4  # questions per key-value document
    max_pairs: int = 64  # key-value lines per document: uniform in [queries, max_pairs] (fewer if they do not fit)
    min_answer_distance: int = 256  # tokens from the start of a queried line to the first question, at least
    task_weights: tuple = (3, 1)

    def __post_init__(self):
        if self.queries < 1:
            raise ValueError(f"queries must be >= 1, got {self.queries}")
        if self.max_pairs < self.queries:
            raise ValueError(f"max_pairs ({self.max_pairs}) must be >= queries ({self.queries})")
        if self.max_pairs > len(ADJECTIVES) * len(NOUNS):
            raise ValueError(f"max_pairs must be at most {len(ADJECTIVES) * len(NOUNS)} (distinct keys), got {self.max_pairs}")
        if self.min_answer_distance < 0:
            raise ValueError(f"min_answer_distance must be >= 0, got {self.min_answer_distance}")
        if len(self.task_weights) != len(TASKS) or min(self.task_weights) < 0 or sum(self.task_weights) <= 0:
            raise ValueError(f"task_weights must be {len(TASKS)} non-negative weights (for {TASKS}), not all 0; "
                             f"got {self.task_weights}")


@dataclass
class RetrievalBatch:
    """``batch_size`` documents of one length and their answers.

    Answer token ``i`` is ``input_ids[answer_sequence[i], answer_position[i]]``, predicted from the position
    before it; it belongs to query ``answer_query[i]``. Per query: its task, the position of the first value
    token of the line that answers it (``needle_position``) and of its first answer token."""

    input_ids: torch.Tensor  # [B, L] int64
    answer_sequence: torch.Tensor  # [N] int64
    answer_position: torch.Tensor  # [N] int64
    answer_query: torch.Tensor  # [N] int64
    query_task: List[str]
    needle_position: torch.Tensor  # [Q] int64
    query_answer_position: torch.Tensor  # [Q] int64
    query_sequence: torch.Tensor  # [Q] int64

    @property
    def answer_tokens(self) -> torch.Tensor:
        return self.input_ids[self.answer_sequence, self.answer_position]

    @property
    def num_queries(self) -> int:
        return len(self.query_task)

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device) -> "RetrievalBatch":
        return RetrievalBatch(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                                 for name, value in vars(self).items()})


class RetrievalDataGenerator:
    """Samples ``RetrievalBatch`` es from a ``random.Random``; the same generator state gives the same batch."""

    def __init__(self, tokenizer, config: RetrievalDataConfig = RetrievalDataConfig()):
        self.config = config
        self.tokenizer = tokenizer
        self.keys = all_keys()
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        self.digit_ids = [self._single_token(tokenizer, str(d)) for d in range(10)]
        # KV_LINE and the questions split as <head><digits><tail>: heads and tails encode on their own
        line_head, line_tail = KV_LINE.split("{value}")
        self.line_heads = [encode(line_head.format(key=key)) for key in self.keys]
        self.line_tail = encode(line_tail)
        self.question_heads = [encode(QUESTION.format(key=key) + KEY_VALUE_ANSWER_PREFIX) for key in self.keys]
        self.newline = self._single_token(tokenizer, "\n")
        self.answer_tail = [self.newline]
        self.preamble = encode(PREAMBLE)
        self.passkey_preamble = encode(PASSKEY_PREAMBLE)
        passkey_head, passkey_middle, passkey_tail = PASSKEY_LINE.split("{value}")
        self.passkey_parts = (encode(passkey_head), encode(passkey_middle), encode(passkey_tail))
        self.passkey_question = encode(PASSKEY_QUESTION + KEY_VALUE_ANSWER_PREFIX)
        self.filler = [encode(paragraph) for paragraph in _filler_paragraphs()]
        self._check_pieces_compose(encode)

    @staticmethod
    def _single_token(tokenizer, text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer must encode {text!r} as one token (digits individually), got ids {ids}")
        return ids[0]

    def _check_pieces_compose(self, encode) -> None:
        digits = "12345"
        value_ids = [self.digit_ids[int(d)] for d in digits]
        key = self.keys[0]
        checks = (
            (KV_LINE.format(key=key, value=digits), self.line_heads[0] + value_ids + self.line_tail),
            (QUESTION.format(key=key) + KEY_VALUE_ANSWER_PREFIX + digits + "\n", self.question_heads[0] + value_ids + self.answer_tail),
            (PASSKEY_LINE.format(value=digits), self.passkey_parts[0] + value_ids + self.passkey_parts[1] + value_ids + self.passkey_parts[2]),
        )
        for text, pieces in checks:
            if encode(text) != pieces:
                raise ValueError(f"the tokenizer does not encode {text!r} piecewise at digit boundaries; it needs the "
                                 f"individual-digit pre-tokenizer of build_retrieval_tokenizer")

    # ------------------------------------------------------------------ sampling
    def _value(self, rng: random.Random) -> List[int]:
        digits = [rng.randrange(1, 10)] + [rng.randrange(10) for _ in range(VALUE_DIGITS - 1)]
        return [self.digit_ids[d] for d in digits]

    def sample_batch(self, rng: random.Random, length: int, batch_size: int) -> RetrievalBatch:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        documents = [self.sample_document(rng, length) for _ in range(batch_size)]
        answer_sequence, answer_position, answer_query = [], [], []
        query_task, needle_position, query_answer_position, query_sequence = [], [], [], []
        for sequence, (ids, queries) in enumerate(documents):
            for task, needle, answer_start in queries:
                for offset in range(VALUE_DIGITS):
                    answer_sequence.append(sequence)
                    answer_position.append(answer_start + offset)
                    answer_query.append(len(query_task))
                query_task.append(task)
                needle_position.append(needle)
                query_answer_position.append(answer_start)
                query_sequence.append(sequence)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        return RetrievalBatch(
            input_ids=torch.tensor([ids for ids, _ in documents], dtype=torch.int64),
            answer_sequence=as_tensor(answer_sequence), answer_position=as_tensor(answer_position),
            answer_query=as_tensor(answer_query), query_task=query_task, needle_position=as_tensor(needle_position),
            query_answer_position=as_tensor(query_answer_position), query_sequence=as_tensor(query_sequence),
        )

    def sample_document(self, rng: random.Random, length: int):
        """``(ids, queries)``: ``length`` token ids and per query ``(task, needle position, answer position)``."""
        task = rng.choices(TASKS, weights=self.config.task_weights)[0]
        if task == "key_value":
            return self._key_value_document(rng, length)
        return self._passkey_document(rng, length)

    def _key_value_document(self, rng: random.Random, length: int):
        config = self.config
        num_pairs = rng.randint(config.queries, config.max_pairs)
        key_ids = rng.sample(range(len(self.keys)), num_pairs)
        values = []
        seen = set()
        while len(values) < num_pairs:  # distinct values, so every question has one right answer
            value = self._value(rng)
            if tuple(value) not in seen:
                seen.add(tuple(value))
                values.append(value)
        queried = rng.sample(range(num_pairs), config.queries)
        is_queried = set(queried)
        lines = {i: self.line_heads[k] + v + self.line_tail for i, (k, v) in enumerate(zip(key_ids, values))}
        questions = [(self.question_heads[key_ids[i]], values[i]) for i in queried]
        budget = length - len(self.preamble) - sum(len(h) + VALUE_DIGITS + len(self.answer_tail) for h, _ in questions)
        # drop unqueried lines while the haystack lacks room for min_answer_distance tokens of filler
        unqueried = [i for i in range(num_pairs) if i not in is_queried]
        while unqueried and budget - sum(len(line) for line in lines.values()) < config.min_answer_distance:
            del lines[unqueried.pop()]
        kept = sorted(lines)
        needles = [(lines[i], i in is_queried, len(self.line_heads[key_ids[i]])) for i in kept]
        ids, needle_starts = self._haystack(rng, length, self.preamble, needles, budget, [h for h, _ in questions])
        positions = dict(zip(kept, needle_starts))
        queries = []
        for (head, value), pair in zip(questions, queried):
            answer_start = len(ids) + len(head)
            ids = ids + head + value + self.answer_tail
            queries.append(("key_value", positions[pair], answer_start))
        return self._exact(ids, length), queries

    def _passkey_document(self, rng: random.Random, length: int):
        value = self._value(rng)
        head, middle, tail = self.passkey_parts
        line = head + value + middle + value + tail
        budget = length - len(self.passkey_preamble) - len(self.passkey_question) - VALUE_DIGITS - len(self.answer_tail)
        ids, (needle,) = self._haystack(rng, length, self.passkey_preamble, [(line, True, len(head))], budget,
                                        [self.passkey_question])
        answer_start = len(ids) + len(self.passkey_question)
        ids = ids + self.passkey_question + value + self.answer_tail
        return self._exact(ids, length), [("passkey", needle, answer_start)]

    def _haystack(self, rng, length, preamble, needles, budget, question_heads):
        """Preamble + filler with the needle lines at paragraph boundaries, ``budget`` tokens in all. Returns the
        ids and the position of each needle's first value token. Queried needles start at least
        ``min_answer_distance`` tokens before the questions."""
        needle_tokens = sum(len(line) for line, _, _ in needles)
        filler_tokens = budget - needle_tokens
        distance = self.config.min_answer_distance
        if filler_tokens < distance or filler_tokens < 0:
            raise ValueError(
                f"length {length} is too short: the preamble, {len(needles)} line(s) and {len(question_heads)} "
                f"question(s) leave {filler_tokens} tokens of filler, fewer than min_answer_distance={distance}")
        filler, boundaries = [], [0]
        while len(filler) < filler_tokens:
            filler += self.filler[rng.randrange(len(self.filler))]
            boundaries.append(min(len(filler), filler_tokens))
        filler = filler[:filler_tokens]
        if filler:  # the cut may fall inside a paragraph: end the haystack with a line break all the same
            filler[-1] = self.newline
        boundaries = sorted(set(boundaries))
        far = [b for b in boundaries if filler_tokens - b >= distance]  # non-empty: 0 qualifies
        slots = [rng.choice(far) if queried else rng.choice(boundaries) for _, queried, _ in needles]
        order = sorted(range(len(needles)), key=lambda i: (slots[i], rng.random()))
        ids, cursor, starts = list(preamble), 0, [0] * len(needles)
        for i in order:
            ids += filler[cursor : slots[i]]
            cursor = slots[i]
            line, _, head_length = needles[i]
            starts[i] = len(ids) + head_length
            ids += line
        ids += filler[cursor:]
        return ids, starts

    @staticmethod
    def _exact(ids: Sequence[int], length: int) -> list:
        if len(ids) != length:
            raise AssertionError(f"document has {len(ids)} tokens, expected {length}")  # a bug here, not bad input
        return list(ids)
