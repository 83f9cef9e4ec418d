"""The router's top-k and the grouped-GEMM experts' routing plans (``minimax_m3.modeling_minimax_m3.top_k_columns``,
``minimax_m3.experts``) against torch's sort and top-k."""

import pytest
import torch

from minimax_m3 import MiniMaxM3Config
from minimax_m3.experts import (COUNTED_PLAN_MAX_PAIRS, ROUTER_PIECES_MIN_TOKENS, exact_bf16_pieces,
                                grouped_mm_experts_forward, router_logits, routing_plan_by_counting,
                                routing_plan_by_sorting)
from minimax_m3.modeling_minimax_m3 import MiniMaxM3Experts, top_k_columns


@pytest.mark.parametrize("shape,k", [((1, 128), 4), ((37, 128), 4), ((5, 16), 16), ((3, 4, 9), 2)])
def test_top_k_columns_are_torch_topks_in_order(shape, k):
    values = torch.randn(shape, generator=torch.Generator().manual_seed(k))
    assert torch.equal(top_k_columns(values, k), torch.topk(values, k, dim=-1).indices)


def test_top_k_columns_take_the_first_of_equal_values_and_compile_to_the_same():
    values = torch.tensor([[0.5, 2.0, 0.5, 2.0, 1.0]])
    assert top_k_columns(values, 4).tolist() == [[1, 3, 4, 0]]
    rows = torch.rand(50, 128)
    assert torch.equal(torch.compile(top_k_columns)(rows, 4), top_k_columns(rows, 4))


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 4, 128), (4, 4, 16), (16, 4, 8), (300, 2, 32)])
def test_both_routing_plans_put_every_pair_in_its_experts_rows(tokens, top_k, experts):
    generator = torch.Generator().manual_seed(tokens)
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    pairs = index.reshape(-1)
    for plan in (routing_plan_by_counting, routing_plan_by_sorting):
        token_of_row, offsets, slot_of_pair = plan(index, experts)
        assert offsets.dtype == torch.int32 and offsets.tolist() == torch.cumsum(
            torch.bincount(pairs, minlength=experts), 0).tolist()
        assert sorted(slot_of_pair.tolist()) == list(range(pairs.numel()))  # a permutation
        row_expert = torch.searchsorted(offsets, torch.arange(pairs.numel()), right=True)
        assert torch.equal(row_expert[slot_of_pair], pairs)  # each pair's row lies in its expert's rows
        assert torch.equal(token_of_row[slot_of_pair], torch.arange(pairs.numel()) // top_k)
    counted = routing_plan_by_counting(index, experts)[2]
    assert torch.equal(counted, torch.sort(pairs, stable=True).indices.argsort())  # pair order within an expert


@pytest.mark.parametrize("tokens", [3, COUNTED_PLAN_MAX_PAIRS // 4 + 5])
def test_the_experts_give_the_same_output_by_either_plan(tokens, monkeypatch):
    import minimax_m3.experts as experts

    config = MiniMaxM3Config(hidden_size=32, intermediate_size=16, num_local_experts=8)
    module = MiniMaxM3Experts(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        module.gate_up_proj.normal_(std=0.2, generator=generator)
        module.down_proj.normal_(std=0.2, generator=generator)
        x = torch.randn(tokens, 32, generator=generator)
        index = torch.stack([torch.randperm(8, generator=generator)[:4] for _ in range(tokens)])
        weights = torch.rand(tokens, 4, generator=generator)
        chosen = grouped_mm_experts_forward(module, x, index, weights)
        monkeypatch.setattr(experts, "COUNTED_PLAN_MAX_PAIRS", 0 if tokens * 4 <= COUNTED_PLAN_MAX_PAIRS else 10**6)
        other = grouped_mm_experts_forward(module, x, index, weights)
        reference = MiniMaxM3Experts.forward.__wrapped__(module, x, index, weights)  # the eager loop, undispatched
    torch.testing.assert_close(chosen, other, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(chosen, reference, atol=1e-5, rtol=1e-4)


def test_the_experts_take_a_decode_routing_plan_for_its_own_choice_only():
    """The MoE block hands the decode routing kernel's plan to the experts with the chosen experts
    (``decode_routing.RoutingPlan``): the experts take it for that very tensor, and count their own for any other,
    even of equal values. A plan that sends every pair to expert 0 shows which was taken."""
    from minimax_m3.decode_routing import RoutingPlan

    config = MiniMaxM3Config(hidden_size=32, intermediate_size=16, num_local_experts=8)
    module = MiniMaxM3Experts(config)
    assert module.routing_plan is None
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        module.gate_up_proj.normal_(std=0.2, generator=generator)
        module.down_proj.normal_(std=0.2, generator=generator)
        x = torch.randn(3, 32, generator=generator)
        index = torch.stack([torch.randperm(8, generator=generator)[:4] for _ in range(3)])
        weights = torch.rand(3, 4, generator=generator)
        expected = grouped_mm_experts_forward(module, x, index, weights)
        token_of_row, _, slot_of_pair = routing_plan_by_counting(index, 8)
        all_to_expert_0 = torch.full((8,), 12, dtype=torch.int32)
        module.routing_plan = RoutingPlan(index, token_of_row, all_to_expert_0, slot_of_pair)
        assert torch.equal(grouped_mm_experts_forward(module, x, index.clone(), weights), expected)
        taken = grouped_mm_experts_forward(module, x, index, weights)
    assert not torch.allclose(taken, expected)
    module.routing_plan = RoutingPlan(index, *routing_plan_by_counting(index, 8))
    with torch.no_grad():
        torch.testing.assert_close(grouped_mm_experts_forward(module, x, index, weights), expected)


def test_the_router_weights_bf16_pieces_sum_to_it_exactly():
    generator = torch.Generator().manual_seed(3)
    weight = torch.cat([torch.randn(64, 96, generator=generator) * 10.0 ** scale for scale in (-25, -8, -2, 0, 5, 30)])
    special = torch.tensor([0.0, -0.0, 2.0 ** -110, -(2.0 ** -110), 1.0 + 2.0 ** -23, 1.0 + 2.0 ** -8 + 2.0 ** -23,
                            -(1.0 + 2.0 ** -16 + 2.0 ** -22), 3.38e38, float(torch.finfo(torch.float32).tiny)])
    weight = torch.cat([weight.reshape(-1), special])
    pieces = exact_bf16_pieces(weight)
    assert pieces.dtype == torch.bfloat16 and pieces.shape == (3, *weight.shape)
    assert torch.equal(pieces[0].float() + pieces[1].float() + pieces[2].float(), weight)
    # each piece is what the ones before left, rounded: the later pieces are at most half a bf16 step of the earlier
    assert (pieces[1].float().abs() <= pieces[0].float().abs() * 2.0 ** -8).all()
    assert (pieces[2].float().abs() <= pieces[1].float().abs() * 2.0 ** -8).all()


def test_the_router_on_a_cpu_is_the_modules_fp32_product_at_any_length():
    gate = torch.nn.Linear(64, 8, bias=False)
    x = torch.randn(ROUTER_PIECES_MIN_TOKENS + 3, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(router_logits(gate, x), gate(x.float()))
