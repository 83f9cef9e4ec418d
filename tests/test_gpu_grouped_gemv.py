"""The decode step's grouped GEMV kernel (experts and router) against fp32 / float64 references, transformers'\ngrouped GEMM and the router module."""

import pytest
import torch
from transformers.integrations.moe import _grouped_mm

from minimax_m3 import experts as experts_module
from minimax_m3.experts import grouped_gemv, router_logits, routing_plan_by_counting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs SM90"),
]


def reference(rows, weights, offsets):
    """fp32 products of each row with its expert's weight."""
    ends = offsets.long().tolist()
    out = torch.empty(rows.shape[0], weights.shape[1], dtype=torch.float32, device=rows.device)
    begin = 0
    for expert, end in enumerate(ends):
        if end > begin:
            out[begin:end] = rows[begin:end].float() @ weights[expert].float().T
        begin = end
    return out


@pytest.mark.parametrize("experts, columns, depth, counts", [
    (4, 512, 6144, [1, 0, 2, 5]),  # the presets' gate_up (K split): an empty expert, one of more rows than a pass
    (4, 6144, 256, [2, 2, 2, 2]),  # their down projection (one warp per column group)
    (128, 6144, 3072, None),  # M3's down projection, 16 random pairs over 128 experts (several ballot chunks)
    (40, 1000, 136, [0] * 33 + [1, 3, 0, 9, 1, 0, 1]),  # widths that fill no CTA's columns evenly
    (6, 1000, 1032, [0, 3, 1, 0, 4, 1]),  # K split with a last round of one vector, odd column blocks
])
def test_grouped_gemv_matches_the_fp32_reference_and_writes_nothing_else(experts, columns, depth, counts):
    generator = torch.Generator(device="cuda").manual_seed(experts + columns)
    if counts is None:
        ids = torch.randint(0, experts, (4, 4), generator=generator, device="cuda")
        _, offsets, _ = routing_plan_by_counting(ids, experts)
    else:
        offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    pairs = int(offsets[-1])
    weights = torch.randn(experts, columns, depth, generator=generator, device="cuda").to(torch.bfloat16)
    guarded = torch.full((pairs + 2, depth), float("nan"), device="cuda", dtype=torch.bfloat16)
    rows = guarded[1:-1]
    rows.copy_(torch.randn(pairs, depth, generator=generator, device="cuda"))
    target = torch.full((pairs + 2, columns), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = grouped_gemv(rows, weights, offsets, out=target[1:-1])
    expected = reference(rows, weights, offsets)
    assert out.shape == (pairs, columns) and out.dtype == torch.bfloat16
    assert not out.isnan().any() and target[0].isnan().all() and target[-1].isnan().all()
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2 * depth ** 0.5)
    if pairs:
        grouped = _grouped_mm(rows, weights.transpose(-2, -1), offsets)
        torch.testing.assert_close(out.float(), grouped.float(), rtol=1e-2, atol=1e-2 * depth ** 0.5)


@pytest.mark.parametrize("experts, columns, depth, tokens, top_k", [
    (4, 512, 6144, 4, 2),  # the presets' gate_up (K split) at batch 4
    (128, 6144, 6144, 4, 4),  # M3's gate_up at batch 4, 16 pairs over 128 experts
    (8, 1000, 136, 3, 3),  # one warp per column group, widths that fill no CTA's columns evenly
])
def test_the_gemv_reads_rows_through_a_row_index_as_the_gathered_rows(experts, columns, depth, tokens, top_k):
    generator = torch.Generator(device="cuda").manual_seed(experts + depth)
    ids = torch.stack([torch.randperm(experts, generator=generator, device="cuda")[:top_k] for _ in range(tokens)])
    token_of_row, offsets, _ = routing_plan_by_counting(ids, experts)
    weights = torch.randn(experts, columns, depth, generator=generator, device="cuda").to(torch.bfloat16)
    guarded = torch.full((tokens + 2, depth), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = guarded[1:-1]
    x.copy_(torch.randn(tokens, depth, generator=generator, device="cuda"))
    target = torch.full((token_of_row.shape[0] + 2, columns), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = grouped_gemv(x, weights, offsets, out=target[1:-1], row_index=token_of_row)
    gathered = x[token_of_row]
    assert not out.isnan().any() and target[0].isnan().all() and target[-1].isnan().all()
    torch.testing.assert_close(out.float(), reference(gathered, weights, offsets), rtol=1e-2, atol=1e-2 * depth ** 0.5)
    assert torch.equal(out, grouped_gemv(gathered, weights, offsets))  # the same sums in the same order


def test_a_row_index_outside_the_rows_reads_the_nearest_row():
    generator = torch.Generator(device="cuda").manual_seed(9)
    weights = torch.randn(2, 64, 128, generator=generator, device="cuda").to(torch.bfloat16)
    guarded = torch.full((5, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = guarded[1:-1]
    x.copy_(torch.randn(3, 128, generator=generator, device="cuda"))
    offsets = torch.tensor([2, 4], dtype=torch.int32, device="cuda")
    row_index = torch.tensor([-5, 1, 3, 1000], device="cuda")
    out = grouped_gemv(x, weights, offsets, row_index=row_index)
    expected = reference(x[torch.tensor([0, 1, 2, 2], device="cuda")], weights, offsets)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=0.2)


def test_inconsistent_offsets_are_clamped_and_nothing_outside_the_output_is_written():
    generator = torch.Generator(device="cuda").manual_seed(3)
    weights = torch.randn(3, 64, 128, generator=generator, device="cuda").to(torch.bfloat16)
    rows = torch.randn(4, 128, generator=generator, device="cuda").to(torch.bfloat16)
    offsets = torch.tensor([2, 1, 1000], dtype=torch.int32, device="cuda")  # not monotone, then past the rows
    target = torch.full((6, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = grouped_gemv(rows, weights, offsets, out=target[1:-1])
    # expert 0 takes rows [0, 2), expert 1 none, expert 2 rows [1, 4) (its start is the previous offset, clamped)
    products = [rows.float() @ weights[expert].float().T for expert in range(3)]
    torch.testing.assert_close(out[0].float(), products[0][0], rtol=1e-2, atol=0.2)
    torch.testing.assert_close(out[2:].float(), products[2][2:], rtol=1e-2, atol=0.2)
    assert not out.isnan().any() and target[0].isnan().all() and target[-1].isnan().all()


def test_the_experts_forward_with_the_gemv_where_it_pays_equals_the_grouped_gemm_path():
    from minimax_m3.bench_prefill import geometry_config
    from minimax_m3.modeling_minimax_m3 import MiniMaxM3Experts

    config = geometry_config(1, tiny=False)
    module = MiniMaxM3Experts(config).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(module.gate_up_proj, std=0.02)
    torch.nn.init.normal_(module.down_proj, std=0.02)
    generator = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(4, config.hidden_size, generator=generator, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(config.num_local_experts, device="cuda")[:2] for _ in range(4)])
    weights = torch.rand(4, 2, device="cuda")
    with torch.no_grad():
        gemv = experts_module.grouped_mm_experts_forward(module, hidden, ids, weights)
        limit = experts_module.GEMV_MAX_PAIRS
        try:
            experts_module.GEMV_MAX_PAIRS = 0
            grouped = experts_module.grouped_mm_experts_forward(module, hidden, ids, weights)
        finally:
            experts_module.GEMV_MAX_PAIRS = limit
    # the gated activations are rounded to bf16 between the projections, by either path
    torch.testing.assert_close(gemv.float(), grouped.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens, experts", [(1, 4), (4, 4), (3, 128), (4, 136), (2, 5)])
def test_the_router_gemv_matches_a_float64_reference_and_writes_nothing_else(tokens, experts, monkeypatch):
    generator = torch.Generator(device="cuda").manual_seed(tokens * experts)
    weight = torch.randn(experts, 6144, generator=generator, device="cuda") * 0.02
    guarded = torch.full((tokens + 2, 6144), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = guarded[1:-1]
    x.copy_(torch.randn(tokens, 6144, generator=generator, device="cuda"))
    target = torch.full((tokens + 2, experts), float("nan"), device="cuda", dtype=torch.float32)
    experts_module._gemv_kernel(x.device, "router")(x, weight.unsqueeze(0), None, target[1:-1], None)
    expected = x.double() @ weight.double().T
    assert target[0].isnan().all() and target[-1].isnan().all() and not target[1:-1].isnan().any()
    torch.testing.assert_close(target[1:-1].double(), expected, rtol=1e-5, atol=1e-5)
    gate = torch.nn.Linear(6144, experts, bias=False, device="cuda")
    gate.weight.data.copy_(weight)
    launched = []
    kernel = experts_module._gemv_kernel
    monkeypatch.setattr(experts_module, "_gemv_kernel", lambda *args: launched.append(args[1]) or kernel(*args))
    with torch.no_grad():
        torch.testing.assert_close(router_logits(gate, x).double(), expected, rtol=1e-5, atol=1e-5)
    assert launched == ["router"]


def test_more_tokens_than_a_router_pass_take_the_modules_product():
    gate = torch.nn.Linear(6144, 4, bias=False, device="cuda")
    x = torch.randn(experts_module.ROUTER_GEMV_MAX_TOKENS + 1, 6144, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(router_logits(gate, x), gate(x.float()))


def test_long_prefills_take_the_router_weights_bf16_pieces_at_fp32_accuracy(monkeypatch):
    torch.manual_seed(7)
    gate = torch.nn.Linear(6144, 128, bias=False, device="cuda")
    torch.nn.init.normal_(gate.weight, std=0.02)
    tokens = experts_module.ROUTER_PIECES_MIN_TOKENS
    x = (torch.randn(2 * tokens + 5, 6144, device="cuda") * 0.5).to(torch.bfloat16)
    by_pieces = []
    logits_by_pieces = experts_module._logits_by_pieces
    monkeypatch.setattr(experts_module, "_logits_by_pieces",
                        lambda *args: by_pieces.append(1) or logits_by_pieces(*args))
    with torch.no_grad():
        logits = router_logits(gate, x)
        sgemm = gate(x.float())
        assert torch.equal(router_logits(gate, x[: tokens - 1]), gate(x[: tokens - 1].float()))
    assert by_pieces == [1] and logits.dtype == torch.float32 and logits.shape == (2 * tokens + 5, 128)
    with torch.enable_grad():  # recording a gradient keeps the module's product
        assert torch.equal(router_logits(gate, x).detach(), sgemm)
    expected = x.double() @ gate.weight.double().t()
    error = (logits.double() - expected).abs().max().item()
    # fp32-class: the tensor cores' fp32 accumulation is off by about 8e-6 of the largest logit (cuBLAS's SGEMM
    # 1e-6), a bf16 product by about 4e-3
    assert error <= 2e-5 * expected.abs().max().item(), error
    # the top-4 choice is fp64's wherever fp64's 4th and 5th logits are further apart than twice the error
    top5 = expected.topk(5, dim=-1)
    clear = (top5.values[:, 3] - top5.values[:, 4]) > 2 * error
    assert clear.float().mean() > 0.99
    chosen = logits.topk(4, dim=-1).indices.sort(-1).values
    assert torch.equal(chosen[clear], top5.indices[:, :4].sort(-1).values[clear])


def test_a_decode_steps_routing_by_the_gemv_equals_the_modules():
    from minimax_m3.bench_prefill import geometry_config
    from minimax_m3.modeling_minimax_m3 import MiniMaxM3SparseMoeBlock

    config = geometry_config(1, tiny=False, real_moe=True)
    block = MiniMaxM3SparseMoeBlock(config).cuda()
    torch.nn.init.normal_(block.gate.weight, std=0.02)
    x = torch.randn(4, config.hidden_size, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        chosen, weights, logits = block.route(x)
        block.gate.register_forward_pre_hook(lambda module, args: None)  # hooked: the module's cuBLAS product
        chosen_blas, weights_blas, logits_blas = block.route(x)
    torch.testing.assert_close(logits, logits_blas, rtol=1e-5, atol=1e-5)
    assert torch.equal(chosen, chosen_blas)
    torch.testing.assert_close(weights, weights_blas, rtol=1e-5, atol=1e-6)
