"""Persistent, warp-specialised FP8 page-score kernel for SM90 (H100/H200), in CuTe DSL.

One CTA = one producer warpgroup + 4 consumer warpgroups of 64 score rows each (256-row q tiles) for FP8 operands,
or + 2 (128-row tiles, pages in pairs) for the exact variant's bf16 operands. The producer's first warp walks the plan's task list (static round-robin
over CTAs, heaviest tasks first) and loads, by TMA, the task's Q tile into a 2-stage ring (the next task's Q
lands while the current pages are consumed) and each history page of the task, addressed by its physical page
id (the next block-table entry is read while the current TMA is in flight), into a multi-stage K ring. The
consumers run ``wgmma.m64n128k32`` e4m3 x e4m3 -> f32 four times per page (K = 128), reduce each accumulator
row to its page maximum (registers, then two quad shuffles) and write one fp32 per (row, page) for pages before
the row's local page only; with 4 consumer warpgroups the maxima of 16 pages are staged in shared memory and
leave as one TMA store per whole block (masked row segments for the blocks on a tile's diagonal or a task's end).
No atomics; the output is deterministic. A plan whose q tiles hold at most 64 rows (decode and verify steps, short
chunks) takes the ``page_parallel`` variant instead: 64-row tiles whose pages the four consumer warpgroups share out,
each storing its rows' maxima directly.

Whatever the metadata holds, nothing is read or written outside the buffers: a task's rows are clamped to the score
buffer's rows, its pages to the score buffer's columns and the block table's, and a physical page id outside the K
cache reads page 0 instead and sets the ``ErrorWord.PAGE_ID`` word of ``mErrors`` (the host raises on it later).
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import arith, llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from .trees import ternary_tree

from ..contract import SCORE_ALIGNMENT_COLUMNS, ErrorWord
from ..cute_runtime import make_tma_pipeline
from ..planner import PAGE_BEGIN_MASK, PAGE_COUNT_MASK, PAGE_COUNT_SHIFT, TOKENS_MASK, TOKENS_SHIFT, DescriptorWord

__all__ = ["PageScoreKernelSm90"]


@dsl_user_op
def fence_view_async_shared(*, loc=None, ip=None):
    """Make this thread's shared-memory writes visible to the async proxy (a TMA store that reads them next)."""
    llvm.inline_asm(None, [], "fence.proxy.async.shared::cta;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def float_bits(value, *, loc=None, ip=None):
    """The bit pattern of an fp32 as an int32 (no instruction)."""
    return cutlass.Int32(arith.bitcast(T.i32(), cutlass.Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def bits_float(bits, *, loc=None, ip=None):
    """The fp32 whose bit pattern is the int32 ``bits`` (no instruction)."""
    return cutlass.Float32(arith.bitcast(T.f32(), cutlass.Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


class TaskDescriptor(NamedTuple):
    """One task of the plan, unpacked (format: ``indexer.planner.DescriptorWord``, docs/INDEXER.md)."""

    row_begin: cutlass.Int32  # first score row: token_begin * H
    position_begin: cutlass.Int32
    request: cutlass.Int32
    page_begin: cutlass.Int32
    page_count: cutlass.Int32
    rows: cutlass.Int32  # tokens * H


def load_task(mDescriptors, task, num_heads: int) -> TaskDescriptor:
    """Read and unpack descriptor ``task`` (trace-time helper; unused fields are dead-code eliminated)."""
    packed = mDescriptors[task, int(DescriptorWord.PACKED)]
    return TaskDescriptor(
        row_begin=mDescriptors[task, int(DescriptorWord.TOKEN_BEGIN)] * num_heads,
        position_begin=mDescriptors[task, int(DescriptorWord.POSITION_BEGIN)],
        request=mDescriptors[task, int(DescriptorWord.REQUEST)],
        page_begin=packed & PAGE_BEGIN_MASK,
        page_count=((packed >> PAGE_COUNT_SHIFT) & PAGE_COUNT_MASK) + 1,
        rows=(((packed >> TOKENS_SHIFT) & TOKENS_MASK) + 1) * num_heads,
    )


class RowTargets(NamedTuple):
    """Where this thread's two accumulator rows go for the current task."""

    tidx: cutlass.Int32
    row_begin: cutlass.Int32
    valid_rows: cutlass.Int32
    first_row: cutlass.Int32
    second_row: cutlass.Int32
    first_history: cutlass.Int32  # L of the first row: pages [0, L) are written
    second_history: cutlass.Int32
    position_begin: cutlass.Int32  # absolute position of the task's first token

    @property
    def is_writer(self):
        return self.tidx % 4 == 0  # one lane of each quad holds the reduced row


class WarpRole(enum.IntEnum):
    """Warpgroup indices inside the CTA."""

    PRODUCER = 0  # its warp 0 issues the TMA loads
    FIRST_CONSUMER = 1


class NamedBarrier(enum.IntEnum):
    """Hardware named-barrier ids (0 is the CTA-wide ``bar.sync``)."""

    ISSUE_RING = 1  # ids ISSUE_RING + w, w = consumer warpgroup: the wgmma issue token (FP8 variant)
    STAGED_MAXIMA = 5  # ids STAGED_MAXIMA + w: warpgroup w's staged row maxima are written / read (FP8 variant)


class PageScoreKernelSm90:
    """Static configuration of the score kernel; ``__call__`` is the host-side (traced) launcher.

    ``num_heads`` (H) is static so row -> token divisions are shifts. Rows of a q tile are
    ``(token, head)`` interleaved: tile row ``i`` is token ``i // H``, head ``i % H``.
    """

    page_size = 128
    head_dim = 128
    shared_memory_bytes = 227 * 1024  # what one CTA may have on SM90
    threads_per_warpgroup = 128
    rows_per_consumer_warpgroup = 64  # one wgmma M

    def __init__(self, num_heads: int, *, exact: bool = False, tma_stores: bool = False, page_parallel: bool = False,
                 num_ctas: int = 132):
        """FP8 (``exact=False``): 256-row tiles of 4 consumer warpgroups, one accumulator each (half the K traffic per
        score of 128-row tiles). A token passed through named barriers makes the warpgroups issue their page's four
        wgmmas in turn (0, 1, 2, 3, 0, ...; it moves on once the four are committed), so that the row-max reductions,
        which compete for the ALU, are staggered instead of coinciding (FlashAttention-3's warp-scheduler barriers).
        Each warpgroup collects its rows' maxima of 16 consecutive pages in shared memory and writes them out as row
        segments, whole 32-byte sectors per store, instead of one scattered 4-byte store per row and page.

        ``tma_stores`` (FP8): a staging block whose rows all lie inside the tile and whose pages all lie before each of
        its rows' local page (every block but the diagonal one and a task's partial last block) leaves by one TMA
        store (``cp.async.bulk.tensor``, shared -> global) issued by one thread; the other blocks take the masked
        write-out. The staging blocks are double buffered, so each flush costs one warpgroup barrier. Needs a score
        buffer whose base is 16-byte aligned and whose row pitch is a multiple of 4 floats (TMA's global-stride rule):
        the host picks this variant only then.

        ``exact``: operands are the bf16 upcasts of the e4m3 values (exact: e4m3 is a subset of bf16) and the wgmma is
        ``bf16.bf16`` (k16), whose fp32 accumulation reproduces the reference (measured on the H200); twice the shared
        memory per tile, so 128-row tiles of 2 consumer warpgroups, each overlapping its own wgmma and reduction with
        two accumulators (pages in pairs), and 4 K stages.

        Every thread reduces its 32 values of a row as int32 bit patterns, in a tree of three-input nodes that ptxas
        issues as ``VIMNMX3`` (16 instructions instead of 31 ``FMNMX``; sm_90 has no three-input float max). A float's
        bits order as a signed int like the float when one of the values is non-negative; when the largest pattern is
        negative, every value is, their order is reversed, and a min tree gives the max (a second pass, taken only
        then). The page maxima are the float maxima (of two zeros the positive one).

        ``page_parallel`` (FP8): 64-row tiles, for plans whose tiles hold at most 64 rows (decode and verify steps,
        short chunks). In a 256-row tile such a task keeps one consumer warpgroup busy and three idle, the pages
        waiting on that warpgroup's wgmma and reduction one after another; here the four consumer warpgroups share out
        the task's pages (warpgroup ``w`` takes every fourth page from the ``w``-th), all on the tile's 64 rows, and
        each stores its rows' page maxima directly (a tile's few rows fill no staging block). Measured 5-9 % faster
        on decode steps over 128K tokens (docs/PERFORMANCE.md), where the K traffic bounds both.

        ``num_ctas``: the persistent grid, one CTA per SM.
        """
        if num_heads not in (1, 2, 4):
            raise ValueError(f"num_heads must be 1, 2 or 4, got {num_heads}")
        if tma_stores and exact:
            raise ValueError("tma_stores writes the FP8 variant's staged blocks: the exact variant stores directly")
        if page_parallel and (exact or tma_stores):
            raise ValueError("page_parallel is an FP8 variant with direct stores: exact and tma_stores must be False")
        if type(num_ctas) is not int or num_ctas < 1:
            raise ValueError(f"num_ctas must be a positive int, got {num_ctas!r}")
        self.exact = exact
        self.operand_dtype = cutlass.BFloat16 if exact else cutlass.Float8E4M3FN
        operand_bytes = 2 if exact else 1
        consumer_warpgroups = 2 if exact else 4
        self.page_parallel = page_parallel
        self.issue_ring = not exact and not page_parallel
        self.staged_stores = not exact and not page_parallel
        self.staged_pages = 16
        self.tma_stores = tma_stores
        self.maxima_buffers = 2 if tma_stores else 1
        self.num_heads = num_heads
        self.num_ctas = num_ctas
        self.num_consumer_warpgroups = consumer_warpgroups
        self.paired_pages = exact
        self.tile_rows = self.rows_per_consumer_warpgroup * (1 if page_parallel else consumer_warpgroups)
        # setmaxnreg only moves registers within the CTA's launch allocation (ptxas's count x threads:
        # 168 x 384 and 96 x 640); asking for more than the producer frees blocks forever.
        self.producer_registers, self.consumer_registers = (40, 232) if exact else (24, 112)
        # a page-parallel CTA holds up to four pages in its consumers: more stages keep the loads ahead of them
        self.k_stages = 4 if exact else (12 if page_parallel else 8)
        self.q_stages = 2  # the next task's Q tile lands while the current pages are consumed
        self.threads_per_cta = (1 + consumer_warpgroups) * self.threads_per_warpgroup
        self.q_tile_bytes = self.tile_rows * self.head_dim * operand_bytes
        self.page_bytes = self.page_size * self.head_dim * operand_bytes
        needed = self._shared_memory_bytes_needed()
        assert needed <= self.shared_memory_bytes, f"{needed} bytes of shared memory per CTA"

    def _shared_memory_bytes_needed(self) -> int:
        barriers = 8 * 2 * (self.q_stages + self.k_stages)
        return (-(-barriers // 1024) * 1024 + self.q_stages * self.q_tile_bytes + self.k_stages * self.page_bytes
                + 4 * self._staged_maxima_floats())

    def _staged_row_pitch(self) -> int:
        # rows padded by one float so the writer lanes' rows fall in distinct banks; a TMA store reads a dense block
        # (there the writers' 4-way conflict costs two stores per page)
        return self.staged_pages + (0 if self.tma_stores else 1)

    def _staged_maxima_layout(self):
        """(64 rows, staged_pages, buffer, consumer warpgroup)."""
        rows = self.rows_per_consumer_warpgroup
        pitch = self._staged_row_pitch()
        block = rows * pitch
        return cute.make_layout((rows, self.staged_pages, self.maxima_buffers, self.num_consumer_warpgroups),
                                stride=(pitch, 1, block, block * self.maxima_buffers))

    def _staged_maxima_floats(self) -> int:
        if not self.staged_stores:
            return 4  # unused
        return (self.rows_per_consumer_warpgroup * self._staged_row_pitch() * self.maxima_buffers
                * self.num_consumer_warpgroups)

    def _smem_layout(self, rows: int, stages: int):
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.operand_dtype, self.head_dim),
            self.operand_dtype,
        )
        return cute.tile_to_shape(atom, (rows, self.head_dim, stages), order=(0, 1, 2))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (total_q, H, 128) e4m3 (bf16 for exact), contiguous
        mK: cute.Tensor,  # (num_pages, 128 tokens, 128 dims) like mQ, each page contiguous, page stride free
        mScores: cute.Tensor,  # (total_q * H, pitch) fp32, unit column stride
        mBlockTable: cute.Tensor,  # (B, >= max_pages) int32
        mDescriptors: cute.Tensor,  # (task_capacity, 4) int32
        mNumTasks: cute.Tensor,  # (1,) int32
        mErrors: cute.Tensor,  # (>= ErrorWord count,) int32: ErrorWord.PAGE_ID is set to 1 on a bad page id
        stream,
    ):
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.operand_dtype,
            self.operand_dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            cutlass.Float32,
            (1 if self.page_parallel else self.num_consumer_warpgroups, 1, 1),
            tiler_mn=(64, self.page_size),
        )
        sQ_layout = self._smem_layout(self.tile_rows, self.q_stages)
        sK_layout = self._smem_layout(self.page_size, self.k_stages)
        # the operands as the wgmmas read them: q rows (token, head) K-major, K as (token, dim, page)
        mQ = cute.make_tensor(mQ.iterator, cute.make_layout((mQ.shape[0] * self.num_heads, self.head_dim),
                                                            stride=(self.head_dim, 1)))
        mK = cute.make_tensor(mK.iterator, cute.make_layout((self.page_size, self.head_dim, mK.shape[0]),
                                                            stride=(self.head_dim, 1, mK.stride[0])))
        tma_atom_q, mQ_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, cute.slice_(sQ_layout, (None, None, 0)), (self.tile_rows, self.head_dim)
        )
        tma_atom_k, mK_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(sK_layout, (None, None, 0)), (self.page_size, self.head_dim)
        )
        tma_atom_scores, mScores_tma = None, None
        if cutlass.const_expr(self.tma_stores):
            block_layout = cute.slice_(self._staged_maxima_layout(), (None, None, 0, 0))
            tma_atom_scores, mScores_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mScores, block_layout, (self.rows_per_consumer_warpgroup, self.staged_pages)
            )

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, self.q_stages * 2]
            k_barriers: cute.struct.MemRange[cutlass.Int64, self.k_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.operand_dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.operand_dtype, cute.cosize(sK_layout)], 1024]
            sMaxima: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self._staged_maxima_floats()], 128]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_q,
            mQ_tma,
            tma_atom_k,
            mK_tma,
            mScores,
            tma_atom_scores,
            mScores_tma,
            mBlockTable,
            mDescriptors,
            mNumTasks,
            mErrors,
            cute.size(mK, mode=[2]),
            tiled_mma,
            sQ_layout,
            sK_layout,
        ).launch(
            grid=(self.num_ctas, 1, 1),
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
        mScores: cute.Tensor,
        tma_atom_scores: Optional[cute.CopyAtom],
        mScores_tma: Optional[cute.Tensor],
        mBlockTable: cute.Tensor,
        mDescriptors: cute.Tensor,
        mNumTasks: cute.Tensor,
        mErrors: cute.Tensor,
        num_pages: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)
        cta_idx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        q_pipeline = self._ring(storage.q_barriers.data_ptr(), self.q_stages, self.q_tile_bytes)
        k_pipeline = self._ring(storage.k_barriers.data_ptr(), self.k_stages, self.page_bytes)
        pipeline.pipeline_init_arrive()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sMaxima = None
        if cutlass.const_expr(self.staged_stores):
            sMaxima = storage.sMaxima.get_tensor(self._staged_maxima_layout())
        pipeline.pipeline_init_wait()

        num_tasks = mNumTasks[0]
        if warpgroup_idx == WarpRole.PRODUCER:
            cute.arch.warpgroup_reg_dealloc(self.producer_registers)
            if warp_idx == 0:
                self.load(tma_atom_q, mQ, tma_atom_k, mK, sQ, sK, mBlockTable, mDescriptors, mErrors, num_pages,
                          mScores.shape[1], q_pipeline, k_pipeline, cta_idx, num_ctas, num_tasks)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_registers)
            self.score(tiled_mma, sQ, sK, sMaxima, mScores, tma_atom_scores, mScores_tma, mDescriptors,
                       q_pipeline, k_pipeline, tidx - self.threads_per_warpgroup, cta_idx, num_ctas, num_tasks)

    def _ring(self, barriers, stages: int, stage_bytes: int):
        consumer_warps = self.num_consumer_warpgroups * self.threads_per_warpgroup // 32
        return make_tma_pipeline(barriers, stages, stage_bytes, consumer_warps)

    @cute.jit
    def load(self, tma_atom_q, mQ, tma_atom_k, mK, sQ, sK, mBlockTable, mDescriptors, mErrors, num_pages,
             score_columns, q_pipeline, k_pipeline, cta_idx, num_ctas, num_tasks):
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.k_stages)
        gK = cute.local_tile(mK, (self.page_size, self.head_dim), (None, None, None))  # (128, 128, 1, 1, pages)
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        for task in cutlass.range(cta_idx, num_tasks, num_ctas, unroll=1):
            descriptor = load_task(mDescriptors, task, self.num_heads)
            row_begin, request = descriptor.row_begin, descriptor.request
            page_begin = descriptor.page_begin
            page_count = self._clamped_page_count(descriptor, score_columns)
            if cutlass.const_expr(self.paired_pages):
                # An odd chunk is padded with the next page: it exists (at most the local page of the
                # tile's last token) and the consumers never store it, since it is not before any row's L.
                page_count = (page_count + 1) // 2 * 2

            gQ = cute.local_tile(cute.domain_offset((row_begin, 0), mQ), (self.tile_rows, self.head_dim), (0, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            q_pipeline.producer_acquire(q_state)
            cute.copy(tma_atom_q, tQgQ, tQsQ[(None, q_state.index)], tma_bar_ptr=q_pipeline.producer_get_barrier(q_state))
            q_state.advance()

            last_column = mBlockTable.shape[1] - 1
            physical_page = self._checked_page(mBlockTable[request, cutlass.min(page_begin, last_column)], num_pages,
                                               mErrors)
            for page in cutlass.range(page_count, unroll=1):
                # read the next entry now: its latency hides behind this page's TMA
                next_page = cutlass.min(page_begin + cutlass.min(page + 1, page_count - 1), last_column)
                next_physical_page = self._checked_page(mBlockTable[request, next_page], num_pages, mErrors)
                k_pipeline.producer_acquire(k_state)
                cute.copy(
                    tma_atom_k,
                    tKgK[(None, 0, 0, physical_page)],
                    tKsK[(None, k_state.index)],
                    tma_bar_ptr=k_pipeline.producer_get_barrier(k_state),
                )
                k_state.advance()
                physical_page = next_physical_page
        q_pipeline.producer_tail(q_state)
        k_pipeline.producer_tail(k_state)

    @cute.jit
    def _checked_page(self, page, num_pages, mErrors):
        """``page`` when it is a page of the K cache, else page 0 with ``ErrorWord.PAGE_ID`` set (its scores are then
        meaningless, never out of bounds)."""
        checked = page
        if (page < 0) | (page >= num_pages):
            mErrors[int(ErrorWord.PAGE_ID)] = 1
            checked = cutlass.Int32(0)
        return checked

    def _clamped_page_count(self, descriptor, score_columns):
        """The task's pages that lie inside the score buffer's columns (all of them for a plan's own tasks;
        trace-time helper, producer and consumers compute the same)."""
        return cutlass.min(descriptor.page_count, score_columns - descriptor.page_begin)

    def _clamped_rows(self, descriptor, score_rows):
        """The task's rows that lie inside the score buffer's rows (trace-time helper)."""
        return cutlass.min(descriptor.rows, score_rows - descriptor.row_begin)

    @cute.jit
    def score(self, tiled_mma, sQ, sK, sMaxima, mScores, tma_atom_scores, mScores_tma, mDescriptors,
              q_pipeline, k_pipeline, consumer_tidx, cta_idx, num_ctas, num_tasks):
        # page_parallel: every consumer warpgroup computes the tile's 64 rows
        thr_mma = tiled_mma.get_slice(consumer_tidx % self.threads_per_warpgroup if self.page_parallel else consumer_tidx)
        tSrQ = tiled_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = tiled_mma.make_fragment_B(thr_mma.partition_B(sK))
        tScS = thr_mma.partition_C(cute.make_identity_tensor((self.tile_rows, self.page_size)))
        first_row = tScS[0][0]  # SM90 m64n128 accumulator: value v = col_pair + 2 * row_half + 4 * col_group
        second_row = tScS[2][0]

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        k_read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.k_stages)
        k_release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.k_stages)
        staging_buffer = cutlass.Int32(0)  # tma_stores: the double-buffered block this warpgroup fills
        consumer_warpgroup = cute.arch.make_warp_uniform(consumer_tidx // self.threads_per_warpgroup)
        if cutlass.const_expr(self.issue_ring):
            # the last warpgroup hands the first one its first token
            if consumer_warpgroup == self.num_consumer_warpgroups - 1:
                self._pass_issue_token(consumer_warpgroup)
        for task in cutlass.range(cta_idx, num_tasks, num_ctas, unroll=1):
            descriptor = load_task(mDescriptors, task, self.num_heads)
            page_begin = descriptor.page_begin
            page_count = self._clamped_page_count(descriptor, mScores.shape[1])
            rows = RowTargets(
                consumer_tidx,
                descriptor.row_begin,
                self._clamped_rows(descriptor, mScores.shape[0]),
                first_row,
                second_row,
                self._local_page(descriptor.position_begin, first_row),
                self._local_page(descriptor.position_begin, second_row),
                descriptor.position_begin,
            )

            q_pipeline.consumer_wait(q_state)
            if cutlass.const_expr(self.paired_pages):
                # Pages go in pairs: both pages' wgmmas are issued, then the first page is reduced while
                # the second one's run. No wgmma stays in flight across the loop's back edge (ptxas would
                # serialise them), and the other consumer warpgroup fills the tensor cores meanwhile.
                # States are reassigned, never advanced in place, so the DSL carries them through loops.
                for pair in cutlass.range((page_count + 1) // 2, unroll=1):
                    page = page_begin + 2 * pair
                    acc_even = cute.make_rmem_tensor(tScS.shape, cutlass.Float32)
                    acc_odd = cute.make_rmem_tensor(tScS.shape, cutlass.Float32)
                    k_read_state = self._issue_page(tiled_mma, acc_even, tSrQ, tSrK, q_state, k_pipeline, k_read_state)
                    k_read_state = self._issue_page(tiled_mma, acc_odd, tSrQ, tSrK, q_state, k_pipeline, k_read_state)
                    warpgroup.wait_group(1)
                    k_release_state = self._release_page(k_pipeline, k_release_state)
                    self._store_page(acc_even, rows, mScores, page)
                    warpgroup.wait_group(0)
                    k_release_state = self._release_page(k_pipeline, k_release_state)
                    self._store_page(acc_odd, rows, mScores, page + 1)
            elif cutlass.const_expr(self.page_parallel):
                k_read_state, k_release_state = self._score_shared_pages(
                    tiled_mma, tSrQ, tSrK, tScS, q_state, k_pipeline, k_read_state, k_release_state, rows, mScores,
                    consumer_warpgroup, page_begin, page_count)
            else:
                if consumer_warpgroup * self.rows_per_consumer_warpgroup < rows.valid_rows:
                    # One accumulator per warpgroup: while one warpgroup reduces, the others' wgmmas run.
                    k_read_state, k_release_state, staging_buffer = self._score_pages(
                        tiled_mma, tSrQ, tSrK, tScS, q_state, k_pipeline, k_read_state, k_release_state, rows,
                        sMaxima, mScores, tma_atom_scores, mScores_tma, consumer_warpgroup, staging_buffer,
                        page_begin, page_count)
                else:
                    # every row of this warpgroup's block lies past the task's rows (a request's last tile):
                    # no wgmma, no reduction, no store
                    for _ in cutlass.range(page_count, unroll=1):
                        k_read_state = self._pass_page(k_pipeline, k_read_state, consumer_warpgroup)
                        k_release_state = self._release_page(k_pipeline, k_release_state)
            q_pipeline.consumer_release(q_state)
            q_state.advance()
        if cutlass.const_expr(self.issue_ring):
            # every warpgroup issued as many pages; the last one's final token is still pending
            if consumer_warpgroup == 0:
                self._wait_issue_token(consumer_warpgroup)
        if cutlass.const_expr(self.tma_stores):
            if consumer_tidx % self.threads_per_warpgroup == 0:
                cute.arch.cp_async_bulk_wait_group(0)  # shared memory must outlive the last store's reads

    @cute.jit
    def _score_pages(self, tiled_mma, tSrQ, tSrK, tScS, q_state, k_pipeline, k_read_state, k_release_state, rows,
                     sMaxima, mScores, tma_atom_scores, mScores_tma, consumer_warpgroup, staging_buffer, page_begin,
                     page_count):
        """One accumulator per warpgroup: the task's pages, each issued, waited on, reduced and stored (staged)."""
        for page_offset in cutlass.range(page_count, unroll=1):
            acc = cute.make_rmem_tensor(tScS.shape, cutlass.Float32)
            k_read_state = self._issue_page(tiled_mma, acc, tSrQ, tSrK, q_state, k_pipeline, k_read_state,
                                            consumer_warpgroup)
            warpgroup.wait_group(0)
            k_release_state = self._release_page(k_pipeline, k_release_state)
            if cutlass.const_expr(self.tma_stores):
                slot = page_offset % self.staged_pages
                self._stage_page(acc, rows, sMaxima[None, None, staging_buffer, consumer_warpgroup],
                                 consumer_warpgroup, slot)
                if slot == self.staged_pages - 1 or page_offset == page_count - 1:
                    self._flush_staged_maxima(sMaxima[None, None, staging_buffer, consumer_warpgroup], rows,
                                              mScores, tma_atom_scores, mScores_tma, consumer_warpgroup,
                                              page_begin + page_offset - slot, slot + 1)
                    staging_buffer = 1 - staging_buffer
            else:
                slot = page_offset % self.staged_pages
                self._stage_page(acc, rows, sMaxima[None, None, 0, consumer_warpgroup], consumer_warpgroup, slot)
                if slot == self.staged_pages - 1 or page_offset == page_count - 1:
                    self._write_staged_maxima(sMaxima[None, None, 0, consumer_warpgroup], rows, mScores,
                                              consumer_warpgroup, page_begin + page_offset - slot, slot + 1)
        return k_read_state, k_release_state, staging_buffer

    @cute.jit
    def _score_shared_pages(self, tiled_mma, tSrQ, tSrK, tScS, q_state, k_pipeline, k_read_state, k_release_state,
                            rows, mScores, consumer_warpgroup, page_begin, page_count):
        """page_parallel: this warpgroup scores every ``num_consumer_warpgroups``-th page of the task from its own
        index on and stores the maxima directly; it waits for the others' pages too, so that its release of every
        stage stays in the stage's phase."""
        for page_offset in cutlass.range(page_count, unroll=1):
            if page_offset % self.num_consumer_warpgroups == consumer_warpgroup:
                acc = cute.make_rmem_tensor(tScS.shape, cutlass.Float32)
                k_read_state = self._issue_page(tiled_mma, acc, tSrQ, tSrK, q_state, k_pipeline, k_read_state)
                warpgroup.wait_group(0)
                k_release_state = self._release_page(k_pipeline, k_release_state)
                self._store_page(acc, rows, mScores, page_begin + page_offset)
            else:
                k_pipeline.consumer_wait(k_read_state)
                k_read_state = k_read_state.clone()
                k_read_state.advance()
                k_release_state = self._release_page(k_pipeline, k_release_state)
        return k_read_state, k_release_state

    def _local_page(self, position_begin, tile_row):
        """L of a tile row: its token's local page, so pages [0, L) are its history (trace-time helper)."""
        return (position_begin + tile_row // self.num_heads) // self.page_size

    def _issue_token_barrier(self, warpgroup_index):
        return int(NamedBarrier.ISSUE_RING) + warpgroup_index

    @cute.jit
    def _wait_issue_token(self, consumer_warpgroup):
        cute.arch.barrier(barrier_id=self._issue_token_barrier(consumer_warpgroup),
                          number_of_threads=2 * self.threads_per_warpgroup)

    @cute.jit
    def _pass_issue_token(self, consumer_warpgroup):
        following = (consumer_warpgroup + 1) % self.num_consumer_warpgroups
        cute.arch.barrier_arrive(barrier_id=self._issue_token_barrier(following),
                                 number_of_threads=2 * self.threads_per_warpgroup)

    @cute.jit
    def _issue_page(self, tiled_mma, acc, tSrQ, tSrK, q_state, k_pipeline, k_read_state, consumer_warpgroup=None):
        """Wait for the next K page and issue its four k32 wgmmas into ``acc`` (not waited on); with the
        issue ring, only while holding the token, which passes on once the four are committed."""
        k_pipeline.consumer_wait(k_read_state)
        if cutlass.const_expr(self.issue_ring):
            self._wait_issue_token(consumer_warpgroup)
        warpgroup.fence()
        # a fresh atom per page: setting ACCUMULATE on the loop-carried tiled MMA breaks SSA dominance
        mma_atom = cute.make_mma_atom(tiled_mma.op)
        for k_block in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            mma_atom.set(warpgroup.Field.ACCUMULATE, k_block != 0)
            cute.gemm(
                mma_atom,
                acc,
                tSrQ[(None, None, k_block, q_state.index)],
                tSrK[(None, None, k_block, k_read_state.index)],
                acc,
            )
        warpgroup.commit_group()
        if cutlass.const_expr(self.issue_ring):
            self._pass_issue_token(consumer_warpgroup)
        next_state = k_read_state.clone()
        next_state.advance()
        return next_state

    @cute.jit
    def _pass_page(self, k_pipeline, k_read_state, consumer_warpgroup):
        """An idle warpgroup's turn at a page: it waits for the page as the others do, so its release stays in the
        page's phase, and passes the issue token on without issuing anything."""
        k_pipeline.consumer_wait(k_read_state)
        self._wait_issue_token(consumer_warpgroup)
        self._pass_issue_token(consumer_warpgroup)
        next_state = k_read_state.clone()
        next_state.advance()
        return next_state

    @cute.jit
    def _release_page(self, k_pipeline, k_release_state):
        k_pipeline.consumer_release(k_release_state)
        next_state = k_release_state.clone()
        next_state.advance()
        return next_state

    @cute.jit
    def _store_page(self, acc, rows, mScores, page):
        """Row maxima of one page; one lane per quad stores those before the row's local page."""
        first_max, second_max = self._page_row_maxima(acc)
        if rows.is_writer:
            if rows.first_row < rows.valid_rows:
                if page < rows.first_history:
                    mScores[rows.row_begin + rows.first_row, page] = first_max
            if rows.second_row < rows.valid_rows:
                if page < rows.second_history:
                    mScores[rows.row_begin + rows.second_row, page] = second_max

    @cute.jit
    def _stage_page(self, acc, rows, sWarpgroupMaxima, consumer_warpgroup, slot):
        """Row maxima of one page into column ``slot`` of this warpgroup's staging block."""
        first_max, second_max = self._page_row_maxima(acc)
        if rows.is_writer:
            block_row = consumer_warpgroup * self.rows_per_consumer_warpgroup
            sWarpgroupMaxima[rows.first_row - block_row, slot] = first_max
            sWarpgroupMaxima[rows.second_row - block_row, slot] = second_max

    @cute.jit
    def _write_staged_maxima(self, sWarpgroupMaxima, rows, mScores, consumer_warpgroup, first_page, pages):
        """Write the staged ``pages`` columns of the warpgroup's 64 rows, consecutive lanes on consecutive
        pages of a row (whole sectors per store), each row only below its local page."""
        barrier_id = int(NamedBarrier.STAGED_MAXIMA) + consumer_warpgroup
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=self.threads_per_warpgroup)
        self._write_block(sWarpgroupMaxima, mScores, rows.tidx % self.threads_per_warpgroup, self.threads_per_warpgroup,
                          consumer_warpgroup * self.rows_per_consumer_warpgroup, rows.row_begin, rows.valid_rows,
                          rows.position_begin, first_page, pages)
        # the next page's maxima may overwrite the block only once every thread has read it
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=self.threads_per_warpgroup)

    @cute.jit
    def _flush_staged_maxima(self, sBlock, rows, mScores, tma_atom_scores, mScores_tma, consumer_warpgroup, first_page,
                             pages):
        """Write the staged ``pages`` columns of the warpgroup's 64 rows: one TMA store when the block is whole
        (every row inside the tile, every page before every row's local page), else the masked write-out. The
        block's buffer is refilled two flushes later; the barrier here also tells every thread that the store
        issued from the other buffer one flush ago has finished reading it."""
        thread = rows.tidx % self.threads_per_warpgroup
        block_row = consumer_warpgroup * self.rows_per_consumer_warpgroup
        fence_view_async_shared()
        if thread == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=int(NamedBarrier.STAGED_MAXIMA) + consumer_warpgroup,
                          number_of_threads=self.threads_per_warpgroup)
        # rows' local pages grow with the row, so the block's first row has the smallest; a TMA store's box must
        # start on a 16-byte column (any other start raised an illegal instruction on the H200)
        whole = ((pages == self.staged_pages) & (block_row + self.rows_per_consumer_warpgroup <= rows.valid_rows)
                 & (first_page + pages <= self._local_page(rows.position_begin, block_row))
                 & (first_page % SCORE_ALIGNMENT_COLUMNS == 0))
        if whole:
            if thread == 0:
                gBlock = cute.local_tile(cute.domain_offset((rows.row_begin + block_row, first_page), mScores_tma),
                                         (self.rows_per_consumer_warpgroup, self.staged_pages), (0, 0))
                tBsB, tBgB = cpasync.tma_partition(tma_atom_scores, 0, cute.make_layout(1), cute.group_modes(sBlock, 0, 2),
                                                   cute.group_modes(gBlock, 0, 2))
                cute.copy(tma_atom_scores, tBsB, tBgB)
                cute.arch.cp_async_bulk_commit_group()
        else:
            self._write_block(sBlock, mScores, thread, self.threads_per_warpgroup, block_row, rows.row_begin,
                              rows.valid_rows, rows.position_begin, first_page, pages)

    @cute.jit
    def _write_block(self, sBlock, mScores, thread, threads: int, block_row, row_begin, valid_rows, position_begin,
                     first_page, pages):
        """Write columns ``[0, pages)`` of a staged (64 rows, staged_pages) block (pages from ``first_page`` on) with
        ``threads`` threads, consecutive threads on consecutive pages of a row (whole sectors per store), each row
        only below its local page. ``block_row``: the block's first tile row."""
        rows_per_pass = threads // self.staged_pages
        column = thread % self.staged_pages
        passes = self.rows_per_consumer_warpgroup // rows_per_pass
        page = first_page + column
        # loads in groups of four so their latencies overlap (all eight at once spill under DSL 4.3.5)
        for group in cutlass.range(0, passes, 4, unroll=1):
            staged = [sBlock[(group + i) * rows_per_pass + thread // self.staged_pages, column] for i in range(4)]
            for i in cutlass.range_constexpr(4):
                tile_row = block_row + (group + i) * rows_per_pass + thread // self.staged_pages
                history = self._local_page(position_begin, tile_row)
                if column < pages and tile_row < valid_rows and page < history:
                    mScores[row_begin + tile_row, page] = staged[i]

    @cute.jit
    def _page_row_maxima(self, acc):
        """This thread's two accumulator rows reduced to their page maxima (complete in every lane of the quad)."""
        values_per_row = cute.size(acc) // 2
        return (self._quad_max(self._row_max_by_bits(acc, 0, values_per_row)),
                self._quad_max(self._row_max_by_bits(acc, 1, values_per_row)))

    @staticmethod
    def _row_values(acc, half: int, values_per_row: int) -> list:
        return [acc[pair + 2 * half + 4 * group] for group in range(values_per_row // 2) for pair in range(2)]

    @cute.jit
    def _row_max_by_bits(self, acc, half: cutlass.Constexpr, values_per_row: cutlass.Constexpr):
        """Max over this thread's values of one accumulator row, from their bit patterns as int32 (see ``__init__``)."""
        bits = [float_bits(value) for value in self._row_values(acc, half, values_per_row)]
        largest = ternary_tree(bits, cutlass.max)
        if largest < 0:  # every value is negative (sign bit set): a larger pattern is a smaller float
            largest = ternary_tree(bits, cutlass.min)
        return bits_float(largest)

    @staticmethod
    def _quad_max(value):
        """Max across the four lanes that share an accumulator row."""
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, offset=1))
        return cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, offset=2))
