"""The one-CTA plan kernel on the H200: ``build_task_plan``'s plan bit for bit (descriptors in the same order,
``num_valid_pages``, the task count and the ``PlanError`` bits) on random metadata, well-formed and corrupt, over
the plan shapes it serves; the wrapper takes it for decode steps and short chunks, and the torch ops beyond."""

import random

import pytest
import torch

from indexer import BatchPrefillIndexerQ8KV8Wrapper
from indexer import cute_backend
from indexer.contract import ErrorWord
from indexer.planner import allocate_task_plan, build_task_plan, length_bounds, plan_shape
from cases import make_case

pytestmark = pytest.mark.gpu

needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                reason="needs an SM90 GPU")


def random_metadata(rng: random.Random):
    """``(cu_seqlens_q, seq_lens, shape kwargs)``: a random batch; one in four has a corrupted offset or context."""
    batch = rng.choice([1, 1, 2, 3, 16, 64, rng.randint(1, 300)])
    num_heads = rng.choice([1, 2, 4])
    max_seqlen_q = rng.choice([1, 1, 4, 64, 300])
    max_seqlen_k = max(max_seqlen_q, rng.choice([100, 2000, 40000, 131072 + 77]))
    q_lens = [rng.randint(0, max_seqlen_q) if max_seqlen_q > 1 else 1 for _ in range(batch)]
    contexts = [q + rng.randint(0, max_seqlen_k - q) for q in q_lens]
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    total_q = max(1, cu[-1])
    if rng.random() < 0.25:
        cu[rng.randrange(batch + 1)] += rng.randint(-70, 70)
    if rng.random() < 0.25:
        contexts[rng.randrange(batch)] += rng.choice([-40, 1, 10**7])
    kwargs = dict(num_requests=batch, total_q=total_q, num_heads=num_heads, page_size=128, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k, tile_rows=rng.choice([64, 128, 256]) // num_heads * num_heads,
                  num_sms=rng.choice([132, 7]))
    return cu, contexts, kwargs


@needs_sm90
def test_the_plan_kernel_builds_the_torch_plan_bit_for_bit():
    rng = random.Random(5)
    kernel = cute_backend.compiled_kernel(cute_backend.PlanKernelKey())
    served = 0
    for trial in range(300):
        cu, contexts, kwargs = random_metadata(rng)
        shape = plan_shape(**kwargs)
        if not cute_backend.plan_kernel_serves(shape):
            continue
        served += 1
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        contexts_t = torch.tensor(contexts, dtype=torch.int32, device="cuda")
        bounds = torch.full((1,), length_bounds(shape.max_seqlen_q, shape.max_seqlen_k), dtype=torch.int64, device="cuda")
        expected = build_task_plan(cu_t, contexts_t, shape, bounds=bounds)
        got = allocate_task_plan(shape, torch.device("cuda"))
        for tensor in (got.num_valid_pages, got.descriptors, got.num_tasks):
            tensor.fill_(-123456)  # poison: every entry must be written
        got.errors.fill_(0)
        kernel(cu_t, contexts_t, bounds.view(torch.int32), got.num_valid_pages, got.descriptors, got.num_tasks,
               got.errors, shape.total_q, shape.num_heads, shape.page_size, shape.tile_tokens, shape.max_pages,
               shape.max_history_pages, shape.q_tile_capacity, shape.page_chunk, shape.num_sms)
        for name in ("num_valid_pages", "descriptors", "num_tasks", "error_flags"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (trial, name, cu, contexts, shape)
        assert not got.errors[int(ErrorWord.PLAN) + 1:].any()  # the kernels' words are not the plan's to write
    assert served > 200


@needs_sm90
@pytest.mark.parametrize("lengths, num_heads, by_kernel", [
    ([(1, 131072 - 3)], 4, True),  # a decode step over 128K
    ([(1, 4000 + 300 * i) for i in range(16)], 4, True),  # 16 sequences' decode step
    ([(2048, 126 * 1024)], 4, True),  # a chunk over a long prefix
    ([(40000, 40000)], 2, False),  # a long prefill: 80,000 score rows
])
def test_the_wrapper_takes_the_plan_kernel_where_it_serves_with_the_same_selection(lengths, num_heads, by_kernel,
                                                                                   monkeypatch):
    device = torch.device("cuda")
    case = make_case(lengths, num_heads=num_heads, seed=21)
    cu, seq_lens, block_table = (t.to(device) for t in case.metadata())
    q, k = case.q.to(device), case.k_cache.to(device)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend="cute")
    wrapper.plan(cu, seq_lens, block_table, **case.plan_kwargs())
    (state,) = wrapper._states.values()
    assert (state.plan_kernel is not None) == by_kernel
    selection = wrapper.run(q, k).clone()
    plan = {name: getattr(wrapper.task_plan, name).clone() for name in ("descriptors", "num_tasks", "num_valid_pages")}
    monkeypatch.setattr(cute_backend, "plan_kernel_serves", lambda shape: False)
    torch_ops = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend="cute")
    torch_ops.plan(cu, seq_lens, block_table, **case.plan_kwargs())
    assert next(iter(torch_ops._states.values())).plan_kernel is None
    for name, tensor in plan.items():
        assert torch.equal(getattr(torch_ops.task_plan, name), tensor), name
    assert torch.equal(torch_ops.run(q, k), selection)
    torch_ops.check_errors()
    wrapper.check_errors()
