"""Dense attention of one new token per sequence over a long cache on CUDA: flash-decoding.

SDPA's kernels run a decode step's 16 query heads of a KV group over all of the group's keys in one block of
threads: at batch 1 the 4 KV groups of M3 are 4 blocks, and a 32K-token step took 0.64 ms per dense layer (cuDNN,
H200) for 64 MB of keys and values (15 us at the memory's rate). Eagerly, cuDNN also builds a new plan for every
new key length, about 60 ms of host time per step.

Here the cache is split into chunks of ``SPLIT_KEYS`` keys; FlashAttention's variable-length kernel
(``aten::_flash_attention_forward`` with ``seqused_k``) attends each query to each chunk, reading only the chunk's
keys below the sequence's length (GQA native), and the chunks' outputs are merged by their log-sum-exps in fp32.
Lengths are device tensors and every shape depends only on the cache's capacity, so a CUDA graph replays it at any
length; eager steps run the same kernels.
"""

from __future__ import annotations

import torch

__all__ = ["SPLIT_KEYS", "flash_decode_supported", "flash_decode"]

SPLIT_KEYS = 2048
"""Keys per chunk: a 128K-token cache gives 64 chunks per KV group, enough blocks for every SM at batch 1."""


def flash_decode_supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """fp16/bf16 on CUDA with a head dim FlashAttention serves."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and keys.dtype == q.dtype
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def flash_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_lengths: torch.Tensor, *,
                 scale: float) -> torch.Tensor:
    """``q [B, H, D]`` (one token per sequence, the last of its ``kv_lengths[b]`` tokens) over ``keys`` / ``values
    [B, C, KV, D]`` (contiguous caches); ``[B, H, D]``."""
    batch, capacity, num_kv_heads, head_dim = keys.shape
    splits = max(1, -(-capacity // SPLIT_KEYS))
    chunk = -(-capacity // splits)
    device = q.device
    split_start = torch.arange(splits, device=device, dtype=torch.int32) * chunk  # [S]
    sequence_start = torch.arange(batch, device=device, dtype=torch.int32) * capacity  # [B]
    starts = (sequence_start[:, None] + split_start[None, :]).flatten()
    cu_seqlens_k = torch.cat([starts, torch.full((1,), batch * capacity, device=device, dtype=torch.int32)])
    used = (kv_lengths.to(device=device, dtype=torch.int32)[:, None] - split_start[None, :]).clamp(0, chunk)  # [B, S]
    cu_seqlens_q = torch.arange(batch * splits + 1, device=device, dtype=torch.int32)
    query = q.repeat_interleave(splits, dim=0)  # [B * S, H, D]
    output, lse = torch.ops.aten._flash_attention_forward(
        query, keys.view(batch * capacity, num_kv_heads, head_dim), values.view(batch * capacity, num_kv_heads, head_dim),
        cu_seqlens_q, cu_seqlens_k, 1, chunk, 0.0, False, False, scale=scale,
        seqused_k=used.flatten().contiguous())[:2]
    heads = q.shape[1]
    lse = lse.reshape(heads, batch * splits).t().float().view(batch, splits, heads)  # varlen: [H, total_q]
    lse = torch.where((used > 0)[:, :, None], lse, float("-inf"))  # an empty chunk contributes nothing
    weights = torch.softmax(lse, dim=1)  # [B, S, H]
    merged = (output.view(batch, splits, heads, head_dim).float() * weights[..., None]).sum(1)
    return merged.to(q.dtype)
