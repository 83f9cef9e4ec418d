"""The GPU kernels as torch custom ops, so ``torch.compile`` graphs can contain them.

``torch.ops.indexer.page_scores_sm90`` and ``torch.ops.indexer.topk_select16`` write into their output
argument (declared in ``mutates_args``) and return nothing; their fake implementations do nothing, which
is all a trace needs. The wrapper calls the kernels through these ops.
"""

from __future__ import annotations

import torch

__all__ = ["page_scores_sm90", "topk_select16"]


@torch.library.custom_op("indexer::page_scores_sm90", mutates_args=("scores",))
def page_scores_sm90(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    scores: torch.Tensor,
    block_table: torch.Tensor,
    descriptors: torch.Tensor,
    num_tasks: torch.Tensor,
    num_heads: int,
    tile_rows: int,
    exact: bool,
) -> None:
    """Scores of every planned task into ``scores`` (see ``PageScoreKernelSm90``); ``tile_rows`` is the
    plan's, ``exact`` selects the bf16 variant."""
    from .cute_backend import PageScoreRunner

    PageScoreRunner(num_heads, q.device, tile_rows, exact)(q, k_pages, scores, block_table, descriptors, num_tasks)


@page_scores_sm90.register_fake
def _page_scores_sm90_fake(q, k_pages, scores, block_table, descriptors, num_tasks, num_heads, tile_rows, exact) -> None:
    return None


@torch.library.custom_op("indexer::topk_select16", mutates_args=("out",))
def topk_select16(scores: torch.Tensor, num_valid_pages: torch.Tensor, out: torch.Tensor) -> None:
    """The forced-local-page top-16 of every row into ``out`` (see ``TopkSelectKernel``)."""
    from .cute_backend import run_topk_select

    run_topk_select(scores, num_valid_pages, out)


@topk_select16.register_fake
def _topk_select16_fake(scores, num_valid_pages, out) -> None:
    return None
