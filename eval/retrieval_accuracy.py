"""Retrieval accuracy per context length, dense vs sparse variants of one model, with the indexer's recall:
``python -m eval.retrieval_accuracy``.

The documents are the bundled retrieval task's kind (``eval.synthetic_retrieval``: key-value lines or one pass key
in public-domain text, the question at the end), generated deterministically per length and task from ``--seed``,
and scored from the requests lm-eval makes for a ``multiple_choice`` task: the log-likelihood of each choice
(``" " + value``) after the context, tokenised as lm-eval's causal ``HFLM`` does (``encode_pair``). Two metrics:
multiple choice (lm-eval's ``acc``: the answer has the highest log-likelihood) and greedy exact match (lm-eval's
``is_greedy`` of the answer: greedy decoding writes it), the stricter test of an indexer, since with the answer's
tokens given the continuation's own page selections can still reach the needle.
``retrieval_length_task`` writes the same documents as an lm-eval task (YAML + JSONL), so on CPU lm-eval and this
loop can be run on identical data (``tests/test_eval_retrieval_accuracy.py`` checks that they agree document by
document); this loop is what runs on the GPU machine, where lm-eval is not installed.

Variants (``VARIANTS``), all on the same weights: ``dense`` (every layer full attention), ``sparse`` (the trained
indexer, FP8 index path as served), ``sparse-bf16-index`` (the index path in bf16), ``untrained-indexer`` (the
indexer's projections and norms re-initialised, FP8) and ``sliding-window`` (the 16 most recent pages:
``page_selection="recent"``); by name also ``attention-oracle`` (each token and KV group reads the pages of the most
dense attention mass, ``eval.oracle_selection``: the bound of what indexer training can reach). Per length and
variant: both metrics per task, their paired exact McNemar p-values against ``dense`` and, for the sparse variants,
the recall of each sparse layer (``eval.recall``: the share of dense attention mass in the selected pages) on the
first ``--recall-documents`` documents of each task.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import re
import time
from pathlib import Path
from dataclasses import replace
from typing import List, Optional, Sequence

import torch
from minimax_m3.command_line import positive_ints

from .cli import TOKENIZER_FILES, add_debug_argument, checked_model, run_main
from .devices import checked_device
from .layer_inputs import capture_sparse_layer_inputs, single_pass
from .modes import attention_mode
from .oracle_selection import attention_oracle_selection
from .recall import RecallAccumulator
from .report import checked_output_path, format_table, pyplot, save_figure, write_json
from .stats import mcnemar_exact_p_value
from .synthetic_retrieval import TASKS, VALUE_DIGITS, RetrievalDataConfig, RetrievalDataGenerator

__all__ = ["LENGTHS", "VARIANTS", "REFERENCE_VARIANTS", "KNOWN_VARIANTS", "TRAINED_INDEXER_VARIANTS",
           "NUM_CHOICES", "make_documents", "retrieval_length_task", "encode_pair",
           "choice_loglikelihoods", "evaluate_variant", "evaluate_retrieval_accuracy", "accuracy_table",
           "recall_table", "main"]

logger = logging.getLogger(__name__)

LENGTHS = (2048, 8192, 16384, 32768)
VARIANTS = ("dense", "sparse", "sparse-bf16-index", "untrained-indexer", "sliding-window")
REFERENCE_VARIANTS = ("attention-oracle",)  # asked for by name: a dense attention per sparse layer
KNOWN_VARIANTS = VARIANTS + REFERENCE_VARIANTS
TRAINED_INDEXER_VARIANTS = ("sparse", "sparse-bf16-index")  # the others select without the trained indexer
NUM_CHOICES = 6  # the answer and five distractors: the document's other values (key-value) or random ones
DATA_CONFIG = RetrievalDataConfig(queries=1, max_pairs=64, min_answer_distance=256)
SEED = 20261202
_VALUE_LINE = re.compile(r"The value of \S+ is (\d{%d})\." % VALUE_DIGITS)


# ---------------------------------------------------------------------------------------------- documents
def make_documents(tokenizer, length: int, count: int, seed: int = SEED, tasks: Sequence[str] = TASKS) -> List[dict]:
    """``count`` multiple-choice documents of about ``length`` tokens per task of ``tasks``: ``context`` ends with
    ``"Answer:"``, ``choices`` are five-digit values, ``answer`` the index of the right one, ``needle_distance`` the
    tokens between the answering line's value and the end of the context."""
    unknown = [task for task in tasks if task not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}: expected names among {TASKS}")
    documents = []
    for task in tasks:
        weights = tuple(int(name == task) for name in TASKS)
        generator = RetrievalDataGenerator(tokenizer, replace(DATA_CONFIG, task_weights=weights))
        rng = random.Random(f"{seed}/retrieval-accuracy/{task}/{length}")
        for _ in range(count):
            ids, [(_, needle, answer_start)] = generator.sample_document(rng, length)
            value = tokenizer.decode(ids[answer_start: answer_start + VALUE_DIGITS])
            context = tokenizer.decode(ids[: answer_start - 1])  # drops the space before the value: lm-eval adds it
            others = sorted(set(_VALUE_LINE.findall(context)) - {value}) if task == "key_value" else []
            distractors = rng.sample(others, min(NUM_CHOICES - 1, len(others)))
            while len(distractors) < NUM_CHOICES - 1:
                candidate = str(rng.randrange(10 ** (VALUE_DIGITS - 1), 10 ** VALUE_DIGITS))
                if candidate != value and candidate not in distractors:
                    distractors.append(candidate)
            choices = distractors + [value]
            rng.shuffle(choices)
            documents.append({"doc_id": len(documents), "task": task, "length": length, "context": context,
                              "choices": choices, "answer": choices.index(value),
                              "needle_distance": answer_start - 1 - needle})
    return documents


def retrieval_length_task(directory: Path, name: str, documents: Sequence[dict]) -> Path:
    """Write ``documents`` as the lm-eval ``multiple_choice`` task ``name`` (``name.yaml`` + ``name.jsonl``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(document) + "\n" for document in documents), encoding="utf-8")
    task = (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
            "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: choices\n"
            "doc_to_target: answer\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
            "metadata:\n  version: 1.0\n")
    path = directory / f"{name}.yaml"
    path.write_text(task, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- scoring
def encode_pair(tokenizer, context: str, continuation: str):
    """``(context ids, continuation ids)`` as lm-eval's causal models encode a request: trailing spaces of the
    context move to the continuation, the whole string is encoded and split after the context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def _shared_prefix(pairs) -> bool:
    """Whether every choice's tokens are the same context ids followed by its own continuation of equal length."""
    context = pairs[0][0]
    return len(context) > 0 and all(c == context and len(k) == len(pairs[0][1]) and len(k) > 0 for c, k in pairs)


def _continuation_score(logits: torch.Tensor, continuation: Sequence[int]) -> tuple:
    """``(log-likelihood, is_greedy)`` of ``continuation`` from the logits predicting it, as lm-eval's loglikelihood
    requests return them (greedy: every continuation token is the argmax)."""
    target = torch.tensor(continuation, device=logits.device)
    log_probabilities = torch.log_softmax(logits.float(), -1)
    return (float(log_probabilities.gather(-1, target[:, None]).sum()),
            bool((log_probabilities.argmax(-1) == target).all()))


def choice_loglikelihoods(model, tokenizer, document: dict, *, recall: Optional[RecallAccumulator] = None) -> List[tuple]:
    """``(log-likelihood, is_greedy)`` of each choice after the document's context, what lm-eval's ``HFLM`` returns
    per loglikelihood request (``encode_pair``; the sum of the continuation tokens' log-probabilities, and whether
    greedy decoding would produce the continuation).

    The context is prefilled once, its cache repeated per choice (``MiniMaxM3Cache.batch_repeat_interleave``) and
    the choices' continuations run as one batch over it: the same logits as a full forward of each choice (a cached
    prefix equals one forward, tested) at a fraction of the cost. Pairs that do not share their context tokens run
    as full forwards. With ``recall`` (sparse modes), the answer's full sequence also adds its sparse layers' recall."""
    from minimax_m3 import MiniMaxM3Cache

    pairs = [encode_pair(tokenizer, document["context"], " " + choice) for choice in document["choices"]]
    device = model.get_input_embeddings().weight.device
    scores: List[tuple] = []
    with torch.no_grad():
        if _shared_prefix(pairs):
            context = torch.tensor([pairs[0][0]], dtype=torch.int64, device=device)
            cache = MiniMaxM3Cache(model.config, 1)
            first = model(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            cache.batch_repeat_interleave(len(pairs))
            rest = torch.tensor([continuation[:-1] for _, continuation in pairs], dtype=torch.int64, device=device)
            following = model(input_ids=rest, past_key_values=cache, use_cache=True).logits if rest.shape[1] else None
            for row, (_, continuation) in enumerate(pairs):
                logits = first[None] if following is None else torch.cat([first[None], following[row]], 0)
                scores.append(_continuation_score(logits, continuation))
        else:
            for context, continuation in pairs:
                ids = torch.tensor([(context + continuation)[:-1]], dtype=torch.int64, device=device)
                hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
                scores.append(_continuation_score(model.lm_head(hidden[0, -len(continuation):]), continuation))
    if recall is not None:
        context, continuation = pairs[document["answer"]]
        ids = torch.tensor([(context + continuation)[:-1]], dtype=torch.int64, device=device)
        answer_rows = torch.arange(len(context) - 1, ids.shape[1])  # the rows that predict the answer's tokens
        with capture_sparse_layer_inputs(model) as captured, torch.no_grad():
            output = model.model(input_ids=ids, use_cache=False, output_page_selections=True)
        for layer_input, selection in zip(single_pass(model, captured), output.page_selections):
            recall.add(layer_input, selection.flatten(0, 1), answer_rows=answer_rows)
    return scores


def _indexer_modules(model) -> list:
    modules = []
    for layer in model.model.layers:
        attention = layer.self_attn
        if attention.is_sparse:
            modules += [attention.index_q_proj, attention.index_k_proj, attention.index_q_norm, attention.index_k_norm]
    return modules


@contextlib.contextmanager
def _reinitialised_indexer(model, seed: int):
    """The indexer's projections and norms re-initialised in place (the model's own ``_init_weights``, seeded) for
    the block, then restored: only the indexer's parameters are copied, so it works on a model of any size."""
    modules = _indexer_modules(model)
    saved = [[parameter.detach().clone() for parameter in module.parameters()] for module in modules]
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            for module in modules:
                model._init_weights(module)
        yield model
    finally:
        torch.random.set_rng_state(generator_state)
        with torch.no_grad():
            for module, parameters in zip(modules, saved):
                for parameter, value in zip(module.parameters(), parameters):
                    parameter.copy_(value)


@contextlib.contextmanager
def variant(model, name: str, seed: int = SEED):
    """``model`` set up as variant ``name`` for the block; everything is restored after it."""
    if name not in KNOWN_VARIANTS:
        raise ValueError(f"variant must be one of {KNOWN_VARIANTS}, got {name!r}")
    mode = "dense" if name == "dense" else "sparse"
    config = model.config
    saved = (config.index_dtype, config.page_selection)
    config.index_dtype = "bfloat16" if name == "sparse-bf16-index" else "float8_e4m3fn"
    config.page_selection = "recent" if name == "sliding-window" else "indexer"
    if name == "untrained-indexer":
        indexer = _reinitialised_indexer(model, seed)
    elif name == "attention-oracle":
        indexer = attention_oracle_selection(model)
    else:
        indexer = contextlib.nullcontext(model)
    try:
        with indexer, attention_mode(model, mode):
            yield model
    finally:
        config.index_dtype, config.page_selection = saved


def evaluate_variant(model, tokenizer, documents: Sequence[dict], name: str, *, recall_documents: int = 0,
                     progress=None) -> dict:
    """Per document: multiple-choice correctness (``correct``: the answer has the highest log-likelihood, lm-eval's
    ``acc``), greedy exact match (``greedy``: greedy decoding writes the answer, lm-eval's ``is_greedy`` of the
    answer's request) and the log-likelihoods of variant ``name``; for the sparse variants, recall over the first
    ``recall_documents`` documents of each task (over all rows, and over the rows that predict the answer)."""
    accumulator = RecallAccumulator() if name != "dense" and recall_documents > 0 else None
    correct, greedy, loglikelihoods, seen = [], [], [], {}
    with variant(model, name) as configured:
        for document in documents:
            index = seen[document["task"]] = seen.get(document["task"], -1) + 1
            results = choice_loglikelihoods(configured, tokenizer, document,
                                            recall=accumulator if index < recall_documents else None)
            scores = [score for score, _ in results]
            loglikelihoods.append(scores)
            correct.append(max(range(len(scores)), key=lambda i: (scores[i], -i)) == document["answer"])
            greedy.append(results[document["answer"]][1])
            if progress is not None:
                progress.update(1)
    result = {"correct": correct, "greedy": greedy, "loglikelihoods": loglikelihoods}
    if accumulator is not None:
        result["recall"] = [layer.as_dict() for layer in accumulator.result()]
    return result


def _paired(dense: Sequence[bool], other: Sequence[bool]) -> dict:
    only_dense = sum(d and not o for d, o in zip(dense, other))
    only_this = sum(o and not d for d, o in zip(dense, other))
    return {"only_dense_correct": only_dense, "only_this_correct": only_this,
            "mcnemar_p": mcnemar_exact_p_value(only_dense, only_this)}


def summarize(documents: Sequence[dict], outcome: dict, dense: Optional[dict]) -> dict:
    """Accuracy (multiple choice) and greedy exact match, overall and per task; McNemar against ``dense``."""
    def rate(values):
        return sum(values) / len(values)

    summary = {"accuracy": rate(outcome["correct"]), "greedy_accuracy": rate(outcome["greedy"]),
               "documents": len(documents), "by_task": {}}
    for task in TASKS:
        picked = [i for i, document in enumerate(documents) if document["task"] == task]
        if picked:
            summary["by_task"][task] = {"accuracy": rate([outcome["correct"][i] for i in picked]),
                                        "greedy_accuracy": rate([outcome["greedy"][i] for i in picked]),
                                        "documents": len(picked)}
    if dense is not None:
        summary["versus_dense"] = _paired(dense["correct"], outcome["correct"])
        summary["greedy_versus_dense"] = _paired(dense["greedy"], outcome["greedy"])
    if "recall" in outcome:
        summary["recall"] = outcome["recall"]
    return summary


def evaluate_retrieval_accuracy(model, tokenizer, *, lengths: Sequence[int] = LENGTHS, documents: int = 16,
                                tasks: Sequence[str] = TASKS, variants: Sequence[str] = VARIANTS,
                                recall_documents: int = 4, seed: int = SEED,
                                show_progress: bool = True, after_length=None) -> dict:
    """The whole comparison: ``{"lengths": {length: {variant: summary}}, "documents": {length: [...]}}``.
    ``after_length(partial result)`` is called as each length completes (``"complete": False`` until the last)."""
    from tqdm.auto import tqdm

    unknown = [name for name in variants if name not in KNOWN_VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}: expected names among {KNOWN_VARIANTS}")
    if "dense" not in variants:
        raise ValueError("variants must include 'dense' (the paired baseline)")
    variants = ["dense"] + [name for name in variants if name != "dense"]
    per_length, outcomes, document_sets = {}, {}, {}
    progress = tqdm(total=len(lengths) * len(variants) * documents * len(tasks), desc="retrieval accuracy",
                    unit="doc", disable=not show_progress)
    for length in lengths:
        docs = make_documents(tokenizer, length, documents, seed, tasks)
        document_sets[length] = [{key: doc[key] for key in ("doc_id", "task", "answer", "needle_distance")} for doc in docs]
        results = {}
        for name in variants:
            started = time.perf_counter()
            results[name] = evaluate_variant(model, tokenizer, docs, name, recall_documents=recall_documents,
                                             progress=progress)
            results[name]["seconds"] = time.perf_counter() - started
        per_length[length] = {name: {**summarize(docs, results[name], None if name == "dense" else results["dense"]),
                                     "seconds": results[name]["seconds"]} for name in variants}
        outcomes[length] = {name: {"correct": results[name]["correct"], "greedy": results[name]["greedy"]}
                            for name in variants}
        result = {"lengths": per_length, "correct": outcomes, "documents": document_sets, "variants": list(variants),
                  "seed": seed, "choices": NUM_CHOICES, "complete": length == lengths[-1]}
        if after_length is not None:
            after_length(result)
    progress.close()
    return result


# ---------------------------------------------------------------------------------------------- report
def accuracy_table(result: dict) -> str:
    """Per length and task, each variant's multiple-choice accuracy / greedy exact match, and the McNemar p-values
    of both against dense (over all documents of the length)."""
    variants = result["variants"]
    rows = []
    for length, by_variant in result["lengths"].items():
        for task in (*TASKS, "all"):
            cells, count = [], None
            for name in variants:
                summary = by_variant[name] if task == "all" else by_variant[name]["by_task"].get(task)
                if summary is None:
                    cells.append("-")
                    continue
                count = summary["documents"]
                cells.append(f"{summary['accuracy']:.2f} / {summary['greedy_accuracy']:.2f}")
            if count is None:
                continue
            p_values = "-" if task != "all" else ", ".join(
                f"{by_variant[name]['versus_dense']['mcnemar_p']:.2g} / {by_variant[name]['greedy_versus_dense']['mcnemar_p']:.2g}"
                for name in variants[1:])
            rows.append([str(length), task, str(count), *cells, p_values])
    header = ["length", "task", "n", *variants, "McNemar p vs dense (" + ", ".join(variants[1:]) + ")"]
    return format_table(header, rows)


def recall_table(result: dict) -> str:
    rows = []
    for length, by_variant in result["lengths"].items():
        for name, summary in by_variant.items():
            for layer in summary.get("recall", []):
                beyond, answer = layer["recall_beyond_topk"], layer.get("recall_at_answer")
                rows.append([str(length), name, str(layer["layer"]), f"{layer['recall']:.3f}",
                             "-" if beyond is None else f"{beyond:.3f}", str(layer["rows_beyond_topk"]),
                             "-" if answer is None else f"{answer:.3f}"])
    return format_table(["length", "variant", "layer", "recall", "recall beyond top-16", "rows beyond",
                         "recall at the answer"], rows)


def plot(result: dict, path: Path) -> Path:
    """Accuracy against context length: a row per metric (multiple choice, greedy exact match), a column per task,
    a line per variant (markers and widths differ so that equal values stay visible)."""
    plt = pyplot()
    lengths = [int(length) for length in result["lengths"]]
    metrics = (("accuracy", "multiple choice"), ("greedy_accuracy", "greedy exact match"))
    figure, axes = plt.subplots(len(metrics), len(TASKS), figsize=(5.5 * len(TASKS), 3.4 * len(metrics)), squeeze=False)
    markers = "osD^vP"
    for row, (metric, metric_label) in enumerate(metrics):
        for column, task in enumerate(TASKS):
            axis = axes[row][column]
            for index, name in enumerate(result["variants"]):
                values = [result["lengths"][length][name]["by_task"].get(task, {}).get(metric, float("nan"))
                          for length in result["lengths"]]
                axis.plot(lengths, values, marker=markers[index % len(markers)], markersize=8 - index,
                          linewidth=3.0 - 0.5 * index, color=f"C{index}", label=name, alpha=0.85)
            axis.set_xscale("log", base=2)
            axis.set_xticks(lengths, [f"{length // 1024}K" for length in lengths])
            axis.set_ylim(-0.04, 1.04)
            axis.set_title(f"{task}: {metric_label}", fontsize=10)
            axis.set_xlabel("context length (tokens)")
            axis.set_ylabel("accuracy")
            axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    return save_figure(figure, path)


# ---------------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.retrieval_accuracy", description=__doc__.splitlines()[0].replace("``", "`"))
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped trained tiny model)")
    parser.add_argument("--lengths", type=positive_ints, default=LENGTHS, help="context lengths in tokens")
    parser.add_argument("--documents", type=int, default=16, help="documents per task and length")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated among {', '.join(TASKS)}")
    parser.add_argument("--recall-documents", type=int, default=4,
                        help="documents per task and length (the first ones) whose recall is measured")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated among {', '.join(KNOWN_VARIANTS)} (default: all but "
                             f"{', '.join(REFERENCE_VARIANTS)})")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--output", type=Path, default=None, help="JSON results path")
    parser.add_argument("--plot", type=Path, default=None, help="PNG plot path")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output or --plot")
    return add_debug_argument(parser)


def run_command(argv: Optional[Sequence[str]] = None) -> dict:
    from .accuracy import load_for_evaluation
    from .trained_model import trained_model_dir

    arguments = build_parser().parse_args(argv)
    if arguments.documents < 1 or arguments.recall_documents < 0:
        raise SystemExit("--documents must be >= 1 and --recall-documents >= 0")
    tasks = _names(arguments.tasks, "--tasks", TASKS)
    variants = _names(arguments.variants, "--variants", KNOWN_VARIANTS)
    if "dense" not in variants:
        raise SystemExit("--variants must include dense (the paired baseline)")
    device = str(checked_device(arguments.device))
    for name, path, suffix in (("--output", arguments.output, ".json"), ("--plot", arguments.plot, ".png")):
        if path is not None:
            checked_output_path(path, "retrieval_accuracy", overwrite=arguments.overwrite, argument=name, suffix=suffix)
    if arguments.model is not None:
        checked_model(arguments.model)
        checked_model(arguments.model, files=TOKENIZER_FILES)
    model_path = arguments.model or str(trained_model_dir())
    model, tokenizer, description = load_for_evaluation(model_path, None, dtype=arguments.dtype,
                                                        device=device, device_map=None)
    started = time.perf_counter()

    def save_partial(partial: dict) -> None:  # a long run killed at its last length keeps the shorter ones
        if arguments.output is not None:
            write_json(arguments.output, {**partial, "model": description})

    result = evaluate_retrieval_accuracy(model, tokenizer, lengths=arguments.lengths, documents=arguments.documents,
                                         tasks=tasks, variants=variants,
                                         recall_documents=arguments.recall_documents, seed=arguments.seed,
                                         after_length=save_partial)
    result["model"] = description
    result["seconds"] = time.perf_counter() - started
    print("\nRetrieval accuracy per context length: multiple choice (lm-eval's acc) / greedy exact match (lm-eval's "
          "is_greedy of the answer)\n")
    print(accuracy_table(result))
    print("\nIndexer recall: share of dense attention mass in the selected pages\n")
    print(recall_table(result))
    if arguments.output is not None:
        write_json(arguments.output, result)
        print(f"\nresults: {arguments.output}")
    if arguments.plot is not None:
        print(f"plot: {plot(result, arguments.plot)}")
    return result


def _names(text: str, argument: str, known: Sequence[str]) -> tuple:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise SystemExit(f"{argument} must be among {', '.join(known)}, got {text!r}")
    return names


def main(argv: Optional[Sequence[str]] = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    run_main(run_command, argv)


if __name__ == "__main__":
    main()
