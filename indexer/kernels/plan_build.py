"""The task plan of a small plan shape in one launch: ``build_task_plan``'s outputs, bit for bit, from one CTA.

``build_task_plan`` is some 150 small torch kernels. Under a decode step's CUDA graph they cost about 170 µs per step
on the H200, most of a step's time beyond its weights; a chunk's eager plan pays the same on the device. This kernel
computes the same plan (``num_valid_pages``, the descriptors in the same heaviest-first snake order, the task count
and the ``PlanError`` bits) for shapes of at most ``MAX_REQUESTS`` requests and ``MAX_TILES`` q tiles
(``plan_kernel_serves``); larger plans keep the torch ops.

- The requests and the tiles are walked once by one thread out of shared memory (the clamps and prefix sums of
  ``build_task_plan``, whose order they fix), the rest by the whole CTA.
- The sort is replaced by each task's rank, counted in closed form per tile: a task's key is its page count
  (descending), then its chunk index, then its index (tile-major), and a tile's tasks are full chunks but the last.
- Every search of a sorted prefix sum (``searchsorted`` in the torch version) is a fixed-step binary search.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..contract import ErrorWord
from ..cute_backend import PLAN_KERNEL_MAX_REQUESTS as MAX_REQUESTS
from ..cute_backend import PLAN_KERNEL_MAX_TILES as MAX_TILES
from ..planner import PAGE_COUNT_SHIFT, TOKENS_SHIFT, PlanError

__all__ = ["TaskPlanKernel"]


class TaskPlanKernel:
    """``build_task_plan(cu_seqlens_q, seq_lens, shape, out=plan, bounds=bounds)`` as one CTA of ``threads``."""

    threads = 512
    search_steps = 12  # a binary search over at most 2^11 sorted entries

    @cute.jit
    def __call__(
        self,
        mCuSeqlensQ: cute.Tensor,  # (B + 1,) int32
        mSeqLens: cute.Tensor,  # (B,) int32
        mBounds: cute.Tensor,  # (2,) int32: length_bounds() as its two words (max_seqlen_k, max_seqlen_q)
        mNumValidPages: cute.Tensor,  # (total_q * H,) int32
        mDescriptors: cute.Tensor,  # (max(1, task_capacity), 4) int32
        mNumTasks: cute.Tensor,  # (1,) int32
        mErrors: cute.Tensor,  # (ERROR_WORDS,) int32
        total_q: cutlass.Int32,
        num_heads: cutlass.Int32,
        page_size: cutlass.Int32,
        tile_tokens: cutlass.Int32,
        max_pages: cutlass.Int32,
        max_history_pages: cutlass.Int32,
        q_tile_capacity: cutlass.Int32,
        page_chunk: cutlass.Int32,
        num_sms: cutlass.Int32,
        stream,
    ):
        self.kernel(mCuSeqlensQ, mSeqLens, mBounds, mNumValidPages, mDescriptors, mNumTasks, mErrors, total_q,
                    num_heads, page_size, tile_tokens, max_pages, max_history_pages, q_tile_capacity, page_chunk,
                    num_sms).launch(grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mCuSeqlensQ, mSeqLens, mBounds, mNumValidPages, mDescriptors, mNumTasks, mErrors,
               total_q: cutlass.Int32, num_heads: cutlass.Int32, page_size: cutlass.Int32, tile_tokens: cutlass.Int32,
               max_pages: cutlass.Int32, max_history_pages: cutlass.Int32, q_tile_capacity: cutlass.Int32,
               page_chunk: cutlass.Int32, num_sms: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        num_requests = cute.size(mSeqLens, mode=[0])
        smem = cutlass.utils.SmemAllocator()
        sStart = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_REQUESTS + 1), 16)  # clamped cu_seqlens_q
        sPrefix = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_REQUESTS), 16)  # context before the query
        sTileEnd = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_REQUESTS), 16)  # tiles up to a request
        sTileRequest = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_TILES), 16)
        sTileToken = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_TILES), 16)  # first token in its request
        sTileTokens = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_TILES), 16)
        sTilePosition = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_TILES), 16)
        sHistory = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_TILES), 16)
        sTaskEnd = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_TILES), 16)
        sTotals = smem.allocate_tensor(cutlass.Int32, cute.make_layout(4), 16)  # tiles, tasks

        for i in cutlass.range(tidx, num_requests + 1, self.threads, unroll=1):
            sStart[i] = mCuSeqlensQ[i]
        for i in cutlass.range(tidx, num_requests, self.threads, unroll=1):
            sPrefix[i] = mSeqLens[i]
        cute.arch.barrier()
        if tidx == 0:
            self.walk_requests(sStart, sPrefix, sTileEnd, sTotals, mBounds, mErrors, num_requests, total_q, page_size,
                               tile_tokens, max_pages, q_tile_capacity)
        cute.arch.barrier()
        total_tiles = sTotals[0]
        for t in cutlass.range(tidx, q_tile_capacity, self.threads, unroll=1):
            self.tile_fields(sStart, sPrefix, sTileEnd, sTileRequest, sTileToken, sTileTokens, sTilePosition, sHistory,
                             t, total_tiles, num_requests, page_size, tile_tokens, max_history_pages)
        cute.arch.barrier()
        if tidx == 0:
            tasks = cutlass.Int32(0)
            for t in cutlass.range(0, q_tile_capacity, 1, unroll=1):
                tasks = tasks + (sHistory[t] + page_chunk - 1) // page_chunk
                sTaskEnd[t] = tasks
            sTotals[1] = tasks
            mNumTasks[0] = tasks
        cute.arch.barrier()
        total_tasks = sTotals[1]
        rows = total_q * num_heads
        for row in cutlass.range(tidx, rows, self.threads, unroll=1):
            token = row // num_heads
            request = cutlass.min(self.upper_bound(sStart, 1, num_requests, token), num_requests - 1)
            position = cutlass.max(sPrefix[request] + token - sStart[request], 0)
            mNumValidPages[row] = cutlass.min(position // page_size + 1, max_pages)
        for k in cutlass.range(tidx, cute.size(mDescriptors, mode=[0]), self.threads, unroll=1):
            if k < total_tasks:
                self.place_task(sStart, sTileRequest, sTileToken, sTileTokens, sTilePosition, sHistory, sTaskEnd,
                                mDescriptors, k, total_tasks, total_tiles, q_tile_capacity, page_chunk, num_sms)
            else:
                for word in cutlass.range_constexpr(4):
                    mDescriptors[k, word] = 0

    @cute.jit
    def walk_requests(self, sStart, sPrefix, sTileEnd, sTotals, mBounds, mErrors, num_requests, total_q, page_size,
                      tile_tokens, max_pages, q_tile_capacity):
        """One thread, in request order: the ``PlanError`` bits of the raw metadata, the clamped offsets (a running
        max) and contexts, and the tiles per request as a running sum; all in place in shared memory."""
        max_seqlen_k = cutlass.Int64(mBounds[0])
        max_seqlen_q = cutlass.Int64(mBounds[1])
        total = cutlass.Int64(total_q)
        flags = cutlass.Int32(0)
        previous = cutlass.Int64(sStart[0])
        if (previous != 0) | (previous > total):
            flags = flags | int(PlanError.CU_SEQLENS_NOT_MONOTONE)
        top = cutlass.Int32(cutlass.min(cutlass.max(previous, cutlass.Int64(0)), total))
        sStart[0] = top
        tiles = cutlass.Int32(0)
        context_limit = max_pages * page_size
        for b in cutlass.range(0, num_requests, 1, unroll=1):
            raw = cutlass.Int64(sStart[b + 1])
            raw_query = raw - previous
            raw_context = cutlass.Int64(sPrefix[b])
            if (raw_query < 0) | (raw > total):
                flags = flags | int(PlanError.CU_SEQLENS_NOT_MONOTONE)
            if raw_query > max_seqlen_q:
                flags = flags | int(PlanError.QUERY_TOO_LONG)
            if (raw_context < raw_query) | (raw_context > max_seqlen_k):
                flags = flags | int(PlanError.KV_LENGTH_INVALID)
            start = cutlass.max(top, cutlass.Int32(cutlass.min(cutlass.max(raw, cutlass.Int64(0)), total)))
            query = start - top
            context = cutlass.Int32(cutlass.min(cutlass.max(raw_context, cutlass.Int64(query)),
                                                cutlass.Int64(context_limit)))
            sStart[b + 1] = start
            sPrefix[b] = context - query
            tiles = tiles + (query + tile_tokens - 1) // tile_tokens
            sTileEnd[b] = tiles
            top = start
            previous = raw
        if previous != total:
            flags = flags | int(PlanError.TOTAL_Q_MISMATCH)
        if tiles > q_tile_capacity:
            flags = flags | int(PlanError.TILE_CAPACITY)
        mErrors[int(ErrorWord.PLAN)] = flags
        sTotals[0] = tiles

    @cute.jit
    def tile_fields(self, sStart, sPrefix, sTileEnd, sTileRequest, sTileToken, sTileTokens, sTilePosition, sHistory,
                    t, total_tiles, num_requests, page_size, tile_tokens, max_history_pages):
        """Tile slot ``t``: its request, first token, token count, first position and history pages (0 for a slot
        beyond the tiles)."""
        request = cutlass.min(self.upper_bound(sTileEnd, 0, num_requests, t), num_requests - 1)
        query = sStart[request + 1] - sStart[request]
        first_tile = sTileEnd[request] - (query + tile_tokens - 1) // tile_tokens
        token = (t - first_tile) * tile_tokens
        tokens = cutlass.max(cutlass.min(query - token, tile_tokens), 1)
        position = sPrefix[request] + token
        history = cutlass.Int32(0)
        if t < total_tiles:
            history = cutlass.min(cutlass.max(position + tokens - 1, 0) // page_size, max_history_pages)
        sTileRequest[t] = request
        sTileToken[t] = token
        sTileTokens[t] = tokens
        sTilePosition[t] = position
        sHistory[t] = history

    @cute.jit
    def place_task(self, sStart, sTileRequest, sTileToken, sTileTokens, sTilePosition, sHistory, sTaskEnd,
                   mDescriptors, k, total_tasks, total_tiles, q_tile_capacity, page_chunk, num_sms):
        """Task ``k`` (tile-major order): its rank in ``build_task_plan``'s stable sort, counted per tile, then its
        snake slot, where its descriptor goes."""
        tile = cutlass.min(self.upper_bound(sTaskEnd, 0, q_tile_capacity, k), q_tile_capacity - 1)
        history = sHistory[tile]
        chunk = k - (sTaskEnd[tile] - (history + page_chunk - 1) // page_chunk)
        page_begin = chunk * page_chunk
        pages = cutlass.max(cutlass.min(history - page_begin, page_chunk), 1)
        rank = cutlass.Int32(0)
        for other in cutlass.range(0, total_tiles, 1, unroll=1):
            other_history = sHistory[other]
            full = other_history // page_chunk
            last = other_history - full * page_chunk  # the partial last chunk's pages, 0 when there is none
            if pages == page_chunk:  # before it: full chunks of lower index, or of its index in an earlier tile
                rank = rank + cutlass.min(full, chunk)
                if (other < tile) & (chunk < full):
                    rank = rank + 1
            else:  # before it: every full chunk, and partial chunks of more pages, or as many and earlier
                rank = rank + full
                if (last > pages) | ((last == pages) & ((full < chunk) | ((full == chunk) & (other < tile)))):
                    rank = rank + 1
        wave = rank // num_sms
        lane = rank - wave * num_sms
        slot = wave * num_sms + lane
        if (wave % 2 == 1) & ((wave + 1) * num_sms <= total_tasks):
            slot = wave * num_sms + num_sms - 1 - lane
        request = sTileRequest[tile]
        mDescriptors[slot, 0] = sStart[request] + sTileToken[tile]
        mDescriptors[slot, 1] = sTilePosition[tile]
        mDescriptors[slot, 2] = request
        mDescriptors[slot, 3] = page_begin | ((pages - 1) << PAGE_COUNT_SHIFT) | ((sTileTokens[tile] - 1) << TOKENS_SHIFT)

    @cute.jit
    def upper_bound(self, sSorted, offset, count, value):
        """How many of ``sSorted[offset : offset + count]`` (non-decreasing) are ``<= value``."""
        low = cutlass.Int32(0)
        high = count
        for _ in cutlass.range_constexpr(self.search_steps):
            if low < high:
                middle = (low + high) // 2
                if sSorted[offset + middle] <= value:
                    low = middle + 1
                else:
                    high = middle
        return low
