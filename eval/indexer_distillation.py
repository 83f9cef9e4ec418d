"""Training the indexer to imitate attention: the KL objective MiniMax describes for MiniMax Sparse Attention.

Per sparse layer, query token and KV group (= index head), the target is the share of dense attention's
probability mass on each causal page (the group's query heads summed, normalised to 1:
``minimax_m3.sparse_attention.dense_attention_page_mass``), and the prediction the softmax over the indexer's
page scores of the same causal pages (``indexer.differentiable_page_scores``: history pages as the indexer
scores them, the local page over its causal keys). The loss is ``KL(target || prediction)`` averaged over rows.
Only the indexer's projections and norms receive gradients; the rest of the model runs dense and frozen.

The ``"history"`` objective fits only what the selection reads: the top-k ranks the history pages and forces the
local page, and a row with at most ``topk - 1`` history pages selects them all. Per choosing row it takes the KL
between the history pages' share of the mass and the softmax over their index scores, weighted by the history's
mass (``history_page_kl``).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from indexer import differentiable_page_scores
from minimax_m3.sparse_attention import dense_attention_page_mass

from .layer_inputs import SparseLayerInput, capture_sparse_layer_inputs, single_pass
from .modes import attention_mode

__all__ = ["INDEXER_PARAMETER_PREFIXES", "OBJECTIVES", "indexer_parameter_names", "initialise_indexer_from_attention",
           "page_distribution_kl", "history_page_kl", "layer_distillation_kl", "indexer_distillation_loss"]

INDEXER_PARAMETER_PREFIXES = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")
OBJECTIVES = ("pages", "history")


def indexer_parameter_names(model) -> List[str]:
    """Names of the indexer's parameters (projections and norms of every sparse layer)."""
    names = [name for name, _ in model.named_parameters()
             if any(f"self_attn.{prefix}." in name for prefix in INDEXER_PARAMETER_PREFIXES)]
    if not names:
        raise ValueError("the model has no indexer parameters (no sparse attention layer)")
    return names


def initialise_indexer_from_attention(model) -> None:
    """Start every sparse layer's indexer from the layer's own attention: index head ``g`` projects as the mean of KV
    group ``g``'s query heads, the shared index key as the mean of the key heads, and the index norms scale by one.
    Before the norms, an index score is then the layer's attention logits averaged over a group's heads and its key
    heads: a start near what distillation imitates (docs/ACCURACY.md measured it against random projections). Index
    heads wider than attention's take attention's dimensions first, which the same rotary frequencies turn; their
    further (position-free) dimensions keep the values they had. Needs one index head per KV group, at least
    attention's head size."""
    config = model.config
    heads, groups, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    index_dim = config.index_head_dim
    if config.index_n_heads != groups or index_dim < head_dim:
        raise ValueError(f"an indexer started from attention needs one index head per KV group ({groups}) of at least "
                         f"the attention head size ({head_dim}), got {config.index_n_heads} index heads of {index_dim}")
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            if not attention.is_sparse:
                continue
            queries = attention.q_proj.weight.view(groups, heads // groups, head_dim, -1)
            keys = attention.k_proj.weight.view(groups, head_dim, -1)
            # in place: the parameters may be views of the layer's packed projection storage
            attention.index_q_proj.weight.view(groups, index_dim, -1)[:, :head_dim].copy_(queries.mean(1))
            attention.index_k_proj.weight[:head_dim].copy_(keys.mean(0))
            for norm in (attention.index_q_norm, attention.index_k_norm):
                norm.weight.fill_(1.0 - norm.offset)


def page_distribution_kl(index_scores: torch.Tensor, attention_mass: torch.Tensor) -> torch.Tensor:
    """``KL(attention_mass || softmax(index_scores))`` per row, over each row's causal pages: ``[rows...]``.

    ``index_scores`` ``[..., pages]`` are ``-inf`` exactly on the pages after a row's own page (as
    ``differentiable_page_scores`` returns them); ``attention_mass`` ``[..., pages]`` sums to 1 over the causal
    pages and is 0 after them. The terms of non-causal pages are excluded before any arithmetic can turn their
    ``0 * -inf`` into NaN, in the forward and the backward pass."""
    if index_scores.shape != attention_mass.shape:
        raise ValueError(f"index_scores {tuple(index_scores.shape)} and attention_mass {tuple(attention_mass.shape)} "
                         f"must have the same shape")
    causal = torch.isfinite(index_scores)
    log_prediction = torch.log_softmax(index_scores, dim=-1)
    target = attention_mass.to(log_prediction.dtype)
    terms = torch.where(causal, torch.xlogy(target, target) - target * log_prediction, 0.0)
    return terms.sum(-1)


def history_page_kl(index_scores: torch.Tensor, attention_mass: torch.Tensor, local_pages: torch.Tensor,
                    selected_history: int) -> torch.Tensor:
    """``h * KL(mass over history pages / h || softmax(index scores over history pages))`` per row ``[T, H]``, with
    ``h`` the row's attention mass on its history pages (pages before ``local_pages[t]``); 0 for rows with at most
    ``selected_history`` history pages, which the top-k takes whole.

    ``index_scores`` and ``attention_mass`` ``[T, H, pages]`` as ``page_distribution_kl`` takes them,
    ``local_pages`` ``[T]`` each token's own page. A row whose mass lies on its local page alone contributes 0."""
    if index_scores.shape != attention_mass.shape or index_scores.dim() != 3:
        raise ValueError(f"index_scores {tuple(index_scores.shape)} and attention_mass {tuple(attention_mass.shape)} "
                         f"must both be [tokens, heads, pages]")
    if local_pages.shape != index_scores.shape[:1]:
        raise ValueError(f"local_pages must be [{index_scores.shape[0]}] (one per token), got {tuple(local_pages.shape)}")
    page_ids = torch.arange(index_scores.shape[-1], device=index_scores.device)
    history = page_ids < local_pages[:, None, None]
    choosing = (local_pages > selected_history)[:, None, None]
    # rows that choose nothing get finite dummy scores, so no row's softmax is over -inf alone
    scores = torch.where(choosing, index_scores.masked_fill(~history, float("-inf")), 0.0)
    log_prediction = torch.log_softmax(scores, dim=-1)
    target = attention_mass.to(log_prediction.dtype)
    history_mass = torch.where(history, target, 0.0).sum(-1, keepdim=True)
    terms = torch.xlogy(target, target) - torch.xlogy(target, history_mass) - target * log_prediction
    return torch.where(history & choosing, terms, 0.0).sum(-1)


def layer_distillation_kl(layer_input: SparseLayerInput, objective: str = "pages") -> torch.Tensor:
    """Mean KL over the (token, KV group) rows of one sparse layer's captured forward; differentiable in the
    layer's indexer parameters only (attention's q/k are recomputed without gradients). ``objective`` ``"pages"``:
    ``page_distribution_kl`` over every row; ``"history"``: ``history_page_kl`` over the rows that choose (0 when
    none does)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
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
        if objective == "pages":
            kl = page_distribution_kl(scores, mass).sum()
            rows += scores.shape[0] * scores.shape[1]
        else:
            local_pages = positions // config.index_block_size
            kl = history_page_kl(scores, mass, local_pages, config.index_topk_blocks - 1).sum()
            rows += int((local_pages >= config.index_topk_blocks).sum()) * scores.shape[1]
        total = kl if total is None else total + kl
    if total is None:
        raise ValueError("the forward held no tokens")
    return total / max(rows, 1)


def indexer_distillation_loss(model, input_ids: torch.Tensor,
                               objective: str = "pages") -> Tuple[torch.Tensor, Dict[int, float]]:
    """``(loss, {layer index: KL})``: the dense forward of ``input_ids`` ``[B, L]`` runs without gradients, with
    the sparse layers' inputs captured; the loss is the sum over sparse layers of their mean KL by ``objective``
    (``layer_distillation_kl``; each layer's indexer parameters see only their own layer's term)."""
    with attention_mode(model, "dense"), capture_sparse_layer_inputs(model) as captured, torch.no_grad():
        model.model(input_ids=input_ids, use_cache=False)
    per_layer = {}
    loss = None
    for layer_input in single_pass(model, captured):
        kl = layer_distillation_kl(layer_input, objective)
        per_layer[layer_input.layer_index] = float(kl.detach())
        loss = kl if loss is None else loss + kl
    return loss, per_layer
