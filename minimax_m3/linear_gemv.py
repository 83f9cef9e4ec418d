"""A decode step's linear layers by the weight-streaming GEMV kernel (``kernels/linear_gemv_sm90.py``).

``linear_gemv(x, weight)`` is ``F.linear(x, weight)`` for 1 to ``MAX_TOKENS`` bf16 rows on an SM90 GPU: one CTA per
SM streams its band of the weight's rows through shared memory by bulk copies, the products and sums in fp32.
``linear_gemv_serves`` says where it applies; the model calls it through ``project``, which keeps ``F.linear``
everywhere else (more rows, other dtypes or devices, a gradient to record).
"""

from __future__ import annotations

from typing import Optional

import torch

from indexer.cute_runtime import compile_once, compile_tvm_ffi, dsl_available, sm_count

__all__ = ["MAX_TOKENS", "global_forward_hooks", "linear", "linear_gemv", "linear_gemv_serves", "max_depth", "project"]

MAX_TOKENS = 4
"""The most rows one call multiplies (``LinearGemvSm90``: a group's sums are one per lane)."""
MIN_DEPTH = 1024
"""Narrower inputs keep cuBLAS: a row of a few hundred bytes per stage leaves the ring latency-bound (256 and 512
wide: 20 µs against cuBLAS's 4-5 µs, H200)."""


def max_depth(tokens: int) -> int:
    """The widest input ``linear_gemv`` takes for ``tokens`` rows: 8,192 for 3 or 4, 16,384 for 2, 32,768 for 1
    (each thread holds its share of the activations in registers)."""
    from .kernels.linear_gemv_sm90 import LinearGemvSm90

    return LinearGemvSm90.max_depth(tokens)


def linear_gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear_gemv`` takes these operands: ``x [T, K]`` bf16 with 1 to ``MAX_TOKENS`` rows, 16-byte
    aligned with a row stride of a multiple of 8 and unit column stride, ``weight [N, K]`` bf16 contiguous and
    16-byte aligned on the same SM90 GPU, K a multiple of 8 up to ``max_depth(T)``, the CuTe DSL present and no
    gradient to record."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_TOKENS and x.dtype == torch.bfloat16
            and type(weight.data) is torch.Tensor and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.device == x.device and weight.shape[1] == x.shape[1] and weight.shape[0] > 0
            and x.shape[1] % 8 == 0 and x.shape[1] >= MIN_DEPTH
            and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and dsl_available() and torch.cuda.get_device_capability(x.device)[0] == 9
            and x.shape[1] <= max_depth(x.shape[0]))


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T`` (``[T, N]`` bf16, into ``out`` when given) by the GEMV kernel; raises where
    ``linear_gemv_serves`` does not hold."""
    if not linear_gemv_serves(x, weight):
        raise ValueError(
            f"linear_gemv needs bf16 x [T <= {MAX_TOKENS}, K] (16-byte aligned rows) and a contiguous bf16 weight "
            f"[N, K] on an SM90 GPU with the CuTe DSL, K a multiple of 8 up to max_depth(T), no gradient; got x "
            f"{tuple(x.shape)} {x.dtype} stride {tuple(x.stride())} on {x.device}, weight {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}")
    shape = (x.shape[0], weight.shape[0])
    if out is not None and (out.shape != shape or out.dtype != torch.bfloat16 or out.device != x.device
                            or out.stride(-1) != 1):
        raise ValueError(f"out must be bf16 {list(shape)} on {x.device} with unit column stride, got {out.dtype} "
                         f"{list(out.shape)} stride {tuple(out.stride())} on {out.device}")
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=x.device)
    ctas = min(sm_count(x.device), weight.shape[0])
    _kernel(x.device, x.shape[0], x.shape[1])(x, weight, out, ctas)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), by ``linear_gemv`` where it serves ``x``'s rows (any leading shape)."""
    rows = x.reshape(-1, x.shape[-1])
    if linear_gemv_serves(rows, weight):
        return linear_gemv(rows, weight).view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight)


def project(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, by ``linear_gemv`` where it serves ``x``'s rows and ``module`` is a plain bias-free
    ``nn.Linear`` called as it is (no forward hooks, no accelerate hook or replaced ``forward``: quantised,
    adapted or offloaded modules keep their own call)."""
    if (type(module) is torch.nn.Linear and module.bias is None and not module._forward_hooks
            and not module._forward_pre_hooks and "forward" not in vars(module) and not hasattr(module, "_hf_hook")
            and not global_forward_hooks()):
        rows = x.reshape(-1, x.shape[-1])
        if linear_gemv_serves(rows, module.weight):
            return linear_gemv(rows, module.weight).view(*x.shape[:-1], module.weight.shape[0])
    return module(x)


def global_forward_hooks() -> bool:
    """Forward hooks registered for every module (``nn.modules.module.register_module_forward_hook``)."""
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def _kernel(device: torch.device, tokens: int, depth: int):
    from .kernels.linear_gemv_sm90 import LinearGemvSm90
    from .kernels.signatures import linear_gemv_arguments

    with torch.cuda.device(device):
        return compile_once(("linear_gemv_sm90", tokens, depth), lambda: compile_tvm_ffi(
            LinearGemvSm90(tokens, depth), linear_gemv_arguments(tokens, depth)))
