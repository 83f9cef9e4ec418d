"""The dynamic-shape signatures the kernels are compiled for. ``indexer.cute_backend.build_kernel`` uses them for the
runtime and for the CPU compile check alike, so both compile exactly the same kernels.

Every extent and every stride except the unit column stride is dynamic: one compiled kernel serves every batch,
context length, score-buffer pitch and K-cache page stride. The stream is TVM-FFI's environment stream (torch's
current stream at the call).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from ..contract import ERROR_WORDS

__all__ = ["score_kernel_arguments", "topk_kernel_arguments", "plan_kernel_arguments"]


def _dynamic(divisibility: int = 1):
    return cute.sym_int64(divisibility=divisibility)


def _errors():
    return make_fake_tensor(cutlass.Int32, (ERROR_WORDS,), (1,), assumed_align=4)


def _stream():
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def score_kernel_arguments(num_heads: int, exact: bool, tma_stores: bool):
    """Fake (compile-time) arguments of ``PageScoreKernelSm90.__call__``, in its order: ``q`` and ``k_cache`` as the
    caller holds them (the kernel builds its operand views). ``tma_stores``: the score buffer as that variant needs
    it (16-byte aligned base)."""
    operand = cutlass.BFloat16 if exact else cutlass.Float8E4M3FN
    page_stride_divisibility = 8 if exact else 16  # 16 bytes
    q = make_fake_tensor(operand, (cute.sym_int32(), num_heads, 128), (num_heads * 128, 128, 1), assumed_align=16)
    k = make_fake_tensor(operand, (cute.sym_int32(), 128, 128), (_dynamic(page_stride_divisibility), 128, 1),
                         assumed_align=16)
    scores = make_fake_tensor(cutlass.Float32, (cute.sym_int32(), cute.sym_int32()), (_dynamic(), 1),
                              assumed_align=16 if tma_stores else 4)
    block_table = make_fake_tensor(cutlass.Int32, (cute.sym_int32(), cute.sym_int32()), (_dynamic(), 1), assumed_align=4)
    descriptors = make_fake_tensor(cutlass.Int32, (cute.sym_int32(), 4), (4, 1), assumed_align=16)
    num_tasks = make_fake_tensor(cutlass.Int32, (1,), (1,), assumed_align=4)
    return q, k, scores, block_table, descriptors, num_tasks, _errors(), _stream()


def topk_kernel_arguments():
    """Fake arguments of ``TopkSelectKernel.__call__``, in its order."""
    rows = cute.sym_int32()
    scores = make_fake_tensor(cutlass.Float32, (rows, cute.sym_int32()), (_dynamic(), 1), assumed_align=4)
    num_valid_pages = make_fake_tensor(cutlass.Int32, (rows,), (1,), assumed_align=4)
    out = make_fake_tensor(cutlass.Int32, (rows, 16), (16, 1), assumed_align=4)
    return scores, num_valid_pages, out, _errors(), _stream()


def plan_kernel_arguments():
    """Fake arguments of ``TaskPlanKernel.__call__``, in its order: the metadata, the bounds word as two int32, the
    plan's tensors, then the plan shape's sizes as int32 scalars."""
    def vector():
        return make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), (1,), assumed_align=4)

    bounds = make_fake_tensor(cutlass.Int32, (2,), (1,), assumed_align=8)
    descriptors = make_fake_tensor(cutlass.Int32, (cute.sym_int32(), 4), (4, 1), assumed_align=16)
    num_tasks = make_fake_tensor(cutlass.Int32, (1,), (1,), assumed_align=4)
    sizes = tuple(cutlass.Int32(1) for _ in range(9))
    return (vector(), vector(), bounds, vector(), descriptors, num_tasks, _errors(), *sizes, _stream())
