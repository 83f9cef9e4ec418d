"""The model benches' device timer."""

from __future__ import annotations

import statistics

import torch

__all__ = ["median_cuda_ms"]


def median_cuda_ms(fn, repeats: int, flush_bytes: int = 0) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls (CUDA events) after one warm-up call; with
    ``flush_bytes``, a buffer that large is overwritten before each call so L2 starts cold."""
    fn()
    torch.cuda.synchronize()
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda") if flush_bytes else None
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
