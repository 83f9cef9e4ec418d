"""Q8KV8 paged prefill indexer for MiniMax-M3 sparse attention (contract: docs/INDEXER.md).

Scores every complete history page of every (query token, index head) row with the max over the
page's keys of the raw fp32 dot product, and selects ``topk`` pages per row with the local page
forced in. The torch backend is exact and runs anywhere; the SM90 CuTe DSL kernel is a separate
backend chosen by ``backend="auto"`` where it fits. ``differentiable_page_scores`` is the same score definition
under autograd, for training the indexer.
"""

from .contract import DEFAULT_TOPK, HEAD_DIM, MAX_PAGES_PER_ROW, PAGE_SIZE, score_row_pitch
from .differentiable_scores import causal_page_counts, differentiable_page_scores
from .selection_gate import selection_gate
from .topk import topk_select
from .wrapper import BatchPrefillIndexerQ8KV8Wrapper

__all__ = [
    "BatchPrefillIndexerQ8KV8Wrapper",
    "topk_select",
    "selection_gate",
    "differentiable_page_scores",
    "causal_page_counts",
    "PAGE_SIZE",
    "HEAD_DIM",
    "DEFAULT_TOPK",
    "MAX_PAGES_PER_ROW",
    "score_row_pitch",
]
