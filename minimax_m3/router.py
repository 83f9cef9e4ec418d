"""The MoE router's fp32 projection, ``block_sparse_moe.gate``: fp32 logits whatever the activations' dtype.

At inference on CUDA with bf16 activations, the fp32 GEMM (and the activations' fp32 copy it needs) is the slow way
to an exact-product result: at real width and 128K tokens it took 4.6 ms of a sparse layer on the H200, on the
fp32 (non-tensor-core) pipe. The weight is instead split into three bf16 parts whose sum is exactly the weight
(``exact_bf16_parts``); one bf16 tensor-core GEMM with fp32 output gives the three partial logits and their fp32
sum is the logit. Every product of a bf16 activation and a part is exact in fp32, as the fp32 GEMM's products are,
so the result differs from the fp32 GEMM's only in the order of its fp32 sums.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .fusion import compiled, fuse

__all__ = ["exact_bf16_parts", "MiniMaxM3Router"]

_LOW_HALF = 0xFFFF


def exact_bf16_parts(weight: torch.Tensor) -> torch.Tensor:
    """``[3, *weight.shape]`` bf16 parts of an fp32 ``weight`` that sum to it exactly (in fp32, any order of the
    three adds, for weights whose parts are normal numbers): each part is what the previous ones left, truncated to
    its 8 leading significant bits. Truncating, not rounding, keeps each remainder exact: the first remainder is
    the weight's low 16 mantissa bits, the second at most 8 significant bits, which bf16 holds."""
    if weight.dtype != torch.float32:
        raise ValueError(f"weight must be float32, got {weight.dtype}")
    high = (weight.view(torch.int32) & ~_LOW_HALF).view(torch.float32)
    rest = weight - high
    middle = (rest.view(torch.int32) & ~_LOW_HALF).view(torch.float32)
    return torch.stack([high, middle, rest - middle]).to(torch.bfloat16)


class MiniMaxM3Router(nn.Linear):
    """``nn.Linear(hidden, experts)`` in fp32 returning fp32 logits ``[..., experts]`` (the forward runs in the
    module, so offload hooks bring the weight)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__(hidden_size, num_experts, bias=False, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype == torch.bfloat16 and self.weight.dtype == torch.float32 and fuse(x)
                and not isinstance(self.weight, DTensor)):
            parts = compiled("exact_bf16_parts", exact_bf16_parts)(self.weight)  # [3, E, hidden]
            partial = torch.mm(x.reshape(-1, x.shape[-1]), parts.flatten(0, 1).t(), out_dtype=torch.float32)
            return partial.view(*x.shape[:-1], 3, self.out_features).sum(-2)
        return super().forward(x.to(self.weight.dtype)).float()
