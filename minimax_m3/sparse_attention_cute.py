"""Host side of the SM90 sparse-attention kernel (``minimax_m3/kernels/sparse_attention_sm90.py``): page unions per
query tile, validation, compile cache and launch. Registered as the ``"cute"`` sparse attention function.

The kernel reads K/V straight from the positional cache ``[batch, capacity, kv_heads, dim]`` (physical page ``p`` of
sequence ``b`` is cache rows ``(b * capacity + 128 p) ...``), so nothing is gathered or copied per layer.

Forwards of at most ``DECODE_MAX_QUERY_LENGTH`` new tokens per sequence (decode and verify steps) take the kernel's
split-KV variant: it reads the selection as it is (no union is built, so no sort), splits each token's pages over
CTAs, and the last CTA of a token's splits merges them (no merge launch). Its cost follows the selected pages at any
batch: a tile's 8 tokens then come from 8 sequences, whose union is 8 x 16 pages that one CTA would walk alone.
"""

from __future__ import annotations

import torch

from indexer.cute_runtime import compile_once, compile_tvm_ffi, dsl_available, sm_count

__all__ = ["cute_sparse_attention_supported", "page_unions", "own_cache_slots", "sparse_attention_cute",
           "sparse_decode_attention_cute", "sparse_union_attention_cute", "attend_page_unions", "union_tile_tokens",
           "decode_splits", "decode_arrival_counters", "UNION_TOKEN_SHIFT", "DECODE_MAX_QUERY_LENGTH",
           "DECODE_MAX_SPLITS"]

_PAGE_SIZE = 128
_HEAD_DIM = 128
_TILE_ROWS = 128
_HEADS_PER_GROUP = 16
UNION_TOKEN_SHIFT = 24
"""A union entry is ``physical_page | token_bits << UNION_TOKEN_SHIFT`` (the kernel's ``UNION_TOKEN_SHIFT``)."""
_UNION_PAGE_LIMIT = 1 << UNION_TOKEN_SHIFT
DECODE_MAX_QUERY_LENGTH = 16
"""Forwards with at most this many new tokens per sequence take the split-KV decode kernel."""
DECODE_MAX_SPLITS = 16
"""Splits per token and KV group the decode kernel merges at most (``SparseAttentionSm90.max_splits``)."""

_arrival_counters = {}
_outgrown_arrival_counters = []  # replaced by larger ones; a CUDA graph may still write them, so never freed


def cute_sparse_attention_supported(q: torch.Tensor, keys: torch.Tensor, page_size: int) -> bool:
    """Whether the SM90 kernel serves this geometry: bf16 on an SM90 GPU, pages of 128 keys, head dim 128 and 16
    query heads per KV group (M3's)."""
    if not (q.is_cuda and q.dtype == torch.bfloat16 and keys.dtype == torch.bfloat16 and dsl_available()):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return (page_size == _PAGE_SIZE and q.shape[2] == _HEAD_DIM and q.shape[1] == _HEADS_PER_GROUP * keys.shape[2])


def own_cache_slots(batch_index: torch.Tensor, positions: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[T]`` int32: each packed token's row in the flattened cache ``[batch * capacity]`` (its causal bound)."""
    return (batch_index.to(torch.int64) * capacity + positions.to(torch.int64)).to(torch.int32)


def page_unions(selection: torch.Tensor, batch_index: torch.Tensor, pages_per_sequence: int, tokens_per_tile: int):
    """The distinct physical pages each query tile of each KV group reads, and which of its tokens read them.

    ``selection`` is ``[T, G, topk]`` logical page ids (``-1`` = none). Returns ``union [tiles, G, tokens_per_tile
    * topk]`` int32 entries ``physical_page | token_bits << UNION_TOKEN_SHIFT`` (ascending pages first; the rest is
    padding) and ``count [tiles, G]`` int32.
    """
    count_tokens, num_groups, topk = selection.shape
    tiles = -(-count_tokens // tokens_per_tile)
    device = selection.device
    # keys physical_page * 8 + token fit int32: physical pages < 2^24 (sparse_attention_cute checks)
    physical = torch.where(selection >= 0, batch_index.to(torch.int32)[:, None, None] * pages_per_sequence + selection,
                           -1).to(torch.int32)
    if tiles * tokens_per_tile != count_tokens:
        padded = torch.full((tiles * tokens_per_tile, num_groups, topk), -1, dtype=torch.int32, device=device)
        padded[:count_tokens] = physical
        physical = padded
    candidates = physical.view(tiles, tokens_per_tile, num_groups, topk).transpose(1, 2).reshape(tiles, num_groups, -1)
    token_of_candidate = torch.arange(tokens_per_tile, dtype=torch.int32, device=device).repeat_interleave(topk)
    absent = torch.iinfo(torch.int32).max
    keys, _ = torch.sort(torch.where(candidates >= 0, candidates * 8 + token_of_candidate, absent), dim=-1)
    valid = keys != absent
    pages = keys // 8
    first = valid & torch.cat([torch.ones_like(valid[..., :1]), pages[..., 1:] != pages[..., :-1]], dim=-1)
    run = (torch.cumsum(first, dim=-1, dtype=torch.int32) - 1).clamp(min=0).long()
    # a token selects a page at most once, so the bits of one run are distinct and their sum is their OR
    bits = torch.zeros_like(keys).scatter_add_(-1, run, torch.where(valid, 1 << (keys % 8), 0))
    # entry r is run r's page and bits; every key of a run writes the same value, padding lands in the last slot,
    # which is a run only when no key is padding
    token_bits = bits.gather(-1, run).to(torch.int64) << UNION_TOKEN_SHIFT
    entries = torch.where(valid, pages.to(torch.int64) | token_bits, 0)
    entries = torch.where(entries >= 2**31, entries - 2**32, entries).to(torch.int32)
    slot = torch.where(valid, run, keys.shape[-1] - 1)
    union = torch.zeros_like(entries).scatter_(-1, slot, entries)
    return union, first.sum(-1, dtype=torch.int32)


def _check_selection(selection: torch.Tensor, q: torch.Tensor, num_kv_heads: int) -> None:
    if (selection.dim() != 3 or selection.shape[:2] != (q.shape[0], num_kv_heads)
            or selection.dtype not in (torch.int32, torch.int64) or selection.device != q.device):
        raise ValueError(f"selection must be integer [tokens={q.shape[0]}, kv_heads={num_kv_heads}, topk] on "
                         f"{q.device}, got {tuple(selection.shape)} {selection.dtype} on {selection.device}")


def sparse_attention_cute(q, keys, values, selection, metadata, *, scale: float, page_size: int,
                          out: torch.Tensor = None) -> torch.Tensor:
    """The same attention as ``sparse_attention_reference``, by the SM90 kernel (bf16, fp32 softmax)."""
    if not cute_sparse_attention_supported(q, keys, page_size):
        raise ValueError(
            "sparse_attention_implementation='cute' needs bf16 q/k/v on an SM90 GPU with nvidia-cutlass-dsl, pages of "
            f"128 keys, head_dim 128 and 16 query heads per KV group; got q {tuple(q.shape)} {q.dtype} on {q.device}, "
            f"keys {tuple(keys.shape)}, page_size {page_size}"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values)):
        raise ValueError("sparse_attention_implementation='cute' is forward-only: use 'flex' (or 'auto') under autograd")
    batch, capacity, num_kv_heads, head_dim = keys.shape
    if values.shape != keys.shape or not keys.is_contiguous() or not values.is_contiguous():
        raise ValueError(f"keys and values must be contiguous caches of one shape, got {tuple(keys.shape)} and {tuple(values.shape)}")
    _check_selection(selection, q, num_kv_heads)
    pages_per_sequence = capacity // page_size
    if capacity % page_size or batch * capacity >= 2**31 or batch * pages_per_sequence >= _UNION_PAGE_LIMIT:
        raise ValueError(f"the cache [{batch}, {capacity}] must hold whole pages, fewer than 2^31 slots and 2^24 pages")
    if q.shape[0] and max(metadata.query_lengths) <= DECODE_MAX_QUERY_LENGTH:
        return sparse_decode_attention_cute(q, keys, values, selection, metadata.cache_slots(capacity), scale=scale,
                                            out=out)
    return sparse_union_attention_cute(q, keys, values, selection, metadata, scale=scale, out=out)


def sparse_union_attention_cute(q, keys, values, selection, metadata, *, scale: float,
                                out: torch.Tensor = None) -> torch.Tensor:
    """``sparse_attention_cute`` by the page-union kernel, whatever the query lengths (inputs as
    ``sparse_attention_cute`` validates them): what prefills and chunks take."""
    target = out if out is not None and out.is_contiguous() else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return target if out is None else out
    capacity, num_kv_heads = keys.shape[1], keys.shape[2]
    union, count = page_unions(selection, metadata.batch_index, capacity // _PAGE_SIZE,
                               union_tile_tokens(q.shape[1], num_kv_heads))
    attend_page_unions(q, keys, values, union, count, metadata.cache_slots(capacity), scale=scale, out=target)
    if out is None or out is target:
        return target
    return out.copy_(target)


def union_tile_tokens(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per tile of the page-union kernel: its 128 rows are (token, query head of the KV group)."""
    return _TILE_ROWS // (num_heads // num_kv_heads)


def attend_page_unions(q, keys, values, union, count, own_slots, *, scale: float, out: torch.Tensor) -> torch.Tensor:
    """The page-union kernel alone, on unions ``page_unions`` built for tiles of ``union_tile_tokens`` tokens:
    writes the contiguous ``out`` (``q``'s shape) and returns it. Inputs as ``sparse_union_attention_cute`` has them;
    ``own_slots`` is ``metadata.cache_slots(capacity)``."""
    batch, capacity, num_kv_heads, head_dim = keys.shape
    with torch.cuda.device(q.device):
        kernel = compile_once(("sparse_attention_sm90", q.shape[1], num_kv_heads),
                              lambda: _compile_union(q.shape[1], num_kv_heads))
    kernel(q.contiguous(), keys.view(batch * capacity, num_kv_heads, head_dim),
           values.view(batch * capacity, num_kv_heads, head_dim), out, None, None, union, count, own_slots, None,
           scale)
    return out


def decode_splits(num_tokens: int, num_kv_heads: int, topk: int, num_sms: int) -> int:
    """Splits of each token's ``topk`` pages (per KV group) in the decode kernel: CTAs for the SMs' one wave (a CTA
    of every (token, group, split)), at least one page each, no split empty."""
    splits = max(1, min(topk, DECODE_MAX_SPLITS, num_sms // (num_tokens * num_kv_heads)))
    chunk = -(-topk // splits)
    return -(-topk // chunk)


def sparse_decode_attention_cute(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, selection: torch.Tensor,
                                 own_slots: torch.Tensor, *, scale: float, out: torch.Tensor = None) -> torch.Tensor:
    """``sparse_attention_cute`` by the split-KV decode kernel: ``q [T, H, 128]`` bf16 over the cache ``[B, C, KV,
    128]``, ``selection [T, KV, topk]`` logical page ids of each token's sequence (``-1``, or a page beyond the
    capacity: skipped), ``own_slots [T]`` int32 each token's flattened cache slot in ``[0, B * C)``
    (``own_cache_slots``). Shapes, dtypes and devices of ``selection`` and ``own_slots`` are checked here; the
    geometry by ``sparse_attention_cute``."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    _check_selection(selection, q, num_kv_heads)
    if own_slots.shape != (num_tokens,) or own_slots.dtype != torch.int32 or own_slots.device != q.device:
        raise ValueError(f"own_slots must be int32 [tokens={num_tokens}] on {q.device}, got {tuple(own_slots.shape)} "
                         f"{own_slots.dtype} on {own_slots.device}")
    selection = selection.to(torch.int32).contiguous()
    splits = decode_splits(num_tokens, num_kv_heads, selection.shape[2], sm_count(q.device))
    target = (out if out is not None and out.is_contiguous() and out.dtype == q.dtype
              else torch.empty(q.shape, dtype=q.dtype, device=q.device))
    partial = torch.empty(num_tokens, splits, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, splits, num_heads, dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        kernel = compile_once(("sparse_decode_attention_sm90", num_heads, num_kv_heads, selection.shape[2]),
                              lambda: _compile_decode(num_heads, num_kv_heads, selection.shape[2]))
        arrivals = decode_arrival_counters(q.device, num_tokens * num_kv_heads).view(num_tokens, num_kv_heads)
    kernel(q.contiguous(), keys, values, target, partial, lse, selection, None, own_slots, arrivals, scale)
    if out is None or out is target:
        return target
    return out.copy_(target)


def decode_arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` int32 arrival counters for the decode kernel on ``device``'s current stream: zero, and zero again
    after every launch (its last split CTA of a (token, group) resets the group's counter). One buffer per stream,
    grown for more counters; every buffer is kept for the process, the outgrown ones too, since a CUDA graph may
    have captured one. Launches on one stream reuse it in turn; graphs captured on one stream and replayed
    concurrently on different streams would share it."""
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    counters = _arrival_counters.get(key)
    if counters is None or counters.numel() < count:
        if counters is not None:
            _outgrown_arrival_counters.append(counters)
        counters = _arrival_counters[key] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return counters[:count]


def _compile_decode(num_heads: int, num_kv_heads: int, topk: int):
    from .kernels.signatures import sparse_decode_attention_arguments

    kernel = _kernel_class()(num_heads // num_kv_heads, decode=True)
    return compile_tvm_ffi(kernel, sparse_decode_attention_arguments(num_heads, num_kv_heads, _HEAD_DIM, topk))


def _compile_union(num_heads: int, num_kv_heads: int):
    from .kernels.signatures import sparse_attention_fake_arguments

    kernel = _kernel_class()(num_heads // num_kv_heads)
    return compile_tvm_ffi(kernel, sparse_attention_fake_arguments(num_heads, num_kv_heads, _HEAD_DIM))


def _kernel_class():
    from .kernels.sparse_attention_sm90 import SparseAttentionSm90

    return SparseAttentionSm90
