"""The dynamic-shape signature the sparse-attention kernel is compiled for, shared by the CPU compile check and
the runtime so both build exactly the same kernel type: the token count, cache size and union width are dynamic;
the head counts and the head dim are static (they are the model's)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

__all__ = ["sparse_attention_fake_arguments"]


def sparse_attention_fake_arguments(num_heads: int = 64, num_kv_heads: int = 4, head_dim: int = 128):
    """Fake (compile-time) tensors for ``SparseAttentionSm90.__call__``, in its argument order."""
    tokens, slots, tiles = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    q = make_fake_tensor(cutlass.BFloat16, (tokens, num_heads, head_dim), (num_heads * head_dim, head_dim, 1), assumed_align=16)
    k = make_fake_tensor(cutlass.BFloat16, (slots, num_kv_heads, head_dim), (num_kv_heads * head_dim, head_dim, 1), assumed_align=16)
    v = make_fake_tensor(cutlass.BFloat16, (slots, num_kv_heads, head_dim), (num_kv_heads * head_dim, head_dim, 1), assumed_align=16)
    o = make_fake_tensor(cutlass.BFloat16, (tokens, num_heads, head_dim), (num_heads * head_dim, head_dim, 1), assumed_align=16)
    union = make_fake_tensor(cutlass.Int32, (tiles, num_kv_heads, cute.sym_int32()), (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    count = make_fake_tensor(cutlass.Int32, (tiles, num_kv_heads), (num_kv_heads, 1), assumed_align=4)
    own_slot = make_fake_tensor(cutlass.Int32, (tokens,), (1,), assumed_align=4)
    return q, k, v, o, union, count, own_slot, cutlass.Float32(0.08838834764831845), make_fake_stream()
