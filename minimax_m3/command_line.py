"""What every command of the project checks before any work, and how it writes results: the ``--device`` and output
path checks, counts of at least 1, and atomic file writes. ``minimax_m3``'s benches and the ``eval`` commands share
them (``eval`` sits above ``minimax_m3``). A failed check raises ``SystemExit`` naming the argument; an argparse
command turns it into its one-line usage error (``checked_output_argument``, ``device_argument``)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

__all__ = ["atomic_write", "check_writable_parent", "checked_output_file", "checked_output_argument",
           "add_output_arguments", "write_results", "checked_device", "device_argument", "positive_int",
           "positive_ints"]


def atomic_write(path, write) -> Path:
    """``write(temporary_path)`` fills a temporary file next to ``path``, which then replaces ``path`` in one
    rename: readers see the whole new file or the previous one, never a torn write, and a failure (a full disk, a
    file-size limit, Ctrl-C) keeps what was there and leaves no temporary behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(temporary))
        with open(temporary, "rb") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def check_writable_parent(path: Path, argument: str) -> None:
    """The nearest existing parent of ``path`` must be a writable directory (``SystemExit`` naming ``argument``)."""
    for parent in Path(path).parents:
        if parent.exists():
            if not parent.is_dir():
                raise SystemExit(f"{argument} {path}: {parent} is a file, not a directory")
            if not os.access(parent, os.W_OK):
                raise SystemExit(f"{argument} {path}: {parent} is not writable")
            return


def checked_output_file(output, *, overwrite: bool, argument: str = "--output",
                        example_name: str = "results.json") -> Path:
    """A results file path, checked before any work: a directory, an existing file without ``overwrite`` or a
    parent that cannot be written raise ``SystemExit`` naming ``argument``."""
    path = Path(output)
    if path.is_dir():
        raise SystemExit(f"{argument} {path} is a directory: give a file path, e.g. {path / example_name}")
    if path.exists() and not overwrite:
        raise SystemExit(f"{argument} {path} exists: pass --overwrite to replace it, or choose another path")
    check_writable_parent(path, argument)
    return path


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """A bench's optional ``--output`` JSON file and its ``--overwrite``."""
    parser.add_argument("--output", default=None,
                        help="JSON results path (rewritten atomically after each measurement, \"partial\" until the end)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")


def checked_output_argument(parser: argparse.ArgumentParser, output, overwrite: bool) -> Optional[Path]:
    """``checked_output_file`` for an optional ``--output`` (None without one), failing as ``parser``'s usage error."""
    if output is None:
        return None
    try:
        return checked_output_file(output, overwrite=overwrite)
    except SystemExit as error:
        parser.error(str(error))


def write_results(path: Optional[Path], results: list, *, partial: bool) -> None:
    """``{"partial": ..., "results": [...]}`` into ``path`` (None: nothing), atomically: rewritten after every
    measurement, so an interrupted run keeps the finished ones, marked partial."""
    if path is not None:
        text = json.dumps({"partial": partial, "results": results}, indent=1) + "\n"
        atomic_write(path, lambda temporary: temporary.write_text(text))


def checked_device(text: str, argument: str = "--device") -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; a device this machine does not
    have raises ``SystemExit`` naming ``argument``: a run must not fall back silently and record a device it never
    used."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise SystemExit(f"{argument} {text!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"{argument} {text}: CUDA is not available on this machine (use cpu or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(f"{argument} {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise SystemExit(f"{argument} {text!r}: expected auto, cpu, cuda or cuda:N")
    return device


def device_argument(text: str) -> torch.device:
    """``checked_device`` as an argparse ``type``."""
    try:
        return checked_device(text)
    except SystemExit as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (counts, lengths, repeats)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_ints(text: str) -> tuple:
    """argparse type: comma-separated integers of at least 1."""
    try:
        return tuple(positive_int(part) for part in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None
