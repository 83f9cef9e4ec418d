"""Dense attention of new tokens over a cached prefix on CUDA against an fp32 reference (run on the H200)."""

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from minimax_m3.dense_attention import (PREFIX_KEY_BLOCK, eager_attention_forward, sdpa_attention_forward,
                                        split_prefix_serves)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(batch, heads, kv_heads, dim, q_length, kv_length, dtype):
    """Queries 4x the unit scale, so each row's softmax is peaked (a flat one averages every kernel's output to
    near zero and hides errors)."""
    generator = torch.Generator(device="cuda").manual_seed(q_length + kv_length)
    query = (4 * torch.randn(batch, heads, q_length, dim, device="cuda", generator=generator)).to(dtype)
    key = torch.randn(batch, kv_heads, kv_length, dim, device="cuda", generator=generator).to(dtype)
    value = torch.randn(batch, kv_heads, kv_length, dim, device="cuda", generator=generator).to(dtype)
    return query, key, value


@pytest.mark.parametrize("batch, heads, kv_heads, dim, q_length, kv_length", [
    (1, 64, 4, 128, 2048, 9000),  # M3's geometry: a 2K chunk over a cached prefix shorter than a key block
    (1, 64, 4, 128, 2048, 2048 + 2 * PREFIX_KEY_BLOCK + 777),  # two cuDNN key blocks and a rest
    (1, 64, 4, 128, 1000, 1000 + PREFIX_KEY_BLOCK),  # exactly one block: the rest is the new tokens alone
    (1, 64, 4, 128, 16, 5000),  # a verify step
    (2, 9, 3, 64, 300, 1001),  # the converted SmolLM2's geometry, two sequences, lengths off every tile
    (2, 9, 3, 64, 1000, 1013 + PREFIX_KEY_BLOCK),  # the same over a key block, queries padded to whole tiles
    (1, 8, 8, 128, 2, 3),  # no GQA, a one-key prefix
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_new_tokens_over_a_prefix_match_the_fp32_reference(batch, heads, kv_heads, dim, q_length, kv_length, dtype):
    query, key, value = _inputs(batch, heads, kv_heads, dim, q_length, kv_length, dtype)
    scale = dim ** -0.5
    with torch.no_grad():
        got, _ = sdpa_attention_forward(None, query, key, value, None, scaling=scale, is_causal=True)
        expected, _ = eager_attention_forward(None, query.float(), key.float(), value.float(), None, scaling=scale,
                                              is_causal=True)
        one_kernel = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(q_length, kv_length), scale=scale,
            enable_gqa=heads != kv_heads).transpose(1, 2)
    assert got.shape == (batch, q_length, heads, dim) and got.dtype == dtype
    assert torch.isfinite(got).all()
    error = (got.float() - expected).abs().max().item()
    # as close to the reference as SDPA's single bottom-right kernel, the path a chunk took before
    assert error <= 2 * (one_kernel.float() - expected).abs().max().item() + 1e-3, error
    # the outputs' own rounding: bf16 keeps 8 significant bits, fp16 11
    torch.testing.assert_close(got.float(), expected, atol=2e-2 if dtype == torch.bfloat16 else 4e-3,
                               rtol=8e-3 if dtype == torch.bfloat16 else 1e-3)


def test_the_split_prefix_path_serves_inference_over_a_key_block_with_a_wave_of_query_tiles():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    key = torch.randn(1, 4, 2048 + PREFIX_KEY_BLOCK, 128, device="cuda", dtype=torch.bfloat16)
    chunk = torch.randn(1, 64, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert not split_prefix_serves(chunk, key, 0.0)  # training keeps SDPA's differentiable kernels
    with torch.no_grad():
        assert split_prefix_serves(chunk, key, 0.0)
        assert not split_prefix_serves(chunk, key[:, :, 1:], 0.0)  # the prefix is one key short of a block
        assert not split_prefix_serves(chunk, key, 0.1)
        assert not split_prefix_serves(chunk.float(), key.float(), 0.0)
        short_of_a_wave = (sms - 1) // 64 * 128  # queries per head giving 64 heads fewer tiles than SMs
        assert not split_prefix_serves(chunk[:, :, :short_of_a_wave], key, 0.0)
        assert split_prefix_serves(chunk[:, :, :short_of_a_wave + 1], key, 0.0)
