"""Every invalid argument raises a clear TypeError/ValueError naming it, before anything is written."""

import pytest
import torch

from indexer import BatchPrefillIndexerQ8KV8Wrapper, topk_select
from indexer.wrapper import PlanRequiredError
from cases import make_case

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def case():
    return make_case([(100, 2000), (30, 900)], num_heads=2, seed=0, extra_columns=2)


def planned(case, **kwargs):
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    wrapper.plan(*case.metadata(), **case.plan_kwargs(), **kwargs)
    return wrapper


def misaligned(tensor: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """The same values at a storage offset of ``offset_bytes`` (for 1-byte dtypes)."""
    flat = torch.empty(tensor.numel() + 64, dtype=torch.uint8)
    start = (-flat.data_ptr()) % 16 + offset_bytes
    view = flat[start : start + tensor.numel()].view(tensor.dtype).view(tensor.shape)
    view.copy_(tensor)
    return view


# ------------------------------------------------------------------ constructor
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_heads=1.0), TypeError, "num_heads"),
        (dict(num_heads=True), TypeError, "num_heads"),
        (dict(num_heads=0), ValueError, "num_heads"),
        (dict(backend="triton"), ValueError, "backend"),
        (dict(precision="fp16"), ValueError, "precision"),
        (dict(page_size=0), ValueError, "page_size"),
        (dict(topk=0), ValueError, "topk"),
        (dict(num_heads=3, backend="cute"), ValueError, "num_heads"),
        (dict(backend="cute", page_size=64), ValueError, "page_size"),
    ],
)
def test_constructor_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        BatchPrefillIndexerQ8KV8Wrapper(**kwargs)


def test_cute_backend_refuses_a_cpu_plan(case):
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="cute")
    with pytest.raises(RuntimeError, match="backend='cute' cannot serve .* CUDA device"):
        wrapper.plan(*case.metadata(), **case.plan_kwargs())


# ------------------------------------------------------------------ plan
def _plan_call(case, **overrides):
    cu, seq_lens, block_table = case.metadata()
    args = dict(cu_seqlens_q=cu, seq_lens=seq_lens, block_table=block_table, **case.plan_kwargs())
    args.update(overrides)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    wrapper.plan(
        args.pop("cu_seqlens_q"), args.pop("seq_lens"), args.pop("block_table"), **args
    )


@pytest.mark.parametrize(
    "override, error, match",
    [
        (lambda c: dict(total_q=float(c.total_q)), TypeError, "total_q"),
        (lambda c: dict(total_q=0), ValueError, "total_q"),
        (lambda c: dict(max_seqlen_q=0), ValueError, "max_seqlen_q"),
        (lambda c: dict(max_seqlen_k=0), ValueError, "max_seqlen_k"),
        (lambda c: dict(max_seqlen_k=50, max_seqlen_q=100), ValueError, "max_seqlen_k .* >= max_seqlen_q"),
        (lambda c: dict(validate=1), TypeError, "validate"),
        (lambda c: dict(cu_seqlens_q=c.cu_seqlens_q.tolist()), TypeError, "cu_seqlens_q must be a torch.Tensor"),
        (lambda c: dict(cu_seqlens_q=c.cu_seqlens_q.long()), TypeError, "cu_seqlens_q must have dtype torch.int32"),
        (lambda c: dict(cu_seqlens_q=c.cu_seqlens_q[None]), ValueError, "cu_seqlens_q must be 1-D"),
        (lambda c: dict(cu_seqlens_q=c.cu_seqlens_q[:1]), ValueError, "cu_seqlens_q must have B \\+ 1 >= 2"),
        (lambda c: dict(cu_seqlens_q=torch.zeros(6, dtype=torch.int32)[::2]), ValueError, "cu_seqlens_q must have stride 1"),
        (lambda c: dict(seq_lens=c.seq_lens.float()), TypeError, "seq_lens must have dtype"),
        (lambda c: dict(seq_lens=c.seq_lens[:1]), ValueError, "seq_lens must have shape \\[2\\]"),
        (lambda c: dict(seq_lens=c.seq_lens.to("meta")), ValueError, "seq_lens must be on cpu"),
        (lambda c: dict(block_table=c.block_table[0]), ValueError, "block_table must be 2-D"),
        (lambda c: dict(block_table=c.block_table[:1]), ValueError, "block_table must have 2 rows"),
        (lambda c: dict(block_table=c.block_table.long()), TypeError, "block_table must have dtype"),
        (lambda c: dict(block_table=c.block_table.t().contiguous().t()), ValueError, "block_table must have stride\\(1\\) == 1"),
        (lambda c: dict(block_table=c.block_table[:, :5]), ValueError, "block_table capacity is smaller"),
        (lambda c: dict(block_table=c.block_table.to("meta")), ValueError, "block_table must be on cpu"),
        (lambda c: dict(max_seqlen_k=65536 * 128 + 1), ValueError, "65536"),
        (lambda c: dict(request_lengths=[(100, 2000)]), ValueError, "request_lengths must have 2 .* pairs"),
        (lambda c: dict(request_lengths=[(100, 2000), (30,)]), ValueError, "request_lengths\\[1\\] must be a .* pair"),
        (lambda c: dict(request_lengths=[(100, 2000), (30, 20)]), ValueError, "request_lengths\\[1\\] = \\(30, 20\\)"),
        (lambda c: dict(request_lengths=[(100, 4000), (30, 900)]), ValueError, "context <= max_seqlen_k"),
        (lambda c: dict(request_lengths=[(100, 2000), (30, 900)], total_q=120, max_seqlen_q=100), ValueError,
         "130 query tokens, more than total_q = 120"),
        (lambda c: dict(request_lengths=torch.tensor([[100, 2000], [30, 900]], device="meta")), ValueError,
         "request_lengths must be host ints"),
    ],
)
def test_plan_rejects(case, override, error, match):
    with pytest.raises(error, match=match):
        _plan_call(case, **override(case))


@pytest.mark.parametrize(
    "make_score_out, error, match",
    [
        (lambda rows, cols: torch.zeros(rows, cols, dtype=torch.float64), TypeError, "score_out must have dtype torch.float32"),
        (lambda rows, cols: torch.zeros(rows, cols, device="meta"), ValueError, "score_out must be on cpu"),
        (lambda rows, cols: torch.zeros(rows + 1, cols), ValueError, "score_out must have shape"),
        (lambda rows, cols: torch.zeros(rows, cols - 1), ValueError, "score_out must have shape"),
        (lambda rows, cols: torch.zeros(rows * cols), ValueError, "score_out must be 2-D"),
        (lambda rows, cols: torch.zeros(cols, rows).t(), ValueError, "stride\\(1\\) == 1"),
        (lambda rows, cols: torch.zeros(rows * cols).as_strided((rows, cols), (cols - 1, 1)), ValueError, "rows must not overlap"),
    ],
)
def test_plan_rejects_bad_score_out(case, make_score_out, error, match):
    rows, cols = case.total_q * 2, -(-case.max_seqlen_k // 128)
    with pytest.raises(error, match=match):
        _plan_call(case, score_out=make_score_out(rows, cols))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda cu, sl: cu.__setitem__(2, cu[2] - 1), "cu_seqlens_q\\[-1\\] must equal total_q"),
        (lambda cu, sl: cu.__setitem__(1, 200), "non-decreasing"),
        (lambda cu, sl: sl.__setitem__(0, 50), "seq_lens\\[b\\] must be >= its query length"),
    ],
)
def test_validate_checks_device_metadata(case, mutate, match):
    cu, seq_lens, block_table = (t.clone() for t in case.metadata())
    mutate(cu, seq_lens)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    with pytest.raises(ValueError, match=match):
        wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs(), validate=True)
    with pytest.raises(PlanRequiredError):
        wrapper.run(case.q, case.k_cache)  # the failed plan left no state behind


def test_validate_checks_query_bound(case):
    with pytest.raises(ValueError, match="max_seqlen_q"):
        _plan_call(case, max_seqlen_q=50, validate=True)


def test_failed_plan_keeps_the_previous_plan(case):
    wrapper = planned(case)
    expected = wrapper.run(case.q, case.k_cache).clone()
    with pytest.raises(ValueError):
        wrapper.plan(*case.metadata(), **case.plan_kwargs(), score_out=torch.zeros(3, 3))
    assert torch.equal(wrapper.run(case.q, case.k_cache), expected)


# ------------------------------------------------------------------ run
@pytest.mark.parametrize("method", ["run", "run_scores", "replan", "num_valid_pages", "scores", "task_plan"])
def test_use_before_plan(case, method):
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    with pytest.raises(PlanRequiredError, match="plan\\(\\) first"):
        attribute = getattr(wrapper, method)
        if callable(attribute):
            attribute(case.q, case.k_cache) if method.startswith("run") else attribute()
    with pytest.raises(ValueError):  # a call-order error is also a ValueError
        wrapper.run(case.q, case.k_cache)


@pytest.mark.parametrize(
    "make_q, error, match",
    [
        (lambda q: q.to(torch.int8), TypeError, "q must have dtype"),
        (lambda q: q[:-1], ValueError, "q must have shape \\[total_q=130"),
        (lambda q: q[:, :1], ValueError, "q must have shape"),
        (lambda q: q.reshape(130, 256), ValueError, "q must be 3-D"),
        (lambda q: q.transpose(0, 1).contiguous().transpose(0, 1), ValueError, "q must be contiguous"),
        (lambda q: misaligned(q, 4), ValueError, "q must be 16-byte aligned"),
        (lambda q: q.to("meta"), ValueError, "q must be on cpu"),
        (lambda q: [q], TypeError, "q must be a torch.Tensor"),
    ],
)
def test_run_rejects_bad_q(case, make_q, error, match):
    wrapper = planned(case)
    with pytest.raises(error, match=match):
        wrapper.run(make_q(case.q), case.k_cache)


@pytest.mark.parametrize(
    "make_k, error, match",
    [
        (lambda k: k.to(torch.bfloat16), TypeError, "k_cache must have dtype torch.float8_e4m3fn"),
        (lambda k: k[None], ValueError, "k_cache as 4-D must be"),
        (lambda k: k.reshape(-1, 128 * 128), ValueError, "k_cache must be \\[num_pages"),
        (lambda k: k.reshape(-1, 64, 128), ValueError, "page_size=128"),
        (lambda k: k[:, :, :64], ValueError, "head_dim=128"),
        (lambda k: k.transpose(1, 2), ValueError, "each k_cache page must be contiguous"),
        (lambda k: torch.cat([k.view(k.shape[0], -1), k.view(k.shape[0], -1)[:, :8]], 1)[:, : 128 * 128].view(-1, 128, 128), ValueError, "multiple of 16 bytes"),
        (lambda k: misaligned(k, 8), ValueError, "k_cache must be 16-byte aligned"),
        (lambda k: k.to("meta"), ValueError, "k_cache must be on cpu"),
    ],
)
def test_run_rejects_bad_k_cache(case, make_k, error, match):
    wrapper = planned(case)
    with pytest.raises(error, match=match):
        wrapper.run(case.q, make_k(case.k_cache))


@pytest.mark.parametrize(
    "make_out, error, match",
    [
        (lambda: torch.empty(130, 2, 16, dtype=torch.int64), TypeError, "out must have dtype torch.int32"),
        (lambda: torch.empty(130, 2, 15, dtype=torch.int32), ValueError, "out must have shape \\[130, 2, 16\\]"),
        (lambda: torch.empty(130 * 2, 16, dtype=torch.int32), ValueError, "out must be 3-D"),
        (lambda: torch.empty(16, 2, 130, dtype=torch.int32).transpose(0, 2), ValueError, "out must be contiguous"),
        (lambda: torch.empty(130, 2, 16, dtype=torch.int32, device="meta"), ValueError, "out must be on cpu"),
    ],
)
def test_run_rejects_bad_out(case, make_out, error, match):
    wrapper = planned(case)
    with pytest.raises(error, match=match):
        wrapper.run(case.q, case.k_cache, out=make_out())


def test_nothing_is_written_before_validation(case):
    score_out = torch.full((case.total_q * 2, case.block_table.shape[1]), 7.0)
    wrapper = planned(case, score_out=score_out)
    out = torch.full((case.total_q, 2, 16), -5, dtype=torch.int32)
    with pytest.raises(ValueError):
        wrapper.run(case.q[:-1], case.k_cache, out=out)
    with pytest.raises(ValueError):
        wrapper.run(case.q, case.k_cache, out=out[:, :1])
    with pytest.raises(TypeError):
        wrapper.run_scores(case.q, case.k_cache.to(torch.bfloat16))
    assert bool((score_out == 7.0).all()) and bool((out == -5).all())


def test_validate_checks_page_ids_and_finiteness(case):
    block_table = case.block_table.clone()
    block_table[1, 3] = case.k_cache.shape[0]
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    wrapper.plan(case.cu_seqlens_q, case.seq_lens, block_table, **case.plan_kwargs(), validate=True)
    with pytest.raises(ValueError, match="block_table\\[1, 3\\]"):
        wrapper.run(case.q, case.k_cache)
    wrapper = planned(case, validate=True)
    bad_q = case.q.clone()
    bad_q.view(torch.uint8)[5, 1, 7] = 0x7F  # e4m3 NaN
    with pytest.raises(ValueError, match="q must be finite"):
        wrapper.run(bad_q, case.k_cache)


# ------------------------------------------------------------------ topk_select
@pytest.mark.parametrize(
    "scores, valid, kwargs, error, match",
    [
        (torch.zeros(4, 8, dtype=torch.float64), torch.ones(4, dtype=torch.int32), {}, TypeError, "scores must have dtype"),
        (torch.zeros(4, 8, 1), torch.ones(4, dtype=torch.int32), {}, ValueError, "scores must be 2-D"),
        (torch.zeros(8, 4).t(), torch.ones(4, dtype=torch.int32), {}, ValueError, "scores must have stride\\(1\\) == 1"),
        (torch.zeros(40).as_strided((4, 8), (4, 1)), torch.ones(4, dtype=torch.int32), {}, ValueError, "rows must not overlap"),
        (torch.zeros(4, 8), torch.ones(4, dtype=torch.int64), {}, TypeError, "num_valid_pages must have dtype"),
        (torch.zeros(4, 8), torch.ones(3, dtype=torch.int32), {}, ValueError, "num_valid_pages must have shape \\[4\\]"),
        (torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32), {}, ValueError, "num_valid_pages must lie in \\[1, 9\\]"),
        (torch.zeros(4, 8), torch.full((4,), 10, dtype=torch.int32), {}, ValueError, "num_valid_pages must lie in"),
        (torch.zeros(4, 8), torch.ones(4, dtype=torch.int32), dict(topk=0), ValueError, "topk"),
        (torch.zeros(4, 8), torch.ones(4, dtype=torch.int32), dict(out=torch.empty(4, 15, dtype=torch.int32)), ValueError, "out must have shape \\[4, 16\\]"),
        (torch.zeros(4, 8), torch.ones(4, dtype=torch.int32), dict(out=torch.empty(4, 16)), TypeError, "out must have dtype"),
        (torch.zeros(1, 65536), torch.ones(1, dtype=torch.int32), {}, ValueError, "at most 65535 history columns"),
    ],
)
def test_topk_select_rejects(scores, valid, kwargs, error, match):
    with pytest.raises(error, match=match):
        topk_select(scores, valid, **kwargs)


def test_kernels_are_registered_as_custom_ops_with_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import indexer.ops  # noqa: F401  (registers the ops)

    assert hasattr(torch.ops.indexer, "page_scores_sm90") and hasattr(torch.ops.indexer, "topk_select16")
    with FakeTensorMode():
        scores = torch.empty(8, 4)
        out = torch.empty(8, 16, dtype=torch.int32)
        errors = torch.zeros(3, dtype=torch.int32)
        assert torch.ops.indexer.topk_select16(scores, torch.ones(8, dtype=torch.int32), out, errors, 1) is None
        q = torch.empty(4, 2, 128, dtype=torch.float8_e4m3fn)
        k = torch.empty(3, 128, 128, dtype=torch.float8_e4m3fn)
        table = torch.zeros(1, 3, dtype=torch.int32)
        descriptors = torch.zeros(1, 4, dtype=torch.int32)
        assert torch.ops.indexer.page_scores_sm90(q, k, scores, table, descriptors, torch.zeros(1, dtype=torch.int32),
                                                  errors, 2, False, True, 132) is None
