"""The SM90 kernels on MiniMax's 128 production cases (H = 1, 2, 4) against the exact reference.

All 384 tests passed on the H200 on 2026-11-30 (docs/PERFORMANCE.md, session 2).
Inputs are drawn as in the MSA harness; per case and H: the FP8 kernel within its documented bound, the exact kernel
within atol = rtol = 2e-4, exactly the columns p < L written into a NaN-prefilled buffer, and the GPU top-k equal
to the torch top-k on the same scores.
"""

import pytest
import torch

from indexer import BatchPrefillIndexerQ8KV8Wrapper, topk_select
from indexer.bench import load_cases, make_inputs, sequence_lengths

pytestmark = pytest.mark.gpu

FP8_RELATIVE_BOUND = 2.0**-9
CASES = load_cases(quick=False)


def sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def scores_of(backend, precision, inputs, bounds, num_heads, magnitude=False):
    q, k, cu, seq_lens, block_table = inputs
    if magnitude:
        q, k, precision = q.float().abs().to(torch.bfloat16), k.float().abs().to(torch.bfloat16), "auto"
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(num_heads, backend=backend, precision=precision)
    rows = bounds["total_q"] * num_heads
    pages = -(-bounds["max_seqlen_k"] // 128)
    out = torch.full((rows, pages), float("nan"), device=q.device)
    wrapper.plan(cu, seq_lens, block_table, **bounds, score_out=out)
    wrapper.run_scores(q, k)
    return wrapper, out


@pytest.mark.skipif(not sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("case", CASES, ids=[c["case_id"][-8:] for c in CASES])
def test_production_case(case, num_heads):
    lengths = sequence_lengths(case)
    generator = torch.Generator().manual_seed(int(case["case_id"][-8:], 16))
    inputs = make_inputs(lengths, num_heads, torch.device("cuda"), generator)
    bounds = dict(total_q=case["total_q"], max_seqlen_q=max(q for q, _ in lengths), max_seqlen_k=max(kv for _, kv in lengths))
    reference_wrapper, exact = scores_of("torch", "auto", inputs, bounds, num_heads)
    written = ~exact.isnan()
    _, fp8 = scores_of("cute", "fp8", inputs, bounds, num_heads)
    _, exact_kernel = scores_of("cute", "exact", inputs, bounds, num_heads)
    assert torch.equal(written, ~fp8.isnan()) and torch.equal(written, ~exact_kernel.isnan())
    torch.testing.assert_close(exact_kernel[written], exact[written], atol=2e-4, rtol=2e-4)
    _, magnitude = scores_of("torch", "auto", inputs, bounds, num_heads, magnitude=True)
    assert bool(((fp8 - exact).abs()[written] <= FP8_RELATIVE_BOUND * magnitude[written] + 1e-6).all())
    valid = reference_wrapper.num_valid_pages
    for buffer in (fp8, exact_kernel):
        assert torch.equal(topk_select(buffer, valid), topk_select(buffer, valid, backend="torch"))
