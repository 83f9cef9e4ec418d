"""The dynamic-shape signatures the kernels are compiled for, shared by the CPU compile check and
the runtime so both build exactly the same kernel type.

Every extent and every stride except the unit column stride is dynamic: one compiled kernel serves
every batch, context length, score-buffer pitch and K-cache page stride.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

__all__ = ["score_kernel_fake_arguments", "topk_kernel_fake_arguments"]


def _dynamic(divisibility: int = 1):
    return cute.sym_int64(divisibility=divisibility)


def score_kernel_fake_arguments(exact: bool = False, tma_stores: bool = False):
    """Fake (compile-time) tensors for ``PageScoreKernelSm90.__call__``, in its argument order. ``tma_stores``: the
    score buffer as that variant needs it (16-byte aligned base, as the host converts it)."""
    operand = cutlass.BFloat16 if exact else cutlass.Float8E4M3FN
    page_stride_divisibility = 8 if exact else 16  # 16 bytes
    q = make_fake_tensor(operand, (cute.sym_int32(), 128), (128, 1), assumed_align=16)
    k = make_fake_tensor(operand, (128, 128, cute.sym_int32()), (128, 1, _dynamic(page_stride_divisibility)), assumed_align=16)
    scores = make_fake_tensor(cutlass.Float32, (cute.sym_int32(), cute.sym_int32()), (_dynamic(), 1),
                              assumed_align=16 if tma_stores else 4)
    block_table = make_fake_tensor(cutlass.Int32, (cute.sym_int32(), cute.sym_int32()), (_dynamic(), 1), assumed_align=4)
    descriptors = make_fake_tensor(cutlass.Int32, (cute.sym_int32(), 4), (4, 1), assumed_align=16)
    num_tasks = make_fake_tensor(cutlass.Int32, (1,), (1,), assumed_align=4)
    return q, k, scores, block_table, descriptors, num_tasks, make_fake_stream()


def topk_kernel_fake_arguments():
    """Fake tensors for ``TopkSelectKernel.__call__``, in its argument order."""
    rows = cute.sym_int32()
    scores = make_fake_tensor(cutlass.Float32, (rows, cute.sym_int32()), (_dynamic(), 1), assumed_align=4)
    num_valid_pages = make_fake_tensor(cutlass.Int32, (rows,), (1,), assumed_align=4)
    out = make_fake_tensor(cutlass.Int32, (rows, 16), (16, 1), assumed_align=4)
    return scores, num_valid_pages, out, make_fake_stream()
