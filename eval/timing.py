"""Timing one prefill (CUDA events on GPU, a monotonic clock on CPU) and its peak GPU memory.

``minimax_m3.bench_prefill.measure`` couples a warm-up with its repeats; the throughput evaluation warms up once
per configuration and then times one prefill per seed, chunk by chunk, so it needs the single timed run.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Optional, Sequence

import torch

__all__ = ["time_steps", "cuda_devices", "reset_peak_memory", "peak_memory_gib", "release_memory"]


def cuda_devices(devices: Sequence[torch.device]) -> list:
    """The distinct CUDA devices among ``devices`` (an index-less ``cuda`` is the current device)."""
    return sorted({torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
                   for d in devices if d.type == "cuda"}, key=lambda d: d.index)


def time_steps(steps: Sequence[Callable[[], object]], devices: Sequence[torch.device]) -> list:
    """Run ``steps`` back to back and return each one's seconds.

    On one GPU, CUDA events between the steps (the host does not wait between them). A model split over several
    GPUs finishes on another device than it starts on, so there every step ends with a synchronisation of all of
    them and the host clock times it. On CPU, the host clock."""
    gpus = cuda_devices(devices)
    if len(gpus) == 1:
        with torch.cuda.device(gpus[0]):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
            events[0].record()
            for step, event in zip(steps, events[1:]):
                step()
                event.record()
            events[-1].synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in zip(events, events[1:])]

    def synchronize():
        for gpu in gpus:
            torch.cuda.synchronize(gpu)

    synchronize()
    stamps = [time.perf_counter()]
    for step in steps:
        step()
        synchronize()
        stamps.append(time.perf_counter())
    return [end - begin for begin, end in zip(stamps, stamps[1:])]


def reset_peak_memory(devices: Sequence[torch.device]) -> None:
    for device in cuda_devices(devices):
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(devices: Sequence[torch.device]) -> Optional[float]:
    """The largest ``torch.cuda.max_memory_allocated`` over the CUDA ``devices`` in GiB; None without CUDA."""
    gpus = cuda_devices(devices)
    if not gpus:
        return None
    return max(torch.cuda.max_memory_allocated(device) for device in gpus) / 2**30


def release_memory() -> None:
    """After an out-of-memory error (outside its ``except`` block: the traceback pins the tensors) or between
    models: drop garbage and return cached blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
