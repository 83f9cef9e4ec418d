"""The ``--device`` argument of the eval commands, checked before any work (the project's one check, in
``minimax_m3.command_line``)."""

from __future__ import annotations

from minimax_m3.command_line import checked_device, device_argument

__all__ = ["checked_device", "device_argument"]
