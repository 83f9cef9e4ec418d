"""Host side of the indexer's SM90 kernels: which compiled kernel serves a plan, decided once at ``plan()``.

A kernel is compiled once per static key (``ScoreKernelKey`` / ``TopkKernelKey``, plus the DSL version and the
device) with every extent and stride dynamic, so any batch, context, score pitch or page stride reuses it. It is
compiled under the TVM-FFI calling convention (``cute_runtime.TVM_FFI_OPTIONS``): the hot path passes torch tensors
straight to it, and it launches on torch's current stream. ``kernel_keys()`` lists every kernel the runtime can
select; the CPU compile check compiles exactly those, through the same ``build_kernel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from .contract import SCORE_ALIGNMENT_COLUMNS
from .cute_runtime import compile_once, compile_tvm_ffi

__all__ = [
    "ScoreKernelKey",
    "TopkKernelKey",
    "kernel_keys",
    "build_kernel",
    "compiled_kernel",
    "score_tile_rows",
    "score_page_parallel",
    "score_kernel_key",
    "topk_kernel_key",
    "TOPK_ROW_SPLIT_MAX_ROWS",
    "PlanKernelKey",
    "plan_kernel_serves",
]

FP8_TILE_ROWS = 256
"""Rows per q tile of the FP8 score kernel (4 consumer warpgroups): half the K traffic per score of 128-row tiles."""
EXACT_TILE_ROWS = 128
"""Rows per q tile of the exact (bf16) score kernel: its operands need twice the shared memory."""
PAGE_PARALLEL_TILE_ROWS = 64
"""Rows per q tile of the FP8 kernel's page-parallel variant, which a plan takes when no tile can hold more rows
(``max_seqlen_q * H`` at most 64: decode and verify steps, short chunks): its four consumer warpgroups share out
each task's pages instead of its rows."""

TOPK_ROW_SPLIT_MAX_ROWS = 2048
"""Top-k launches of at most this many rows whose buffer has more columns than a warp holds in registers (512: 16 per
lane; longer rows loop over the rest) give each row a CTA of 4 warps (``TopkSelectKernel(warps_per_row=4)``) instead
of one warp: few long rows (short queries over long contexts) are bound by each row's chain of loads, which the split
cuts by four. The selection is the same bit for bit. Measured on the H200 (docs/PERFORMANCE.md): 347 rows over 1,028
pages 8.3 -> 5.3 µs, 1,649 rows over 1,059 pages 12.4 -> 10.8 µs; at 6,504 rows (H = 4) the split was slower (16.1 ->
19.9 µs: one warp per row already fills the SMs)."""

PLAN_KERNEL_MAX_REQUESTS = 1024
PLAN_KERNEL_MAX_TILES = 1024
"""The plan kernel's shared-memory tables: requests and q tiles of a plan it serves."""
PLAN_KERNEL_MAX_ROWS = 1 << 16
PLAN_KERNEL_MAX_RANK_STEPS = 1 << 22
"""Score rows (``num_valid_pages``) and task x tile rank steps of a plan the one CTA serves; beyond them (long
prefills) the plan's torch ops, which a CUDA graph replays, spread the work over the GPU."""


@dataclass(frozen=True)
class ScoreKernelKey:
    num_heads: int
    exact: bool
    tma_stores: bool
    num_ctas: int
    page_parallel: bool = False


@dataclass(frozen=True)
class TopkKernelKey:
    warps_per_row: int


@dataclass(frozen=True)
class PlanKernelKey:
    """The one-CTA task-plan kernel (``kernels.plan_build``): no static configuration."""


KernelKey = Union[ScoreKernelKey, TopkKernelKey, PlanKernelKey]


def kernel_keys(num_ctas: int = 132) -> list:
    """Every kernel the runtime can select on a GPU of ``num_ctas`` SMs, production choices first."""
    keys = [ScoreKernelKey(num_heads, exact=False, tma_stores=True, num_ctas=num_ctas) for num_heads in (1, 2, 4)]
    keys += [TopkKernelKey(1), TopkKernelKey(4), PlanKernelKey()]
    keys += [ScoreKernelKey(num_heads, exact=False, tma_stores=False, num_ctas=num_ctas, page_parallel=True)
             for num_heads in (1, 2, 4)]
    keys += [ScoreKernelKey(num_heads, exact=False, tma_stores=False, num_ctas=num_ctas) for num_heads in (1, 2, 4)]
    keys += [ScoreKernelKey(num_heads, exact=True, tma_stores=False, num_ctas=num_ctas) for num_heads in (1, 2, 4)]
    return keys


def build_kernel(key: KernelKey):
    """The kernel object and its fake (compile-time) arguments for ``key``."""
    from .kernels import signatures

    if isinstance(key, ScoreKernelKey):
        from .kernels.score_sm90 import PageScoreKernelSm90

        return (PageScoreKernelSm90(key.num_heads, exact=key.exact, tma_stores=key.tma_stores,
                                    page_parallel=key.page_parallel, num_ctas=key.num_ctas),
                signatures.score_kernel_arguments(key.num_heads, key.exact, key.tma_stores))
    if isinstance(key, PlanKernelKey):
        from .kernels.plan_build import TaskPlanKernel

        return TaskPlanKernel(), signatures.plan_kernel_arguments()
    from .kernels.topk_select import TopkSelectKernel

    return TopkSelectKernel(warps_per_row=key.warps_per_row), signatures.topk_kernel_arguments()


def compiled_kernel(key: KernelKey):
    """The TVM-FFI function of ``key`` on the current device, compiled on first use (never inside graph capture)."""
    return compile_once(("indexer", key), lambda: compile_tvm_ffi(*build_kernel(key)))


def plan_kernel_serves(shape) -> bool:
    """Whether the one-CTA plan kernel builds this plan shape (``kernels.plan_build``): decode steps and short
    chunks, whose plans are small; its output is ``planner.build_task_plan``'s, bit for bit."""
    return (shape.num_requests <= PLAN_KERNEL_MAX_REQUESTS and shape.q_tile_capacity <= PLAN_KERNEL_MAX_TILES
            and shape.total_q * shape.num_heads <= PLAN_KERNEL_MAX_ROWS
            and shape.task_capacity * shape.q_tile_capacity <= PLAN_KERNEL_MAX_RANK_STEPS)


def score_page_parallel(exact: bool, num_heads: int, max_seqlen_q: int) -> bool:
    """Whether a plan takes the FP8 kernel's page-parallel variant: no q tile of it can hold more than 64 rows."""
    return not exact and max_seqlen_q * num_heads <= PAGE_PARALLEL_TILE_ROWS


def score_tile_rows(exact: bool, page_parallel: bool = False) -> int:
    if page_parallel:
        return PAGE_PARALLEL_TILE_ROWS
    return EXACT_TILE_ROWS if exact else FP8_TILE_ROWS


def score_kernel_key(num_heads: int, exact: bool, scores: torch.Tensor, num_ctas: int,
                     page_parallel: bool = False) -> ScoreKernelKey:
    """The score kernel for a plan: the page-parallel variant when the plan's tiles are its 64 rows; otherwise the
    FP8 kernel takes TMA stores when the buffer meets TMA's rules (a 16-byte aligned base and a row pitch of whole
    16-byte units), the masked write-out otherwise."""
    if page_parallel:
        return ScoreKernelKey(num_heads, False, False, num_ctas, page_parallel=True)
    pitch = scores.stride(0)
    tma_stores = (not exact and scores.data_ptr() % 16 == 0
                  and (scores.shape[0] <= 1 or pitch % SCORE_ALIGNMENT_COLUMNS == 0))
    return ScoreKernelKey(num_heads, exact, tma_stores, num_ctas)


def topk_kernel_key(rows: int, columns: int) -> TopkKernelKey:
    from .kernels.topk_select import TopkSelectKernel

    # more columns than a warp's lanes keep in registers on the exhaustive path
    split = 0 < rows <= TOPK_ROW_SPLIT_MAX_ROWS and columns > 32 * TopkSelectKernel.cached_per_lane
    return TopkKernelKey(4 if split else 1)
