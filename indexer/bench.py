"""Benchmark of the prefill indexer on MiniMax's 128-case production suite: ``python -m indexer.bench``.

Per case and H: inputs as the MSA harness draws them (q = randn·0.25·(h+1), K = randn·0.25, e4m3, a
scattered page table), one wrapper, plan and CUDA graph per rotation slot (enough slots that the
inputs exceed 2x L2), 5 warm-up rounds and 20 timed replays of every slot with CUDA events; the
median per call is reported. The baseline, timed in the same run, is what a user would write with
torch: ``torch._scaled_mm`` FP8 logits per request and token chunk, the page max of the materialised
chunk, and ``torch.topk`` over the history. ``--quick`` runs the 16 weighted batch-1 cases.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys

import torch

from . import BatchPrefillIndexerQ8KV8Wrapper, topk_select
from .contract import FP8_DTYPE, HEAD_DIM, PAGE_SIZE

CASES_PATH = pathlib.Path(__file__).with_name("bench_data") / "prefill_benchmark_cases_v1.json"
MEASURED_CUBLAS_FP8_TFLOPS = 1452.0  # H200, ../shared/DEVICE.md
L2_BYTES = 60 * 1024 * 1024


def load_cases(quick: bool):
    cases = json.loads(CASES_PATH.read_text())["cases"]
    if quick:
        cases = [c for c in cases if c.get("representative_weight") and c["batch_size"] == 1]
    return cases


def sequence_lengths(case) -> list:
    """(q_len, kv_len) per sequence, by the rule of ../shared/data/README.md for batch > 1."""
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
    pages = [-(-kv // PAGE_SIZE) for _, kv in lengths]
    num_pages = sum(pages) + 1
    order = torch.randperm(num_pages, generator=generator).to(torch.int32)
    block_table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    cursor = 0
    for b, count in enumerate(pages):
        block_table[b, :count] = order[cursor : cursor + count]
        cursor += count
    total_q = sum(q for q, _ in lengths)
    head_scale = torch.arange(1, num_heads + 1, dtype=torch.float32).view(1, num_heads, 1)
    q = (torch.randn(total_q, num_heads, HEAD_DIM, generator=generator) * 0.25 * head_scale).to(FP8_DTYPE)
    k = (torch.randn(num_pages, PAGE_SIZE, HEAD_DIM, generator=generator) * 0.25).to(FP8_DTYPE)
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


def schedule_balance(plan, num_ctas: int, *, cost: str = "rows") -> float:
    """Mean over max of the per-CTA work under the kernel's static round robin (CTA c runs tasks c, c + grid, ...):
    the share of the SMs kept busy (1.0 = perfectly balanced) when a task costs ``cost`` (``planner.TASK_COSTS``):
    its valid rows x pages (``"rows"``: useful work), its tile's rows x pages (``"tile"``: the score kernel's time,
    since each consumer warpgroup computes its whole 64-row block whatever the valid rows), or its active
    warpgroups' rows x pages (``"warpgroup"``: the time of a kernel whose idle warpgroups skip)."""
    from .planner import TASK_COSTS, decode_descriptors, task_rows

    if cost not in TASK_COSTS:
        raise ValueError(f"cost must be one of {TASK_COSTS}, got {cost!r}")
    count = int(plan.num_tasks[0])
    if count == 0:
        return 1.0
    fields = decode_descriptors(plan.descriptors[:count].cpu())
    rows = task_rows(fields["tokens"], plan.shape.num_heads, plan.shape.tile_rows, cost)
    work = (rows * fields["page_count"]).double()
    per_cta = torch.zeros(num_ctas, dtype=torch.float64)
    per_cta.index_add_(0, torch.arange(count) % num_ctas, work)
    return float(per_cta.mean() / per_cta.max())


def custom_case(q_len: int, kv_len: int) -> dict:
    """A batch-1 case outside the suite, e.g. 8192 query tokens at the end of a 32K context."""
    return {"case_id": f"custom_{q_len}_{kv_len}", "batch_size": 1, "total_q": q_len, "max_final_kv": kv_len,
            "representative_weight": 0}


def bench_case(case, num_heads, device, seed, baseline: bool, precision: str = "auto", host_lengths: bool = False):
    lengths = sequence_lengths(case)
    unique_bytes = sum((kv - 1) // PAGE_SIZE * PAGE_SIZE * HEAD_DIM for _, kv in lengths) + case["total_q"] * 17 * 4
    slots = min(8, 2 * L2_BYTES // max(1, unique_bytes) + 2)
    generator = torch.Generator().manual_seed(seed)
    bounds = dict(total_q=case["total_q"], max_seqlen_q=max(q for q, _ in lengths), max_seqlen_k=max(kv for _, kv in lengths))
    runs, scores_only, topk_only, base_runs = [], [], [], []
    tasks = None
    for _ in range(slots):
        q, k, cu, seq_lens, block_table = make_inputs(lengths, num_heads, device, generator)
        wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, precision=precision)
        wrapper.plan(cu, seq_lens, block_table, **bounds, request_lengths=lengths if host_lengths else None)
        tasks = int(wrapper.task_plan.num_tasks[0])
        balance = schedule_balance(wrapper.task_plan, wrapper.task_plan.shape.num_sms)
        occupancy = schedule_balance(wrapper.task_plan, wrapper.task_plan.shape.num_sms, cost="tile")
        runs.append(lambda w=wrapper, q=q, k=k: w.run(q, k))
        scores_only.append(lambda w=wrapper, q=q, k=k: w.run_scores(q, k))
        selection = torch.empty(case["total_q"] * num_heads, 16, dtype=torch.int32, device=device)
        topk_only.append(lambda w=wrapper, out=selection: topk_select(w.scores, w.num_valid_pages, out=out))
        if baseline:
            scores = torch.empty_like(wrapper.scores)
            base_runs.append(TorchFp8Baseline(lengths, num_heads, q, k, block_table, scores))
    result = dict(case_id=case["case_id"], batch=case["batch_size"], total_q=case["total_q"], max_kv=case["max_final_kv"],
                  weight=case.get("representative_weight") or 0, num_heads=num_heads, slots=slots, tasks=tasks,
                  sm_busy=balance, sm_busy_tile_time=occupancy, task_cost=wrapper.task_plan.shape.task_cost,
                  task_order=wrapper.task_plan.shape.task_order,
                  backend=wrapper.active_backend, precision=precision, tile_rows=wrapper.task_plan.shape.tile_rows,
                  page_chunk=wrapper.task_plan.shape.page_chunk, host_lengths=host_lengths,
                  issue_ring=_backend_setting("SCORE_ISSUE_RING"),
                  tma_stores=_backend_setting("SCORE_TMA_STORES"),
                  topk_options=dict(_backend_setting("TOPK_KERNEL_OPTIONS")),
                  programmatic_topk=_backend_setting("PROGRAMMATIC_TOPK"),
                  topk_row_split_max_rows=_backend_setting("TOPK_ROW_SPLIT_MAX_ROWS"),
                  integer_row_max=_backend_setting("SCORE_INTEGER_ROW_MAX"),
                  skip_idle_warpgroups=_backend_setting("SCORE_SKIP_IDLE_WARPGROUPS"),
                  useful_flops=useful_flops(lengths, num_heads))
    result["scores_ms"], result["scores_cv"] = time_graphs(scores_only)
    result["run_ms"], result["run_cv"] = time_graphs(runs)
    result["topk_ms"], result["topk_cv"] = time_graphs(topk_only)  # on the scores the run graphs left
    if baseline:
        result["baseline_ms"], result["baseline_cv"] = time_graphs(base_runs)
    result["tflops_scores"] = result["useful_flops"] / result["scores_ms"] / 1e9
    return result


def _backend_setting(name: str):
    from . import cute_backend

    return getattr(cute_backend, name)


def _apply_library_switches(args) -> None:
    """Each A/B switch sets one of the library's module-level defaults, before any plan or kernel is built."""
    from . import cute_backend, planner

    switches = {
        "task_order": (planner, "DEFAULT_TASK_ORDER", str),
        "task_cost": (planner, "DEFAULT_TASK_COST", str),
        "chunk_policy": (planner, "DEFAULT_CHUNK_POLICY", str),
        "tile_rows": (cute_backend, "SCORE_TILE_ROWS", int),
        "issue_ring": (cute_backend, "SCORE_ISSUE_RING", lambda value: None if value == "none" else value),
        "tma_stores": (cute_backend, "SCORE_TMA_STORES", lambda value: value == "on"),
        "programmatic_topk": (cute_backend, "PROGRAMMATIC_TOPK", lambda value: value == "on"),
        "topk_row_split_max_rows": (cute_backend, "TOPK_ROW_SPLIT_MAX_ROWS", int),
        "integer_row_max": (cute_backend, "SCORE_INTEGER_ROW_MAX", lambda value: value == "on"),
        "skip_idle_warpgroups": (cute_backend, "SCORE_SKIP_IDLE_WARPGROUPS", lambda value: value == "on"),
    }
    for option, (module, attribute, convert) in switches.items():
        value = getattr(args, option)
        if value is not None:
            setattr(module, attribute, convert(value))
    for name, value in args.topk_option:
        cute_backend.TOPK_KERNEL_OPTIONS[name] = value


def _topk_option(text: str):
    """``NAME=VALUE`` for one of ``cute_backend.TOPK_KERNEL_OPTIONS``: an int, ``on``/``off`` or ``none``."""
    from . import cute_backend

    name, separator, value = text.partition("=")
    if not separator or name not in cute_backend.TOPK_KERNEL_OPTIONS:
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE with NAME one of {sorted(cute_backend.TOPK_KERNEL_OPTIONS)}, got {text!r}")
    words = {"on": True, "off": False, "none": None}
    if value in words:
        return name, words[value]
    if value.isdigit():
        return name, int(value)
    raise argparse.ArgumentTypeError(f"the value of {name} must be an int, on, off or none, got {value!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 16 weighted batch-1 cases")
    parser.add_argument("--heads", default="4", help="comma-separated H values (1, 2, 4)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--limit", type=int, default=0, help="first N cases only")
    parser.add_argument("--case", action="append", default=[], metavar="Q,KV",
                        help="an extra batch-1 case, e.g. 8192,32768 (repeatable); with --only-custom, only these")
    parser.add_argument("--only-custom", action="store_true")
    parser.add_argument("--chunk-policy", choices=["fill_sms", "balanced"], default=None,
                        help="the planner's page-chunk policy (default: the library's)")
    parser.add_argument("--output", default=None, help="JSON results path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["auto", "fp8", "exact"], default="auto")
    parser.add_argument("--tile-rows", type=int, choices=[128, 192, 256], default=None,
                        help="score-kernel q-tile rows (default: the library's)")
    parser.add_argument("--topk-option", type=_topk_option, action="append", default=[], metavar="NAME=VALUE",
                        help="top-k kernel: set one of its options (cute_backend.TOPK_KERNEL_OPTIONS), e.g. "
                             "rest_batch=1, lane_list_length=none, winners_in_shared=on (repeatable; default: the "
                             "library's)")
    parser.add_argument("--host-lengths", action="store_true",
                        help="plan() gets each request's (query, context) lengths as host ints, as a server has them "
                             "(the page-chunk model then balances the actual batch)")
    parser.add_argument("--issue-ring", choices=["none", "commit", "progress"], default=None,
                        help="score kernel (256-row tiles): consumer warpgroups issue their wgmmas in turn, passing "
                             "the turn on once committed or once three of four k-blocks are done "
                             "(default: the library's)")
    parser.add_argument("--topk-row-split-max-rows", type=int, default=None, metavar="N",
                        help="top-k: launches of at most N rows of more than 512 pages take one CTA of 4 warps per row "
                             "(0: never; default: the library's)")
    parser.add_argument("--programmatic-topk", choices=["on", "off"], default=None,
                        help="launch the top-k as a programmatic dependent of the score kernel (default: the library's)")
    parser.add_argument("--integer-row-max", choices=["on", "off"], default=None,
                        help="score kernel: page maxima from the scores' int32 bit patterns by three-input integer max "
                             "(default: the library's)")
    parser.add_argument("--skip-idle-warpgroups", choices=["on", "off"], default=None,
                        help="score kernel (256-row tiles): warpgroups with no valid rows in a task skip its wgmmas "
                             "(default: the library's)")
    parser.add_argument("--tma-stores", choices=["on", "off"], default=None,
                        help="score kernel (256-row tiles): whole staged blocks of row maxima leave by TMA stores "
                             "(default: the library's)")
    parser.add_argument("--task-cost", choices=["rows", "tile", "warpgroup"], default=None,
                        help="planner: a task costs its valid rows x pages, its tile's, or its active warpgroups' "
                             "(pair with --skip-idle-warpgroups on; default: the library's)")
    parser.add_argument("--task-order", choices=["buckets", "snake"], default=None,
                        help="planner: tasks heaviest bucket first, or by exact cost with every second wave reversed "
                             "(default: the library's)")
    args = parser.parse_args(argv)
    _apply_library_switches(args)
    if not torch.cuda.is_available():
        sys.exit("indexer.bench needs a CUDA GPU")
    device = torch.device("cuda")
    cases = [] if args.only_custom else load_cases(args.quick)
    if args.limit:
        cases = cases[: args.limit]
    cases += [custom_case(*(int(x) for x in spec.split(","))) for spec in args.case]
    results = []
    for num_heads in (int(h) for h in args.heads.split(",")):
        for index, case in enumerate(cases):
            result = bench_case(case, num_heads, device, args.seed + index, baseline=not args.no_baseline,
                                precision=args.precision, host_lengths=args.host_lengths)
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(results, indent=1))
    print_summary(results)


def print_summary(results):
    print("\n| H | case | B | q | max kv | tasks | SM busy | scores us | top-k us | run us | baseline us | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = f"{r['baseline_ms'] * 1e3:.0f}" if "baseline_ms" in r else "-"
        print(f"| {r['num_heads']} | {r['case_id'][-8:]} | {r['batch']} | {r['total_q']} | {r['max_kv']} | {r['tasks']} | {r['sm_busy']:.2f} | "
              f"{r['scores_ms'] * 1e3:.1f} | {r['topk_ms'] * 1e3:.1f} | {r['run_ms'] * 1e3:.1f} | {base} | {r['tflops_scores']:.0f} |")
    for num_heads in sorted({r["num_heads"] for r in results}):
        subset = [r for r in results if r["num_heads"] == num_heads and r["weight"]]
        if subset:
            weight = sum(r["weight"] for r in subset)
            line = f"H={num_heads}: weighted mean scores {sum(r['weight'] * r['scores_ms'] for r in subset) / weight * 1e3:.1f} us"
            line += f", top-k {sum(r['weight'] * r['topk_ms'] for r in subset) / weight * 1e3:.1f} us"
            line += f", run {sum(r['weight'] * r['run_ms'] for r in subset) / weight * 1e3:.1f} us"
            if all("baseline_ms" in r for r in subset):
                line += f", baseline {sum(r['weight'] * r['baseline_ms'] for r in subset) / weight * 1e3:.1f} us"
            floor = sum(r["weight"] * r["useful_flops"] for r in subset) / weight / (MEASURED_CUBLAS_FP8_TFLOPS * 1e12) * 1e6
            line += f", floor at {MEASURED_CUBLAS_FP8_TFLOPS:.0f} TFLOP/s {floor:.1f} us"
            print(line)
        for name, rows in query_length_classes([r for r in results if r["num_heads"] == num_heads]).items():
            if rows:
                print(f"H={num_heads} {name}: {len(rows)} cases, median run "
                      f"{statistics.median(r['run_ms'] for r in rows) * 1e3:.1f} us, median scores "
                      f"{statistics.median(r['scores_ms'] for r in rows) * 1e3:.1f} us, median SM busy "
                      f"{statistics.median(r['sm_busy'] for r in rows):.2f} (useful work) / "
                      f"{statistics.median(r.get('sm_busy_tile_time', float('nan')) for r in rows):.2f} (kernel time)")


def query_length_classes(results) -> dict:
    """The suite's classes by query tokens: short (< 512), medium (512-4095), long (>= 4096)."""
    classes = {"short (< 512 q)": [], "medium (512-4095 q)": [], "long (>= 4096 q)": []}
    for r in results:
        name = "short (< 512 q)" if r["total_q"] < 512 else "medium (512-4095 q)" if r["total_q"] < 4096 else "long (>= 4096 q)"
        classes[name].append(r)
    return classes


if __name__ == "__main__":
    main()
