"""The torch backend against the loop reference: scores bit for bit, num_valid_pages, selection."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from indexer import BatchPrefillIndexerQ8KV8Wrapper
from cases import make_case
from loop_reference import loop_case

SENTINEL_BITS = 0x7FC0BEEF  # a NaN with a payload: any write, even of a NaN, changes it


def sentinel_buffer(rows: int, pitch: int) -> torch.Tensor:
    return torch.full((rows, pitch), SENTINEL_BITS, dtype=torch.int32).view(torch.float32)


def check_against_loop(case, num_heads, *, topk=16, score_base=None, columns=None):
    """Run the wrapper (into ``score_base[:, :columns]`` when given) and compare with the loop reference."""
    score_out = None if score_base is None else score_base[:, :columns]
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend="torch", page_size=case.page_size, topk=topk)
    wrapper.plan(*case.metadata(), **case.plan_kwargs(), score_out=score_out, validate=True)
    before = None if score_base is None else score_base.clone()
    selection = wrapper.run(case.q, case.k_cache)
    scores, num_valid, expected_selection = loop_case(**case.loop_inputs(), topk=topk)

    assert wrapper.num_valid_pages.tolist() == num_valid
    assert selection.shape == (case.total_q, num_heads, topk)
    assert selection.view(-1, topk).tolist() == expected_selection
    buffer = wrapper.scores
    for (row, page), value in scores.items():
        got = buffer[row, page].item()
        assert np.float32(got).view(np.int32) == value.view(np.int32), (row, page, got, value)
    if before is not None:
        assert buffer.data_ptr() == score_out.data_ptr()
        written = torch.zeros(score_base.shape, dtype=torch.bool)
        for row, page in scores:
            written[row, page] = True
        # every entry the contract does not write, beyond the view's columns included, is bitwise unchanged
        untouched = ~written
        assert torch.equal(score_base.view(torch.int32)[untouched], before.view(torch.int32)[untouched])
    return wrapper


@st.composite
def batches(draw):
    num_heads = draw(st.sampled_from([1, 2, 4]))
    num_requests = draw(st.integers(1, 48))
    row_budget = 800 // num_heads
    lengths = []
    for _ in range(num_requests):
        # long contexts (> 16 pages) exercise the ranked selection, short ones the identity rows
        kv_len = draw(st.one_of(st.integers(1, 400), st.integers(1, 5000)))
        limit = max(1, min(kv_len, row_budget // num_requests))
        aligned = draw(st.booleans())
        q_len = draw(st.integers(1, limit))
        if aligned and kv_len > 128:
            prefix = (kv_len - q_len) // 128 * 128
            q_len = kv_len - prefix if kv_len - prefix <= limit else q_len
        lengths.append((q_len, kv_len))
    values = draw(st.sampled_from(["normal", "normal", "ties", "zeros"]))
    page_table = draw(st.sampled_from(["scattered", "shared"]))
    extra = draw(st.integers(0, 9))
    pitch_extra = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    return num_heads, lengths, values, page_table, extra, pitch_extra, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_torch_backend_matches_loop_reference(batch):
    num_heads, lengths, values, page_table, extra, pitch_extra, seed = batch
    case = make_case(lengths, num_heads=num_heads, seed=seed, values=values, page_table=page_table, extra_columns=extra)
    rows = case.total_q * num_heads
    max_pages = case.block_table.shape[1] - extra
    columns = max_pages + extra // 2
    wrapper = check_against_loop(case, num_heads, score_base=sentinel_buffer(rows, columns + pitch_extra), columns=columns)
    event("has ranked rows (n > 16)" if bool((wrapper.num_valid_pages > 16).any()) else "identity rows only")


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_all_zero_k_selects_first_pages_and_local(num_heads):
    case = make_case([(200, 3000), (1, 2600)], num_heads=num_heads, seed=1, values="zeros")
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend="torch")
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    selection = wrapper.run(case.q, case.k_cache).view(-1, 16)
    for row, n in enumerate(wrapper.num_valid_pages.tolist()):
        expected = list(range(15)) + [n - 1] if n > 16 else list(range(n)) + [-1] * (16 - n)
        assert selection[row].tolist() == expected


@pytest.mark.parametrize(
    "lengths",
    [
        [(1000, 1000)],  # no prefix
        [(127, 127), (128, 128), (129, 129), (1, 1), (1, 2), (256, 256)],  # page boundaries without prefix
        [(127, 128), (128, 256), (129, 384), (1, 129), (1, 384), (256, 639)],  # prefixes 1, 128, 255, 128, 383, 383
        [(300, 2000), (5, 1025), (64, 1089)],  # unaligned prefixes
    ],
)
@pytest.mark.parametrize("num_heads", [1, 4])
def test_hand_written_page_boundary_cases(lengths, num_heads):
    case = make_case(lengths, num_heads=num_heads, seed=len(lengths))
    check_against_loop(case, num_heads)


def test_batch_of_48_with_shared_pages():
    lengths = [(3 + i % 7, 130 + 37 * i) for i in range(48)]
    case = make_case(lengths, num_heads=2, seed=48, page_table="shared")
    check_against_loop(case, 2)


def test_other_page_size_head_dim_and_topk():
    case = make_case([(40, 300), (17, 100)], num_heads=3, seed=5, page_size=16, head_dim=64)
    check_against_loop(case, 3, topk=4)


def test_four_dimensional_k_cache_view_and_padded_page_stride():
    case = make_case([(50, 900), (20, 700)], num_heads=2, seed=9)
    padded = torch.zeros(case.k_cache.shape[0], 1, 128 * 128 + 64, dtype=torch.uint8)
    padded[:, 0, : 128 * 128] = case.k_cache.view(torch.uint8).reshape(case.k_cache.shape[0], -1)
    k_view = padded[:, :, : 128 * 128].view(torch.float8_e4m3fn).view(case.k_cache.shape[0], 1, 128, 128)
    assert k_view.stride(0) == 128 * 128 + 64
    reference = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    reference.plan(*case.metadata(), **case.plan_kwargs())
    expected = reference.run(case.q, case.k_cache).clone()
    expected_scores = reference.scores.clone()
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    assert torch.equal(wrapper.run(case.q, k_view), expected)
    valid = torch.arange(expected_scores.shape[1])[None, :] < (wrapper.num_valid_pages[:, None] - 1)
    assert torch.equal(wrapper.scores[valid], expected_scores[valid])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wider_dtypes_accumulate_in_fp32(dtype):
    case = make_case([(70, 700), (9, 400)], num_heads=2, seed=2, dtype=dtype)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    wrapper.run_scores(case.q, case.k_cache)
    scores, num_valid, _ = loop_case(**case.loop_inputs(), topk=16)
    for (row, page), value in scores.items():
        assert wrapper.scores[row, page].item() == pytest.approx(float(value), rel=1e-5, abs=1e-5)


def test_chunking_does_not_change_results():
    from indexer.torch_backend import compute_page_scores, read_host_metadata

    case = make_case([(600, 3000), (300, 1900)], num_heads=2, seed=12)
    host = read_host_metadata(case.cu_seqlens_q, case.seq_lens)
    rows = case.total_q * 2
    results = []
    for chunk_elements in (1, 128 * 128 * 3, 1 << 24):
        out = torch.full((rows, case.block_table.shape[1]), float("nan"))
        compute_page_scores(case.q, case.k_cache, case.block_table, host, out, page_size=128, chunk_elements=chunk_elements)
        results.append(out)
    for other in results[1:]:
        assert torch.equal(results[0].isnan(), other.isnan())
        assert torch.equal(results[0].nan_to_num(), other.nan_to_num())


def test_plan_reused_by_layers_and_replan_after_in_place_update():
    case = make_case([(100, 3900), (60, 3300)], num_heads=1, seed=21, extra_columns=1)
    cu, final_seq_lens, block_table = case.metadata()
    seq_lens = final_seq_lens - 400  # the same queries, 400 tokens earlier in their contexts
    bounds = dict(total_q=case.total_q, max_seqlen_q=200, max_seqlen_k=4000)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(1, backend="torch")
    wrapper.plan(cu, seq_lens, block_table, **bounds)
    layer_two_q = (case.q.float() * -1).to(torch.float8_e4m3fn)
    first = wrapper.run(case.q, case.k_cache).clone()
    second = wrapper.run(layer_two_q, case.k_cache).clone()
    fresh = BatchPrefillIndexerQ8KV8Wrapper(1, backend="torch")
    fresh.plan(cu, seq_lens.clone(), block_table, **bounds)
    assert torch.equal(first, fresh.run(case.q, case.k_cache))
    assert torch.equal(second, fresh.run(layer_two_q, case.k_cache))
    assert not torch.equal(first, second)

    seq_lens += 400
    wrapper.replan()
    check = BatchPrefillIndexerQ8KV8Wrapper(1, backend="torch")
    check.plan(cu, final_seq_lens, block_table, **bounds)
    assert torch.equal(wrapper.num_valid_pages, check.num_valid_pages)
    assert torch.equal(wrapper.task_plan.descriptors, check.task_plan.descriptors)
    assert torch.equal(wrapper.run(case.q, case.k_cache), check.run(case.q, case.k_cache))


def test_head_isolation():
    case = make_case([(90, 4000)], num_heads=4, seed=31)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(4, backend="torch")
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    base = wrapper.run(case.q, case.k_cache).clone()
    flipped = case.q.float().clone()
    flipped[:, 0] *= -1
    changed = wrapper.run(flipped.to(torch.float8_e4m3fn), case.k_cache)
    assert torch.equal(changed[:, 1:], base[:, 1:])
    assert not torch.equal(changed[:, 0], base[:, 0])


@pytest.mark.parametrize("max_seqlen_k", [128 * 9, 128 * 12, 128 * 12 + 1])
def test_own_score_buffer_has_a_pitch_of_whole_16_byte_units(max_seqlen_k):
    """Without ``score_out`` the wrapper's buffer is ``[rows, max_pages]`` with its row pitch rounded up to a
    multiple of 4 floats (what lets the SM90 kernel write whole blocks by TMA), and the scores stay exact."""
    from indexer import score_row_pitch

    case = make_case([(40, max_seqlen_k), (3, 700)], num_heads=2, seed=5)
    wrapper = check_against_loop(case, 2)
    pages = -(-max_seqlen_k // 128)
    assert wrapper.scores.shape == (case.total_q * 2, pages)
    assert wrapper.scores.stride() == (score_row_pitch(pages), 1) and score_row_pitch(pages) % 4 == 0
    assert score_row_pitch(pages) - pages in range(4)
