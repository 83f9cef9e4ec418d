"""Host side of the SM90 CuTe DSL kernels: tensor conversion, compile cache, launch.

Kernels are compiled once per static key (kernel, num_heads, SM count, DSL version) with every
extent and stride dynamic, so any batch, context, score pitch or page stride reuses them. A compile
that would be needed inside CUDA-graph capture raises instead (warm up before capturing).
"""

from __future__ import annotations

import functools
import importlib.metadata
import threading

import torch

from .contract import score_row_pitch

__all__ = ["dsl_available", "dsl_version", "PageScoreRunner", "run_topk_select", "as_cute_tensor", "cute_stream",
           "compile_once"]

_lock = threading.Lock()
_compiled: dict = {}

SCORE_TILE_ROWS = 256
"""Rows per q tile of the score kernel: 128 (2 consumer warpgroups with paired pages), 192 (3, paired pages;
measured slower) or 256 (4 consumer warpgroups). The plan is built for it; chosen by measurement (docs/PERFORMANCE.md)."""

SCORE_ISSUE_RING = "commit"
"""256-row tiles: pass a wgmma-issue token between the consumer warpgroups, ``"commit"`` or ``"progress"``
(``PageScoreKernelSm90(issue_ring=...)``), or None; the scores are the same bit for bit. Chosen by measurement
(docs/PERFORMANCE.md)."""

SCORE_TMA_STORES = True
"""256-row tiles: whole staged blocks of row maxima leave by TMA stores (``PageScoreKernelSm90(tma_stores=True)``)
when the score buffer allows it (16-byte aligned base, row pitch a multiple of 4 floats); the scores are the same bit
for bit. Chosen by measurement (docs/PERFORMANCE.md, session 8)."""

SCORE_INTEGER_ROW_MAX = True
"""Score kernel: reduce each row's values to its page maximum on their int32 bit patterns with three-input integer
max instructions (``PageScoreKernelSm90(integer_row_max=True)``), half the instructions of the float tree; the scores
are the same values. Measured in session 10 (docs/PERFORMANCE.md): quick run at H = 1, scores 78.1 -> 76.1 µs."""

SCORE_SKIP_IDLE_WARPGROUPS = False
"""256-row tiles: a consumer warpgroup whose 64 rows lie beyond a task's valid rows (a request's last, partial tile)
skips the task's wgmmas and reductions (``PageScoreKernelSm90(skip_idle_warpgroups=True)``); the scores are the same.
Pairs with the planner's ``task_cost="warpgroup"``. Off: measured slower in session 10 (docs/PERFORMANCE.md; quick
run at H = 1, scores 78.1 -> 79.7 µs with the warpgroup cost)."""

PROGRAMMATIC_TOPK = False
"""Launch the top-k as a programmatic dependent of the score kernel (``TopkSelectKernel(programmatic_launch=True)``,
``PageScoreKernelSm90(release_dependents=True)``): its CTAs are scheduled on the SMs the score kernel's tail frees and
wait there for the scores; the result is the same bit for bit. Off: no gain measured in session 10
(docs/PERFORMANCE.md; quick run at H = 1, 87.6 vs 87.9 µs)."""

TOPK_KERNEL_OPTIONS = dict(
    lane_list_length=4,
    rest_batch=4,
    saturating_u16_levels=True,
    row_range_by_redux=True,
    winners_in_shared=True,
    heads_in_registers=False,
    longest_rows_first=True,
    max_registers=40,
)
"""``TopkSelectKernel``'s constructor options; every choice selects the same pages bit for bit, the speed differs.
``lane_list_length`` 4 (keys per lane in the fast path; None: the exhaustive path only) and ``rest_batch`` 4 (columns
beyond a lane's cached slots loaded four per loop trip) were chosen by measurement (docs/PERFORMANCE.md, sessions 5
and 8). Built in session 9 and measured in session 10 (docs/PERFORMANCE.md): one float-to-u16 conversion per key
instead of a clamp and a conversion, the row's min and max by a tree in each lane and one ``redux.sync`` each across
the warp, the ranked winners collected in shared memory instead of a compare and select per round, CTAs started from
the longest rows, and a 40-register limit (under DSL 4.3.5 ``rest_batch`` 4 took 48 registers, 10 CTAs per SM instead
of 12): together 28.2 -> 26.5 µs weighted top-k at H = 4, 11.5 -> 11.0 at H = 1. The fast path's list heads in
registers (``heads_in_registers``) measured within noise and stays off."""

TOPK_ROW_SPLIT_MAX_ROWS = 2048
"""Top-k launches of at most this many rows whose buffer has more columns than a warp holds in registers (512: 16 per
lane; longer rows loop over the rest) give each row a CTA of 4 warps (``TopkSelectKernel(warps_per_row=4)``) instead
of one warp: few long rows (short queries over long contexts) are bound by each row's chain of loads, which the split
cuts by four. 0: never. The selection is the same bit for bit. Measured in session 10 (docs/PERFORMANCE.md): 347 rows
over 1,028 pages 8.3 -> 5.3 µs, 1,649 rows over 1,059 pages 12.4 -> 10.8 µs; at 6,504 rows (H = 4) the split was
slower (16.1 -> 19.9 µs: one warp per row already fills the SMs), hence 2,048."""


@functools.cache
def dsl_version() -> str:
    # cached: a metadata lookup costs ~0.15 ms, and it is part of every launch's cache key
    return importlib.metadata.version("nvidia-cutlass-dsl")


@functools.cache
def dsl_available() -> bool:
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception:  # the DSL is an optional runtime dependency of the torch path
        return False
    return True


def as_cute_tensor(tensor: torch.Tensor, *, leading_dim: int, align: int, fp8: bool = False):
    """A CuTe view of ``tensor`` with every extent and stride dynamic except the unit stride of ``leading_dim``."""
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    if fp8:
        converted = from_dlpack(tensor.view(torch.uint8), assumed_align=align)
        converted.element_type = cutlass.Float8E4M3FN
    else:
        converted = from_dlpack(tensor, assumed_align=align)
    return converted.mark_layout_dynamic(leading_dim=leading_dim)


def cute_stream():
    """The current torch CUDA stream as the DSL's stream argument."""
    import cuda.bindings.driver as cuda_driver

    return cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)


class PageScoreRunner:
    """Runs ``PageScoreKernelSm90`` for one ``num_heads`` and q-tile size on the current device."""

    def __init__(self, num_heads: int, device: torch.device, tile_rows: int, exact: bool = False):
        if tile_rows not in (128, 192, 256) or (exact and tile_rows != 128):
            raise ValueError(f"the score kernel has 128-, 192- or 256-row tiles (128 when exact), the plan has {tile_rows}")
        self.num_heads = num_heads
        self.exact = exact
        self.consumer_warpgroups = tile_rows // 64
        self.device = device
        self.num_ctas = _sm_count(device)

    def __call__(self, q, k_pages, scores, block_table, descriptors, num_tasks) -> None:
        # the tensors' device must be the current one (DLPack export, stream, loaded module)
        with torch.cuda.device(q.device):
            self._launch(q, k_pages, scores, block_table, descriptors, num_tasks)

    def _launch(self, q, k_pages, scores, block_table, descriptors, num_tasks) -> None:
        fp8 = not self.exact
        if self.exact:
            # e4m3 is a subset of bf16: the upcast is exact. It converts the whole cache, not just the
            # pages the batch reads (the exact mode is the precision reference, not the fast path).
            q = q.to(torch.bfloat16)
            k_pages = k_pages.to(torch.bfloat16)
        tma_stores = self._tma_stores(scores)
        arguments = (
            as_cute_tensor(q.view(q.shape[0] * q.shape[1], q.shape[2]), leading_dim=1, align=16, fp8=fp8),
            as_cute_tensor(k_pages.permute(1, 2, 0), leading_dim=1, align=16, fp8=fp8),
            as_cute_tensor(scores, leading_dim=1, align=16 if tma_stores else 4),
            as_cute_tensor(block_table, leading_dim=1, align=4),
            as_cute_tensor(descriptors, leading_dim=1, align=16),
            as_cute_tensor(num_tasks, leading_dim=0, align=4),
        )
        stream = cute_stream()
        kernel = self._compiled(arguments, stream, tma_stores)
        kernel(*arguments, self.num_ctas, stream)

    def _tma_stores(self, scores: torch.Tensor) -> bool:
        """Whether this launch takes the TMA-store variant: its score buffer must meet TMA's global alignment rules."""
        return (SCORE_TMA_STORES and self.consumer_warpgroups == 4 and scores.data_ptr() % 16 == 0
                and (scores.shape[0] <= 1 or score_row_pitch(scores.stride(0)) == scores.stride(0)))

    def _compiled(self, arguments, stream, tma_stores: bool):
        from .kernels.score_sm90 import PageScoreKernelSm90

        issue_ring = SCORE_ISSUE_RING if self.consumer_warpgroups == 4 else None
        release_dependents, integer_row_max = PROGRAMMATIC_TOPK, SCORE_INTEGER_ROW_MAX
        skip_idle = SCORE_SKIP_IDLE_WARPGROUPS and self.consumer_warpgroups == 4 and issue_ring != "progress"
        key = ("page_scores_sm90", self.num_heads, self.consumer_warpgroups, self.exact, issue_ring, tma_stores,
               release_dependents, integer_row_max, skip_idle, self.num_ctas, dsl_version())
        return compile_once(
            key,
            lambda: PageScoreKernelSm90(self.num_heads, consumer_warpgroups=self.consumer_warpgroups, exact=self.exact,
                                        issue_ring=issue_ring, tma_stores=tma_stores,
                                        release_dependents=release_dependents, integer_row_max=integer_row_max,
                                        skip_idle_warpgroups=skip_idle),
            (*arguments, self.num_ctas, stream),
        )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def run_topk_select(scores: torch.Tensor, num_valid_pages: torch.Tensor, out: torch.Tensor) -> None:
    """The GPU top-16 select (``indexer/kernels/topk_select.py``) on validated CUDA tensors."""
    from .kernels.topk_select import TopkSelectKernel

    with torch.cuda.device(scores.device):
        arguments = (
            as_cute_tensor(scores, leading_dim=1, align=4),
            as_cute_tensor(num_valid_pages, leading_dim=0, align=4),
            as_cute_tensor(out, leading_dim=1, align=4),
            cute_stream(),
        )
        rows, columns = scores.shape
        split = 0 < rows <= TOPK_ROW_SPLIT_MAX_ROWS and columns > 32 * TopkSelectKernel.cached_per_lane
        options = dict(TOPK_KERNEL_OPTIONS, warps_per_row=TopkSelectKernel.warps_per_cta if split else 1)
        programmatic = PROGRAMMATIC_TOPK
        kernel = compile_once(("topk_select", tuple(sorted(options.items())), programmatic, dsl_version()),
                              lambda: TopkSelectKernel(programmatic_launch=programmatic, **options), arguments)
        kernel(*arguments)


def compile_once(key, make_kernel, arguments):
    """The compiled kernel for ``key`` on the current device (a module is loaded per device), compiling once."""
    key = (*key, torch.cuda.current_device())
    compiled = _compiled.get(key)
    if compiled is not None:
        return compiled
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the indexer's CuTe kernels must be compiled before CUDA graph capture: run them once (warm-up) first"
        )
    import cutlass.cute as cute

    with _lock:
        if key not in _compiled:
            _compiled[key] = cute.compile(make_kernel(), *arguments)
    return _compiled[key]
