"""A decode step's routing in one launch, in CuTe DSL (SIMT, one CTA; compiled for SM90).

From the router's fp32 logits ``[T, E]`` of a few tokens: each token's ``top_k`` experts by ``sigmoid(logit) +
bias`` (``k`` rounds of an argmax that masks its winner with ``-inf``, ties to the lower expert id, as
``modeling_minimax_m3.top_k_columns``), their weights (the chosen sigmoids renormalised to sum to ``scaling``, as
``route_weights``), and the grouped experts' routing plan of the ``P = T * top_k`` pairs (as
``experts.routing_plan_by_counting``: a pair's row is the number of pairs of a smaller expert id, or of the same id
and an earlier pair). Compiled, those are five kernels of a microsecond or two each on the routed experts' chain of
a decode step; here they are one.

Warp ``t`` routes token ``t``: lane ``l`` holds experts ``l + 32 j`` in registers, a round is one butterfly argmax
over the warp. Then the CTA counts the plan out of shared memory. A NaN logit counts as the largest, as torch's
argmax takes it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

__all__ = ["DecodeRoutingSm90"]


class DecodeRoutingSm90:
    """Static configuration: ``top_k`` experts per token. At most ``max_tokens`` tokens (one warp each) and
    ``max_experts`` experts (``experts_per_lane`` per lane)."""

    max_tokens = 16
    experts_per_lane = 8
    max_experts = 32 * experts_per_lane

    def __init__(self, top_k: int):
        if not 1 <= top_k <= 8:
            raise ValueError(f"top_k must lie in [1, 8], got {top_k}")
        self.top_k = top_k
        self.threads = 32 * self.max_tokens

    @cute.jit
    def __call__(
        self,
        mLogits: cute.Tensor,  # (T, E) fp32, T <= max_tokens, E <= max_experts
        mBias: cute.Tensor,  # (E,) fp32
        mChosen: cute.Tensor,  # (T, top_k) int64
        mWeights: cute.Tensor,  # (T, top_k) fp32
        mTokenOfRow: cute.Tensor,  # (T * top_k,) int64
        mOffsets: cute.Tensor,  # (E,) int32
        mSlotOfPair: cute.Tensor,  # (T * top_k,) int64
        scaling: cutlass.Float32,
        stream,
    ):
        self.kernel(mLogits, mBias, mChosen, mWeights, mTokenOfRow, mOffsets, mSlotOfPair, scaling).launch(
            grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mChosen: cute.Tensor, mWeights: cute.Tensor,
               mTokenOfRow: cute.Tensor, mOffsets: cute.Tensor, mSlotOfPair: cute.Tensor, scaling: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        token = tidx // 32
        tokens = cutlass.min(cute.size(mLogits, mode=[0]), self.max_tokens)
        experts = cutlass.min(cute.size(mLogits, mode=[1]), self.max_experts)
        pairs = tokens * self.top_k
        smem = cutlass.utils.SmemAllocator()
        sIds = smem.allocate_tensor(cutlass.Int32, cute.make_layout(self.max_tokens * self.top_k), 16)
        if token < tokens:
            self.route_token(mLogits, mBias, mChosen, mWeights, sIds, scaling, token, lane, experts)
        cute.arch.barrier()  # every pair's expert id is in shared memory
        for pair in cutlass.range(tidx, pairs, self.threads, unroll=1):
            expert = sIds[pair]
            slot = cutlass.Int32(0)
            for other in cutlass.range(pairs, unroll=1):
                theirs = sIds[other]
                slot = slot + cutlass.Int32(cutlass.select_((theirs < expert) | ((theirs == expert) & (other < pair)),
                                                            1, 0))
            mSlotOfPair[pair] = cutlass.Int64(slot)
            mTokenOfRow[slot] = cutlass.Int64(pair // self.top_k)
        for expert in cutlass.range(tidx, cute.size(mOffsets, mode=[0]), self.threads, unroll=1):
            end = cutlass.Int32(0)
            for other in cutlass.range(pairs, unroll=1):
                end = end + cutlass.Int32(cutlass.select_(sIds[other] <= expert, 1, 0))
            mOffsets[expert] = end

    @cute.jit
    def route_token(self, mLogits, mBias, mChosen, mWeights, sIds, scaling, token, lane, experts):
        probabilities = cute.make_rmem_tensor((self.experts_per_lane,), cutlass.Float32)
        scores = cute.make_rmem_tensor((self.experts_per_lane,), cutlass.Float32)
        for j in cutlass.range_constexpr(self.experts_per_lane):
            expert = lane + 32 * j
            probabilities[j] = 0.0
            scores[j] = cutlass.Float32(-float("inf"))
            if expert < experts:
                logit = mLogits[token, expert]
                probability = 1.0 / (1.0 + cute.math.exp(-logit))
                probabilities[j] = probability
                score = probability + mBias[expert]
                scores[j] = cutlass.Float32(cutlass.select_(score != score, cutlass.Float32(float("inf")), score))
        chosen = [cutlass.Int32(0)] * self.top_k
        chosen_probabilities = [cutlass.Float32(0.0)] * self.top_k
        for rank in cutlass.range_constexpr(self.top_k):
            best = cutlass.Float32(-float("inf"))
            best_expert = cutlass.Int32(experts)
            best_probability = cutlass.Float32(0.0)
            for j in cutlass.range_constexpr(self.experts_per_lane):
                expert = lane + 32 * j
                # strictly larger: a lane's experts ascend, so its first of equal scores stays
                if (expert < experts) & ((scores[j] > best) | (best_expert == experts)):
                    best = scores[j]
                    best_expert = expert
                    best_probability = probabilities[j]
            for offset in (16, 8, 4, 2, 1):
                other = cute.arch.shuffle_sync_bfly(best, offset=offset)
                other_expert = cute.arch.shuffle_sync_bfly(best_expert, offset=offset)
                other_probability = cute.arch.shuffle_sync_bfly(best_probability, offset=offset)
                if (other > best) | ((other == best) & (other_expert < best_expert)):
                    best = other
                    best_expert = other_expert
                    best_probability = other_probability
            chosen[rank] = best_expert
            chosen_probabilities[rank] = best_probability
            for j in cutlass.range_constexpr(self.experts_per_lane):
                if lane + 32 * j == best_expert:
                    scores[j] = cutlass.Float32(-float("inf"))
        total = chosen_probabilities[0]
        for rank in cutlass.range_constexpr(1, self.top_k):
            total = total + chosen_probabilities[rank]
        if lane == 0:
            for rank in cutlass.range_constexpr(self.top_k):
                mChosen[token, rank] = cutlass.Int64(chosen[rank])
                mWeights[token, rank] = chosen_probabilities[rank] / total * scaling
                sIds[token * self.top_k + rank] = chosen[rank]
