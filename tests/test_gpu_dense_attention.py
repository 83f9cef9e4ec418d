"""Dense attention of new tokens over a cached prefix on CUDA: the split cuDNN path against an fp32 reference (run
on the H200)."""

import pytest
import torch

from minimax_m3.dense_attention import (eager_attention_forward, sdpa_attention_forward, split_causal_cudnn,
                                        split_causal_cudnn_serves)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _reference(query, key, value, scale):
    """fp32 bottom-right causal attention by the eager implementation (explicit softmax per KV group)."""
    output, _ = eager_attention_forward(None, query.float(), key.float(), value.float(), None, scaling=scale,
                                        is_causal=True)
    return output


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
        got = split_causal_cudnn(query, key, value, scale)
        dispatched, _ = sdpa_attention_forward(None, query, key, value, None, scaling=scale, is_causal=True)
        expected = _reference(query, key, value, scale)
        masked = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=torch.nn.attention.bias.causal_lower_right(q_length, kv_length), scale=scale,
            enable_gqa=heads != kv_heads).transpose(1, 2)
    assert got.shape == (batch, q_length, heads, dim) and got.dtype == dtype
    assert torch.isfinite(got).all()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=0)
    torch.testing.assert_close(dispatched.float(), expected, atol=tolerance, rtol=0)
    # as close to the reference as the single masked kernel it replaces
    assert (got.float() - expected).abs().max() <= 2 * (masked.float() - expected).abs().max() + 1e-3


def test_the_split_path_serves_inference_with_a_wave_of_query_tiles():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    key = torch.randn(1, 4, 4096, 128, device="cuda", dtype=torch.bfloat16)
    chunk = torch.randn(1, 64, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert not split_causal_cudnn_serves(chunk, key, 0.0)  # training keeps SDPA's differentiable kernels
    with torch.no_grad():
        assert split_causal_cudnn_serves(chunk, key, 0.0)
        assert not split_causal_cudnn_serves(chunk, key, 0.1)
        assert not split_causal_cudnn_serves(chunk.float(), key.float(), 0.0)
        tiles_short_of_a_wave = (sms - 1) // 64 * 128  # queries per head giving 64 heads fewer tiles than SMs
        assert not split_causal_cudnn_serves(chunk[:, :, :max(1, tiles_short_of_a_wave)], key, 0.0)
        assert split_causal_cudnn_serves(chunk[:, :, :tiles_short_of_a_wave + 129], key, 0.0)
