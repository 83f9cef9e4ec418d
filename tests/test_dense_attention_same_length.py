"""A same-length fresh prefill (a training batch) runs dense attention as one SDPA batch, equal to one sequence at a
time."""

import torch

import minimax_m3  # noqa: F401
from eval.default_model import _initialise, tiny_config
from minimax_m3 import MiniMaxM3ForCausalLM
from minimax_m3.dense_attention import dense_attention, is_same_length_fresh_prefill
from minimax_m3.sparse_attention import ForwardMetadata


def metadata(lengths, past=None):
    past = past or [0] * len(lengths)
    starts, offset = [], 0
    for length in lengths:
        starts.append(offset)
        offset += length
    batch_index = torch.cat([torch.full((n,), b) for b, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(past, lengths)])
    return ForwardMetadata(batch_index=batch_index, positions=positions, query_lengths=list(lengths),
                           kv_lengths=[p + n for p, n in zip(past, lengths)], query_starts=starts)


def test_batched_equals_one_sequence_at_a_time():
    generator = torch.Generator().manual_seed(0)
    batch, length, heads, groups, dim = 3, 37, 4, 2, 16
    q = torch.randn(batch * length, heads, dim, generator=generator)
    keys = torch.randn(batch, 40, groups, dim, generator=generator)
    values = torch.randn(batch, 40, groups, dim, generator=generator)
    grid = metadata([length] * batch)
    assert is_same_length_fresh_prefill(grid, batch_size=batch)
    together = dense_attention(q, keys, values, grid, scale=0.25)
    for b in range(batch):
        alone = dense_attention(q[b * length : (b + 1) * length], keys[b : b + 1], values[b : b + 1], metadata([length]),
                                scale=0.25)
        torch.testing.assert_close(together[b * length : (b + 1) * length], alone, atol=1e-6, rtol=1e-6)
    assert not is_same_length_fresh_prefill(metadata([length, length - 1]), batch_size=2)
    assert not is_same_length_fresh_prefill(metadata([4, 4], past=[3, 3]), batch_size=2)


def test_model_batch_equals_each_sequence_alone():
    model = MiniMaxM3ForCausalLM(tiny_config()).float()
    _initialise(model)
    ids = torch.randint(3, 512, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        together = model(ids).logits
        for b in range(3):
            torch.testing.assert_close(together[b : b + 1], model(ids[b : b + 1]).logits, atol=1e-5, rtol=1e-5)
