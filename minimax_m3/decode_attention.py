"""Dense attention of one new token per sequence over a long cache on CUDA: flash-decoding.

SDPA's kernels run a decode step's 16 query heads of a KV group over all of the group's keys in one block of
threads: at batch 1 the 4 KV groups of M3 are 4 blocks, and a 32K-token step took 0.64 ms per dense layer (cuDNN,
H200) for 64 MB of keys and values (15 us at the memory's rate). Eagerly, cuDNN also builds a new plan for every
new key length, about 60 ms of host time per step.

Here the cache is split into chunks of ``SPLIT_KEYS`` keys; FlashAttention's variable-length kernel
(``aten::_flash_attention_forward`` with ``seqused_k``) attends each query to each chunk, reading only the chunk's
keys below the sequence's length (GQA native), and the chunks are merged by their log-sum-exps (``split_kv``).
One query row per head and split, 4,096 keys per split: measured against packing a KV group's 16 heads as rows of
its KV head, and against 256 to 4,096 keys per split, it is the fastest or within 2 % of it at batch 1 to 16 over 32K
and 128K (H200, docs/PERFORMANCE.md). Lengths are device tensors and every shape depends only on the cache's
capacity, so a CUDA graph replays it at any length; eager steps run the same kernels.
"""

from __future__ import annotations

import torch

from .fusion import compiled, fuse
from .split_kv import merge_split_outputs

__all__ = ["SPLIT_KEYS", "flash_decode_supported", "flash_decode", "split_queries"]

SPLIT_KEYS = 4096
"""Keys per chunk: a 128K-token cache gives 32 chunks per sequence, 2,048 blocks of one query head at batch 1."""

_layouts = {}


def flash_decode_supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """fp16/bf16 on CUDA with a head dim FlashAttention serves."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and keys.dtype == q.dtype
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def _split_layout(device, batch: int, capacity: int):
    """``(split starts [S], cu_seqlens_q, cu_seqlens_k)`` of a cache shape: they depend on no length, so they are
    built once (before any capture: a graph's warm-up step builds them)."""
    key = (device, batch, capacity)
    layout = _layouts.get(key)
    if layout is None:
        splits = max(1, -(-capacity // SPLIT_KEYS))
        chunk = -(-capacity // splits)
        split_start = torch.arange(splits, device=device, dtype=torch.int32) * chunk
        starts = (torch.arange(batch, device=device, dtype=torch.int32)[:, None] * capacity + split_start).flatten()
        cu_seqlens_k = torch.cat([starts, torch.full((1,), batch * capacity, device=device, dtype=torch.int32)])
        cu_seqlens_q = torch.arange(batch * splits + 1, device=device, dtype=torch.int32)
        layout = _layouts[key] = (split_start, cu_seqlens_q, cu_seqlens_k)
    return layout


def split_queries(q: torch.Tensor, kv_lengths: torch.Tensor, split_start: torch.Tensor, chunk: int):
    """``(q [B, H, D] repeated once per split [B * S, H, D], the keys each split holds [B, S] int32)``: a sequence's
    split ``s`` holds ``kv_lengths[b] - split_start[s]`` keys, clamped into ``[0, chunk]``. One compiled kernel on
    CUDA where the eager ops are a cast, a broadcast subtraction, a clamp and a strided copy of the queries (the
    copy alone 2 MB for 4 sequences at 128K)."""
    splits = split_start.shape[0]
    used = (kv_lengths.to(torch.int32)[:, None] - split_start).clamp(0, chunk)
    return q[:, None].expand(-1, splits, -1, -1).reshape(-1, *q.shape[1:]), used


def flash_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_lengths: torch.Tensor, *,
                 scale: float) -> torch.Tensor:
    """``q [B, H, D]`` (one token per sequence, the last of its ``kv_lengths[b]`` tokens) over ``keys`` / ``values
    [B, C, KV, D]`` (contiguous caches); ``[B, H, D]``."""
    batch, capacity, num_kv_heads, head_dim = keys.shape
    heads = q.shape[1]
    split_start, cu_seqlens_q, cu_seqlens_k = _split_layout(q.device, batch, capacity)
    splits = split_start.shape[0]
    chunk = -(-capacity // splits)
    inputs = compiled("flash_decode_split_queries", split_queries) if fuse(q) else split_queries
    query, used = inputs(q, kv_lengths.to(q.device), split_start, chunk)  # one query per (sequence, split)
    output, lse = torch.ops.aten._flash_attention_forward(
        query, keys.view(batch * capacity, num_kv_heads, head_dim), values.view(batch * capacity, num_kv_heads, head_dim),
        cu_seqlens_q, cu_seqlens_k, 1, chunk, 0.0, False, False, scale=scale,
        seqused_k=used.flatten())[:2]
    partial = output.view(batch, splits, heads, head_dim)
    lse = lse.view(heads, batch, splits).permute(1, 2, 0)  # varlen lse: [H, B * S]
    return merge_split_outputs(partial, lse, q.dtype, valid=used)  # an empty chunk contributes nothing
