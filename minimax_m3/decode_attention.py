"""Dense attention of one new token per sequence over a long cache on CUDA: flash-decoding.

SDPA's kernels run a decode step's 16 query heads of a KV group over all of the group's keys in one block of
threads: at batch 1 the 4 KV groups of M3 are 4 blocks, and a 32K-token step took 0.64 ms per dense layer (cuDNN,
H200) for 64 MB of keys and values (15 us at the memory's rate). Eagerly, cuDNN also builds a new plan for every
new key length, about 60 ms of host time per step.

Here the cache is split into chunks of ``SPLIT_KEYS`` keys; FlashAttention's variable-length kernel
(``aten::_flash_attention_forward`` with ``seqused_k``) attends each query to each chunk, reading only the chunk's
keys below the sequence's length, and the chunks are merged by their log-sum-exps (``split_kv``). The query heads of
a KV group are packed as query *rows* of that KV head (16 rows of one head instead of 16 heads of one row): the
kernel's blocks are per (row block, head), so each chunk's keys are read by one block per KV head instead of one per
query head. Lengths are device tensors and every shape depends only on the cache's capacity, so a CUDA graph replays
it at any length; eager steps run the same kernels.
"""

from __future__ import annotations

import torch

from .split_kv import merge_split_outputs

__all__ = ["SPLIT_KEYS", "flash_decode_supported", "flash_decode"]

SPLIT_KEYS = 2048
"""Keys per chunk: a 128K-token cache gives 64 chunks per KV group, enough blocks for every SM at batch 1."""

_layouts = {}


def flash_decode_supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """fp16/bf16 on CUDA with a head dim FlashAttention serves."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and keys.dtype == q.dtype
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def _split_layout(device, batch: int, capacity: int, group: int):
    """``(split starts [S], cu_seqlens_q, cu_seqlens_k)`` of a cache shape: they depend on no length, so they are
    built once (before any capture: a graph's warm-up step builds them)."""
    key = (device, batch, capacity, group)
    layout = _layouts.get(key)
    if layout is None:
        splits = max(1, -(-capacity // SPLIT_KEYS))
        chunk = -(-capacity // splits)
        split_start = torch.arange(splits, device=device, dtype=torch.int32) * chunk
        starts = (torch.arange(batch, device=device, dtype=torch.int32)[:, None] * capacity + split_start).flatten()
        cu_seqlens_k = torch.cat([starts, torch.full((1,), batch * capacity, device=device, dtype=torch.int32)])
        cu_seqlens_q = torch.arange(batch * splits + 1, device=device, dtype=torch.int32) * group
        layout = _layouts[key] = (split_start, cu_seqlens_q, cu_seqlens_k)
    return layout


def flash_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_lengths: torch.Tensor, *,
                 scale: float) -> torch.Tensor:
    """``q [B, H, D]`` (one token per sequence, the last of its ``kv_lengths[b]`` tokens) over ``keys`` / ``values
    [B, C, KV, D]`` (contiguous caches); ``[B, H, D]``."""
    batch, capacity, num_kv_heads, head_dim = keys.shape
    heads = q.shape[1]
    group = heads // num_kv_heads
    split_start, cu_seqlens_q, cu_seqlens_k = _split_layout(q.device, batch, capacity, group)
    splits = split_start.shape[0]
    chunk = -(-capacity // splits)
    used = (kv_lengths.to(device=q.device, dtype=torch.int32)[:, None] - split_start).clamp(0, chunk)  # [B, S]
    # row r of KV head g in split s of sequence b: query head g * group + r
    rows = q.view(batch, 1, num_kv_heads, group, head_dim).transpose(2, 3)
    query = rows.expand(batch, splits, group, num_kv_heads, head_dim).reshape(-1, num_kv_heads, head_dim)
    output, lse = torch.ops.aten._flash_attention_forward(
        query, keys.view(batch * capacity, num_kv_heads, head_dim), values.view(batch * capacity, num_kv_heads, head_dim),
        cu_seqlens_q, cu_seqlens_k, group, chunk, 0.0, False, False, scale=scale,
        seqused_k=used.flatten())[:2]
    # views: output [B * S * group, KV, D] as [B, S, KV, group, D]; varlen lse [KV, B * S * group] as [B, S, KV, group]
    partial = output.view(batch, splits, group, num_kv_heads, head_dim).transpose(2, 3)
    lse = lse.view(num_kv_heads, batch, splits, group).permute(1, 2, 0, 3)
    merged = merge_split_outputs(partial, lse, q.dtype, valid=used)  # an empty chunk contributes nothing
    return merged.reshape(batch, heads, head_dim)
