"""The model benches' ``--output`` and ``--device`` checks, made before any work, and their atomic JSON writes.

The eval commands have the same checks (``eval.report.checked_output_path``, ``eval.devices.checked_device``);
``minimax_m3`` sits below ``eval`` and cannot import them. Errors go through ``parser.error``: one usage line and
status 2."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Optional

import torch

from .remote_code import write_text_atomically

__all__ = ["add_output_arguments", "checked_output", "checked_device", "positive_int", "positive_ints", "write_json",
           "write_results"]


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default=None,
                        help="JSON results path (rewritten atomically after each measurement, \"partial\" until the end)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")


def checked_output(parser: argparse.ArgumentParser, output, overwrite: bool) -> Optional[Path]:
    """``output`` as a path (None without one), refused through ``parser.error`` when it is a directory, an existing
    file without ``overwrite``, or under a file or an unwritable directory."""
    if output is None:
        return None
    path = Path(output)
    if path.is_dir():
        parser.error(f"--output {path} is a directory: give a file path, e.g. {path / 'results.json'}")
    if path.exists() and not overwrite:
        parser.error(f"--output {path} exists: pass --overwrite to replace it, or choose another path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                parser.error(f"--output {path}: {parent} is a file, not a directory")
            if not os.access(parent, os.W_OK):
                parser.error(f"--output {path}: {parent} is not writable")
            break
    return path


def checked_device(parser: argparse.ArgumentParser, text: str) -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; a device this machine does not
    have is refused through ``parser.error`` instead of failing (or falling back) later."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        parser.error(f"--device {text!r}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {text}: CUDA is not available on this machine (use cpu or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def write_json(path: Path, payload) -> Path:
    """``payload`` as indented JSON, atomically: the whole new file or the previous one, never a torn write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(str(path), json.dumps(payload, indent=1) + "\n")
    return path


def write_results(path: Optional[Path], results: list, *, partial: bool) -> None:
    """``{"partial": ..., "results": [...]}`` into ``path`` (None: nothing), atomically: rewritten after every
    measurement, so an interrupted run keeps the finished ones, marked partial."""
    if path is not None:
        write_json(path, {"partial": partial, "results": results})


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
    """argparse type: comma-separated integers of at least 1 (the eval commands' lengths too)."""
    try:
        return tuple(positive_int(part) for part in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None
