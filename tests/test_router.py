"""The router's exact bf16 split (``minimax_m3.router``)."""

import pytest
import torch

from minimax_m3.fusion import compiled
from minimax_m3.router import MiniMaxM3Router, exact_bf16_parts


@pytest.mark.parametrize("scale", [1e-4, 0.02, 1.0, 3e3])
def test_the_three_bf16_parts_sum_to_the_weight_exactly_in_any_order(scale):
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * scale
    high, middle, low = exact_bf16_parts(weight).float()
    assert exact_bf16_parts(weight).dtype == torch.bfloat16
    for total in ((high + middle) + low, (low + middle) + high, (high + low) + middle):
        assert torch.equal(total, weight)


def test_compiled_parts_equal_the_eager_ones_bit_for_bit():
    weight = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    assert torch.equal(compiled("test_router_parts", exact_bf16_parts)(weight), exact_bf16_parts(weight))


def test_the_parts_reproduce_the_fp32_products_exactly():
    """A bf16 activation times each part is exact in fp32, so the split logits are the fp32 GEMM's products."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(16, 40, generator=generator) * 0.05
    x = torch.randn(7, 40, generator=generator).to(torch.bfloat16)
    parts = exact_bf16_parts(weight).double()
    products = x.double()[:, None, None, :] * parts[None]  # [T, 3, E, hidden]
    assert torch.equal(products.float().double(), products)  # each product exact in fp32
    torch.testing.assert_close(products.sum((1, 3)), x.double() @ weight.double().t(), rtol=0, atol=1e-12)


def test_the_router_returns_fp32_logits_of_any_activation_dtype():
    router = MiniMaxM3Router(40, 16)
    torch.nn.init.normal_(router.weight, std=0.05, generator=torch.Generator().manual_seed(3))
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    logits = router(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ router.weight.t())
    with pytest.raises(ValueError, match="float32"):
        exact_bf16_parts(router.weight.detach().to(torch.bfloat16))
