"""The MiniMax-M3 caches: ``transformers.Cache`` subclasses with one layer object per ``config.layer_types`` entry.

Every sequence of the batch keeps its tokens at slots equal to their positions (0, 1, 2, ...), whatever padding the
inputs carry, so pages of ``index_block_size`` tokens stay anchored at absolute positions as the indexer contract
requires. A full-attention layer holds K/V ``[batch, capacity, kv_heads, head_dim]``; a sparse layer also holds the
index-K ``[batch, capacity, index_head_dim]``, viewed as ``[batch * pages, page_size, index_head_dim]`` physical
pages with the block table ``b * pages + p``. The per-sequence lengths are the cache's (every layer holds the same
tokens).

* ``MiniMaxM3Cache`` grows its capacity geometrically in whole pages (``generate``'s default).
* ``MiniMaxM3StaticCache`` (``cache_implementation="static"``) allocates ``max_cache_len`` rounded up to whole pages
  at its first write and never moves it: its tensors, page layout and block table keep their addresses (what CUDA
  graphs capture); beam reordering copies in place; a forward beyond the capacity raises.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .configuration_minimax_m3 import SPARSE_ATTENTION

__all__ = ["MiniMaxM3Cache", "MiniMaxM3StaticCache", "MiniMaxM3CacheLayer", "MiniMaxM3SparseCacheLayer"]

class MiniMaxM3CacheLayer(CacheLayerMixin):
    """One full-attention layer's K/V by (sequence, position). Written through ``MiniMaxM3Cache.write``."""

    is_croppable = True
    stores = ("keys", "values")

    def __init__(self, **kwargs):
        super().__init__()
        self.lengths = []  # the cache's per-sequence lengths, shared

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None):
        raise TypeError("MiniMax-M3's cache layers are written by (sequence, position) through MiniMaxM3Cache.write, "
                        "not appended with update(): the model keeps each sequence's tokens at their positions")

    def get_seq_length(self) -> int:
        return max(self.lengths, default=0)

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def tensors(self):
        return [(name, getattr(self, name)) for name in self.stores if getattr(self, name) is not None]


class MiniMaxM3SparseCacheLayer(MiniMaxM3CacheLayer):
    """A sparse layer: K/V and the paged index-K."""

    stores = ("keys", "values", "index_keys")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.index_keys: Optional[torch.Tensor] = None


class MiniMaxM3Cache(Cache):
    """Positional K/V and paged index-K for every layer of one batch (capacity grows in whole pages).

    ``batch_size`` may be left out: the first forward sets it."""

    static = False

    def __init__(self, config, batch_size: Optional[int] = None):
        layers = [MiniMaxM3SparseCacheLayer() if kind == SPARSE_ATTENTION else MiniMaxM3CacheLayer()
                  for kind in config.layer_types]
        super().__init__(layers=layers)
        self.config = config
        self.page_size = config.index_block_size
        self.capacity = 0
        self.columns_seen = 0  # input columns consumed so far, padding included (generate() slices by it)
        self._batch = None
        self.lengths = []
        if batch_size is not None:
            self._set_batch(batch_size)
        self._block_table = None
        self._block_table_key = None

    def _set_batch(self, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._batch = batch_size
        self._set_lengths([0] * batch_size)

    def _set_lengths(self, lengths: list) -> None:
        self.lengths = list(lengths)
        for layer in self.layers:
            layer.lengths = self.lengths

    # ------------------------------------------------------------- transformers' Cache API
    @property
    def batch_size(self) -> Optional[int]:
        return self._batch

    @property
    def max_batch_size(self) -> Optional[int]:
        return self._batch

    @property
    def max_cache_len(self) -> int:
        return self.capacity if self.static else -1

    @property
    def is_compileable(self) -> bool:
        return False  # the sparse layers call the indexer: generate must not torch.compile the forward

    @property
    def is_initialized(self) -> bool:
        return self._batch is not None and any(layer.is_initialized for layer in self.layers)

    @property
    def is_sliding(self) -> list:
        return [False] * len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        """Forget every token (the tensors stay allocated)."""
        if self._batch is not None:
            self._set_lengths([0] * self._batch)
        self.columns_seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``|tokens_to_remove|`` columns of every sequence (transformers passes it negative), e.g.
        the rejected candidates of assisted decoding: they were real tokens of every sequence."""
        removed = abs(int(tokens_to_remove))
        if removed == 0:
            return
        if removed > min(self.lengths, default=0) or removed > self.columns_seen:
            raise ValueError(f"cannot crop {removed} tokens: the cache holds {self.lengths} tokens per sequence")
        self._set_lengths([length - removed for length in self.lengths])
        self.columns_seen -= removed

    def activate_past_recording(self, recurrent_states_to_keep: Optional[int] = None, **kwargs) -> None:
        """Assisted decoding asks for it before cropping; a positional cache keeps every token anyway, and this model
        has no recurrent states to keep (transformers >= 5.25 passes ``recurrent_states_to_keep``)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._take_sequences(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._take_sequences(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every cached sequence ``repeats`` times in place (sequence ``b`` becomes ``b * repeats`` ...
        ``b * repeats + repeats - 1``), as transformers' caches do: e.g. to score several continuations of one
        prefix with a single prefill."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self._take_sequences(torch.arange(self._batch or 0).repeat_interleave(repeats))

    def _take_sequences(self, index: torch.Tensor) -> None:
        """Keep the cached sequences ``index`` (repeats allowed), in that order."""
        if self._batch is None:
            return
        index = index.long()
        for layer in self.layers:
            for name, tensor in layer.tensors():
                setattr(layer, name, tensor.index_select(0, index.to(tensor.device)))
        positions = index.tolist()
        self._batch = len(positions)
        self._set_lengths([self.lengths[i] for i in positions])
        self._block_table_key = None

    # ------------------------------------------------------------- storage (the model's side)
    def bind(self, batch_size: int) -> None:
        """The batch of a forward: sets it on a new cache, checks it on a filled one."""
        if self._batch is None:
            self._set_batch(batch_size)
        if batch_size != self._batch:
            raise ValueError(f"past_key_values holds {self._batch} sequences, the inputs have {batch_size}")

    def reserve(self, new_lengths: list) -> None:
        """Make room for ``new_lengths`` tokens per sequence (host ints; capacity only: the cached lengths stay
        until ``advance``)."""
        if self._batch is None:
            self._set_batch(len(new_lengths))
        needed = max(length + extra for length, extra in zip(self.lengths, new_lengths))
        if needed > self.capacity:
            self._grow(needed)

    def _grow(self, needed: int) -> None:
        pages = -(-needed // self.page_size)
        capacity = max(pages * self.page_size, 2 * self.capacity)
        self._move_to_capacity(-(-capacity // self.page_size) * self.page_size)

    def _move_to_capacity(self, capacity: int) -> None:
        """Every store re-allocated with ``capacity`` tokens per sequence, the cached ones copied (the block table
        follows: it is keyed by the pages)."""
        for layer in self.layers:
            for name, tensor in layer.tensors():
                grown = tensor.new_zeros(tensor.shape[0], capacity, *tensor.shape[2:])
                grown[:, : tensor.shape[1]] = tensor
                setattr(layer, name, grown)
        self.capacity = capacity

    def write(self, store_name: str, layer_idx: int, values: torch.Tensor, batch_index: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        """Write packed per-token ``values`` ``[T, ...]`` of ``layer_idx`` at (sequence, position); returns the
        layer's whole store."""
        layer = self.layers[layer_idx]
        held = getattr(layer, store_name)
        if held is not None and (held.dtype != values.dtype or held.device != values.device):
            if any(self.lengths):
                # re-allocating would silently drop the cached history
                raise ValueError(
                    f"the cache holds {store_name} of layer {layer_idx} as {held.dtype} on {held.device}, the model "
                    f"now computes {values.dtype} on {values.device}: continue a filled cache with the dtype and "
                    f"device it was filled with (or start a new cache)"
                )
            held = None
        if held is None:
            held = values.new_zeros(self._batch, self.capacity, *values.shape[1:])
            setattr(layer, store_name, held)
            if store_name == "keys":
                layer.lazy_initialization(values, values)
        held[batch_index, positions] = values
        return held

    def allocated_store(self, store_name: str, layer_idx: int, dtype: torch.dtype,
                        device: torch.device) -> Optional[torch.Tensor]:
        """The layer's whole store ``store_name`` when it is allocated in ``dtype`` on ``device`` (what ``write``
        would write into without re-allocating), else None."""
        held = getattr(self.layers[layer_idx], store_name)
        if held is None or held.dtype != dtype or held.device != device:
            return None
        return held

    def advance(self, new_lengths: list, columns: int) -> None:
        """After every layer has written the new tokens (``columns`` input positions, padding included)."""
        self._set_lengths([length + extra for length, extra in zip(self.lengths, new_lengths)])
        self.columns_seen += columns

    def index_pages(self, layer_idx: int) -> torch.Tensor:
        """The sparse layer's index-K as physical pages ``[batch * pages, page_size, index_head_dim]``."""
        keys = self.layers[layer_idx].index_keys
        return keys.view(self._batch * (self.capacity // self.page_size), self.page_size, keys.shape[-1])

    def block_table(self, device: torch.device) -> torch.Tensor:
        """``b * pages + p``; built once per capacity and device, shared by every sparse layer."""
        pages = self.capacity // self.page_size
        key = (str(device), pages, self._batch)
        if self._block_table_key != key:
            self._block_table = torch.arange(self._batch * pages, dtype=torch.int32, device=device).view(self._batch, pages)
            self._block_table_key = key
        return self._block_table


class MiniMaxM3StaticCache(MiniMaxM3Cache):
    """``MiniMaxM3Cache`` with a capacity fixed up front: ``max_cache_len`` tokens per sequence, rounded up to whole
    pages, allocated at the first write; nothing is ever re-allocated (the base for CUDA-graph decode)."""

    static = True

    def __init__(self, config, max_cache_len: int, batch_size: Optional[int] = None):
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        super().__init__(config, batch_size)
        self.capacity = -(-max_cache_len // self.page_size) * self.page_size

    def _grow(self, needed: int) -> None:
        raise ValueError(f"the static cache holds {self.capacity} tokens per sequence (max_cache_len rounded up to "
                         f"pages of {self.page_size}); this forward needs {needed}: build it with a larger "
                         f"max_cache_len")

    def reallocate(self, max_cache_len: int) -> None:
        """Give the cache a larger fixed capacity between generations (``generate`` continuing it for more tokens
        than it holds): its tensors move, once, and decode graphs captured on it are captured again."""
        capacity = -(-max_cache_len // self.page_size) * self.page_size
        if capacity > self.capacity:
            self._move_to_capacity(capacity)

    def _take_sequences(self, index: torch.Tensor) -> None:
        """In place, so every tensor keeps its address; the batch size cannot change."""
        if self._batch is None:
            return
        if index.numel() != self._batch:
            raise ValueError(f"a static cache keeps its batch of {self._batch} sequences; got {index.numel()} indices")
        index = index.long()
        for layer in self.layers:
            for _, tensor in layer.tensors():
                tensor.copy_(tensor.index_select(0, index.to(tensor.device)))
        self._set_lengths([self.lengths[i] for i in index.tolist()])
