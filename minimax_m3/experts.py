"""The routed experts' forward functions, through transformers' ``ExpertsInterface``.

``grouped_mm`` (the default) is transformers' grouped-GEMM algorithm (sort the (token, expert) pairs by expert, one
grouped GEMM per projection over all experts, no host synchronisation) with its last steps fused: the routed
outputs are weighted, put back in token order and summed in one pass (compiled on CUDA), in fp32, instead of an
fp32 product, a gather and a sum over ``[T * k, hidden]`` (and, in transformers 5.17, three masking passes for
expert parallelism): 12.5 ms of a 32K-token real-width layer pair on the H200. ``batched_mm`` and transformers'
other functions are transformers' own; ``eager`` is the experts module's loop.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ExpertsInterface, _grouped_mm

from .fusion import compiled, fuse

__all__ = ["EXPERTS_FUNCTIONS", "grouped_mm_experts_forward", "weighted_token_sum"]


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


def grouped_mm_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    num_tokens, top_k = top_k_index.shape
    expert_of_row, pair_of_row = torch.sort(top_k_index.reshape(-1))
    rows = hidden_states[pair_of_row // top_k]
    # histc, not bincount: no host synchronisation (CUDA wants integer input, the CPU float)
    counted = expert_of_row.float() if hidden_states.device.type == "cpu" else expert_of_row.int()
    offsets = torch.cumsum(torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1), 0,
                           dtype=torch.int32)
    gated = self._apply_gate(_grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offsets))
    outputs = _grouped_mm(gated, self.down_proj.transpose(-2, -1), offsets)
    slot_of_pair = torch.empty_like(pair_of_row)
    slot_of_pair[pair_of_row] = torch.arange(pair_of_row.numel(), device=pair_of_row.device)
    combine = compiled("weighted_token_sum", weighted_token_sum) if fuse(outputs) else weighted_token_sum
    return combine(outputs, slot_of_pair, top_k_weights)


EXPERTS_FUNCTIONS = ExpertsInterface()
"""transformers' experts interface with this model's ``grouped_mm`` as a local entry (other models keep
transformers' function)."""
EXPERTS_FUNCTIONS["grouped_mm"] = grouped_mm_experts_forward
