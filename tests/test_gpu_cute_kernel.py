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
@pytest.mark.parametrize("tile_rows", [128, 192, 256])
@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_scores_match_the_exact_reference_within_the_fp8_bound(num_heads, tile_rows, monkeypatch):
    from indexer import cute_backend

    monkeypatch.setattr(cute_backend, "SCORE_TILE_ROWS", tile_rows)
    case = make_case([(700, 9000), (64, 20000), (1, 129), (300, 300), (129, 4000)], num_heads=num_heads, seed=num_heads)
    results, _, _ = run_both(case, num_heads, pitch_extra=37)
    (_, exact), (wrapper, kernel) = results["torch"], results["cute"]
    assert wrapper.active_backend == "cute" and wrapper.task_plan.shape.tile_rows == tile_rows
    written = ~exact.isnan()
    assert torch.equal(written, ~kernel.isnan()), "the kernel must write exactly the columns p < L"
    bound = magnitude_bound(case, num_heads, exact.device)
    cols = bound.shape[1]
    error = (kernel[:, :cols] - exact[:, :cols]).abs()[written[:, :cols]]
    allowed = (FP8_RELATIVE_BOUND * bound)[written[:, :cols]] + 1e-6
    ratio = (error / bound[written[:, :cols]].clamp(min=1e-6)).max().item()
    print(f"H={num_heads} tile {tile_rows}: max |err| {error.max().item():.3e}, max err / sum|qk| {ratio:.3e}")
    assert bool((error <= allowed).all()), f"max error ratio {ratio}"


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("num_heads", [1, 4])
def test_issue_ring_changes_the_schedule_not_the_scores(num_heads, monkeypatch):
    """The wgmma issue token only orders the warpgroups: every score is the same bit for bit."""
    from indexer import cute_backend

    case = make_case([(700, 9000), (64, 20000), (1, 129), (300, 300), (129, 4000)], num_heads=num_heads, seed=7)
    scores = {}
    for ring in (None, "commit", "progress"):
        monkeypatch.setattr(cute_backend, "SCORE_ISSUE_RING", ring)
        results, _, _ = run_both(case, num_heads, pitch_extra=5)
        scores[ring] = results["cute"][1]
    for ring in ("commit", "progress"):
        assert torch.equal(scores[None].isnan(), scores[ring].isnan()), ring
        assert torch.equal(scores[None].nan_to_num(), scores[ring].nan_to_num()), ring


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
@pytest.mark.parametrize("tile_rows", [128, 256])
@pytest.mark.parametrize("num_heads", [1, 4])
def test_integer_row_max_writes_the_same_page_maxima(num_heads, tile_rows, monkeypatch):
    """Page maxima from the scores' bit patterns (three-input integer max, a min tree for all-negative rows): the same
    values as the float tree, on pages of every sign mix, including all-negative and all-zero pages."""
    from indexer import cute_backend

    monkeypatch.setattr(cute_backend, "SCORE_TILE_ROWS", tile_rows)
    case = mixed_sign_case(num_heads)
    scores = {}
    for integer_row_max in (False, True):
        monkeypatch.setattr(cute_backend, "SCORE_INTEGER_ROW_MAX", integer_row_max)
        results, _, _ = run_both(case, num_heads, pitch_extra=2)
        scores[integer_row_max] = results["cute"][1]
        used = {key[7] for key in cute_backend._compiled if key[0] == "page_scores_sm90"}  # key[7]: integer_row_max
        assert integer_row_max in used
    written = ~scores[False].isnan()
    assert (scores[False][written] < 0).any() and (scores[False][written] == 0).any()
    assert torch.equal(scores[False].isnan(), scores[True].isnan())
    assert torch.equal(scores[False].nan_to_num(), scores[True].nan_to_num())


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("task_cost", ["tile", "warpgroup"])
@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_idle_warpgroups_skipping_partial_tiles_write_the_same_scores(num_heads, task_cost, monkeypatch):
    """Warpgroups whose 64 rows lie past a task's valid rows skip its pages: the same scores bit for bit, the same
    columns written, on requests whose last tiles hold 1 to 4 active warpgroups (TMA-store and masked pitches)."""
    from indexer import cute_backend, planner

    monkeypatch.setattr(planner, "DEFAULT_TASK_COST", task_cost)
    case = make_case([(700, 9000), (64, 20000), (1, 129), (300, 300), (129, 4000), (2048, 2100), (17, 6000)],
                     num_heads=num_heads, seed=23)
    cols = case.block_table.shape[1]
    for pitch_extra in (4 + (-cols) % 4, 1):
        scores = {}
        for skip in (False, True):
            monkeypatch.setattr(cute_backend, "SCORE_SKIP_IDLE_WARPGROUPS", skip)
            results, _, _ = run_both(case, num_heads, pitch_extra=pitch_extra)
            scores[skip] = results["cute"][1]
            used = {key[8] for key in cute_backend._compiled if key[0] == "page_scores_sm90"}  # key[8]: skip
            assert skip in used
        reference = results["torch"][1]
        assert torch.equal(scores[True].isnan(), reference.isnan()), "exactly the columns p < L, padding untouched"
        assert torch.equal(scores[False].isnan(), scores[True].isnan())
        assert torch.equal(scores[False].nan_to_num(), scores[True].nan_to_num())


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("page_chunk", [21, 22])
def test_tma_stores_of_tasks_starting_off_a_16_byte_column_take_the_masked_write_out(page_chunk, monkeypatch):
    """A page chunk that is not a multiple of 4 starts tasks on columns a TMA store cannot start on (an illegal
    instruction on the H200 before the kernel checked it): those blocks take the masked write-out, the scores are the
    same bit for bit as the masked pitch's, exactly the columns p < L are written."""
    from indexer import cute_backend, planner

    monkeypatch.setattr(planner, "_balanced_page_chunk", lambda *args: page_chunk)
    case = make_case([(700, 9000), (2048, 6100), (17, 3000)], num_heads=1, seed=29)
    cols = case.block_table.shape[1]
    scores = {}
    for pitch_extra in (4 + (-cols) % 4, 1):
        results, _, _ = run_both(case, 1, pitch_extra=pitch_extra)
        wrapper, scores[pitch_extra] = results["cute"]
        assert wrapper.task_plan.shape.page_chunk == page_chunk
        assert torch.equal(scores[pitch_extra][:, :cols].isnan(), results["torch"][1][:, :cols].isnan())
    assert {key[5] for key in cute_backend._compiled if key[0] == "page_scores_sm90"} >= {True, False}  # key[5]: TMA
    tma, masked = scores.values()
    assert torch.equal(tma[:, :cols].nan_to_num(), masked[:, :cols].nan_to_num())
    assert tma[:, cols:].isnan().all(), "the padding stays untouched"


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_tma_stores_write_the_same_scores_and_nothing_else(num_heads, monkeypatch):
    """Whole staged blocks leave by TMA stores when the buffer allows it (16-byte pitch): the same scores bit for bit
    as the masked write-out, the same columns written, the wide pitch's padding untouched; an odd pitch takes the
    masked write-out (tasks of 1 to hundreds of pages, partial and diagonal blocks, partial tiles)."""
    from indexer import cute_backend

    case = make_case([(700, 9000), (64, 20000), (1, 129), (300, 300), (129, 4000), (2048, 2100)], num_heads=num_heads,
                     seed=17)
    cols = case.block_table.shape[1]
    aligned_extra = 4 + (-cols) % 4
    for pitch_extra, tma_expected in ((aligned_extra, True), (aligned_extra + 1, False)):
        scores = {}
        for tma_stores in (False, True):
            monkeypatch.setattr(cute_backend, "SCORE_TMA_STORES", tma_stores)
            cute_backend._compiled.clear()
            results, _, _ = run_both(case, num_heads, pitch_extra=pitch_extra)
            scores[tma_stores] = results["cute"][1]
            used = {key[5] for key in cute_backend._compiled if key[0] == "page_scores_sm90"}  # key[5]: tma_stores
            assert used == {tma_stores and tma_expected}
        reference = results["torch"][1]
        assert torch.equal(scores[True].isnan(), reference.isnan()), "exactly the columns p < L, padding untouched"
        assert torch.equal(scores[False].isnan(), scores[True].isnan())
        assert torch.equal(scores[False].nan_to_num(), scores[True].nan_to_num())


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


# the top-k kernel's options that change its code, never its result (cute_backend.TOPK_KERNEL_OPTIONS); "plain" is the
# kernel before session 9's options (the defaults since session 10)
PLAIN_TOPK = dict(saturating_u16_levels=False, row_range_by_redux=False, winners_in_shared=False, longest_rows_first=False,
                  max_registers=None)
TOPK_OPTION_SETS = {"default": {}, "rest_batch_1": dict(rest_batch=1), "plain": PLAIN_TOPK,
                    "plain_rest_batch_1": dict(PLAIN_TOPK, rest_batch=1), "32_registers": dict(max_registers=32),
                    "heads_in_registers": dict(heads_in_registers=True),
                    "plain_heads_in_registers": dict(PLAIN_TOPK, heads_in_registers=True),
                    # every launch of these tests splits its rows over 4 warps (cute_backend.TOPK_ROW_SPLIT_MAX_ROWS)
                    "4_warps_per_row": dict(row_split_max_rows=1 << 20),
                    "plain_4_warps_per_row": dict(PLAIN_TOPK, row_split_max_rows=1 << 20)}


def use_topk_options(monkeypatch, row_split_max_rows=0, **options):
    from indexer import cute_backend

    monkeypatch.setattr(cute_backend, "TOPK_KERNEL_OPTIONS", dict(cute_backend.TOPK_KERNEL_OPTIONS, **options))
    monkeypatch.setattr(cute_backend, "TOPK_ROW_SPLIT_MAX_ROWS", row_split_max_rows)


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("option_set", TOPK_OPTION_SETS)
def test_gpu_topk_matches_the_torch_topk_bitwise(option_set, monkeypatch):
    use_topk_options(monkeypatch, **TOPK_OPTION_SETS[option_set])
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
@pytest.mark.parametrize("option_set", TOPK_OPTION_SETS)
@pytest.mark.parametrize("lane_list_length", [4, None])
def test_gpu_topk_paths_and_the_fast_paths_fallback_match_torch_bitwise(lane_list_length, option_set, monkeypatch):
    """Every row length around the kernel's path boundaries (8 / 12 / 16 / 24 cached slots, the re-read
    beyond), and rows built so that one lane holds most of the top 15: the fast path must hand them
    to the exhaustive one (a lane keeps only its 4 best keys), with the same result."""
    use_topk_options(monkeypatch, lane_list_length=lane_list_length, **TOPK_OPTION_SETS[option_set])
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
def test_programmatic_topk_launch_selects_the_same_pages_eagerly_and_in_graph_replay(monkeypatch):
    """The top-k launched as a programmatic dependent of the score kernel (its CTAs may start during the score
    kernel's tail and wait for it) selects exactly what the plain launch does, eagerly and replayed."""
    from indexer import cute_backend

    case = make_case([(1500, 40000), (7, 9000), (300, 70000)], num_heads=4, seed=21)
    device = torch.device("cuda")
    metadata = [t.to(device) for t in case.metadata()]
    q, k = case.q.to(device), case.k_cache.to(device)
    selections = {}
    for programmatic in (False, True):
        monkeypatch.setattr(cute_backend, "PROGRAMMATIC_TOPK", programmatic)
        wrapper = BatchPrefillIndexerQ8KV8Wrapper(4, backend="cute", precision="fp8")
        wrapper.plan(*metadata, **case.plan_kwargs())
        eager = wrapper.run(q, k).clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = wrapper.run(q, k)
        for _ in range(3):
            wrapper.scores.fill_(float("nan"))
            replayed.fill_(-7)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, eager)
        selections[programmatic] = eager
    assert torch.equal(selections[True], selections[False])
    # key: ("topk_select", options, programmatic_launch, DSL version, device)
    assert any(key[0] == "topk_select" and key[2] is True for key in cute_backend._compiled)


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
    # test_schema compares inputs with arithmetic torch lacks for e4m3 on CUDA; the fake test covers the op
    torch.library.opcheck(
        torch.ops.indexer.page_scores_sm90,
        (q, k, wrapper.scores, metadata[2], plan.descriptors, plan.num_tasks, 2, plan.shape.tile_rows, False),
        test_utils=("test_faketensor",),
    )
    out = torch.empty(case.total_q * 2, 16, dtype=torch.int32, device=device)
    torch.library.opcheck(
        torch.ops.indexer.topk_select16, (wrapper.scores, wrapper.num_valid_pages, out),
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
