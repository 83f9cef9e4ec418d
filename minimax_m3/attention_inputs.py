"""A decode step's attention inputs in one kernel: q and k normed and rotated, k and v written into the cache.

Eagerly (and in the model's prefill) attention's inputs are two compiled norm-and-RoPE kernels and two ``index_put``
writes into the cache; in a decode step of a few tokens each is a few microseconds of launch and latency for a few
kilobytes, on the step's longest branch. ``write_decode_attention_inputs`` runs them as one SM90 kernel
(``minimax_m3/kernels/qk_norm_rope_sm90.py``) where it serves the call, the same math in fp32 with the same rounding
to the model dtype between the norm and the rotation; elsewhere the caller takes the unfused path.
"""

from __future__ import annotations

from typing import Optional

import torch

from indexer.cute_runtime import compile_once, compile_tvm_ffi, dsl_available

__all__ = ["DECODE_INPUTS_MAX_TOKENS", "write_decode_attention_inputs"]

DECODE_INPUTS_MAX_TOKENS = 64
"""Up to this many new tokens (decode and verify steps) take the fused kernel; prefills keep the compiled chains,
which stream long inputs at the copy rate."""


def _plain(module: torch.nn.Module) -> bool:
    return not module._forward_pre_hooks and not module._forward_hooks and type(module.weight.data) is torch.Tensor


def _serves(attention, q, k, v, cos, sin, keys, values, metadata) -> bool:
    if not (q.is_cuda and not torch.is_grad_enabled() and attention.config.use_qk_norm
            and 0 < q.shape[0] <= DECODE_INPUTS_MAX_TOKENS and dsl_available()):
        return False
    tensors = (q, k, v, cos, sin, keys, values, metadata.batch_index, metadata.positions,
               attention.q_norm.weight.data, attention.k_norm.weight.data)
    return (all(type(t) is torch.Tensor and t.device == q.device for t in tensors)
            and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype == k.dtype == v.dtype == keys.dtype == values.dtype == torch.bfloat16
            and attention.q_norm.weight.dtype == attention.k_norm.weight.dtype == torch.bfloat16
            and _plain(attention.q_norm) and _plain(attention.k_norm)
            and attention.q_norm.offset == attention.k_norm.offset and attention.q_norm.eps == attention.k_norm.eps
            and q.shape[-1] in (64, 128, 256) and all(t.stride(-1) == 1 and t.stride(-2) == q.shape[-1] for t in (q, k, v))
            and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape == (q.shape[0], cos.shape[-1]) and (cos.shape[-1] % (q.shape[-1] // 32)) == 0
            and 2 * cos.shape[-1] <= q.shape[-1]
            and keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape
            and keys.shape[2:] == k.shape[1:]
            and metadata.batch_index.dtype == metadata.positions.dtype == torch.int64
            and metadata.batch_index.is_contiguous() and metadata.positions.is_contiguous())


def write_decode_attention_inputs(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                  sin: torch.Tensor, cache, metadata) -> Optional[tuple]:
    """``(q normed and rotated [T, Hq, D], the layer's cached keys, its cached values)`` after writing the new
    tokens' normed and rotated ``k`` and their ``v`` at their slots, in one launch; None where the kernel does not
    serve the call (then nothing was written): more than ``DECODE_INPUTS_MAX_TOKENS`` tokens, not bf16 on an SM90
    GPU, no qk norm, a hooked or tensor-parallel norm, or a cache without its stores yet (a first forward)."""
    keys = cache.allocated_store("keys", attention.layer_idx, k)
    values = cache.allocated_store("values", attention.layer_idx, v)
    if keys is None or values is None or not _serves(attention, q, k, v, cos, sin, keys, values, metadata):
        return None
    heads, kv_heads, head_dim, half = q.shape[1], k.shape[1], q.shape[2], cos.shape[-1]
    offset = float(attention.q_norm.offset)
    with torch.cuda.device(q.device):
        kernel = compile_once(("qk_norm_rope_sm90", heads, kv_heads, head_dim, half, offset),
                              lambda: _compile(heads, kv_heads, head_dim, half, offset))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kernel(q, k, v, attention.q_norm.weight, attention.k_norm.weight, cos, sin, metadata.batch_index,
           metadata.positions, q_out, keys, values, float(attention.q_norm.eps))
    return q_out, keys, values


def _compile(heads, kv_heads, head_dim, half, offset):
    from .kernels.qk_norm_rope_sm90 import QkNormRopeSm90
    from .kernels.signatures import qk_norm_rope_arguments

    return compile_tvm_ffi(QkNormRopeSm90(heads, kv_heads, head_dim, half, offset),
                           qk_norm_rope_arguments(heads, kv_heads, head_dim, half))
