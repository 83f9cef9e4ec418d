"""The "1.5 quantisation steps" gate: is a selection acceptable for a row's reference scores?

A kernel whose scores differ from the exact reference by rounding cannot be expected to reproduce the
reference selection bit for bit: two pages whose scores lie within one quantisation step of each other
may swap. The gate accepts a selection when it is right up to that ambiguity (docs/INDEXER.md).
"""

from __future__ import annotations

import torch

from .contract import QUANT_LEVELS

__all__ = ["selection_gate", "GATE_STEPS"]

GATE_STEPS = 1.5
_ROW_CHUNK_ELEMENTS = 1 << 21


def selection_gate(
    selection: torch.Tensor,
    reference_scores: torch.Tensor,
    num_valid_pages: torch.Tensor,
    *,
    topk: int = 16,
    score_tolerance: torch.Tensor = None,
) -> torch.Tensor:
    """Per row, whether ``selection`` (``[rows, topk]`` int) passes the gate against ``reference_scores``.

    Rows with ``n <= topk`` valid pages must be exactly ``[0, .., n-1, -1, ..]``. Longer rows need the
    local page ``n - 1`` in the last slot, distinct history pages in the others whose reference scores
    are non-increasing within ``tol``, each at least the ``(topk-1)``-th best score minus ``tol``, and
    every page scoring above that threshold plus ``tol`` selected; ``tol = 1.5 (max - min) / 65534``
    over the row's history. ``score_tolerance`` (``[rows]``, optional) widens ``tol`` by twice the given
    per-row bound on the scores' error, for selections computed from approximate (e.g. FP8) scores.
    """
    rows = selection.shape[0]
    if tuple(selection.shape) != (rows, topk) or reference_scores.shape[0] != rows or num_valid_pages.shape[0] != rows:
        raise ValueError(
            f"selection [rows, topk={topk}], reference_scores [rows, cols] and num_valid_pages [rows] must agree, got "
            f"{tuple(selection.shape)}, {tuple(reference_scores.shape)}, {tuple(num_valid_pages.shape)}"
        )
    passed = torch.empty(rows, dtype=torch.bool, device=selection.device)
    chunk = max(1, _ROW_CHUNK_ELEMENTS // max(1, reference_scores.shape[1]))
    for begin in range(0, rows, chunk):
        end = min(rows, begin + chunk)
        passed[begin:end] = _gate_rows(
            selection[begin:end].to(torch.int64),
            reference_scores[begin:end],
            num_valid_pages[begin:end].to(torch.int64),
            topk,
            None if score_tolerance is None else score_tolerance[begin:end].to(torch.float64),
        )
    return passed


def _gate_rows(selection, scores, valid_pages, topk, score_tolerance):
    rows, cols = scores.shape
    device = scores.device
    slots = torch.arange(topk, device=device)
    short_expected = torch.where(slots[None, :] < valid_pages[:, None], slots[None, :], -1)
    short_ok = (selection == short_expected).all(dim=1)
    if topk == 1 or cols == 0:
        long_ok = selection[:, -1] == valid_pages - 1
        return torch.where(valid_pages > topk, long_ok, short_ok)

    history = valid_pages - 1
    columns = torch.arange(cols, device=device)
    in_history = columns[None, :] < history[:, None]
    exact = scores.to(torch.float64)
    low = torch.where(in_history, exact, torch.inf).amin(dim=1)
    high = torch.where(in_history, exact, -torch.inf).amax(dim=1)
    tolerance = GATE_STEPS * (high - low) / QUANT_LEVELS
    if score_tolerance is not None:
        tolerance = tolerance + 2 * score_tolerance

    picked = selection[:, : topk - 1]
    local_ok = selection[:, -1] == history
    range_ok = ((picked >= 0) & (picked < history[:, None])).all(dim=1)
    ordered = torch.sort(picked, dim=1).values
    distinct_ok = (ordered[:, 1:] != ordered[:, :-1]).all(dim=1)
    picked_scores = exact.gather(1, picked.clamp(0, cols - 1))
    order_ok = (picked_scores[:, 1:] <= picked_scores[:, :-1] + tolerance[:, None]).all(dim=1)

    masked = torch.where(in_history, exact, -torch.inf)
    k_best = min(topk - 1, cols)
    threshold = torch.topk(masked, k_best, dim=1).values[:, -1]
    floor_ok = (picked_scores >= (threshold - tolerance)[:, None]).all(dim=1)
    chosen = torch.zeros(rows, cols, dtype=torch.bool, device=device)
    chosen.scatter_(1, picked.clamp(0, cols - 1), True)
    must_have = in_history & (exact > (threshold + tolerance)[:, None])
    coverage_ok = ~(must_have & ~chosen).any(dim=1)
    long_ok = local_ok & range_ok & distinct_ok & order_ok & floor_ok & coverage_ok
    return torch.where(valid_pages > topk, long_ok, short_ok)
