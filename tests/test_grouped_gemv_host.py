"""Host-side checks of the decode step's grouped GEMV, experts and router (the kernel runs in\ntests/test_gpu_grouped_gemv.py)."""

import pytest
import torch

from minimax_m3.experts import grouped_gemv, grouped_gemv_serves


def test_the_gemv_serves_only_bf16_on_an_sm90_gpu():
    rows, weights = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    assert not grouped_gemv_serves(rows, weights)  # on the CPU


def test_unserved_operands_are_refused_by_name():
    rows, weights = torch.zeros(4, 64), torch.zeros(2, 16, 64)
    with pytest.raises(ValueError, match="grouped_gemv needs bf16 rows"):
        grouped_gemv(rows, weights, torch.tensor([2, 4], dtype=torch.int32))


@pytest.mark.parametrize("pairs, experts, takes_gemv", [
    (4, 128, True), (16, 128, True), (64, 128, True),  # M3's width, 1, 4 and 16 tokens at top-4
    (2, 4, True), (8, 4, True),  # the presets' experts at 1 and 4 tokens (top-2 of 4), both projections
    (32, 4, False),  # ... at 16 tokens: 8 rows per expert
    (65, 128, False), (0, 128, False),
])
def test_the_gemv_is_taken_where_it_measured_faster(pairs, experts, takes_gemv):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from minimax_m3.experts import gemv_pays

    assert gemv_pays(pairs, experts) == takes_gemv


def test_the_router_off_the_gpu_is_the_modules_fp32_product():
    from minimax_m3.experts import router_logits

    gate = torch.nn.Linear(64, 8, bias=False, dtype=torch.float32)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(router_logits(gate, x), gate(x.float()), rtol=0, atol=0)


def test_a_hooked_router_is_called_through_its_module():
    from minimax_m3.experts import router_logits

    gate = torch.nn.Linear(64, 8, bias=False, dtype=torch.float32)
    calls = []
    gate.register_forward_pre_hook(lambda module, args: calls.append(args[0].dtype))
    router_logits(gate, torch.randn(2, 64, dtype=torch.bfloat16))
    assert calls == [torch.float32]
