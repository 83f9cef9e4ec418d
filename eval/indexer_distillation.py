"""Training the indexer to imitate attention: the KL objective MiniMax describes for MiniMax Sparse Attention.

Per sparse layer, query token and KV group (= index head), the target is the share of dense attention's
probability mass on each causal page (the group's query heads summed, normalised to 1:
``minimax_m3.sparse_attention.dense_attention_page_mass``), and the prediction the softmax over the indexer's
page scores of the same causal pages (``indexer.differentiable_page_scores``: history pages as the indexer
scores them, the local page over its causal keys). The loss is ``KL(target || prediction)`` averaged over rows.
Only the indexer's projections and norms receive gradients; the rest of the model runs dense and frozen.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from indexer import differentiable_page_scores
from minimax_m3.sparse_attention import dense_attention_page_mass

from .layer_inputs import SparseLayerInput, capture_sparse_layer_inputs, single_pass
from .modes import attention_mode

__all__ = ["INDEXER_PARAMETER_PREFIXES", "KL_PAGES", "indexer_parameter_names", "page_distribution_kl", "history_rows",
           "layer_distillation_kl", "indexer_distillation_loss"]

INDEXER_PARAMETER_PREFIXES = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")
KL_PAGES = ("causal", "history")


def indexer_parameter_names(model) -> List[str]:
    """Names of the indexer's parameters (projections and norms of every sparse layer)."""
    names = [name for name, _ in model.named_parameters()
             if any(f"self_attn.{prefix}." in name for prefix in INDEXER_PARAMETER_PREFIXES)]
    if not names:
        raise ValueError("the model has no indexer parameters (no sparse attention layer)")
    return names


def page_distribution_kl(index_scores: torch.Tensor, attention_mass: torch.Tensor,
                         pages: str = "causal") -> torch.Tensor:
    """``KL(attention_mass || softmax(index_scores))`` per row, over each row's causal pages: ``[rows...]``.

    ``index_scores`` ``[..., pages]`` are ``-inf`` exactly on the pages after a row's own page (as
    ``differentiable_page_scores`` returns them); ``attention_mass`` ``[..., pages]`` sums to 1 over the causal
    pages and is 0 after them. The terms of non-causal pages are excluded before any arithmetic can turn their
    ``0 * -inf`` into NaN, in the forward and the backward pass.

    ``pages="history"``: the same KL over the history pages alone, both distributions renormalised there. The
    selection always takes a row's own page, so only the history pages' order decides anything; a row without
    history pages gives 0 (``history_rows`` counts the others)."""
    if index_scores.shape != attention_mass.shape:
        raise ValueError(f"index_scores {tuple(index_scores.shape)} and attention_mass {tuple(attention_mass.shape)} "
                         f"must have the same shape")
    if pages not in KL_PAGES:
        raise ValueError(f"pages must be one of {KL_PAGES}, got {pages!r}")
    kept = torch.isfinite(index_scores)
    target = attention_mass
    if pages == "history":
        own_page = kept.sum(-1, keepdim=True) - 1
        kept = kept & (torch.arange(kept.shape[-1], device=kept.device) < own_page)
        target = target * kept
        total = target.sum(-1, keepdim=True)
        target = target / torch.where(total > 0, total, 1.0)
        # a row without history pages keeps one finite score, so its softmax stays finite; its terms are dropped
        index_scores = torch.where(kept | (own_page == 0), index_scores, float("-inf"))
    log_prediction = torch.log_softmax(index_scores, dim=-1)
    target = target.to(log_prediction.dtype)
    terms = torch.where(kept, torch.xlogy(target, target) - target * log_prediction, 0.0)
    return terms.sum(-1)


def history_rows(index_scores: torch.Tensor) -> int:
    """How many rows of ``index_scores`` (as ``page_distribution_kl`` takes them) have a history page."""
    return int((torch.isfinite(index_scores).sum(-1) > 1).sum())


def layer_distillation_kl(layer_input: SparseLayerInput, pages: str = "causal") -> torch.Tensor:
    """Mean KL over the (token, KV group) rows of one sparse layer's captured forward (``pages="history"``: over
    the rows that have history pages); differentiable in the layer's indexer parameters only (attention's q/k are
    recomputed without gradients)."""
    attention = layer_input.attention
    config = attention.config
    x, cos, sin = layer_input.x, layer_input.cos, layer_input.sin
    with torch.no_grad():
        q, k, _ = attention.query_key_value(x, cos, sin)
    index_q, index_k = attention.index_query_key(x, cos, sin)
    total, rows = None, 0
    for _, tokens, positions in layer_input.sequences():
        with torch.no_grad():
            mass = dense_attention_page_mass(q[tokens], k[tokens], positions, scale=attention.scale,
                                             page_size=config.index_block_size)
        scores = differentiable_page_scores(index_q[tokens], index_k[tokens], positions,
                                            page_size=config.index_block_size)
        kl = page_distribution_kl(scores, mass, pages).sum()
        total = kl if total is None else total + kl
        rows += history_rows(scores) if pages == "history" else scores.shape[0] * scores.shape[1]
    if total is None:
        raise ValueError("the forward held no tokens")
    return total / max(rows, 1)


def indexer_distillation_loss(model, input_ids: torch.Tensor,
                              pages: str = "causal") -> Tuple[torch.Tensor, Dict[int, float]]:
    """``(loss, {layer index: KL})``: the dense forward of ``input_ids`` ``[B, L]`` runs without gradients, with
    the sparse layers' inputs captured; the loss is the sum over sparse layers of their mean KL over ``pages``
    (``page_distribution_kl``; each layer's indexer parameters see only their own layer's term)."""
    with attention_mode(model, "dense"), capture_sparse_layer_inputs(model) as captured, torch.no_grad():
        model.model(input_ids=input_ids, use_cache=False)
    per_layer = {}
    loss = None
    for layer_input in single_pass(model, captured):
        kl = layer_distillation_kl(layer_input, pages)
        per_layer[layer_input.layer_index] = float(kl.detach())
        loss = kl if loss is None else loss + kl
    return loss, per_layer
