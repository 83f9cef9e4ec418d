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
@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_scores_match_the_exact_reference_within_the_fp8_bound(num_heads):
    case = make_case([(700, 9000), (64, 20000), (1, 129), (300, 300), (129, 4000)], num_heads=num_heads, seed=num_heads)
    results, _, _ = run_both(case, num_heads, pitch_extra=37)
    (_, exact), (wrapper, kernel) = results["torch"], results["cute"]
    assert wrapper.active_backend == "cute"
    written = ~exact.isnan()
    assert torch.equal(written, ~kernel.isnan()), "the kernel must write exactly the columns p < L"
    bound = magnitude_bound(case, num_heads, exact.device)
    cols = bound.shape[1]
    error = (kernel[:, :cols] - exact[:, :cols]).abs()[written[:, :cols]]
    allowed = (FP8_RELATIVE_BOUND * bound)[written[:, :cols]] + 1e-6
    ratio = (error / bound[written[:, :cols]].clamp(min=1e-6)).max().item()
    print(f"H={num_heads}: max |err| {error.max().item():.3e}, max err / sum|qk| {ratio:.3e}")
    assert bool((error <= allowed).all()), f"max error ratio {ratio}"


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
def test_selection_from_kernel_scores_passes_the_gate_mostly():
    case = make_case([(2000, 30000), (300, 12000)], num_heads=4, seed=7)
    results, _, _ = run_both(case, 4)
    (torch_wrapper, exact), (_, kernel) = results["torch"], results["cute"]
    cols = case.block_table.shape[1]
    valid = torch_wrapper.num_valid_pages
    selection = topk_select(kernel[:, :cols], valid)
    reference = topk_select(exact[:, :cols], valid)
    passed = selection_gate(selection, exact[:, :cols], valid)
    identical = (selection == reference).all(dim=1)
    print(f"rows {valid.numel()}: identical {identical.float().mean().item():.4f}, gate {passed.float().mean().item():.4f}")
    assert passed.float().mean().item() > 0.95


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
