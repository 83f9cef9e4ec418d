"""The page unions the SM90 sparse-attention kernel walks, against a direct per-tile loop."""

import torch

from minimax_m3.sparse_attention_cute import own_cache_slots, page_unions


def _loop_unions(selection, batch_index, pages_per_sequence, tokens_per_tile):
    count_tokens, num_groups, _ = selection.shape
    tiles = -(-count_tokens // tokens_per_tile)
    result = []
    for tile in range(tiles):
        per_group = []
        for group in range(num_groups):
            bits = {}
            for local in range(tokens_per_tile):
                token = tile * tokens_per_tile + local
                if token >= count_tokens:
                    continue
                for page in selection[token, group].tolist():
                    if page >= 0:
                        physical = int(batch_index[token]) * pages_per_sequence + page
                        bits[physical] = bits.get(physical, 0) | (1 << local)
            per_group.append(sorted(bits.items()))
        result.append(per_group)
    return result


def _random_selection(count_tokens, num_groups, topk, max_pages, generator):
    selection = torch.full((count_tokens, num_groups, topk), -1, dtype=torch.int32)
    for token in range(count_tokens):
        for group in range(num_groups):
            pages = torch.randperm(max_pages, generator=generator)[: int(torch.randint(1, topk + 1, (1,), generator=generator))]
            selection[token, group, : len(pages)] = pages.to(torch.int32)
    return selection


def test_page_unions_match_a_loop():
    generator = torch.Generator().manual_seed(0)
    count_tokens, num_groups, topk, pages_per_sequence = 37, 3, 5, 300
    selection = _random_selection(count_tokens, num_groups, topk, 12, generator)
    batch_index = torch.sort(torch.randint(0, 4, (count_tokens,), generator=generator)).values
    batch_index[-1] = 3  # a large physical page id: the top token bit lands in int32's sign bit
    for tokens_per_tile in (8, 4):
        union, count = page_unions(selection, batch_index, pages_per_sequence, tokens_per_tile)
        expected = _loop_unions(selection, batch_index, pages_per_sequence, tokens_per_tile)
        assert union.dtype == torch.int32 and count.dtype == torch.int32
        assert union.shape == (len(expected), num_groups, tokens_per_tile * topk)
        for tile, per_group in enumerate(expected):
            for group, entries in enumerate(per_group):
                assert int(count[tile, group]) == len(entries)
                got = [(int(e) & 0xFFFFFF, (int(e) >> 24) & 0xFF) for e in union[tile, group, : len(entries)]]
                assert got == entries
        wide_union, wide_count = page_unions(selection.long(), batch_index, pages_per_sequence, tokens_per_tile)
        assert torch.equal(wide_union, union) and torch.equal(wide_count, count)


def test_own_cache_slots_are_batch_times_capacity_plus_position():
    batch_index = torch.tensor([0, 0, 2, 5])
    positions = torch.tensor([0, 7, 130, 1023])
    assert own_cache_slots(batch_index, positions, 1024).tolist() == [0, 7, 2178, 6143]


def test_warpgroup_pages_count_a_page_once_per_warpgroup_that_selected_it():
    from minimax_m3.bench_sparse_attention import TILE_TOKENS, WARPGROUP_TOKENS, warpgroup_pages

    generator = torch.Generator().manual_seed(1)
    count_tokens, num_groups, pages_per_sequence = 45, 2, 20
    selection = _random_selection(count_tokens, num_groups, 6, pages_per_sequence, generator)
    batch_index = torch.zeros(count_tokens, dtype=torch.long)
    expected_pages = expected_warpgroup_pages = 0
    for per_group in _loop_unions(selection, batch_index, pages_per_sequence, TILE_TOKENS):
        for entries in per_group:
            expected_pages += len(entries)
            for _, bits in entries:
                tokens = [local for local in range(TILE_TOKENS) if bits >> local & 1]
                expected_warpgroup_pages += len({local // WARPGROUP_TOKENS for local in tokens})
    union, count = page_unions(selection, batch_index, pages_per_sequence, TILE_TOKENS)
    assert warpgroup_pages(union, count) == {"union_pages": expected_pages,
                                             "warpgroup_pages": expected_warpgroup_pages}
    assert expected_pages < expected_warpgroup_pages < 2 * expected_pages  # pages shared within and across warpgroups


def test_the_kernel_takes_m3s_sixteen_heads_per_group_only():
    import pytest

    from minimax_m3.kernels.sparse_attention_sm90 import SparseAttentionSm90, UNION_TOKEN_SHIFT as kernel_shift
    from minimax_m3.sparse_attention_cute import UNION_TOKEN_SHIFT, union_tile_tokens

    assert SparseAttentionSm90(16).tokens_per_tile == 8 == union_tile_tokens(64, 4)
    assert kernel_shift == UNION_TOKEN_SHIFT
    with pytest.raises(ValueError, match="heads_per_group must be 16"):
        SparseAttentionSm90(32)
