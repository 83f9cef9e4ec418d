"""Differentiable page scores: the contract's score definition for training the indexer.

The contract (docs/INDEXER.md) scores page ``p`` of a (query token, index head) row with the maximum over the
page's keys of the raw dot product ``q . k``, for every complete history page ``p`` below the token's own
(local) page; the local page itself is forced into the selection and not scored. Training the indexer to imitate
attention (MiniMax's KL objective) needs a probability over *all* causal pages, so this function also scores the
local page, the same way but over its causal keys only (keys at positions ``<=`` the token's), and marks pages
after it ``-inf``. History-page values are the torch backend's (``compute_page_scores``): the same products in the
same accumulation dtype (``accumulation_dtype``), maximum per page.

Gradients flow through the maximum to the maximal key of each page (``torch.max`` over the page's keys). It
routes the gradient to one key where ``torch.amax`` would split it over tied keys, which is the same almost
everywhere, and it keeps only the winning key's index for the backward pass instead of the whole ``[tokens,
heads, keys]`` product block: memory stays bounded by the token chunk in the forward pass and by the
``[tokens, heads, pages]`` indices in the graph.
"""

from __future__ import annotations

import torch

from .contract import FP8_DTYPE
from .torch_backend import DEFAULT_CHUNK_ELEMENTS, accumulation_dtype
from .validation import check_host_int, check_tensor

__all__ = ["differentiable_page_scores", "causal_page_counts"]

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def causal_page_counts(positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Causal pages of each query token (its history pages and its own): ``position // page_size + 1``."""
    return torch.div(positions, page_size, rounding_mode="floor") + 1


def differentiable_page_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    *,
    page_size: int,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Page scores ``[T, H, pages]`` of the packed queries of one sequence, differentiable in ``q`` and ``k``.

    ``q`` is ``[T, H, D]`` (the H index heads of T query tokens), ``k`` ``[S, D]`` the sequence's index keys at
    positions ``0 .. S-1`` (one key head shared by the H index heads), ``positions`` ``[T]`` the query tokens'
    absolute positions (each in ``[0, S)``), ``pages = ceil(S / page_size)``. Entry ``[t, h, p]`` is
    ``max_j q[t, h] . k[j]`` over the keys ``j`` of page ``p`` with ``j <= positions[t]``, so: history pages
    (``p < positions[t] // page_size``) over all their keys, the local page over its causal keys, later pages
    ``-inf``.

    Dtypes: ``q`` and ``k`` share one of float64/float32/bfloat16/float16 (products accumulated in float64 for
    float64, else float32) or float8_e4m3fn (exact in float64, rounded once to float32 as the backend does; no
    gradient). The result is float64 for float64 inputs, else float32. At most ``chunk_elements`` dot products
    are materialised at once; one host synchronisation checks the positions.
    """
    if q.dtype not in _FLOAT_DTYPES + (FP8_DTYPE,):
        raise TypeError(f"q must have dtype float64, float32, bfloat16, float16 or float8_e4m3fn, got {q.dtype}")
    check_tensor("q", q, dtypes=(q.dtype,), ndim=3)
    check_tensor("k", k, dtypes=(q.dtype,), ndim=2, device=q.device)
    check_tensor("positions", positions, dtypes=(torch.int32, torch.int64), ndim=1, device=q.device)
    check_host_int("page_size", page_size, minimum=1)
    check_host_int("chunk_elements", chunk_elements, minimum=1)
    num_tokens, num_heads, head_dim = q.shape
    num_keys = k.shape[0]
    if k.shape[1] != head_dim:
        raise ValueError(f"k must be [S, {head_dim}] (the head dim of q), got {tuple(k.shape)}")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions must have shape [{num_tokens}] (one per query token), got {tuple(positions.shape)}")
    if num_keys == 0:
        raise ValueError("k must hold at least one key (the sequence's token at position 0)")
    if num_tokens:
        low, high = (int(v) for v in torch.aminmax(positions))
        if low < 0 or high >= num_keys:
            raise ValueError(f"positions must lie in [0, {num_keys}) (the keys of k), got values in [{low}, {high}]")

    compute = torch.float64 if q.dtype == torch.float64 else accumulation_dtype(q.dtype)
    result_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    num_pages = -(-num_keys // page_size)
    padded_keys = num_pages * page_size
    # keys beyond S are zeros, always masked: their index exceeds every position
    keys = torch.nn.functional.pad(k.to(compute), (0, 0, 0, padded_keys - num_keys))
    key_index = torch.arange(padded_keys, device=q.device)
    token_chunk = max(1, chunk_elements // (num_heads * padded_keys))
    chunks = []
    for begin in range(0, num_tokens, token_chunk):
        end = min(num_tokens, begin + token_chunk)
        products = q[begin:end].to(compute) @ keys.T  # [n, H, S_pad]
        # an added 0 / -inf mask keeps nothing for the backward pass (a masked_fill would keep the mask)
        causal = torch.zeros(end - begin, padded_keys, dtype=compute, device=q.device).masked_fill_(
            key_index[None, :] > positions[begin:end, None], float("-inf"))
        masked = products + causal[:, None, :]
        chunks.append(masked.view(end - begin, num_heads, num_pages, page_size).max(dim=-1).values)
    if not chunks:
        return torch.empty(0, num_heads, num_pages, dtype=result_dtype, device=q.device)
    return torch.cat(chunks).to(result_dtype)
