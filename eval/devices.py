"""The ``--device`` argument of the eval commands, checked before any work."""

from __future__ import annotations

import argparse

import torch

__all__ = ["checked_device", "device_argument"]


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
