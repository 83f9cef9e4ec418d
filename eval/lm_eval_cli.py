"""lm-eval's own command line with this project's model type registered: ``minimax-m3-lm-eval`` (or ``python -m
eval.lm_eval_cli``) takes exactly ``lm_eval``'s arguments.

It imports ``minimax_m3`` (which registers the ``minimax_m3`` model type with transformers' Auto classes) and hands
over to ``lm_eval``'s CLI unchanged, so ``--model hf --model_args pretrained=<checkpoint>`` loads our checkpoints
without ``trust_remote_code``. Plain ``lm_eval`` works too, with ``trust_remote_code=True`` in ``--model_args``:
the checkpoints carry an ``auto_map`` to this installed package (``minimax_m3.remote_code``). The one argument of
ours, ``--debug``, is taken out before lm-eval sees it: without it an error is one line (``eval.cli.run_main``).
"""

from __future__ import annotations

import sys

from .cli import run_main


def run_command(argv) -> None:
    import minimax_m3  # noqa: F401  (registers the model type)
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *argv]  # lm-eval's CLI parses sys.argv only
    cli_evaluate()


def main(argv=None) -> None:
    run_main(run_command, argv, strip_debug=True)


if __name__ == "__main__":
    main()
