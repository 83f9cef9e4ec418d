"""Forced-local-page top-k selection on the GPU, bit for bit the contract's (docs/INDEXER.md).

One warp per score row, several rows per CTA, one launch for all rows. Each lane reads a strided
share of the row's history into registers (8, 12 or 16 columns by row length; rows beyond 512
history pages read the rest twice, four columns per loop trip so their loads overlap). Pass one
finds the row's min/max (a tree per lane, one ``redux.sync`` each across the warp), pass two builds the 16-bit
quantised keys. On rows of more than 256 pages a lane keeps its 4 largest keys (groups of four sorted by a network
of branch-free integer min/max, merged pairwise) and parks them in shared memory. The warp then takes the top 15 in 15 rounds of one ``redux.sync.max`` over the lanes' list heads; the winning
lane advances its head by one shared-memory read. A row where one lane wins 4 of the first 14 rounds
is redone by the exhaustive path, where every lane sorts all its keys (odd-even merge network), so
the result never depends on how the keys fall across lanes. The arithmetic is written in PTX with
explicit rounding (``sub.rn``, ``div.rn``, ``fma.rn``, ``cvt.rzi``) so no compiler contraction or
approximation can change a key. Keys are held as signed int32 with the top bit flipped, which keeps
the unsigned key order under signed comparisons. The top-k kernel is bound by the integer (ALU) pipe
(ncu, docs/PERFORMANCE.md): the list length trades its min/max count against the fallback rate.
With ``warps_per_row=4`` (few long rows) a CTA's four warps share one row instead: each takes every fourth
32-column stripe on the exhaustive path, and warp 0 merges their top-15 lists.
"""

from __future__ import annotations

import contextlib

import cutlass
import cutlass.cute as cute
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..contract import MAX_PAGES_PER_ROW, QUANT_BIAS, QUANT_LEVELS, ErrorWord
from .trees import pairwise_tree

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


@contextlib.contextmanager
def kernel_register_limit(launcher, max_registers):
    """Emit ``.maxnreg max_registers`` for the kernel ``launcher`` launches (None: ptxas chooses). The DSL's launch
    options have no register limit, so the MLIR attribute ``nvvm.maxnreg`` is added to the attributes it generates for
    the kernel (the same private hook in DSL 4.3.5 and 4.8; the compile check builds it under both). The hook is
    the DSL's, shared by every kernel traced meanwhile: compile under one lock (``cute_backend.compile_once``)."""
    if max_registers is None:
        yield
        return
    dsl = launcher.dsl
    generate = getattr(dsl, "_generate_kernel_attrs", None)
    if generate is None:
        raise RuntimeError("max_registers: this nvidia-cutlass-dsl has no kernel-attribute hook (known: 4.3.5 to 4.8); "
                           "leave max_registers at None")

    def with_limit(config):
        attributes = generate(config)
        attributes["nvvm.maxnreg"] = ir.Attribute.parse(f"{int(max_registers)} : i32")
        return attributes

    dsl._generate_kernel_attrs = with_limit
    try:
        yield
    finally:
        del dsl._generate_kernel_attrs


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
def saturate_to_u16_level(x, *, loc=None, ip=None):
    """``clamp(trunc(x), 0, 65535)`` as an int32 in one conversion: a float-to-u16 ``cvt`` saturates at both ends
    of the 16-bit range (NaN gives 0), so no float clamp is needed."""
    return cutlass.Int32(
        llvm.inline_asm(T.i32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)],
                        "{ .reg .u16 level; cvt.rzi.sat.u16.f32 level, $1; cvt.u32.u16 $0, level; }",
                        "=r,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                        loc=loc, ip=ip)
    )


# float <-> int32 whose signed order is the float order (non-NaN; -0 below +0); the map is its own inverse
_ORDERED_S32 = "shr.s32 sign, bits, 31; and.b32 sign, sign, 0x7FFFFFFF; xor.b32 bits, bits, sign;"


@dsl_user_op
def warp_reduce_f32_by_redux(value, operation: str, *, loc=None, ip=None):
    """Min or max of a float over the full warp in one integer ``redux.sync`` on order-preserving int32s: the
    same value as five shuffle butterflies (for non-NaN inputs; of two zeros either may be returned, and the row's
    quantisation is the same with either)."""
    if operation not in ("min", "max"):
        raise ValueError(f"operation must be 'min' or 'max', got {operation!r}")
    ptx = ("{ .reg .s32 bits, sign; mov.b32 bits, $1; " + _ORDERED_S32
           + f" redux.sync.{operation}.s32 bits, bits, 0xffffffff; " + _ORDERED_S32 + " mov.b32 $0, bits; }")
    return _asm_f32(ptx, value, loc=loc, ip=ip)


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


def sort4_descending_network() -> list:
    """The 5 compare-exchanges that sort four values (optimal for n = 4)."""
    return [(0, 1), (2, 3), (0, 2), (1, 3), (1, 2)]


class TopkSelectKernel:
    """``out[r, :] = select(scores[r, :n-1], n = num_valid_pages[r])`` for k = 16 (k - 1 ranked slots).

    The fast path: a lane keeps only its 4 largest keys (sorted groups of four merged pairwise: 76 integer min/max
    for 16 keys instead of 126), the warp merges the lists, and a row where some lane wins 4 of the first 14 rounds
    (its 5th key could belong to the top 15; about 1 % of rows of random scores in a CPU model of the algorithm) is
    redone by the exhaustive path, where every lane sorts all its keys. Rows of 257-384 and 385+ history pages take
    it with 12 and 16 cached scores per lane (a 24-slot path was faster on 513-768 pages but raised the kernel to 52
    registers); rows of up to 256 pages take the exhaustive 8-slot path, which measured faster there.

    Columns beyond a lane's cached slots (rows of more than 512 history pages) are read four at a time, their loads
    issued together: rows of a thousand pages otherwise wait on ~16 load latencies per pass, which bounds
    short-query cases, where a few hundred rows cannot hide them. A key's level comes from one float-to-u16
    conversion that saturates at both ends; the row's min and max from a tree in each lane and one integer
    ``redux.sync`` each across the warp on order-preserving ints; each round's winner is stored to shared memory by
    the whole warp (one store) and lane ``r`` reads rank ``r`` back at the end; CTAs take rows from the end, where a
    request's longest rows are, so the last wave holds short rows; and a 40-register limit lets 12 CTAs share an SM
    (ptxas takes 48 without it under DSL 4.3.5: 10 CTAs). None of these changes a selected page.

    A row length outside ``[1, score columns + 1]`` is clamped into it and sets ``ErrorWord.TOPK_ROW_LENGTH`` of
    ``mErrors``, so no metadata makes the kernel read or write outside its buffers.
    """

    topk = 16
    warps_per_cta = 4
    cached_per_lane = 16  # exhaustive path: rows of up to 512 history pages are read once
    short_row_slots = 8  # exhaustive path: rows of up to 256 history pages take a path of half the work
    fast_slot_paths = (12, 16)  # fast path: cached scores per lane, by row length; longer rows read the rest twice
    rest_batch = 4  # columns beyond the cached slots loaded per loop trip
    max_registers = 40

    def __init__(self, warps_per_row: int = 1):
        """``warps_per_row`` 4: one row per CTA, its columns dealt out to the four warps in 32-column stripes; each
        warp takes its share's top 15 by the exhaustive path (keys to shared memory), the row's min and max are
        combined through shared memory, and warp 0 merges the four lists in 15 more rounds. For few long rows (short
        queries over long contexts), where a row's chain of loads, not the SM's throughput, sets the time; the host
        picks it per plan (``cute_backend.TOPK_ROW_SPLIT_MAX_ROWS``)."""
        if type(warps_per_row) is not int or warps_per_row not in (1, self.warps_per_cta):
            raise ValueError(f"warps_per_row must be 1 or {self.warps_per_cta}, got {warps_per_row!r}")
        self.warps_per_row = warps_per_row
        self.column_stride = 32 * warps_per_row  # between a lane's consecutive columns

    @cute.jit
    def __call__(
        self,
        mScores: cute.Tensor,  # (rows, pitch) fp32, unit column stride
        mNumValidPages: cute.Tensor,  # (rows,) int32
        mOut: cute.Tensor,  # (rows, 16) int32
        mErrors: cute.Tensor,  # (>= ErrorWord count,) int32
        stream,
    ):
        rows = cute.size(mNumValidPages, mode=[0])
        rows_per_cta = self.warps_per_cta // self.warps_per_row
        grid = (rows + rows_per_cta - 1) // rows_per_cta
        launcher = self.kernel(mScores, mNumValidPages, mOut, mErrors)
        with kernel_register_limit(launcher, self.max_registers):
            launcher.launch(grid=(grid, 1, 1), block=(32 * self.warps_per_cta, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mNumValidPages: cute.Tensor, mOut: cute.Tensor, mErrors: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        # a request's rows grow with their position, and CTAs start in index order: the long ones first
        num_ctas, _, _ = cute.arch.grid_dim()
        cta = num_ctas - 1 - cta
        # (lane, slot, warp): a lane's sorted keys, one bank per lane, so the merge's reads never conflict; one more
        # slot column holds the warp's winners in rank order
        slot_columns = self.cached_per_lane + 1
        smem = cutlass.utils.SmemAllocator()
        sLists = smem.allocate_tensor(cutlass.Int32, cute.make_layout((32, slot_columns, self.warps_per_cta)), 16)
        if cutlass.const_expr(self.warps_per_row > 1):
            sRange = smem.allocate_tensor(cutlass.Float32, cute.make_layout((2, self.warps_per_cta)), 16)
            if cta < cute.size(mNumValidPages, mode=[0]):
                self.select_split_row(mScores, mNumValidPages, mOut, mErrors, sLists, sRange, cta, lane, warp)
        else:
            self.select_warp_row(mScores, mNumValidPages, mOut, mErrors, sLists, cta * self.warps_per_cta + warp, lane,
                                 warp)

    @cute.jit
    def checked_row_length(self, mNumValidPages, mScores, mErrors, row):
        """The row's ``num_valid_pages`` clamped into ``[1, columns + 1]`` (``ErrorWord.TOPK_ROW_LENGTH`` set when it
        lay outside)."""
        num_valid = mNumValidPages[row]
        limit = mScores.shape[1] + 1
        checked = num_valid
        if (num_valid < 1) | (num_valid > limit):
            mErrors[int(ErrorWord.TOPK_ROW_LENGTH)] = 1
            checked = cutlass.max(cutlass.min(num_valid, limit), 1)
        return checked

    @cute.jit
    def select_warp_row(self, mScores, mNumValidPages, mOut, mErrors, sLists, row, lane, warp):
        """One warp, one row."""
        if row < cute.size(mNumValidPages, mode=[0]):
            num_valid = self.checked_row_length(mNumValidPages, mScores, mErrors, row)
            history = num_valid - 1
            if num_valid <= self.topk:
                if lane < self.topk:
                    mOut[row, lane] = lane if lane < num_valid else -1
            else:
                # rows of up to 256 history pages keep the exhaustive 8-slot path: measured faster there
                exhaustive = cutlass.Boolean(True)
                paths = self.fast_slot_paths
                if history <= 32 * self.short_row_slots:
                    exhaustive = cutlass.Boolean(True)
                elif history <= 32 * paths[0]:
                    exhaustive = self.select_row_fast(mScores, mOut, sLists, row, lane, warp, history, paths[0],
                                                      self.short_row_slots)
                else:
                    exhaustive = self.select_row_fast(mScores, mOut, sLists, row, lane, warp, history, paths[1], paths[0])
                if exhaustive:
                    if history <= 32 * self.short_row_slots:
                        self.select_row(mScores, mOut, sLists, row, lane, warp, num_valid, self.short_row_slots, lane)
                    else:
                        self.select_row(mScores, mOut, sLists, row, lane, warp, num_valid, self.cached_per_lane, lane)

    @cute.jit
    def quantisation(self, low, high):
        """The contract's row scale and bias from the row's min and max (docs/INDEXER.md)."""
        spread = sub_rn(high, low)
        quotient = div_rn(QUANT_LEVELS, spread)
        usable = (spread != 0.0) & (quotient < float("inf"))
        scale = quotient if usable else cutlass.Float32(0.0)
        return scale, fma_rn(-low, scale, QUANT_BIAS)

    @cute.jit
    def warp_min_max(self, low, high):
        return warp_reduce_f32_by_redux(low, "min"), warp_reduce_f32_by_redux(high, "max")

    @staticmethod
    def compare_exchange(keys, i: int, j: int):
        larger = cutlass.max(keys[i], keys[j])
        keys[j] = cutlass.min(keys[i], keys[j])
        keys[i] = larger

    @cute.jit
    def select_row_fast(self, mScores, mOut, sLists, row, lane, warp, history, slots: cutlass.Constexpr,
                        full_slots: cutlass.Constexpr):
        """The fast path for rows of at most ``32 * slots`` history pages (more for the last path, whose
        further columns are read twice); slots below ``full_slots`` are known to lie inside the history.
        Returns whether the row needs the exhaustive path (nothing is written then)."""
        longest = slots == self.fast_slot_paths[-1]
        cached, scale, bias = self.first_pass(mScores, row, lane, history, slots, full_slots, longest)

        # the lane's 4 largest keys, descending: sort each group of four, merge it into the list
        # (the elementwise max against the reversed group leaves the top four as a bitonic sequence)
        page_bits = self.page_bits(lane)
        best = cute.make_rmem_tensor((4,), cutlass.Int32)
        group = cute.make_rmem_tensor((4,), cutlass.Int32)
        for g in cutlass.range_constexpr(slots // 4):
            for j in cutlass.range_constexpr(4):
                i = 4 * g + j
                key = self.key_of_level(self.level(cached[i], scale, bias), page_bits - 32 * i)
                if cutlass.const_expr(i >= full_slots):
                    key = cutlass.Int32(cutlass.select_(lane + 32 * i < history, key, _INT32_MIN))
                if cutlass.const_expr(g == 0):
                    best[j] = key
                else:
                    group[j] = key
            if cutlass.const_expr(g == 0):
                for i, j in sort4_descending_network():
                    self.compare_exchange(best, i, j)
            else:
                for i, j in sort4_descending_network():
                    self.compare_exchange(group, i, j)
                for j in cutlass.range_constexpr(4):
                    best[j] = cutlass.max(best[j], group[3 - j])
                for i, j in ((0, 2), (1, 3), (0, 1), (2, 3)):
                    self.compare_exchange(best, i, j)
        if cutlass.const_expr(longest):
            self.insert_rest(mScores, best, row, lane + 32 * slots, history, scale, bias, 4)
        for slot in cutlass.range_constexpr(4):
            sLists[lane, slot, warp] = best[slot]
        sLists[lane, 4, warp] = _INT32_MIN  # an exhausted lane's head: it cannot win again
        page_of_lane, position = self.take_top(sLists, lane, warp, best[0])
        # a lane that won 4 of the first 14 rounds may hold a 5th key that belongs to the top 15
        exhaustive = warp_max_s32(position) >= 4
        if not exhaustive:
            self.write_row(mOut, row, lane, page_of_lane, history)
        return exhaustive

    @cute.jit
    def first_pass(self, mScores, row, first_column, history, slots: cutlass.Constexpr, full_slots: cutlass.Constexpr,
                   read_rest: cutlass.Constexpr, sRange=None, lane=None, warp=None):
        """The lane's first ``slots`` scores (columns ``first_column + column_stride * i``), kept in registers for the
        second pass, and the row's scale and bias (min and max over the whole history; with ``read_rest`` the columns
        beyond the slots are read here and again in the second pass; a split row combines its warps' ranges through
        ``sRange``)."""
        cached = cute.make_rmem_tensor((slots,), cutlass.Float32)
        for i in cutlass.range_constexpr(slots):
            cached[i] = self.read_slot(mScores, row, first_column, history, i, full_slots)
        # min and max are exact, so any order gives the same value: a tree of depth log2(slots), not a chain
        low = pairwise_tree([cached[i] for i in range(slots)], fmin)
        high = pairwise_tree([cached[i] for i in range(slots)], cute.arch.fmax)
        if cutlass.const_expr(read_rest):
            stride = self.column_stride
            for column in cutlass.range(first_column + stride * slots, history, stride * self.rest_batch, unroll=1):
                values = self.read_rest(mScores, row, column, history)
                for j in cutlass.range_constexpr(self.rest_batch):
                    low = fmin(low, values[j])
                    high = cute.arch.fmax(high, values[j])
        low, high = self.warp_min_max(low, high)
        if cutlass.const_expr(self.warps_per_row > 1):
            low, high = self.row_range_across_warps(low, high, sRange, lane, warp)
        scale, bias = self.quantisation(low, high)
        return cached, scale, bias

    @cute.jit
    def read_slot(self, mScores, row, first_column, history, i: cutlass.Constexpr, full_slots: cutlass.Constexpr):
        """Column ``first_column + column_stride * i`` of the row; a slot past the history reads column
        ``history - 1``, a real score of the row, so min and max need no masking (its key is masked)."""
        if cutlass.const_expr(i < full_slots):
            return mScores[row, first_column + self.column_stride * i]
        return mScores[row, cutlass.min(first_column + self.column_stride * i, history - 1)]

    @cute.jit
    def read_rest(self, mScores, row, column, history):
        """Columns ``column + column_stride * j``, ``j < rest_batch``, loaded together; those past the history load
        column ``history - 1``, a real score of the row, so min and max need no masking (their keys are masked)."""
        return [mScores[row, cutlass.min(column + self.column_stride * j, history - 1)] for j in range(self.rest_batch)]

    @cute.jit
    def insert_rest(self, mScores, best, row, first_column, history, scale, bias, length: cutlass.Constexpr):
        """Insert the keys of this lane's columns ``first_column + column_stride * i < history`` into ``best``."""
        stride = self.column_stride
        for column in cutlass.range(first_column, history, stride * self.rest_batch, unroll=1):
            values = self.read_rest(mScores, row, column, history)
            for j in cutlass.range_constexpr(self.rest_batch):
                key = self.key_of_level(self.level(values[j], scale, bias), self.page_bits(column + stride * j))
                if cutlass.const_expr(self.rest_batch > 1):
                    key = cutlass.Int32(cutlass.select_(column + stride * j < history, key, _INT32_MIN))
                self.insert(best, key, length)

    @cute.jit
    def select_row(self, mScores, mOut, sLists, row, lane, warp, num_valid, slots: cutlass.Constexpr, first_column,
                   sRange=None):
        """The exhaustive path: every lane sorts all its keys (columns ``first_column + column_stride * i``). A split
        row's warp leaves its share's 15 best keys in shared memory instead of writing the row."""
        history = num_valid - 1
        cached, scale, bias = self.first_pass(mScores, row, first_column, history, slots, 0, slots == self.cached_per_lane,
                                              sRange, lane, warp)

        # the lane's keys, sorted descending (padding = INT32_MIN, below every real key)
        best = cute.make_rmem_tensor((self.cached_per_lane,), cutlass.Int32)
        page_bits = self.page_bits(first_column)
        stride = self.column_stride
        for i in cutlass.range_constexpr(self.cached_per_lane):
            if cutlass.const_expr(i < slots):
                key = self.key_of_level(self.level(cached[i], scale, bias), page_bits - stride * i)
                best[i] = cutlass.Int32(cutlass.select_(first_column + stride * i < history, key, _INT32_MIN))
            else:
                best[i] = _INT32_MIN
        for i, j in odd_even_merge_sort_network(slots):
            self.compare_exchange(best, i, j)
        if cutlass.const_expr(slots == self.cached_per_lane):
            self.insert_rest(mScores, best, row, first_column + stride * slots, history, scale, bias,
                             self.cached_per_lane)
        for slot in cutlass.range_constexpr(self.cached_per_lane):
            sLists[lane, slot, warp] = best[slot]

        # A lane holds at most 15 winners, so its head never passes its 16th slot (INT32_MIN beyond ``slots``).
        if cutlass.const_expr(self.warps_per_row > 1):
            self.take_top(sLists, lane, warp, best[0], collect_winners=True)
        else:
            page_of_lane, _ = self.take_top(sLists, lane, warp, best[0])
            self.write_row(mOut, row, lane, page_of_lane, history)

    @cute.jit
    def select_split_row(self, mScores, mNumValidPages, mOut, mErrors, sLists, sRange, row, lane, warp):
        """``warps_per_row`` warps, one row: warp ``w`` takes columns ``32 w + lane + column_stride * i``."""
        num_valid = self.checked_row_length(mNumValidPages, mScores, mErrors, row)
        history = num_valid - 1
        if num_valid <= self.topk:
            if warp == 0:
                if lane < self.topk:
                    mOut[row, lane] = lane if lane < num_valid else -1
        else:
            first_column = lane + 32 * warp
            # the same path in every warp (the row's length decides), so all reach the same barriers
            if history <= self.column_stride * self.short_row_slots:
                self.select_row(mScores, mOut, sLists, row, lane, warp, num_valid, self.short_row_slots, first_column,
                                sRange)
            else:
                self.select_row(mScores, mOut, sLists, row, lane, warp, num_valid, self.cached_per_lane, first_column,
                                sRange)
            cute.arch.barrier()  # every warp's 15 best keys are in shared memory
            if warp == 0:
                self.merge_split_row(sLists, mOut, row, lane, history)

    @cute.jit
    def row_range_across_warps(self, low, high, sRange, lane, warp):
        """A split row's min and max from its warps' (every lane of a warp holds its warp's)."""
        if lane == 0:
            sRange[0, warp] = low
            sRange[1, warp] = high
        cute.arch.barrier()
        low = pairwise_tree([sRange[0, part] for part in range(self.warps_per_row)], fmin)
        high = pairwise_tree([sRange[1, part] for part in range(self.warps_per_row)], cute.arch.fmax)
        return low, high

    @cute.jit
    def merge_split_row(self, sLists, mOut, row, lane, history):
        """Warp 0 takes the row's top 15 from its warps' lists of 15 (descending keys): lane ``w`` holds warp ``w``'s
        list head; 15 rounds as in ``take_top``."""
        parts = self.warps_per_row
        part = cutlass.min(lane, parts - 1)
        winners = self.cached_per_lane  # the slot column that holds each warp's winners by rank
        position = cutlass.Int32(0)
        page_of_lane = cutlass.Int32(-1)
        head = cutlass.Int32(cutlass.select_(lane < parts, sLists[0, winners, part], _INT32_MIN))
        for rank in cutlass.range_constexpr(self.topk - 1):
            winner = warp_max_s32(head)
            page_of_lane = (~winner & 0xFFFF) if lane == rank else page_of_lane
            if cutlass.const_expr(rank < self.topk - 2):
                position = position + cutlass.Int32(cutlass.select_(head == winner, 1, 0))
                head = cutlass.Int32(cutlass.select_(lane < parts, sLists[position, winners, part], _INT32_MIN))
        self.write_row(mOut, row, lane, page_of_lane, history)

    @cute.jit
    def take_top(self, sLists, lane, warp, head, collect_winners: cutlass.Constexpr = False):
        """15 rounds: the warp's largest head wins and its lane moves on to its next key (one shared-memory read).
        Every lane stores the round's winning key (one store, column ``cached_per_lane``, by rank). Returns this lane's
        page (lane ``r`` reads the ``r``-th winner back) and how many of the first 14 rounds it won;
        ``collect_winners``: the winning keys stay in shared memory for a split row's merge instead (page -1)."""
        position = cutlass.Int32(0)
        page_of_lane = cutlass.Int32(-1)
        for rank in cutlass.range_constexpr(self.topk - 1):
            winner = warp_max_s32(head)
            sLists[rank, self.cached_per_lane, warp] = winner
            if cutlass.const_expr(rank < self.topk - 2):
                won = head == winner
                position = position + cutlass.Int32(cutlass.select_(won, 1, 0))
                head = sLists[lane, position, warp]
        if cutlass.const_expr(not collect_winners):
            page_of_lane = ~sLists[lane, self.cached_per_lane, warp] & 0xFFFF  # lanes from 15 on read no winner
        return page_of_lane, position

    @cute.jit
    def write_row(self, mOut, row, lane, page_of_lane, history):
        """The 15 ranked pages, then the forced local page (``history``) in the last slot."""
        if lane < self.topk - 1:
            mOut[row, lane] = page_of_lane
        if lane == self.topk - 1:
            mOut[row, lane] = history

    @cute.jit
    def level(self, score, scale, bias):
        return saturate_to_u16_level(fma_rn(score, scale, bias))

    @cute.jit
    def page_bits(self, column):
        """The key's low half, ``~column & 0xFFFF``, with bit 31 set: adding ``level << 16`` to it flips the
        level's top bit, so signed comparisons order the keys as unsigned ones."""
        return (~column & 0xFFFF) | _INT32_MIN

    @cute.jit
    def key_of_level(self, level, page_bits):
        return (level << 16) + page_bits

    @cute.jit
    def insert(self, best, key, length: cutlass.Constexpr):
        """Keep the lane's ``length`` largest keys, descending; most keys lose to the last and skip the chain."""
        if key > best[length - 1]:
            for slot in cutlass.range_constexpr(length):
                kept = best[slot]
                best[slot] = cutlass.max(kept, key)
                key = cutlass.min(kept, key)
