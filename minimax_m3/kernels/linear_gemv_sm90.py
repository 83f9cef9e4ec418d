"""Weight-streaming GEMV for a decode step's linear layers, in CuTe DSL for SM90: ``out[m, n] = sum_k x[m, k] *
w[n, k]`` for the few rows ``m`` of a decode step (1 to 4 tokens) and an ``nn.Linear`` weight ``w [N, K]``.

At these sizes a projection is the reading of its weight, and what bounds the read is the bytes in flight. Each CTA
(one per SM) owns a contiguous band of weight rows; one producer thread streams them into a ring of shared-memory
stages, one weight row per stage, by bulk copies (``cp.async.bulk``: a row is contiguous, so no tensor map), which
keeps the ring's ~190 KB per SM in flight without holding any of it in registers. Eight consumer warps keep the
tokens' activations in registers (thread ``t`` owns the 16-byte vectors ``t``, ``t + 256``, ... of a row), multiply
each row as it lands and hold one fp32 partial sum per (row, token) for a group of ``32 / tokens`` rows (tokens
rounded up to a power of two). A group's 32 sums are added over each warp's lanes by a halving exchange (31
shuffles, after which lane ``j`` holds sum ``j``) and over the warps in shared memory in warp order, so the result
does not depend on timing.
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from indexer.cute_runtime import make_tma_pipeline

__all__ = ["LinearGemvSm90", "MAX_TOKENS"]

MAX_TOKENS = 4
"""The most rows of ``x`` one launch multiplies: a group's sums are 32 values, one per lane."""


class NamedBarrier(enum.IntEnum):
    """Named barrier ids (0 is the CTA-wide barrier)."""

    CONSUMERS = 1  # the consumer warps, around a group's cross-warp sums


@dsl_user_op
def bulk_copy_to_shared(shared_address, global_address, size, barrier_address, *, loc=None, ip=None):
    """``size`` bytes (a multiple of 16, both addresses 16-byte aligned) from global memory into shared memory,
    completing ``size`` transaction bytes on the mbarrier at ``barrier_address``."""
    llvm.inline_asm(
        None,
        [cutlass.Int32(shared_address).ir_value(loc=loc, ip=ip), cutlass.Int64(global_address).ir_value(loc=loc, ip=ip),
         cutlass.Int32(size).ir_value(loc=loc, ip=ip), cutlass.Int32(barrier_address).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


class LinearGemvSm90:
    """Static configuration (the number of tokens and the input width ``depth``); ``__call__`` is the traced host
    launcher, ``kernel`` the device code. ``ctas`` CTAs split the weight's rows evenly."""

    consumer_warps = 16
    vector = 8  # bf16 elements per 16-byte load
    shared_budget = 192 * 1024
    max_stages = 16

    activation_registers = 64  # fp32 activations a thread holds: tokens x its vectors x 8

    @classmethod
    def max_depth(cls, tokens: int) -> int:
        """The widest input for ``tokens`` rows: the activations fit their registers, two stages their memory."""
        vectors_per_thread = cls.activation_registers // (cls.vector * tokens)
        return min(vectors_per_thread * 32 * cls.consumer_warps * cls.vector, cls.shared_budget // 4)

    def __init__(self, tokens: int, depth: int):
        if not 1 <= tokens <= MAX_TOKENS:
            raise ValueError(f"tokens must be 1 to {MAX_TOKENS}, got {tokens}")
        if depth % self.vector or not 0 < depth <= self.max_depth(tokens):
            raise ValueError(f"depth must be a positive multiple of {self.vector} of at most "
                             f"{self.max_depth(tokens)} elements for {tokens} tokens, got {depth}")
        self.tokens = tokens
        self.depth = depth
        self.padded_tokens = 1 << (tokens - 1).bit_length()
        self.rows_per_group = 32 // self.padded_tokens
        self.consumer_threads = 32 * self.consumer_warps
        self.threads = self.consumer_threads
        self.vectors = depth // self.vector
        self.vectors_per_thread = -(-self.vectors // self.consumer_threads)
        self.stage_bytes = depth * 2
        self.stages = min(self.max_stages, self.shared_budget // self.stage_bytes)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (tokens, depth) bf16, 16-byte aligned rows
        mW: cute.Tensor,  # (N, depth) bf16, contiguous
        mOut: cute.Tensor,  # (tokens, N) bf16, unit column stride
        ctas: cutlass.Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            partial: cute.struct.MemRange[cutlass.Float32, 2 * 32 * self.consumer_warps]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, self.stages * self.depth], 128]

        self.shared_storage = SharedStorage
        self.kernel(mX, mW, mOut).launch(grid=(ctas, 1, 1), block=(self.threads, 1, 1), min_blocks_per_mp=1,
                                         stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        rows = mW.shape[0]
        # an even band of rows per CTA (the bands differ by at most one row)
        first = cutlass.Int32(cutlass.Int64(rows) * cta // ctas)
        end = cutlass.Int32(cutlass.Int64(rows) * (cta + 1) // ctas)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        ring = make_tma_pipeline(storage.barriers.data_ptr(), self.stages, self.stage_bytes, self.consumer_warps)
        pipeline.pipeline_init_arrive()
        sW = storage.sW.get_tensor(cute.make_layout((self.depth, self.stages)))
        sPartial = storage.partial.get_tensor(cute.make_layout((32, self.consumer_warps, 2)))
        pipeline.pipeline_init_wait()

        self.multiply(mX, mW, sW, sPartial, mOut, ring, first, end, tidx, warp)

    @cute.jit
    def load_row(self, ring, state, sW, weight_address, row):
        """Weight row ``row`` into the stage ``state`` names once every warp has released it, by one thread (the
        caller advances ``state``: a state advanced inside a helper would not be seen by the tracer)."""
        ring.producer_acquire(state)
        with cute.arch.elect_one():
            bulk_copy_to_shared(sW[(None, state.index)].iterator.toint(),
                                weight_address + cutlass.Int64(row) * self.stage_bytes, self.stage_bytes,
                                ring.producer_get_barrier(state).toint())

    @cute.jit
    def multiply(self, mX, mW, sW, sPartial, mOut, ring, first, end, tidx, warp):
        lane = tidx % 32
        # warp 0 also streams the band's rows: the first `stages` now, then one more as each stage is released
        weight_address = mW.iterator.toint()
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        next_row = cutlass.min(first + self.stages, end)
        if warp == 0:
            for row in cutlass.range(first, next_row, unroll=1):
                self.load_row(ring, producer, sW, weight_address, row)
                producer.advance()
        # the activations in fp32, converted once
        rX = cute.make_rmem_tensor((self.vector, self.vectors_per_thread, self.tokens), cutlass.Float32)
        rX.fill(0.0)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128)
        for v in cutlass.range_constexpr(self.vectors_per_thread):
            index = tidx + v * self.consumer_threads
            if index < self.vectors:
                for m in cutlass.range_constexpr(self.tokens):
                    loaded = cute.make_rmem_tensor((self.vector,), cutlass.BFloat16)
                    cute.copy(atom, cute.local_tile(mX[m, None], (self.vector,), (index,)), loaded)
                    rX[None, v, m].store(loaded.load().to(cutlass.Float32))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        parity = cutlass.Int32(0)
        for group_first in cutlass.range(first, end, self.rows_per_group, unroll=1):
            sums = cute.make_rmem_tensor((self.padded_tokens, self.rows_per_group), cutlass.Float32)
            sums.fill(0.0)
            for r in cutlass.range_constexpr(self.rows_per_group):
                if group_first + r < end:  # the same for every consumer thread
                    ring.consumer_wait(state)
                    for v in cutlass.range_constexpr(self.vectors_per_thread):
                        index = tidx + v * self.consumer_threads
                        if index < self.vectors:
                            rW = cute.make_rmem_tensor((self.vector,), cutlass.BFloat16)
                            cute.autovec_copy(cute.local_tile(sW[(None, state.index)], (self.vector,), (index,)), rW)
                            weights = rW.load().to(cutlass.Float32)
                            for m in cutlass.range_constexpr(self.tokens):
                                activations = rX[None, v, m].load()
                                total = sums[m, r]
                                for i in cutlass.range_constexpr(self.vector):
                                    total = total + weights[i] * activations[i]
                                sums[m, r] = total
                    ring.consumer_release(state)
                    state.advance()
                    if warp == 0:
                        if next_row < end:
                            self.load_row(ring, producer, sW, weight_address, next_row)
                            producer.advance()
                            next_row = next_row + 1
            total = self.lane_sums(sums, lane)
            sPartial[lane, warp, parity] = total
            cute.arch.barrier(barrier_id=NamedBarrier.CONSUMERS, number_of_threads=self.consumer_threads)
            if warp == 0:
                total = sPartial[lane, 0, parity]
                for w in cutlass.range_constexpr(1, self.consumer_warps):
                    total = total + sPartial[lane, w, parity]
                m = lane % self.padded_tokens
                row = group_first + lane // self.padded_tokens
                if (m < self.tokens) & (row < end):
                    mOut[m, row] = total.to(mOut.element_type)
            parity = 1 - parity

    @cute.jit
    def lane_sums(self, sums, lane):
        """Sum value ``j`` (``j = row * padded_tokens + token``) of ``sums`` over the warp's lanes into lane ``j``:
        five halving steps, each lane keeping the half its lane bit names and sending the other to its partner."""
        values = [sums[j % self.padded_tokens, j // self.padded_tokens] for j in range(32)]
        for step in cutlass.range_constexpr(5):
            width = 16 >> step
            upper = (lane & width) != 0
            kept = []
            for j in cutlass.range_constexpr(width):
                lower, higher = values[j], values[j + width]
                send = cutlass.Float32(cutlass.select_(upper, lower, higher))
                keep = cutlass.Float32(cutlass.select_(upper, higher, lower))
                kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset=width))
            values = kept
        return values[0]
