"""A decode step's routing in one kernel: the experts each token takes, their weights and the grouped experts'
routing plan, from the router's logits.

Compiled, ``route_weights`` is two kernels and ``routing_plan_by_counting`` three, each a microsecond or two of a
few hundred bytes, one after another on the routed experts' branch of every MoE layer of a decode step.
``decode_routing`` computes all of them in one launch of ``DecodeRoutingSm90``
(``minimax_m3/kernels/decode_routing_sm90.py``) where it serves the call (a few tokens on an SM90 GPU, no gradient to
record); the MoE block hands the plan to the experts function with the chosen experts (``RoutingPlan``), which takes
it for exactly those experts and otherwise counts its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from indexer.cute_runtime import compile_once, compile_tvm_ffi, dsl_available

__all__ = ["DECODE_ROUTING_MAX_TOKENS", "RoutingPlan", "decode_routing", "decode_routing_serves"]

DECODE_ROUTING_MAX_TOKENS = 16
"""Up to this many tokens (decode and verify steps) the routing is one kernel; prefills keep the compiled chains."""
_MAX_EXPERTS = 256
_MAX_TOP_K = 8


@dataclass(frozen=True)
class RoutingPlan:
    """The grouped experts' routing plan (``experts.routing_plan_by_counting``'s outputs) of the pairs of
    ``chosen``: the experts function takes it when it is given this very tensor of expert ids."""

    chosen: torch.Tensor
    token_of_row: torch.Tensor
    offsets: torch.Tensor
    slot_of_pair: torch.Tensor

    def of(self, top_k_index: torch.Tensor) -> Optional[tuple]:
        """``(token_of_row, offsets, slot_of_pair)`` when ``top_k_index`` is the routed ``chosen``, else None."""
        if top_k_index is not self.chosen:
            return None
        return self.token_of_row, self.offsets, self.slot_of_pair


def decode_routing_serves(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> bool:
    """Whether ``decode_routing`` takes this call: fp32 logits ``[T, E]`` of at most ``DECODE_ROUTING_MAX_TOKENS``
    tokens and 256 experts, top-k of at most 8, on an SM90 GPU with the CuTe DSL, with no gradient to record."""
    return (type(logits) is torch.Tensor and logits.is_cuda and logits.dim() == 2
            and 0 < logits.shape[0] <= DECODE_ROUTING_MAX_TOKENS and 0 < top_k <= min(_MAX_TOP_K, logits.shape[1])
            and logits.shape[1] <= _MAX_EXPERTS and logits.dtype == torch.float32 and logits.stride(-1) == 1
            and type(bias) is torch.Tensor and bias.dtype == torch.float32 and bias.shape == (logits.shape[1],)
            and bias.device == logits.device and bias.is_contiguous()
            and not (torch.is_grad_enabled() and (logits.requires_grad or bias.requires_grad))
            and dsl_available() and torch.cuda.get_device_capability(logits.device)[0] == 9)


def decode_routing(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """``(chosen [T, top_k] int64, weights [T, top_k] fp32, RoutingPlan)``: ``route_weights(logits, bias, top_k,
    scaling)`` and ``routing_plan_by_counting(chosen, E)`` in one launch. The same choice (ties to the lower expert
    id; a NaN logit counts as the largest); the sigmoids and sums in another order, within a few fp32 ulps."""
    if not decode_routing_serves(logits, bias, top_k):
        raise ValueError("decode_routing needs fp32 logits [T <= 16, E <= 256] with unit column stride, an fp32 bias "
                         "[E], 1 <= top_k <= min(8, E), on an SM90 GPU with the CuTe DSL and no gradient to record; "
                         f"got logits {tuple(logits.shape)} {logits.dtype} on {logits.device}, bias "
                         f"{tuple(bias.shape)} {bias.dtype}, top_k {top_k}")
    tokens, experts = logits.shape
    device = logits.device
    chosen = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    token_of_row = torch.empty(tokens * top_k, dtype=torch.int64, device=device)
    offsets = torch.empty(experts, dtype=torch.int32, device=device)
    slot_of_pair = torch.empty(tokens * top_k, dtype=torch.int64, device=device)
    _kernel(device, top_k)(logits, bias, chosen, weights, token_of_row, offsets, slot_of_pair, float(scaling))
    return chosen, weights, RoutingPlan(chosen, token_of_row, offsets, slot_of_pair)


def _kernel(device: torch.device, top_k: int):
    from .kernels.decode_routing_sm90 import DecodeRoutingSm90
    from .kernels.signatures import decode_routing_arguments

    with torch.cuda.device(device):
        return compile_once(("decode_routing_sm90", top_k), lambda: compile_tvm_ffi(
            DecodeRoutingSm90(top_k), decode_routing_arguments(top_k)))
