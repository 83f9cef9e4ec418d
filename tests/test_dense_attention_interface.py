"""The dense layers' attention through transformers' AttentionInterface: GQA-native sdpa and eager against an
independent per-token reference, user-registered functions, and the implementations the model refuses."""

import pytest
import torch
from transformers import AttentionInterface

import minimax_m3  # noqa: F401
from minimax_m3.dense_attention import ALL_ATTENTION_FUNCTIONS, dense_attention
from minimax_m3.sparse_attention import ForwardMetadata
from test_minimax_m3 import CACHE_FIELD, tiny_model


def packed_metadata(query_lengths, kv_lengths):
    starts, offset = [], 0
    for count in query_lengths:
        starts.append(offset)
        offset += count
    positions = torch.cat([torch.arange(kv - n, kv) for n, kv in zip(query_lengths, kv_lengths)])
    batch_index = torch.cat([torch.full((n,), b) for b, n in enumerate(query_lengths)])
    return ForwardMetadata(batch_index, positions, list(query_lengths), list(kv_lengths), starts)


def per_token_reference(q, keys, values, metadata, scale):
    """Token by token in float64: softmax over the keys at positions <= its own, of its query head's KV group."""
    group = q.shape[1] // keys.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        b, p = int(metadata.batch_index[t]), int(metadata.positions[t])
        for h in range(q.shape[1]):
            k = keys[b, : p + 1, h // group].double()
            weights = torch.softmax(k @ q[t, h].double() * scale, dim=0)
            out[t, h] = weights @ values[b, : p + 1, h // group].double()
    return out


CASES = {
    "fresh, two lengths": ([9, 5], [9, 5]),
    "fresh, one length (a training batch)": ([6, 6], [6, 6]),
    "chunk over a cached prefix": ([7, 4], [19, 11]),
    "one new token each (decode)": ([1, 1], [13, 8]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_dense_attention_matches_a_per_token_reference(case, implementation):
    query_lengths, kv_lengths = CASES[case]
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(sum(query_lengths), 6, 16, generator=generator)
    keys = torch.randn(2, 24, 2, 16, generator=generator)
    values = torch.randn(2, 24, 2, 16, generator=generator)
    metadata = packed_metadata(query_lengths, kv_lengths)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, None)
    got = dense_attention(q, keys, values, metadata, scale=0.3, attention=attention)
    torch.testing.assert_close(got.double(), per_token_reference(q, keys, values, metadata, 0.3), atol=1e-5, rtol=1e-5)


def test_sdpa_never_repeats_the_kv_heads(monkeypatch):
    """The query heads meet the 2 KV heads as they are (enable_gqa): SDPA sees 2 key heads in every call."""
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        seen.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa")))
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = tiny_model(attention_mode="dense")
    ids = torch.randint(3, 97, (2, 30))
    cache = model(ids[:, :20], use_cache=True)[CACHE_FIELD]
    model(ids[:, 20:], past_key_values=cache)
    assert seen and all(heads == (4, 2, True) for heads in seen), seen


def test_eager_and_sdpa_models_give_the_same_logits():
    sdpa = tiny_model(attention_mode="dense")
    eager = tiny_model(attention_mode="dense", attn_implementation="eager")
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    ids = torch.randint(3, 97, (2, 30))
    torch.testing.assert_close(eager(ids).logits, sdpa(ids).logits, atol=1e-5, rtol=1e-5)
    sdpa.set_attn_implementation("eager")
    torch.testing.assert_close(sdpa(ids).logits, eager(ids).logits, atol=0, rtol=0)


def test_a_registered_attention_function_is_called_with_transformers_signature():
    calls = []

    def recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
        calls.append((tuple(query.shape), tuple(key.shape), None if attention_mask is None else tuple(attention_mask.shape),
                      is_causal))
        reference = ALL_ATTENTION_FUNCTIONS["eager"]
        if attention_mask is None:
            return reference(module, query, key, value, None, scaling=scaling, is_causal=is_causal)
        return reference(module, query, key, value, attention_mask, scaling=scaling)

    AttentionInterface.register("recording_attention", recording_attention)
    model = tiny_model(attention_mode="dense", attn_implementation="recording_attention")
    reference = tiny_model(attention_mode="dense")
    ids = torch.randint(3, 97, (1, 30))
    cache = model(ids[:, :20], use_cache=True)[CACHE_FIELD]
    continued = model(ids[:, 20:], past_key_values=cache).logits
    torch.testing.assert_close(continued, reference(ids).logits[:, 20:], atol=1e-5, rtol=1e-5)
    assert calls[0] == ((1, 4, 20, 32), (1, 2, 20, 32), None, True)  # fresh: causal, no mask, KV heads as they are
    assert calls[-1] == ((1, 4, 10, 32), (1, 2, 30, 32), (1, 1, 10, 30), False)  # over the cache: a boolean mask


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention", "paged|eager", "sdpa_paged", "no_such_attention"])
def test_attention_implementations_the_model_cannot_serve_raise(implementation):
    with pytest.raises((ValueError, ImportError, KeyError)):
        tiny_model(attn_implementation=implementation)
    model = tiny_model()
    with pytest.raises((ValueError, ImportError, KeyError)):
        model.set_attn_implementation(implementation)
    assert model.config._attn_implementation == "sdpa"


def _math_attention(causal):
    """What the split-prefix path asks of cuDNN (no mask) and of FlashAttention-2 (bottom-right causal), in fp32
    on the CPU: ``([B, H, q, D], natural log-sum-exp [B, H, q])``, GQA by grouping the query heads."""
    def attend(query, key, value, scaling):
        batch, heads, q_length, dim = query.shape
        kv_heads, kv_length = key.shape[1], key.shape[2]
        grouped = query.float().view(batch, kv_heads, heads // kv_heads, q_length, dim)
        logits = torch.einsum("bgrqd,bgkd->bgrqk", grouped, key.float()) * scaling
        if causal:
            positions = torch.arange(kv_length - q_length, kv_length)
            logits = logits.masked_fill(torch.arange(kv_length)[None, :] > positions[:, None], float("-inf"))
        output = torch.einsum("bgrqk,bgkd->bgrqd", torch.softmax(logits, -1), value.float())
        return (output.reshape(batch, heads, q_length, dim).to(query.dtype),
                torch.logsumexp(logits, -1).reshape(batch, heads, q_length))
    return attend


@pytest.mark.parametrize("q_length, kv_length, key_block", [(5, 5 + 3 * 16 + 7, 16), (130, 130 + 2 * 32, 32),
                                                            (3, 3 + 16, 16)])
def test_the_split_prefix_path_equals_one_causal_softmax(q_length, kv_length, key_block):
    """Whole key blocks without a mask, the rest bottom-right causal, merged one block at a time (CPU stand-ins
    for the CUDA kernels; the queries are padded to whole 128-query tiles for the block calls)."""
    from minimax_m3.dense_attention import eager_attention_forward, split_prefix_attention

    generator = torch.Generator().manual_seed(kv_length)
    query = torch.randn(2, 6, q_length, 8, generator=generator) * 2
    key, value = torch.randn(2, 3, kv_length, 8, generator=generator), torch.randn(2, 3, kv_length, 8, generator=generator)
    got = split_prefix_attention(query, key, value, 0.3, key_block=key_block, prefix_attention=_math_attention(False),
                                 causal_attention=_math_attention(True))
    expected, _ = eager_attention_forward(None, query, key, value, None, scaling=0.3, is_causal=True)
    assert got.shape == (2, q_length, 6, 8)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
