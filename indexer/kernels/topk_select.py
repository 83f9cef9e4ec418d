"""Forced-local-page top-k selection on the GPU, bit for bit the contract's (docs/INDEXER.md).

One warp per score row, several rows per CTA, one launch for all rows. Each lane reads a strided
share of the row's history: the first 16 columns per lane stay in registers, longer rows read the
rest twice. Pass one finds the row's min/max (warp butterflies), pass two builds the 16-bit
quantised keys. A lane sorts its 16 cached keys with a fixed odd-even merge network (branch-free
integer min/max), inserts the keys of any further columns into that sorted list, and parks the list in
shared memory. The warp then takes the top 15 in 15 rounds of one ``redux.sync.max`` over the
lanes' list heads; the winning lane advances its head by one shared-memory read. The arithmetic is
written in PTX with explicit rounding (``sub.rn``, ``div.rn``, ``fma.rn``, ``cvt.rzi``) so no
compiler contraction or approximation can change a key. Keys are held as signed int32 with the top
bit flipped, which keeps the unsigned key order under signed comparisons.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..contract import MAX_PAGES_PER_ROW, QUANT_BIAS, QUANT_LEVELS

__all__ = ["TopkSelectKernel", "MAX_HISTORY_PAGES"]

MAX_HISTORY_PAGES = MAX_PAGES_PER_ROW - 1
_MAX_LEVEL = float(MAX_PAGES_PER_ROW - 1)  # quantised levels are 16-bit, like the page ids
_INT32_MIN = -(2**31)


def _asm_f32(ptx: str, *operands, loc=None, ip=None):
    constraints = "=f," + ",".join("f" for _ in operands)
    values = [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in operands]
    return cutlass.Float32(
        llvm.inline_asm(T.f32(), values, ptx, constraints, has_side_effects=False, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    )


@dsl_user_op
def sub_rn(a, b, *, loc=None, ip=None):
    return _asm_f32("sub.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def fmin(a, b, *, loc=None, ip=None):
    return _asm_f32("min.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None):
    return _asm_f32("div.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None):
    return _asm_f32("fma.rn.f32 $0, $1, $2, $3;", a, b, c, loc=loc, ip=ip)


@dsl_user_op
def truncate_to_u16_level(x, *, loc=None, ip=None):
    """``clamp(trunc(x), 0, 65535)`` as an int32 (cvt.rzi saturates; the clamp bounds the top)."""
    clamped = _asm_f32("min.f32 $0, $1, $2;", x, _MAX_LEVEL, loc=loc, ip=ip)
    return cutlass.Int32(
        llvm.inline_asm(T.i32(), [cutlass.Float32(clamped).ir_value(loc=loc, ip=ip)], "cvt.rzi.sat.u32.f32 $0, $1;",
                        "=r,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                        loc=loc, ip=ip)
    )


@dsl_user_op
def warp_max_s32(value, *, loc=None, ip=None):
    """Max of an int32 over the full warp in one ``redux.sync`` (SM80+)."""
    return cutlass.Int32(
        llvm.inline_asm(T.i32(), [cutlass.Int32(value).ir_value(loc=loc, ip=ip)], "redux.sync.max.s32 $0, $1, 0xffffffff;",
                        "=r,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                        loc=loc, ip=ip)
    )


def odd_even_merge_sort_network(size: int) -> list:
    """Batcher's odd-even merge sort as (i, j) compare-exchange pairs, i < j; ``size`` a power of two."""

    def merge(low, count, stride):
        step = stride * 2
        if step < count:
            yield from merge(low, count, step)
            yield from merge(low + stride, count, step)
            yield from ((i, i + stride) for i in range(low + stride, low + count - stride, step))
        else:
            yield (low, low + stride)

    def sort(low, count):
        if count > 1:
            half = count // 2
            yield from sort(low, half)
            yield from sort(low + half, half)
            yield from merge(low, count, 1)

    if size & (size - 1):
        raise ValueError(f"size must be a power of two, got {size}")
    return list(sort(0, size))


class TopkSelectKernel:
    """``out[r, :] = select(scores[r, :n-1], n = num_valid_pages[r])`` for k = 16 (k - 1 ranked slots)."""

    topk = 16
    warps_per_cta = 4
    cached_per_lane = 16  # rows of up to 512 history pages are read once
    short_row_slots = 8  # rows of up to 256 history pages take a path of half the work

    @cute.jit
    def __call__(
        self,
        mScores: cute.Tensor,  # (rows, pitch) fp32, unit column stride
        mNumValidPages: cute.Tensor,  # (rows,) int32
        mOut: cute.Tensor,  # (rows, 16) int32
        stream,
    ):
        rows = cute.size(mNumValidPages, mode=[0])
        grid = (rows + self.warps_per_cta - 1) // self.warps_per_cta
        self.kernel(mScores, mNumValidPages, mOut).launch(
            grid=(grid, 1, 1), block=(32 * self.warps_per_cta, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mNumValidPages: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        row = cta * self.warps_per_cta + warp
        # (lane, slot, warp): a lane's sorted keys, one bank per lane, so the merge's reads never conflict
        sLists = cutlass.utils.SmemAllocator().allocate_tensor(
            cutlass.Int32, cute.make_layout((32, self.cached_per_lane, self.warps_per_cta)), 16
        )
        if row < cute.size(mNumValidPages, mode=[0]):
            num_valid = mNumValidPages[row]
            if num_valid <= self.topk:
                if lane < self.topk:
                    mOut[row, lane] = lane if lane < num_valid else -1
            elif num_valid - 1 <= 32 * self.short_row_slots:
                self.select_row(mScores, mOut, sLists, row, lane, warp, num_valid, self.short_row_slots)
            else:
                self.select_row(mScores, mOut, sLists, row, lane, warp, num_valid, self.cached_per_lane)

    @cute.jit
    def select_row(self, mScores, mOut, sLists, row, lane, warp, num_valid, slots: cutlass.Constexpr):
        history = num_valid - 1
        # The first slots * 32 scores stay in registers between the two passes; longer rows (only with
        # 16 slots) read the rest twice. A slot past the history loads column history - 1, a real score
        # of the row, so min and max need no masking; its key is masked below.
        cached = cute.make_rmem_tensor((slots,), cutlass.Float32)
        low = cutlass.Float32(float("inf"))
        high = cutlass.Float32(float("-inf"))
        for i in cutlass.range_constexpr(slots):
            cached[i] = mScores[row, cutlass.min(lane + 32 * i, history - 1)]
            low = fmin(low, cached[i])
            high = cute.arch.fmax(high, cached[i])
        if cutlass.const_expr(slots == self.cached_per_lane):
            for column in cutlass.range(lane + 32 * slots, history, 32, unroll=1):
                value = mScores[row, column]
                low = fmin(low, value)
                high = cute.arch.fmax(high, value)
        for offset in cutlass.range_constexpr(5):
            low = fmin(low, cute.arch.shuffle_sync_bfly(low, offset=1 << offset))
            high = cute.arch.fmax(high, cute.arch.shuffle_sync_bfly(high, offset=1 << offset))
        spread = sub_rn(high, low)
        quotient = div_rn(QUANT_LEVELS, spread)
        usable = (spread != 0.0) & (quotient < float("inf"))
        scale = quotient if usable else cutlass.Float32(0.0)
        bias = fma_rn(-low, scale, QUANT_BIAS)

        # the lane's keys, sorted descending (padding = INT32_MIN, below every real key)
        best = cute.make_rmem_tensor((self.cached_per_lane,), cutlass.Int32)
        page_bits = self.page_bits(lane)
        for i in cutlass.range_constexpr(self.cached_per_lane):
            if cutlass.const_expr(i < slots):
                key = self.key_of_level(self.level(cached[i], scale, bias), page_bits - 32 * i)
                best[i] = cutlass.Int32(cutlass.select_(lane + 32 * i < history, key, _INT32_MIN))
            else:
                best[i] = _INT32_MIN
        for i, j in odd_even_merge_sort_network(slots):
            larger = cutlass.max(best[i], best[j])
            best[j] = cutlass.min(best[i], best[j])
            best[i] = larger
        if cutlass.const_expr(slots == self.cached_per_lane):
            for column in cutlass.range(lane + 32 * slots, history, 32, unroll=1):
                self.insert(best, self.key_of_level(self.level(mScores[row, column], scale, bias), self.page_bits(column)))
        for slot in cutlass.range_constexpr(self.cached_per_lane):
            sLists[lane, slot, warp] = best[slot]

        # 15 rounds: the warp's largest head wins; its lane moves on to its next key. A lane holds at
        # most 15 winners, so its head never passes its 16th slot (INT32_MIN beyond ``slots``).
        head = best[0]
        position = cutlass.Int32(0)
        page_of_lane = cutlass.Int32(-1)
        for rank in cutlass.range_constexpr(self.topk - 1):
            winner = warp_max_s32(head)
            page_of_lane = (~winner & 0xFFFF) if lane == rank else page_of_lane
            if cutlass.const_expr(rank < self.topk - 2):
                position = position + cutlass.Int32(cutlass.select_(head == winner, 1, 0))
                head = sLists[lane, position, warp]
        if lane < self.topk - 1:
            mOut[row, lane] = page_of_lane
        if lane == self.topk - 1:
            mOut[row, lane] = history

    @cute.jit
    def level(self, score, scale, bias):
        return truncate_to_u16_level(fma_rn(score, scale, bias))

    @cute.jit
    def page_bits(self, column):
        """The key's low half, ``~column & 0xFFFF``, with bit 31 set: adding ``level << 16`` to it flips the
        level's top bit, so signed comparisons order the keys as unsigned ones."""
        return (~column & 0xFFFF) | _INT32_MIN

    @cute.jit
    def key_of_level(self, level, page_bits):
        return (level << 16) + page_bits

    @cute.jit
    def insert(self, best, key):
        """Keep the lane's 16 largest keys, descending; most keys lose to the 16th and skip the chain."""
        if key > best[self.cached_per_lane - 1]:
            for slot in cutlass.range_constexpr(self.cached_per_lane):
                kept = best[slot]
                best[slot] = cutlass.max(kept, key)
                key = cutlass.min(kept, key)
