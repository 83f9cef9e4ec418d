"""The routed experts' forward functions, through transformers' ``ExpertsInterface``.

``grouped_mm`` (the default) is transformers' grouped-GEMM algorithm (sort the (token, expert) pairs by expert, one
grouped GEMM per projection over all experts, no host synchronisation) with its last steps fused: the routed
outputs are weighted, put back in token order and summed in one pass (compiled on CUDA), in fp32, instead of an
fp32 product, a gather and a sum over ``[T * k, hidden]`` (and, in transformers 5.17, three masking passes for
expert parallelism): 12.5 ms of a 32K-token real-width layer pair on the H200. ``batched_mm`` and transformers'
other functions are transformers' own; ``eager`` is the experts module's loop. The pairs are put in expert order
by a sort, or for decode-sized batches by counting, in one compiled kernel instead of a sort's ten. In decode
steps on SM90 a projection that ``gemv_pays`` for is the grouped GEMV kernel instead of the grouped GEMM: a few rows
per expert leave the GEMM's tiles mostly idle, the GEMV reads each active expert's weight once. The same kernel
computes the router's fp32 logits for a few tokens (``router_logits``).
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.integrations.moe import ExpertsInterface, _grouped_mm

from indexer.cute_runtime import compile_once, compile_tvm_ffi, dsl_available

from .fusion import compiled, fuse

__all__ = ["EXPERTS_FUNCTIONS", "GEMV_MAX_PAIRS", "ROUTER_GEMV_MAX_TOKENS", "ROUTER_PIECES_MIN_TOKENS",
           "exact_bf16_pieces", "gemv_pays", "grouped_gemv", "grouped_gemv_serves", "grouped_mm_experts_forward",
           "router_logits", "routing_plan_by_counting", "routing_plan_by_sorting", "weighted_token_sum"]


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


GEMV_MAX_PAIRS = 64
"""At most this many (token, expert) pairs (decode steps of up to 16 tokens at top-4) may take the grouped GEMV
kernel (``grouped_gemv``, where ``gemv_pays``); more take transformers' grouped GEMM."""
GEMV_SPLIT_K_MIN_DEPTH = 1024
"""From this input width on the GEMV splits K over four warps per column group (``experts_split_k``): below it the
split warps would have a vector or less each."""
ROUTER_GEMV_MAX_TOKENS = 4
"""Up to this many tokens (one pass of the router configuration's rows) the router's logits come from the GEMV
kernel; at 16 tokens cuBLAS was faster (docs/PERFORMANCE.md)."""


def gemv_pays(pairs: int, num_experts: int) -> bool:
    """Whether a projection of ``pairs`` rows over ``num_experts`` experts is faster by the grouped GEMV than by the
    grouped GEMM, by the rule its measurements set (H100, docs/PERFORMANCE.md): at most ``GEMV_MAX_PAIRS`` pairs, and
    on average at most one pass of rows per expert (more passes re-read the weight). Every measured case it admits
    took 11-59 % less time than the grouped GEMM (M3's width at 1, 4 and 16 tokens; the presets' 4 experts of 256 at
    1 and 4 tokens, both projections); every case it refuses was slower by the GEMV (the presets at 16 tokens, 8 rows
    per expert)."""
    from .kernels.grouped_gemv_sm90 import CONFIGURATIONS

    rows_per_pass = CONFIGURATIONS["experts"]["rows_per_pass"]
    return 0 < pairs <= GEMV_MAX_PAIRS and pairs <= rows_per_pass * num_experts


def _gemv_operands_ok(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    return (type(rows.data) is torch.Tensor and type(weights.data) is torch.Tensor  # not a tensor-parallel shard
            and rows.is_cuda and rows.dtype == torch.bfloat16 and weights.device == rows.device
            and dsl_available() and torch.cuda.get_device_capability(rows.device)[0] == 9
            and rows.shape[-1] % 8 == 0 and weights.shape[-1] == rows.shape[-1]
            and rows.is_contiguous() and weights.is_contiguous()
            and rows.data_ptr() % 16 == 0 and weights.data_ptr() % 16 == 0
            and not (torch.is_grad_enabled() and (rows.requires_grad or weights.requires_grad)))


def grouped_gemv_serves(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether ``grouped_gemv`` takes these operands: bf16 on an SM90 GPU with the CuTe DSL, rows of a multiple of 8
    elements, 16-byte aligned and contiguous, and no gradient to record."""
    return weights.dtype == torch.bfloat16 and weights.shape[-2] % 8 == 0 and _gemv_operands_ok(rows, weights)


def grouped_gemv(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                 out: Optional[torch.Tensor] = None, row_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[r] = weights[e(r)] @ rows[r]``: ``rows [P, K]`` in expert order, expert ``e``'s rows ending at
    ``offsets[e]`` (``[E]`` int32, non-decreasing, the last equal to ``P``), ``weights [E, N, K]``; ``[P, N]`` in the
    rows' dtype (into ``out`` when given), fp32 sums: what ``_grouped_mm(rows, weights.transpose(-2, -1), offsets)``
    computes, by the SM90 kernel (``minimax_m3/kernels/grouped_gemv_sm90.py``) that reads each active expert's
    weight once. With ``row_index [P]`` (int64) row ``r`` is ``rows[row_index[r]]`` instead (``rows`` then the
    tokens, ``row_index`` each pair's token): ``rows[row_index]`` without gathering it (an index outside ``rows``
    reads its nearest row)."""
    if not grouped_gemv_serves(rows, weights):
        raise ValueError("grouped_gemv needs bf16 rows [P, K] and weights [E, N, K] on an SM90 GPU with the CuTe DSL, "
                         f"K and N multiples of 8, contiguous and 16-byte aligned; got rows {tuple(rows.shape)} "
                         f"{rows.dtype} on {rows.device}, weights {tuple(weights.shape)} {weights.dtype}")
    if offsets.shape != (weights.shape[0],) or offsets.dtype != torch.int32 or offsets.device != rows.device:
        raise ValueError(f"offsets must be int32 [{weights.shape[0]}] on {rows.device}, got {tuple(offsets.shape)} "
                         f"{offsets.dtype} on {offsets.device}")
    pairs = rows.shape[0]
    if row_index is not None:
        if row_index.dim() != 1 or row_index.dtype != torch.int64 or row_index.device != rows.device:
            raise ValueError(f"row_index must be int64 [pairs] on {rows.device}, got {tuple(row_index.shape)} "
                             f"{row_index.dtype} on {row_index.device}")
        if row_index.numel() and not rows.shape[0]:
            raise ValueError("row_index names rows of an empty rows tensor")
        pairs = row_index.shape[0]
    shape = (pairs, weights.shape[1])
    if out is not None and (out.shape != shape or out.dtype != rows.dtype or out.device != rows.device
                            or out.stride(-1) != 1):
        raise ValueError(f"out must be {rows.dtype} {list(shape)} on {rows.device} with unit column stride, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    return _launch_grouped_gemv(rows, weights, offsets, out, row_index)


def _launch_grouped_gemv(rows, weights, offsets, out=None, row_index=None):
    """``grouped_gemv`` on operands already checked (``grouped_gemv_serves``, offsets from a routing plan)."""
    pairs = rows.shape[0] if row_index is None else row_index.shape[0]
    if out is None:
        out = torch.empty(pairs, weights.shape[1], dtype=rows.dtype, device=rows.device)
    if pairs == 0:
        return out
    configuration = "experts_split_k" if rows.shape[1] >= GEMV_SPLIT_K_MIN_DEPTH else "experts"
    _gemv_kernel(rows.device, configuration, row_index is not None)(rows, weights, offsets, out, row_index)
    return out


def _gemv_kernel(device: torch.device, configuration: str, indexed: bool = False):
    from .kernels.grouped_gemv_sm90 import CONFIGURATIONS, GroupedGemvSm90
    from .kernels.signatures import grouped_gemv_arguments

    with torch.cuda.device(device):
        return compile_once(("grouped_gemv_sm90", configuration, indexed), lambda: compile_tvm_ffi(
            GroupedGemvSm90(**CONFIGURATIONS[configuration]), grouped_gemv_arguments(configuration, indexed)))


ROUTER_PIECES_MIN_TOKENS = 4096
"""From this many bf16 tokens on a CUDA device the router's fp32 logits are three bf16 GEMMs with fp32 output, one
per exact bf16 piece of the fp32 weight (``exact_bf16_pieces``), instead of casting the tokens to fp32 for an SGEMM
(docs/PERFORMANCE.md)."""


def exact_bf16_pieces(weight: torch.Tensor) -> torch.Tensor:
    """``[3, *weight.shape]`` bf16 pieces of an fp32 ``weight`` whose fp32 sum is ``weight`` exactly: each piece
    rounds what the ones before left, and 3 x 8 significand bits cover fp32's 24. Exact for zero and every weight of
    magnitude from 2^-110 (below, the last piece's bits fall under bf16's smallest subnormal) up to bf16's largest
    finite value (3.39e38; above, the first piece rounds to infinity)."""
    first = weight.to(torch.bfloat16)
    rest = weight - first.float()
    second = rest.to(torch.bfloat16)
    return torch.stack([first, second, (rest - second.float()).to(torch.bfloat16)])


def _logits_by_pieces(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fp32 for bf16 ``x`` and an fp32 ``weight`` at the bf16 GEMM rate: bf16 x bf16 products
    are exact in fp32, so what the three pieces' summed GEMMs lose is the tensor cores' fp32 accumulation, about
    8e-6 of the largest logit where cuBLAS's SGEMM loses 1e-6 to 2e-6 (H100, docs/PERFORMANCE.md)."""
    pieces = exact_bf16_pieces(weight)
    num_experts = weight.shape[0]
    by_piece = torch.mm(x, pieces.view(3 * num_experts, -1).t(), out_dtype=torch.float32).view(-1, 3, num_experts)
    return (by_piece[:, 2] + by_piece[:, 1]) + by_piece[:, 0]


def router_logits(gate: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The router's fp32 logits ``[T, E]`` of ``x [T, hidden]``: ``gate(x.float())``. For a plain ``nn.Linear``
    with an fp32 weight and no hooks (offloading brings its weight in one; such a module is called) and bf16 ``x``:
    up to ``ROUTER_GEMV_MAX_TOKENS`` tokens on SM90 by the GEMV kernel (fp32 weights and sums; 5-9 us less than the
    cast and cuBLAS's split-K GEMM and its reduction), from ``ROUTER_PIECES_MIN_TOKENS`` tokens on CUDA by the
    weight's exact bf16 pieces (``_logits_by_pieces``)."""
    weight = gate.weight
    plain = (x.dim() == 2 and type(gate) is torch.nn.Linear and gate.bias is None and not gate._forward_pre_hooks
             and not gate._forward_hooks and weight.dtype == torch.float32)
    if plain and 0 < x.shape[0] <= ROUTER_GEMV_MAX_TOKENS and _gemv_operands_ok(x, weight):
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        _gemv_kernel(x.device, "router")(x, weight.unsqueeze(0), None, out, None)
        return out
    if (plain and x.shape[0] >= ROUTER_PIECES_MIN_TOKENS and x.is_cuda and x.dtype == torch.bfloat16
            and weight.device == x.device and type(weight.data) is torch.Tensor
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return _logits_by_pieces(x, weight)
    return gate(x.to(weight.dtype)).float()


def _expert_projection(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                       token_of_row: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The grouped projection of the rows in expert order: ``x`` itself, or ``x[token_of_row]`` (the GEMV reads
    the tokens through the index, the grouped GEMM takes them gathered)."""
    if (token_of_row is not None and gemv_pays(token_of_row.shape[0], weights.shape[0])
            and grouped_gemv_serves(x, weights)):
        return _launch_grouped_gemv(x, weights, offsets, row_index=token_of_row)
    rows = x if token_of_row is None else x[token_of_row]
    if gemv_pays(rows.shape[0], weights.shape[0]) and grouped_gemv_serves(rows, weights):
        return _launch_grouped_gemv(rows, weights, offsets)
    return _grouped_mm(rows, weights.transpose(-2, -1), offsets)


def grouped_mm_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    routed = getattr(self, "routing_plan", None)
    known = None if routed is None else routed.of(top_k_index)
    if known is not None:  # the MoE block's decode routing counted it with the choice (decode_routing)
        token_of_row, offsets, slot_of_pair = known
    else:
        if top_k_index.numel() <= COUNTED_PLAN_MAX_PAIRS:
            plan = (compiled("routing_plan_by_counting", routing_plan_by_counting, tokens_first=False)
                    if fuse(hidden_states) else routing_plan_by_counting)
        else:
            plan = routing_plan_by_sorting
        token_of_row, offsets, slot_of_pair = plan(top_k_index, self.num_experts)
    gated = self._apply_gate(_expert_projection(hidden_states, self.gate_up_proj, offsets, token_of_row))
    outputs = _expert_projection(gated.contiguous(), self.down_proj, offsets)
    combine = compiled("weighted_token_sum", weighted_token_sum) if fuse(outputs) else weighted_token_sum
    return combine(outputs, slot_of_pair, top_k_weights)


EXPERTS_FUNCTIONS = ExpertsInterface()
"""transformers' experts interface with this model's ``grouped_mm`` as a local entry (other models keep
transformers' function)."""
EXPERTS_FUNCTIONS["grouped_mm"] = grouped_mm_experts_forward
