"""Grouped GEMV for the routed experts of a decode step, in CuTe DSL (SIMT, any SM80+; compiled for SM90).

``out[r, n] = sum_k x[r, k] * w[e(r), n, k]``: the rows of ``x`` are (token, expert) pairs in expert order, expert
``e``'s rows end at ``offsets[e]``. A decode step has a few rows per expert, so the work is reading the active
experts' weights once; the grouped GEMM takes 1.2-1.6x their bytes' time at M3's width and 5-8x with 256-wide
experts (docs/PERFORMANCE.md): its tiles of 64+ rows hold a few real ones, and few output tiles leave SMs idle.

CTA ``(column block, slot)``: the slot-th expert that has rows (found by a ballot over ``offsets``; slots beyond the
active experts exit), ``columns_per_warp`` output columns per warp. A warp streams its columns' weight rows once,
16 bytes per lane per load, for ``rows_per_pass`` rows of the expert at a time (fp32 products and sums), then sums
each (row, column) over its lanes by shuffles; lane 0 writes it. Rows past the expert's last are computed on its
last row and not written.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

__all__ = ["GroupedGemvSm90"]


class GroupedGemvSm90:
    """Static configuration; ``__call__`` is the traced host launcher, ``kernel`` the device code."""

    warps = 2
    columns_per_warp = 4
    columns_per_cta = warps * columns_per_warp
    rows_per_pass = 2
    unroll = 4
    vector = 8  # bf16 elements per 16-byte load

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (rows, K) bf16, rows in expert order, K a multiple of 8, 16-byte aligned rows
        mW: cute.Tensor,  # (experts, N, K) bf16, K contiguous
        mOffsets: cute.Tensor,  # (experts,) int32: expert e's rows end at offsets[e]
        mOut: cute.Tensor,  # (rows, N) bf16
        stream,
    ):
        columns = cute.size(mW, mode=[1])
        slots = cutlass.min(cute.size(mW, mode=[0]), cute.size(mX, mode=[0]))
        column_blocks = (columns + self.columns_per_cta - 1) // self.columns_per_cta
        self.kernel(mX, mW, mOffsets, mOut).launch(grid=(column_blocks, slots, 1), block=(32 * self.warps, 1, 1),
                                                   stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mOffsets: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        column_block, slot, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        expert, row_begin, row_end = self.active_expert(mOffsets, cute.size(mX, mode=[0]), slot, lane)
        if expert >= 0:
            self.expert_columns(mX, mW, mOut, expert, row_begin, row_end,
                                column_block * self.columns_per_cta + warp * self.columns_per_warp, lane)

    @cute.jit
    def active_expert(self, mOffsets, rows, slot, lane):
        """``(expert, first row, row end)`` of the ``slot``-th expert with rows, or ``(-1, 0, 0)``: each warp walks
        the offsets 32 experts at a time and counts the experts with rows by ballot."""
        experts = cute.size(mOffsets, mode=[0])
        expert = cutlass.Int32(-1)
        row_begin = cutlass.Int32(0)
        row_end = cutlass.Int32(0)
        seen = cutlass.Int32(0)
        for base in cutlass.range(0, experts, 32, unroll=1):
            candidate = base + lane
            end = cutlass.Int32(0)
            begin = cutlass.Int32(0)
            if candidate < experts:
                # clamped into [0, rows]: no offsets make the kernel read or write beyond its buffers
                end = cutlass.max(cutlass.min(mOffsets[candidate], rows), 0)
                if candidate > 0:
                    begin = cutlass.max(cutlass.min(mOffsets[candidate - 1], end), 0)
            has_rows = end > begin
            ballot = cute.arch.vote_ballot_sync(has_rows)
            rank = seen + cute.arch.popc(ballot & ((cutlass.Int32(1) << lane) - 1))
            found = has_rows & (rank == slot)
            winners = cute.arch.vote_ballot_sync(found)
            if winners != 0:
                source = cute.arch.popc((winners & -winners) - 1)  # the one lane that found it
                expert = cute.arch.shuffle_sync(candidate, source)
                row_begin = cute.arch.shuffle_sync(begin, source)
                row_end = cute.arch.shuffle_sync(end, source)
            seen = seen + cute.arch.popc(ballot)
        return expert, row_begin, row_end

    @cute.jit
    def expert_columns(self, mX, mW, mOut, expert, row_begin, row_end, first_column, lane):
        columns = cute.size(mW, mode=[1])
        depth = cute.size(mW, mode=[2])
        vector = self.vector
        for row_base in cutlass.range(row_begin, row_end, self.rows_per_pass, unroll=1):
            partial = cute.make_rmem_tensor((self.rows_per_pass, self.columns_per_warp), cutlass.Float32)
            for i in cutlass.range_constexpr(self.rows_per_pass * self.columns_per_warp):
                partial[i] = 0.0
            rows = [cutlass.min(row_base + r, row_end - 1) for r in range(self.rows_per_pass)]
            weight_rows = [cutlass.min(first_column + c, columns - 1) for c in range(self.columns_per_warp)]
            for k in cutlass.range(lane * vector, depth, 32 * vector, unroll=self.unroll):
                weights = [self.load_vector(mW[expert, weight_rows[c], None], k) for c in range(self.columns_per_warp)]
                for r in cutlass.range_constexpr(self.rows_per_pass):
                    activations = self.load_vector(mX[rows[r], None], k)
                    for c in cutlass.range_constexpr(self.columns_per_warp):
                        products = activations * weights[c]
                        partial[r, c] = partial[r, c] + products.reduce(cute.ReductionOp.ADD, 0.0, 0)
            for r in cutlass.range_constexpr(self.rows_per_pass):
                for c in cutlass.range_constexpr(self.columns_per_warp):
                    total = cute.arch.warp_reduction(partial[r, c], lambda a, b: a + b)
                    if (lane == 0) & (row_base + r < row_end) & (first_column + c < columns):
                        mOut[row_base + r, first_column + c] = total.to(mOut.element_type)

    @cute.jit
    def load_vector(self, mRow, k):
        """Elements ``k .. k + 7`` of a bf16 row (16-byte aligned) as fp32, by one 16-byte load."""
        fragment = cute.make_rmem_tensor((self.vector,), mRow.element_type)
        source = cute.local_tile(mRow, (self.vector,), (k // self.vector,))
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mRow.element_type, num_bits_per_copy=128)
        cute.copy(atom, source, fragment)
        return fragment.load().to(cutlass.Float32)
