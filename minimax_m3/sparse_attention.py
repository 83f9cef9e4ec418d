"""Page selection (through the indexer) and the attention functions of MiniMax-M3, pluggable by name.

All functions work on packed (varlen) query tokens: ``q`` is ``[T, num_heads, head_dim]`` for the new tokens of
every sequence back to back, with their sequence (``batch_index``) and absolute ``positions``; keys and values come
from the positional cache ``[batch, capacity, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from indexer import BatchPrefillIndexerQ8KV8Wrapper, score_row_pitch

from .sparse_attention_cute import cute_sparse_attention_supported, own_cache_slots, sparse_attention_cute

__all__ = [
    "ForwardMetadata",
    "PageSelector",
    "dense_attention_page_mass",
    "recent_page_selection",
    "sparse_attention_masked",
    "sparse_attention_reference",
    "SPARSE_ATTENTION_FUNCTIONS",
    "get_sparse_attention_function",
    "resolve_auto_implementation",
    "to_index_dtype",
    "DecodeStep",
    "STEP_SPARSE_ATTENTION",
    "host_to_device",
]

_QUERY_CHUNK = 64
_MASK_ELEMENTS = 1 << 24
_FP8_MAX = 448.0


@dataclass
class DecodeStep:
    """The device side of a decode step that a CUDA graph can replay: one new token per sequence over a static cache,
    with every length read from device buffers (``decode_graphs.DecodeGraph`` updates them before each replay).

    Layers given a ``ForwardMetadata`` with ``step`` set use no host length: dense attention spans the cache's
    capacity with a mask of ``kv_lengths``, and the page selector re-plans its own indexer plan on the device
    (``replan``), planned once with the capacity as its bound."""

    kv_lengths: torch.Tensor  # [B] int32: tokens per sequence once the step's token is written
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: 0, 1, ..., B
    capacity: int
    selector: "PageSelector"  # the step's own indexer plan and score buffer, never re-planned by other forwards


@dataclass
class ForwardMetadata:
    """What every layer of one forward shares: packed token layout and per-sequence lengths (host ints; with
    ``step`` set, on the device only, see ``DecodeStep``)."""

    batch_index: torch.Tensor  # [T] sequence of each packed token
    positions: torch.Tensor  # [T] absolute position of each packed token
    query_lengths: list  # new tokens per sequence
    kv_lengths: list  # tokens per sequence after this forward (query tokens included)
    query_starts: list  # packed offset of each sequence's first new token
    planned_devices: set = field(default_factory=set)
    staged_lengths: dict = field(default_factory=dict)  # device -> int32 [query starts..., total, kv lengths...]
    step: Optional[DecodeStep] = None
    derived: dict = field(default_factory=dict)  # tensors every layer of the forward shares (``cache_slots``)

    @property
    def total_tokens(self) -> int:
        return sum(self.query_lengths)

    def to(self, device, non_blocking: bool = False) -> "ForwardMetadata":
        """The same metadata with its tensors on ``device`` (accelerate's hooks call it when a layer of a
        ``device_map`` runs elsewhere); the plan bookkeeping is shared."""
        if self.batch_index.device == torch.device(device):
            return self
        return ForwardMetadata(
            batch_index=self.batch_index.to(device, non_blocking=non_blocking),
            positions=self.positions.to(device, non_blocking=non_blocking),
            query_lengths=self.query_lengths,
            kv_lengths=self.kv_lengths,
            query_starts=self.query_starts,
            planned_devices=self.planned_devices,
            staged_lengths=self.staged_lengths,
            step=self.step,
            derived=self.derived,
        )

    def cache_slots(self, capacity: int) -> torch.Tensor:
        """``[T]`` int32: each token's row in its layer's flattened cache ``[batch * capacity]``, built once per
        forward and device (a decode graph clears ``derived`` per step, so its replay recomputes it)."""
        key = ("cache_slots", self.batch_index.device, capacity)
        slots = self.derived.get(key)
        if slots is None:
            slots = self.derived[key] = own_cache_slots(self.batch_index, self.positions, capacity)
        return slots

    def device_lengths(self, device):
        """``(query starts with the total appended, kv lengths)`` as int32 tensors on ``device``. The model stages
        them when the forward starts: copied from host lists later, mid-forward, the (pageable) copy would wait for
        every kernel queued before it and leave the GPU idle while the host catches up (9 ms of a 32K prefill)."""
        device = torch.device(device)
        if device not in self.staged_lengths:
            staged = next(iter(self.staged_lengths.values()), None)
            if staged is None:
                staged = host_to_device(torch.tensor(self.query_starts + [self.total_tokens] + list(self.kv_lengths),
                                                     dtype=torch.int32), device)
            self.staged_lengths[device] = staged.to(device, non_blocking=True)
        staged = self.staged_lengths[device]
        count = len(self.query_lengths)
        return staged[: count + 1], staged[count + 1 :]


def host_to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on ``device`` without a synchronisation: through pinned memory on CUDA (a pageable copy
    would wait for the queued work), torch's pinned allocator keeping the block until the copy is done."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_index_dtype(x: torch.Tensor, index_dtype: str) -> torch.Tensor:
    """The index path's dtype: e4m3 by a saturating cast (clamp to +-448, no scale), as MiniMax serves it."""
    if index_dtype == "float8_e4m3fn":
        return x.float().clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return x.to(getattr(torch, index_dtype))


def recent_page_selection(positions: torch.Tensor, num_heads: int, *, page_size: int, topk: int) -> torch.Tensor:
    """The sliding-window baseline in the indexer's output format: ``[T, num_heads, topk]`` int32, per token at
    absolute position ``p`` with ``n = p // page_size + 1`` causal pages: ``[0 .. n-1, -1 ..]`` when ``n <= topk``,
    else the ``topk - 1`` pages before the local page, then the local page ``n - 1`` in the last slot."""
    valid = positions.to(torch.int64) // page_size + 1
    slots = torch.arange(topk, device=positions.device)
    window = (valid - topk).clamp(min=0)[:, None] + slots  # the topk most recent pages, oldest first
    selection = torch.where(slots < valid[:, None], window, -1).to(torch.int32)
    return selection[:, None, :].expand(-1, num_heads, -1).contiguous()


class PageSelector:
    """Runs the indexer for the sparse layers: one plan per forward and device, one score buffer per device.

    The score buffer ``[T * H, pitch]`` is owned here and grown geometrically; it is handed to ``plan()`` as
    ``score_out`` so the indexer never allocates per layer. Like the indexer's wrapper it holds mutable state: a
    model (and so its selector) is not safe to share between threads; give each thread its own.
    """

    def __init__(self, config):
        self.config = config
        self._wrappers: Dict[torch.device, BatchPrefillIndexerQ8KV8Wrapper] = {}
        self._score_storage: Dict[torch.device, torch.Tensor] = {}
        self._step_plan_key = None  # what a decode step's plan was built for (``_plan_step``)

    def indexer_backends(self) -> set:
        """The indexer backends (``"torch"``/``"cute"``) that served the last plan on each device (empty before one)."""
        from indexer.wrapper import PlanRequiredError

        backends = set()
        for wrapper in self._wrappers.values():
            try:
                backends.add(wrapper.active_backend)
            except PlanRequiredError:
                continue
        return backends

    def select(self, layer_cache_pages: torch.Tensor, block_table: torch.Tensor, index_q: torch.Tensor,
               metadata: ForwardMetadata) -> torch.Tensor:
        """``[T, H, topk]`` int32 logical page ids for the packed index queries ``index_q [T, H, D]``."""
        if self.config.page_selection == "recent":
            return recent_page_selection(metadata.positions, index_q.shape[1], page_size=self.config.index_block_size,
                                         topk=self.config.index_topk_blocks)
        device = index_q.device
        if metadata.step is not None and metadata.step.selector is not self:
            return metadata.step.selector.select(layer_cache_pages, block_table, index_q, metadata)
        wrapper = self._wrappers.get(device)
        if wrapper is None:
            wrapper = BatchPrefillIndexerQ8KV8Wrapper(
                index_q.shape[1],  # config.index_n_heads, or a tensor-parallel rank's share of them
                backend=self.config.indexer_backend,
                page_size=self.config.index_block_size,
                topk=self.config.index_topk_blocks,
            )
            self._wrappers[device] = wrapper
        if device not in metadata.planned_devices:
            if metadata.step is None:
                self._plan(wrapper, block_table, metadata, device)
            else:
                self._plan_step(wrapper, block_table, metadata.step, device)
            metadata.planned_devices.add(device)
        return wrapper.run(index_q.contiguous(), layer_cache_pages)

    def _plan_step(self, wrapper, block_table, step: DecodeStep, device) -> None:
        """A decode step's plan: built once from the step's buffers with the cache's capacity as its bound (which
        allocates), then re-planned on the device from their current values (what a CUDA graph replays)."""
        key = (device, step.kv_lengths.data_ptr(), block_table.data_ptr(), step.capacity)
        if self._step_plan_key == key:
            wrapper.replan()
            return
        pages = step.capacity // self.config.index_block_size
        rows = step.kv_lengths.shape[0] * wrapper.num_heads
        pitch = score_row_pitch(pages)
        storage = torch.empty(rows * pitch, dtype=torch.float32, device=device)
        self._score_storage[device] = storage
        wrapper.plan(step.cu_seqlens_q, step.kv_lengths, block_table.to(device), total_q=step.kv_lengths.shape[0],
                     max_seqlen_q=1, max_seqlen_k=step.capacity, score_out=storage.view(rows, pitch)[:, :pages])
        self._step_plan_key = key

    def _plan(self, wrapper, block_table, metadata: ForwardMetadata, device) -> None:
        starts, kv_lengths = metadata.device_lengths(device)
        max_kv = max(metadata.kv_lengths)
        pages = -(-max_kv // self.config.index_block_size)
        pitch = score_row_pitch(pages)
        rows = metadata.total_tokens * wrapper.num_heads
        storage = self._score_storage.get(device)
        if storage is None or storage.numel() < rows * pitch:
            capacity = max(rows * pitch, 2 * (0 if storage is None else storage.numel()))
            storage = torch.empty(capacity, dtype=torch.float32, device=device)
            self._score_storage[device] = storage
        wrapper.plan(
            starts,
            kv_lengths,
            block_table.to(device),
            total_q=metadata.total_tokens,
            max_seqlen_q=max(max(metadata.query_lengths), 1),
            max_seqlen_k=max_kv,
            score_out=storage[: rows * pitch].view(rows, pitch)[:, :pages],
            request_lengths=self._request_lengths(metadata),
        )

    @staticmethod
    def _request_lengths(metadata: ForwardMetadata):
        """The host lengths for the indexer's chunk model where they change it: a batched prefill. One request is
        modelled exactly from the bounds, and decode steps (one token each) keep the bounds model, whose result is
        memoised across steps (the exact one costs milliseconds of host time per new batch shape)."""
        if len(metadata.query_lengths) > 1 and max(metadata.query_lengths) > 1:
            return list(zip(metadata.query_lengths, metadata.kv_lengths))
        return None


def dense_attention_page_mass(q, keys, positions, *, scale: float, page_size: int,
                              chunk_elements: int = _MASK_ELEMENTS) -> torch.Tensor:
    """The probability mass dense causal attention puts on each page, per KV group: ``[T, G, pages]``.

    ``q`` is ``[T, heads, D]`` for query tokens of one sequence as attention reads them (normed, rotated),
    ``keys`` ``[S, G, D]`` the sequence's keys at positions ``0 .. S-1``, ``positions`` ``[T]`` the tokens'
    positions; ``pages = ceil(S / page_size)``. Entry ``[t, g, p]`` is the softmax of ``q . k * scale`` over the
    keys ``j <= positions[t]``, summed over the keys of page ``p`` and averaged over the query heads of KV group
    ``g``: each row sums to 1 over the token's causal pages and is 0 after them. This is what the indexer of a
    sparse layer should imitate (the target of its KL training) and what a selection keeps (its recall).
    Computed in float32 (float64 for float64 inputs), at most ``chunk_elements`` logits at once.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_keys, num_groups = keys.shape[0], keys.shape[1]
    if keys.dim() != 3 or keys.shape[2] != head_dim or num_heads % num_groups:
        raise ValueError(f"keys must be [S, G, {head_dim}] with G dividing the {num_heads} query heads, got {tuple(keys.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must have shape [{num_tokens}] (one per query token), got {tuple(positions.shape)}")
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = num_heads // num_groups
    num_pages = -(-num_keys // page_size)
    padded = num_pages * page_size
    key_index = torch.arange(num_keys, device=q.device)
    keys = keys.to(compute)
    token_chunk = max(1, chunk_elements // (num_heads * padded))
    mass = []
    for begin in range(0, num_tokens, token_chunk):
        end = min(num_tokens, begin + token_chunk)
        query = q[begin:end].to(compute).view(end - begin, num_groups, group, head_dim)
        logits = torch.einsum("ngrd,sgd->ngrs", query, keys) * scale
        logits = logits.masked_fill((key_index[None, :] > positions[begin:end, None])[:, None, None, :], float("-inf"))
        probabilities = torch.nn.functional.pad(torch.softmax(logits, dim=-1), (0, padded - num_keys))
        mass.append(probabilities.view(end - begin, num_groups, group, num_pages, page_size).sum(-1).mean(2))
    if not mass:
        return torch.zeros(0, num_groups, num_pages, dtype=compute, device=q.device)
    return torch.cat(mass)


def sparse_attention_reference(q, keys, values, selection, metadata: ForwardMetadata, *, scale: float,
                               page_size: int) -> torch.Tensor:
    """Exact softmax over the keys of each (token, KV group)'s selected pages, token-level causal mask.

    Works on any device; memory is bounded by query chunks (``chunk x topk x page_size`` keys per group).
    """
    output = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    offsets = torch.arange(page_size, device=q.device)
    for begin in range(0, q.shape[0], _QUERY_CHUNK):
        end = min(q.shape[0], begin + _QUERY_CHUNK)
        sequences = metadata.batch_index[begin:end]
        positions = metadata.positions[begin:end]
        pages = selection[begin:end].long()  # [n, G, topk]
        key_positions = (pages.clamp(min=0)[..., None] * page_size + offsets).flatten(2)  # [n, G, topk * page]
        allowed = (pages >= 0)[..., None].expand(*pages.shape, page_size).flatten(2) & (key_positions <= positions[:, None, None])
        key_positions = key_positions.clamp(max=keys.shape[1] - 1)
        gather_sequence = sequences[:, None, None].expand_as(key_positions)
        gather_group = torch.arange(num_kv_heads, device=q.device)[None, :, None].expand_as(key_positions)
        chunk_keys = keys[gather_sequence, key_positions, gather_group].float()  # [n, G, K, D]
        chunk_values = values[gather_sequence, key_positions, gather_group].float()
        query = q[begin:end].float().view(end - begin, num_kv_heads, group, -1)  # [n, G, r, D]
        logits = torch.einsum("ngrd,ngkd->ngrk", query, chunk_keys) * scale
        logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
        probabilities = torch.softmax(logits, dim=-1)
        attended = torch.einsum("ngrk,ngkd->ngrd", probabilities, chunk_values)
        output[begin:end] = attended.reshape(end - begin, num_heads, -1).to(q.dtype)
    return output


def sparse_attention_masked(q, keys, values, selection, metadata: ForwardMetadata, *, scale: float,
                            page_size: int, chunk_elements: int = 1 << 26) -> torch.Tensor:
    """The same attention as ``sparse_attention_reference``, as dense fp32 attention over each sequence's whole
    causal prefix with the unselected pages masked out: matrix products instead of a per-token gather of the
    selected pages, so it is the faster exact path while contexts are short (a few thousand keys per token) and for
    small models. Memory is bounded by query chunks of ``chunk_elements`` logits."""
    output = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    for sequence, (start, count, kv_length) in enumerate(zip(metadata.query_starts, metadata.query_lengths, metadata.kv_lengths)):
        if count == 0:
            continue
        pages = -(-kv_length // page_size)
        key = keys[sequence, :kv_length].float().transpose(0, 1)  # [G, S, D]
        value = values[sequence, :kv_length].float().transpose(0, 1)
        key_positions = torch.arange(kv_length, device=q.device)
        chunk = max(1, chunk_elements // (num_heads * kv_length))
        for begin in range(start, start + count, chunk):
            end = min(start + count, begin + chunk)
            chosen = selection[begin:end].long()  # [n, G, topk]
            selected = torch.zeros(end - begin, num_kv_heads, pages + 1, dtype=torch.bool, device=q.device)
            selected.scatter_(-1, torch.where(chosen >= 0, chosen, pages), True)  # -1 lands in a spare column
            allowed = selected[..., :pages].repeat_interleave(page_size, dim=-1)[..., :kv_length]
            allowed &= key_positions <= metadata.positions[begin:end, None, None]  # [n, G, S]
            query = q[begin:end].float().view(end - begin, num_kv_heads, group, -1).transpose(0, 1)  # [G, n, r, D]
            logits = torch.einsum("gnrd,gsd->gnrs", query, key) * scale
            logits = logits.masked_fill(~allowed.transpose(0, 1)[:, :, None, :], float("-inf"))
            attended = torch.einsum("gnrs,gsd->gnrd", torch.softmax(logits, dim=-1), value)
            output[begin:end] = attended.transpose(0, 1).reshape(end - begin, num_heads, -1).to(q.dtype)
    return output


SPARSE_ATTENTION_FUNCTIONS: Dict[str, Callable] = {"reference": sparse_attention_reference,
                                                   "masked": sparse_attention_masked}


FLEX_MIN_PAGE_SIZE = 128
"""Compiled FlexAttention tiles KV blocks by up to 128 keys; smaller pages go to the reference."""
_FLEX_ROW_TILE = 128


def get_sparse_attention_function(name: str, device: Optional[torch.device] = None, page_size: int = 128) -> Callable:
    """A sparse attention function by name. ``"auto"`` dispatches per call: the SM90 CuTe kernel where it serves the
    geometry (bf16, pages and heads of 128, an H100/H200), else FlexAttention on CUDA for pages of a multiple of 128
    keys, else the reference. All compute the same exact attention; only the speed (and bf16 rounding) differs."""
    if name == "auto":
        return sparse_attention_auto
    if name not in SPARSE_ATTENTION_FUNCTIONS:
        raise ValueError(f"sparse_attention_implementation must be 'auto' or one of {sorted(SPARSE_ATTENTION_FUNCTIONS)}, got {name!r}")
    return SPARSE_ATTENTION_FUNCTIONS[name]


def resolve_auto_implementation(q: torch.Tensor, keys: torch.Tensor, page_size: int, values: torch.Tensor = None) -> str:
    """The implementation ``"auto"`` picks for these inputs (the CuTe kernel has no backward: under autograd
    FlexAttention serves CUDA)."""
    values = keys if values is None else values
    needs_gradients = torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values))
    if cute_sparse_attention_supported(q, keys, page_size) and not needs_gradients:  # forward-only kernel
        return "cute"
    if q.device.type == "cuda" and page_size % FLEX_MIN_PAGE_SIZE == 0:
        return "flex"
    return "reference"


def sparse_attention_auto(q, keys, values, selection, metadata: ForwardMetadata, *, scale: float, page_size: int):
    implementation = resolve_auto_implementation(q, keys, page_size, values)
    if metadata.step is not None and implementation not in STEP_SPARSE_ATTENTION:
        implementation = "reference"  # the same exact attention, from device metadata only
    return SPARSE_ATTENTION_FUNCTIONS[implementation](q, keys, values, selection, metadata, scale=scale, page_size=page_size)


def sparse_attention_flex(q, keys, values, selection, metadata: ForwardMetadata, *, scale: float,
                          page_size: int, query_block: Optional[int] = None) -> torch.Tensor:
    """The same attention as ``sparse_attention_reference`` through FlexAttention, whose cost follows the
    selected pages.

    The query heads of a KV group are packed into the query sequence (row ``t * group + r`` is token ``t``, head
    ``r`` of the group), so FlexAttention runs with one "head" per KV group and a query block of ``query_block``
    rows (default: the least multiple of 128, FlexAttention's row tile, and of ``group``) holds ``query_block /
    group`` tokens (8 at M3's 16 heads per group, 128 at the converted SmolLM2's 3): the block's KV blocks are the
    union of its tokens' selections. A page selected by every token of the block and entirely before its first position is a *full*
    block (no ``mask_mod``); the other selected pages are partial blocks, masked per token by a bit set of its
    selected pages and the causal bound.
    """
    from torch.nn.attention.flex_attention import BlockMask

    output = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    if query_block is None:
        query_block = math.lcm(_FLEX_ROW_TILE, group)
    if query_block % group:
        raise ValueError(f"query_block ({query_block}) must be a multiple of the query heads per KV group ({group})")
    tokens_per_block = query_block // group
    attend = _flex_attention_callable(q.device)
    # autograd needs the transposed (q-block) lists, which FlexAttention derives from full-width kv lists
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values))
    for sequence, (start, count, kv_length) in enumerate(zip(metadata.query_starts, metadata.query_lengths, metadata.kv_lengths)):
        if count == 0:
            continue
        chosen = selection[start : start + count].long()  # [n, G, topk]
        positions = metadata.positions[start : start + count]
        lists, page_bits = _flex_block_lists(chosen, positions, kv_length, page_size, tokens_per_block, full_width=backward)

        def mask_mod(batch, head, q_index, kv_index):
            token = q_index // group
            page = kv_index // page_size
            word = page_bits[head, token, page // 32]
            return (((word >> (page % 32)) & 1) == 1) & (kv_index <= positions[token])

        block_mask = BlockMask.from_kv_blocks(
            *lists, BLOCK_SIZE=(query_block, page_size), mask_mod=mask_mod, seq_lengths=(count * group, kv_length),
            compute_q_blocks=backward,
        )
        query = q[start : start + count].view(count, num_kv_heads, group, -1).transpose(0, 1).reshape(1, num_kv_heads, count * group, -1)
        key = keys[sequence, :kv_length].transpose(0, 1)[None]
        value = values[sequence, :kv_length].transpose(0, 1)[None]
        attended = attend(query, key, value, block_mask=block_mask, scale=scale)  # [1, G, n * group, D]
        output[start : start + count] = attended[0].view(num_kv_heads, count, group, -1).transpose(0, 1).reshape(count, num_heads, -1)
    return output


def _flex_block_lists(chosen: torch.Tensor, positions: torch.Tensor, kv_length: int, page_size: int, tokens_per_block: int,
                      full_width: bool = False):
    """FlexAttention's block lists for packed-GQA query blocks, and each token's selected pages as a bit set.

    ``chosen`` is ``[n, G, topk]`` (``-1`` = no page). Returns ``(kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices)``, each ``[1, G, q_blocks, ...]`` with lists as wide as a block's possible union
    (``tokens_per_block * topk``; every KV block with ``full_width``), and ``page_bits [G, n, ceil(pages / 32)]``
    int32.
    """
    count, num_groups, topk = chosen.shape
    device = chosen.device
    kv_blocks = -(-kv_length // page_size)
    q_blocks = -(-count // tokens_per_block)
    width = kv_blocks if full_width else min(kv_blocks, tokens_per_block * topk)
    padded = torch.full((q_blocks * tokens_per_block, num_groups, topk), -1, dtype=torch.long, device=device)
    padded[:count] = chosen
    block_pages = padded.view(q_blocks, tokens_per_block, num_groups, topk).permute(0, 2, 1, 3).reshape(q_blocks, num_groups, -1)
    # A token selects a page at most once, so a page's multiplicity in its block = the tokens that selected it.
    pages, _ = torch.sort(block_pages, dim=-1)
    first = (pages >= 0) & torch.cat([torch.ones_like(pages[..., :1], dtype=torch.bool), pages[..., 1:] != pages[..., :-1]], dim=-1)
    run = torch.cumsum(first.to(torch.int64), dim=-1) - 1
    votes = torch.zeros_like(pages).scatter_add_(-1, run.clamp(min=0), (pages >= 0).to(torch.int64))
    votes = torch.gather(votes, -1, run.clamp(min=0))  # each page's vote count, at its first occurrence
    block_begin = torch.arange(q_blocks, device=device) * tokens_per_block
    tokens_in_block = (count - block_begin).clamp(max=tokens_per_block)
    first_position = positions[block_begin]
    before_block = (pages + 1) * page_size - 1 <= first_position[:, None, None]
    full = first & (votes == tokens_in_block[:, None, None]) & before_block
    partial = first & ~full

    def compact(keep):
        ordered = torch.sort(torch.where(keep, pages, kv_blocks), dim=-1).values[..., :width]
        if ordered.shape[-1] < width:
            ordered = torch.cat([ordered, ordered.new_full((*ordered.shape[:-1], width - ordered.shape[-1]), kv_blocks)], -1)
        number = keep.sum(-1).to(torch.int32)  # [q_blocks, G]
        indices = torch.where(ordered < kv_blocks, ordered, 0).to(torch.int32)
        return number.transpose(0, 1)[None].contiguous(), indices.transpose(0, 1)[None].contiguous()

    words = -(-kv_blocks // 32)
    valid = chosen >= 0
    page = chosen.clamp(min=0)
    # distinct bits of one word sum to their OR (int64, then bit 31 becomes int32's sign bit)
    bit = torch.where(valid, torch.ones_like(page) << (page % 32), 0)
    page_bits = torch.zeros(count, num_groups, words, dtype=torch.int64, device=device).scatter_add_(2, page // 32, bit)
    page_bits = torch.where(page_bits >= 2**31, page_bits - 2**32, page_bits).to(torch.int32)
    return (*compact(partial), *compact(full)), page_bits.permute(1, 0, 2).contiguous()


_compiled_flex = {}


def _flex_attention_callable(device: torch.device):
    """Compiled FlexAttention on CUDA (its fast path); the unfused eager version elsewhere (tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _compiled_flex:
        _compiled_flex["cuda"] = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex["cuda"]


SPARSE_ATTENTION_FUNCTIONS["flex"] = sparse_attention_flex


SPARSE_ATTENTION_FUNCTIONS["cute"] = sparse_attention_cute

STEP_SPARSE_ATTENTION = ("reference", "cute")
"""The functions that read only device metadata, so a decode step with them can be replayed as a CUDA graph."""
