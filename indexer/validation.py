"""Argument checks shared by the wrapper and ``topk_select``.

Every check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong value, shape, stride,
device, alignment) with a message that names the argument and what was expected. None of them reads
device memory, so they never synchronise.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

__all__ = [
    "check_host_int",
    "check_tensor",
    "check_same_device",
    "check_alignment",
    "check_unit_stride_1d",
]


def check_host_int(name: str, value, *, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_tensor(
    name: str,
    value,
    *,
    dtypes: Iterable[torch.dtype],
    ndim: Optional[int] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    dtypes = tuple(dtypes)
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if device is not None:
        check_same_device(name, value, device)
    return value


def check_same_device(name: str, value: torch.Tensor, device: torch.device) -> None:
    if value.device != device:
        raise ValueError(f"{name} must be on {device} (the device of cu_seqlens_q), got {value.device}")


def check_alignment(name: str, value: torch.Tensor, alignment: int) -> None:
    if value.numel() > 0 and value.data_ptr() % alignment != 0:
        raise ValueError(f"{name} must be {alignment}-byte aligned, got data_ptr % {alignment} = {value.data_ptr() % alignment}")


def check_unit_stride_1d(name: str, value: torch.Tensor) -> None:
    if value.numel() > 1 and value.stride(0) != 1:
        raise ValueError(f"{name} must have stride 1, got stride {value.stride(0)}")
