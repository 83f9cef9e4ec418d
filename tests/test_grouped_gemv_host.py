"""Host-side checks of the decode experts' grouped GEMV (the kernel runs in tests/test_gpu_grouped_gemv.py)."""

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


@pytest.mark.parametrize("pairs, experts, columns, takes_gemv", [
    (4, 128, 6144, True), (16, 128, 6144, True), (64, 128, 6144, True),  # M3's width, 1, 4 and 16 tokens at top-4
    (2, 4, 6144, True), (8, 4, 6144, True),  # the presets' down projection at 1 and 4 tokens (top-2 of 4)
    (32, 4, 6144, False),  # ... at 16 tokens: 8 rows per expert
    (2, 4, 512, False), (8, 4, 512, False),  # the presets' 512-wide gate_up: too few column blocks
    (65, 128, 6144, False), (0, 128, 6144, False),
])
def test_the_gemv_is_taken_where_it_measured_faster(pairs, experts, columns, takes_gemv):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from minimax_m3.experts import gemv_pays

    assert gemv_pays(pairs, experts, columns, num_sms=132) == takes_gemv
