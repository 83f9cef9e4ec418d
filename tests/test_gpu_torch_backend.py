"""The torch backend and planner on a CUDA device: bitwise equal to the CPU, no host syncs in plan()."""

import pytest
import torch

from indexer import BatchPrefillIndexerQ8KV8Wrapper, topk_select
from cases import make_case

pytestmark = pytest.mark.gpu


def run_on(device, case, num_heads, score_pitch_extra=0):
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend="torch")
    metadata = [t.to(device) for t in case.metadata()]
    rows = case.total_q * num_heads
    cols = case.block_table.shape[1]
    base = torch.full((rows, cols + score_pitch_extra), float("nan"), device=device)
    wrapper.plan(*metadata, **case.plan_kwargs(), score_out=base[:, :cols], validate=True)
    selection = wrapper.run(case.q.to(device), case.k_cache.to(device))
    return wrapper, selection.cpu(), base.cpu()


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_cuda_matches_cpu_bitwise(num_heads):
    case = make_case([(700, 9000), (64, 20000), (1, 129), (300, 300)], num_heads=num_heads, seed=num_heads)
    cpu_wrapper, cpu_selection, cpu_scores = run_on(torch.device("cpu"), case, num_heads, 13)
    gpu_wrapper, gpu_selection, gpu_scores = run_on(torch.device("cuda"), case, num_heads, 13)
    assert torch.equal(cpu_wrapper.num_valid_pages, gpu_wrapper.num_valid_pages.cpu())
    assert torch.equal(cpu_scores.view(torch.int32), gpu_scores.view(torch.int32))  # NaN where unwritten, bit for bit
    assert torch.equal(cpu_selection, gpu_selection)
    for name in ("descriptors", "num_tasks", "errors"):
        cpu_plan, gpu_plan = cpu_wrapper.task_plan, gpu_wrapper.task_plan
        if name == "descriptors":
            count = int(cpu_plan.num_tasks[0])
            assert torch.equal(cpu_plan.descriptors[:count], gpu_plan.descriptors[:count].cpu())
        else:
            assert torch.equal(getattr(cpu_plan, name), getattr(gpu_plan, name).cpu()), name


def test_topk_select_cuda_matches_cpu_bitwise():
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(4096, 2000, generator=generator) * torch.logspace(-20, 20, 4096)[:, None]
    valid = torch.randint(1, 2001, (4096,), generator=generator, dtype=torch.int32)
    expected = topk_select(scores, valid)
    assert torch.equal(topk_select(scores.cuda(), valid.cuda(), validate=True).cpu(), expected)


def test_plan_and_replan_do_not_synchronise():
    case = make_case([(900, 40000), (3, 7000)], num_heads=4, seed=8)
    metadata = [t.cuda() for t in case.metadata()]
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(4, backend="torch")
    wrapper.plan(*metadata, **case.plan_kwargs())  # warm-up: lazy CUDA init may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        wrapper.plan(*metadata, **case.plan_kwargs())
        wrapper.replan()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_replan_is_capturable_in_a_cuda_graph():
    case = make_case([(500, 30000), (40, 9000)], num_heads=2, seed=9, extra_columns=20)
    cu, seq_lens, block_table = (t.cuda() for t in case.metadata())
    bounds = dict(total_q=case.total_q, max_seqlen_q=500, max_seqlen_k=32000)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    wrapper.plan(cu, seq_lens, block_table, **bounds)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wrapper.replan()  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.replan()
    seq_lens.add_(1500)
    wrapper.task_plan.descriptors.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    fresh = BatchPrefillIndexerQ8KV8Wrapper(2, backend="torch")
    fresh.plan(cu, seq_lens.clone(), block_table, **bounds)
    assert torch.equal(wrapper.num_valid_pages, fresh.num_valid_pages)
    assert torch.equal(wrapper.task_plan.descriptors, fresh.task_plan.descriptors)
    assert torch.equal(wrapper.task_plan.num_tasks, fresh.task_plan.num_tasks)
