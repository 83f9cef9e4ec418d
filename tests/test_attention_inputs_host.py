"""Host-side gating of the fused decode attention inputs (the kernel runs in tests/test_gpu_attention_inputs.py)."""

import torch

from minimax_m3.attention_inputs import write_decode_attention_inputs, write_decode_index_inputs
from minimax_m3.modeling_minimax_m3 import MiniMaxM3Attention
from test_minimax_m3 import tiny_model


def test_off_the_gpu_nothing_is_fused_and_nothing_written():
    model = tiny_model()
    attention = next(module for module in model.modules() if isinstance(module, MiniMaxM3Attention))
    from minimax_m3 import MiniMaxM3Cache

    cache = MiniMaxM3Cache(model.config)
    prompt = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        model(prompt, past_key_values=cache)
    keys = cache.layers[attention.layer_idx].keys.clone()
    q = torch.randn(1, model.config.num_attention_heads, model.config.head_dim)
    k = torch.randn(1, model.config.num_key_value_heads, model.config.head_dim)
    angles = torch.rand(1, 4)

    class Metadata:
        batch_index, positions = torch.tensor([0]), torch.tensor([2])

    assert write_decode_attention_inputs(attention, q, k, k.clone(), angles.cos(), angles.sin(), cache, Metadata) is None
    assert torch.equal(cache.layers[attention.layer_idx].keys, keys)
    sparse = next(module for module in model.modules() if isinstance(module, MiniMaxM3Attention) and module.is_sparse)
    index_keys = cache.layers[sparse.layer_idx].index_keys.clone()
    config = model.config
    query = torch.randn(1, config.index_n_heads * config.index_head_dim)
    key = torch.randn(1, config.index_head_dim)
    assert write_decode_index_inputs(sparse, query, key, angles.cos(), angles.sin(), cache, Metadata,
                                     config.index_dtype) is None
    assert torch.equal(cache.layers[sparse.layer_idx].index_keys.float(), index_keys.float())
