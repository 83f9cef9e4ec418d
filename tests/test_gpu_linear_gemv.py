"""The decode step's weight-streaming GEMV (``minimax_m3.linear_gemv``) against an fp32 reference and ``F.linear``,
into NaN-guarded buffers, eagerly and replayed in a CUDA graph, and the model's projections through it."""

import pytest
import torch

from minimax_m3.linear_gemv import linear, linear_gemv, linear_gemv_serves, max_depth, project

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs SM90"),
]


def _operands(tokens, columns, depth, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    # x as rows of a wider NaN-guarded buffer (a row stride beyond K), the weight between NaN rows
    x_guarded = torch.full((tokens + 2, depth + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = x_guarded[1:-1, 32:32 + depth]
    x.copy_(torch.randn(tokens, depth, generator=generator, device="cuda"))
    w_guarded = torch.full((columns + 2, depth), float("nan"), device="cuda", dtype=torch.bfloat16)
    weight = w_guarded[1:-1]
    weight.copy_(torch.randn(columns, depth, generator=generator, device="cuda") * depth ** -0.5)
    return x, weight


@pytest.mark.parametrize("columns, depth", [
    (9216, 6144),  # M3's packed q/k/v
    (6144, 8192),  # its o_proj
    (640, 6144),  # the packed index q/k: fewer rows per CTA than a group
    (133, 256),  # odd rows, one vector per thread for a few threads only
    (1, 8),  # one row, one vector: one CTA
    (200, 3072),  # a width that leaves threads without a vector
])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_linear_gemv_matches_fp32_and_f_linear_and_writes_nothing_else(tokens, columns, depth):
    x, weight = _operands(tokens, columns, depth, seed=tokens * 7919 + columns + depth)
    target = torch.full((tokens + 2, columns + 16), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = linear_gemv(x, weight, out=target[1:-1, 8:8 + columns])
    expected = x.float() @ weight.float().T
    assert not out.isnan().any()
    assert target[0].isnan().all() and target[-1].isnan().all()
    assert target[:, :8].isnan().all() and target[:, 8 + columns:].isnan().all()
    # fp32 sums in another order than the reference: within one bf16 rounding of it
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=1e-4)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("tokens", [1, 2])
def test_linear_gemv_takes_its_widest_inputs(tokens):
    depth = max_depth(tokens)
    x, weight = _operands(tokens, 300, depth, seed=depth)
    out = linear_gemv(x, weight)
    torch.testing.assert_close(out.float(), x.float() @ weight.float().T, rtol=2 ** -7, atol=1e-4)
    assert not linear_gemv_serves(torch.empty(tokens, depth + 8, device="cuda", dtype=torch.bfloat16),
                                  torch.empty(4, depth + 8, device="cuda", dtype=torch.bfloat16))


def test_linear_gemv_replays_in_a_cuda_graph_as_it_runs_eagerly():
    x, weight = _operands(4, 6144, 8192, seed=3)
    eager = linear_gemv(x, weight)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear_gemv(x, weight, out=out)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        torch.testing.assert_close(out, linear_gemv(x, weight), rtol=0, atol=0)  # the same kernel, bit for bit


def test_linear_and_project_take_the_gemv_for_decode_rows_and_f_linear_otherwise():
    module = torch.nn.Linear(6144, 1000, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        decode = torch.randn(2, 1, 6144, device="cuda", dtype=torch.bfloat16)
        out = project(module, decode)
        assert out.shape == (2, 1, 1000)
        assert torch.equal(out.view(2, 1000), linear_gemv(decode.view(2, 6144), module.weight))
        prefill = torch.randn(9, 6144, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(linear(prefill, module.weight), torch.nn.functional.linear(prefill, module.weight))
    # a gradient to record keeps the module call
    decode.requires_grad_(True)
    assert project(module, decode).requires_grad
