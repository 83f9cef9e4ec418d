"""A decode step's attention inputs in one kernel: q and k normed and rotated, k and v written into the cache.

Eagerly (and in the model's prefill) attention's inputs are two compiled norm-and-RoPE kernels and two ``index_put``
writes into the cache; in a decode step of a few tokens each is a few microseconds of launch and latency for a few
kilobytes, on the step's longest branch. ``write_decode_attention_inputs`` runs them as one SM90 kernel
(``minimax_m3/kernels/qk_norm_rope_sm90.py``) where it serves the call, the same math in fp32 with the same rounding
to the model dtype between the norm and the rotation; elsewhere the caller takes the unfused path.
``write_decode_index_inputs`` does the same for a sparse layer's index path: its queries and key normed, rotated
and cast to the index dtype, the key written into the index-key cache.
"""

from __future__ import annotations

from typing import Optional

import torch

from indexer.cute_runtime import compile_once, compile_tvm_ffi, dsl_available

__all__ = ["DECODE_INPUTS_MAX_TOKENS", "write_decode_attention_inputs", "write_decode_index_inputs"]

DECODE_INPUTS_MAX_TOKENS = 64
"""Up to this many new tokens (decode and verify steps) take the fused kernel; prefills keep the compiled chains,
which stream long inputs at the copy rate."""

_INDEX_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}
"""The index dtypes the kernel stores: e4m3 by the saturating cast, or bf16 as is."""


def _plain(module: torch.nn.Module) -> bool:
    return not module._forward_pre_hooks and not module._forward_hooks and type(module.weight.data) is torch.Tensor


def _serves(q_norm, k_norm, q, k, v, cos, sin, keys, values, metadata) -> bool:
    """Whether the kernel computes this call as the unfused path does: bf16 heads of 64, 128 or 256 on an SM90 GPU
    without autograd, plain norms of one kind, angles and slots of the kernel's layout, contiguous caches."""
    if not (q.is_cuda and not torch.is_grad_enabled() and 0 < q.shape[0] <= DECODE_INPUTS_MAX_TOKENS
            and dsl_available()):
        return False
    projected = (q, k) if v is None else (q, k, v)
    caches = (keys,) if values is None else (keys, values)
    tensors = (*projected, cos, sin, *caches, metadata.batch_index, metadata.positions, q_norm.weight.data,
               k_norm.weight.data)
    return (all(type(t) is torch.Tensor and t.device == q.device for t in tensors)
            and torch.cuda.get_device_capability(q.device)[0] == 9
            and all(t.dtype == torch.bfloat16 for t in projected)
            and all(t.dtype == keys.dtype and t.is_contiguous() and t.shape == keys.shape for t in caches)
            and q_norm.weight.dtype == k_norm.weight.dtype == torch.bfloat16
            and _plain(q_norm) and _plain(k_norm)
            and q_norm.offset == k_norm.offset and q_norm.eps == k_norm.eps
            and q.shape[-1] in (64, 128, 256)
            and all(t.stride(-1) == 1 and t.stride(-2) == q.shape[-1] for t in projected)
            and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape == (q.shape[0], cos.shape[-1]) and (cos.shape[-1] % (q.shape[-1] // 32)) == 0
            and 2 * cos.shape[-1] <= q.shape[-1]
            and keys.dim() == 4 and keys.shape[2:] == k.shape[1:]
            and metadata.batch_index.dtype == metadata.positions.dtype == torch.int64
            and metadata.batch_index.is_contiguous() and metadata.positions.is_contiguous())


def _launch(q_norm, k_norm, q, k, v, cos, sin, keys, values, metadata, q_out) -> None:
    heads, kv_heads, head_dim, half = q.shape[1], k.shape[1], q.shape[2], cos.shape[-1]
    offset, index_cast = float(q_norm.offset), q_out.dtype == torch.float8_e4m3fn
    with torch.cuda.device(q.device):
        kernel = compile_once(("qk_norm_rope_sm90", heads, kv_heads, head_dim, half, offset, v is not None, index_cast),
                              lambda: _compile(heads, kv_heads, head_dim, half, offset, v is not None, index_cast))
    kernel(q, k, v, q_norm.weight, k_norm.weight, cos, sin, metadata.batch_index, metadata.positions, q_out, keys,
           values, float(q_norm.eps))


def write_decode_attention_inputs(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                  sin: torch.Tensor, cache, metadata) -> Optional[tuple]:
    """``(q normed and rotated [T, Hq, D], the layer's cached keys, its cached values)`` after writing the new
    tokens' normed and rotated ``k`` and their ``v`` at their slots, in one launch; None where the kernel does not
    serve the call (then nothing was written): more than ``DECODE_INPUTS_MAX_TOKENS`` tokens, not bf16 on an SM90
    GPU, no qk norm, a hooked or tensor-parallel norm, or a cache without its stores yet (a first forward)."""
    if not attention.config.use_qk_norm:
        return None
    keys = cache.allocated_store("keys", attention.layer_idx, k.dtype, k.device)
    values = cache.allocated_store("values", attention.layer_idx, v.dtype, v.device)
    if keys is None or values is None or not _serves(attention.q_norm, attention.k_norm, q, k, v, cos, sin, keys,
                                                     values, metadata):
        return None
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(attention.q_norm, attention.k_norm, q, k, v, cos, sin, keys, values, metadata, q_out)
    return q_out, keys, values


def write_decode_index_inputs(attention, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, cache, metadata, index_dtype: str) -> Optional[torch.Tensor]:
    """The index queries ``[T, H_index, D_index]`` normed, rotated and cast to ``index_dtype`` after writing the new
    tokens' index key (``key [T, D_index]``, projected) into the layer's index-key cache the same way, in one
    launch; None where the kernel does not serve the call (then nothing was written), as
    ``write_decode_attention_inputs``, or an index dtype other than e4m3 and bf16. ``query [T, H_index * D_index]``
    is the index query projection."""
    dtype = _INDEX_DTYPES.get(index_dtype)
    if dtype is None or query.dim() != 2 or key.dim() != 2:
        return None
    store = cache.allocated_store("index_keys", attention.layer_idx, dtype, key.device)
    head_dim = key.shape[-1]
    if store is None or store.dim() != 3 or store.shape[-1] != head_dim or query.shape[-1] % head_dim:
        return None
    q, k = query.view(query.shape[0], -1, head_dim), key.view(key.shape[0], 1, head_dim)
    keys = store.view(*store.shape[:2], 1, head_dim)
    if not _serves(attention.index_q_norm, attention.index_k_norm, q, k, None, cos, sin, keys, None, metadata):
        return None
    q_out = torch.empty(q.shape, dtype=dtype, device=q.device)
    _launch(attention.index_q_norm, attention.index_k_norm, q, k, None, cos, sin, keys, None, metadata, q_out)
    return q_out


def _compile(heads, kv_heads, head_dim, half, offset, with_values, index_cast):
    from .kernels.qk_norm_rope_sm90 import QkNormRopeSm90
    from .kernels.signatures import qk_norm_rope_arguments

    return compile_tvm_ffi(QkNormRopeSm90(heads, kv_heads, head_dim, half, offset, with_values, index_cast),
                           qk_norm_rope_arguments(heads, kv_heads, head_dim, half, with_values, index_cast))
