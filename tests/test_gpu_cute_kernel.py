"""The SM90 CuTe score kernel against the exact torch backend (run on the H200)."""

import pytest
import torch

from indexer import BatchPrefillIndexerQ8KV8Wrapper, selection_gate, topk_select
from cases import make_case

pytestmark = pytest.mark.gpu

FP8_RELATIVE_BOUND = 2.0**-9
"""|kernel - exact| <= bound * max_j sum_d |q_d k_jd| over the page: FP8 wgmma's reduced-precision
accumulation, measured on the H200 (docs/INDEXER.md, "Precision")."""


def sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def run_both(case, num_heads, pitch_extra=0):
    device = torch.device("cuda")
    metadata = [t.to(device) for t in case.metadata()]
    q, k = case.q.to(device), case.k_cache.to(device)
    rows, cols = case.total_q * num_heads, case.block_table.shape[1]
    results = {}
    for backend in ("torch", "cute"):
        base = torch.full((rows, cols + pitch_extra), float("nan"), device=device)
        wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend=backend, precision="fp8" if backend == "cute" else "auto")
        wrapper.plan(*metadata, **case.plan_kwargs(), score_out=base[:, :cols], validate=True)
        wrapper.run_scores(q, k)
        results[backend] = (wrapper, base)
    return results, q, k


def magnitude_bound(case, num_heads, device):
    """Per (row, page): max over the page's keys of sum_d |q_d k_d| (the scale of the FP8 error)."""
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend="torch")
    cols = case.block_table.shape[1]
    out = torch.full((case.total_q * num_heads, cols), float("nan"), device=device)
    wrapper.plan(*[t.to(device) for t in case.metadata()], **case.plan_kwargs(), score_out=out)
    q_abs = case.q.to(device).float().abs().to(torch.bfloat16)
    k_abs = case.k_cache.to(device).float().abs().to(torch.bfloat16)
    wrapper.run_scores(q_abs, k_abs)
    return out


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("lengths", [
    [(700, 9000), (64, 20000), (1, 129), (300, 300), (129, 4000)],
    # decode and verify steps: tiles of a few rows, the page-parallel kernel
    [(1, 40000), (3, 9000), (4, 131), (2, 20000), (1, 20001)],
    # short chunks: up to 64 rows per tile at H = 4, still page-parallel
    [(16, 9000), (9, 40000), (16, 131), (1, 20000), (13, 5000)],
], ids=["prefill", "decode", "short"])
@pytest.mark.parametrize("pitch_extra", [37, 40])
@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_scores_match_the_exact_reference_within_the_fp8_bound(num_heads, pitch_extra, lengths):
    case = make_case(lengths, num_heads=num_heads, seed=num_heads)
    results, _, _ = run_both(case, num_heads, pitch_extra=pitch_extra)
    (_, exact), (wrapper, kernel) = results["torch"], results["cute"]
    page_parallel = max(q_len for q_len, _ in lengths) * num_heads <= 64
    tile_rows = 64 if page_parallel else 256
    assert wrapper.active_backend == "cute" and wrapper.task_plan.shape.tile_rows == tile_rows
    assert wrapper.kernel_keys[0].page_parallel is page_parallel
    written = ~exact.isnan()
    assert torch.equal(written, ~kernel.isnan()), "the kernel must write exactly the columns p < L"
    bound = magnitude_bound(case, num_heads, exact.device)
    cols = bound.shape[1]
    error = (kernel[:, :cols] - exact[:, :cols]).abs()[written[:, :cols]]
    allowed = (FP8_RELATIVE_BOUND * bound)[written[:, :cols]] + 1e-6
    ratio = (error / bound[written[:, :cols]].clamp(min=1e-6)).max().item()
    print(f"H={num_heads} tile {tile_rows}: max |err| {error.max().item():.3e}, max err / sum|qk| {ratio:.3e}")
    assert bool((error <= allowed).all()), f"max error ratio {ratio}"


def mixed_sign_case(num_heads):
    """Pages whose scores are all negative, all zero, all positive, negative but for one key (held by one lane of
    each quad), or of mixed signs."""
    case = make_case([(300, 5000), (77, 1500), (1, 129)], num_heads=num_heads, seed=5)
    q = case.q.float().abs()
    k = case.k_cache.float().abs()
    kind = torch.arange(k.shape[0]) % 5
    k[kind == 0] = -k[kind == 0]  # every score of the page < 0
    k[kind == 1] = 0.0  # every score +0
    one_positive = kind == 2
    k[one_positive] = -k[one_positive]
    k[one_positive, 37] = k[one_positive, 37].abs()  # one key (one lane of each quad) >= 0
    k[kind == 3] *= torch.where(torch.rand(k[kind == 3].shape, generator=torch.Generator().manual_seed(1)) < 0.5, -1.0, 1.0)
    case.q, case.k_cache = q.to(case.q.dtype), k.to(case.k_cache.dtype)
    return case


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("num_heads", [1, 4])
def test_page_maxima_are_exact_for_negative_zero_and_mixed_sign_pages(num_heads):
    """Page maxima where the sign matters (``mixed_sign_case``)."""
    case = mixed_sign_case(num_heads)
    results, _, _ = run_both(case, num_heads, pitch_extra=2)
    (_, exact), (_, kernel) = results["torch"], results["cute"]
    assert torch.equal(exact.isnan(), kernel.isnan())
    cols = case.block_table.shape[1]
    exact, kernel = exact[:, :cols], kernel[:, :cols]
    written = ~exact.isnan()
    assert (exact[written] < 0).any() and (exact[written] == 0).any() and (exact[written] > 0).any()
    bound = magnitude_bound(case, num_heads, exact.device)
    error = (kernel - exact).abs()[written]
    assert bool((error <= FP8_RELATIVE_BOUND * bound[written] + 1e-6).all()), error.max().item()
    assert torch.equal(kernel[written] == 0, exact[written] == 0)


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("page_chunk", [None, 21, 22])
@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_tma_stores_write_the_same_scores_as_the_masked_write_out_and_nothing_else(num_heads, page_chunk, monkeypatch):
    """Whole staged blocks leave by TMA stores when the buffer allows it (16-byte pitch): the same scores bit for bit
    as the masked write-out an odd pitch takes, the same columns written, the padding untouched (tasks of 1 to hundreds
    of pages, partial and diagonal blocks, partial tiles). A page chunk that is not a multiple of 4 starts tasks on
    columns a TMA store cannot start on (an illegal instruction on the H200 before the kernel checked it): those blocks
    take the masked write-out."""
    from indexer import planner

    if page_chunk is not None:
        monkeypatch.setattr(planner, "balanced_page_chunk", lambda *args: page_chunk)
        planner._plan_shape.cache_clear()
    case = make_case([(700, 9000), (64, 20000), (1, 129), (300, 300), (129, 4000), (2048, 2100), (17, 3000)],
                     num_heads=num_heads, seed=17)
    cols = case.block_table.shape[1]
    aligned_extra = 4 + (-cols) % 4
    scores = {}
    for pitch_extra, tma_expected in ((aligned_extra, True), (aligned_extra + 1, False)):
        results, _, _ = run_both(case, num_heads, pitch_extra=pitch_extra)
        wrapper, scores[tma_expected] = results["cute"]
        assert wrapper.kernel_keys[0].tma_stores is tma_expected
        if page_chunk is not None:
            assert wrapper.task_plan.shape.page_chunk == page_chunk
        reference = results["torch"][1]
        assert torch.equal(scores[tma_expected].isnan(), reference.isnan()), "exactly the columns p < L"
    planner._plan_shape.cache_clear()
    assert torch.equal(scores[True][:, :cols].nan_to_num(), scores[False][:, :cols].nan_to_num())
    assert scores[True][:, cols:].isnan().all() and scores[False][:, cols:].isnan().all(), "the padding stays untouched"


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
def test_fp8_selection_is_right_up_to_the_fp8_error_bound():
    case = make_case([(2000, 30000), (300, 12000)], num_heads=4, seed=7)
    results, _, _ = run_both(case, 4)
    (torch_wrapper, exact), (_, kernel) = results["torch"], results["cute"]
    cols = case.block_table.shape[1]
    valid = torch_wrapper.num_valid_pages
    selection = topk_select(kernel[:, :cols], valid)
    reference = topk_select(exact[:, :cols], valid)
    history = torch.arange(cols, device=valid.device)[None, :] < (valid[:, None] - 1)
    bound = magnitude_bound(case, 4, exact.device)
    row_error_bound = FP8_RELATIVE_BOUND * torch.where(history, bound[:, :cols], 0).amax(dim=1)
    strict = selection_gate(selection, exact[:, :cols], valid)
    widened = selection_gate(selection, exact[:, :cols], valid, score_tolerance=row_error_bound)
    identical = (selection == reference).all(dim=1)
    ranked = valid > 16
    same_set = torch.stack([torch.isin(a[:15], b[:15]).all() for a, b in zip(selection[ranked], reference[ranked])])
    lost = (exact.gather(1, reference[:, :15].clamp(min=0).long()).sum(1) - exact.gather(1, selection[:, :15].clamp(min=0).long()).sum(1))[ranked]
    print(f"ranked rows {int(ranked.sum())}: identical {identical[ranked].float().mean():.4f}, same top-15 set "
          f"{same_set.float().mean():.4f}, strict gate {strict[ranked].float().mean():.4f}, widened gate "
          f"{widened.float().mean():.4f}, reference score lost per row: mean {lost.mean():.2e} max {lost.max():.2e}")
    assert bool(widened.all())


# every top-k launch of the "4_warps_per_row" tests splits its rows over 4 warps (cute_backend.TOPK_ROW_SPLIT_MAX_ROWS)
TOPK_ROW_SPLITS = {"1_warp_per_row": 0, "4_warps_per_row": 1 << 20}


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("row_split", TOPK_ROW_SPLITS)
def test_gpu_topk_matches_the_torch_topk_bitwise(row_split, monkeypatch):
    from indexer import cute_backend

    monkeypatch.setattr(cute_backend, "TOPK_ROW_SPLIT_MAX_ROWS", TOPK_ROW_SPLITS[row_split])
    generator = torch.Generator().manual_seed(11)
    # random rows of many magnitudes, ties, all-equal rows, few-ulp ranges at large magnitude (clamps at both ends)
    scores = torch.randn(3000, 9000, generator=generator) * torch.logspace(-30, 30, 3000)[:, None]
    scores[:100] = torch.randint(-2, 3, (100, 9000), generator=generator).float()
    scores[100:120] = 3.25
    scores[120:200] = 1.0e6 + torch.randint(0, 4, (80, 9000), generator=generator).float() * 2.0**-4
    # signed zeros beside tiny values (the warp min/max may return either zero), and subnormal rows
    signed_zeros = torch.tensor([-0.0, 0.0, 1e-3, -1e-3])
    scores[200:240] = signed_zeros[torch.randint(0, 4, (40, 9000), generator=generator)]
    scores[240:250] = signed_zeros[torch.randint(0, 2, (10, 9000), generator=generator)]
    scores[250:290] = torch.randn(40, 9000, generator=generator) * 1e-42
    valid = torch.randint(1, 9001, (3000,), generator=generator, dtype=torch.int32)
    valid[:40] = 9001
    valid[40:60] = torch.arange(1, 21, dtype=torch.int32)
    wide = torch.full((3000, 9100), float("nan"))
    wide[:, :9000] = scores
    for buffer in (scores, wide[:, :9000]):
        expected = topk_select(buffer, valid, backend="torch")
        got = topk_select(buffer.cuda(), valid.cuda())
        assert torch.equal(got.cpu(), expected)
    long_rows = torch.randn(4, 65535, generator=generator)
    long_valid = torch.tensor([65536, 40000, 17, 16], dtype=torch.int32)
    assert torch.equal(topk_select(long_rows.cuda(), long_valid.cuda()).cpu(), topk_select(long_rows, long_valid))


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("row_split", TOPK_ROW_SPLITS)
def test_gpu_topk_paths_and_the_fast_paths_fallback_match_torch_bitwise(row_split, monkeypatch):
    """Every row length around the kernel's path boundaries (8 / 12 / 16 cached slots, the re-read
    beyond), and rows built so that one lane holds most of the top 15: the fast path must hand them
    to the exhaustive one (a lane keeps only its 4 best keys), with the same result."""
    from indexer import cute_backend

    monkeypatch.setattr(cute_backend, "TOPK_ROW_SPLIT_MAX_ROWS", TOPK_ROW_SPLITS[row_split])
    generator = torch.Generator().manual_seed(12)
    # (with 4 warps per row: 8 slots per lane up to 1024 history pages, 16 up to 2048, and warps without columns
    # below 97)
    boundaries = [17, 18, 33, 47, 48, 49, 60, 100, 129, 256, 257, 258, 300, 384, 385, 386, 512, 513, 514, 700, 768, 769,
                  770, 800, 1024, 1025, 1026, 2048, 2049, 2050, 4000]
    valid = torch.tensor(boundaries * 40, dtype=torch.int32)
    rows, cols = valid.shape[0], 4100
    scores = torch.randn(rows, cols, generator=generator)
    kind = torch.arange(rows) % 5
    lane = torch.randint(0, 32, (rows,), generator=generator)
    columns = torch.arange(cols)
    same_lane = (columns[None, :] % 32) == lane[:, None]
    scores = torch.where((kind == 1)[:, None] & same_lane, scores + 8.0, scores)  # one lane holds the top 15
    two_lanes = same_lane | ((columns[None, :] % 32) == ((lane + 7) % 32)[:, None])
    scores = torch.where((kind == 2)[:, None] & two_lanes, scores + 8.0, scores)  # two lanes: 8 and 7 winners
    level_ties = torch.randint(0, 3, (rows, cols), generator=generator).float()
    scores = torch.where((kind == 3)[:, None], level_ties, scores)  # ties broken by page order
    four_in_a_lane = same_lane & (columns[None, :] < 4 * 32)  # exactly 4 winners in one lane, the rest spread
    scores = torch.where((kind == 4)[:, None] & four_in_a_lane, scores + 8.0, scores)
    expected = topk_select(scores, valid, backend="torch")
    got = topk_select(scores.cuda(), valid.cuda())
    assert torch.equal(got.cpu(), expected)


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
def test_run_selects_the_same_pages_eagerly_on_a_side_stream_and_in_graph_replay():
    """The TVM-FFI launches take torch's current stream: eager on the default stream, eager on a side stream behind
    queued work, and a captured graph's replays select the same pages."""
    case = make_case([(1500, 40000), (7, 9000), (300, 70000)], num_heads=4, seed=21)
    device = torch.device("cuda")
    metadata = [t.to(device) for t in case.metadata()]
    q, k = case.q.to(device), case.k_cache.to(device)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(4, backend="cute", precision="fp8")
    wrapper.plan(*metadata, **case.plan_kwargs())
    eager = wrapper.run(q, k).clone()
    expected = topk_select(wrapper.scores.clone(), wrapper.num_valid_pages, backend="torch").view_as(eager)
    assert torch.equal(eager, expected)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        wrapper.scores.fill_(float("nan"))
        on_side = wrapper.run(q, k).clone()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = wrapper.run(q, k)
    for _ in range(3):
        wrapper.scores.fill_(float("nan"))
        replayed.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
def test_kernel_is_deterministic_and_graph_replay_matches_eager():
    case = make_case([(1500, 40000), (7, 9000)], num_heads=2, seed=3)
    device = torch.device("cuda")
    metadata = [t.to(device) for t in case.metadata()]
    q, k = case.q.to(device), case.k_cache.to(device)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="cute", precision="fp8")
    wrapper.plan(*metadata, **case.plan_kwargs())
    written = torch.arange(wrapper.scores.shape[1], device=device)[None, :] < (wrapper.num_valid_pages[:, None] - 1)
    first = wrapper.run_scores(q, k).clone()
    second = wrapper.run_scores(q, k).clone()
    assert torch.equal(first[written].view(torch.int32), second[written].view(torch.int32))
    wrapper.scores.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run_scores(q, k)
    wrapper.scores.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = wrapper.scores.clone()
    assert torch.equal(replayed[written].view(torch.int32), first[written].view(torch.int32))
    assert bool(replayed[~written].isnan().all())


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
def test_custom_ops_pass_opcheck_and_run_under_torch_compile():
    import indexer.ops  # noqa: F401

    case = make_case([(300, 9000), (40, 5000)], num_heads=2, seed=13)
    device = torch.device("cuda")
    metadata = [t.to(device) for t in case.metadata()]
    q, k = case.q.to(device), case.k_cache.to(device)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="cute", precision="fp8")
    wrapper.plan(*metadata, **case.plan_kwargs())
    eager = wrapper.run(q, k).clone()
    plan = wrapper.task_plan
    score_key, topk_key = wrapper.kernel_keys
    # test_schema compares inputs with arithmetic torch lacks for e4m3 on CUDA; the fake test covers the op
    torch.library.opcheck(
        torch.ops.indexer.page_scores_sm90,
        (q, k, wrapper.scores, metadata[2], plan.descriptors, plan.num_tasks,
         plan.errors, 2, False, score_key.tma_stores, score_key.num_ctas),
        test_utils=("test_faketensor",),
    )
    out = torch.empty(case.total_q * 2, 16, dtype=torch.int32, device=device)
    torch.library.opcheck(
        torch.ops.indexer.topk_select16, (wrapper.scores, wrapper.num_valid_pages, out, plan.errors,
                                          topk_key.warps_per_row),
        test_utils=("test_schema", "test_faketensor"),
    )
    compiled = torch.compile(lambda q, k: wrapper.run(q, k).clone())
    assert torch.equal(compiled(q, k), eager)


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_exact_precision_matches_the_reference(num_heads):
    case = make_case([(900, 20000), (64, 9000), (1, 129), (129, 4000)], num_heads=num_heads, seed=20 + num_heads)
    device = torch.device("cuda")
    metadata = [t.to(device) for t in case.metadata()]
    q, k = case.q.to(device), case.k_cache.to(device)
    rows, cols = case.total_q * num_heads, case.block_table.shape[1]
    buffers, selections = {}, {}
    for backend, precision in (("torch", "auto"), ("cute", "exact")):
        base = torch.full((rows, cols + 5), float("nan"), device=device)
        wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend=backend, precision=precision)
        wrapper.plan(*metadata, **case.plan_kwargs(), score_out=base[:, :cols], validate=True)
        selections[backend] = wrapper.run(q, k).clone().view(rows, 16)
        buffers[backend] = base
    exact, kernel = buffers["torch"], buffers["cute"]
    written = ~exact.isnan()
    assert torch.equal(written, ~kernel.isnan())
    torch.testing.assert_close(kernel[written], exact[written], atol=2e-4, rtol=2e-4)
    bitwise = (kernel[written].view(torch.int32) == exact[written].view(torch.int32)).float().mean().item()
    differing = ~(selections["cute"] == selections["torch"]).all(dim=1)
    valid = wrapper.num_valid_pages
    gate = selection_gate(selections["cute"], exact[:, :cols], valid)
    print(f"exact H={num_heads}: bitwise-equal scores {bitwise:.6f}, rows with another selection {int(differing.sum())} "
          f"of {rows}, all pass the gate: {bool(gate.all())}")
    assert bool(gate.all())
