"""Forced-local-page top-k page selection (docs/INDEXER.md, "Top-k select")."""

from __future__ import annotations

from typing import Optional

import torch

from .contract import ERROR_WORDS, MAX_PAGES_PER_ROW, QUANT_BIAS, QUANT_LEVELS
from .fp32_math import div_f32, fma_f32
from .validation import check_host_int, check_tensor, check_unit_stride_1d

__all__ = ["topk_select", "quantisation_keys", "validate_topk_inputs"]

_ROW_CHUNK_ELEMENTS = 1 << 21
_INVALID_KEY = -1


def topk_select(
    scores: torch.Tensor,
    num_valid_pages: torch.Tensor,
    *,
    topk: int = 16,
    out: Optional[torch.Tensor] = None,
    validate: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Select ``topk`` logical pages per row, the local page forced into the last valid slot.

    ``scores`` is ``[rows, cols]`` fp32 with unit column stride and any row pitch; only columns
    ``[0, num_valid_pages[r] - 1)`` of row ``r`` are read. Returns ``[rows, topk]`` int32 (``out``
    when given). Checks that need the values of ``num_valid_pages`` (``1 <= n <= cols + 1`` and
    ``n <= 65536``) run when ``validate=True`` and always for CPU tensors, where they cost no sync.

    ``backend``: ``"auto"`` runs the GPU kernel for CUDA tensors with ``topk == 16`` when the CuTe DSL
    is available (bitwise the same result, tested), torch ops otherwise; ``"torch"`` forces torch ops.
    """
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend must be 'auto' or 'torch', got {backend!r}")
    validate_topk_inputs(scores, num_valid_pages, topk=topk, out=out, validate=validate)
    if out is None:
        out = torch.empty(scores.shape[0], topk, dtype=torch.int32, device=scores.device)
    if backend == "auto" and _kernel_serves(scores, topk) and scores.shape[0] > 0:
        from .cute_backend import topk_kernel_key
        from .ops import topk_select16

        # the kernel clamps row lengths outside [1, cols + 1] into it; validate=True raises on them first
        topk_select16(scores, num_valid_pages, out, _scratch_errors(scores.device),
                      topk_kernel_key(*scores.shape).warps_per_row)
        return out
    rows, cols = scores.shape
    chunk = max(1, _ROW_CHUNK_ELEMENTS // max(cols, topk))
    for begin in range(0, rows, chunk):
        end = min(rows, begin + chunk)
        out[begin:end] = _select_rows(scores[begin:end], num_valid_pages[begin:end], topk)
    return out


def _kernel_serves(scores: torch.Tensor, topk: int) -> bool:
    if scores.device.type != "cuda" or topk != 16:
        return False
    from .cute_runtime import dsl_available

    return dsl_available()


_scratch: dict = {}


def _scratch_errors(device: torch.device) -> torch.Tensor:
    """The error words the kernel writes when called outside a wrapper (nobody reads them)."""
    errors = _scratch.get(device)
    if errors is None:
        errors = _scratch[device] = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)
    return errors


def validate_topk_inputs(scores, num_valid_pages, *, topk, out, validate) -> None:
    check_host_int("topk", topk, minimum=1)
    check_tensor("scores", scores, dtypes=(torch.float32,), ndim=2)
    if scores.shape[1] > 0 and scores.stride(1) != 1:
        raise ValueError(f"scores must have stride(1) == 1 (contiguous pages in a row), got stride {scores.stride()}")
    if scores.shape[0] > 1 and scores.stride(0) < scores.shape[1]:
        raise ValueError(
            f"scores rows must not overlap: stride(0) must be >= shape[1] = {scores.shape[1]}, got {scores.stride(0)}"
        )
    if scores.shape[1] + 1 > MAX_PAGES_PER_ROW:
        raise ValueError(f"scores may have at most {MAX_PAGES_PER_ROW - 1} history columns, got {scores.shape[1]}")
    check_tensor("num_valid_pages", num_valid_pages, dtypes=(torch.int32,), ndim=1, device=scores.device)
    check_unit_stride_1d("num_valid_pages", num_valid_pages)
    if num_valid_pages.shape[0] != scores.shape[0]:
        raise ValueError(
            f"num_valid_pages must have shape [{scores.shape[0]}] (one entry per score row), "
            f"got {tuple(num_valid_pages.shape)}"
        )
    if out is not None:
        check_tensor("out", out, dtypes=(torch.int32,), ndim=2, device=scores.device)
        if tuple(out.shape) != (scores.shape[0], topk):
            raise ValueError(f"out must have shape [{scores.shape[0]}, {topk}], got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    if (validate or num_valid_pages.device.type == "cpu") and num_valid_pages.numel() > 0:
        low = int(num_valid_pages.min())
        high = int(num_valid_pages.max())
        limit = min(scores.shape[1] + 1, MAX_PAGES_PER_ROW)
        if low < 1 or high > limit:
            raise ValueError(
                f"num_valid_pages must lie in [1, {limit}] (scores has {scores.shape[1]} columns; at most "
                f"{MAX_PAGES_PER_ROW} pages per row), got values in [{low}, {high}]"
            )


def quantisation_keys(history_scores: torch.Tensor, num_history: torch.Tensor) -> torch.Tensor:
    """The 32-bit selection keys ``(qv << 16) | (~p & 0xFFFF)`` as int64, ``-1`` beyond each row's history.

    ``history_scores`` is ``[rows, cols]`` fp32, ``num_history`` ``[rows]`` the count of valid leading
    columns per row (``n - 1``); rows with no history get all ``-1``.
    """
    rows, cols = history_scores.shape
    device = history_scores.device
    columns = torch.arange(cols, device=device)
    valid = columns[None, :] < num_history.to(torch.int64)[:, None]
    has_history = num_history > 0
    # Unread columns may hold anything (NaN included): select them out before any arithmetic.
    low = torch.where(valid, history_scores, torch.inf).amin(dim=1) if cols else history_scores.new_zeros(rows)
    high = torch.where(valid, history_scores, -torch.inf).amax(dim=1) if cols else history_scores.new_zeros(rows)
    low = torch.where(has_history, low, 0.0)
    high = torch.where(has_history, high, 0.0)
    spread = high - low  # one IEEE fp32 subtraction
    quotient = div_f32(torch.full_like(spread, QUANT_LEVELS), spread)
    scale = torch.where((spread == 0) | ~torch.isfinite(quotient), 0.0, quotient)
    bias = fma_f32(-low, scale, QUANT_BIAS)
    values = torch.where(valid, history_scores, 0.0)
    quantised = fma_f32(values, scale[:, None], bias[:, None])
    # clamp before the integer cast: the float may be far outside [0, 65535] when the row spread is a few ulps.
    levels = torch.trunc(quantised).clamp(0.0, 65535.0).to(torch.int64)
    keys = (levels << 16) | (~columns & 0xFFFF)[None, :]
    return torch.where(valid, keys, _INVALID_KEY)


def _select_rows(scores: torch.Tensor, num_valid_pages: torch.Tensor, topk: int) -> torch.Tensor:
    rows = scores.shape[0]
    device = scores.device
    valid_pages = num_valid_pages.to(torch.int64)
    slots = torch.arange(topk, device=device)
    short = torch.where(slots[None, :] < valid_pages[:, None], slots[None, :], -1)
    if topk == 1:
        ranked = torch.empty(rows, 0, dtype=torch.int64, device=device)
    else:
        keys = quantisation_keys(scores, valid_pages - 1)
        if keys.shape[1] < topk - 1:
            padding = keys.new_full((rows, topk - 1 - keys.shape[1]), _INVALID_KEY)
            keys = torch.cat([keys, padding], dim=1)
        # Keys are distinct within a row (the low 16 bits hold ~page), so the order is total and unique.
        best = torch.topk(keys, topk - 1, dim=1, largest=True, sorted=True).values
        ranked = torch.where(best >= 0, ~best & 0xFFFF, -1)
    long = torch.cat([ranked, (valid_pages - 1)[:, None]], dim=1)
    return torch.where(valid_pages[:, None] > topk, long, short).to(torch.int32)
