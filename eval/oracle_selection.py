"""The attention oracle: sparse layers read, per token and KV group, the pages where dense attention puts the most mass.

No indexer can select better pages by that measure, so this variant bounds what indexer training can reach: the
sparse model with the oracle's pages against dense attention is the smallest gap a trained indexer of the same
``index_topk_blocks`` could leave. The oracle ranks the history pages by ``dense_attention_page_mass`` (the
distillation's target) through the indexer's own top-k (``indexer.topk_select``: forced local page in the last
slot, ``-1`` past a short row's pages), so its selections have the contract's format and only the ranked quantity
differs. It costs a dense attention per sparse layer: an evaluation tool, not a serving path.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from indexer import causal_page_counts, topk_select
from minimax_m3.sparse_attention import dense_attention_page_mass

from .layer_inputs import sparse_attention_layers

__all__ = ["attention_oracle_pages", "attention_oracle_selection"]


def attention_oracle_pages(q: torch.Tensor, keys: torch.Tensor, metadata, *, scale: float, page_size: int,
                           topk: int) -> torch.Tensor:
    """``[T, G, topk]`` int32 page ids: per packed query token (``q [T, heads, D]``, normed and rotated) and KV
    group, its ``topk - 1`` history pages of the most dense attention mass, then its local page. ``keys`` is a
    layer's key store ``[B, capacity, G, D]`` holding every sequence's keys up to its ``metadata.kv_lengths``."""
    num_groups = keys.shape[2]
    selection = torch.full((q.shape[0], num_groups, topk), -1, dtype=torch.int32, device=q.device)
    for sequence, (start, count, kv_length) in enumerate(
            zip(metadata.query_starts, metadata.query_lengths, metadata.kv_lengths)):
        if count == 0:
            continue
        tokens = slice(start, start + count)
        positions = metadata.positions[tokens]
        mass = dense_attention_page_mass(q[tokens], keys[sequence, :kv_length], positions, scale=scale,
                                         page_size=page_size)  # [count, G, pages]
        rows = mass.float().reshape(count * num_groups, mass.shape[-1]).contiguous()
        causal_pages = causal_page_counts(positions, page_size).to(torch.int32).repeat_interleave(num_groups)
        selection[tokens] = topk_select(rows, causal_pages, topk=topk).view(count, num_groups, topk)
    return selection


@contextlib.contextmanager
def attention_oracle_selection(model) -> Iterator[object]:
    """Within the block, ``model``'s sparse layers (in sparse mode) attend to ``attention_oracle_pages`` instead of
    their indexer's selection. The indexer still runs and caches its keys, so the cache a forward leaves is the one
    the model would leave; the layers are restored after the block."""
    layers = sparse_attention_layers(model)

    def oracle(attention):
        indexer_select = attention.cache_index_keys_and_select

        def cache_index_keys_and_select(x, cos, sin, cache, metadata, page_selector):
            indexed = indexer_select(x, cos, sin, cache, metadata, page_selector)
            if indexed is None:  # dense mode: no selection to replace
                return None
            if metadata.step is not None:
                raise ValueError("the attention oracle selects in forwards with host lengths (prefills, chunks, "
                                 "cached continuations), not in captured decode steps: call the model with "
                                 "decode_cuda_graphs=False under the oracle")
            config = attention.config
            with torch.no_grad():
                q, k, _ = attention.query_key_value(x, cos, sin)
                # the values attention writes for these positions itself: the store then holds every key needed
                keys = cache.write("keys", attention.layer_idx, k, metadata.batch_index, metadata.positions)
                return attention_oracle_pages(q, keys, metadata, scale=attention.scale,
                                              page_size=config.index_block_size, topk=config.index_topk_blocks)

        return cache_index_keys_and_select

    for attention in layers:
        attention.cache_index_keys_and_select = oracle(attention)
    try:
        yield model
    finally:
        for attention in layers:
            del attention.cache_index_keys_and_select
