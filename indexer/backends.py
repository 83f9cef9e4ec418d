"""Which backend serves a configuration, and the once-per-configuration log line saying so."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from .contract import DEFAULT_TOPK, FP8_DTYPE, HEAD_DIM, KERNEL_NUM_HEADS, PAGE_SIZE

__all__ = ["BackendChoice", "resolve_backend", "cute_kernel_available", "kernel_unsupported_reason"]

logger = logging.getLogger("indexer")
_logged_choices: set = set()


@dataclass(frozen=True)
class BackendChoice:
    name: str  # "torch" or "cute"
    reason: str


def cute_kernel_available() -> bool:
    """Whether the CuTe DSL (``nvidia-cutlass-dsl``) and TVM-FFI import, so the SM90 kernel can be built and called."""
    from .cute_runtime import dsl_available

    return dsl_available()


def kernel_unsupported_reason(
    *,
    device: torch.device,
    num_heads: int,
    page_size: int,
    topk: int,
    precision: str = "auto",
    dtype: Optional[torch.dtype] = None,
    head_dim: Optional[int] = None,
) -> Optional[str]:
    """Why the GPU kernel cannot serve this configuration, or None when it can."""
    if device.type != "cuda":
        return f"the kernel needs a CUDA device, the metadata is on {device}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"the kernel needs an SM90 GPU, {torch.cuda.get_device_name(device)} is SM{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    if num_heads not in KERNEL_NUM_HEADS:
        return f"the kernel supports num_heads in {KERNEL_NUM_HEADS}, got {num_heads}"
    if page_size != PAGE_SIZE:
        return f"the kernel supports page_size {PAGE_SIZE}, got {page_size}"
    if topk != DEFAULT_TOPK:
        return f"the kernel supports topk {DEFAULT_TOPK}, got {topk}"
    if dtype is not None and dtype != FP8_DTYPE:
        return f"the kernel needs {FP8_DTYPE} inputs, got {dtype}"
    if head_dim is not None and head_dim != HEAD_DIM:
        return f"the kernel needs head dim {HEAD_DIM}, got {head_dim}"
    if not cute_kernel_available():
        return "the CuTe DSL (nvidia-cutlass-dsl) or TVM-FFI (apache-tvm-ffi) does not import"
    return None


def resolve_backend(requested: str, **config) -> BackendChoice:
    """Resolve ``"auto"``/``"torch"``/``"cute"`` for one configuration; ``"cute"`` that cannot serve raises."""
    if requested == "torch":
        return _log(BackendChoice("torch", "requested"), config)
    reason = kernel_unsupported_reason(**config)
    if requested == "cute":
        if reason is not None:
            raise RuntimeError(f"backend='cute' cannot serve this configuration: {reason}")
        return _log(BackendChoice("cute", "requested"), config)
    if reason is None:
        return _log(BackendChoice("cute", "SM90 kernel fits the configuration"), config)
    return _log(BackendChoice("torch", f"fallback: {reason}"), config)


def _log(choice: BackendChoice, config: dict) -> BackendChoice:
    key = (choice, tuple(sorted((k, str(v)) for k, v in config.items())))
    if key not in _logged_choices:
        _logged_choices.add(key)
        settings = ", ".join(f"{k}={v}" for k, v in sorted(config.items()) if v is not None)
        logger.info("indexer backend %r serves (%s): %s", choice.name, settings, choice.reason)
    return choice
