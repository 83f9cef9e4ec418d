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

With an ``activation`` the weights are an MLP's ``[gate | up]`` rows (``[E, 2I, K]``) and ``out [P, I]`` is
``act(gate, up)``: a warp's columns ``j`` take weight rows ``j`` and ``I + j`` and apply the activation to their fp32
sums, so the gated projection needs no activation pass after it.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

__all__ = ["CONFIGURATIONS", "ExpertTokenSumSm90", "GroupedGemvSm90"]


@cute.jit
def load_vector(mRow, k, vector: cutlass.Constexpr):
    """Elements ``k .. k + vector - 1`` of a row (aligned to the vector's bytes) as fp32, by one load."""
    fragment = cute.make_rmem_tensor((vector,), mRow.element_type)
    source = cute.local_tile(mRow, (vector,), (k // vector,))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mRow.element_type,
                               num_bits_per_copy=vector * mRow.element_type.width)
    cute.copy(atom, source, fragment)
    return fragment.load().to(cutlass.Float32)


class GroupedGemvSm90:
    """Static configuration; ``__call__`` is the traced host launcher, ``kernel`` the device code.

    ``columns_per_warp`` output columns per column group, ``k_splits`` warps per group, ``column_groups`` groups per
    CTA, ``rows_per_pass`` rows per pass over the weights. The weight's element type (bf16 or fp32) sets the vector:
    16 bytes of weight per lane per load, the same number of ``x``'s bf16 elements."""

    unroll = 4

    def __init__(self, columns_per_warp: int = 4, k_splits: int = 1, column_groups: int = 2, rows_per_pass: int = 2,
                 activation: tuple = None):
        # activation: None, ("silu_and_mul",) or ("swiglu_oai", alpha, limit, beta) (the model's gated_activation)
        if activation is not None and activation[0] not in ("silu_and_mul", "swiglu_oai"):
            raise ValueError(f"activation must be None, ('silu_and_mul',) or ('swiglu_oai', alpha, limit, beta), "
                             f"got {activation!r}")
        self.activation = activation
        self.gated = activation is not None
        self.columns_per_warp = columns_per_warp
        self.k_splits = k_splits
        self.column_groups = column_groups
        self.rows_per_pass = rows_per_pass
        self.warps = column_groups * k_splits
        self.columns_per_cta = column_groups * columns_per_warp
        self.halves = 2 if self.gated else 1  # weight rows per output column

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
        columns = cute.size(mOut, mode=[1])
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
                cute.make_layout((self.rows_per_pass * self.columns_per_warp * self.halves, self.k_splits,
                                  self.column_groups)), 16)
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
        columns = cute.size(mOut, mode=[1])
        depth = cute.size(mW, mode=[2])
        vector = 128 // mW.element_type.width
        slots = self.rows_per_pass * self.columns_per_warp
        for row_base in cutlass.range(row_begin, row_end, self.rows_per_pass, unroll=1):
            # partial[r, h * columns_per_warp + c]: row r's sum with the weight row of column c's half h (gate, up)
            partial = cute.make_rmem_tensor((self.rows_per_pass, self.columns_per_warp * self.halves), cutlass.Float32)
            for i in cutlass.range_constexpr(slots * self.halves):
                partial[i] = 0.0
            rows = [cutlass.min(row_base + r, row_end - 1) for r in range(self.rows_per_pass)]
            sources = rows
            if cutlass.const_expr(mRowIndex is not None):
                # clamped into x: no index makes the kernel read beyond it
                last = cute.size(mX, mode=[0]) - 1
                sources = [cutlass.max(cutlass.min(cutlass.Int32(mRowIndex[rows[r]]), last), 0)
                           for r in range(self.rows_per_pass)]
            weight_rows = [h * columns + cutlass.min(first_column + c, columns - 1)
                           for h in range(self.halves) for c in range(self.columns_per_warp)]
            for k in cutlass.range((split * 32 + lane) * vector, depth, self.k_splits * 32 * vector,
                                   unroll=self.unroll):
                weights = [load_vector(mW[expert, weight_row, None], k, vector) for weight_row in weight_rows]
                for r in cutlass.range_constexpr(self.rows_per_pass):
                    activations = load_vector(mX[sources[r], None], k, vector)
                    for c in cutlass.range_constexpr(self.columns_per_warp * self.halves):
                        products = activations * weights[c]
                        partial[r, c] = partial[r, c] + products.reduce(cute.ReductionOp.ADD, 0.0, 0)
            if cutlass.const_expr(self.k_splits == 1):
                for r in cutlass.range_constexpr(self.rows_per_pass):
                    for c in cutlass.range_constexpr(self.columns_per_warp):
                        totals = [cute.arch.warp_reduction(partial[r, h * self.columns_per_warp + c],
                                                           lambda a, b: a + b) for h in range(self.halves)]
                        if (lane == 0) & (row_base + r < row_end) & (first_column + c < columns):
                            mOut[row_base + r, first_column + c] = self.finish(totals).to(mOut.element_type)
            else:
                for r in cutlass.range_constexpr(self.rows_per_pass):
                    for c in cutlass.range_constexpr(self.columns_per_warp * self.halves):
                        total = cute.arch.warp_reduction(partial[r, c], lambda a, b: a + b)
                        if lane == 0:
                            sPartial[(c // self.columns_per_warp * self.rows_per_pass + r) * self.columns_per_warp
                                     + c % self.columns_per_warp, split, group] = total
                cute.arch.barrier()  # every split's sums of this pass are in shared memory
                # lane l < slots of split 0 sums (row, column) l over the splits, in split order
                slot = lane % slots
                row = row_base + slot // self.columns_per_warp
                column = first_column + slot % self.columns_per_warp
                totals = [cutlass.Float32(0.0)] * self.halves
                for h in cutlass.range_constexpr(self.halves):
                    for s in cutlass.range_constexpr(self.k_splits):
                        totals[h] = totals[h] + sPartial[h * slots + slot, s, group]
                if (split == 0) & (lane < slots) & (row < row_end) & (column < columns):
                    mOut[row, column] = self.finish(totals).to(mOut.element_type)
                cute.arch.barrier()  # read before the next pass overwrites them

    @cute.jit
    def finish(self, totals):
        """An output column's value from its fp32 sums: the sum, or the activation of ``(gate, up)``."""
        result = totals[0]
        if cutlass.const_expr(self.gated):
            gate, up = totals[0], totals[1]
            slope = 1.0
            if cutlass.const_expr(self.activation[0] == "swiglu_oai"):
                _, alpha, limit, beta = self.activation
                gate = cutlass.min(gate, cutlass.Float32(limit))
                up = cutlass.max(cutlass.min(up, cutlass.Float32(limit)), cutlass.Float32(-limit)) + beta
                slope = alpha
            sigmoid = 1.0 / (1.0 + cute.math.exp2(gate * (-slope * math.log2(math.e)), fastmath=False))
            result = gate * sigmoid * up
        return result



class ExpertTokenSumSm90:
    """The experts' down projection and the routing weights' token sum in one kernel:
    ``out[t, n] = sum_j route_weights[t, j] * (w[chosen[t, j], n, :] . x[slot_of_pair[t * top_k + j], :])``, fp32
    products and sums, the pairs ``j`` of a token added in order (deterministic), ``out`` in bf16.

    CTA = ``columns_per_cta`` output columns; its warps take the (token, expert) pairs in turn (warp ``w`` pairs
    ``w, w + warps, ...``) and each computes its pair's products with all of the CTA's columns, K over its lanes, so
    a decode step's few pairs load their weights at once. The weighted products meet in shared memory and the
    token sums are added there. At most ``max_pairs`` pairs (the host takes this kernel for at most that many);
    expert ids and slots are clamped into the weights' and rows' ranges."""

    unroll = 4

    def __init__(self, columns_per_cta: int = 8, warps: int = 8, max_pairs: int = 64):
        self.columns_per_cta = columns_per_cta
        self.warps = warps
        self.max_pairs = max_pairs

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (pairs, K) bf16: the activated rows in expert order
        mW: cute.Tensor,  # (experts, N, K) bf16, K contiguous
        mChosen: cute.Tensor,  # (tokens, top_k) int64 expert ids
        mSlotOfPair: cute.Tensor,  # (tokens * top_k,) int64: pair t * top_k + j's row of x
        mRouteWeights: cute.Tensor,  # (tokens, top_k) fp32
        mOut: cute.Tensor,  # (tokens, N) bf16
        stream,
    ):
        column_blocks = (cute.size(mOut, mode=[1]) + self.columns_per_cta - 1) // self.columns_per_cta
        self.kernel(mX, mW, mChosen, mSlotOfPair, mRouteWeights, mOut).launch(
            grid=(column_blocks, 1, 1), block=(32 * self.warps, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mChosen: cute.Tensor, mSlotOfPair: cute.Tensor,
               mRouteWeights: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        column_block, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        sWeighted = cutlass.utils.SmemAllocator().allocate_tensor(
            cutlass.Float32, cute.make_layout((self.columns_per_cta, self.max_pairs)), 16)
        top_k = cute.size(mChosen, mode=[1])
        tokens = cute.size(mOut, mode=[0])
        columns = cute.size(mOut, mode=[1])
        pairs = cutlass.min(tokens * top_k, self.max_pairs)
        last_expert = cute.size(mW, mode=[0]) - 1
        last_row = cute.size(mX, mode=[0]) - 1
        depth = cute.size(mW, mode=[2])
        vector = 128 // mW.element_type.width
        first_column = column_block * self.columns_per_cta
        weight_rows = [cutlass.min(first_column + c, columns - 1) for c in range(self.columns_per_cta)]
        for pair in cutlass.range(warp, pairs, self.warps, unroll=1):
            token = pair // top_k
            choice = pair - token * top_k
            expert = cutlass.max(cutlass.min(cutlass.Int32(mChosen[token, choice]), last_expert), 0)
            row = cutlass.max(cutlass.min(cutlass.Int32(mSlotOfPair[pair]), last_row), 0)
            dots = cute.make_rmem_tensor((self.columns_per_cta,), cutlass.Float32)
            dots.fill(0.0)
            for k in cutlass.range(lane * vector, depth, 32 * vector, unroll=self.unroll):
                activations = load_vector(mX[row, None], k, vector)
                for c in cutlass.range_constexpr(self.columns_per_cta):
                    products = activations * load_vector(mW[expert, weight_rows[c], None], k, vector)
                    dots[c] = dots[c] + products.reduce(cute.ReductionOp.ADD, 0.0, 0)
            route_weight = mRouteWeights[token, choice]
            for c in cutlass.range_constexpr(self.columns_per_cta):
                total = cute.arch.warp_reduction(dots[c], lambda a, b: a + b)
                if lane == 0:
                    sWeighted[c, pair] = total * route_weight
        cute.arch.barrier()  # every pair's weighted products are in shared memory
        for item in cutlass.range(tidx, tokens * self.columns_per_cta, 32 * self.warps, unroll=1):
            token = item // self.columns_per_cta
            c = item - token * self.columns_per_cta
            total = cutlass.Float32(0.0)
            for choice in cutlass.range(top_k, unroll=1):
                pair = token * top_k + choice
                if pair < pairs:
                    total = total + sWeighted[c, pair]
            if first_column + c < columns:
                mOut[token, first_column + c] = total.to(mOut.element_type)


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
