"""The task plan: coverage, ordering, capacities, adaptive chunking, determinism, and an executor."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import BatchPrefillIndexerQ8KV8Wrapper
from indexer.planner import (
    BALANCED_MIN_PAGE_CHUNK,
    BUCKET_THRESHOLDS,
    MAX_PAGE_CHUNK,
    MIN_PAGE_CHUNK,
    NUM_BUCKETS,
    PlanError,
    build_task_plan,
    decode_descriptors,
    plan_shape,
)
from cases import make_case


def metadata(lengths):
    q_lens = [q for q, _ in lengths]
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return cu, torch.tensor([k for _, k in lengths], dtype=torch.int32)


def build(lengths, num_heads, *, tile_rows=None, num_sms=132, max_seqlen_q=None, max_seqlen_k=None, page_size=128,
          chunk_policy=None, task_cost=None, task_order=None, request_lengths=None):
    cu, seq_lens = metadata(lengths)
    shape = plan_shape(
        num_requests=len(lengths),
        total_q=int(cu[-1]),
        num_heads=num_heads,
        page_size=page_size,
        max_seqlen_q=max_seqlen_q or max(max(q for q, _ in lengths), 1),
        max_seqlen_k=max_seqlen_k or max(k for _, k in lengths),
        tile_rows=tile_rows,
        num_sms=num_sms,
        chunk_policy=chunk_policy,
        task_cost=task_cost,
        task_order=task_order,
        request_lengths=request_lengths,
    )
    return build_task_plan(cu, seq_lens, shape), shape


def tasks_of(plan):
    count = int(plan.num_tasks[0])
    fields = decode_descriptors(plan.descriptors[:count])
    return [dict(zip(fields, values)) for values in zip(*(v.tolist() for v in fields.values()))]


def check_plan(lengths, num_heads, **kwargs):
    plan, shape = build(lengths, num_heads, **kwargs)

    def chunk_limit(tokens):
        """A tile's page chunk: the plan's, stretched by tile rows / its warpgroups' rows under the warpgroup cost."""
        if shape.task_cost != "warpgroup":
            return shape.page_chunk
        stretched = shape.page_chunk * shape.tile_rows // (-(-tokens * num_heads // 64) * 64) // 4 * 4
        return min(128, max(shape.page_chunk, stretched))

    assert int(plan.error_flags[0]) == 0
    tasks = tasks_of(plan)
    assert len(tasks) <= shape.task_capacity

    # tiles: per request, consecutive token ranges of tile_tokens (the last one partial)
    tiles = {}
    for task in tasks:
        key = (task["request"], task["token_begin"])
        tiles.setdefault(key, []).append(task)
    starts = [0]
    for q_len, _ in lengths:
        starts.append(starts[-1] + q_len)
    expected_tiles = set()
    for request, (q_len, kv_len) in enumerate(lengths):
        prefix = kv_len - q_len
        for local in range(0, q_len, shape.tile_tokens):
            tokens = min(shape.tile_tokens, q_len - local)
            history = (prefix + local + tokens - 1) // shape.page_size
            if history == 0:
                continue
            key = (request, starts[request] + local)
            expected_tiles.add(key)
            assert key in tiles, f"tile {key} has no task"
            chunks = sorted(tiles[key], key=lambda t: t["page_begin"])
            limit = chunk_limit(tokens)
            covered = 0
            for index, chunk in enumerate(chunks):
                assert chunk["tokens"] == tokens
                assert chunk["position_begin"] == prefix + local
                assert chunk["page_begin"] == covered, "page chunks must tile the history contiguously"
                assert 1 <= chunk["page_count"] <= limit
                assert chunk["page_count"] == limit or index == len(chunks) - 1, "only a tile's last chunk is short"
                covered += chunk["page_count"]
            assert covered == history
    assert set(tiles) == expected_tiles

    # heaviest bucket first (by valid rows or by the tile's rows, as the plan's task cost says); offsets agree
    def task_rows(task):
        if shape.task_cost == "rows":
            return task["tokens"] * num_heads
        if shape.task_cost == "warpgroup":  # whole 64-row blocks of the kernel's consumer warpgroups
            return -(-task["tokens"] * num_heads // 64) * 64
        return shape.tile_rows

    buckets = [sum(task_rows(t) * t["page_count"] >= th for th in BUCKET_THRESHOLDS) for t in tasks]
    if shape.task_order == "snake":
        # waves of num_sms tasks; every odd full wave is stored lightest first; undone, costs never increase and
        # equal costs keep chunk-major order
        waves = [tasks[begin:begin + shape.num_sms] for begin in range(0, len(tasks), shape.num_sms)]
        ranked = []
        for index, wave in enumerate(waves):
            ranked += wave[::-1] if index % 2 == 1 and len(wave) == shape.num_sms else wave
        keys = [(-task_rows(t) * (t["page_count"] + 2), t["page_begin"] // chunk_limit(t["tokens"])) for t in ranked]
        assert keys == sorted(keys)
    else:
        assert buckets == sorted(buckets, reverse=True)
    offsets = plan.bucket_offsets.tolist()
    assert offsets[0] == 0 and offsets[-1] == len(tasks)
    for rank in range(NUM_BUCKETS):
        bucket = NUM_BUCKETS - 1 - rank
        assert offsets[rank + 1] - offsets[rank] == buckets.count(bucket)

    # num_valid_pages: L + 1 per (token, head)
    expected_valid = []
    for q_len, kv_len in lengths:
        for i in range(q_len):
            expected_valid += [(kv_len - q_len + i) // shape.page_size + 1] * num_heads
    assert plan.num_valid_pages.tolist() == expected_valid
    return plan, shape


lengths_strategy = st.lists(
    st.integers(1, 3000).flatmap(lambda kv: st.tuples(st.integers(0, min(kv, 700)), st.just(kv))),
    min_size=1,
    max_size=48,
).filter(lambda ls: sum(q for q, _ in ls) > 0)


@settings(max_examples=120, deadline=None)
@given(
    lengths=lengths_strategy,
    num_heads=st.sampled_from([1, 2, 4]),
    tile_rows=st.sampled_from([None, 256]),
    chunk_policy=st.sampled_from(["fill_sms", "balanced"]),
    task_cost=st.sampled_from(["rows", "tile", "warpgroup"]),
    task_order=st.sampled_from(["buckets", "snake"]),
    num_sms=st.sampled_from([3, 16, 132]),
)
def test_plan_covers_every_tile_and_page_exactly_once(lengths, num_heads, tile_rows, chunk_policy, task_cost, task_order,
                                                      num_sms):
    check_plan(lengths, num_heads, tile_rows=tile_rows, chunk_policy=chunk_policy, task_cost=task_cost,
               task_order=task_order, num_sms=num_sms)


def test_plan_is_deterministic_and_refills_in_place():
    lengths = [(500, 9000), (33, 40000), (0, 5), (1, 129), (2000, 2000)]
    first, shape = build(lengths, 4)
    second, _ = build(lengths, 4)
    for name in ("descriptors", "num_tasks", "bucket_offsets", "num_valid_pages", "error_flags"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    cu, seq_lens = metadata(lengths)
    pointer = first.descriptors.data_ptr()
    first.descriptors.fill_(-7)
    build_task_plan(cu, seq_lens, shape, out=first)
    assert first.descriptors.data_ptr() == pointer
    assert torch.equal(first.descriptors, second.descriptors)


def test_short_queries_over_long_context_fill_the_machine():
    # fill_sms: 171 tokens (two q tiles) over a 100K context: a fixed 64-page chunk would give 26 tasks
    plan, shape = check_plan([(171, 100_000)], 1, chunk_policy="fill_sms")
    assert MIN_PAGE_CHUNK <= shape.page_chunk < 64
    assert int(plan.num_tasks[0]) >= 132
    plan, shape = check_plan([(128, 131_072)], 4, chunk_policy="fill_sms")
    assert int(plan.num_tasks[0]) >= 132
    # where even 8-page chunks cannot give every SM a task, the chunk is the smallest fill_sms allows ...
    for lengths, heads in (([(171, 55_000)], 1), ([(128, 32_768)], 4)):
        plan, shape = check_plan(lengths, heads, chunk_policy="fill_sms")
        assert shape.page_chunk == MIN_PAGE_CHUNK
        assert int(plan.num_tasks[0]) < 132
        # ... which the balanced policy (the default) may go below when its model predicts a shorter makespan
        balanced, balanced_shape = check_plan(lengths, heads)
        assert BALANCED_MIN_PAGE_CHUNK <= balanced_shape.page_chunk <= MIN_PAGE_CHUNK
        assert int(balanced.num_tasks[0]) >= int(plan.num_tasks[0])
    # one q tile over 429 pages: below 8 pages a chunk gives more SMs a share
    balanced, balanced_shape = check_plan([(128, 55_000)], 1)
    assert balanced_shape.page_chunk < MIN_PAGE_CHUNK


def test_long_queries_use_the_largest_chunk():
    plan, shape = check_plan([(16_384, 65_536)], 1, chunk_policy="fill_sms")
    assert shape.page_chunk == MAX_PAGE_CHUNK
    assert shape.q_tile_capacity == 128


def test_no_history_gives_no_tasks():
    plan, shape = check_plan([(100, 100), (28, 128)], 2)
    assert int(plan.num_tasks[0]) == 0
    assert shape.task_capacity == 0


def test_capacity_formulas_at_the_limits():
    # the largest plan that fits: 2^31 - 1 rows is over the task limit, so the error names it
    with pytest.raises(ValueError, match="task slots"):
        plan_shape(num_requests=1, total_q=(1 << 31) - 1, num_heads=1, page_size=128, max_seqlen_q=1 << 23, max_seqlen_k=1 << 23)
    with pytest.raises(ValueError, match="2\\^31 score rows"):
        plan_shape(num_requests=1, total_q=1 << 30, num_heads=2, page_size=128, max_seqlen_q=8, max_seqlen_k=8)
    with pytest.raises(ValueError, match="65536"):
        plan_shape(num_requests=1, total_q=8, num_heads=1, page_size=128, max_seqlen_q=8, max_seqlen_k=65536 * 128 + 1)
    # the largest context and a 1M-token batch fit, with capacities that are true bounds
    shape = plan_shape(num_requests=1000, total_q=1 << 20, num_heads=4, page_size=128, max_seqlen_q=1 << 20, max_seqlen_k=65536 * 128)
    assert shape.max_pages == 65536 and shape.page_chunk == MAX_PAGE_CHUNK
    assert shape.q_tile_capacity == (1 << 20) // 32 + 999
    assert shape.task_capacity == shape.q_tile_capacity * 512 < 1 << 31
    # many one-token requests: every token is its own tile
    shape = plan_shape(num_requests=5000, total_q=5000, num_heads=1, page_size=128, max_seqlen_q=1, max_seqlen_k=10)
    assert shape.q_tile_capacity == 5000


@settings(max_examples=60, deadline=None)
@given(
    q_lens=st.lists(st.sampled_from([1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129]), min_size=1, max_size=40),
    num_heads=st.sampled_from([1, 2, 4]),
)
def test_tile_capacity_holds_for_worst_case_partial_tiles(q_lens, num_heads):
    lengths = [(q, q + 300) for q in q_lens]
    plan, shape = build(lengths, num_heads)
    tiles = sum(-(-q // shape.tile_tokens) for q in q_lens)
    assert tiles <= shape.q_tile_capacity
    assert int(plan.error_flags[0]) == 0


@pytest.mark.parametrize(
    "mutate, flag",
    [
        (lambda cu, sl: cu.__setitem__(-1, cu[-1] - 1), PlanError.TOTAL_Q_MISMATCH),
        (lambda cu, sl: cu.__setitem__(1, 200), PlanError.CU_SEQLENS_NOT_MONOTONE),
        (lambda cu, sl: sl.__setitem__(0, 10), PlanError.KV_LENGTH_INVALID),
        (lambda cu, sl: sl.__setitem__(1, 5000), PlanError.KV_LENGTH_INVALID),
    ],
)
def test_error_flags_report_metadata_outside_the_bounds(mutate, flag):
    lengths = [(100, 1000), (50, 2000)]
    cu, seq_lens = metadata(lengths)
    shape = plan_shape(num_requests=2, total_q=150, num_heads=1, page_size=128, max_seqlen_q=100, max_seqlen_k=2000)
    mutate(cu, seq_lens)
    plan = build_task_plan(cu, seq_lens, shape)
    assert int(plan.error_flags[0]) & flag


def test_query_longer_than_bound_is_flagged():
    cu, seq_lens = metadata([(100, 1000), (50, 2000)])
    shape = plan_shape(num_requests=2, total_q=150, num_heads=1, page_size=128, max_seqlen_q=60, max_seqlen_k=2000)
    assert int(build_task_plan(cu, seq_lens, shape).error_flags[0]) & PlanError.QUERY_TOO_LONG


def execute_plan(plan, shape, q, k_cache, block_table, out):
    """A naive executor of the descriptors: what the GPU kernel does, one task at a time."""
    num_heads = shape.num_heads
    for task in tasks_of(plan):
        q_rows = q[task["token_begin"] : task["token_begin"] + task["tokens"]].reshape(-1, q.shape[-1]).double()
        for page in range(task["page_begin"], task["page_begin"] + task["page_count"]):
            keys = k_cache[int(block_table[task["request"], page])].double()
            maxima = (q_rows @ keys.T).amax(dim=1).float()
            for row in range(q_rows.shape[0]):
                position = task["position_begin"] + row // num_heads
                if page < position // shape.page_size:  # rows whose local page is earlier skip the tail
                    out[task["token_begin"] * num_heads + row, page] = maxima[row]
    return out


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_executing_the_descriptors_reproduces_the_torch_backend(num_heads):
    case = make_case([(150, 2500), (40, 4100), (1, 700), (70, 70)], num_heads=num_heads, seed=num_heads)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend="torch")
    rows = case.total_q * num_heads
    expected = torch.full((rows, case.block_table.shape[1]), float("nan"))
    wrapper.plan(*case.metadata(), **case.plan_kwargs(), score_out=expected)
    wrapper.run_scores(case.q, case.k_cache)
    executed = execute_plan(wrapper.task_plan, wrapper.task_plan.shape, case.q, case.k_cache, case.block_table, torch.full_like(expected, float("nan")))
    assert torch.equal(expected.isnan(), executed.isnan())
    assert torch.equal(expected.nan_to_num(), executed.nan_to_num())


def test_bench_schedule_balance_and_suite_shapes():
    from indexer.bench import load_cases, schedule_balance, sequence_lengths, useful_flops

    for case in load_cases(quick=False):
        lengths = sequence_lengths(case)
        assert sum(q for q, _ in lengths) == case["total_q"] and all(1 <= q <= kv for q, kv in lengths)
        assert max(kv for _, kv in lengths) == case["max_final_kv"]
        if case["batch_size"] == 1:
            assert useful_flops(lengths, 1) == case["useful_flops"]
    plan, shape = build([(16_384, 65_536)], 1, tile_rows=256)
    assert 0.5 < schedule_balance(plan, shape.num_sms) <= 1.0
    plan, shape = build([(16, 300)], 1)
    assert schedule_balance(plan, shape.num_sms) < 0.1  # a couple of tasks on 132 SMs


def test_balanced_chunk_policy_predicts_a_shorter_makespan():
    """The 'balanced' policy's chunk never has a worse modelled round-robin makespan than 'fill_sms'."""
    from indexer.bench import schedule_balance

    for lengths, heads in (([(16_384, 47_744)], 1), ([(16_384, 27_136)], 4), ([(1_649, 135_537)], 4)):
        fill, fill_shape = build(lengths, heads, tile_rows=256, chunk_policy="fill_sms")
        balanced, balanced_shape = build(lengths, heads, tile_rows=256, chunk_policy="balanced")
        assert BALANCED_MIN_PAGE_CHUNK <= balanced_shape.page_chunk <= MAX_PAGE_CHUNK
        assert schedule_balance(balanced, 132) >= schedule_balance(fill, 132) - 1e-9
    with pytest.raises(ValueError, match="chunk_policy"):
        plan_shape(num_requests=1, total_q=8, num_heads=1, page_size=128, max_seqlen_q=8, max_seqlen_k=800, chunk_policy="lpt")


def test_balanced_model_is_memoised_per_page_and_skipped_for_many_waves():
    from indexer import planner

    planner._balanced_page_chunk.cache_clear()
    decode = dict(num_requests=8, total_q=8, num_heads=4, page_size=128, max_seqlen_q=1, tile_rows=256)
    chunks = {plan_shape(**decode, max_seqlen_k=kv).page_chunk for kv in range(100_001, 100_097)}  # one page
    assert len(chunks) == 1 and planner._balanced_page_chunk.cache_info().misses == 1
    many_waves = dict(num_requests=1, total_q=131_072, num_heads=4, page_size=128, max_seqlen_q=131_072,
                      max_seqlen_k=131_072, tile_rows=256)
    assert plan_shape(**many_waves).page_chunk == plan_shape(**many_waves, chunk_policy="fill_sms").page_chunk
    assert planner._balanced_page_chunk.cache_info().misses == 1



def test_host_request_lengths_balance_a_short_batch_better_and_change_nothing_else():
    """The bounds model sees two requests at the longest context; the host lengths show a short second request."""
    from indexer.bench import schedule_balance
    from indexer.planner import modelled_requests

    lengths = [(175, 55282), (175, 21000)]
    cu, seq_lens = metadata(lengths)
    bounds = dict(num_requests=2, total_q=350, num_heads=1, page_size=128, max_seqlen_q=175, max_seqlen_k=55282,
                  tile_rows=256, num_sms=132)
    modelled = plan_shape(**bounds)
    assert plan_shape(**bounds, request_lengths=modelled_requests(350, 175, 55282)) == modelled
    exact = plan_shape(**bounds, request_lengths=lengths)
    assert exact.task_capacity >= 1 and exact.max_pages == modelled.max_pages
    balance = {name: schedule_balance(build_task_plan(cu, seq_lens, shape), 132)
               for name, shape in (("bounds", modelled), ("host", exact))}
    assert exact.page_chunk != modelled.page_chunk and balance["host"] > balance["bounds"] + 0.05


def test_scores_and_selection_do_not_depend_on_the_host_request_lengths():
    case = make_case([(300, 9000), (40, 5000), (1, 129)], num_heads=2, seed=3)
    results = []
    for request_lengths in (None, [(300, 9000), (40, 5000), (1, 129)], [(1, 1), (1, 1), (1, 1)]):
        wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
        wrapper.plan(*case.metadata(), **case.plan_kwargs(), request_lengths=request_lengths)
        selection = wrapper.run(case.q, case.k_cache)
        written = torch.arange(wrapper.scores.shape[1])[None, :] < (wrapper.num_valid_pages[:, None] - 1)
        results.append((wrapper.scores[written].clone(), selection.clone()))
    for scores, selection in results[1:]:
        assert torch.equal(scores, results[0][0]) and torch.equal(selection, results[0][1])


def test_tile_task_cost_balances_partial_tiles_by_what_the_kernel_spends():
    """338 tokens at H = 1 are a full 256-row tile and a partial one of 82 rows over the same ~580 pages. Valid rows
    make the partial tile's tasks look cheap; the kernel spends a full tile on them. Costed per tile, the plan's
    kernel-time makespan is shorter and its SMs busier (on the H200: 41.0 -> 36.7 µs run at H = 4, session 8)."""
    from indexer.bench import schedule_balance

    lengths = [(338, 74_578)]
    plans = {cost: build(lengths, 1, tile_rows=256, task_cost=cost, request_lengths=lengths) for cost in ("rows", "tile")}

    def kernel_time_makespan(plan):
        tasks = tasks_of(plan)
        per_cta = [0] * 132
        for index, task in enumerate(tasks):
            per_cta[index % 132] += task["page_count"] + 2
        return max(per_cta)

    (rows_plan, rows_shape), (tile_plan, tile_shape) = plans["rows"], plans["tile"]
    assert rows_shape.task_cost == "rows" and tile_shape.task_cost == "tile"
    assert kernel_time_makespan(tile_plan) < 0.8 * kernel_time_makespan(rows_plan)
    assert schedule_balance(tile_plan, 132, cost="tile") > schedule_balance(rows_plan, 132, cost="tile") + 0.1
    with pytest.raises(ValueError, match="task_cost"):
        plan_shape(num_requests=1, total_q=8, num_heads=1, page_size=128, max_seqlen_q=8, max_seqlen_k=800, task_cost="x")


def test_warpgroup_task_cost_counts_whole_64_row_blocks():
    """With idle warpgroups skipping their work, a task costs its valid rows rounded up to the kernel's 64-row
    warpgroup blocks: 338 tokens at H = 1 are a 256-row tile and an 82-row one, which costs 128 rows and whose page
    chunk is stretched twofold."""
    from indexer.bench import schedule_balance
    from indexer.planner import task_rows

    assert [task_rows(tokens, heads, 256, "warpgroup") for tokens, heads in ((82, 1), (1, 4), (16, 4), (17, 4), (64, 4))] \
        == [128, 64, 64, 128, 256]
    assert task_rows(82, 1, 256, "tile") == 256 and task_rows(82, 1, 256, "rows") == 82
    assert torch.equal(task_rows(torch.tensor([82, 256]), 1, 256, "warpgroup"), torch.tensor([128, 256]))
    lengths = [(338, 74_578)]
    plans = {cost: build(lengths, 1, tile_rows=256, task_cost=cost, request_lengths=lengths) for cost in ("tile", "warpgroup")}
    assert plans["warpgroup"][1].task_cost == "warpgroup"
    assert {-(-task["tokens"] // 64) * 64 for task in tasks_of(plans["warpgroup"][0])} == {256, 128}

    def skipping_kernel_makespan(plan):  # what a kernel that skips idle warpgroups spends per CTA
        per_cta = [0] * 132
        for index, task in enumerate(tasks_of(plan)):
            per_cta[index % 132] += -(-task["tokens"] // 64) * 64 * (task["page_count"] + 2)
        return max(per_cta)

    # the partial tile's chunks are stretched (its tasks cost what a full tile's do), so the kernel's makespan drops
    assert skipping_kernel_makespan(plans["warpgroup"][0]) < 0.9 * skipping_kernel_makespan(plans["tile"][0])
    assert 0 < schedule_balance(plans["warpgroup"][0], 132, cost="warpgroup") <= 1


def test_kernel_time_balance_counts_a_partial_tile_in_full():
    from indexer.bench import schedule_balance

    # H = 4: tiles of 64 tokens; 100 tokens at positions 1024..1123 are a full tile and one of 36 tokens, both with
    # 8 history pages: one task each on two SMs
    plan, shape = build([(100, 1124)], 4, tile_rows=256, num_sms=2, chunk_policy="fill_sms")
    assert [(t["tokens"], t["page_count"]) for t in tasks_of(plan)] == [(64, 8), (36, 8)]
    assert schedule_balance(plan, 2, cost="tile") == pytest.approx(1.0)  # both SMs spend a full tile's time
    assert schedule_balance(plan, 2, cost="rows") == pytest.approx((64 + 36) / 2 / 64)  # useful work
    with pytest.raises(ValueError, match="cost must be one of"):
        schedule_balance(plan, 2, cost="row")


def test_snake_order_lays_out_waves_that_balance_the_round_robin():
    # 16K query tokens over 48K of context at H = 4 (the suite's heaviest weighted case): the snake layout's round
    # robin is within 2 % of the perfect split; the bucket layout of the same tasks is 5 % off
    lengths = [(16384, 47744)]
    balance = {}
    for order in ("buckets", "snake"):
        plan, shape = build(lengths, 4, tile_rows=256, task_order=order, request_lengths=lengths)
        assert shape.task_order == order
        tasks = tasks_of(plan)
        cost = torch.tensor([shape.tile_rows * (t["page_count"] + 2) for t in tasks], dtype=torch.float64)
        per_cta = torch.zeros(shape.num_sms, dtype=torch.float64).index_add_(0, torch.arange(len(tasks)) % shape.num_sms, cost)
        balance[order] = float(per_cta.mean() / per_cta.max())
    assert balance["snake"] > 0.98 and balance["buckets"] < 0.96
    with pytest.raises(ValueError, match="task_order"):
        plan_shape(num_requests=1, total_q=8, num_heads=1, page_size=128, max_seqlen_q=8, max_seqlen_k=800, task_order="x")
