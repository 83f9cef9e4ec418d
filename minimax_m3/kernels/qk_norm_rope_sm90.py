"""A decode step's attention inputs in one launch, in CuTe DSL (SIMT, any SM80+; compiled for SM90).

From the projections of ``T`` tokens (``q [T, Hq, D]``, ``k`` and ``v [T, Hkv, D]``, any row stride, e.g. column
slices of one packed GEMM output): q and k normed per head (RMSNorm in fp32, ``x_hat * (offset + w)`` rounded to
the model dtype, as ``rms_norm``) and rotated (NeoX rotate-half on the first ``2 * half`` dims, as
``apply_partial_rope``; cos and sin ``[T, half]`` fp32), q written to ``q_out [T, Hq, D]``, k and v written into the
cache ``[B, capacity, Hkv, D]`` at (``batch_index[t]``, ``positions[t]``). Eagerly these are two compiled norm kernels
and two ``index_put`` kernels, each a few microseconds of launch and latency for a few kilobytes.

The index path's inputs take the same kernel without ``v`` (``with_values=False``): its queries and its one key
head, normed and rotated, with ``index_cast``: rounded to bf16 and cast to e4m3 by a saturating cast (clamp to
±448), as ``sparse_attention.to_index_dtype`` after ``apply_partial_rope``; the keys into the index-key cache
``[B, capacity, 1, D]``.

CTA ``(token, row block)``: one warp per head row (q's heads, then k's, then v's), ``D / 32`` elements per lane;
a rotation partner lies ``half / (D / 32)`` lanes away and comes by a shuffle. A slot outside the cache is not
written (the cache reserves every position it is given before the forward, so none is).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

__all__ = ["QkNormRopeSm90", "FP8_E4M3_MAX"]

FP8_E4M3_MAX = 448.0


class QkNormRopeSm90:
    """Static configuration: head counts, head dim, the rotated half width, the norm's offset (1 for Gemma's);
    ``with_values``: v is copied into its cache (attention's inputs) or there is no v (the index path's);
    ``index_cast``: q and k are stored as e4m3 by the index path's saturating cast.
    ``__call__`` is the traced host launcher, ``kernel`` the device code."""

    warps_per_cta = 4

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary_half: int, offset: float,
                 with_values: bool = True, index_cast: bool = False):
        if head_dim % 32 != 0 or (head_dim // 32) % 2 != 0 or head_dim // 32 > 8:
            raise ValueError(f"head_dim must be 64, 128 or 256 (an even vector of 2-8 elements per lane), got {head_dim}")
        per_lane = head_dim // 32
        if rotary_half % per_lane != 0 or not 0 <= 2 * rotary_half <= head_dim:
            raise ValueError(f"the rotated half ({rotary_half}) must be a multiple of {per_lane} within half the head dim")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rotary_half = rotary_half
        self.offset = offset
        self.per_lane = per_lane
        self.with_values = with_values
        self.index_cast = index_cast
        self.rows = num_heads + (2 if with_values else 1) * num_kv_heads

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T, Hq, D) bf16, any row stride
        mK: cute.Tensor,  # (T, Hkv, D) bf16
        mV,  # (T, Hkv, D) bf16, or None without values
        mQNormWeight: cute.Tensor,  # (D,) bf16 or fp32
        mKNormWeight: cute.Tensor,  # (D,)
        mCos: cute.Tensor,  # (T, half) fp32
        mSin: cute.Tensor,  # (T, half) fp32
        mBatchIndex: cute.Tensor,  # (T,) int64
        mPositions: cute.Tensor,  # (T,) int64
        mQOut: cute.Tensor,  # (T, Hq, D) bf16, or e4m3 with index_cast
        mKeys: cute.Tensor,  # (B, capacity, Hkv, D) bf16, or e4m3 with index_cast
        mValues,  # (B, capacity, Hkv, D) bf16, or None without values
        eps: cutlass.Float32,
        stream,
    ):
        tokens = cute.size(mQ, mode=[0])
        row_blocks = (self.rows + self.warps_per_cta - 1) // self.warps_per_cta
        self.kernel(mQ, mK, mV, mQNormWeight, mKNormWeight, mCos, mSin, mBatchIndex, mPositions, mQOut, mKeys,
                    mValues, eps).launch(grid=(tokens, row_blocks, 1), block=(32 * self.warps_per_cta, 1, 1),
                                         stream=stream)

    @cute.kernel
    def kernel(self, mQ, mK, mV, mQNormWeight, mKNormWeight, mCos, mSin, mBatchIndex, mPositions, mQOut, mKeys,
               mValues, eps: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        token, row_block, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = row_block * self.warps_per_cta + tidx // 32
        batch = cutlass.Int32(mBatchIndex[token])
        position = cutlass.Int32(mPositions[token])
        in_cache = (batch >= 0) & (batch < cute.size(mKeys, mode=[0])) & (position >= 0) & (
            position < cute.size(mKeys, mode=[1]))
        if row < self.num_heads:
            values = self.normed_and_rotated(mQ[token, row, None], mQNormWeight, mCos, mSin, token, lane, eps)
            self.store(mQOut[token, row, None], self.cast_for_output(values, mQ.element_type), lane)
        elif row < self.num_heads + self.num_kv_heads:
            head = row - self.num_heads
            values = self.normed_and_rotated(mK[token, head, None], mKNormWeight, mCos, mSin, token, lane, eps)
            if in_cache:
                self.store(mKeys[batch, position, head, None], self.cast_for_output(values, mK.element_type), lane)
        elif row < self.rows:
            if cutlass.const_expr(self.with_values):
                head = row - self.num_heads - self.num_kv_heads
                if in_cache:
                    self.store(mValues[batch, position, head, None], self.load(mV[token, head, None], lane), lane)

    @cute.jit
    def cast_for_output(self, values, input_type):
        """The rotated row as the store converts it: as is, or (``index_cast``) rounded to the input dtype and
        clamped to e4m3's range, whose conversion then saturates nothing."""
        if cutlass.const_expr(not self.index_cast):
            return values
        rounded = cute.make_rmem_tensor((self.per_lane,), cutlass.Float32)
        rounded.store(values.to(input_type).to(cutlass.Float32))
        for i in cutlass.range_constexpr(self.per_lane):
            value = rounded[i]  # compared, not min / max: a NaN stays NaN, as torch's clamp keeps it
            if value > FP8_E4M3_MAX:
                value = cutlass.Float32(FP8_E4M3_MAX)
            if value < -FP8_E4M3_MAX:
                value = cutlass.Float32(-FP8_E4M3_MAX)
            rounded[i] = value
        return rounded.load()

    @cute.jit
    def load(self, mRow, lane):
        """This lane's ``per_lane`` consecutive elements of a row, as fp32."""
        fragment = cute.make_rmem_tensor((self.per_lane,), mRow.element_type)
        for i in cutlass.range_constexpr(self.per_lane):
            fragment[i] = mRow[lane * self.per_lane + i]
        return fragment.load().to(cutlass.Float32)

    @cute.jit
    def store(self, mRow, values, lane):
        fragment = cute.make_rmem_tensor((self.per_lane,), mRow.element_type)
        fragment.store(values.to(mRow.element_type))
        for i in cutlass.range_constexpr(self.per_lane):
            mRow[lane * self.per_lane + i] = fragment[i]

    @cute.jit
    def normed_and_rotated(self, mRow, mWeight, mCos, mSin, token, lane, eps: cutlass.Float32):
        x = self.load(mRow, lane)
        squares = x * x
        total = cute.arch.warp_reduction(squares.reduce(cute.ReductionOp.ADD, 0.0, 0), lambda a, b: a + b)
        scale = cute.math.rsqrt(total / self.head_dim + eps, fastmath=False)
        weight = self.load(mWeight, lane)
        # rounded to the model dtype between the norm and the rotation, as rms_norm returns it
        normed = (x * scale * (weight + self.offset)).to(mRow.element_type).to(cutlass.Float32)
        if cutlass.const_expr(self.rotary_half == 0):
            return normed
        out = cute.make_rmem_tensor((self.per_lane,), cutlass.Float32)
        out.store(normed)
        lanes_per_half = self.rotary_half // self.per_lane
        partner_lane = lane + lanes_per_half
        if lane >= lanes_per_half:
            partner_lane = lane - lanes_per_half
        for i in cutlass.range_constexpr(self.per_lane):
            partner = cute.arch.shuffle_sync(out[i], partner_lane)  # every lane shuffles, rotated or not
            dim = lane * self.per_lane + i
            if dim < 2 * self.rotary_half:
                frequency = dim
                sign = cutlass.Float32(-1.0)
                if dim >= self.rotary_half:
                    frequency = dim - self.rotary_half
                    sign = cutlass.Float32(1.0)
                out[i] = out[i] * mCos[token, frequency] + partner * sign * mSin[token, frequency]
        return out.load()
