"""Prefix-cached multi-turn workloads of ``python -m eval.throughput``: a long prefix already in the cache, then new
turns of a few thousand tokens, each one forward over the cache (its time is the turn's TTFT).

Per seed: the prefix is prefilled (untimed; our modes over a ``MiniMaxM3StaticCache`` sized for the prefix and
every turn, transformers' native model over its own cache), then ``turns`` turns of ``turn_tokens`` random tokens
are timed one by one (CUDA events), each keeping only its last position's logits.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .modes import forward_over_cache
from .report import format_table, timing_cells
from .stats import spread
from .timing import peak_memory_gib, release_memory, reset_peak_memory, time_steps

__all__ = ["turn_steps", "measure_turns", "turns_table"]


def turn_steps(model, prompt: torch.Tensor, workload, *, native: bool) -> list:
    """Prefill the prefix (``prompt[:, :length]``), then return one callable per turn."""
    from minimax_m3 import MiniMaxM3StaticCache

    prefix = workload.length
    state = {"cache": None if native else MiniMaxM3StaticCache(model.config, max_cache_len=prompt.shape[1])}
    forward_over_cache(model, prompt[:, :prefix], state, native=native)

    def turn(begin: int, end: int) -> Callable[[], None]:
        return lambda: forward_over_cache(model, prompt[:, begin:end], state, native=native)

    size = workload.chunk_size
    return [turn(prefix + i * size, prefix + (i + 1) * size) for i in range(workload.steps)]


def measure_turns(model, mode: str, workload, seeds: Sequence[int], prompt: Callable, devices, *, native: bool) -> dict:
    """One (mode, turns workload); ``prompt(seed)`` gives ``[B, prefix + turns * turn_tokens]`` token ids."""
    result = {"mode": mode, "workload": workload.kind, "length": workload.length, "batch_size": workload.batch_size,
              "chunk_size": workload.chunk_size, "steps": workload.steps,
              "tokens": workload.chunk_size * workload.batch_size}
    per_turn, peaks = [], []
    try:
        for seed in seeds:
            steps = turn_steps(model, prompt(seed), workload, native=native)
            reset_peak_memory(devices)
            per_turn += time_steps(steps, devices)
            peaks.append(peak_memory_gib(devices))
            steps = None
    except torch.OutOfMemoryError:
        per_turn = None
    release_memory()
    if per_turn is None:
        return {**result, "status": "OOM"}
    return {**result, "status": "ok", "seeds": list(seeds), "seconds": spread(per_turn),
            "tokens_per_second": spread([result["tokens"] / s for s in per_turn]),
            "peak_memory_gib": None if peaks[0] is None else max(peaks)}


def turns_table(results: Sequence[dict]) -> str:
    headers = ["prefix", "turn tokens", "turns", "batch", "mode", "TTFT per turn ms, median [min–max]",
               "input tokens/s", "peak GiB", "vs dense"]
    rows = []
    for r in results:
        common = [f"{r['length']:,}", f"{r['chunk_size']:,}", r["steps"], r["batch_size"], r["mode"]]
        rows.append(common + timing_cells(r, decimals=1))
    return format_table(headers, rows)
