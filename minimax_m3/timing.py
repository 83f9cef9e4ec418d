"""The model benches' device timer."""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["median_cuda_ms", "timed_seconds"]


def timed_seconds(fn, device: torch.device) -> float:
    """Seconds of one call of ``fn``: CUDA events on a GPU, the host clock on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


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
