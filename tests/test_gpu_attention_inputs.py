"""A decode step's fused attention inputs (``minimax_m3/attention_inputs.py``) against the unfused path: q normed
and rotated, k and v written into the cache at their slots and nowhere else."""

import pytest
import torch

import minimax_m3.attention_inputs as attention_inputs
from minimax_m3 import MiniMaxM3StaticCache
from minimax_m3.modeling_minimax_m3 import _norm_and_rope_math
from test_gpu_decode_graphs import kernel_geometry_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs SM90")]


class Norm(torch.nn.Module):
    def __init__(self, head_dim, offset):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(head_dim, device="cuda").mul(0.2).to(torch.bfloat16))
        self.offset, self.eps = offset, 1e-6


class Attention(torch.nn.Module):
    def __init__(self, head_dim, offset):
        super().__init__()
        self.config = type("Config", (), {"use_qk_norm": True})()
        self.layer_idx = 0
        self.q_norm, self.k_norm = Norm(head_dim, offset), Norm(head_dim, offset)


class Cache:
    def __init__(self, keys, values):
        self.stores = {"keys": keys, "values": values}

    def allocated_store(self, name, layer_idx, like):
        return self.stores[name]


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
    bf16 rounding of the unfused attention inputs', eagerly and graphed."""
    model = kernel_geometry_model([0, 1, 1])
    prompt = torch.randint(3, 97, (2, 600), device="cuda")
    launched = []
    write = attention_inputs.write_decode_attention_inputs

    def recording(*args):
        result = write(*args)
        launched.append(result is not None)
        return result

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
    monkeypatch.setattr(modeling, "write_decode_attention_inputs", recording)
    unfused = steps(graphs=False, fused=False)
    launched.clear()
    fused_eager = steps(graphs=False, fused=True)
    assert launched.count(True) == 3 * 4  # every layer of every step, none in the prefill
    fused_graphs = steps(graphs=True, fused=True)
    torch.testing.assert_close(fused_eager, unfused, rtol=0.05, atol=0.05)
    torch.testing.assert_close(fused_graphs, fused_eager, rtol=0.05, atol=0.05)
