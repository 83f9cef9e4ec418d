"""A deliberately simple, loop-by-loop reference of the indexer contract.

It shares no code with the ``indexer`` package: scores are numpy float64 dot products per (row, page)
(exact for e4m3 inputs), and the top-k is plain Python with exact rational arithmetic for ``fmaf``.
Slow on purpose; only for small test cases.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

FLT_MAX = Fraction((2**24 - 1) * 2**104)


def round_to_f32(x: Fraction) -> float:
    """Round an exact rational to the nearest binary32 value, ties to even (IEEE default)."""
    if x == 0:
        return 0.0
    sign = -1.0 if x < 0 else 1.0
    magnitude = abs(x)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    exponent = max(exponent, -126)  # subnormals share the quantum of the smallest normal binade
    quantum = Fraction(2) ** (exponent - 23)
    scaled = magnitude / quantum
    whole = scaled.numerator // scaled.denominator
    remainder = scaled - whole
    if remainder > Fraction(1, 2) or (remainder == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    value = whole * quantum
    if value > FLT_MAX:
        return sign * math.inf
    return sign * float(value)


def fmaf(a: float, b: float, c: float) -> float:
    return round_to_f32(Fraction(a) * Fraction(b) + Fraction(c))


def loop_topk_row(history: list, num_valid: int, topk: int) -> list:
    """The contract's selection for one row; ``history`` holds at least ``num_valid - 1`` fp32 scores."""
    if num_valid <= topk:
        return list(range(num_valid)) + [-1] * (topk - num_valid)
    values = [float(v) for v in history[: num_valid - 1]]
    low, high = min(values), max(values)
    spread = round_to_f32(Fraction(high) - Fraction(low))
    if spread == 0 or math.isinf(spread):
        scale = 0.0
    else:
        scale = round_to_f32(Fraction(65534) / Fraction(spread))
        if math.isinf(scale):
            scale = 0.0
    bias = fmaf(-low, scale, 1.5)
    keys = []
    for page, value in enumerate(values):
        quantised = fmaf(value, scale, bias)
        level = 65535 if quantised >= 65535 else max(0, math.trunc(quantised))
        keys.append((level << 16) | (~page & 0xFFFF))
    best = sorted(keys, reverse=True)[: topk - 1]
    return [(~key) & 0xFFFF for key in best] + [num_valid - 1]


def loop_case(q, k_cache, cu_seqlens_q, seq_lens, block_table, *, page_size, topk):
    """Scores, num_valid_pages and selection of a whole batch.

    ``q`` ``[total_q, H, D]`` and ``k_cache`` ``[num_pages, page_size, D]`` are numpy float64 arrays of
    the input values; the metadata are Python lists. Returns ``(scores, num_valid_pages, selection)``
    with ``scores`` a dict ``{(row, page): np.float32}`` holding exactly the entries the contract writes.
    """
    total_q, num_heads, _ = q.shape
    scores = {}
    num_valid_pages = [0] * (total_q * num_heads)
    selection = [None] * (total_q * num_heads)
    for request in range(len(seq_lens)):
        q_begin, q_end = cu_seqlens_q[request], cu_seqlens_q[request + 1]
        q_len = q_end - q_begin
        for i in range(q_len):
            token = q_begin + i
            position = seq_lens[request] - q_len + i
            local_page = position // page_size
            for head in range(num_heads):
                row = token * num_heads + head
                num_valid_pages[row] = local_page + 1
                history = []
                for page in range(local_page):
                    keys = k_cache[block_table[request][page]]
                    # float64 dot products of e4m3 values are exact in any summation order
                    best = float((keys @ q[token, head]).max())
                    scores[(row, page)] = np.float32(best)
                    history.append(np.float32(best))
                selection[row] = loop_topk_row(history, local_page + 1, topk)
    return scores, num_valid_pages, selection
