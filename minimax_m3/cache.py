"""The MiniMax-M3 cache: K/V per layer and the paged index-K of each sparse layer, addressed by position.

Every sequence of the batch keeps its own tokens at slots equal to their positions (0, 1, 2, ...), whatever
padding the inputs carry, so pages of ``index_block_size`` tokens stay anchored at absolute positions as the
indexer contract requires. Capacity grows geometrically in whole pages. The index-K of a sparse layer is viewed
as ``[batch * pages, page_size, index_head_dim]`` physical pages with the block table ``b * pages + p``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MiniMaxM3Cache"]


class MiniMaxM3Cache:
    """Positional K/V and paged index-K for every layer of one batch."""

    def __init__(self, config, batch_size: int):
        self.config = config
        self.batch_size = batch_size
        self.page_size = config.index_block_size
        self.lengths = [0] * batch_size  # tokens cached per sequence
        self.columns_seen = 0  # input columns consumed so far, padding included (generate() slices by it)
        self.capacity = 0
        self.keys: list = [None] * config.num_hidden_layers
        self.values: list = [None] * config.num_hidden_layers
        self.index_keys: list = [None] * config.num_hidden_layers
        self._block_table = None
        self._block_table_key = None

    # ------------------------------------------------------------- HF-facing
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths) if self.lengths else 0

    def __len__(self) -> int:
        return self.config.num_hidden_layers

    # ------------------------------------------------------------- storage
    def reserve(self, new_lengths: list) -> None:
        """Make room for ``new_lengths`` tokens per sequence (host ints)."""
        needed = max(length + extra for length, extra in zip(self.lengths, new_lengths))
        if needed <= self.capacity:
            return
        pages = -(-needed // self.page_size)
        capacity = max(pages * self.page_size, 2 * self.capacity)
        capacity = -(-capacity // self.page_size) * self.page_size
        for store in (self.keys, self.values, self.index_keys):
            for layer, tensor in enumerate(store):
                if tensor is not None:
                    grown = tensor.new_zeros(tensor.shape[0], capacity, *tensor.shape[2:])
                    grown[:, : tensor.shape[1]] = tensor
                    store[layer] = grown
        self.capacity = capacity

    def write(self, store_name: str, layer: int, values: torch.Tensor, batch_index: torch.Tensor, positions: torch.Tensor):
        """Write packed per-token ``values`` ``[T, ...]`` of ``layer`` at (sequence, position)."""
        store = getattr(self, store_name)
        held = store[layer]
        if held is not None and (held.dtype != values.dtype or held.device != values.device):
            if any(self.lengths):
                # re-allocating would silently drop the cached history
                raise ValueError(
                    f"the cache holds {store_name} of layer {layer} as {held.dtype} on {held.device}, the model now "
                    f"computes {values.dtype} on {values.device}: continue a filled cache with the dtype and device "
                    f"it was filled with (or start a new cache)"
                )
            held = None
        if held is None:
            store[layer] = values.new_zeros(self.batch_size, self.capacity, *values.shape[1:])
        store[layer][batch_index, positions] = values
        return store[layer]

    def advance(self, new_lengths: list, columns: int) -> None:
        """After every layer has written the new tokens (``columns`` input positions, padding included)."""
        self.lengths = [length + extra for length, extra in zip(self.lengths, new_lengths)]
        self.columns_seen += columns

    def index_pages(self, layer: int) -> torch.Tensor:
        """The sparse layer's index-K as physical pages ``[batch * pages, page_size, index_head_dim]``."""
        keys = self.index_keys[layer]
        return keys.view(self.batch_size * (self.capacity // self.page_size), self.page_size, keys.shape[-1])

    def block_table(self, device: torch.device) -> torch.Tensor:
        """``b * pages + p``; built once per capacity and device, shared by every sparse layer."""
        pages = self.capacity // self.page_size
        key = (str(device), pages)
        if self._block_table_key != key:
            self._block_table = torch.arange(self.batch_size * pages, dtype=torch.int32, device=device).view(self.batch_size, pages)
            self._block_table_key = key
        return self._block_table

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every cached sequence ``repeats`` times in place (sequence ``b`` becomes ``b * repeats`` ...
        ``b * repeats + repeats - 1``), as transformers' caches do: e.g. to score several continuations of one
        prefix with a single prefill."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self._take_sequences(torch.arange(self.batch_size).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._take_sequences(beam_idx)

    def _take_sequences(self, index: torch.Tensor) -> None:
        """Keep the cached sequences ``index`` (repeats allowed), in that order."""
        for store in (self.keys, self.values, self.index_keys):
            for layer, tensor in enumerate(store):
                if tensor is not None:
                    store[layer] = tensor.index_select(0, index.to(tensor.device))
        self.lengths = [self.lengths[i] for i in index.tolist()]
        self.batch_size = len(self.lengths)
        self._block_table_key = None

    def layer_device(self, layer: int) -> Optional[torch.device]:
        tensor = self.keys[layer]
        return None if tensor is None else tensor.device
