"""Constants of the Q8KV8 prefill indexer contract (docs/INDEXER.md)."""

from __future__ import annotations

import enum

import torch

PAGE_SIZE = 128
"""Tokens per KV page (MiniMax-M3 ``sparse_block_size``)."""

HEAD_DIM = 128
"""Index head dimension of MiniMax-M3."""

DEFAULT_TOPK = 16
"""Pages selected per (token, index head), the local page included."""

MAX_PAGES_PER_ROW = 65536
"""The top-k key keeps a page id in 16 bits, so a row may hold at most this many pages."""


SCORE_ALIGNMENT_COLUMNS = 4
"""Score columns (fp32) per 16 bytes, TMA's unit: the SM90 score kernel's TMA stores need a row pitch and a block's
first column that are multiples of it (docs/INDEXER.md)."""


def score_row_pitch(pages: int) -> int:
    """The row pitch (floats) of a score buffer for ``pages`` columns that the SM90 score kernel writes fastest:
    whole 16-byte units, so whole blocks of row maxima leave by TMA stores (docs/INDEXER.md)."""
    return -(-pages // SCORE_ALIGNMENT_COLUMNS) * SCORE_ALIGNMENT_COLUMNS


QUANT_LEVELS = 65534.0
"""Score range of a row is mapped onto ``[1.5, 65535.5)`` before truncation to 16 bits."""

QUANT_BIAS = 1.5

FP8_DTYPE = torch.float8_e4m3fn

KERNEL_NUM_HEADS = (1, 2, 4)
"""Index heads per rank served by the GPU kernel (M3 has 4 index heads: TP4 -> 1, TP2 -> 2, TP1 -> 4)."""

SCORE_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes of the torch backend; e4m3 scores are exact, the others accumulate in fp32."""

BACKENDS = ("auto", "torch", "cute")
PRECISIONS = ("auto", "fp8", "exact")


class ErrorWord(enum.IntEnum):
    """The int32 words of a plan's device-side error record (``TaskPlan.errors``), written without a sync and read by
    ``BatchPrefillIndexerQ8KV8Wrapper.check_errors()``; any non-zero word is an error."""

    PLAN = 0  # ``planner.PlanError`` bits: metadata that contradicts the plan's bounds (clamped)
    PAGE_ID = 1  # the score kernel met a block-table entry outside the K cache (it read page 0 instead)
    TOPK_ROW_LENGTH = 2  # the top-k met a num_valid_pages entry outside [1, score columns + 1] (clamped)


ERROR_WORDS = len(ErrorWord)
