"""The main job: ``python -m eval`` compares sparse and dense attention, on the converted SmolLM2 when it is prepared
and on the project's tiny models.

1. Accuracy. When SmolLM2-135M-Instruct converted to MiniMax-M3 is prepared (``python -m eval.real_model prepare``)
   and a trained indexer exists, ``eval.real_model evaluate`` on held-out real books (perplexity by position,
   pass key in prose, continuation choice, recall; one 4K length on a CPU). Otherwise ``eval.accuracy`` on the
   shipped trained tiny MiniMax-M3 (``eval.trained_model``: M3's indexer
   geometry, trained on long-context retrieval, its indexer distilled from its dense attention): lm-eval on the
   bundled key-value retrieval (short variant) and public-domain perplexity tasks in sparse and dense mode, side by
   side with the difference and the paired exact McNemar p-value; then retrieval accuracy per context length for
   dense, sparse (FP8 / bf16 index path), an untrained indexer and a sliding window, with the indexer's recall.
2. Throughput (``eval.throughput``) on the embedded tiny model (random weights): prefill of fresh prompts and a
   chunked prefill, decode steps (graphed and eager) and prefix-cached turns in the modes sparse, sparse-torch,
   dense and transformers' native model, then one sparse layer's attention against dense.

Sized to finish in a few minutes on a 2-core CPU, so the per-length retrieval runs one document per task at 4K
tokens: it shows the machinery; the GPU numbers (2K-32K, 16 documents per task) are in docs/ACCURACY.md. For real
measurements: ``python -m eval.throughput --preset m3-geometry`` and ``python -m eval.accuracy`` on a GPU,
``python -m eval.accuracy --model PATH`` for a checkpoint (see the README).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .cli import add_debug_argument, run_main
from .devices import checked_device
from .offline import enforce_offline
from .report import checked_output_directory, checked_output_path

__all__ = ["run_command", "main"]

DEFAULT_LIMIT = 64


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="documents per accuracy task")
    parser.add_argument("--seeds", default="0,1,2", help="throughput: one timed prefill per seed")
    parser.add_argument("--lengths", default=None, help="throughput: fresh prompt lengths (default 256,512)")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--output-dir", default=None,
                        help="where accuracy.json, throughput.json and throughput.png go (default: eval_results/eval-<time>)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --output-dir")
    return add_debug_argument(parser)


def run_command(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    enforce_offline()
    if args.limit < 1:
        raise SystemExit(f"--limit must be positive, got {args.limit}")
    checked_device(args.device)  # before the accuracy part runs anywhere else
    output_dir = Path(args.output_dir or Path("eval_results") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}")
    checked_output_directory(output_dir, "--output-dir")
    parts = [name for name, skipped in (("accuracy.json", args.skip_accuracy), ("throughput.json", args.skip_throughput),
                                        ("throughput.png", args.skip_throughput)) if not skipped]
    if args.skip_accuracy and args.skip_throughput:
        raise SystemExit("nothing to run: --skip-accuracy and --skip-throughput together skip both parts")
    existing = [name for name in parts if (output_dir / name).exists()]
    if existing and not args.overwrite:
        raise SystemExit(f"--output-dir {output_dir} already holds {', '.join(existing)}: pass --overwrite to replace "
                         f"them, or choose another --output-dir")
    for name in parts:  # a parent that is a file or not writable; existing files were handled above
        checked_output_path(output_dir / name, Path(name).stem, overwrite=True, argument="--output-dir",
                            suffix=Path(name).suffix)
    overwrite = ["--overwrite"] if args.overwrite else []
    argv_throughput = ["--preset", "embedded", "--device", args.device, "--seeds", args.seeds,
                       "--output", str(output_dir / "throughput.json"), *overwrite]
    if args.lengths:
        argv_throughput += ["--lengths", args.lengths]
    if not args.skip_throughput:  # --seeds and --lengths are checked now, not after the accuracy part
        from . import throughput

        throughput.resolve_arguments(throughput.build_parser().parse_args(argv_throughput))
    print("MiniMax-M3 sparse vs dense: accuracy (the model is named below), then throughput on the embedded random "
          "tiny model (CPU-sized: it shows the machinery, not GPU speed)", flush=True)
    results = {}
    if not args.skip_accuracy:
        results["accuracy"] = _run_accuracy(args, output_dir / "accuracy.json", overwrite)
        sys.stdout.flush()
    if not args.skip_throughput:
        results["throughput"] = throughput.run_command(argv_throughput)
    logging.getLogger(__name__).info("all results in %s", output_dir)
    return results


REAL_MODEL_CPU = ["--lengths", "4096", "--windows", "2", "--documents", "2", "--recall-documents", "1"]
"""The real model's evaluation sized for a 2-core CPU (about ten minutes): one length beyond the top-k pages."""


def _run_accuracy(args, output: Path, overwrite: list) -> dict:
    """The converted SmolLM2 (``eval.real_model``) when it is prepared and has a trained indexer; otherwise the
    shipped trained tiny model (``eval.accuracy``). Either way the choice is printed and recorded."""
    from .real_model.__main__ import prepared_for_evaluation

    prepared = prepared_for_evaluation()
    if prepared is not None:
        from .real_model.__main__ import run_command as run_real_model

        directory, indexer = prepared
        print(f"accuracy: the converted SmolLM2-135M-Instruct ({directory}, indexer {indexer})", flush=True)
        sizing = REAL_MODEL_CPU if checked_device(args.device).type == "cpu" else []
        result = run_real_model(["evaluate", "--device", args.device, "--indexer", str(indexer), *sizing,
                                 "--output", str(output), *overwrite])
        return {**result, "accuracy_model": "converted SmolLM2-135M-Instruct"}
    from . import accuracy

    print("accuracy: the shipped trained tiny model (the converted SmolLM2 is not prepared: python -m "
          "eval.real_model prepare, then distill, or use the shipped indexer)", flush=True)
    result = accuracy.run_command(["--limit", str(args.limit), "--device", args.device, "--output", str(output),
                                   *overwrite])
    return {**result, "accuracy_model": "trained tiny model"}


def main(argv=None) -> None:
    run_main(run_command, argv)


if __name__ == "__main__":
    main()
