"""The dynamic-shape signatures the sparse-attention kernels are compiled for, shared by the CPU compile check and
the runtime so both build exactly the same kernel types: token counts, cache sizes, union widths and split counts are
dynamic; the head counts and the head dim are static (they are the model's)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

__all__ = ["sparse_attention_fake_arguments", "sparse_decode_attention_arguments", "grouped_gemv_arguments",
           "qk_norm_rope_arguments", "decode_routing_arguments"]

SCALE = 0.08838834764831845


def _bf16_rows(tokens, num_heads: int, head_dim: int):
    return make_fake_tensor(cutlass.BFloat16, (tokens, num_heads, head_dim), (num_heads * head_dim, head_dim, 1),
                            assumed_align=16)


def sparse_attention_fake_arguments(num_heads: int = 64, num_kv_heads: int = 4, head_dim: int = 128):
    """Fake (compile-time) tensors for ``SparseAttentionSm90(decode=False).__call__``, in its argument order
    (compiled for TVM-FFI calls: the stream is torch's current one): the cache flattened to ``[batch * capacity,
    kv_heads, dim]``, the page unions ``[tiles, kv_heads, width]``."""
    tokens, slots, tiles = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    q = _bf16_rows(tokens, num_heads, head_dim)
    k = _bf16_rows(slots, num_kv_heads, head_dim)
    v = _bf16_rows(slots, num_kv_heads, head_dim)
    o = _bf16_rows(tokens, num_heads, head_dim)
    union = make_fake_tensor(cutlass.Int32, (tiles, num_kv_heads, cute.sym_int32()), (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    count = make_fake_tensor(cutlass.Int32, (tiles, num_kv_heads), (num_kv_heads, 1), assumed_align=4)
    own_slot = make_fake_tensor(cutlass.Int32, (tokens,), (1,), assumed_align=4)
    return (q, k, v, o, None, None, union, count, own_slot, None, cutlass.Float32(SCALE),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def sparse_decode_attention_arguments(num_heads: int = 64, num_kv_heads: int = 4, head_dim: int = 128, topk: int = 16):
    """Fake tensors for ``SparseAttentionSm90(decode=True).__call__`` (compiled for TVM-FFI calls: the stream is
    torch's current one): the cache as ``[batch, capacity, kv_heads, dim]``, the merged output ``[T, heads, dim]``,
    the split outputs ``[T, splits, ...]``, the selection ``[T, kv_heads, topk]`` and the arrival counters
    ``[T, kv_heads]``."""
    tokens, batch, capacity, splits = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    q = _bf16_rows(tokens, num_heads, head_dim)
    cache_strides = (cute.sym_int64(divisibility=8), num_kv_heads * head_dim, head_dim, 1)
    k = make_fake_tensor(cutlass.BFloat16, (batch, capacity, num_kv_heads, head_dim), cache_strides, assumed_align=16)
    v = make_fake_tensor(cutlass.BFloat16, (batch, capacity, num_kv_heads, head_dim), cache_strides, assumed_align=16)
    o = _bf16_rows(tokens, num_heads, head_dim)
    split_o = make_fake_tensor(cutlass.Float32, (tokens, splits, num_heads, head_dim),
                               (cute.sym_int64(), num_heads * head_dim, head_dim, 1), assumed_align=16)
    lse = make_fake_tensor(cutlass.Float32, (tokens, splits, num_heads), (cute.sym_int64(), num_heads, 1), assumed_align=4)
    selection = make_fake_tensor(cutlass.Int32, (tokens, num_kv_heads, topk), (num_kv_heads * topk, topk, 1), assumed_align=4)
    own_slot = make_fake_tensor(cutlass.Int32, (tokens,), (1,), assumed_align=4)
    arrivals = make_fake_tensor(cutlass.Int32, (tokens, num_kv_heads), (num_kv_heads, 1), assumed_align=4)
    return (q, k, v, o, split_o, lse, selection, None, own_slot, arrivals, cutlass.Float32(SCALE),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def grouped_gemv_arguments(configuration: str, indexed: bool = False):
    """Fake tensors for ``GroupedGemvSm90.__call__`` in a named configuration (TVM-FFI calls): bf16 rows ``[P, K]``
    with 16-byte aligned rows, weights ``[E, N, K]`` and the output ``[P, N]`` (every extent dynamic, K and N
    multiples of 8), the offsets ``[E]`` int32; bf16 weights and output for the experts, fp32 for the router, whose
    one weight serves every row (no offsets). ``indexed``: x is ``[T, K]`` tokens and a row index ``[P]`` int64
    names each output row's token."""
    grouped = configuration != "router"
    weight_dtype = out_dtype = cutlass.BFloat16 if grouped else cutlass.Float32
    rows, experts, columns, depth = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32(divisibility=8)
    if not grouped:
        experts = 1
    x_rows = cute.sym_int32() if indexed else rows
    x = make_fake_tensor(cutlass.BFloat16, (x_rows, depth), (cute.sym_int64(divisibility=8), 1), assumed_align=16)
    w = make_fake_tensor(weight_dtype, (experts, columns, depth),
                         (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1), assumed_align=16)
    offsets = make_fake_tensor(cutlass.Int32, (experts,), (1,), assumed_align=4) if grouped else None
    out = make_fake_tensor(out_dtype, (rows, columns), (cute.sym_int64(), 1), assumed_align=out_dtype.width // 8)
    row_index = make_fake_tensor(cutlass.Int64, (rows,), (1,), assumed_align=8) if indexed else None
    return x, w, offsets, out, row_index, make_fake_stream(use_tvm_ffi_env_stream=True)


def qk_norm_rope_arguments(num_heads: int = 64, num_kv_heads: int = 4, head_dim: int = 128, rotary_half: int = 32,
                           with_values: bool = True, index_cast: bool = False):
    """Fake tensors for ``QkNormRopeSm90.__call__`` (TVM-FFI calls): q, k and v ``[T, H, D]`` bf16 with a dynamic
    row stride (column slices of one packed projection), the norms' bf16 weights ``[D]``, cos and sin ``[T, half]``
    fp32, the slots ``[T]`` int64, q's output ``[T, Hq, D]`` and the cache ``[B, capacity, Hkv, D]``.
    As ``QkNormRopeSm90``'s options: no v and no value cache without ``with_values``; q's output and the key cache
    e4m3 with ``index_cast``."""
    tokens, batch, capacity = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    stored = cutlass.Float8E4M3FN if index_cast else cutlass.BFloat16

    def projected(heads):
        return make_fake_tensor(cutlass.BFloat16, (tokens, heads, head_dim), (cute.sym_int64(), head_dim, 1),
                                assumed_align=2)

    weight = make_fake_tensor(cutlass.BFloat16, (head_dim,), (1,), assumed_align=2)
    angles = make_fake_tensor(cutlass.Float32, (tokens, rotary_half), (rotary_half, 1), assumed_align=4)
    slots = make_fake_tensor(cutlass.Int64, (tokens,), (1,), assumed_align=8)
    q_out = make_fake_tensor(stored, (tokens, num_heads, head_dim), (num_heads * head_dim, head_dim, 1),
                             assumed_align=16)
    cache_strides = (cute.sym_int64(), num_kv_heads * head_dim, head_dim, 1)

    def cache():
        return make_fake_tensor(stored, (batch, capacity, num_kv_heads, head_dim), cache_strides, assumed_align=16)

    v, values = (projected(num_kv_heads), cache()) if with_values else (None, None)
    return (projected(num_heads), projected(num_kv_heads), v, weight, weight, angles, angles,
            slots, slots, q_out, cache(), values, cutlass.Float32(1e-6), make_fake_stream(use_tvm_ffi_env_stream=True))


def decode_routing_arguments(top_k: int = 4):
    """Fake tensors for ``DecodeRoutingSm90(top_k).__call__`` (TVM-FFI calls): the router's fp32 logits ``[T, E]``
    and the bias ``[E]``, the chosen experts ``[T, top_k]`` int64 and their fp32 weights, the routing plan's
    ``token_of_row`` and ``slot_of_pair`` ``[T * top_k]`` int64 and ``offsets`` ``[E]`` int32; every extent dynamic."""
    tokens, experts, pairs = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    logits = make_fake_tensor(cutlass.Float32, (tokens, experts), (cute.sym_int64(), 1), assumed_align=4)
    bias = make_fake_tensor(cutlass.Float32, (experts,), (1,), assumed_align=4)
    chosen = make_fake_tensor(cutlass.Int64, (tokens, top_k), (top_k, 1), assumed_align=8)
    weights = make_fake_tensor(cutlass.Float32, (tokens, top_k), (top_k, 1), assumed_align=4)
    token_of_row = make_fake_tensor(cutlass.Int64, (pairs,), (1,), assumed_align=8)
    offsets = make_fake_tensor(cutlass.Int32, (experts,), (1,), assumed_align=4)
    slot_of_pair = make_fake_tensor(cutlass.Int64, (pairs,), (1,), assumed_align=8)
    return (logits, bias, chosen, weights, token_of_row, offsets, slot_of_pair, cutlass.Float32(1.0),
            make_fake_stream(use_tvm_ffi_env_stream=True))
