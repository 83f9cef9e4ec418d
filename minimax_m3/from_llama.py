"""A dense Llama-architecture model in the MiniMax-M3 architecture: the same weights under the same names, with a new
indexer on the layers that become sparse.

Llama's decoder is M3's with other fixed choices, each an option of ``MiniMaxM3Config``: a plain SiLU-gated MLP
(``hidden_act = "silu_and_mul"``), no q/k norm (``use_qk_norm = False``), the standard RMSNorm ``x_hat * w``
(``use_gemma_norm = False``), RoPE over the whole head (``partial_rotary_factor = 1``) and, where Llama has them,
tied embeddings. Every layer keeps its dense MLP. The layers from ``first_sparse_layer`` on become
``minimax_m3_sparse``: they gain ``index_q_proj`` / ``index_k_proj`` and their norms, initialised as the model
initialises them, to be trained by distillation. In ``attention_mode = "dense"`` the result computes Llama's logits.
"""

from __future__ import annotations

from typing import Optional

import torch

from .configuration_minimax_m3 import FULL_ATTENTION, ROPE_TYPES, SILU_AND_MUL, SPARSE_ATTENTION, MiniMaxM3Config
from .modeling_minimax_m3 import MiniMaxM3ForCausalLM

__all__ = ["minimax_m3_config_from_llama", "convert_llama", "INDEXER_SUFFIXES"]

INDEXER_SUFFIXES = ("index_q_proj.weight", "index_k_proj.weight", "index_q_norm.weight", "index_k_norm.weight")
"""The parameters a sparse layer has beyond Llama's: the converted model's new, untrained indexer."""


def _check_llama(llama_config) -> None:
    """Llama features the M3 architecture cannot express raise, naming the field."""
    if getattr(llama_config, "model_type", None) != "llama":
        raise ValueError(f"llama_config must be a Llama config (model_type 'llama'), got "
                         f"{getattr(llama_config, 'model_type', None)!r}")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(llama_config, field, False):
            raise ValueError(f"llama_config.{field} is true: MiniMax-M3's projections have no biases")
    if llama_config.hidden_act != "silu":
        raise ValueError(f"llama_config.hidden_act must be 'silu' (the SiLU-gated MLP), got {llama_config.hidden_act!r}")
    rope = dict(getattr(llama_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise ValueError(f"llama_config rope_type {rope.get('rope_type')!r} is not served; served: {ROPE_TYPES}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("llama_config rotates part of each head: Llama rotates all of it")


def minimax_m3_config_from_llama(llama_config, *, first_sparse_layer: int = 3, index_head_dim: Optional[int] = None,
                                 index_block_size: int = 128, index_topk_blocks: int = 16,
                                 **overrides) -> MiniMaxM3Config:
    """The M3 config of ``llama_config``'s model: layers ``first_sparse_layer`` on sparse, one index head per KV
    head of ``index_head_dim`` (Llama's head size by default), pages of ``index_block_size`` keys, the top
    ``index_topk_blocks`` with the local page forced. ``overrides`` set any other M3 field.

    The indexer runs the torch backend unless ``overrides`` say otherwise: the SM90 kernel serves 1, 2 or 4 index
    heads, so a model with another number would otherwise reach the torch backend by a logged fallback."""
    _check_llama(llama_config)
    layers = llama_config.num_hidden_layers
    if not 0 <= first_sparse_layer <= layers:
        raise ValueError(f"first_sparse_layer must be in [0, {layers}], got {first_sparse_layer}")
    head_dim = getattr(llama_config, "head_dim", None) or llama_config.hidden_size // llama_config.num_attention_heads
    kv_heads = llama_config.num_key_value_heads or llama_config.num_attention_heads
    rope = dict(getattr(llama_config, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", getattr(llama_config, "rope_theta", None))
    rope.pop("partial_rotary_factor", None)
    values = dict(
        vocab_size=llama_config.vocab_size,
        hidden_size=llama_config.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=llama_config.num_attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        dense_intermediate_size=llama_config.intermediate_size,
        intermediate_size=llama_config.intermediate_size,  # the MoE's sizes: unused, every layer's MLP is dense
        shared_intermediate_size=llama_config.intermediate_size,
        num_local_experts=1,
        num_experts_per_tok=1,
        hidden_act=SILU_AND_MUL,
        use_gemma_norm=False,
        use_qk_norm=False,
        rms_norm_eps=llama_config.rms_norm_eps,
        max_position_embeddings=llama_config.max_position_embeddings,
        rope_parameters={"rope_type": "default", **rope, "rope_theta": theta},
        partial_rotary_factor=1.0,
        tie_word_embeddings=bool(llama_config.tie_word_embeddings),
        initializer_range=llama_config.initializer_range,
        layer_types=[FULL_ATTENTION] * first_sparse_layer + [SPARSE_ATTENTION] * (layers - first_sparse_layer),
        mlp_layer_types=["dense"] * layers,
        index_n_heads=kv_heads,
        index_head_dim=index_head_dim or head_dim,
        index_block_size=index_block_size,
        index_topk_blocks=index_topk_blocks,
        index_local_blocks=1,
        indexer_backend="torch",
        bos_token_id=llama_config.bos_token_id,
        eos_token_id=llama_config.eos_token_id,
        pad_token_id=llama_config.pad_token_id,
    )
    values.update(overrides)
    return MiniMaxM3Config(**values)


def convert_llama(llama_model, *, seed: int = 0, dtype: Optional[torch.dtype] = None,
                  **config_options) -> MiniMaxM3ForCausalLM:
    """``llama_model`` (a ``LlamaForCausalLM``) as a ``MiniMaxM3ForCausalLM`` on the CPU, in ``dtype`` (the Llama
    model's by default): every Llama tensor copied under its own name, the new indexer initialised from ``seed``.
    ``config_options`` go to ``minimax_m3_config_from_llama``."""
    config = minimax_m3_config_from_llama(llama_model.config, **config_options)
    source = {name: tensor.detach() for name, tensor in llama_model.state_dict().items()
              if not name.endswith("rotary_emb.inv_freq")}
    dtype = dtype or next(iter(source.values())).dtype
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = MiniMaxM3ForCausalLM(config).to(dtype)
    finally:
        torch.random.set_rng_state(generator_state)
    target = model.state_dict()
    unexpected = sorted(set(source) - set(target))
    if unexpected:
        raise ValueError(f"the Llama model has {len(unexpected)} tensors the converted model does not: {unexpected[:5]}")
    new = sorted(set(target) - set(source))
    not_indexer = [name for name in new if not name.endswith(INDEXER_SUFFIXES)]
    if not_indexer:
        raise ValueError(f"the Llama model lacks {len(not_indexer)} tensors of the converted model: {not_indexer[:5]}")
    for name, tensor in source.items():
        if tuple(tensor.shape) != tuple(target[name].shape):
            raise ValueError(f"{name}: the Llama model's {tuple(tensor.shape)} is not the converted model's "
                             f"{tuple(target[name].shape)}")
    with torch.no_grad():
        for name, tensor in source.items():
            target[name].copy_(tensor)
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("tie_word_embeddings is set but lm_head does not share embed_tokens' weight")
    return model.eval()
