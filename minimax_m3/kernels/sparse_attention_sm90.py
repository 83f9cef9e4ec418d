"""Page-sparse prefill attention for SM90 (H100/H200), in CuTe DSL: each query token of a KV group attends to
the keys of its own selected pages only.

One CTA = one *query tile* (``tokens_per_tile`` consecutive packed tokens, 8 at M3's 16 query heads per KV
group) of one KV group: its ``tokens x heads`` = 128 rows (row ``t * heads + h``) share every K/V page they
load. The CTA walks the tile's **page union** (built on the host side: physical page id plus a bit set of the
tile's tokens that selected it), so K/V traffic follows the selection, not the context.

Warp roles: warpgroup 0 is the producer (its first warp loads the tile's Q once and each union page's K and V
by TMA, addressed by physical page, into a multi-stage ring); warpgroups 1 and 2 are consumers, 64 rows
(4 tokens) each. A consumer skips a page that none of its tokens selected; otherwise it computes
``S = Q K^T`` (``wgmma.m64n128k16`` bf16, Q and K from shared memory), masks each row to its token's selection
and causal bound, updates the online softmax in registers and accumulates ``O += P V`` (P from registers,
V from shared memory, MN-major). The two consumer warpgroups interleave on the tensor cores. The epilogue
normalises and stores bf16 rows of real tokens; rows of tokens past the end are never written.

``decode=True`` is the split-KV variant for decode and verify steps (a few new tokens per sequence): a CTA reads
its entries straight from the indexer's selection ``[T, G, topk]`` (entry ``i`` of a tile is page ``i % topk`` of
its token ``i // topk``, so no union is built). The third grid dimension names one token of the tile and one of
its ``splits`` chunks of pages; the CTA writes that token's 16 rows, normalised over the chunk, as fp32 with their
log-sum-exp. The last of a (token, KV group)'s split CTAs to finish, counted by an atomic on a per-(token, group)
arrival counter, merges the splits' rows by their log-sum-exps into the bf16 output (``split_kv``'s merge, in the
kernel: no merge launch) and sets the counter back to zero. A tile's tokens then come from different sequences; a
split holds one token's pages only.
"""

from __future__ import annotations

import enum
import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from indexer.cute_runtime import make_tma_pipeline

__all__ = ["SparseAttentionSm90", "UNION_PAGE_BITS", "UNION_TOKEN_SHIFT"]

UNION_PAGE_BITS = 24
"""A union entry is ``physical_page | token_bits << 24``: the page id in the low 24 bits, bit ``i`` of the
high byte set when the tile's token ``i`` selected the page."""
UNION_TOKEN_SHIFT = UNION_PAGE_BITS
_PAGE_MASK = (1 << UNION_PAGE_BITS) - 1
_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)


class WarpRole(enum.IntEnum):
    """Warpgroup indices inside the CTA."""

    PRODUCER = 0
    FIRST_CONSUMER = 1


class NamedBarrier(enum.IntEnum):
    """Named barrier ids (0 is the CTA-wide barrier)."""

    CONSUMERS = 1  # the consumer warpgroups, around a decode split's arrival


@dsl_user_op
def fence_gpu(*, loc=None, ip=None):
    """``fence.acq_rel.gpu``: this thread's global writes before it are seen by the GPU before its writes after it
    (``__threadfence``)."""
    llvm.inline_asm(None, [], "fence.acq_rel.gpu;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def arrive_gpu(address, *, loc=None, ip=None):
    """Add one to the int32 at global ``address`` (acquire-release at GPU scope); the value before."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [cutlass.Int64(address).ir_value(loc=loc, ip=ip)], "atom.acq_rel.gpu.global.add.s32 $0, [$1], 1;",
        "=r,l", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def load_gpu(address, *, loc=None, ip=None):
    """The fp32 at global ``address``, loaded relaxed at GPU scope (from L2: never a stale L1 line)."""
    return cutlass.Float32(llvm.inline_asm(
        T.f32(), [cutlass.Int64(address).ir_value(loc=loc, ip=ip)], "ld.relaxed.gpu.global.f32 $0, [$1];", "=f,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def load_gpu_x4(address, *, loc=None, ip=None):
    """The four fp32 at the 16-byte aligned global ``address``, as ``load_gpu`` loads one."""
    vector = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4), [cutlass.Int64(address).ir_value(loc=loc, ip=ip)],
        "ld.relaxed.gpu.global.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), vector, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def reset_gpu(address, *, loc=None, ip=None):
    """Store zero to the int32 at global ``address`` (relaxed, GPU scope)."""
    llvm.inline_asm(None, [cutlass.Int64(address).ir_value(loc=loc, ip=ip)], "st.relaxed.gpu.global.s32 [$0], 0;",
                    "l", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                    loc=loc, ip=ip)


class SparseAttentionSm90:
    """Static configuration; ``__call__`` is the traced host launcher, ``kernel`` the device code."""

    page_size = 128
    head_dim = 128
    tile_rows = 128
    threads_per_warpgroup = 128
    consumer_warpgroups = 2
    heads_per_warp = 16
    # decode: at most this many splits per (token, group) (``sparse_attention_cute.DECODE_MAX_SPLITS``), all merged
    # at once by the last split CTA
    max_splits = 16

    def __init__(self, heads_per_group: int, *, decode: bool = False):
        if heads_per_group != self.heads_per_warp:
            # a warp's 16 accumulator rows are then exactly one token: the per-row masks and the per-warpgroup page
            # skip rely on it (M3: 64 query heads over 4 KV heads)
            raise ValueError(f"heads_per_group must be {self.heads_per_warp} (query heads per KV group), got {heads_per_group}")
        self.heads_per_group = heads_per_group
        self.decode = decode
        self.tokens_per_tile = self.tile_rows // heads_per_group
        self.tokens_per_warpgroup = 64 // heads_per_group
        # A prefill tile walks ~25-100 union pages, fetched mostly from L2 at close to its bandwidth: a third page in
        # flight (224 KB of shared memory with Q) is 1-4 % faster. A decode CTA walks a few pages; two stages do.
        self.kv_stages = 2 if decode else 3
        self.dtype = cutlass.BFloat16
        self.threads_per_cta = (1 + self.consumer_warpgroups) * self.threads_per_warpgroup
        # setmaxnreg redistributes the launch allocation (ptxas count x 384 threads); the compile check verifies it
        self.producer_registers, self.consumer_registers = 24, 240
        self.page_bytes = self.page_size * self.head_dim * 2

    def _smem_layout(self, rows: int, stages):
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.dtype, self.head_dim), self.dtype
        )
        shape = (rows, self.head_dim) if stages is None else (rows, self.head_dim, stages)
        order = (0, 1) if stages is None else (0, 1, 2)
        return cute.tile_to_shape(atom, shape, order=order)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T, num_heads, 128) bf16, contiguous
        mK: cute.Tensor,  # the cache: (slots, num_kv_heads, 128) bf16; decode: (batch, capacity, num_kv_heads, 128)
        mV: cute.Tensor,  # like mK
        mO: cute.Tensor,  # like mQ
        mSplitO,  # decode: (T, splits, num_heads, 128) fp32 rows normalised over their token's split; else None
        mLSE,  # decode: (T, splits, num_heads) fp32 natural log-sum-exp of each split row; else None
        mEntries: cute.Tensor,  # (tiles, num_kv_heads, width) int32 union entries; decode: (T, num_kv_heads, topk)
        mEntryCount,  # (tiles, num_kv_heads) int32 union entries in use; decode: None
        mOwnSlot: cute.Tensor,  # (T,) int32: the token's own cache slot (physical page * 128 + position % 128)
        mArrivals,  # decode: (T, num_kv_heads) int32 arrival counters, zero before the launch and after it; else None
        softmax_scale: cutlass.Float32,
        stream,
    ):
        num_tokens = mQ.shape[0]
        num_heads = mQ.shape[1]
        num_kv_heads = mK.shape[cute.rank(mK) - 2]
        slots = mK.shape[0]
        capacity = cutlass.Int32(0)
        splits = 1
        if cutlass.const_expr(self.decode):
            slots = mK.shape[0] * mK.shape[1]
            capacity = mK.shape[1]
            # one token of the tile and one of its splits per CTA
            splits = cutlass.min(num_tokens, self.tokens_per_tile) * mSplitO.shape[1]
        # Rows (token, head of the group) of KV group g: a hierarchical mode ((heads, tokens), dim, group).
        q_layout = cute.make_layout(
            ((self.heads_per_group, num_tokens), self.head_dim, num_kv_heads),
            stride=((self.head_dim, num_heads * self.head_dim), 1, self.heads_per_group * self.head_dim),
        )
        mQ_rows = cute.make_tensor(mQ.iterator, q_layout)
        kv_layout = cute.make_layout(
            (slots, self.head_dim, num_kv_heads), stride=(num_kv_heads * self.head_dim, 1, self.head_dim)
        )
        mK_pages = cute.make_tensor(mK.iterator, kv_layout)
        mV_pages = cute.make_tensor(mV.iterator, kv_layout)

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, cutlass.Float32,
            (self.consumer_warpgroups, 1, 1), tiler_mn=(64, self.page_size),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, cutlass.Float32,
            (self.consumer_warpgroups, 1, 1), tiler_mn=(64, self.head_dim), a_source=warpgroup.OperandSource.RMEM,
        )
        sQ_layout = self._smem_layout(self.tile_rows, None)
        sKV_layout = self._smem_layout(self.page_size, self.kv_stages)
        tma_atom_q, mQ_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ_rows, sQ_layout, (self.tile_rows, self.head_dim)
        )
        kv_stage_layout = cute.slice_(sKV_layout, (None, None, 0))
        tma_atom_k, mK_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK_pages, kv_stage_layout, (self.page_size, self.head_dim)
        )
        tma_atom_v, mV_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV_pages, kv_stage_layout, (self.page_size, self.head_dim)
        )

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            kv_barriers: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            last_arrival: cute.struct.MemRange[cutlass.Int32, 1]

        self.shared_storage = SharedStorage
        num_tiles = mEntries.shape[0]
        if cutlass.const_expr(self.decode):
            num_tiles = (num_tokens + self.tokens_per_tile - 1) // self.tokens_per_tile
        self.kernel(
            tma_atom_q, mQ_tma, tma_atom_k, mK_tma, tma_atom_v, mV_tma, mO, mSplitO, mLSE, mEntries, mEntryCount,
            mOwnSlot, mArrivals, capacity, softmax_scale * _LOG2_E, tiled_mma_qk, tiled_mma_pv, sQ_layout, sKV_layout,
        ).launch(
            grid=(num_tiles, num_kv_heads, splits),
            block=(self.threads_per_cta, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mSplitO,
        mLSE,
        mEntries: cute.Tensor,
        mEntryCount,
        mOwnSlot: cute.Tensor,
        mArrivals,
        capacity: cutlass.Int32,
        scale_log2: cutlass.Float32,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)
        tile, group, split = cute.arch.block_idx()

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        q_pipeline = self._ring(storage.q_barriers.data_ptr(), 1, self.tile_rows * self.head_dim * 2)
        kv_pipeline = self._ring(storage.kv_barriers.data_ptr(), self.kv_stages, 2 * self.page_bytes)
        pipeline.pipeline_init_arrive()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sLastArrival = storage.last_arrival.get_tensor(cute.make_layout(1))
        pipeline.pipeline_init_wait()

        entry_begin, entry_end = self._entry_range(mEntries, mEntryCount, mSplitO, tile, group, split)
        if warpgroup_idx == WarpRole.PRODUCER:
            cute.arch.warpgroup_reg_dealloc(self.producer_registers)
            if warp_idx == 0:
                self.load(tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV, sQ, sK, sV, mEntries, mOwnSlot, capacity,
                          q_pipeline, kv_pipeline, tile, group, entry_begin, entry_end)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_registers)
            self.attend(tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, mO, mSplitO, mLSE, mEntries, mOwnSlot, mArrivals,
                        sLastArrival, capacity, scale_log2, q_pipeline,
                        kv_pipeline, tidx - self.threads_per_warpgroup, tile, group, split, entry_begin, entry_end)

    @cute.jit
    def _entry_range(self, mEntries, mEntryCount, mSplitO, tile, group, split):
        """The entries ``[begin, end)`` this CTA walks: the tile's whole union, or (decode) the chunk of one token's
        ``topk`` selection entries that grid index ``split`` names (``split = local token * splits + chunk``; empty
        for a local token past the tile's tokens)."""
        begin = cutlass.Int32(0)
        end = cutlass.Int32(0)
        if cutlass.const_expr(self.decode):
            tokens = cutlass.min(mEntries.shape[0] - tile * self.tokens_per_tile, self.tokens_per_tile)
            topk = mEntries.shape[2]
            splits = mSplitO.shape[1]
            local_token = split // splits
            chunk = (topk + splits - 1) // splits
            if local_token < tokens:
                begin = local_token * topk + cutlass.min((split - local_token * splits) * chunk, topk)
                end = cutlass.min(begin + chunk, (local_token + 1) * topk)
        else:
            end = mEntryCount[tile, group]
        return begin, end

    @cute.jit
    def _entry(self, mEntries, mOwnSlot, capacity, tile, group, index):
        """``(physical page, token bits)`` of entry ``index``; token bits 0: nothing to read (decode: an unused
        selection slot, ``-1`` or a page beyond the sequence's capacity)."""
        physical_page = cutlass.Int32(0)
        token_bits = cutlass.Int32(0)
        if cutlass.const_expr(self.decode):
            topk = mEntries.shape[2]
            local_token = index // topk
            token = tile * self.tokens_per_tile + local_token
            pages_per_sequence = capacity // self.page_size
            logical_page = mEntries[token, group, index - local_token * topk]
            if logical_page >= 0 and logical_page < pages_per_sequence:
                physical_page = (mOwnSlot[token] // capacity) * pages_per_sequence + logical_page
                token_bits = cutlass.Int32(1) << local_token
        else:
            entry = mEntries[tile, group, index]
            physical_page = entry & _PAGE_MASK
            token_bits = (entry >> UNION_TOKEN_SHIFT) & 0xFF
        return physical_page, token_bits

    def _ring(self, barriers, stages: int, stage_bytes: int):
        consumer_warps = self.consumer_warpgroups * self.threads_per_warpgroup // 32
        return make_tma_pipeline(barriers, stages, stage_bytes, consumer_warps)

    @cute.jit
    def load(self, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV, sQ, sK, sV, mEntries, mOwnSlot, capacity,
             q_pipeline, kv_pipeline, tile, group, entry_begin, entry_end):
        gQ = cute.local_tile(mQ[None, None, group], (self.tile_rows, self.head_dim), (tile, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        q_pipeline.producer_acquire(q_state)
        cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=q_pipeline.producer_get_barrier(q_state))

        gK = cute.local_tile(mK[None, None, group], (self.page_size, self.head_dim), (None, 0))  # (128, 128, pages)
        gV = cute.local_tile(mV[None, None, group], (self.page_size, self.head_dim), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        if cutlass.const_expr(self.decode):
            for index in cutlass.range(entry_begin, entry_end, unroll=1):
                physical_page, token_bits = self._entry(mEntries, mOwnSlot, capacity, tile, group, index)
                if token_bits != 0:
                    kv_pipeline.producer_acquire(kv_state)
                    barrier = kv_pipeline.producer_get_barrier(kv_state)
                    cute.copy(tma_atom_k, tKgK[(None, physical_page)], tKsK[(None, kv_state.index)], tma_bar_ptr=barrier)
                    cute.copy(tma_atom_v, tVgV[(None, physical_page)], tVsV[(None, kv_state.index)], tma_bar_ptr=barrier)
                    kv_state.advance()
        else:
            page_count = entry_end
            physical_page = mEntries[tile, group, 0] & _PAGE_MASK
            for index in cutlass.range(page_count, unroll=1):
                # the next entry's load hides behind this page's TMA
                next_physical_page = mEntries[tile, group, cutlass.min(index + 1, page_count - 1)] & _PAGE_MASK
                kv_pipeline.producer_acquire(kv_state)
                barrier = kv_pipeline.producer_get_barrier(kv_state)
                cute.copy(tma_atom_k, tKgK[(None, physical_page)], tKsK[(None, kv_state.index)], tma_bar_ptr=barrier)
                cute.copy(tma_atom_v, tVgV[(None, physical_page)], tVsV[(None, kv_state.index)], tma_bar_ptr=barrier)
                kv_state.advance()
                physical_page = next_physical_page
        kv_pipeline.producer_tail(kv_state)

    @cute.jit
    def attend(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, mO, mSplitO, mLSE, mEntries, mOwnSlot, mArrivals,
               sLastArrival, capacity, scale_log2, q_pipeline, kv_pipeline, consumer_tidx, tile, group, split,
               entry_begin, entry_end):
        thr_mma_qk = tiled_mma_qk.get_slice(consumer_tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(consumer_tidx)
        tSrQ = tiled_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = tiled_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))
        # V as the (dim, keys) B operand: the same smem, MN-major
        sVt = cute.composition(sV, cute.make_ordered_layout((self.head_dim, self.page_size, self.kv_stages), order=(1, 0, 2)))
        tOrVt = tiled_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt))
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_rows, self.page_size)))
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_rows, self.head_dim)))
        acc_O = cute.make_rmem_tensor(tOcO.shape, cutlass.Float32)
        acc_O.fill(0.0)
        tOrP = tiled_mma_pv.make_fragment_A(thr_mma_pv.partition_shape_A((self.tile_rows, self.page_size)))

        num_tokens = mOwnSlot.shape[0]
        lane_column = 2 * (consumer_tidx % 4)
        token_begin = tile * self.tokens_per_tile
        # this thread's two accumulator rows (SM90 m64nN layout: value v = pair + 2 * half + 4 * column_group)
        rows = (tScS[0][0], tScS[2][0])
        local_tokens = (rows[0] // self.heads_per_group, rows[1] // self.heads_per_group)
        own_slots = (
            mOwnSlot[cutlass.min(token_begin + local_tokens[0], num_tokens - 1)],
            mOwnSlot[cutlass.min(token_begin + local_tokens[1], num_tokens - 1)],
        )
        warpgroup_tokens = ((1 << self.tokens_per_warpgroup) - 1) << (
            (consumer_tidx // self.threads_per_warpgroup) * self.tokens_per_warpgroup
        )
        max_first, max_second = -cutlass.Float32.inf, -cutlass.Float32.inf
        sum_first, sum_second = cutlass.Float32(0.0), cutlass.Float32(0.0)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        q_pipeline.consumer_wait(q_state)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        for index in cutlass.range(entry_begin, entry_end, unroll=1):
            physical_page, token_bits = self._entry(mEntries, mOwnSlot, capacity, tile, group, index)
            if token_bits != 0:
                kv_pipeline.consumer_wait(kv_state)
                if token_bits & warpgroup_tokens:
                    acc_S = cute.make_rmem_tensor(tScS.shape, cutlass.Float32)
                    warpgroup.fence()
                    mma_qk = cute.make_mma_atom(tiled_mma_qk.op)
                    for k_block in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                        mma_qk.set(warpgroup.Field.ACCUMULATE, k_block != 0)
                        cute.gemm(mma_qk, acc_S, tSrQ[(None, None, k_block)], tSrK[(None, None, k_block, kv_state.index)], acc_S)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)

                    first_limit = self._visible_limit(token_bits, local_tokens[0], own_slots[0], physical_page)
                    second_limit = self._visible_limit(token_bits, local_tokens[1], own_slots[1], physical_page)
                    max_first, sum_first = self._online_softmax(
                        acc_S, acc_O, 0, first_limit, lane_column, max_first, sum_first, scale_log2
                    )
                    max_second, sum_second = self._online_softmax(
                        acc_S, acc_O, 1, second_limit, lane_column, max_second, sum_second, scale_log2
                    )
                    for i in cutlass.range_constexpr(cute.size(tOrP)):
                        tOrP[i] = acc_S[i].to(self.dtype)
                    warpgroup.fence()
                    mma_pv = cute.make_mma_atom(tiled_mma_pv.op)
                    mma_pv.set(warpgroup.Field.ACCUMULATE, True)
                    for k_block in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                        cute.gemm(mma_pv, acc_O, tOrP[(None, None, k_block)], tOrVt[(None, None, k_block, kv_state.index)], acc_O)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                kv_pipeline.consumer_release(kv_state)
                kv_state.advance()
        q_pipeline.consumer_release(q_state)
        if cutlass.const_expr(self.decode):
            self._store_split(acc_O, (sum_first, sum_second), (max_first, max_second), tOcO, mSplitO, mLSE,
                              token_begin, group, split, num_tokens, lane_column)
            local_token = split // mSplitO.shape[1]
            if token_begin + local_token < num_tokens:  # the same for the whole CTA
                self._merge_if_last(mO, mSplitO, mLSE, mArrivals, sLastArrival, token_begin + local_token, group,
                                    consumer_tidx)
        else:
            self._store(acc_O, (sum_first, sum_second), tOcO, mO, token_begin, group, num_tokens, lane_column)

    @cute.jit
    def _visible_limit(self, token_bits, local_token, own_slot, physical_page):
        """The last key of the page a row's token may see: -1 (page not selected), its own position (its own
        page: causal), or the page's last key."""
        limit = cutlass.Int32(-1)
        if (token_bits >> local_token) & 1:
            limit = cutlass.Int32(self.page_size - 1)
            if (own_slot >> 7) == physical_page:
                limit = own_slot & (self.page_size - 1)
        return limit

    @cute.jit
    def _online_softmax(self, acc_S, acc_O, half: cutlass.Constexpr, limit, lane_column, running_max, running_sum,
                        scale_log2):
        """Mask one accumulator row to keys ``<= limit``, fold it into the row's running max/sum, rescale O,
        and leave the row's probabilities (unnormalised) in ``acc_S``."""
        column_groups = cute.size(acc_S) // 4
        page_max = -cutlass.Float32.inf
        for group in cutlass.range_constexpr(column_groups):
            for pair in cutlass.range_constexpr(2):
                v = pair + 2 * half + 4 * group
                if 8 * group + lane_column + pair > limit:
                    acc_S[v] = -cutlass.Float32.inf
                page_max = cute.arch.fmax(page_max, acc_S[v])
        page_max = cute.arch.fmax(page_max, cute.arch.shuffle_sync_bfly(page_max, offset=1))
        page_max = cute.arch.fmax(page_max, cute.arch.shuffle_sync_bfly(page_max, offset=2))
        new_max = cute.arch.fmax(running_max, page_max * scale_log2)
        # a row with nothing visible so far keeps max -inf; subtract 0 instead so exp2 gives exact zeros
        offset = new_max
        if new_max == -cutlass.Float32.inf:
            offset = cutlass.Float32(0.0)
        correction = cute.math.exp2(running_max - offset, fastmath=True)
        page_sum = cutlass.Float32(0.0)
        for group in cutlass.range_constexpr(column_groups):
            for pair in cutlass.range_constexpr(2):
                v = pair + 2 * half + 4 * group
                probability = cute.math.exp2(acc_S[v] * scale_log2 - offset, fastmath=True)
                acc_S[v] = probability
                page_sum = page_sum + probability
        for group in cutlass.range_constexpr(cute.size(acc_O) // 4):
            for pair in cutlass.range_constexpr(2):
                v = pair + 2 * half + 4 * group
                acc_O[v] = acc_O[v] * correction
        return new_max, running_sum * correction + page_sum

    @cute.jit
    def _store(self, acc_O, row_sum, tOcO, mO, token_begin, group, num_tokens, lane_column):
        """Normalise and write this thread's two rows (tokens past the end are skipped)."""
        for half in cutlass.range_constexpr(2):
            total, token, head = self._row(row_sum, tOcO, half, token_begin, group)
            inverse = cutlass.Float32(0.0)
            if total > 0.0:
                inverse = 1.0 / total
            if token < num_tokens:
                for column_group in cutlass.range_constexpr(cute.size(acc_O) // 4):
                    for pair in cutlass.range_constexpr(2):
                        v = pair + 2 * half + 4 * column_group
                        mO[token, head, 8 * column_group + lane_column + pair] = (acc_O[v] * inverse).to(self.dtype)

    @cute.jit
    def _store_split(self, acc_O, row_sum, row_max, tOcO, mSplitO, mLSE, token_begin, group, split, num_tokens,
                     lane_column):
        """Decode: write the split's token's rows among this thread's two, normalised over the split (fp32), and
        their natural log-sum-exp (``-inf`` and zeros for a row that saw no key: its pages were all skipped)."""
        splits = mSplitO.shape[1]
        local_token = split // splits
        token_split = split - local_token * splits
        for half in cutlass.range_constexpr(2):
            total, token, head = self._row(row_sum, tOcO, half, token_begin, group)
            inverse = cutlass.Float32(0.0)
            log_sum_exp = -cutlass.Float32.inf
            if total > 0.0:
                inverse = 1.0 / total
                log_sum_exp = (row_max[half] + cute.math.log2(total, fastmath=True)) * _LN_2
            if (token == token_begin + local_token) & (token < num_tokens):
                for column_group in cutlass.range_constexpr(cute.size(acc_O) // 4):
                    for pair in cutlass.range_constexpr(2):
                        v = pair + 2 * half + 4 * column_group
                        mSplitO[token, token_split, head, 8 * column_group + lane_column + pair] = acc_O[v] * inverse
                if lane_column == 0:
                    mLSE[token, token_split, head] = log_sum_exp

    @cute.jit
    def _merge_if_last(self, mO, mSplitO, mLSE, mArrivals, sLastArrival, token, group, consumer_tidx):
        """Count this split CTA's arrival at (token, group); the last to arrive merges every split's rows of the
        group's heads into ``mO`` (bf16) and resets the counter. Rows are weighted by ``exp(lse - max lse)`` and
        divided by the weights' sum; a row that no split saw (every lse ``-inf``) is zero."""
        consumer_threads = self.consumer_warpgroups * self.threads_per_warpgroup
        splits = mSplitO.shape[1]
        fence_gpu()  # this thread's split rows before the arrival
        cute.arch.barrier(barrier_id=int(NamedBarrier.CONSUMERS), number_of_threads=consumer_threads)
        counter = self._address(mArrivals, (token, group))
        if consumer_tidx == 0:
            arrived = arrive_gpu(counter)
            sLastArrival[0] = cutlass.Int32(arrived == splits - 1)
        cute.arch.barrier(barrier_id=int(NamedBarrier.CONSUMERS), number_of_threads=consumer_threads)
        if sLastArrival[0] != 0:
            if consumer_tidx == 0:
                reset_gpu(counter)
            fence_gpu()  # the other splits' rows after their arrivals
            # 16 threads per head, 8 consecutive dims each
            threads_per_row = consumer_threads // self.heads_per_group
            dims = self.head_dim // threads_per_row
            head = group * self.heads_per_group + consumer_tidx // threads_per_row
            dim_begin = (consumer_tidx % threads_per_row) * dims
            # relaxed GPU-scope loads: served by L2, where the other SMs' rows are, never by a stale L1 line; every
            # split's log-sum-exp and row issued before any is used, so the merge waits for one round trip
            lse = cute.make_rmem_tensor((self.max_splits,), cutlass.Float32)
            rows = cute.make_rmem_tensor((self.max_splits, dims), cutlass.Float32)
            for s in cutlass.range_constexpr(self.max_splits):
                lse[s] = -cutlass.Float32.inf
                if s < splits:
                    lse[s] = load_gpu(self._address(mLSE, (token, s, head)))
                    row = self._address(mSplitO, (token, s, head, dim_begin))
                    for v in cutlass.range_constexpr(dims // 4):
                        values = load_gpu_x4(row + 16 * v)
                        for i in cutlass.range_constexpr(4):
                            rows[s, 4 * v + i] = values[i]
            top = -cutlass.Float32.inf
            for s in cutlass.range_constexpr(self.max_splits):
                top = cute.arch.fmax(top, lse[s])
            if top == -cutlass.Float32.inf:
                top = cutlass.Float32(0.0)  # no split saw a key: every weight 0, the row 0
            merged = cute.make_rmem_tensor((dims,), cutlass.Float32)
            merged.fill(0.0)
            total = cutlass.Float32(0.0)
            for s in cutlass.range_constexpr(self.max_splits):
                if s < splits:
                    weight = cute.math.exp2((lse[s] - top) * _LOG2_E, fastmath=True)
                    total = total + weight
                    for d in cutlass.range_constexpr(dims):
                        merged[d] = merged[d] + rows[s, d] * weight
            inverse = cutlass.Float32(1.0)
            if total > 0.0:
                inverse = 1.0 / total
            result = cute.make_rmem_tensor((dims,), self.dtype)
            for d in cutlass.range_constexpr(dims):
                result[d] = (merged[d] * inverse).to(self.dtype)
            cute.autovec_copy(result, cute.local_tile(mO[token, head, None], (dims,), (dim_begin // dims,)))

    @staticmethod
    def _address(tensor: cute.Tensor, coordinate):
        """The global address (int64) of ``tensor``'s element at ``coordinate``."""
        return (tensor.iterator + cute.crd2idx(coordinate, tensor.layout)).toint()

    @cute.jit
    def _row(self, row_sum, tOcO, half: cutlass.Constexpr, token_begin, group):
        """``(softmax denominator over the row's quad of threads, token, query head)`` of this thread's row ``half``."""
        total = row_sum[half]
        total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
        total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
        row = tOcO[2 * half][0]
        return total, token_begin + row // self.heads_per_group, group * self.heads_per_group + row % self.heads_per_group
