"""The GPU kernels as torch custom ops, so ``torch.compile`` graphs of a whole model forward can contain them.

``torch.ops.indexer.page_scores_sm90`` and ``torch.ops.indexer.topk_select16`` write into their output arguments
(declared in ``mutates_args``) and return nothing; their fake implementations do nothing, which is all a trace
needs. The wrapper's eager path calls the compiled kernels directly (a custom op's dispatch costs more host time
than the launch itself) and goes through these ops only while ``torch.compile`` traces it.
"""

from __future__ import annotations

import torch

from .cute_backend import ScoreKernelKey, TopkKernelKey, compiled_kernel

__all__ = ["page_scores_sm90", "topk_select16"]


@torch.library.custom_op("indexer::page_scores_sm90", mutates_args=("scores", "errors"))
def page_scores_sm90(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    scores: torch.Tensor,
    block_table: torch.Tensor,
    descriptors: torch.Tensor,
    num_tasks: torch.Tensor,
    errors: torch.Tensor,
    num_heads: int,
    exact: bool,
    tma_stores: bool,
    num_ctas: int,
    page_parallel: bool = False,
) -> None:
    """Scores of every planned task into ``scores`` (see ``PageScoreKernelSm90``): ``q`` ``[total_q, H, 128]``,
    ``k_pages`` ``[num_pages, 128, 128]``."""
    with torch.cuda.device(q.device):
        kernel = compiled_kernel(ScoreKernelKey(num_heads, exact, tma_stores, num_ctas, page_parallel))
    kernel(q, k_pages, scores, block_table, descriptors, num_tasks, errors)


@page_scores_sm90.register_fake
def _page_scores_sm90_fake(q, k_pages, scores, block_table, descriptors, num_tasks, errors, num_heads, exact,
                           tma_stores, num_ctas, page_parallel=False) -> None:
    return None


@torch.library.custom_op("indexer::topk_select16", mutates_args=("out", "errors"))
def topk_select16(scores: torch.Tensor, num_valid_pages: torch.Tensor, out: torch.Tensor, errors: torch.Tensor,
                  warps_per_row: int) -> None:
    """The forced-local-page top-16 of every row into ``out`` (see ``TopkSelectKernel``)."""
    with torch.cuda.device(scores.device):
        kernel = compiled_kernel(TopkKernelKey(warps_per_row))
    kernel(scores, num_valid_pages, out, errors)


@topk_select16.register_fake
def _topk_select16_fake(scores, num_valid_pages, out, errors, warps_per_row) -> None:
    return None
