"""The split-KV merge against one softmax over all keys, and the decode kernel's split count (CPU)."""

import pytest
import torch

from minimax_m3.sparse_attention_cute import DECODE_MAX_SPLITS, decode_splits
from minimax_m3.split_kv import merge_split_outputs


def _split_rows(logits, values, bounds):
    """Per split of the key axis: rows normalised over the split and their log-sum-exp (``-inf`` when empty)."""
    partial, lse = [], []
    for begin, end in zip(bounds[:-1], bounds[1:]):
        part = logits[..., begin:end]
        if end == begin:
            partial.append(torch.zeros(*logits.shape[:-1], values.shape[-1], dtype=torch.float64))
            lse.append(torch.full(logits.shape[:-1], float("-inf"), dtype=torch.float64))
            continue
        partial.append(torch.einsum("nhk,nkd->nhd", torch.softmax(part, -1), values[:, begin:end]))
        lse.append(torch.logsumexp(part, -1))
    return torch.stack(partial, 1), torch.stack(lse, 1)


@pytest.mark.parametrize("bounds", [[0, 7, 7, 20, 64], [0, 64], [0, 1, 2, 3, 64]])
def test_merge_equals_one_softmax_over_every_key(bounds):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 64, generator=generator, dtype=torch.float64) * 4
    values = torch.randn(3, 64, 8, generator=generator, dtype=torch.float64)
    partial, lse = _split_rows(logits, values, bounds)
    expected = torch.einsum("nhk,nkd->nhd", torch.softmax(logits, -1), values)
    torch.testing.assert_close(merge_split_outputs(partial, lse, torch.float64), expected, atol=1e-6, rtol=1e-5)  # fp32 math


def test_merge_ignores_invalid_splits_and_zeroes_rows_without_keys():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 16, generator=generator, dtype=torch.float64)
    values = torch.randn(2, 16, 4, generator=generator, dtype=torch.float64)
    partial, lse = _split_rows(logits, values, [0, 8, 16])
    garbage = partial.clone()
    garbage[:, 1] = float("nan")  # what a split with no keys may hold
    lse_garbage = lse.clone()
    lse_garbage[:, 1] = float("inf")
    valid = torch.tensor([[8, 0], [8, 0]])
    expected = torch.einsum("nhk,nkd->nhd", torch.softmax(logits[..., :8], -1), values[:, :8])
    torch.testing.assert_close(merge_split_outputs(garbage.nan_to_num(0.0), lse_garbage, torch.float64, valid), expected,
                               atol=1e-6, rtol=1e-5)
    empty = merge_split_outputs(partial, torch.full_like(lse, float("-inf")), torch.float32)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_decode_splits_fill_one_wave_of_the_sms_with_at_least_one_page_each():
    assert decode_splits(1, 4, 16, 132) == 16  # 4 groups x 16 splits of one page
    assert decode_splits(4, 4, 16, 132) == 8  # 4 tokens x 4 groups x 8 splits of 2 pages: 128 CTAs
    assert decode_splits(16, 4, 16, 132) == 2  # 16 x 4 x 2 splits of 8 pages
    assert decode_splits(64, 4, 16, 132) == 1
    assert decode_splits(4096, 4, 16, 132) == 1
    for tokens in (1, 2, 3, 5, 8, 9, 100):
        splits = decode_splits(tokens, 4, 16, 132)
        chunk = -(-16 // splits)
        assert (splits - 1) * chunk < 16  # no split is empty
        assert splits == 1 or tokens * 4 * splits <= 132  # one wave


def test_the_decode_path_names_a_bad_selection_or_own_slots_before_any_launch():
    from minimax_m3.sparse_attention_cute import sparse_decode_attention_cute

    q = torch.zeros(3, 64, 128, dtype=torch.bfloat16)
    keys = torch.zeros(2, 256, 4, 128, dtype=torch.bfloat16)
    slots = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="selection must be integer"):
        sparse_decode_attention_cute(q, keys, keys, torch.zeros(3, 2, 16, dtype=torch.int32), slots, scale=0.1)
    with pytest.raises(ValueError, match="selection must be integer"):
        sparse_decode_attention_cute(q, keys, keys, torch.zeros(3, 4, 16), slots, scale=0.1)
    with pytest.raises(ValueError, match="own_slots must be int32"):
        sparse_decode_attention_cute(q, keys, keys, torch.zeros(3, 4, 16, dtype=torch.int32), slots.long(), scale=0.1)
    with pytest.raises(ValueError, match="own_slots must be int32"):
        sparse_decode_attention_cute(q, keys, keys, torch.zeros(3, 4, 16, dtype=torch.int32), slots[:2], scale=0.1)


def test_merging_splits_one_at_a_time_equals_one_softmax_over_every_key():
    from minimax_m3.split_kv import merge_two_splits

    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 64, generator=generator, dtype=torch.float64) * 4
    values = torch.randn(3, 64, 8, generator=generator, dtype=torch.float64)
    partial, lse = _split_rows(logits, values, [0, 5, 5, 30, 64])  # one split without keys
    output, running = partial[:, 0], lse[:, 0]
    for split in range(1, partial.shape[1]):
        output, running = merge_two_splits(output, running, partial[:, split], lse[:, split])
    expected = torch.einsum("nhk,nkd->nhd", torch.softmax(logits, -1), values)
    assert output.dtype == torch.float32
    torch.testing.assert_close(output.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(running.double(), torch.logsumexp(logits, -1), atol=1e-6, rtol=1e-6)


def test_decode_splits_stay_within_what_the_kernel_merges():
    kernel = pytest.importorskip("minimax_m3.kernels.sparse_attention_sm90", reason="needs nvidia-cutlass-dsl")
    assert kernel.SparseAttentionSm90.max_splits == DECODE_MAX_SPLITS
    for topk in (1, 4, 16, 32, 64):
        assert decode_splits(1, 1, topk, 1000) <= DECODE_MAX_SPLITS
