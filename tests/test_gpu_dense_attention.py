"""Dense attention of new tokens over a cached prefix on CUDA against an fp32 reference (run on the H200)."""

import pytest
import torch

from minimax_m3.dense_attention import eager_attention_forward, sdpa_attention_forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("batch, heads, kv_heads, dim, q_length, kv_length", [
    (1, 64, 4, 128, 2048, 9000),  # M3's geometry: a 2K chunk over a cached prefix
    (1, 64, 4, 128, 16, 5000),  # a verify step
    (2, 9, 3, 64, 300, 1001),  # the converted SmolLM2's geometry, two sequences, lengths off every tile
    (1, 8, 8, 128, 2, 3),  # no GQA, a one-key prefix
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_new_tokens_over_a_prefix_match_the_fp32_reference(batch, heads, kv_heads, dim, q_length, kv_length, dtype):
    generator = torch.Generator(device="cuda").manual_seed(q_length + kv_length)
    query = torch.randn(batch, heads, q_length, dim, device="cuda", generator=generator).to(dtype)
    key = torch.randn(batch, kv_heads, kv_length, dim, device="cuda", generator=generator).to(dtype)
    value = torch.randn(batch, kv_heads, kv_length, dim, device="cuda", generator=generator).to(dtype)
    scale = dim ** -0.5
    with torch.no_grad():
        got, _ = sdpa_attention_forward(None, query, key, value, None, scaling=scale, is_causal=True)
        expected, _ = eager_attention_forward(None, query.float(), key.float(), value.float(), None, scaling=scale,
                                              is_causal=True)
    assert got.shape == (batch, q_length, heads, dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=2e-2 if dtype == torch.bfloat16 else 4e-3, rtol=0)
