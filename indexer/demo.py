"""Indexer demo on an embedded default batch: ``python -m indexer.demo``.

Three requests in the shapes MiniMax-M3 prefill produces (a chunk of a long prompt, a short turn on a
long prefix-cached context, a fresh prompt), random e4m3 queries and a scattered paged K cache. Plans
once, runs scores and top-k, prints the plan, the selected pages of a few rows and the timings.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from . import BatchPrefillIndexerQ8KV8Wrapper
from .contract import FP8_DTYPE, HEAD_DIM, PAGE_SIZE

DEFAULT_BATCH = ((512, 6144), (48, 12000), (300, 300))
"""(query tokens, KV length including them) per request."""


def make_batch(lengths, *, num_heads: int, device: torch.device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in lengths]
    pages = [-(-kv // PAGE_SIZE) for _, kv in lengths]
    num_pages = sum(pages) + 1
    order = torch.randperm(num_pages, generator=generator)
    block_table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    cursor = 0
    for request, count in enumerate(pages):
        block_table[request, :count] = order[cursor : cursor + count]
        cursor += count
    head_scale = torch.arange(1, num_heads + 1).view(1, num_heads, 1)
    q = (torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=generator) * 0.25 * head_scale).to(FP8_DTYPE)
    k_cache = (torch.randn(num_pages, PAGE_SIZE, HEAD_DIM, generator=generator) * 0.25).to(FP8_DTYPE)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([kv for _, kv in lengths], dtype=torch.int32)
    tensors = [t.to(device) for t in (q, k_cache, cu, seq_lens, block_table)]
    bounds = dict(total_q=sum(q_lens), max_seqlen_q=max(q_lens), max_seqlen_k=max(kv for _, kv in lengths))
    return tensors, bounds


def timed(fn, device, repeats):
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-heads", type=int, default=4, help="index heads per rank (M3: 4 at TP1)")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "cute"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device(args.device)

    (q, k_cache, cu, seq_lens, block_table), bounds = make_batch(
        DEFAULT_BATCH, num_heads=args.num_heads, device=device, seed=args.seed
    )
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(args.num_heads, backend=args.backend)
    plan_ms = timed(lambda: wrapper.plan(cu, seq_lens, block_table, **bounds), device, args.repeats)
    scores_ms = timed(lambda: wrapper.run_scores(q, k_cache), device, args.repeats)
    run_ms = timed(lambda: wrapper.run(q, k_cache), device, args.repeats)
    selection = wrapper.run(q, k_cache)

    plan = wrapper.task_plan
    shape = plan.shape
    print(f"indexer demo: {len(DEFAULT_BATCH)} requests (q tokens, KV length) = {list(DEFAULT_BATCH)}, "
          f"H = {args.num_heads}, device = {device}, backend = {wrapper.active_backend}")
    print(f"plan: {int(plan.num_tasks[0])} tasks of up to {shape.tile_tokens} tokens x {shape.page_chunk} pages, "
          f"score buffer {tuple(wrapper.scores.shape)}")
    print("\nselected logical pages (head 0; the last one is the forced local page):")
    starts = cu.tolist()
    for request, (q_len, kv_len) in enumerate(DEFAULT_BATCH):
        for local in sorted({0, q_len - 1}):
            token = starts[request] + local
            pages = [p for p in selection[token, 0].tolist() if p >= 0]
            print(f"  request {request} token {local:>4} (position {kv_len - q_len + local:>5}): {pages}")
    print("\n| step                   | median ms |")
    print("|------------------------|-----------|")
    print(f"| plan                   | {plan_ms:9.2f} |")
    print(f"| run_scores             | {scores_ms:9.2f} |")
    print(f"| run (scores + top-k)   | {run_ms:9.2f} |")


if __name__ == "__main__":
    main()
