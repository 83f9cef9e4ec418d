"""How the eval commands fail: one line for an error the user can fix, the traceback behind ``--debug``.

``run_main(command, argv)`` runs ``command(argv)`` (a command's ``run_command``) and reports its errors as one line
``error: <message>`` on stderr. A ``SystemExit`` with a message (the argument checks) or a ``UsageError`` exits with
status 2, argparse's convention; a runtime failure the user can act on (``OSError``: a missing file, a full disk,
a path that cannot be written; out of memory) with status 1. Anything else is a bug: its line says so, names
``--debug`` and exits with status 1. With ``--debug`` the full traceback comes first, the status stays the same.

``checked_model`` is the ``--model`` check of the commands that load a checkpoint (runs are offline, so a hub id
must already be in the local cache).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

__all__ = ["DEBUG_FLAG", "UsageError", "add_debug_argument", "debug_requested", "run_main", "checked_model",
           "MODEL_FILES", "TOKENIZER_FILES"]

DEBUG_FLAG = "--debug"
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
RUNTIME_ERRORS = (OSError, MemoryError, torch.OutOfMemoryError)


class UsageError(ValueError):
    """Arguments that cannot work, found past argument parsing (e.g. a training state that is not the one asked
    for); a ``ValueError``, so that callers catching those keep working."""


def add_debug_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(DEBUG_FLAG, action="store_true", help="show the full traceback of an error")
    return parser


def debug_requested(argv: Sequence[str]) -> bool:
    """``--debug`` among the options (not after a ``--``), found before parsing so that a parse error has it too."""
    argv = list(argv)
    return DEBUG_FLAG in (argv[:argv.index("--")] if "--" in argv else argv)


def _one_line(text) -> str:
    return " ".join(str(text).split())


def run_main(command: Callable, argv: Optional[Sequence[str]] = None, *, strip_debug: bool = False):
    """``command(argv)`` with its errors reported as described above; returns what ``command`` returns.
    ``strip_debug``: ``--debug`` is taken out of the arguments (a command line that is not ours, lm-eval's)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(arguments)
    if strip_debug:
        arguments = [a for a in arguments if a != DEBUG_FLAG]
    try:
        return command(arguments)
    except SystemExit as error:
        if error.code is None or isinstance(error.code, int):  # argparse, --help and interrupts already spoke
            raise
        failure, line, status = error, _one_line(error.code), 2
    except UsageError as error:
        failure, line, status = error, _one_line(error), 2
    except KeyboardInterrupt as error:
        failure, line, status = error, "interrupted", 130
    except RUNTIME_ERRORS as error:
        failure, line, status = error, _one_line(error) or type(error).__name__, 1
    except Exception as error:
        line = f"{type(error).__name__}: {_one_line(error)} (unexpected; rerun with {DEBUG_FLAG} for the traceback)"
        failure, status = error, 1
    if debug:
        traceback.print_exception(failure)
    print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def checked_model(text: str, argument: str = "--model", files: Sequence[str] = MODEL_FILES) -> str:
    """``text`` when it names a directory holding one of ``files`` or a hub id whose file is in the local Hugging
    Face cache; else ``SystemExit`` naming ``argument``, before anything is loaded."""
    path = Path(text)
    wanted = " or ".join(files)
    if path.is_dir():
        if not any((path / name).is_file() for name in files):
            raise SystemExit(f"{argument} {text}: the directory has no {wanted}")
        return text
    if path.exists():
        raise SystemExit(f"{argument} {text} is a file: give a checkpoint directory (with {wanted}) or a hub id")
    if not any(isinstance(_cached_hub_file(text, name), str) for name in files):
        raise SystemExit(f"{argument} {text}: no such directory, nor a hub id in the local Hugging Face cache (runs "
                         f"are offline): give a directory with {wanted}, or download the model first")
    return text


def _cached_hub_file(repo_id: str, name: str):
    from huggingface_hub import try_to_load_from_cache

    try:
        return try_to_load_from_cache(repo_id, name)
    except ValueError:  # huggingface_hub's HFValidationError: not a well-formed repo id, e.g. an absolute path
        return None
