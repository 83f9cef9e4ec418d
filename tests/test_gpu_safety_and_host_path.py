"""The SM90 path on the H200: poisoned metadata never reaches outside a buffer (NaN guard regions around every
buffer stay untouched) and is reported by ``check_errors()``; ``plan()`` repeats a shape without a sync or an
allocation, by a graph replay that builds the same plan; ``run()`` decides nothing."""

import pytest
import torch

from indexer import BatchPrefillIndexerQ8KV8Wrapper, topk_select
from indexer.wrapper import IndexerRunError
from cases import make_case

pytestmark = pytest.mark.gpu

GUARD = 8


def sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")


def guarded_scores(rows, cols, tma_pitch: bool):
    """A NaN buffer with GUARD rows above and below and guard columns to the right; the score view inside it."""
    pitch = cols + 4 + (-cols) % 4 + (0 if tma_pitch else 1)
    base = torch.full((rows + 2 * GUARD, pitch), float("nan"), device="cuda")
    return base, base[GUARD:GUARD + rows, :cols]


def guarded_selection(total_q, num_heads):
    base = torch.full((total_q * num_heads + 2 * GUARD, 16), -7, dtype=torch.int32, device="cuda")
    return base, base[GUARD:GUARD + total_q * num_heads].view(total_q, num_heads, 16)


def assert_guards_untouched(base, scores, selection_base=None, total_rows=None):
    rows, cols = scores.shape
    assert base[:GUARD].isnan().all() and base[GUARD + rows:].isnan().all(), "a guard row was written"
    assert base[:, cols:].isnan().all(), "a guard column was written"
    if selection_base is not None:
        assert (selection_base[:GUARD] == -7).all() and (selection_base[GUARD + total_rows:] == -7).all()


def fp8_inputs(total_q, num_heads, num_pages, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(total_q, num_heads, 128, device="cuda", generator=generator) * 0.3).to(torch.float8_e4m3fn)
    k = (torch.randn(num_pages, 128, 128, device="cuda", generator=generator) * 0.3).to(torch.float8_e4m3fn)
    return q, k


@needs_sm90
@pytest.mark.parametrize("tma_pitch", [True, False])
@pytest.mark.parametrize("num_heads", [1, 4])
@pytest.mark.parametrize("poison", ["query_offsets_beyond_total_q", "context_beyond_the_columns",
                                    "negative_offsets", "context_shorter_than_query"])
def test_poisoned_lengths_are_clamped_inside_the_buffers_and_reported(poison, num_heads, tma_pitch):
    total_q, max_seqlen_k = 300, 4096  # 32 score columns
    cu, seq_lens = {
        "query_offsets_beyond_total_q": ([0, 1000], [4000]),  # rows up to 1000 * H in a 300 * H row buffer
        "context_beyond_the_columns": ([0, 300], [40000]),  # 313 valid pages against 32 columns
        "negative_offsets": ([-500, 300], [4000]),
        "context_shorter_than_query": ([0, 300], [10]),
    }[poison]
    cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    num_pages = 400
    block_table = torch.randperm(num_pages, device="cuda")[None, :].to(torch.int32).contiguous()
    q, k = fp8_inputs(total_q, num_heads, num_pages, seed=3)
    base, scores = guarded_scores(total_q * num_heads, 32, tma_pitch)
    selection_base, selection = guarded_selection(total_q, num_heads)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend="cute")
    wrapper.plan(cu, seq_lens, block_table, total_q=total_q, max_seqlen_q=total_q, max_seqlen_k=max_seqlen_k,
                 score_out=scores)
    wrapper.run(q, k, out=selection)
    torch.cuda.synchronize()
    assert_guards_untouched(base, scores, selection_base, total_q * num_heads)
    assert int(wrapper.num_valid_pages.min()) >= 1 and int(wrapper.num_valid_pages.max()) <= 32
    assert int(selection.min()) >= -1 and int(selection.max()) < 32, "page ids stay inside the score columns"
    with pytest.raises(IndexerRunError, match="metadata does not match"):
        wrapper.check_errors()


@needs_sm90
@pytest.mark.parametrize("tma_pitch", [True, False])
@pytest.mark.parametrize("bad_page", [-1, 600, 1 << 30])
def test_page_ids_outside_the_k_cache_read_page_zero_and_are_reported(bad_page, tma_pitch):
    case = make_case([(300, 9000), (40, 5000)], num_heads=4, seed=5)
    device = torch.device("cuda")
    cu, seq_lens, block_table = (t.to(device) for t in case.metadata())
    q, k = case.q.to(device), case.k_cache.to(device)
    assert k.shape[0] < 600
    block_table[0, 3] = bad_page
    block_table[1, 0] = bad_page
    cols = block_table.shape[1]
    base, scores = guarded_scores(case.total_q * 4, cols, tma_pitch)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(4, backend="cute")
    wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs(), score_out=scores)
    wrapper.check_errors()  # the metadata's lengths are consistent
    selection = wrapper.run(q, k)
    torch.cuda.synchronize()
    assert_guards_untouched(base, scores)
    assert int(selection.max()) < cols
    with pytest.raises(IndexerRunError, match="block_table entry"):
        wrapper.check_errors()
    wrapper.check_errors()  # the kernels' records are cleared by the check
    # the CUDA context is healthy and every score is what physical page 0 in place of the bad ids gives
    fixed = block_table.clone()
    fixed[0, 3] = 0
    fixed[1, 0] = 0
    reference = BatchPrefillIndexerQ8KV8Wrapper(4, backend="cute")
    reference_base, reference_scores = guarded_scores(case.total_q * 4, cols, tma_pitch)
    reference.plan(cu, seq_lens, fixed, **case.plan_kwargs(), score_out=reference_scores)
    reference.run_scores(q, k)
    assert torch.equal(scores.nan_to_num(), reference_scores.nan_to_num())


@needs_sm90
def test_standalone_topk_clamps_row_lengths_outside_the_buffer():
    rows, cols = 64, 700
    generator = torch.Generator(device="cuda").manual_seed(9)
    scores = torch.randn(rows, cols, device="cuda", generator=generator)
    valid = torch.randint(1, cols + 2, (rows,), dtype=torch.int32, device="cuda", generator=generator)
    valid[:4] = torch.tensor([0, -5, cols + 2, 70000], dtype=torch.int32)
    base = torch.full((rows + 2 * GUARD, 16), -7, dtype=torch.int32, device="cuda")
    out = base[GUARD:GUARD + rows]
    topk_select(scores, valid, out=out)
    torch.cuda.synchronize()
    assert (base[:GUARD] == -7).all() and (base[GUARD + rows:] == -7).all()
    assert int(out.min()) >= -1 and int(out.max()) <= cols
    clamped = valid.clamp(1, cols + 1)
    assert torch.equal(out[4:], topk_select(scores[4:], clamped[4:], backend="torch"))
    assert torch.equal(out[:4], topk_select(scores[:4], clamped[:4], backend="torch"))


@needs_sm90
def test_validate_raises_before_anything_is_written_and_keeps_the_previous_plan():
    case = make_case([(300, 9000), (40, 5000)], num_heads=2, seed=6)
    device = torch.device("cuda")
    cu, seq_lens, block_table = (t.to(device) for t in case.metadata())
    q, k = case.q.to(device), case.k_cache.to(device)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="cute")
    wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs())
    before = wrapper.run(q, k).clone()
    descriptors = wrapper.task_plan.descriptors.clone()
    bad = cu.clone()
    bad[1] = 10_000
    untouched = torch.full((case.total_q * 2, block_table.shape[1]), float("nan"), device=device)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        wrapper.plan(bad, seq_lens, block_table, **case.plan_kwargs(), score_out=untouched, validate=True)
    assert untouched.isnan().all()
    assert torch.equal(wrapper.task_plan.descriptors, descriptors)
    assert torch.equal(wrapper.run(q, k), before)


@needs_sm90
@pytest.mark.parametrize("builder", ["plan kernel", "graph of torch ops"])
def test_repeated_plans_replay_a_graph_without_a_sync_or_an_allocation_and_build_the_same_plan(builder, monkeypatch):
    from indexer import cute_backend

    if builder != "plan kernel":  # the shape is small enough for the kernel: force the torch ops
        monkeypatch.setattr(cute_backend, "plan_kernel_serves", lambda shape: False)
    device = torch.device("cuda")
    lengths = [(900, 40000), (3, 7000), (64, 64)]
    case = make_case(lengths, num_heads=4, seed=8)
    cu, seq_lens, block_table = (t.to(device) for t in case.metadata())
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(4, backend="cute")
    wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs())  # the first plan: compiles, builds eagerly
    eager = {name: getattr(wrapper.task_plan, name).clone() for name in ("descriptors", "num_tasks", "num_valid_pages")}
    for _ in range(2):  # the second plan of a shape captures its graph (the host lengths may give another shape)
        wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs())
        wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs(), request_lengths=lengths)
    if builder == "plan kernel":
        assert all(state.plan_kernel is not None and state.graph is None for state in wrapper._states.values())
    else:
        assert all(state.graph is not None for state in wrapper._states.values())
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs())
            wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs(), request_lengths=lengths)
        wrapper.replan()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs())
    for name, tensor in eager.items():
        assert torch.equal(getattr(wrapper.task_plan, name), tensor), name

    # a decode step's longer context in the same page count replays the same graph, with the new lengths
    grown = seq_lens + torch.tensor([1, 2, 0], dtype=torch.int32, device=device)
    kwargs = dict(case.plan_kwargs(), max_seqlen_k=case.max_seqlen_k + 1)
    wrapper.plan(cu, grown, block_table, **kwargs)
    fresh = BatchPrefillIndexerQ8KV8Wrapper(4, backend="cute")
    fresh.plan(cu, grown, block_table, **kwargs)
    for name in ("descriptors", "num_tasks", "num_valid_pages", "errors"):
        assert torch.equal(getattr(wrapper.task_plan, name), getattr(fresh.task_plan, name)), name


@needs_sm90
def test_plan_graphs_are_captured_and_freed_safely_among_cyclic_garbage(monkeypatch):
    """A plan's graph capture survives the garbage collector (a collection that frees a CUDA graph would end the
    capture): garbage cycles holding graphs are pending, and the collector would run on every allocation. A dropped
    wrapper frees its own graphs at once, outside anyone's capture. (Plans of the torch ops: the plan kernel would
    serve this small shape without a graph.)"""
    import gc
    import weakref

    from indexer import cute_backend

    monkeypatch.setattr(cute_backend, "plan_kernel_serves", lambda shape: False)

    device = torch.device("cuda")
    case = make_case([(300, 9000), (40, 5000)], num_heads=1, seed=12)
    cu, seq_lens, block_table = (t.to(device) for t in case.metadata())

    def planned_twice():
        wrapper = BatchPrefillIndexerQ8KV8Wrapper(1, backend="cute")
        for _ in range(2):
            wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs())
        return wrapper

    thresholds = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):  # garbage cycles, each holding a captured plan graph
            cycle = [planned_twice()]
            cycle.append(cycle)
            assert all(state.graph is not None for state in cycle[0]._states.values())
            del cycle
        gc.set_threshold(1)
        gc.enable()
        wrapper = planned_twice()  # captures while the collector is due at every allocation
        state = next(iter(wrapper._states.values()))
        assert state.graph is not None and not state.capture_failed
        reference = weakref.ref(state)
        del wrapper, state
        assert reference() is None
    finally:
        gc.set_threshold(*thresholds)
        gc.enable()
        gc.collect()
    # the process's graphs still capture
    graph, out = torch.cuda.CUDAGraph(), torch.empty(4, device=device)
    with torch.cuda.graph(graph):
        out.copy_(torch.arange(4, device=device, dtype=torch.float32))
    graph.replay()
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


@needs_sm90
def test_replan_and_run_captured_in_a_graph_follow_in_place_metadata_updates():
    device = torch.device("cuda")
    case = make_case([(256, 9000), (256, 5000)], num_heads=2, seed=10)
    cu, seq_lens, block_table = (t.to(device) for t in case.metadata())
    q, k = case.q.to(device), case.k_cache.to(device)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="cute")
    wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs())
    wrapper.run(q, k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.replan()
        selection = wrapper.run(q, k)
    seq_lens.copy_(torch.tensor([8000, 4000], dtype=torch.int32))
    graph.replay()
    fresh = BatchPrefillIndexerQ8KV8Wrapper(2, backend="cute")
    fresh.plan(cu, seq_lens, block_table, **case.plan_kwargs())
    assert torch.equal(selection, fresh.run(q, k))


@needs_sm90
def test_run_makes_no_backend_decision_and_compiles_nothing(monkeypatch):
    from indexer import backends, cute_backend, cute_runtime

    case = make_case([(300, 9000)], num_heads=4, seed=12)
    device = torch.device("cuda")
    metadata = [t.to(device) for t in case.metadata()]
    q, k = case.q.to(device), case.k_cache.to(device)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(4)
    wrapper.plan(*metadata, **case.plan_kwargs())
    expected = wrapper.run(q, k).clone()

    def refuse(*args, **kwargs):
        raise AssertionError("run() must not decide or compile")

    for module, name in ((backends, "resolve_backend"), (backends, "kernel_unsupported_reason"),
                         (cute_backend, "compiled_kernel"), (cute_backend, "score_kernel_key"),
                         (cute_backend, "topk_kernel_key"), (cute_runtime, "compile_once")):
        monkeypatch.setattr(module, name, refuse)
    assert torch.equal(wrapper.run(q, k), expected)
    wrapper.run_scores(q, k)
