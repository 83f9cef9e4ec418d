"""The routed experts' forward functions, through transformers' ``ExpertsInterface``.

``grouped_mm`` (the default) is transformers' grouped-GEMM algorithm (sort the (token, expert) pairs by expert, one
grouped GEMM per projection over all experts, no host synchronisation) with its last steps fused: the routed
outputs are weighted, put back in token order and summed in one pass (compiled on CUDA), in fp32, instead of an
fp32 product, a gather and a sum over ``[T * k, hidden]`` (and, in transformers 5.17, three masking passes for
expert parallelism): 12.5 ms of a 32K-token real-width layer pair on the H200. ``batched_mm`` and transformers'
other functions are transformers' own; ``eager`` is the experts module's loop. The pairs are put in expert order
by a sort, or for decode-sized batches by counting, in one compiled kernel instead of a sort's ten.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ExpertsInterface, _grouped_mm

from .fusion import compiled, fuse

__all__ = ["EXPERTS_FUNCTIONS", "grouped_mm_experts_forward", "routing_plan_by_counting", "routing_plan_by_sorting",
           "weighted_token_sum"]


def weighted_token_sum(outputs: torch.Tensor, slot_of_pair: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * outputs[slot_of_pair[t * top_k + k]]`` in fp32, in ``outputs``' dtype:
    ``outputs [T * top_k, hidden]`` in expert order, ``slot_of_pair`` the row of each (token, k) pair there.
    Written as ``top_k`` row gathers so the compiled kernel is one pointwise pass (as a reduction over k it ran at
    a seventh of the memory bandwidth)."""
    num_tokens, top_k = weights.shape
    slots = slot_of_pair.view(num_tokens, top_k)
    total = outputs[slots[:, 0]].float() * weights[:, 0, None].float()
    for k in range(1, top_k):
        total = total + outputs[slots[:, k]].float() * weights[:, k, None].float()
    return total.to(outputs.dtype)


COUNTED_PLAN_MAX_PAIRS = 1024
"""Up to this many (token, expert) pairs the routing plan is counted (``routing_plan_by_counting``), beyond it
sorted (``routing_plan_by_sorting``)."""


def routing_plan_by_sorting(top_k_index: torch.Tensor, num_experts: int):
    """``(token_of_row [P], offsets [E] int32, slot_of_pair [P])`` of the ``P = T * top_k`` (token, expert) pairs
    put in expert order: row ``r`` of the grouped GEMMs takes token ``token_of_row[r]``, expert ``e``'s rows end at
    ``offsets[e]``, and pair ``p`` lands in row ``slot_of_pair[p]``. A sort, a histogram and a scan (histc, not
    bincount: no host synchronisation; CUDA wants integer input, the CPU float)."""
    top_k = top_k_index.shape[1]
    expert_of_row, pair_of_row = torch.sort(top_k_index.reshape(-1))
    counted = expert_of_row.float() if top_k_index.device.type == "cpu" else expert_of_row.int()
    offsets = torch.cumsum(torch.histc(counted, bins=num_experts, min=0, max=num_experts - 1), 0, dtype=torch.int32)
    slot_of_pair = torch.empty_like(pair_of_row)
    slot_of_pair[pair_of_row] = torch.arange(pair_of_row.numel(), device=pair_of_row.device)
    return pair_of_row // top_k, offsets, slot_of_pair


def routing_plan_by_counting(top_k_index: torch.Tensor, num_experts: int):
    """``routing_plan_by_sorting``'s plan, pairs of one expert in pair order, by counting: a pair's row is the number
    of pairs of a smaller expert id or of the same id and an earlier pair. ``P^2`` comparisons, for decode-sized
    ``P``; compiled on CUDA it is 10 kernels fewer per MoE layer than the sort's path (about 20 µs of a decode
    step's layer on the H100), with the same outputs."""
    ids = top_k_index.reshape(-1)
    pairs = torch.arange(ids.numel(), device=ids.device)
    earlier = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (pairs[None, :] < pairs[:, None]))
    slot_of_pair = earlier.sum(-1)
    token_of_row = torch.empty_like(pairs)
    token_of_row[slot_of_pair] = pairs // top_k_index.shape[1]
    counts = (ids[:, None] == torch.arange(num_experts, device=ids.device)).sum(0)
    return token_of_row, torch.cumsum(counts, 0).to(torch.int32), slot_of_pair


def grouped_mm_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    if top_k_index.numel() <= COUNTED_PLAN_MAX_PAIRS:
        plan = (compiled("routing_plan_by_counting", routing_plan_by_counting, tokens_first=False)
                if fuse(hidden_states) else routing_plan_by_counting)
    else:
        plan = routing_plan_by_sorting
    token_of_row, offsets, slot_of_pair = plan(top_k_index, self.num_experts)
    rows = hidden_states[token_of_row]
    gated = self._apply_gate(_grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offsets))
    outputs = _grouped_mm(gated, self.down_proj.transpose(-2, -1), offsets)
    combine = compiled("weighted_token_sum", weighted_token_sum) if fuse(outputs) else weighted_token_sum
    return combine(outputs, slot_of_pair, top_k_weights)


EXPERTS_FUNCTIONS = ExpertsInterface()
"""transformers' experts interface with this model's ``grouped_mm`` as a local entry (other models keep
transformers' function)."""
EXPERTS_FUNCTIONS["grouped_mm"] = grouped_mm_experts_forward
