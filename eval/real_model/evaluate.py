"""``evaluate``: sparse vs dense on the converted SmolLM2 over held-out real text.

Variants are ``eval.retrieval_accuracy``'s, on the same weights: ``dense``; ``sparse`` (the trained indexer, FP8
index path); ``sparse-bf16-index``; ``untrained-indexer`` (the indexer re-initialised as the model initialises it);
``sliding-window`` (the 16 most recent pages); by name also ``attention-oracle`` (the pages of the most dense
attention mass: what no indexer can beat). Three measurements:

* **Perplexity by position** (``perplexity``): the per-token loss over held-out windows of 2K, 4K and 8K tokens,
  in buckets of 2,048 positions. Below 2,048 (16 pages of 128) every variant reads every page, so sparse equals dense
  by construction; beyond, each variant's mean loss difference to dense gets a 95 % bootstrap interval over the
  windows (each a separate passage of a held-out book).
* **Pass-key retrieval in real prose** (``needle``): a five-digit pass key stated once at a random depth of a
  held-out passage, the question asked through the instruct chat template, six choices. Multiple-choice accuracy
  and greedy exact match, McNemar against dense, and the indexer's recall of dense attention mass per layer.
* **Continuation choice** (``continuation``): which of four 24-word spans follows a held-out passage (the true one
  and three from elsewhere in the same book), scored as lm-eval's ``multiple_choice`` log-likelihoods; the same
  documents are written as an lm-eval task (``retrieval_accuracy.retrieval_length_task``) for ``lm_eval`` runs.

The indexer runs the torch backend at this model's 3 index heads: times here are not the SM90 kernel's.
"""

from __future__ import annotations

import random
import re
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import retrieval_accuracy
from ..recall import indexer_recall
from ..stats import bootstrap_mean_interval
from .corpus import interleaved, token_windows

__all__ = ["LENGTHS", "BUCKET", "VARIANTS", "KNOWN_VARIANTS", "position_losses", "perplexity_by_position",
           "needle_documents", "continuation_documents", "window_recall", "evaluate_real_model"]

LENGTHS = (2048, 4096, 8192)
BUCKET = 2048
VARIANTS = retrieval_accuracy.VARIANTS
KNOWN_VARIANTS = retrieval_accuracy.KNOWN_VARIANTS
SEED = 20261202
PASS_KEY_DIGITS = 5
NEEDLE_CHOICES = 6
CONTINUATION_CHOICES = 4
CONTINUATION_WORDS = 24
MIN_LENGTH = 256
_LOGIT_CHUNK = 1024


def position_losses(model, windows: torch.Tensor) -> torch.Tensor:
    """``[N, L - 1]`` fp32: the loss of predicting token ``t + 1`` of each window ``[N, L]`` from its prefix; logits
    are formed ``_LOGIT_CHUNK`` positions at a time (an 8K window's full logits would be 1.6 GB)."""
    device = model.get_input_embeddings().weight.device
    losses = []
    with torch.no_grad():
        for window in windows:
            ids = window[None].to(device)
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
            targets = ids[0, 1:]
            parts = [torch.nn.functional.cross_entropy(model.lm_head(hidden[s:s + _LOGIT_CHUNK]).float(),
                                                       targets[s:s + _LOGIT_CHUNK], reduction="none")
                     for s in range(0, hidden.shape[0], _LOGIT_CHUNK)]
            losses.append(torch.cat(parts).cpu())
    return torch.stack(losses)


def _difference(values: torch.Tensor, reference: torch.Tensor, picked: torch.Tensor, seed: int) -> dict:
    """The mean per-token loss difference ``values - reference`` over the ``picked`` positions with its bootstrap
    interval over windows, the perplexity ratio, and whether the interval excludes 0."""
    interval = bootstrap_mean_interval((values[:, picked] - reference[:, picked]).mean(1).double().tolist(), seed=seed)
    return {"difference": interval, "perplexity_ratio": float(torch.exp(torch.tensor(interval["mean"]))),
            "excludes_zero": interval["low"] > 0 or interval["high"] < 0}


def perplexity_by_position(losses: Dict[str, torch.Tensor], *, bucket: int = BUCKET, seed: int = SEED) -> dict:
    """Per variant and bucket of predicted positions ``[b * bucket, (b + 1) * bucket)``: mean loss and perplexity,
    and for the variants other than ``dense`` the largest difference to it and (with 2 windows or more) the mean
    difference to it (``versus_dense``: ``_difference``). ``beyond`` holds the same over every position from
    ``bucket`` on, and for the variants other than ``sparse`` (the trained indexer) also ``versus_sparse``."""
    dense = losses["dense"]
    positions = torch.arange(1, dense.shape[1] + 1)  # the position of the predicted token
    several = dense.shape[0] >= 2
    table = {}
    for name, values in losses.items():
        rows = {}
        for start in range(0, int(positions[-1]) + 1, bucket):
            picked = (positions >= max(start, 1)) & (positions < start + bucket)
            if not picked.any():
                continue
            mean = float(values[:, picked].mean())
            row = {"tokens": int(picked.sum()) * values.shape[0], "loss": mean,
                   "perplexity": float(torch.exp(torch.tensor(mean)))}
            if name != "dense":
                row["max_abs_difference_to_dense"] = float((values[:, picked] - dense[:, picked]).abs().max())
                if several:
                    row["versus_dense"] = _difference(values, dense, picked, seed)
            rows[f"{start}-{start + bucket}"] = row
        beyond = positions >= bucket
        if name != "dense" and beyond.any() and several:
            rows["beyond"] = {"versus_dense": _difference(values, dense, beyond, seed)}
            if "sparse" in losses and name != "sparse":  # the baselines against the trained indexer
                rows["beyond"]["versus_sparse"] = _difference(values, losses["sparse"], beyond, seed)
        table[name] = rows
    return table


def window_recall(model, windows: torch.Tensor) -> List[dict]:
    """Per sparse layer, the share of dense attention mass in the pages the model (a sparse variant) selects, over
    ``windows`` ``[N, L]`` (``eval.recall``), averaged over their (token, KV group) rows."""
    totals: Dict[int, List[float]] = {}
    device = model.get_input_embeddings().weight.device
    for window in windows:
        for layer in indexer_recall(model, window[None].to(device)):
            kept = totals.setdefault(layer.layer, [0.0, 0, 0.0, 0])
            kept[0] += layer.recall * layer.rows
            kept[1] += layer.rows
            if layer.recall_beyond_topk is not None:
                kept[2] += layer.recall_beyond_topk * layer.rows_beyond_topk
                kept[3] += layer.rows_beyond_topk
    return [{"layer": layer, "recall": kept / rows, "recall_beyond_topk": beyond / rows_beyond if rows_beyond else None}
            for layer, (kept, rows, beyond, rows_beyond) in sorted(totals.items())]


def _profile(losses: torch.Tensor, width: int = 128) -> List[float]:
    """Mean loss per ``width`` positions, over windows: the curve of the per-position plot."""
    usable = losses.shape[1] // width * width
    return losses[:, :usable].reshape(losses.shape[0], -1, width).mean((0, 2)).tolist()


def _passage(text: str, tokenizer, tokens: int, rng: random.Random) -> tuple:
    """``(start, end)`` characters of a passage of ``text`` of at most ``tokens`` tokens, from a random paragraph
    start to the last sentence end within them (character offsets of the tokenizer, so the passage is ``text``'s own
    characters, not a decoding of them)."""
    starts = [0] + [match.end() for match in re.finditer(r"\n\n", text)]
    chars = tokens * 6  # more characters than ``tokens`` tokens take in English prose; trimmed by tokens below
    start = rng.choice([s for s in starts if s + chars < len(text)] or [0])
    offsets = tokenizer(text[start:start + chars], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    window = text[start:start + offsets[min(tokens, len(offsets)) - 1][1]]
    end = max(window.rfind(". "), window.rfind(".\n"))
    return start, start + (end + 1 if end > 0 else len(window))


def _fitted(build, length: int, tokenizer, budget: int) -> dict:
    """``build(passage token budget)``'s document, its budget lowered until context and longest choice fit in
    ``length`` tokens (the model's positions end at its context)."""
    for _ in range(8):
        document = build(budget)
        longest = max(document["choices"], key=lambda choice: len(tokenizer.encode(" " + choice)))
        excess = len(tokenizer.encode(document["context"] + " " + longest)) - length
        if excess <= 0:
            return document
        budget -= excess + 4
    raise ValueError(f"no document of {length} tokens fits its question and answers")


def needle_documents(books: Dict[str, str], tokenizer, length: int, count: int, seed: int = SEED) -> List[dict]:
    """``count`` pass-key documents of at most ``length`` tokens in held-out prose (``retrieval_accuracy``'s
    document layout: ``context``, ``choices``, ``answer``, ``needle_distance``)."""
    titles = sorted(books)
    documents = []
    for index in range(count):
        def build(budget, index=index):
            rng = random.Random(f"{seed}/needle/{length}/{index}")
            key = str(rng.randrange(10 ** (PASS_KEY_DIGITS - 1), 10 ** PASS_KEY_DIGITS))
            book = books[titles[index % len(titles)]]
            start, end = _passage(book, tokenizer, budget, rng)
            passage = book[start:end]
            breaks = [m.end() for m in re.finditer(r"(?<=[.!?\"]) ", passage)] or [len(passage)]
            cut = breaks[min(len(breaks) - 1, int(rng.uniform(0.05, 0.95) * len(breaks)))]
            needle = f"The pass key is {key}. Remember it: {key} is the pass key. "
            question = "What is the pass key stated in the text above? Answer with its five digits."
            content = f"{passage[:cut]}{needle}{passage[cut:]}\n\n{question}"
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
            choices = [key]
            while len(choices) < NEEDLE_CHOICES:
                candidate = str(rng.randrange(10 ** (PASS_KEY_DIGITS - 1), 10 ** PASS_KEY_DIGITS))
                if candidate not in choices:
                    choices.append(candidate)
            rng.shuffle(choices)
            after_needle = prompt[prompt.index(needle) + len(needle):] + "The pass key is"
            return {"doc_id": index, "task": "pass_key_prose", "length": length,
                    "context": prompt + "The pass key is", "choices": choices, "answer": choices.index(key),
                    "needle_distance": len(tokenizer.encode(after_needle))}

        documents.append(_fitted(build, length, tokenizer, length - 100))
    return documents


def continuation_documents(books: Dict[str, str], tokenizer, length: int, count: int,
                           seed: int = SEED) -> List[dict]:
    """``count`` documents of at most ``length`` tokens: a held-out passage and ``CONTINUATION_CHOICES`` spans of
    ``CONTINUATION_WORDS`` words, the one that follows it and others from elsewhere in the same book."""
    titles = sorted(books)
    documents = []
    for index in range(count):
        def build(budget, index=index):
            rng = random.Random(f"{seed}/continuation/{length}/{index}")
            text = books[titles[index % len(titles)]]
            start, end = _passage(text, tokenizer, budget, rng)
            passage = text[start:end]
            true = " ".join(text[end:].split()[:CONTINUATION_WORDS])
            all_words = text.split()
            choices = [true]
            while len(choices) < CONTINUATION_CHOICES:
                first = rng.randrange(0, len(all_words) - CONTINUATION_WORDS)
                candidate = " ".join(all_words[first:first + CONTINUATION_WORDS])
                if candidate not in choices and candidate not in passage:
                    choices.append(candidate)
            rng.shuffle(choices)
            return {"doc_id": index, "task": "continuation", "length": length, "context": passage,
                    "choices": choices, "answer": choices.index(true), "needle_distance": 0}

        documents.append(_fitted(build, length, tokenizer, length - 60))
    return documents


def _choice_part(model, tokenizer, documents: List[dict], variants: Sequence[str], recall_documents: int) -> dict:
    outcomes = {}
    for name in variants:
        started = time.perf_counter()
        outcomes[name] = retrieval_accuracy.evaluate_variant(model, tokenizer, documents, name,
                                                             recall_documents=recall_documents)
        outcomes[name]["seconds"] = time.perf_counter() - started
    summary = {}
    for name in variants:
        row = retrieval_accuracy.summarize(documents, outcomes[name], None if name == "dense" else outcomes["dense"])
        row.pop("by_task", None)
        summary[name] = {**row, "seconds": outcomes[name]["seconds"]}
    return {"summary": summary, "correct": {name: outcomes[name]["correct"] for name in variants},
            "greedy": {name: outcomes[name]["greedy"] for name in variants}}


def evaluate_real_model(model, tokenizer, held_out_books: Dict[str, str], *, lengths: Sequence[int] = LENGTHS,
                        windows: int = 24, documents: int = 32, variants: Sequence[str] = VARIANTS,
                        recall_documents: int = 4, seed: int = SEED,
                        after_part: Optional[Callable[[dict], None]] = None) -> dict:
    """Every measurement, ``after_part(result so far)`` after each (length, part)."""
    unknown = [name for name in variants if name not in KNOWN_VARIANTS]
    if unknown or "dense" not in variants:
        raise ValueError(f"variants must include 'dense' and be among {KNOWN_VARIANTS}, got {list(variants)}")
    if any(not isinstance(length, int) or length < MIN_LENGTH for length in lengths):
        raise ValueError(f"lengths must be ints >= {MIN_LENGTH} (a question and answers follow each passage), got "
                         f"{list(lengths)}")
    variants = ["dense"] + [name for name in variants if name != "dense"]
    # below the positions the top-k pages cover, every variant reads every page
    bucket = model.config.index_topk_blocks * model.config.index_block_size
    result = {"variants": variants, "seed": seed, "lengths": {}, "complete": False}
    for length in lengths:
        per_length = result["lengths"][str(length)] = {}
        chosen = interleaved(token_windows(held_out_books, tokenizer, length), windows)
        if len(chosen) < 2:
            raise ValueError(f"the held-out books give {len(chosen)} windows of {length} tokens: at least 2 are needed")
        ids = torch.stack([window for _, _, window in chosen])
        losses = {}
        for name in variants:
            with retrieval_accuracy.variant(model, name, seed) as configured:
                losses[name] = position_losses(configured, ids)
        recall = {}
        for name in variants:
            if name != "dense" and recall_documents > 0:
                with retrieval_accuracy.variant(model, name, seed) as configured:
                    recall[name] = window_recall(configured, ids[:recall_documents])
        per_length["perplexity"] = {"windows": [[title, index] for title, index, _ in chosen],
                                    "bucket": bucket,
                                    "buckets": perplexity_by_position(losses, bucket=bucket, seed=seed),
                                    "profile": {name: _profile(values) for name, values in losses.items()},
                                    "recall": recall}
        _report(after_part, result)
        per_length["needle"] = _choice_part(model, tokenizer, needle_documents(held_out_books, tokenizer, length,
                                                                             documents, seed), variants, recall_documents)
        _report(after_part, result)
        per_length["continuation"] = _choice_part(model, tokenizer, continuation_documents(
            held_out_books, tokenizer, length, documents, seed), variants, 0)
        _report(after_part, result)
    result["complete"] = True
    _report(after_part, result)
    return result


def _report(after_part, result: dict) -> None:
    if after_part is not None:
        after_part(result)
