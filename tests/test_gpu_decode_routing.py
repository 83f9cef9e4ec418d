"""A decode step's routing kernel (``minimax_m3.decode_routing``) against the compiled chains it replaces: the
choice, the weights and the grouped experts' routing plan, NaN-guarded outputs, ties and the MoE block's output."""

import pytest
import torch

from minimax_m3 import decode_routing as routing_module
from minimax_m3.decode_routing import RoutingPlan, decode_routing, decode_routing_serves
from minimax_m3.experts import routing_plan_by_counting
from minimax_m3.modeling_minimax_m3 import route_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs SM90"),
]

GUARD = 7


def guarded(shape, dtype, fill):
    """A tensor of ``shape`` inside a flat buffer with ``GUARD`` poisoned elements on either side."""
    count = 1
    for extent in shape:
        count *= extent
    storage = torch.full((count + 2 * GUARD,), fill, dtype=dtype, device="cuda")
    return storage, fill, storage[GUARD:GUARD + count].view(shape)


def run_guarded(logits, bias, top_k, scaling):
    tokens, experts = logits.shape
    pairs = tokens * top_k
    buffers = [guarded((tokens, top_k), torch.int64, -(2**40)), guarded((tokens, top_k), torch.float32, float("nan")),
               guarded((pairs,), torch.int64, -(2**40)), guarded((experts,), torch.int32, -(2**30)),
               guarded((pairs,), torch.int64, -(2**40))]
    routing_module._kernel(logits.device, top_k)(logits, bias, *[view for _, _, view in buffers], float(scaling))
    for storage, fill, _ in buffers:
        for part in (storage[:GUARD], storage[-GUARD:]):
            assert bool(part.isnan().all()) if part.dtype.is_floating_point else bool((part == fill).all())
    return [view for _, _, view in buffers]


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 128, 4), (4, 128, 4), (16, 128, 4), (4, 4, 2), (3, 256, 8),
                                                    (16, 33, 1), (2, 200, 6)])
def test_the_routing_equals_the_compiled_chains_and_writes_nothing_else(tokens, experts, top_k):
    generator = torch.Generator(device="cuda").manual_seed(tokens * 1000 + experts + top_k)
    logits = torch.randn(tokens, experts, device="cuda", generator=generator) * 3
    bias = torch.randn(experts, device="cuda", generator=generator) * 0.1
    chosen, weights, token_of_row, offsets, slot_of_pair = run_guarded(logits, bias, top_k, 2.5)
    expected_chosen, expected_weights = route_weights(logits, bias, top_k, 2.5)
    assert torch.equal(chosen, expected_chosen)
    torch.testing.assert_close(weights, expected_weights, rtol=2e-6, atol=1e-7)
    for got, expected in zip((token_of_row, offsets, slot_of_pair), routing_plan_by_counting(expected_chosen, experts)):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_ties_go_to_the_lower_expert_and_a_nan_logit_counts_as_the_largest():
    logits = torch.zeros(3, 64, device="cuda")
    logits[0, [5, 9, 40, 63]] = 2.0  # four equal winners: ids ascending
    logits[1, 17] = float("nan")
    logits[1, [3, 30]] = 1.0
    bias = torch.zeros(64, device="cuda")
    chosen, weights, plan = decode_routing(logits, bias, 4, 1.0)
    expected_chosen, expected_weights = route_weights(logits, bias, 4, 1.0)
    assert chosen[0].tolist() == [5, 9, 40, 63]
    assert torch.equal(chosen, expected_chosen)
    torch.testing.assert_close(weights, expected_weights, rtol=2e-6, atol=1e-7, equal_nan=True)
    assert torch.equal(plan.offsets, routing_plan_by_counting(chosen, 64)[1])


def test_what_the_kernel_serves():
    logits, bias = torch.randn(4, 128, device="cuda"), torch.zeros(128, device="cuda")
    assert decode_routing_serves(logits, bias, 4)
    assert not decode_routing_serves(torch.randn(17, 128, device="cuda"), bias, 4)  # a prefill: the compiled chains
    assert not decode_routing_serves(torch.randn(4, 257, device="cuda"), torch.zeros(257, device="cuda"), 4)
    assert not decode_routing_serves(logits, bias, 9)
    assert not decode_routing_serves(logits.half(), bias, 4)
    assert not decode_routing_serves(logits.requires_grad_(), bias, 4)  # the weights need their gradient
    with pytest.raises(ValueError, match="top_k"):
        decode_routing(torch.randn(4, 128, device="cuda"), bias, 9, 1.0)


def test_a_decode_steps_moe_block_takes_the_kernel_and_matches_the_compiled_chains(monkeypatch):
    from minimax_m3.bench_prefill import geometry_config
    from minimax_m3.modeling_minimax_m3 import MiniMaxM3SparseMoeBlock

    config = geometry_config(1, tiny=False)  # the presets' MoE: 4 experts of 256, top-2
    torch.manual_seed(0)
    block = MiniMaxM3SparseMoeBlock(config).cuda().to(torch.bfloat16)
    block.gate.float()
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    block.e_score_correction_bias.normal_(std=0.01)
    x = torch.randn(4, config.hidden_size, device="cuda").to(torch.bfloat16)
    calls = []
    original = routing_module.decode_routing

    def counted(*args):
        calls.append(args[0].shape)
        return original(*args)

    import minimax_m3.modeling_minimax_m3 as modeling

    monkeypatch.setattr(modeling, "decode_routing", counted)
    with torch.no_grad():
        output, logits = block(x)
        assert calls == [(4, config.num_local_experts)]
        assert isinstance(block.experts.routing_plan, RoutingPlan)
        monkeypatch.setattr(modeling, "decode_routing_serves", lambda *args: False)
        expected, expected_logits = block(x)
    assert torch.equal(logits, expected_logits)
    torch.testing.assert_close(output, expected, rtol=1e-2, atol=1e-3)
