"""``minimax_m3.streams`` off a capture: both branches run in order on the current stream."""

import torch

from minimax_m3.streams import run_branches


def test_outside_a_capture_the_branches_run_in_order_and_return_side_then_main():
    order = []
    side, main = run_branches(lambda: order.append("side") or torch.ones(2), lambda: order.append("main") or 3,
                              torch.device("cpu"))
    assert order == ["side", "main"] and torch.equal(side, torch.ones(2)) and main == 3
