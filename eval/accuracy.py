"""Accuracy of sparse vs dense attention on the same weights: ``python -m eval.accuracy``.

Runs lm-eval (``simple_evaluate`` with ``HFLM`` wrapping our model object, offline) once per attention mode on
one model, then prints every task's metrics side by side with the difference and, where lm-eval logs per-sample
correctness (``acc``, ``acc_norm``, ``exact_match``, ...), the paired exact McNemar p-value over the samples
paired by ``doc_id``, as the reference PR reports accuracy. Perplexity tasks get the metric and its difference.
Then a logit-agreement summary on long inputs: KL(dense ‖ sparse), top-1 agreement and max |Δlogit| beyond
the top-k window, and the same within it as a control.

Then retrieval accuracy per context length (``eval.retrieval_accuracy``): multiple choice scored as lm-eval scores
it, for dense, sparse (FP8 and bf16 index paths), an untrained indexer and a sliding window, with the indexer's
recall per sparse layer.

Without ``--model`` it evaluates the shipped trained tiny model (``eval.trained_model``: a MiniMax-M3 with the real
indexer geometry, trained on long-context retrieval); ``--model embedded`` the embedded random tiny model
(``eval.default_model``, quick tests). ``--model PATH --tasks ...`` evaluates a checkpoint (any layout ``minimax_m3.load_model`` reads) on bundled
tasks and on any lm-eval task whose data is already in the local Hugging Face cache: nothing reaches the network.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .cli import TOKENIZER_FILES, UsageError, add_debug_argument, checked_model, run_main
from .offline import enforce_offline
from .devices import checked_device
from .report import checked_output_path, environment, format_number, format_table, write_json
from .stats import paired_outcome

__all__ = [
    "DEFAULT_TASKS_EMBEDDED",
    "DEFAULT_TASKS_CHECKPOINT",
    "run_lm_eval",
    "metrics_of",
    "correctness_of",
    "compare_modes",
    "evaluate_accuracy",
    "accuracy_table",
    "agreement_table",
    "run_command",
    "main",
]

logger = logging.getLogger(__name__)

DEFAULT_TASKS_EMBEDDED = ("m3_kv_retrieval_short", "m3_pd_perplexity")
DEFAULT_TASKS_CHECKPOINT = ("m3_kv_retrieval_long", "m3_kv_retrieval_short", "m3_pd_perplexity")
EMBEDDED = "embedded"  # --model value of the embedded random tiny model
RETRIEVAL_LENGTHS_GPU = "2048,8192,16384,32768"
RETRIEVAL_LENGTHS_CPU = "4096"  # 32 pages: selection matters, and a 2-core CPU finishes in about a minute


class TaskSession:
    """An lm-eval ``TaskManager`` over the bundled tasks (``eval/tasks``, read in place) and, when a requested task
    is not bundled, lm-eval's own; an unknown task, or one whose data is not in the local cache, raises
    ``UsageError`` (a ``ValueError``) before any model runs."""

    def __init__(self, tasks: Sequence[str], extra_task_paths: Sequence[Path] = ()):
        """``extra_task_paths``: more directories of task YAMLs (e.g. ``eval.retrieval_accuracy.retrieval_length_task``
        output), scanned after the bundled ones."""
        enforce_offline()
        from lm_eval.tasks import TaskManager

        from .tasks import BUNDLED_TAG, TASK_DIRECTORY, bundled_task_names

        bundled = set(bundled_task_names()) | {BUNDLED_TAG}
        # indexing lm-eval's thousands of task files takes seconds: only when a task needs them
        extra = [str(path) for path in extra_task_paths]
        extra_names = {path.stem for directory in extra_task_paths for path in Path(directory).glob("*.yaml")}
        self.manager = TaskManager(include_path=[str(TASK_DIRECTORY), *extra],
                                   include_defaults=not set(tasks) <= bundled | extra_names)
        unknown = [name for name in tasks if name not in self.manager.all_tasks]
        if unknown:
            raise UsageError(f"unknown task(s) {', '.join(unknown)}: the bundled tasks are {', '.join(sorted(bundled))}; "
                             f"other names must be lm-eval tasks (`lm_eval ls tasks` lists them)")
        for name in tasks:
            if name not in bundled | extra_names:
                self._check_cached(name, sorted(bundled))

    def _check_cached(self, name: str, bundled: Sequence[str]) -> None:
        """Loads the task's data once, so that a dataset missing from the offline cache fails now, not after the
        model has loaded and the first mode has run."""
        try:
            self.manager.load([name])
        except ConnectionError as error:  # what datasets raises offline for a dataset it has not cached
            fetch = f"from lm_eval.tasks import TaskManager; TaskManager().load(['{name}'])"
            raise UsageError(f"task {name}: its data is not in the local Hugging Face cache and runs are offline "
                             f"({error}); fetch it once with network access (python -c \"{fetch}\", same HF_HOME) "
                             f"or use a bundled task: {', '.join(bundled)}") from error


def run_lm_eval(model, tokenizer, tasks: Sequence[str], session: TaskSession, *, limit: Optional[float],
                batch_size: int, max_length: Optional[int], num_fewshot: Optional[int], bootstrap_iters: int) -> dict:
    """One ``simple_evaluate`` of ``model`` as it is configured now; per-sample logs included."""
    enforce_offline()
    import datasets
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    datasets.disable_progress_bars()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size, max_length=max_length)
    results = simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=session.manager, limit=limit, num_fewshot=num_fewshot,
        log_samples=True, bootstrap_iters=bootstrap_iters,
    )
    if results is None:
        raise RuntimeError("lm-eval returned no results (not rank 0 of a distributed run?)")
    return results


def metrics_of(results: dict) -> dict:
    """``{task: {metric: value}}`` from lm-eval's ``results["results"]``; a metric under a filter other than
    ``none`` is named ``metric,filter``; stderr entries and aliases are left out."""
    table = {}
    for task, entries in results["results"].items():
        metrics = {}
        for key, value in entries.items():
            if "," not in key or "_stderr" in key:
                continue
            metric, filter_name = key.split(",", 1)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[metric if filter_name == "none" else key] = float(value)
        table[task] = metrics
    return table


def correctness_of(results: dict) -> dict:
    """``{task: {metric: {(doc_id, filter): correct}}}`` for the per-sample metrics that are 0/1 in every sample
    (perplexity tasks log ``(loglikelihood, words)`` pairs: they have none)."""
    table = {}
    for task, samples in (results.get("samples") or {}).items():
        per_metric, not_binary = {}, set()
        for sample in samples:
            for metric in sample.get("metrics", []):
                value = sample.get(metric)
                name = metric if sample.get("filter", "none") == "none" else f"{metric},{sample['filter']}"
                if isinstance(value, (bool, int, float)) and value in (0, 1):
                    per_metric.setdefault(name, {})[(sample["doc_id"], sample.get("filter", "none"))] = bool(value)
                else:
                    not_binary.add(name)
        table[task] = {name: values for name, values in per_metric.items() if name not in not_binary}
    return table


def compare_modes(candidate: dict, reference: dict, modes: Sequence[str]) -> dict:
    """Side-by-side metrics with differences (candidate - reference) and McNemar outcomes, per task."""
    metrics_c, metrics_r = metrics_of(candidate), metrics_of(reference)
    correct_c, correct_r = correctness_of(candidate), correctness_of(reference)
    comparison = {}
    for task in sorted(set(metrics_c) | set(metrics_r)):
        rows = {}
        for metric in sorted(set(metrics_c.get(task, {})) | set(metrics_r.get(task, {}))):
            value_c, value_r = metrics_c.get(task, {}).get(metric), metrics_r.get(task, {}).get(metric)
            paired_c = correct_c.get(task, {}).get(metric)
            paired_r = correct_r.get(task, {}).get(metric)
            rows[metric] = {
                modes[0]: value_c,
                modes[1]: value_r,
                "difference": None if value_c is None or value_r is None else value_c - value_r,
                "paired": _named(paired_outcome(paired_c, paired_r), modes) if paired_c and paired_r else None,
            }
        comparison[task] = rows
    return comparison


def _named(outcome, modes: Sequence[str]) -> dict:
    return {"samples": outcome.samples, "both_correct": outcome.both_correct,
            f"only_{modes[0]}_correct": outcome.only_first_correct,
            f"only_{modes[1]}_correct": outcome.only_second_correct,
            "both_wrong": outcome.both_wrong, "p_value": outcome.p_value}


def accuracy_table(comparison: dict, modes: Sequence[str]) -> str:
    headers = ["task", "metric", modes[0], modes[1], f"Δ ({modes[0]} − {modes[1]})", "n",
               f"only {modes[0]} / only {modes[1]} correct", "McNemar p"]
    rows = []
    for task, metrics in comparison.items():
        for metric, row in metrics.items():
            paired = row["paired"]
            rows.append([
                task, metric, format_number(row[modes[0]], 4), format_number(row[modes[1]], 4),
                "-" if row["difference"] is None else f"{row['difference']:+.4g}",
                paired["samples"] if paired else "-",
                f"{paired[f'only_{modes[0]}_correct']} / {paired[f'only_{modes[1]}_correct']}" if paired else "-",
                f"{paired['p_value']:.3g}" if paired else "-",
            ])
    return format_table(headers, rows)


def agreement_table(agreement: dict) -> str:
    headers = ["positions", "count", agreement["kl_direction"] + " mean", "KL max", "top-1 agreement", "max abs Δlogit"]
    rows = []
    window = agreement["topk_window_tokens"]
    for name, label in (("within_topk", f"< {window} (all pages kept)"), ("beyond_topk", f">= {window} (pages dropped)")):
        stats = agreement.get(name)
        if stats:
            rows.append([label, stats["positions"], f"{stats['kl_mean']:.3g}", f"{stats['kl_max']:.3g}",
                         f"{stats['top1_agreement']:.2%}", f"{stats['max_abs_logit_diff']:.3g}"])
    return format_table(headers, rows)


def evaluate_accuracy(model, tokenizer, *, tasks: Sequence[str], modes: Sequence[str] = ("sparse", "dense"),
                      limit: Optional[float] = None, batch_size: int = 8, max_length: Optional[int] = None,
                      num_fewshot: Optional[int] = None, bootstrap_iters: int = 0, agreement_length: Optional[int] = None,
                      agreement_sequences: int = 4, agreement_positions: int = 256, seed: int = 0,
                      session: Optional[TaskSession] = None, on_progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Everything ``python -m eval.accuracy`` reports, as a JSON-ready dict. ``agreement_length=0`` skips the
    logit agreement; ``None`` uses ``default_agreement_length``. ``session``: a ``TaskSession(tasks)`` made
    earlier (the command makes it before loading the model). ``on_progress`` gets the results so far
    (``"partial": True``) as each part completes: each mode's lm-eval run (its metrics under ``metrics_by_mode``),
    then the comparison, so an interrupted run keeps them."""
    from .logit_agreement import agreement_sequences as make_sequences
    from .logit_agreement import default_agreement_length, logit_agreement
    from .modes import MODE_SETTINGS, attention_mode

    if len(modes) != 2 or any(m not in MODE_SETTINGS for m in modes) or modes[0] == modes[1]:
        raise ValueError(f"modes must be two different modes of {tuple(MODE_SETTINGS)} (candidate, reference), got {modes}")
    started = time.perf_counter()
    per_mode, seconds = {}, {}
    session = session or TaskSession(tasks)
    header = {"kind": "accuracy", "modes": list(modes), "tasks": list(tasks), "limit": limit,
              "num_fewshot": num_fewshot}

    def report_progress(parts: dict) -> None:
        if on_progress is not None:
            on_progress({**header, "partial": True, **parts, "seconds": time.perf_counter() - started})

    for mode in modes:
        logger.info("lm-eval in %s mode on %s", mode, ", ".join(tasks))
        begin = time.perf_counter()
        with attention_mode(model, mode):
            per_mode[mode] = run_lm_eval(model, tokenizer, tasks, session, limit=limit, batch_size=batch_size,
                                         max_length=max_length, num_fewshot=num_fewshot,
                                         bootstrap_iters=bootstrap_iters)
        seconds[mode] = time.perf_counter() - begin
        if len(per_mode) < len(modes):  # the comparison needs both: until then, the finished mode's metrics
            report_progress({"metrics_by_mode": {name: metrics_of(results) for name, results in per_mode.items()},
                             "lm_eval_seconds": dict(seconds),
                             "n_samples": {name: results.get("n-samples", {}) for name, results in per_mode.items()}})
    result = {
        **header,
        "comparison": compare_modes(per_mode[modes[0]], per_mode[modes[1]], modes),
        "lm_eval_seconds": seconds,
        "n_samples": {mode: per_mode[mode].get("n-samples", {}) for mode in modes},
        "logit_agreement": None,
    }
    if agreement_length != 0:
        report_progress(result)
        length = agreement_length or default_agreement_length(model.config)
        sequences = make_sequences(tokenizer, model.config.vocab_size, length, agreement_sequences, seed)
        result["logit_agreement"] = logit_agreement(model, sequences, modes=modes, max_positions=agreement_positions)
    result["seconds"] = time.perf_counter() - started
    return result


def print_accuracy_report(result: dict, stream=None) -> None:
    stream = stream or sys.stdout  # looked up per call: pytest's capsys replaces it
    modes = result["modes"]
    limit = "" if result["limit"] is None else f", limit {result['limit']} per task"
    print(f"\nAccuracy: {modes[0]} vs {modes[1]} on the same weights (lm-eval{limit}; "
          f"McNemar: paired exact test on per-sample correctness)", file=stream)
    print(accuracy_table(result["comparison"], modes), file=stream)
    agreement = result.get("logit_agreement")
    if agreement:
        print(f"\nLogit agreement, {modes[0]} vs {modes[1]}: {agreement['sequences']} sequences of "
              f"{agreement['length']} tokens (bundled text and random tokens)", file=stream)
        print(agreement_table(agreement), file=stream)
    retrieval = result.get("retrieval_by_length")
    if retrieval:
        from .retrieval_accuracy import accuracy_table as retrieval_table
        from .retrieval_accuracy import recall_table

        print(f"\nRetrieval accuracy per context length: {retrieval['choices']}-way multiple choice (lm-eval's acc) / "
              f"greedy exact match (lm-eval's is_greedy of the answer); McNemar against dense", file=stream)
        print(retrieval_table(retrieval), file=stream)
        print("\nIndexer recall: share of dense attention mass in the selected pages, per sparse layer", file=stream)
        print(recall_table(retrieval), file=stream)


def load_for_evaluation(model_path: Optional[str], tokenizer_path: Optional[str], *, dtype: str, device: str,
                        device_map: Optional[str]):
    """``(model, tokenizer, description)``; the embedded default model without ``model_path``."""
    enforce_offline()
    from transformers import AutoTokenizer

    from .default_model import default_model_dir, load_default_model

    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if model_path is None:
        if tokenizer_path is not None:
            raise ValueError("--tokenizer needs --model (the embedded default model has its own tokenizer)")
        torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        model, tokenizer = load_default_model(dtype=torch_dtype, device=device)
        return model, tokenizer, {"model": "embedded default", "path": str(default_model_dir()),
                                  "dtype": _dtype_name(torch_dtype), "device": device}
    from minimax_m3 import load_model

    torch_dtype = (torch.bfloat16 if device.startswith("cuda") else torch.float32) if dtype == "auto" else getattr(torch, dtype)
    if device_map is None:
        device_map = "auto" if device.startswith("cuda") else None
    model = load_model(model_path, dtype=torch_dtype, device_map=device_map).eval()
    if device_map is None and device != "cpu":
        model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
    return model, tokenizer, {"model": model_path, "tokenizer": tokenizer_path or model_path,
                              "dtype": _dtype_name(torch_dtype), "device": device, "device_map": device_map}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.accuracy", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--model", default=None,
                        help=f"checkpoint directory (default: the shipped trained tiny model; '{EMBEDDED}': the "
                             "embedded random tiny model)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--tasks", default=None,
                        help=f"comma-separated lm-eval task names (default: {','.join(DEFAULT_TASKS_EMBEDDED)} for the "
                             f"embedded model, {','.join(DEFAULT_TASKS_CHECKPOINT)} for --model)")
    parser.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    parser.add_argument("--modes", default="sparse,dense", help="candidate,reference (modes of eval.modes)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=None, help="lm-eval's context limit (default: the config's)")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--bootstrap-iters", type=int, default=0, help="lm-eval's stderr bootstrap (0: none)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: float32 for the embedded model and on CPU, bfloat16 for --model on CUDA")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--device-map", default=None, help="for --model (default: auto on CUDA)")
    parser.add_argument("--agreement-length", type=int, default=None,
                        help="tokens per logit-agreement sequence (default: 4 x topk x page size; 0 skips it)")
    parser.add_argument("--agreement-sequences", type=int, default=4)
    parser.add_argument("--agreement-positions", type=int, default=256,
                        help="positions sampled per group (within / beyond the top-k window)")
    parser.add_argument("--retrieval-lengths", type=_retrieval_lengths, default=None,
                        help=f"context lengths of the retrieval-by-length report (default for the tiny models: "
                             f"{RETRIEVAL_LENGTHS_GPU} on a GPU, {RETRIEVAL_LENGTHS_CPU} on CPU; for --model PATH: "
                             f"none; 'none' skips it)")
    parser.add_argument("--retrieval-documents", type=int, default=None,
                        help="documents per task and length in that report (default: 16 on a GPU, 1 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON results (default: eval_results/accuracy-<time>.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--verbose", action="store_true", help="lm-eval's own INFO logging")
    return add_debug_argument(parser)


def _retrieval_lengths(text: str):
    """``'none'`` or comma-separated positive token counts (the retrieval report's parser)."""
    from minimax_m3.command_line import positive_ints

    return text if text == "none" else positive_ints(text)


def _limit(value: Optional[float]):
    return int(value) if value is not None and value >= 1 and float(value).is_integer() else value


def run_command(argv=None) -> dict:
    """The command line's work; returns the results (``main`` is the console-script entry point)."""
    args = build_parser().parse_args(argv)
    enforce_offline()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.verbose:
        for name in ("lm_eval", "lm-eval", "datasets", "transformers"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if args.limit is not None and (args.limit <= 0 or args.limit > 1 and not float(args.limit).is_integer()):
        raise SystemExit(f"--limit must be a whole number of documents or a fraction below 1, got {args.limit}")
    if args.retrieval_documents is not None and args.retrieval_documents < 1:
        raise SystemExit(f"--retrieval-documents must be >= 1, got {args.retrieval_documents}")
    for name in ("batch_size", "agreement_sequences", "agreement_positions"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_length is not None and args.max_length < 1:
        raise SystemExit(f"--max-length must be >= 1, got {args.max_length}")
    for name, value in (("--num-fewshot", args.num_fewshot), ("--bootstrap-iters", args.bootstrap_iters),
                        ("--agreement-length", args.agreement_length)):
        if value is not None and value < 0:
            raise SystemExit(f"{name} must not be negative, got {value}")
    modes = tuple(m.strip() for m in args.modes.split(","))
    _check_modes(modes)
    device = str(checked_device(args.device))
    output = checked_output_path(args.output, "accuracy", overwrite=args.overwrite)
    if args.model == EMBEDDED and (args.tokenizer is not None or args.device_map is not None):
        raise SystemExit(f"--tokenizer and --device-map need a checkpoint: the {EMBEDDED} model has its own")
    if args.model is None:
        from .trained_model import trained_model_dir

        model_path = str(trained_model_dir())
    else:
        model_path = None if args.model == EMBEDDED else checked_model(args.model)
    if model_path is not None:
        checked_model(args.tokenizer or model_path, "--tokenizer" if args.tokenizer else "--model", TOKENIZER_FILES)
    default_tasks = DEFAULT_TASKS_CHECKPOINT if args.model not in (None, EMBEDDED) else DEFAULT_TASKS_EMBEDDED
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else list(default_tasks)
    if not tasks:
        raise SystemExit(f"--tasks must name at least one task, got {args.tasks!r}")
    session = TaskSession(tasks)  # an unknown or uncached task fails here, before the model loads
    model, tokenizer, description = load_for_evaluation(model_path, args.tokenizer, dtype=args.dtype, device=device,
                                                        device_map=args.device_map)
    window = model.config.index_topk_blocks * model.config.index_block_size
    if args.agreement_length and args.agreement_length <= window:
        raise SystemExit(f"--agreement-length must exceed the top-k window of {window} tokens (0 skips it), got "
                         f"{args.agreement_length}")
    run_environment = environment()
    flushed = []

    def flush(partial: dict) -> None:  # each finished part, atomically: an interrupted run keeps them
        flushed.append(write_json(output, {**partial, **description, "environment": run_environment}))

    try:
        result = evaluate_accuracy(
            model, tokenizer, tasks=tasks, modes=modes, limit=_limit(args.limit),
            batch_size=args.batch_size, max_length=args.max_length, num_fewshot=args.num_fewshot,
            bootstrap_iters=args.bootstrap_iters, agreement_length=args.agreement_length,
            agreement_sequences=args.agreement_sequences, agreement_positions=args.agreement_positions, seed=args.seed,
            session=session, on_progress=flush,
        )
        result["retrieval_by_length"] = None
        on_gpu = next(model.parameters()).is_cuda
        # by default only for the project's tiny models: their tokenizers encode digits one by one, as the synthetic
        # documents need; a checkpoint gets the report when --retrieval-lengths asks for it
        default_lengths = "none" if args.model not in (None, EMBEDDED) else (
            RETRIEVAL_LENGTHS_GPU if on_gpu else RETRIEVAL_LENGTHS_CPU)
        lengths = args.retrieval_lengths or _retrieval_lengths(default_lengths)
        if lengths != "none":
            from . import retrieval_accuracy

            flush({**result, "partial": True})
            documents = args.retrieval_documents or (16 if on_gpu else 1)
            result["retrieval_by_length"] = retrieval_accuracy.evaluate_retrieval_accuracy(
                model, tokenizer, lengths=lengths, documents=documents, recall_documents=min(documents, 4),
                after_length=lambda retrieval: flush({**result, "partial": True, "retrieval_by_length": retrieval}))
    except KeyboardInterrupt:
        saved = f"the finished parts are in {output} (\"partial\": true)" if flushed else "no part had finished"
        print(f"\ninterrupted: {saved}", file=sys.stderr)
        raise SystemExit(130) from None
    result.update(description)
    result["environment"] = run_environment
    result["partial"] = False
    print_accuracy_report(result)
    output = write_json(output, result)
    print(f"\nresults: {output}")
    return result


def _check_modes(modes: Sequence[str]) -> None:
    from .modes import MODE_SETTINGS

    if len(modes) != 2 or any(m not in MODE_SETTINGS for m in modes) or modes[0] == modes[1]:
        raise SystemExit(f"--modes must be two different modes of {', '.join(MODE_SETTINGS)} (candidate,reference), "
                         f"got {','.join(modes)}")


def main(argv=None) -> None:
    run_main(run_command, argv)


if __name__ == "__main__":
    main()
