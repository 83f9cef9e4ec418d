"""Benchmark of the prefill indexer on MiniMax's 128-case production suite: ``python -m indexer.bench``.

Per case and H: inputs as the MSA harness draws them (q = randn·0.25·(h+1), K = randn·0.25, e4m3, a scattered
page table; drawn on the GPU), one wrapper and plan per rotation slot (enough slots that the inputs exceed 2x L2).

* graph replay: one CUDA graph per slot, 5 warm-up rounds and 20 timed replays of every slot with CUDA events; the
  median per call;
* eager: ``run()`` called as transformers and vLLM call it, from an idle GPU, CUDA events around the Python call
  (host and device time), over the rotation slots as the graph replays see the L2 and again after a 256 MiB L2
  flush (a cold L2); the medians over the samples;
* host time per call: ``time.perf_counter`` around ``run()`` / ``run_scores()`` / a repeated ``plan()`` while the
  GPU is kept busy, so the host time is not hidden behind the GPU; the median over 200 calls.

The baseline, timed in the same run, is what a user would write with torch: ``torch._scaled_mm`` FP8 logits per
request and token chunk, the page max of the materialised chunk, and ``torch.topk`` over the history. ``--quick``
runs the 16 weighted batch-1 cases.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

from typing import Optional

import torch

from . import BatchPrefillIndexerQ8KV8Wrapper, topk_select
from .contract import FP8_DTYPE, HEAD_DIM, PAGE_SIZE

CASES_RESOURCE = ("bench_data", "prefill_benchmark_cases_v1.json")
MEASURED_CUBLAS_FP8_TFLOPS = 1452.0  # H200, measured with torch._scaled_mm at 8192^3
L2_BYTES = 60 * 1024 * 1024
FLUSH_BYTES = 256 * 1024 * 1024
HOST_CALLS = 200
EAGER_SAMPLES = 30


def load_cases(quick: bool):
    text = importlib.resources.files("indexer").joinpath(*CASES_RESOURCE).read_text()
    cases = json.loads(text)["cases"]
    if quick:
        cases = [c for c in cases if c.get("representative_weight") and c["batch_size"] == 1]
    return cases


def sequence_lengths(case) -> list:
    """(q_len, kv_len) per sequence, by the rule of ../shared/data/README.md for batch > 1."""
    if "lengths" in case:
        return [tuple(pair) for pair in case["lengths"]]
    batch, total_q, max_kv = case["batch_size"], case["total_q"], case["max_final_kv"]
    if batch == 1:
        return [(total_q, max_kv)]
    rng = random.Random(int(case["case_id"][-8:], 16))
    kv = [max_kv] + [rng.randint(max(1, max_kv // 4), max_kv) for _ in range(batch - 1)]
    q = [max(1, round(total_q * k / sum(kv))) for k in kv]
    q[0] += total_q - sum(q)
    for b in range(batch):
        excess = q[b] - kv[b]
        if excess > 0:
            q[b] = kv[b]
            for other in range(b + 1, batch):
                room = kv[other] - q[other]
                move = min(room, excess)
                q[other] += move
                excess -= move
    return list(zip(q, kv))


def useful_flops(lengths, num_heads) -> int:
    total = 0
    for q_len, kv_len in lengths:
        prefix = kv_len - q_len
        total += sum((prefix + i) // PAGE_SIZE for i in range(q_len))
    return 2 * PAGE_SIZE * HEAD_DIM * total * num_heads


def make_inputs(lengths, num_heads, device, generator):
    """q, K cache, cu_seqlens_q, seq_lens and a scattered block table on ``device``, drawn on the generator's device
    (a CUDA generator keeps a whole-suite run from waiting on host-side draws)."""
    draw = generator.device
    pages = [-(-kv // PAGE_SIZE) for _, kv in lengths]
    num_pages = sum(pages) + 1
    order = torch.randperm(num_pages, generator=generator, device=draw).to(torch.int32)
    block_table = torch.zeros(len(lengths), max(pages), dtype=torch.int32, device=draw)
    cursor = 0
    for b, count in enumerate(pages):
        block_table[b, :count] = order[cursor : cursor + count]
        cursor += count
    total_q = sum(q for q, _ in lengths)
    head_scale = torch.arange(1, num_heads + 1, dtype=torch.float32, device=draw).view(1, num_heads, 1)
    q = (torch.randn(total_q, num_heads, HEAD_DIM, generator=generator, device=draw) * 0.25 * head_scale).to(FP8_DTYPE)
    k = (torch.randn(num_pages, PAGE_SIZE, HEAD_DIM, generator=generator, device=draw) * 0.25).to(FP8_DTYPE)
    cu = torch.tensor([0] + torch.tensor([q for q, _ in lengths]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([kv for _, kv in lengths], dtype=torch.int32)
    return [t.to(device) for t in (q, k, cu, seq_lens, block_table)]


class TorchFp8Baseline:
    """The user's baseline: _scaled_mm FP8 logits per token chunk, page max, torch.topk selection."""

    def __init__(self, lengths, num_heads, q, k, block_table, scores, topk=16, chunk_rows=2048):
        self.lengths, self.num_heads, self.q, self.k = lengths, num_heads, q, k
        self.block_table, self.scores, self.topk, self.chunk_rows = block_table, scores, topk, chunk_rows
        self.one = torch.ones((), device=q.device)
        starts = [0]
        for q_len, _ in lengths:
            starts.append(starts[-1] + q_len)
        self.starts = starts
        positions = torch.cat([torch.arange(kv - ql, kv) for ql, kv in lengths]).to(q.device)
        self.history = (positions // PAGE_SIZE).repeat_interleave(num_heads)
        self.out = torch.empty(q.shape[0] * num_heads, topk, dtype=torch.int64, device=q.device)

    def __call__(self, select: bool = True):
        rows_q = self.q.view(-1, HEAD_DIM)
        for b, (q_len, kv_len) in enumerate(self.lengths):
            pages = (kv_len - 1) // PAGE_SIZE
            if pages == 0:
                continue
            keys = self.k[self.block_table[b, :pages].long()].view(-1, HEAD_DIM)
            first = self.starts[b] * self.num_heads
            last = self.starts[b + 1] * self.num_heads
            for r0 in range(first, last, self.chunk_rows):
                r1 = min(last, r0 + self.chunk_rows)
                logits = torch._scaled_mm(rows_q[r0:r1], keys.t(), scale_a=self.one, scale_b=self.one, out_dtype=torch.float32)
                self.scores[r0:r1, :pages] = logits.view(r1 - r0, pages, PAGE_SIZE).amax(dim=2)
        if select:
            cols = self.scores.shape[1]
            masked = torch.where(torch.arange(cols, device=self.scores.device)[None, :] < self.history[:, None], self.scores, -torch.inf)
            self.out[:, : min(self.topk - 1, cols)] = torch.topk(masked, min(self.topk - 1, cols), dim=1).indices
        return self.scores


def time_graphs(callables, warmup=5, samples=20):
    """Median ms per call over rotation slots, each captured in its own CUDA graph."""
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in callables:
            fn()  # warm-up: compiles, allocator
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for fn in callables:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs.append(graph)
    for _ in range(warmup):
        for graph in graphs:
            graph.replay()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for graph in graphs:
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(graphs))
    return statistics.median(times), statistics.pstdev(times) / statistics.mean(times)


class L2Flush:
    """A buffer larger than the L2, rewritten before each eager sample."""

    def __init__(self, device):
        self.buffer = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def __call__(self):
        self.buffer.fill_(1)


def time_eager(callables, flush: Optional[L2Flush] = None, samples: int = EAGER_SAMPLES) -> float:
    """Median ms of one eager call from an idle GPU, host and device time, as a model calls it: over the rotation slots
    (the L2 as the graph replays see it), or after an L2 flush (``flush``: a cold L2)."""
    for fn in callables:
        fn()  # warm-up
    times = []
    for sample in range(samples):
        fn = callables[sample % len(callables)]
        if flush is not None:
            flush()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_microseconds(fn, calls: int = HOST_CALLS) -> float:
    """Median µs of host time per call while the GPU is busy (the launch queue never throttles the host)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for block in range(calls // 20):
        torch.cuda._sleep(10_000_000)  # ~5 ms of GPU work ahead of the 20 calls
        for _ in range(20):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def schedule_balance(plan, num_ctas: int, *, cost: str = "rows") -> float:
    """Mean over max of the per-CTA work under the kernel's static round robin (CTA c runs tasks c, c + grid, ...):
    the share of the SMs kept busy (1.0 = perfectly balanced) when a task costs its valid rows x pages (``"rows"``:
    useful work) or its tile's rows x pages (``"tile"``: the score kernel's time, since each consumer warpgroup
    computes its whole 64-row block whatever the valid rows)."""
    from .planner import decode_descriptors

    if cost not in ("rows", "tile"):
        raise ValueError(f"cost must be one of ('rows', 'tile'), got {cost!r}")
    count = int(plan.num_tasks[0])
    if count == 0:
        return 1.0
    fields = decode_descriptors(plan.descriptors[:count].cpu())
    rows = fields["tokens"] * plan.shape.num_heads if cost == "rows" else plan.shape.tile_rows
    work = (rows * fields["page_count"]).double()
    per_cta = torch.zeros(num_ctas, dtype=torch.float64)
    per_cta.index_add_(0, torch.arange(count) % num_ctas, work)
    return float(per_cta.mean() / per_cta.max())


def custom_case(q_len: int, kv_len: int, batch: int = 1) -> dict:
    """A case outside the suite: ``batch`` requests of ``q_len`` query tokens at the end of ``kv_len`` tokens of
    context each, e.g. 8192 tokens over 32K, or decode steps (``q_len`` 1) of 16 sequences over 128K."""
    if not (1 <= q_len <= kv_len and batch >= 1):
        raise ValueError(f"--case Q,KV[,B] needs 1 <= Q <= KV and B >= 1, got {q_len},{kv_len},{batch}")
    suffix = f"_x{batch}" if batch > 1 else ""
    return {"case_id": f"custom_{q_len}_{kv_len}{suffix}", "batch_size": batch, "total_q": q_len * batch,
            "max_final_kv": kv_len, "representative_weight": 0, "lengths": [(q_len, kv_len)] * batch}


def bench_case(case, num_heads, device, seed, baseline: bool, flush: L2Flush, precision: str = "auto",
               host_lengths: bool = False):
    lengths = sequence_lengths(case)
    unique_bytes = sum((kv - 1) // PAGE_SIZE * PAGE_SIZE * HEAD_DIM for _, kv in lengths) + case["total_q"] * 17 * 4
    slots = min(8, 2 * L2_BYTES // max(1, unique_bytes) + 2)
    generator = torch.Generator(device=device).manual_seed(seed)
    bounds = dict(total_q=case["total_q"], max_seqlen_q=max(q for q, _ in lengths), max_seqlen_k=max(kv for _, kv in lengths))
    request_lengths = lengths if host_lengths else None
    runs, scores_only, topk_only, base_runs, plans = [], [], [], [], []
    for _ in range(slots):
        q, k, cu, seq_lens, block_table = make_inputs(lengths, num_heads, device, generator)
        wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, precision=precision)
        wrapper.plan(cu, seq_lens, block_table, **bounds, request_lengths=request_lengths)
        runs.append(lambda w=wrapper, q=q, k=k: w.run(q, k))
        scores_only.append(lambda w=wrapper, q=q, k=k: w.run_scores(q, k))
        plans.append(lambda w=wrapper, cu=cu, seq_lens=seq_lens, block_table=block_table:
                     w.plan(cu, seq_lens, block_table, **bounds, request_lengths=request_lengths))
        selection = torch.empty(case["total_q"] * num_heads, 16, dtype=torch.int32, device=device)
        topk_only.append(lambda w=wrapper, out=selection: topk_select(w.scores, w.num_valid_pages, out=out))
        if baseline:
            scores = torch.empty_like(wrapper.scores)
            base_runs.append(TorchFp8Baseline(lengths, num_heads, q, k, block_table, scores))
    plan = wrapper.task_plan
    result = dict(case_id=case["case_id"], batch=case["batch_size"], total_q=case["total_q"], max_kv=case["max_final_kv"],
                  weight=case.get("representative_weight") or 0, num_heads=num_heads, slots=slots,
                  tasks=int(plan.num_tasks[0]), sm_busy=schedule_balance(plan, plan.shape.num_sms),
                  sm_busy_tile_time=schedule_balance(plan, plan.shape.num_sms, cost="tile"),
                  backend=wrapper.active_backend, precision=precision, tile_rows=plan.shape.tile_rows,
                  page_chunk=plan.shape.page_chunk, host_lengths=host_lengths,
                  kernels=[repr(key) for key in wrapper.kernel_keys], useful_flops=useful_flops(lengths, num_heads))
    result["scores_ms"], result["scores_cv"] = time_graphs(scores_only)
    result["run_ms"], result["run_cv"] = time_graphs(runs)
    result["topk_ms"], result["topk_cv"] = time_graphs(topk_only)  # on the scores the run graphs left
    result["eager_run_ms"] = time_eager(runs)
    result["eager_cold_run_ms"] = time_eager(runs, flush)
    result["host_run_us"] = host_microseconds(runs[0])
    result["host_run_scores_us"] = host_microseconds(scores_only[0])
    result["host_plan_us"] = host_microseconds(plans[0])
    if baseline:
        result["baseline_ms"], result["baseline_cv"] = time_graphs(base_runs)
    result["tflops_scores"] = result["useful_flops"] / result["scores_ms"] / 1e9
    return result


def write_json_atomically(path: pathlib.Path, payload) -> None:
    """The whole file or the previous one, never a torn write (a crash or Ctrl-C keeps what was there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(payload, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 16 weighted batch-1 cases")
    parser.add_argument("--heads", default="4", help="comma-separated H values (1, 2, 4)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the torch FP8 baseline")
    parser.add_argument("--limit", type=int, default=0, help="first N cases only")
    parser.add_argument("--case", action="append", default=[], metavar="Q,KV[,B]",
                        help="an extra case of B requests (default 1) of Q query tokens over KV tokens each, e.g. "
                             "8192,32768 or a decode step 1,131072,16 (repeatable); with --only-custom, only these")
    parser.add_argument("--only-custom", action="store_true")
    parser.add_argument("--output", default=None, help="JSON results path (rewritten atomically after every case)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["auto", "fp8", "exact"], default="auto")
    parser.add_argument("--host-lengths", action="store_true",
                        help="plan() gets each request's (query, context) lengths as host ints, as a server has them "
                             "(the page-chunk model then balances the actual batch)")
    args = parser.parse_args(argv)
    cases = [] if args.only_custom else load_cases(args.quick)
    if args.limit:
        cases = cases[: args.limit]
    for spec in args.case:
        try:
            values = [int(x) for x in spec.split(",")]
        except ValueError:
            values = []
        if len(values) not in (2, 3):
            parser.error(f"--case takes Q,KV or Q,KV,B (integers), got {spec!r}")
        try:
            cases.append(custom_case(*values))
        except ValueError as error:
            parser.error(str(error))
    heads = [int(h) for h in args.heads.split(",")]
    if not torch.cuda.is_available():
        sys.exit("indexer.bench needs a CUDA GPU")
    device = torch.device("cuda")
    flush = L2Flush(device)
    output = pathlib.Path(args.output) if args.output else None
    results = []
    for num_heads in heads:
        for index, case in enumerate(cases):
            result = bench_case(case, num_heads, device, args.seed + index, baseline=not args.no_baseline,
                                flush=flush, precision=args.precision, host_lengths=args.host_lengths)
            results.append(result)
            print(json.dumps(result), flush=True)
            if output is not None:
                write_json_atomically(output, results)
    print_summary(results)


def print_summary(results):
    print("\n| H | case | B | q | max kv | tasks | SM busy | scores us | top-k us | run us (graph) | run us (eager) "
          "| eager / graph | eager us, cold L2 | host us run / scores / plan | baseline us | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = f"{r['baseline_ms'] * 1e3:.0f}" if "baseline_ms" in r else "-"
        print(f"| {r['num_heads']} | {r['case_id'][-8:]} | {r['batch']} | {r['total_q']} | {r['max_kv']} | {r['tasks']} "
              f"| {r['sm_busy']:.2f} | {r['scores_ms'] * 1e3:.1f} | {r['topk_ms'] * 1e3:.1f} | {r['run_ms'] * 1e3:.1f} "
              f"| {r['eager_run_ms'] * 1e3:.1f} | {r['eager_run_ms'] / r['run_ms']:.2f} "
              f"| {r['eager_cold_run_ms'] * 1e3:.1f} | {r['host_run_us']:.1f} / {r['host_run_scores_us']:.1f} / {r['host_plan_us']:.1f} | {base} "
              f"| {r['tflops_scores']:.0f} |")
    for num_heads in sorted({r["num_heads"] for r in results}):
        of_h = [r for r in results if r["num_heads"] == num_heads]
        subset = [r for r in of_h if r["weight"]]
        if subset:
            weight = sum(r["weight"] for r in subset)

            def weighted(key):
                return sum(r["weight"] * r[key] for r in subset) / weight * 1e3

            line = (f"H={num_heads}: weighted mean scores {weighted('scores_ms'):.1f} us, top-k {weighted('topk_ms'):.1f} us"
                    f", run {weighted('run_ms'):.1f} us")
            if all("baseline_ms" in r for r in subset):
                line += f", baseline {weighted('baseline_ms'):.1f} us"
            floor = sum(r["weight"] * r["useful_flops"] for r in subset) / weight / (MEASURED_CUBLAS_FP8_TFLOPS * 1e12) * 1e6
            line += f", floor at {MEASURED_CUBLAS_FP8_TFLOPS:.0f} TFLOP/s {floor:.1f} us"
            print(line)
            print(f"H={num_heads} eager: weighted mean run {weighted('eager_run_ms'):.1f} us "
                  f"({weighted('eager_run_ms') / weighted('run_ms'):.2f}x the graph replay)")
        heavy = [r for r in of_h if r["run_ms"] >= 0.2]
        print(f"H={num_heads} eager / graph over the {len(heavy)} cases of >= 0.2 ms: max "
              f"{max((r['eager_run_ms'] / r['run_ms'] for r in heavy), default=float('nan')):.3f}; host per call "
              f"(median over cases): run {statistics.median(r['host_run_us'] for r in of_h):.1f} us, run_scores "
              f"{statistics.median(r['host_run_scores_us'] for r in of_h):.1f} us, plan "
              f"{statistics.median(r['host_plan_us'] for r in of_h):.1f} us")
        for name, rows in query_length_classes(of_h).items():
            if rows:
                print(f"H={num_heads} {name}: {len(rows)} cases, median run "
                      f"{statistics.median(r['run_ms'] for r in rows) * 1e3:.1f} us, median scores "
                      f"{statistics.median(r['scores_ms'] for r in rows) * 1e3:.1f} us, median SM busy "
                      f"{statistics.median(r['sm_busy'] for r in rows):.2f} (useful work) / "
                      f"{statistics.median(r['sm_busy_tile_time'] for r in rows):.2f} (kernel time)")


def query_length_classes(results) -> dict:
    """The suite's classes by query tokens: short (< 512), medium (512-4095), long (>= 4096)."""
    classes = {"short (< 512 q)": [], "medium (512-4095 q)": [], "long (>= 4096 q)": []}
    for r in results:
        name = "short (< 512 q)" if r["total_q"] < 512 else "medium (512-4095 q)" if r["total_q"] < 4096 else "long (>= 4096 q)"
        classes[name].append(r)
    return classes


if __name__ == "__main__":
    main()
