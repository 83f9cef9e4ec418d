"""Grouped GEMV for a decode step's small projections, in CuTe DSL (SIMT, any SM80+; compiled for SM90).

``out[r, n] = sum_k x[i(r), k] * w[e(r), n, k]``: the rows of ``out`` are (token, expert) pairs in expert order,
expert ``e``'s rows end at ``offsets[e]``; with ``offsets`` None every row belongs to the one weight ``w[0]`` (a
router). ``i(r)`` is ``row_index[r]`` (each pair's token, so the tokens are not gathered into pair order first), or
``r`` without a row index.
A decode step has a few rows per weight, so the work is reading the weights once; the grouped GEMM takes 1.2-1.6x
their bytes' time at M3's width and 5-8x with 256-wide experts (docs/PERFORMANCE.md): its tiles of 64+ rows hold a
few real ones, and few output tiles leave SMs idle.

CTA ``(column block, slot)``: the slot-th expert that has rows (found by a ballot over ``offsets``; slots beyond the
active experts exit). Its ``column_groups`` groups of ``k_splits`` warps each own ``columns_per_warp`` output
columns; the warps of a group stream those columns' weight rows, each every ``k_splits``-th 16-byte chunk of K, for
``rows_per_pass`` rows of the expert at a time (fp32 products and sums). Each warp sums a (row, column) over its lanes
by shuffles; with ``k_splits > 1`` the group's partial sums meet in shared memory and are added in split order, so
the result does not depend on timing. Rows past the expert's last are computed on its last row and not written.

Splitting K over the warps of a CTA puts more loads in flight per column: the narrow outputs (a 512-wide expert, a
router of a few experts) have too few columns to fill the SMs one warp per column group.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

__all__ = ["CONFIGURATIONS", "GroupedGemvSm90"]


class GroupedGemvSm90:
    """Static configuration; ``__call__`` is the traced host launcher, ``kernel`` the device code.

    ``columns_per_warp`` output columns per column group, ``k_splits`` warps per group, ``column_groups`` groups per
    CTA, ``rows_per_pass`` rows per pass over the weights. The weight's element type (bf16 or fp32) sets the vector:
    16 bytes of weight per lane per load, the same number of ``x``'s bf16 elements."""

    unroll = 4

    def __init__(self, columns_per_warp: int = 4, k_splits: int = 1, column_groups: int = 2, rows_per_pass: int = 2):
        self.columns_per_warp = columns_per_warp
        self.k_splits = k_splits
        self.column_groups = column_groups
        self.rows_per_pass = rows_per_pass
        self.warps = column_groups * k_splits
        self.columns_per_cta = column_groups * columns_per_warp

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (rows or tokens, K) bf16, K a multiple of the vector, 16-byte aligned rows
        mW: cute.Tensor,  # (experts, N, K) bf16 or fp32, K contiguous
        mOffsets: cute.Tensor,  # (experts,) int32: expert e's rows end at offsets[e]; None: one expert, every row
        mOut: cute.Tensor,  # (rows, N) bf16 or fp32, rows in expert order
        mRowIndex,  # (rows,) int64: the row of x each output row reads; None: the same row
        stream,
    ):
        columns = cute.size(mW, mode=[1])
        slots = 1
        if cutlass.const_expr(mOffsets is not None):
            slots = cutlass.min(cute.size(mW, mode=[0]), cute.size(mOut, mode=[0]))
        column_blocks = (columns + self.columns_per_cta - 1) // self.columns_per_cta
        self.kernel(mX, mW, mOffsets, mOut, mRowIndex).launch(grid=(column_blocks, slots, 1),
                                                              block=(32 * self.warps, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mOffsets: cute.Tensor, mOut: cute.Tensor, mRowIndex):
        tidx, _, _ = cute.arch.thread_idx()
        column_block, slot, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        group = warp // self.k_splits
        split = warp % self.k_splits
        sPartial = None
        if cutlass.const_expr(self.k_splits > 1):
            sPartial = cutlass.utils.SmemAllocator().allocate_tensor(
                cutlass.Float32,
                cute.make_layout((self.rows_per_pass * self.columns_per_warp, self.k_splits, self.column_groups)), 16)
        first_column = column_block * self.columns_per_cta + group * self.columns_per_warp
        if cutlass.const_expr(mOffsets is None):
            self.expert_columns(mX, mW, mOut, mRowIndex, sPartial, 0, 0, cute.size(mOut, mode=[0]), first_column,
                                group, split, lane)
        else:
            expert, row_begin, row_end = self.active_expert(mOffsets, cute.size(mOut, mode=[0]), slot, lane)
            if expert >= 0:  # the same for the whole CTA: its barriers are reached by every warp or none
                self.expert_columns(mX, mW, mOut, mRowIndex, sPartial, expert, row_begin, row_end, first_column,
                                    group, split, lane)

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
    def expert_columns(self, mX, mW, mOut, mRowIndex, sPartial, expert, row_begin, row_end, first_column, group,
                       split, lane):
        columns = cute.size(mW, mode=[1])
        depth = cute.size(mW, mode=[2])
        vector = 128 // mW.element_type.width
        slots = self.rows_per_pass * self.columns_per_warp
        for row_base in cutlass.range(row_begin, row_end, self.rows_per_pass, unroll=1):
            partial = cute.make_rmem_tensor((self.rows_per_pass, self.columns_per_warp), cutlass.Float32)
            for i in cutlass.range_constexpr(slots):
                partial[i] = 0.0
            rows = [cutlass.min(row_base + r, row_end - 1) for r in range(self.rows_per_pass)]
            sources = rows
            if cutlass.const_expr(mRowIndex is not None):
                # clamped into x: no index makes the kernel read beyond it
                last = cute.size(mX, mode=[0]) - 1
                sources = [cutlass.max(cutlass.min(cutlass.Int32(mRowIndex[rows[r]]), last), 0)
                           for r in range(self.rows_per_pass)]
            weight_rows = [cutlass.min(first_column + c, columns - 1) for c in range(self.columns_per_warp)]
            for k in cutlass.range((split * 32 + lane) * vector, depth, self.k_splits * 32 * vector,
                                   unroll=self.unroll):
                weights = [self.load_vector(mW[expert, weight_rows[c], None], k, vector)
                           for c in range(self.columns_per_warp)]
                for r in cutlass.range_constexpr(self.rows_per_pass):
                    activations = self.load_vector(mX[sources[r], None], k, vector)
                    for c in cutlass.range_constexpr(self.columns_per_warp):
                        products = activations * weights[c]
                        partial[r, c] = partial[r, c] + products.reduce(cute.ReductionOp.ADD, 0.0, 0)
            if cutlass.const_expr(self.k_splits == 1):
                for r in cutlass.range_constexpr(self.rows_per_pass):
                    for c in cutlass.range_constexpr(self.columns_per_warp):
                        total = cute.arch.warp_reduction(partial[r, c], lambda a, b: a + b)
                        if (lane == 0) & (row_base + r < row_end) & (first_column + c < columns):
                            mOut[row_base + r, first_column + c] = total.to(mOut.element_type)
            else:
                for r in cutlass.range_constexpr(self.rows_per_pass):
                    for c in cutlass.range_constexpr(self.columns_per_warp):
                        total = cute.arch.warp_reduction(partial[r, c], lambda a, b: a + b)
                        if lane == 0:
                            sPartial[r * self.columns_per_warp + c, split, group] = total
                cute.arch.barrier()  # every split's sums of this pass are in shared memory
                if (split == 0) & (lane < slots):
                    row = row_base + lane // self.columns_per_warp
                    column = first_column + lane % self.columns_per_warp
                    total = cutlass.Float32(0.0)
                    for s in cutlass.range_constexpr(self.k_splits):
                        total = total + sPartial[lane, s, group]
                    if (row < row_end) & (column < columns):
                        mOut[row, column] = total.to(mOut.element_type)
                cute.arch.barrier()  # read before the next pass overwrites them

    @cute.jit
    def load_vector(self, mRow, k, vector: cutlass.Constexpr):
        """Elements ``k .. k + vector - 1`` of a row (aligned to the vector's bytes) as fp32, by one load."""
        fragment = cute.make_rmem_tensor((vector,), mRow.element_type)
        source = cute.local_tile(mRow, (vector,), (k // vector,))
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mRow.element_type,
                                   num_bits_per_copy=vector * mRow.element_type.width)
        cute.copy(atom, source, fragment)
        return fragment.load().to(cutlass.Float32)


CONFIGURATIONS = {
    # (H100, docs/PERFORMANCE.md) one warp per column group where K is short (the presets' 256-wide experts' down
    # projection: 8.6 us against 11.8 split four ways at 1 token)
    "experts": dict(columns_per_warp=4, k_splits=1, column_groups=2, rows_per_pass=2),
    # K split over four warps from 1,024 elements on: 1.7-2.4x faster on the presets' 512-wide gate_up, 2-4 % at M3's width
    "experts_split_k": dict(columns_per_warp=4, k_splits=4, column_groups=2, rows_per_pass=2),
    # fp32 weights, one weight for every row: a router's logits for up to four tokens in one pass
    "router": dict(columns_per_warp=1, k_splits=8, column_groups=1, rows_per_pass=4),
}
"""The configurations the model compiles and launches, by name (the compile check builds each)."""
