"""Decode workloads of ``python -m eval.throughput``: time per output token (TPOT) after a context.

A workload is a context of ``length`` tokens per sequence for ``batch_size`` sequences, then ``steps`` greedy
one-token steps, each timed by CUDA events (host clock on CPU). Our modes decode over a ``MiniMaxM3StaticCache``
sized for the context and the steps, graphed (``decode_cuda_graphs=True``: each step replays a CUDA graph, what
``generate`` does on CUDA) or eager; transformers' native model decodes eagerly over its own cache. Two untimed
steps come first (the first graphed one captures the graph).

The context is a prefill of a random prompt (``fill="prefill"``), or, for our modes, random keys, values and
index keys written straight into the cache (``fill="random"``): the step's work is the same (the indexer then
selects among random index keys, as a random-weight model's does), and a long, wide context costs no prefill.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .report import format_table, timing_cells
from .stats import spread
from .timing import peak_memory_gib, release_memory, reset_peak_memory, time_steps

__all__ = ["FILLS", "WARMUP_STEPS", "decode_context", "decode_steps", "measure_decode", "decode_table"]

FILLS = ("prefill", "random")
WARMUP_STEPS = 2


def decode_context(model, prompt: torch.Tensor, *, steps: int, native: bool, fill: str):
    """The cache after the context: ``(cache, first token [B, 1])``."""
    from minimax_m3 import MiniMaxM3StaticCache
    from minimax_m3.bench_decode import fill_random_context
    from minimax_m3.modeling_minimax_m3 import CACHE_FIELD

    length = prompt.shape[1]
    with torch.no_grad():
        if native:
            if fill != "prefill":
                raise ValueError("transformers' native model decodes after a prefill only (fill='prefill')")
            output = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            return getattr(output, CACHE_FIELD), output.logits[:, -1:].argmax(-1)
        cache = MiniMaxM3StaticCache(model.config, max_cache_len=length + WARMUP_STEPS + steps)
        if fill == "prefill":
            output = model(input_ids=prompt, past_key_values=cache, logits_to_keep=1)
            return cache, output.logits[:, -1:].argmax(-1)
        fill_random_context(model, cache, prompt, length,
                            torch.Generator(device=prompt.device).manual_seed(int(prompt[0, 0])))
        return cache, prompt[:, -1:]


def decode_steps(model, cache, token: torch.Tensor, count: int, *, native: bool, graphs: bool) -> list:
    """``count`` greedy one-token steps, as callables that feed each other (the token stays on the device)."""
    from minimax_m3.modeling_minimax_m3 import CACHE_FIELD

    state = {"token": token, "cache": cache}

    def step():
        with torch.no_grad():
            if native:
                output = model(input_ids=state["token"], use_cache=True, logits_to_keep=1,
                               **{CACHE_FIELD: state["cache"]})
                state["cache"] = getattr(output, CACHE_FIELD)
            else:
                output = model(input_ids=state["token"], past_key_values=state["cache"], logits_to_keep=1,
                               decode_cuda_graphs=graphs)
            state["token"] = output.logits[:, -1:].argmax(-1)

    return [step] * count


def measure_decode(model, mode: str, workload, seeds: Sequence[int], prompt: Callable, devices, *, native: bool) -> dict:
    """One (mode, decode workload): per seed a context, the warm-up steps, then the timed steps. ``prompt(seed)``
    gives the context's token ids."""
    result = {"mode": mode, "workload": workload.kind, "length": workload.length, "batch_size": workload.batch_size,
              "chunk_size": None, "steps": workload.steps, "graphs": workload.graphs, "fill": workload.fill,
              "tokens": workload.steps * workload.batch_size}
    if native and workload.graphs:
        return {**result, "status": "skipped", "reason": "transformers' native model is timed eagerly"}
    if native and workload.fill != "prefill":
        return {**result, "status": "skipped", "reason": "transformers' native model decodes after a prefill only"}
    per_step, peaks = [], []
    try:
        for seed in seeds:
            cache, token = decode_context(model, prompt(seed), steps=workload.steps, native=native, fill=workload.fill)
            for step in decode_steps(model, cache, token, WARMUP_STEPS, native=native, graphs=workload.graphs):
                step()
            steps = decode_steps(model, cache, token, workload.steps, native=native, graphs=workload.graphs)
            reset_peak_memory(devices)
            per_step += time_steps(steps, devices)
            peaks.append(peak_memory_gib(devices))
            cache = steps = None
    except torch.OutOfMemoryError:
        per_step = None
    if per_step is None:
        release_memory()
        return {**result, "status": "OOM"}
    release_memory()
    return {**result, "status": "ok", "seeds": list(seeds), "seconds": spread(per_step),
            "tokens_per_second": spread([workload.batch_size / s for s in per_step]),
            "peak_memory_gib": None if peaks[0] is None else max(peaks)}


def decode_table(results: Sequence[dict]) -> str:
    headers = ["context", "batch", "mode", "run", "ms per token, median [min–max]", "output tokens/s", "peak GiB",
               "vs dense"]
    rows = []
    for r in results:
        common = [f"{r['length']:,}", r["batch_size"], r["mode"], "graphs" if r["graphs"] else "eager"]
        rows.append(common + timing_cells(r, decimals=2))
    return format_table(headers, rows)
