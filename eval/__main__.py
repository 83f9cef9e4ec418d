"""The main job: ``python -m eval`` compares sparse and dense attention on the embedded default model.

1. Accuracy (``eval.accuracy``): lm-eval on the bundled key-value retrieval (short variant) and public-domain
   perplexity tasks in sparse and dense mode, side by side with the difference and the paired exact McNemar
   p-value, then the logit agreement beyond and within the top-k window.
2. Throughput (``eval.throughput``): prefill of fresh prompts and a chunked prefill in the modes sparse,
   sparse-torch, dense and transformers' native model, then one sparse layer's attention against dense.

The embedded model (``eval.default_model``) is a tiny MiniMax-M3 with random weights, created on first use:
the numbers show the machinery and sparse-vs-dense agreement, not a trained model's accuracy or GPU speed. Sized
to finish in a few minutes on a 2-core CPU. For real measurements: ``python -m eval.throughput --preset
m3-geometry`` on a GPU and ``python -m eval.accuracy --model PATH`` (see the README).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .offline import enforce_offline

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
    return parser


def run_command(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    enforce_offline()
    if args.limit < 1:
        raise SystemExit(f"--limit must be positive, got {args.limit}")
    output_dir = Path(args.output_dir or Path("eval_results") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}")
    print("MiniMax-M3 sparse vs dense on the embedded default model (tiny, random weights: it shows the machinery "
          "and how closely sparse follows dense, not a trained model's accuracy or GPU speed)", flush=True)
    results = {}
    if not args.skip_accuracy:
        from . import accuracy

        results["accuracy"] = accuracy.run_command(["--limit", str(args.limit), "--device", args.device,
                                             "--output", str(output_dir / "accuracy.json")])
        sys.stdout.flush()
    if not args.skip_throughput:
        from . import throughput

        argv_throughput = ["--preset", "embedded", "--device", args.device, "--seeds", args.seeds,
                           "--output", str(output_dir / "throughput.json")]
        if args.lengths:
            argv_throughput += ["--lengths", args.lengths]
        results["throughput"] = throughput.run_command(argv_throughput)
    logging.getLogger(__name__).info("all results in %s", output_dir)
    return results


def main(argv=None) -> None:
    run_command(argv)


if __name__ == "__main__":
    main()
