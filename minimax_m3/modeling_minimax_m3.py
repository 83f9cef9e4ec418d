"""MiniMax-M3 text model: full attention + dense MLP on the first layers, MiniMax Sparse Attention + MoE after.

Module and parameter names are the official checkpoint's (``model.layers.i.self_attn.index_q_proj``, ...), except
that the routed experts are held packed (``block_sparse_moe.experts.gate_up_proj``, transformers' experts layout):
the checkpoint's ``block_sparse_moe.experts.e.w1`` / ``w3`` / ``w2`` are packed at load and written back on save.
Tokens are processed packed: the real (non-padding) new tokens of every sequence back to back, each with its
absolute position, which is the layout of the indexer's contract.
"""

import logging
import os
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Optional, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.integrations import use_experts_implementation
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.minimax_m2.modeling_minimax_m2 import load_balancing_loss_func
from transformers.utils import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from indexer import score_row_pitch

from .attention_inputs import write_decode_attention_inputs, write_decode_index_inputs
from .cache import MiniMaxM3Cache, MiniMaxM3StaticCache
from .configuration_minimax_m3 import DENSE_MLP, SILU_AND_MUL, SPARSE_ATTENTION, MiniMaxM3Config
from .decode_graphs import DecodeGraph, decode_graph_obstacle
from .decode_routing import decode_routing, decode_routing_serves
from .dense_attention import ALL_ATTENTION_FUNCTIONS, check_served, dense_attention, eager_attention_forward
from .experts import EXPERTS_FUNCTIONS, router_logits
from .fusion import compiled, fuse
from .packed_projections import ProjectionGroup
from .streams import run_branches
from .sparse_attention import (ForwardMetadata, PageSelector, get_sparse_attention_function, host_to_device,
                               to_index_dtype)

logger = logging.getLogger(__name__)

__all__ = ["MiniMaxM3PreTrainedModel", "MiniMaxM3Model", "MiniMaxM3ForCausalLM"]


class MiniMaxM3RMSNorm(nn.Module):
    """RMSNorm in fp32: Gemma's ``x_hat * (1 + w)`` (``gemma``, the release's; the weight stores the offset ``w``,
    zeros at init) or the standard ``x_hat * w`` (ones at init). Given ``cos`` / ``sin``, the normed heads are also
    rotated (``norm_and_rope``); given ``residual``, ``x`` is added to it first and the sum is returned too. Inside
    the module's forward, so offload hooks bring the weight."""

    def __init__(self, size: int, eps: float, gemma: bool = True):
        super().__init__()
        self.offset = 1.0 if gemma else 0.0  # the scale is offset + w
        self.weight = nn.Parameter(torch.full((size,), 1.0 - self.offset))
        self.eps = eps

    def forward(self, x: torch.Tensor, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                index_dtype: Optional[str] = None, residual: Optional[torch.Tensor] = None):
        if residual is not None:  # a residual stream's sum and its norm: ``(residual + x, norm(residual + x))``
            if fuse(x):
                return compiled("add_and_norm", _add_and_norm_math)(x, residual, self.weight, self.eps, self.offset)
            return _add_and_norm_math(x, residual, self.weight, self.eps, self.offset)
        if index_dtype is not None:  # the index path: normed, rotated, then cast (``to_index_dtype``)
            if fuse(x):
                return compiled("norm_rope_and_cast", _norm_rope_and_cast_math)(x, self.weight, self.eps, self.offset,
                                                                                cos, sin, index_dtype)
            return _norm_rope_and_cast_math(x, self.weight, self.eps, self.offset, cos, sin, index_dtype)
        if cos is not None:
            if fuse(x):
                # one compiled kernel: the eager version makes ~10 passes over the [T, 64, 128] queries (fp32
                # upcasts, cat), 40 % of a 128K-token attention block
                return compiled("norm_and_rope", _norm_and_rope_math)(x, self.weight, self.eps, self.offset, cos, sin)
            return _norm_and_rope_math(x, self.weight, self.eps, self.offset, cos, sin)
        if fuse(x):
            return compiled("rms_norm", rms_norm)(x, self.weight, self.eps, self.offset)
        return rms_norm(x, self.weight, self.eps, self.offset)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (offset + weight)`` in fp32, in ``x``'s dtype: Gemma's with ``offset`` 1 (the
    default), the standard RMSNorm with 0."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.float())).to(x.dtype)


def _add_and_norm_math(x, residual, weight, eps: float, offset: float):
    total = residual + x
    return total, rms_norm(total, weight, eps, offset)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE on the first ``2 * cos.shape[-1]`` dims of ``x [T, H, D]``; the rest untouched.

    Written per output dimension (its frequency, its rotation partner and the partner's sign, gathered by index)
    rather than as halves joined by ``cat``: compiled with a norm before it, that is one kernel, where each ``cat``
    input was a kernel of its own (4 per call, 14 per sparse layer of a decode step)."""
    half = cos.shape[-1]
    dims = torch.arange(x.shape[-1], device=x.device)
    first_half = dims < half
    rotated = dims < 2 * half
    frequency = torch.where(first_half, dims, dims - half).clamp(0, half - 1)
    partner = torch.where(first_half, dims + half, torch.where(rotated, dims - half, dims))
    x32 = x.float()
    cos = cos[:, None, :][..., frequency]
    sin = torch.where(first_half, -1.0, 1.0) * sin[:, None, :][..., frequency]
    return torch.where(rotated, x32 * cos + x32[..., partner] * sin, x32).to(x.dtype)


def norm_and_rope(norm: MiniMaxM3RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_partial_rope(norm(x), cos, sin)`` (fused on CUDA)."""
    return norm(x, cos, sin)


def _norm_and_rope_math(x, weight, eps: float, offset: float, cos, sin):
    return apply_partial_rope(rms_norm(x, weight, eps, offset), cos, sin)


def _norm_rope_and_cast_math(x, weight, eps: float, offset: float, cos, sin, index_dtype: str):
    return to_index_dtype(apply_partial_rope(rms_norm(x, weight, eps, offset), cos, sin), index_dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_partial_rope`` (fused on CUDA): attention's q and k without a norm (``use_qk_norm = false``)."""
    if fuse(x):
        return compiled("rope", apply_partial_rope)(x, cos, sin)
    return apply_partial_rope(x, cos, sin)


def _rope_config(config: MiniMaxM3Config):
    """The RoPE fields as transformers' RoPE functions read them, on a config of their own (ours is not rewritten):
    the rotated dimensions as ``partial_rotary_factor`` of ``head_dim``."""
    from transformers import LlamaConfig

    parameters = dict(config.rope_parameters or {})
    parameters.pop("type", None)
    parameters.update(rope_type=config.rope_type, rope_theta=config.rope_theta,
                      partial_rotary_factor=config.rotary_dim / config.head_dim)
    rope_config = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                              num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                              max_position_embeddings=config.max_position_embeddings, rope_parameters=parameters)
    rope_config.partial_rotary_factor = parameters["partial_rotary_factor"]
    return rope_config


def rope_frequencies(config: MiniMaxM3Config, device=None, seq_len: Optional[int] = None, rope_config=None):
    """``(inv_freq, attention_scaling)`` of the config's RoPE over its ``rotary_dim`` dimensions: the default is
    ``theta^(-2i / rotary_dim)``; other types come from transformers' ``ROPE_INIT_FUNCTIONS`` (``seq_len``: the
    sequence length a dynamic type scales for; ``rope_config``: a ``_rope_config(config)`` built before)."""
    if config.rope_type == "default":
        exponent = torch.arange(0, config.rotary_dim, 2, dtype=torch.float64) / config.rotary_dim
        return (config.rope_theta ** -exponent).float().to(device), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_config = rope_config if rope_config is not None else _rope_config(config)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[config.rope_type](rope_config, device, seq_len=seq_len)
    return inv_freq.float(), float(attention_scaling)


class MiniMaxM3RotaryEmbedding(nn.Module):
    """cos/sin of the config's RoPE (``rope_parameters``; plain ``theta^(-2i / rotary_dim)`` by default) for 1-D
    positions (fp32), for attention and the index path alike. A ``dynamic`` RoPE rescales its frequencies for a
    forward whose sequences reach beyond ``max_position_embeddings`` (``longest``, a host int)."""

    def __init__(self, config: MiniMaxM3Config):
        super().__init__()
        self.config = config
        # a dynamic RoPE recomputes its frequencies per long forward: the carrier config is built once
        self.dynamic_rope_config = _rope_config(config) if config.rope_type == "dynamic" else None
        inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, longest: Optional[int] = None):
        inv_freq = self.inv_freq.to(positions.device)
        if self.dynamic_rope_config is not None and longest is not None and longest > self.config.max_position_embeddings:
            inv_freq, _ = rope_frequencies(self.config, positions.device, seq_len=longest,
                                           rope_config=self.dynamic_rope_config)
        angles = positions.float()[:, None] * inv_freq[None, :]
        if self.attention_scaling == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, beta: float) -> torch.Tensor:
    """SwiGLU-OAI: ``g = min(gate, limit); u = clamp(up, -limit, limit); g * sigmoid(alpha g) * (u + beta)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The plain SiLU-gated MLP's activation, ``silu(gate) * up`` (``hidden_act = "silu_and_mul"``)."""
    return nn.functional.silu(gate) * up


class MiniMaxM3MLP(nn.Module):
    """Dense MLP (first layers) and the shared expert: ``down(act(gate(x), up(x)))`` (``gated_activation``)."""

    def __init__(self, config: MiniMaxM3Config, width: int):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.input_projections = ProjectionGroup(("gate_proj", "up_proj"))

    def forward(self, x):
        gate, up = self.input_projections(self, x)
        return self.down_proj(gated_activation(self.config, gate, up))


def gated_activation(config: MiniMaxM3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The config's ``hidden_act`` of an MLP's gate and up projections (fused on CUDA)."""
    if config.hidden_act == SILU_AND_MUL:
        return (compiled("silu_and_mul", silu_and_mul) if fuse(gate) else silu_and_mul)(gate, up)
    activation = compiled("swiglu_oai", swiglu_oai) if fuse(gate) else swiglu_oai
    return activation(gate, up, config.swiglu_alpha, config.swiglu_limit, config.swiglu_beta)


@use_experts_implementation(experts_interface=EXPERTS_FUNCTIONS)
class MiniMaxM3Experts(nn.Module):
    """The routed experts packed as transformers' experts modules are: ``gate_up_proj [E, 2I, H]`` (the checkpoint's
    ``w1`` rows, then its ``w3`` rows) and ``down_proj [E, H, I]`` (``w2``); the checkpoint's per-expert names are
    packed at load time (``conversion.py``) and unpacked on save. ``config.experts_implementation`` picks the forward:
    ``grouped_mm`` (the default: one grouped GEMM per projection, no host synchronisation; ``experts.py``),
    ``batched_mm`` or ``eager`` (this class's loop over the chosen experts, the reference)."""

    def __init__(self, config: MiniMaxM3Config):
        super().__init__()
        self.config = config
        self.num_experts = config.num_local_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.routing_plan = None  # a decode step's RoutingPlan, which the grouped experts take for its experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden_states[t])`` (fp32 sum, input dtype)."""
        routed = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        for expert_id in torch.unique(top_k_index).tolist():
            tokens, slot = torch.nonzero(top_k_index == expert_id, as_tuple=True)
            gated = self._apply_gate(nn.functional.linear(hidden_states[tokens], self.gate_up_proj[expert_id]))
            output = nn.functional.linear(gated, self.down_proj[expert_id])
            routed.index_add_(0, tokens, output.float() * top_k_weights[tokens, slot, None])
        return routed.to(hidden_states.dtype)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return gated_activation(self.config, gate, up)


def top_k_columns(values: torch.Tensor, k: int) -> torch.Tensor:
    """``[..., k]`` the columns of each row's ``k`` largest values, largest first (of equal values the first
    column), as ``k`` rounds of an argmax that masks its winner: compiled, the rounds fuse into the router's kernel,
    where ``torch.topk`` adds kernels of its own (H100, top-4 of 128 in a graph: 3 kernels instead of 5, 218
    instead of 999 µs at 131,072 tokens)."""
    columns = torch.arange(values.shape[-1], device=values.device)
    chosen = []
    for _ in range(k):
        column = values.argmax(-1, keepdim=True)
        chosen.append(column)
        values = torch.where(columns == column, float("-inf"), values)
    return torch.cat(chosen, -1)


def route_weights(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """``(expert ids, weights)`` of the router's fp32 ``logits [T, E]``: the top-``top_k`` of ``sigmoid(logits) +
    bias``, weighted by their sigmoids renormalised to sum to ``scaling`` (compiled on CUDA)."""
    probabilities = torch.sigmoid(logits)
    chosen = top_k_columns(probabilities + bias, top_k)
    weights = probabilities.gather(-1, chosen)
    return chosen, weights / weights.sum(-1, keepdim=True) * scaling


class MiniMaxM3SparseMoeBlock(nn.Module):
    """Sigmoid router in fp32, top-k by ``p + e_score_correction_bias``, weights = renormalised ``p`` x scaling,
    plus an always-on shared expert (not scaled)."""

    def __init__(self, config: MiniMaxM3Config):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_local_experts, dtype=torch.float32))
        self.experts = MiniMaxM3Experts(config)
        self.shared_experts = MiniMaxM3MLP(config, config.shared_intermediate_size * config.n_shared_experts)

    def route(self, x: torch.Tensor):
        """``(expert ids [T, k], weights [T, k] fp32, router logits [T, E] fp32)``; the router stays fp32 whatever
        the model dtype."""
        # fp32 as loaded (_keep_in_fp32_modules); a hooked module is called (offload hooks bring its weight)
        logits = router_logits(self.gate, x)
        bias, top_k, scaling = (self.e_score_correction_bias.float(), self.config.num_experts_per_tok,
                                self.config.routed_scaling_factor)
        if decode_routing_serves(logits, bias, top_k):
            # a decode step: the choice, the weights and the experts' routing plan in one kernel
            chosen, weights, self.experts.routing_plan = decode_routing(logits, bias, top_k, scaling)
            return chosen, weights, logits
        choose = compiled("route_weights", route_weights) if fuse(logits) else route_weights
        chosen, weights = choose(logits, bias, top_k, scaling)
        return chosen, weights, logits

    def routed_experts(self, x: torch.Tensor):
        """``(routed experts' output [T, hidden], router logits [T, E])``."""
        chosen, weights, logits = self.route(x)
        return self.experts(x, chosen, weights), logits

    def forward(self, x: torch.Tensor):
        """``(output [T, hidden], router logits [T, E])`` of packed tokens ``x [T, hidden]``. In a captured decode
        step the shared expert runs beside the router and the routed experts (``streams``)."""
        shared, (routed, logits) = run_branches(lambda: self.shared_experts(x), lambda: self.routed_experts(x),
                                                x.device)
        return routed + shared, logits


class MiniMaxM3Attention(nn.Module):
    """Full causal GQA attention (first layers) or MiniMax Sparse Attention (the others).

    Sparse layers add the indexer's projections: index q (``index_n_heads`` heads) and one index key head, each
    with a per-head RMSNorm and the same partial RoPE as attention; the index keys go to the paged cache,
    the indexer selects ``index_topk_blocks`` pages per (token, KV group), attention reads only those pages.
    """

    def __init__(self, config: MiniMaxM3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_sparse = config.layer_types[layer_idx] == SPARSE_ATTENTION
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        gemma = config.use_gemma_norm
        if config.use_qk_norm:
            self.q_norm = MiniMaxM3RMSNorm(self.head_dim, config.rms_norm_eps, gemma)
            self.k_norm = MiniMaxM3RMSNorm(self.head_dim, config.rms_norm_eps, gemma)
        if self.is_sparse:
            self.index_q_proj = nn.Linear(config.hidden_size, config.index_n_heads * config.index_head_dim, bias=False)
            self.index_k_proj = nn.Linear(config.hidden_size, config.index_head_dim, bias=False)
            self.index_q_norm = MiniMaxM3RMSNorm(config.index_head_dim, config.rms_norm_eps, gemma)
            self.index_k_norm = MiniMaxM3RMSNorm(config.index_head_dim, config.rms_norm_eps, gemma)
        # one storage for the projections of the layer input: attention's three in one GEMM, the indexer's two in
        # another (the index path runs on its own stream in a captured decode step)
        self.input_projections = ProjectionGroup(
            ("q_proj", "k_proj", "v_proj") + (("index_q_proj", "index_k_proj") if self.is_sparse else ()))

    def query_key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Attention ``q [T, heads, D]``, ``k`` and ``v [T, kv_heads, D]`` of the packed layer input ``x [T, hidden]``
        (after ``input_layernorm``): q and k normed (``use_qk_norm``) and rotated, as attention reads them. The
        head counts are the projections' (under tensor parallelism a rank's share of them)."""
        return self._normed_and_rotated(*self._projected_query_key_value(x), cos, sin)

    def _projected_query_key_value(self, x: torch.Tensor):
        tokens = x.shape[0]
        return tuple(projection.view(tokens, -1, self.head_dim)
                     for projection in self.input_projections(self, x, ("q_proj", "k_proj", "v_proj")))

    def _normed_and_rotated(self, q, k, v, cos, sin):
        if self.config.use_qk_norm:
            q, k = norm_and_rope(self.q_norm, q, cos, sin), norm_and_rope(self.k_norm, k, cos, sin)
        else:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        return q, k, v

    def index_query_key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index_dtype: Optional[str] = None):
        """The indexer's ``q [T, index_n_heads, index_head_dim]`` and ``k [T, index_head_dim]`` of a sparse layer, in
        the model dtype (normed, partial RoPE): differentiable, for training the indexer. With ``index_dtype``
        (the forward pass: ``config.index_dtype``) they come cast by ``to_index_dtype``, fused with the norm."""
        self._require_indexer()
        return self._normed_index_query_key(*self._projected_index_query_key(x), cos, sin, index_dtype)

    def _projected_index_query_key(self, x: torch.Tensor):
        return tuple(self.input_projections(self, x, ("index_q_proj", "index_k_proj")))

    def _normed_index_query_key(self, query, key, cos, sin, index_dtype):
        return self._normed_index_query(query, cos, sin, index_dtype), self._normed_index_key(key, cos, sin, index_dtype)

    def _require_indexer(self) -> None:
        if not self.is_sparse:
            raise ValueError(f"layer {self.layer_idx} is a full-attention layer: it has no indexer")

    def index_query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index_dtype: Optional[str] = None):
        """The indexer's ``q [T, index_n_heads, index_head_dim]`` alone (``index_query_key``)."""
        self._require_indexer()
        return self._normed_index_query(self.index_q_proj(x), cos, sin, index_dtype)

    def index_key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index_dtype: Optional[str] = None):
        """The indexer's ``k [T, index_head_dim]`` alone (``index_query_key``): what dense mode still caches."""
        self._require_indexer()
        return self._normed_index_key(self.index_k_proj(x), cos, sin, index_dtype)

    def _normed_index_query(self, projected, cos, sin, index_dtype):
        return self.index_q_norm(projected.view(projected.shape[0], -1, self.config.index_head_dim), cos, sin,
                                 index_dtype=index_dtype)

    def _normed_index_key(self, projected, cos, sin, index_dtype):
        return self.index_k_norm(projected.view(projected.shape[0], 1, self.config.index_head_dim), cos, sin,
                                 index_dtype=index_dtype)[:, 0]

    def cache_index_keys_and_select(self, x, cos, sin, cache: MiniMaxM3Cache, metadata: ForwardMetadata,
                                    page_selector: PageSelector) -> Optional[torch.Tensor]:
        """Write the new tokens' index keys to the cache and, in sparse mode, return the indexer's page selection
        (dense mode computes no index queries: only the cache, which a later sparse forward reads, needs the keys)."""
        c = self.config
        # the selection is discrete, so no gradient reaches the indexer through it (it trains on a KL of its
        # scores, through index_query_key); without a graph the index path also stays off autograd under training
        with torch.no_grad():
            if c.attention_mode != "sparse":
                index_q, index_k = None, self.index_key(x, cos, sin, index_dtype=c.index_dtype)
            else:
                query, key = self._projected_index_query_key(x)
                index_q = write_decode_index_inputs(self, query, key, cos, sin, cache, metadata, c.index_dtype)
                if index_q is not None:  # a decode step: both norms, RoPE, the casts and the key's write in one kernel
                    return page_selector.select(cache.index_pages(self.layer_idx), cache.block_table(x.device),
                                                index_q, metadata)
                index_q, index_k = self._normed_index_query_key(query, key, cos, sin, c.index_dtype)
            cache.write("index_keys", self.layer_idx, index_k, metadata.batch_index, metadata.positions)
            if index_q is None:
                return None
            return page_selector.select(cache.index_pages(self.layer_idx), cache.block_table(x.device), index_q,
                                        metadata)

    def forward(self, x, cos, sin, cache: MiniMaxM3Cache, metadata: ForwardMetadata, page_selector: PageSelector):
        tokens = x.shape[0]

        def attention_inputs():
            q, k, v = self._projected_query_key_value(x)
            written = write_decode_attention_inputs(self, q, k, v, cos, sin, cache, metadata)
            if written is not None:  # a decode step: norms, RoPE and both cache writes in one kernel
                return written
            q, k, v = self._normed_and_rotated(q, k, v, cos, sin)
            keys = cache.write("keys", self.layer_idx, k, metadata.batch_index, metadata.positions)
            values = cache.write("values", self.layer_idx, v, metadata.batch_index, metadata.positions)
            return q, keys, values

        if self.is_sparse:
            # the index path shares nothing with attention's projections until attention reads the selection: in a
            # captured decode step the two run side by side (``streams``)
            selection, (q, keys, values) = run_branches(
                lambda: self.cache_index_keys_and_select(x, cos, sin, cache, metadata, page_selector),
                attention_inputs, x.device)
        else:
            selection = None
            q, keys, values = attention_inputs()
        if selection is None:
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
            attended = dense_attention(q, keys, values, metadata, scale=self.scale, attention=attention, module=self,
                                       dropout=self.config.attention_dropout if self.training else 0.0)
        else:
            attend = get_sparse_attention_function(
                self.config.sparse_attention_implementation, x.device, self.config.index_block_size
            )
            attended = attend(q, keys, values, selection, metadata, scale=self.scale, page_size=self.config.index_block_size)
        return self.o_proj(attended.reshape(tokens, -1)), selection


class MiniMaxM3DecoderLayer(GradientCheckpointingLayer):
    """Under gradient checkpointing the backward pass runs the layer again: its cache writes land on the same
    positions with the same values, so the cache stays as the forward left it."""

    def __init__(self, config: MiniMaxM3Config, layer_idx: int):
        super().__init__()
        self.self_attn = MiniMaxM3Attention(config, layer_idx)
        self.input_layernorm = MiniMaxM3RMSNorm(config.hidden_size, config.rms_norm_eps, config.use_gemma_norm)
        self.post_attention_layernorm = MiniMaxM3RMSNorm(config.hidden_size, config.rms_norm_eps, config.use_gemma_norm)
        if config.mlp_layer_types[layer_idx] == DENSE_MLP:
            self.mlp = MiniMaxM3MLP(config, config.dense_intermediate_size)
        else:
            self.block_sparse_moe = MiniMaxM3SparseMoeBlock(config)

    def forward(self, x, cos, sin, cache, metadata, page_selector):
        """``(output, page selection or None, router logits or None)`` of packed tokens ``x [T, hidden]``."""
        attended, selection = self.self_attn(self.input_layernorm(x), cos, sin, cache, metadata, page_selector)
        x, normed = self.post_attention_layernorm(attended, residual=x)  # one pass on CUDA
        if hasattr(self, "mlp"):
            return x + self.mlp(normed), selection, None
        feed_forward, router_logits = self.block_sparse_moe(normed)
        return x + feed_forward, selection, router_logits


class MiniMaxM3PreTrainedModel(PreTrainedModel):
    config_class = MiniMaxM3Config
    base_model_prefix = "model"
    _no_split_modules = ["MiniMaxM3DecoderLayer"]
    # the router only, by its module name (matched against parameter names): a bare "gate" would also keep every
    # gate_proj in fp32
    _keep_in_fp32_modules = ["block_sparse_moe.gate"]
    # the official release's vision tower, projector and multi-token-prediction layers
    _keys_to_ignore_on_load_unexpected = [r"^mtp\.", r"\.mtp\.", r"^vision_tower\.", r"^multi_modal_projector\.",
                                          r"^patch_merge_mlp\."]
    # recorded by transformers' capture_outputs on the packed layers (MiniMaxM3Model._forward_packed): the first
    # layer's input, then every layer's output; and each MoE block's router logits
    _can_record_outputs = {
        "hidden_states": OutputRecorder(MiniMaxM3DecoderLayer, index=0),
        "router_logits": OutputRecorder(MiniMaxM3SparseMoeBlock, index=1),
    }
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    supports_gradient_checkpointing = True

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, plus an ``auto_map`` to this installed package (``remote_code``), so
        the checkpoint also loads with ``trust_remote_code=True`` where ``minimax_m3`` was not imported."""
        from .remote_code import write_remote_code

        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(str(save_directory))
        return result

    def post_init(self):
        super().post_init()
        self.pack_projections()

    def pack_projections(self) -> None:
        """Give each group of projections of one input one weight storage (``packed_projections``), so a forward
        computes a group in one GEMM. Done when the model is built, loaded and moved (``to``, ``half``...); call it
        again after replacing projection weights by other tensors. Groups that cannot be packed (tensor-parallel
        shards, quantised, offloaded or hooked modules) keep their weights and are projected module by module."""
        left = {}
        for name, module in self.named_modules():
            group = getattr(module, "input_projections", None)
            if isinstance(group, ProjectionGroup):
                reason = group.pack(module)
                if reason is not None:
                    left.setdefault(reason, []).append(name)
        for reason, names in left.items():
            logger.info("%d projection groups left unpacked (%s), e.g. %s", len(names), reason, names[0])

    def get_correct_attn_implementation(self, requested_attention: Optional[str], is_init_check: bool = False) -> str:
        """transformers' choice, limited to what the dense layers serve (``dense_attention.check_served``)."""
        implementation = super().get_correct_attn_implementation(requested_attention, is_init_check)
        check_served(implementation)
        return implementation

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MiniMaxM3RMSNorm):
            nn.init.constant_(module.weight, 1.0 - module.offset)
        elif isinstance(module, MiniMaxM3Experts):
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
            nn.init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, MiniMaxM3SparseMoeBlock):
            nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, MiniMaxM3RotaryEmbedding):
            module.inv_freq.copy_(rope_frequencies(self.config)[0])


_CACHE_LAYOUT = ("num_hidden_layers", "layer_types", "num_key_value_heads", "head_dim", "index_head_dim",
                 "index_block_size")
"""The config fields that shape a cache's tensors and pages: a cache must agree with the model on all of them."""


def _described(value) -> str:
    return f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


CACHE_FIELD = next(field.name for field in dataclass_fields(MoeModelOutputWithPast) if field.name in ("cache", "past_key_values"))
"""The cache field of transformers' outputs: ``cache`` from transformers 5.2x on (which renames ``past_key_values=``
to it), ``past_key_values`` before; generate() reads the installed version's."""


@dataclass
class MiniMaxM3ModelOutput(MoeModelOutputWithPast):
    """transformers' ``MoeModelOutputWithPast`` plus ``page_selections``: per sparse layer ``[B, S, G, topk]`` int32
    page ids (``output_page_selections=True``)."""

    page_selections: Optional[tuple] = None


@dataclass
class MiniMaxM3CausalLMOutput(MoeCausalLMOutputWithPast):
    """transformers' ``MoeCausalLMOutputWithPast`` plus ``page_selections`` (as ``MiniMaxM3ModelOutput``)."""

    page_selections: Optional[tuple] = None


class MiniMaxM3Model(MiniMaxM3PreTrainedModel):
    def __init__(self, config: MiniMaxM3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MiniMaxM3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = MiniMaxM3RMSNorm(config.hidden_size, config.rms_norm_eps, config.use_gemma_norm)
        self.rotary_emb = MiniMaxM3RotaryEmbedding(config)
        self.page_selector = PageSelector(config)
        self._decode_graphs = {}  # batch size -> DecodeGraph
        self._reported_obstacles = set()
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[MiniMaxM3Cache] = None,
        cache: Optional[MiniMaxM3Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        output_router_logits: Optional[bool] = None,
        output_page_selections: bool = False,
        decode_cuda_graphs: bool = False,
        **kwargs,
    ) -> MiniMaxM3ModelOutput:
        """``position_ids``, when given, must be the positions the cache and ``attention_mask`` imply (each
        sequence's real tokens counted from 0); other positions, such as packed sequences that restart theirs,
        raise: pass such sequences as rows of a batch instead.

        ``decode_cuda_graphs=True`` (what ``generate`` passes on CUDA): a one-token step of every sequence over a
        ``MiniMaxM3StaticCache`` replays a CUDA graph of the model body (``decode_graphs``), captured at the first
        such step; on the CPU the same step runs uncaptured. Every sequence's new token is taken as real (the mask
        is not read), as in ``generate``'s decode steps, and a replayed step's ``last_hidden_state`` is the graph's
        buffer, which the next step overwrites. Other calls, and steps that ask for extra outputs, run as usual.

        Bad inputs raise a ``ValueError`` before the cache is written; on CUDA the ids' values are not checked against
        the vocabulary, as reading them would synchronise (an id out of range there is a device-side assert)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            self._check_input_ids(input_ids)
        else:
            self._check_inputs_embeds(inputs_embeds)
        inputs_name = "input_ids" if input_ids is not None else "inputs_embeds"
        batch, new_tokens = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        past_key_values = past_key_values if past_key_values is not None else cache  # transformers 5.2x's name
        if past_key_values is not None:
            self._check_cache(past_key_values, batch)
        if decode_cuda_graphs and self._takes_decode_step(input_ids, past_key_values, position_ids, output_hidden_states,
                                                          output_router_logits, output_page_selections, kwargs):
            self._check_length(inputs_name, past_key_values.lengths, [1] * batch)
            hidden = self._decode_graph(past_key_values)(input_ids)
            return MiniMaxM3ModelOutput(last_hidden_state=hidden,
                                        **{CACHE_FIELD: past_key_values if use_cache is not False else None})
        attentions = kwargs.get("output_attentions")
        if attentions or (attentions is None and self.config.output_attentions):
            raise ValueError("output_attentions is not supported: the sparse layers never form attention weights and "
                             "the dense layers run SDPA; output_page_selections=True returns the pages each token read")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        real = self._new_token_mask(attention_mask, batch, new_tokens, inputs_embeds.device)
        # without a mask every column is real: the lengths are known on the host (reading them would synchronise)
        query_lengths = [new_tokens] * batch if attention_mask is None else real.sum(1).tolist()
        if not any(query_lengths):
            raise ValueError(f"attention_mask marks none of the {new_tokens} new columns of any sequence as a real "
                             f"token: there is nothing to run")
        past_lengths = past_key_values.lengths if past_key_values is not None and past_key_values.lengths else [0] * batch
        self._check_length(inputs_name, past_lengths, query_lengths)
        cache = past_key_values if past_key_values is not None else MiniMaxM3Cache(self.config, batch)
        cache.bind(batch)

        chunk = self._query_chunk_columns(cache, query_lengths, new_tokens)
        if chunk < new_tokens:
            if position_ids is not None:  # all of them before the first chunk writes the cache
                self._check_position_ids(position_ids, real, self._metadata(real, cache.lengths, query_lengths).positions)
            return self._forward_in_chunks(inputs_embeds, attention_mask, cache, use_cache, output_hidden_states,
                                           output_router_logits, output_page_selections, chunk)
        metadata = self._metadata(real, cache.lengths, query_lengths)
        if position_ids is not None:
            self._check_position_ids(position_ids, real, metadata.positions)
        cache.reserve(query_lengths)  # capacity only: the cached lengths stay until advance()
        # [T, hidden], sequences back to back; without a mask every column is real and packing is a view (boolean
        # indexing would cost a pass and a host synchronisation)
        all_real = attention_mask is None
        packed = inputs_embeds.flatten(0, 1) if all_real else inputs_embeds[real]
        cos, sin = self.rotary_emb(metadata.positions, max(metadata.kv_lengths))
        packed_output = self._forward_packed(packed, cos, sin, cache, metadata, output_page_selections,
                                             output_hidden_states=output_hidden_states,
                                             output_router_logits=output_router_logits, return_dict=True)
        cache.advance(query_lengths, new_tokens)

        def unpack(tensors):
            return None if tensors is None else tuple(
                None if tensor is None else self._unpack(tensor, real, all_real) for tensor in tensors)

        router_logits = unpack(packed_output.router_logits)
        return MiniMaxM3ModelOutput(
            last_hidden_state=self._unpack(packed_output.last_hidden_state, real, all_real),
            hidden_states=unpack(packed_output.hidden_states),
            # transformers' layout for the load-balancing loss: [B * S, E] per layer, padding masked by the caller
            router_logits=None if router_logits is None else tuple(logits.flatten(0, 1) for logits in router_logits),
            page_selections=unpack(packed_output.page_selections),
            **{CACHE_FIELD: cache if use_cache else None},
        )

    @capture_outputs
    def _forward_packed(self, hidden, cos, sin, cache, metadata, output_page_selections=False, **kwargs):
        """The layers over packed tokens ``[T, hidden]``: ``last_hidden_state`` and ``page_selections`` packed, and
        the ``hidden_states`` / ``router_logits`` that transformers' ``capture_outputs`` records from the layers
        (``_can_record_outputs``), packed too; ``forward`` unpacks them all to ``[B, S, ...]``."""
        selections = []
        mesh = self.tensor_parallel_mesh() if output_page_selections else None
        for layer in self.layers:
            hidden, selection, _ = layer(hidden, cos, sin, cache, metadata, self.page_selector)
            if output_page_selections and selection is not None:
                # the selector reuses its buffer; under tensor parallelism a rank selects for its own KV groups
                selections.append(selection.clone() if mesh is None else _gathered_groups(selection, mesh))
        return MiniMaxM3ModelOutput(last_hidden_state=self.norm(hidden),
                                    page_selections=tuple(selections) if output_page_selections else None)

    def _takes_decode_step(self, input_ids, cache, position_ids, output_hidden_states, output_router_logits,
                           output_page_selections, kwargs) -> bool:
        """Whether this call is a decode step the graph serves (see ``forward``)."""
        if not (isinstance(cache, MiniMaxM3StaticCache) and cache.batch_size is not None and input_ids is not None
                and input_ids.dim() == 2 and input_ids.shape == (cache.batch_size, 1) and min(cache.lengths) > 0):
            return False
        if position_ids is not None or output_hidden_states or output_router_logits or output_page_selections:
            return False
        if self.config.output_hidden_states or self.config.output_router_logits or kwargs.get("output_attentions"):
            return False
        if self.training or torch.is_grad_enabled():
            return False
        obstacle = decode_graph_obstacle(self.config)
        graph = self._decode_graphs.get(cache.batch_size)
        if obstacle is None and (graph is None or not graph.serves(cache)) and self._has_accelerate_hooks():
            obstacle = "accelerate's hooks (device_map, offload) move weights and activations during the forward"
        if obstacle is None and self.tensor_parallel_mesh() is not None:
            obstacle = "tensor parallelism: its collectives run in DTensor's Python hooks, which a graph cannot replay"
        if obstacle is not None:
            if obstacle not in self._reported_obstacles:
                logger.warning("decode steps run eagerly: %s", obstacle)
                self._reported_obstacles.add(obstacle)
            return False
        return True

    def tensor_parallel_mesh(self):
        """The tensor-parallel device mesh the attention projections are sharded over (``from_pretrained(...,
        tp_plan="auto")``), or None."""
        weight = self.layers[0].self_attn.k_proj.weight
        return weight.device_mesh if isinstance(weight, DTensor) else None

    def _has_accelerate_hooks(self) -> bool:
        return any(hasattr(module, "_hf_hook") for module in self.modules())

    def _apply(self, fn, *args, **kwargs):
        """``to()``, ``cuda()``, ``half()``...: captured decode graphs read the old tensors' addresses, so they go; the
        converted weights are separate tensors, so the projection groups are packed again."""
        getattr(self, "_decode_graphs", {}).clear()
        result = super()._apply(fn, *args, **kwargs)
        self.pack_projections()
        return result

    def _decode_graph(self, cache) -> DecodeGraph:
        graph = self._decode_graphs.get(cache.batch_size)
        if graph is None or not graph.serves(cache):
            graph = DecodeGraph(self, cache, capture=self.embed_tokens.weight.device.type == "cuda")
            self._decode_graphs[cache.batch_size] = graph
        return graph

    def _decode_step_body(self, input_ids, cache, metadata: ForwardMetadata) -> torch.Tensor:
        """The model body of a decode step with device-only lengths (``DecodeStep``): ``[B, 1, hidden]``."""
        packed = self.embed_tokens(input_ids).flatten(0, 1)
        cos, sin = self.rotary_emb(metadata.positions)
        output = self._forward_packed(packed, cos, sin, cache, metadata, False, output_hidden_states=False,
                                      output_router_logits=False, return_dict=True)
        return output.last_hidden_state.view(input_ids.shape[0], 1, -1)

    def _check_input_ids(self, input_ids) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"input_ids must be [batch, new tokens] of int64 or int32 (one sequence as input_ids[None]), "
                             f"got {_described(input_ids)}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids must hold at least one new token, got shape {tuple(input_ids.shape)}")
        if input_ids.device.type == "cpu":  # on an accelerator min/max would synchronise
            low, high = (int(value) for value in input_ids.aminmax())
            vocabulary = self.embed_tokens.num_embeddings
            if low < 0 or high >= vocabulary:
                raise ValueError(f"input_ids must be in [0, vocab_size = {vocabulary}), got ids from {low} to {high}")

    def _check_inputs_embeds(self, inputs_embeds) -> None:
        hidden_size = self.config.hidden_size
        if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
            raise ValueError(f"inputs_embeds must be [batch, new tokens, hidden_size = {hidden_size}], got "
                             f"{_described(inputs_embeds)}")
        if inputs_embeds.numel() == 0:
            raise ValueError(f"inputs_embeds must hold at least one new token, got shape {tuple(inputs_embeds.shape)}")
        expected = self.embed_tokens.weight.dtype
        # under autocast the matmuls cast their inputs, so any floating dtype runs
        autocast = torch.is_autocast_enabled(inputs_embeds.device.type)
        if not inputs_embeds.is_floating_point() or (inputs_embeds.dtype != expected and not autocast):
            raise ValueError(f"inputs_embeds must be {expected} (the dtype of the model's embeddings), got "
                             f"{inputs_embeds.dtype}")

    def _check_cache(self, cache, batch: int) -> None:
        if not isinstance(cache, MiniMaxM3Cache):
            raise TypeError(f"past_key_values must be a MiniMaxM3Cache or MiniMaxM3StaticCache (positional K/V and paged "
                            f"index-K), got {type(cache).__name__}: build one with MiniMaxM3Cache(model.config) or "
                            f"let generate() build it")
        if cache.config is not self.config:
            for name in _CACHE_LAYOUT:
                theirs, ours = getattr(cache.config, name, None), getattr(self.config, name)
                if theirs != ours:
                    raise ValueError(f"past_key_values was built for another config: its {name} is {theirs}, the "
                                     f"model's is {ours} (build it with MiniMaxM3Cache(model.config))")
        if cache.batch_size is not None and cache.batch_size != batch:
            raise ValueError(f"past_key_values holds {cache.batch_size} sequences, the inputs have {batch}")

    def _check_length(self, inputs_name: str, past_lengths: list, query_lengths: list) -> None:
        """The default RoPE's positions end at ``max_position_embeddings`` (what the model was trained for); the
        scaled ones (dynamic, yarn, ...) stretch it to longer sequences, so only the default is held to it."""
        limit = self.config.max_position_embeddings
        longest = max(past + new for past, new in zip(past_lengths, query_lengths))
        if self.config.rope_type == "default" and longest > limit:
            raise ValueError(f"these {inputs_name} take a sequence to {longest} tokens, beyond max_position_embeddings = "
                             f"{limit} of the default RoPE: raise max_position_embeddings or set a RoPE scaling that "
                             f"serves longer sequences (rope_parameters with rope_type 'dynamic' or 'yarn')")

    @staticmethod
    def _check_position_ids(position_ids, real, positions) -> None:
        """Raise unless ``position_ids`` (``[B or 1, new tokens]``) holds, at the real tokens, the ``positions`` the
        model uses (one synchronisation, only when a caller passes them)."""
        if position_ids.dim() != 2 or position_ids.shape[1] != real.shape[1] or position_ids.shape[0] not in (1, real.shape[0]):
            raise ValueError(f"position_ids must be [batch, new tokens] = {list(real.shape)}, got {tuple(position_ids.shape)}")
        given = position_ids.to(real.device).expand(real.shape[0], -1)[real]
        if not torch.equal(given, positions.to(given.dtype)):
            raise ValueError("position_ids must equal each sequence's positions after its cached tokens (real tokens "
                             "counted from 0, padding skipped); packed sequences that restart their positions are not "
                             "supported: pass them as separate rows with an attention_mask")

    def _query_chunk_columns(self, cache: MiniMaxM3Cache, query_lengths: list, new_tokens: int) -> int:
        """Input columns per forward so the indexer's score buffer (``T * H * pitch`` fp32, the pages rounded up by
        ``score_row_pitch``; the only super-linear allocation) stays within ``config.max_score_buffer_bytes``: very
        long prompts run as query chunks."""
        if self.config.attention_mode != "sparse" or SPARSE_ATTENTION not in self.config.layer_types:
            return new_tokens
        pages = -(-max(p + q for p, q in zip(cache.lengths, query_lengths)) // self.config.index_block_size)
        bytes_per_column = 4 * cache.batch_size * self.config.index_n_heads * score_row_pitch(pages)
        return max(1, min(new_tokens, self.config.max_score_buffer_bytes // max(1, bytes_per_column)))

    def _forward_in_chunks(self, inputs_embeds, attention_mask, cache, use_cache, output_hidden_states,
                           output_router_logits, output_page_selections, chunk):
        total = inputs_embeds.shape[1]
        past_columns = 0 if attention_mask is None else attention_mask.shape[1] - total
        batch = inputs_embeds.shape[0]
        hidden, layer_states, router_logits, selections = [], [], [], []
        for begin in range(0, total, chunk):
            end = min(total, begin + chunk)
            mask = None if attention_mask is None else attention_mask[:, : past_columns + end]
            output = self(inputs_embeds=inputs_embeds[:, begin:end], attention_mask=mask, past_key_values=cache,
                          use_cache=True, output_hidden_states=output_hidden_states,
                          output_router_logits=output_router_logits, output_page_selections=output_page_selections,
                          return_dict=True)
            hidden.append(output.last_hidden_state)
            if output_hidden_states:
                layer_states.append(output.hidden_states)
            if output_router_logits:
                router_logits.append(output.router_logits)
            if output_page_selections:
                selections.append(output.page_selections)
        return MiniMaxM3ModelOutput(
            last_hidden_state=torch.cat(hidden, dim=1),
            hidden_states=tuple(torch.cat(parts, dim=1) for parts in zip(*layer_states)) if output_hidden_states else None,
            router_logits=tuple(torch.cat([part.view(batch, -1, part.shape[-1]) for part in parts], dim=1).flatten(0, 1)
                                for parts in zip(*router_logits)) if output_router_logits else None,
            page_selections=tuple(torch.cat(parts, dim=1) for parts in zip(*selections)) if output_page_selections else None,
            **{CACHE_FIELD: cache if use_cache else None},
        )

    @staticmethod
    def _new_token_mask(attention_mask, batch, new_tokens, device) -> torch.Tensor:
        """Which of the new positions hold real tokens (padding may sit anywhere; left padding in practice)."""
        if attention_mask is None:
            return torch.ones(batch, new_tokens, dtype=torch.bool, device=device)
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < new_tokens:
            raise ValueError(
                f"attention_mask must be [batch, past + new tokens] = [{batch}, >= {new_tokens}], got {tuple(attention_mask.shape)}"
            )
        return attention_mask[:, -new_tokens:].to(device=device, dtype=torch.bool)

    @staticmethod
    def _metadata(real: torch.Tensor, past_lengths: list, query_lengths: list) -> ForwardMetadata:
        """The packed layout. When every new column is real (``query_lengths`` all equal to the columns) it is built
        without a host synchronisation; padding needs ``nonzero`` and a boolean gather, which do synchronise."""
        device = real.device
        batch, columns = real.shape
        starts, offset = [], 0
        for count in query_lengths:
            starts.append(offset)
            offset += count
        past = host_to_device(torch.tensor(past_lengths, dtype=torch.long), device)
        if all(count == columns for count in query_lengths):
            batch_index = torch.arange(batch, device=device).repeat_interleave(columns)
            positions = (past[:, None] + torch.arange(columns, device=device)).flatten()
        else:
            batch_index = torch.nonzero(real, as_tuple=True)[0]
            rank = torch.cumsum(real.long(), dim=1) - 1  # rank of each real token among its sequence's new tokens
            positions = (past[:, None] + rank)[real]
        metadata = ForwardMetadata(
            batch_index=batch_index,
            positions=positions,
            query_lengths=query_lengths,
            kv_lengths=[p + q for p, q in zip(past_lengths, query_lengths)],
            query_starts=starts,
        )
        metadata.device_lengths(device)  # staged now, before any kernel is queued
        return metadata

    @staticmethod
    def _unpack(packed: torch.Tensor, real: torch.Tensor, all_real: bool = False) -> torch.Tensor:
        """``[B, S, ...]`` of packed rows, zeros at padding; a view of ``packed`` when every column is real."""
        if all_real:
            return packed.view(*real.shape, *packed.shape[1:])
        out = packed.new_zeros(*real.shape, *packed.shape[1:])
        out[real.to(packed.device)] = packed
        return out


def _tensor_parallel_size(from_pretrained_kwargs: dict) -> int:
    """The number of ranks a ``from_pretrained(tp_plan=...)`` call splits over: its ``tp_size`` (or its
    ``distributed_config``'s), else the launched world."""
    distributed = from_pretrained_kwargs.get("distributed_config")
    size = from_pretrained_kwargs.get("tp_size") or getattr(distributed, "tp_size", None)
    if size:
        return int(size)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def _gathered_groups(selection: torch.Tensor, mesh) -> torch.Tensor:
    """``[T, G, topk]`` page ids of every KV group from each tensor-parallel rank's ``[T, G / ranks, topk]``."""
    group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")
    parts = [torch.empty_like(selection) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, selection.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class MiniMaxM3ForCausalLM(MiniMaxM3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: MiniMaxM3Config):
        super().__init__(config)
        self.model = MiniMaxM3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained`` for every layout (``loading``), raising where transformers would only
        report: a tensor stored twice, missing, unexpected or of another shape."""
        from . import loading

        if pretrained_model_name_or_path is None:  # a config and a state_dict: nothing to convert
            return super().from_pretrained(None, *args, **kwargs)
        path = str(pretrained_model_name_or_path)
        config = kwargs.get("config")
        if not isinstance(config, PreTrainedConfig):
            hub = {key: kwargs[key] for key in loading.HUB_ARGUMENTS if key in kwargs}
            config = cls.config_class.from_pretrained(config if config is not None else path, **hub)
        quantization = kwargs.get("quantization_config") or getattr(config, "quantization_config", None)
        loading.check_quantization_served(quantization)
        if kwargs.get("tp_plan") is not None or kwargs.get("distributed_config") is not None:
            loading.check_tensor_parallel_split(config, quantization, _tensor_parallel_size(kwargs))
        if os.path.isdir(path):
            loading.check_shards(os.path.join(path, kwargs.get("subfolder") or ""))
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        # transformers would initialise these at random (or drop them) and only report it
        problems = (("missing_keys", "lacks {} tensors of the model"),
                    ("mismatched_keys", "holds {} tensors whose shapes the config's model does not have"),
                    ("unexpected_keys", "has {} tensors which the config's model does not"))
        for field, message in problems:
            keys = sorted(str(key) for key in info.get(field) or [])
            if keys:
                raise ValueError(f"checkpoint {path} {message.format(len(keys))}: {keys[:5]}"
                                 + (" ..." if len(keys) > 5 else ""))
        if quantization is not None:
            model._cast_unquantized_to_config_dtype()
        model.pack_projections()  # the loader set each weight apart
        return (model, info) if wants_info else model

    def _cast_unquantized_to_config_dtype(self) -> None:
        """transformers 5.17's FP8 dequantising loader passes the checkpoint's unquantised tensors (embeddings,
        norms, ``lm_head``) through in their stored dtype; give them the dtype that was asked for, as 5.24 does."""
        target = self.config.dtype
        if not isinstance(target, torch.dtype):
            return
        cast, replaced = [], {}
        for module_name, module in self.named_modules():
            for name, parameter in list(module._parameters.items()):
                full_name = f"{module_name}.{name}" if module_name else name
                keep_fp32 = any(kept in full_name for kept in self._keep_in_fp32_modules)
                if parameter is None or not parameter.dtype.is_floating_point or parameter.dtype == target or keep_fp32:
                    continue
                if isinstance(parameter, DTensor):
                    # a tensor-parallel shard: its local tensor is what the forward reads, so the DTensor is rebuilt
                    # (once per tensor: tied weights stay tied)
                    if id(parameter) not in replaced:
                        local = parameter.to_local().to(target)
                        replaced[id(parameter)] = nn.Parameter(
                            DTensor.from_local(local, parameter.device_mesh, parameter.placements, run_check=False,
                                               shape=parameter.shape, stride=parameter.stride()),
                            requires_grad=parameter.requires_grad)
                    module._parameters[name] = replaced[id(parameter)]
                else:
                    parameter.data = parameter.data.to(target)
                cast.append(full_name)
        if cast:
            logger.info("cast %d unquantised tensors of the FP8 checkpoint to %s, e.g. %s", len(cast), target, cast[:3])

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # transformers' DynamicCache is not this model's cache: _prepare_cache_for_generation builds it

    CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
    """``generate(cache_implementation=...)`` values: ``MiniMaxM3Cache`` (None, "dynamic") or
    ``MiniMaxM3StaticCache`` ("static", sized ``max(max_length, generation_config.max_cache_len)``)."""

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """generate()'s cache: the caller's (which must be one of ours), or a new ``MiniMaxM3Cache`` /
        ``MiniMaxM3StaticCache`` by ``cache_implementation``; other implementations raise."""
        given = model_kwargs.get(CACHE_FIELD)
        implementation = generation_config.cache_implementation
        if given is not None:
            if implementation is not None:
                raise ValueError(f"pass either {CACHE_FIELD}= (a cache) or cache_implementation=, not both")
            if not isinstance(given, MiniMaxM3Cache):
                raise TypeError(f"{CACHE_FIELD} must be a MiniMaxM3Cache or MiniMaxM3StaticCache, got {type(given).__name__}")
            given._is_user_defined = True
            if given.static and given.capacity < max_cache_length:
                logger.info("the static cache holds %d tokens per sequence and this generation reaches %d: "
                            "re-allocated once", given.capacity, max_cache_length)
                given.reallocate(max_cache_length)
            return
        if generation_config.use_cache is False:
            return
        if implementation not in self.CACHE_IMPLEMENTATIONS:
            raise ValueError(f"cache_implementation={implementation!r} is not served by MiniMax-M3: use one of "
                             f"{self.CACHE_IMPLEMENTATIONS} (its cache keeps K/V by position and the paged index-K)")
        if implementation is None and self._decode_cuda_graphs(model_kwargs):
            implementation = "static"  # the graphs need tensors that never move
        if implementation == "static":
            capacity = max(max_cache_length, getattr(generation_config, "max_cache_len", None) or 0)
            model_kwargs[CACHE_FIELD] = MiniMaxM3StaticCache(self.config, max_cache_len=capacity)
        else:
            model_kwargs[CACHE_FIELD] = MiniMaxM3Cache(self.config)

    def _decode_cuda_graphs(self, generate_kwargs: dict) -> bool:
        """``generate(decode_cuda_graphs=...)``: by default on CUDA, one-token steps replay CUDA graphs over a
        static cache (``MiniMaxM3Model.forward``); ``False`` keeps every step eager (and the cache dynamic)."""
        requested = generate_kwargs.get("decode_cuda_graphs")
        return self.device.type == "cuda" if requested is None else bool(requested)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, inputs_embeds=None, **kwargs):
        """The step's new columns and every other generate() keyword (e.g. ``output_page_selections``); positions
        come from the cache and the mask, so ``position_ids`` / ``cache_position`` are not passed on."""
        cache = kwargs.pop("cache", None)
        legacy_cache = kwargs.pop("past_key_values", None)
        cache = cache if cache is not None else legacy_cache
        for derived in ("position_ids", "cache_position"):
            kwargs.pop(derived, None)
        inputs = {"attention_mask": attention_mask, "use_cache": kwargs.pop("use_cache", True),
                  "decode_cuda_graphs": self._decode_cuda_graphs(kwargs)}
        kwargs.pop("decode_cuda_graphs", None)
        if cache is not None:
            inputs["past_key_values"] = cache
        seen = getattr(cache, "columns_seen", 0)
        if seen == 0:
            inputs["inputs_embeds" if inputs_embeds is not None else "input_ids"] = (
                inputs_embeds if inputs_embeds is not None else input_ids)
        else:
            # the mask spans every column so far; a generation that started from inputs_embeds has ids only for
            # the tokens it generated (generate keeps passing the prompt's embeddings, and drops an all-ones mask),
            # so the new columns are counted from the end
            if attention_mask is not None:
                columns = attention_mask.shape[1]
            else:
                columns = input_ids.shape[1] + (inputs_embeds.shape[1] if inputs_embeds is not None else 0)
            new_columns = columns - seen
            if 0 < new_columns <= input_ids.shape[1]:
                inputs["input_ids"] = input_ids[:, input_ids.shape[1] - new_columns:]
            elif (0 < new_columns and input_ids.shape[1] == 0 and inputs_embeds is not None
                  and new_columns <= inputs_embeds.shape[1]):
                # a generation continued from longer embeddings over its cache: their new columns
                inputs["inputs_embeds"] = inputs_embeds[:, inputs_embeds.shape[1] - new_columns:]
            else:
                raise ValueError(f"the cache has seen {seen} columns and the inputs have {columns}: nothing new to run")
        inputs.update(kwargs)
        return inputs

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[MiniMaxM3Cache] = None,
        cache: Optional[MiniMaxM3Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        output_hidden_states: Optional[bool] = None,
        output_router_logits: Optional[bool] = None,
        output_page_selections: bool = False,
        decode_cuda_graphs: bool = False,
        **kwargs,
    ) -> MiniMaxM3CausalLMOutput:
        """``MiniMaxM3Model.forward`` (which validates the inputs), then the logits of ``logits_to_keep`` and the loss."""
        past_key_values = past_key_values if past_key_values is not None else cache  # transformers 5.2x's name
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            output_page_selections=output_page_selections,
            output_attentions=kwargs.pop("output_attentions", None),
            decode_cuda_graphs=decode_cuda_graphs,
            return_dict=True,
        )
        hidden = outputs.last_hidden_state
        # logits only where needed: at a 200K vocabulary every position of a long prompt would cost more than the model
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) and logits_to_keep > 0 else (
            slice(None) if isinstance(logits_to_keep, int) else logits_to_keep
        )
        logits = self.lm_head(hidden[:, keep]).float()
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        aux_loss = None
        if outputs.router_logits:
            new_columns = outputs.router_logits[0].shape[0] // hidden.shape[0]
            mask = None if attention_mask is None else attention_mask[:, -new_columns:]
            aux_loss = load_balancing_loss_func(outputs.router_logits, self.config.num_local_experts,
                                                self.config.num_experts_per_tok, mask)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MiniMaxM3CausalLMOutput(
            loss=loss, aux_loss=aux_loss, logits=logits, hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits, page_selections=outputs.page_selections,
            **{CACHE_FIELD: outputs[CACHE_FIELD] if CACHE_FIELD in outputs else None},
        )
