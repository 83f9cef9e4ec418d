"""A decode step's fused attention inputs (``minimax_m3/attention_inputs.py``) against the unfused path: q normed
and rotated, k and v written into the cache at their slots and nowhere else."""

import pytest
import torch

import minimax_m3.attention_inputs as attention_inputs
from minimax_m3 import MiniMaxM3StaticCache
from minimax_m3.modeling_minimax_m3 import _norm_and_rope_math, _norm_rope_and_cast_math
from test_gpu_decode_graphs import kernel_geometry_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs SM90")]


class Norm(torch.nn.Module):
    def __init__(self, head_dim, offset, spread=0.2):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(head_dim, device="cuda").mul(spread).to(torch.bfloat16))
        self.offset, self.eps = offset, 1e-6


class Attention(torch.nn.Module):
    def __init__(self, head_dim, offset):
        super().__init__()
        self.config = type("Config", (), {"use_qk_norm": True})()
        self.layer_idx = 0
        self.q_norm, self.k_norm = Norm(head_dim, offset), Norm(head_dim, offset)
        # weights large enough that some index outputs pass e4m3's largest value, 448, and saturate
        self.index_q_norm, self.index_k_norm = Norm(head_dim, offset, spread=300.0), Norm(head_dim, offset, spread=300.0)


class Cache:
    def __init__(self, keys=None, values=None, **stores):
        self.stores = {"keys": keys, "values": values, **stores}

    def allocated_store(self, name, layer_idx, dtype, device):
        store = self.stores[name]
        return store if store.dtype == dtype and store.device == device else None


class Metadata:
    def __init__(self, batch_index, positions):
        self.batch_index, self.positions = batch_index, positions


@pytest.mark.parametrize("heads, kv_heads, head_dim, half, offset", [
    (64, 4, 128, 32, 1.0),  # M3: 64 of 128 dims rotated, Gemma's norm
    (16, 2, 128, 64, 0.0),  # every dim rotated, the standard norm
    (9, 3, 64, 16, 1.0),  # 64-dim heads, two elements per lane
])
def test_the_fused_inputs_match_the_unfused_path_and_write_only_their_slots(heads, kv_heads, head_dim, half, offset):
    torch.manual_seed(heads)
    tokens, batch, capacity = 5, 3, 40
    packed = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").to(torch.bfloat16)
    q, k, v = packed.view(tokens, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)  # strided views
    angles = torch.rand(tokens, half, device="cuda") * 100
    cos, sin = angles.cos(), angles.sin()
    attention = Attention(head_dim, offset)
    keys = torch.full((batch, capacity, kv_heads, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    values = torch.full_like(keys, float("nan"))
    batch_index = torch.tensor([0, 2, 2, 1, 0], device="cuda")
    positions = torch.tensor([7, 0, 39, 12, 8], device="cuda")
    with torch.no_grad():
        written = attention_inputs.write_decode_attention_inputs(attention, q, k, v, cos, sin, Cache(keys, values),
                                                                 Metadata(batch_index, positions))
    assert written is not None
    q_out, keys_out, values_out = written
    assert keys_out is keys and values_out is values
    expected_q = _norm_and_rope_math(q, attention.q_norm.weight, 1e-6, offset, cos, sin)
    expected_k = _norm_and_rope_math(k, attention.k_norm.weight, 1e-6, offset, cos, sin)
    torch.testing.assert_close(q_out.float(), expected_q.float(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(keys[batch_index, positions].float(), expected_k.float(), rtol=1.6e-2, atol=1e-2)
    assert torch.equal(values[batch_index, positions], v)
    untouched = torch.ones(batch, capacity, dtype=torch.bool, device="cuda")
    untouched[batch_index, positions] = False
    assert keys[untouched].isnan().all() and values[untouched].isnan().all()


@pytest.mark.parametrize("index_dtype", ["float8_e4m3fn", "bfloat16"])
def test_the_fused_index_inputs_match_the_unfused_path_and_write_only_their_slots(index_dtype):
    torch.manual_seed(11)
    tokens, batch, capacity, heads, head_dim, half = 6, 2, 24, 4, 128, 32
    packed = torch.randn(tokens, (heads + 1) * head_dim, device="cuda").to(torch.bfloat16)
    query, key = packed.split([heads * head_dim, head_dim], dim=1)  # column slices of one packed projection
    angles = torch.rand(tokens, half, device="cuda") * 100
    cos, sin = angles.cos(), angles.sin()
    attention = Attention(head_dim, 1.0)
    dtype = getattr(torch, index_dtype)
    store = torch.full((batch, capacity, head_dim), float("nan"), device="cuda").to(dtype)
    batch_index = torch.tensor([1, 0, 1, 1, 0, 0], device="cuda")
    positions = torch.tensor([0, 23, 5, 6, 11, 12], device="cuda")
    with torch.no_grad():
        index_q = attention_inputs.write_decode_index_inputs(attention, query, key, cos, sin, Cache(index_keys=store),
                                                             Metadata(batch_index, positions), index_dtype)
    assert index_q is not None and index_q.dtype == dtype and index_q.shape == (tokens, heads, head_dim)
    expected_q = _norm_rope_and_cast_math(query.view(tokens, heads, head_dim), attention.index_q_norm.weight, 1e-6,
                                          1.0, cos, sin, index_dtype)
    expected_k = _norm_rope_and_cast_math(key.view(tokens, 1, head_dim), attention.index_k_norm.weight, 1e-6, 1.0,
                                          cos, sin, index_dtype)[:, 0]
    for actual, expected in ((index_q, expected_q), (store[batch_index, positions], expected_k)):
        actual, expected = actual.float(), expected.float()
        if dtype == torch.bfloat16:
            torch.testing.assert_close(actual, expected, rtol=1.6e-2, atol=1e-2)
            continue
        assert expected.abs().max() == 448 and not expected.isnan().any()  # the saturating cast is exercised
        # the fp32 arithmetic may round differently before the casts: at most one e4m3 step apart, rarely
        assert ((actual - expected).abs() <= expected.abs() * 0.125 + 2.0 ** -9).all()
        assert (actual == expected).float().mean() > 0.98
    untouched = torch.ones(batch, capacity, dtype=torch.bool, device="cuda")
    untouched[batch_index, positions] = False
    assert store[untouched].float().isnan().all()


def test_a_slot_outside_the_cache_is_not_written():
    attention = Attention(128, 1.0)
    packed = torch.randn(2, 6 * 128, device="cuda").to(torch.bfloat16)
    q, k, v = packed.view(2, -1, 128).split([4, 1, 1], dim=1)
    keys = torch.full((1, 8, 1, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    values = torch.full_like(keys, float("nan"))
    angles = torch.rand(2, 32, device="cuda")
    metadata = Metadata(torch.tensor([0, 1], device="cuda"), torch.tensor([8, 3], device="cuda"))
    with torch.no_grad():
        written = attention_inputs.write_decode_attention_inputs(attention, q, k, v, angles.cos(), angles.sin(),
                                                                 Cache(keys, values), metadata)
    assert written is not None
    torch.cuda.synchronize()
    assert keys.isnan().all() and values.isnan().all()


def test_decode_steps_with_the_fused_inputs_match_the_unfused_steps(monkeypatch):
    """Decode steps of the kernels' geometry model (a dense and two sparse layers) over the same tokens: logits within
    bf16 rounding of the unfused attention and index inputs', eagerly and graphed."""
    model = kernel_geometry_model([0, 1, 1])
    prompt = torch.randint(3, 97, (2, 600), device="cuda")
    launched = {"attention": [], "index": []}

    def recording(name, write):
        def call(*args):
            result = write(*args)
            launched[name].append(result is not None)
            return result
        return call

    tokens = torch.randint(3, 97, (4, 2, 1), device="cuda")  # the same tokens for every run: no greedy drift

    def steps(graphs, fused):
        monkeypatch.setattr(attention_inputs, "DECODE_INPUTS_MAX_TOKENS", 64 if fused else 0)
        cache = MiniMaxM3StaticCache(model.config, max_cache_len=610)
        out = []
        with torch.no_grad():
            model(prompt, past_key_values=cache)
            for token in tokens:
                out.append(model(token, past_key_values=cache, decode_cuda_graphs=graphs).logits[:, -1].float())
        return torch.stack(out)

    import minimax_m3.modeling_minimax_m3 as modeling
    monkeypatch.setattr(modeling, "write_decode_attention_inputs",
                        recording("attention", attention_inputs.write_decode_attention_inputs))
    monkeypatch.setattr(modeling, "write_decode_index_inputs", recording("index", attention_inputs.write_decode_index_inputs))
    unfused = steps(graphs=False, fused=False)
    launched["attention"].clear(), launched["index"].clear()
    fused_eager = steps(graphs=False, fused=True)
    assert launched["attention"].count(True) == 3 * 4  # every layer of every step, none in the prefill
    assert launched["index"].count(True) == 2 * 4  # every sparse layer of every step
    fused_graphs = steps(graphs=True, fused=True)
    torch.testing.assert_close(fused_eager, unfused, rtol=0.05, atol=0.05)
    torch.testing.assert_close(fused_graphs, fused_eager, rtol=0.05, atol=0.05)
