import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import topk_select
from loop_reference import fmaf, loop_topk_row, round_to_f32


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def loop_select(scores: torch.Tensor, num_valid_pages: torch.Tensor, topk: int) -> list:
    return [loop_topk_row(row, int(n), topk) for row, n in zip(scores.tolist(), num_valid_pages.tolist())]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 90),
    topk=st.sampled_from([1, 2, 4, 16, 17]),
    magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_loop_reference_on_random_rows(rows, cols, topk, magnitude, seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, cols, generator=generator) * magnitude
    num_valid = torch.randint(1, cols + 2, (rows,), generator=generator, dtype=torch.int32)
    assert topk_select(scores, num_valid, topk=topk).tolist() == loop_select(scores, num_valid, topk)


def test_short_rows_are_identity_then_padding():
    scores = torch.full((3, 20), float("nan"))
    num_valid = torch.tensor([1, 7, 16], dtype=torch.int32)
    got = topk_select(scores, num_valid).tolist()
    assert got[0] == [0] + [-1] * 15
    assert got[1] == list(range(7)) + [-1] * 9
    assert got[2] == list(range(16))


def test_all_equal_scores_select_lowest_pages_then_local():
    scores = torch.zeros(2, 300)
    scores[1] = 3.25
    num_valid = torch.tensor([301, 40], dtype=torch.int32)
    got = topk_select(scores, num_valid).tolist()
    assert got[0] == list(range(15)) + [300]
    assert got[1] == list(range(15)) + [39]


def test_ties_go_to_the_lower_page_and_order_is_descending():
    row = [0.0] * 40
    for page in (30, 5, 17, 2):
        row[page] = 1.0
    row[8] = 2.0
    scores = torch.tensor([row])
    got = topk_select(scores, torch.tensor([41], dtype=torch.int32)).tolist()[0]
    assert got[:5] == [8, 2, 5, 17, 30]
    assert got[5:15] == [0, 1, 3, 4, 6, 7, 9, 10, 11, 12]
    assert got[15] == 40


def test_unread_columns_may_hold_garbage():
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 64, generator=generator)
    num_valid = torch.tensor([20, 33, 50, 65], dtype=torch.int32)
    poisoned = scores.clone()
    for row, n in enumerate(num_valid.tolist()):
        poisoned[row, n - 1 :] = float("nan")
        poisoned[row, n - 1 : n + 1] = float("inf")
    assert torch.equal(topk_select(scores, num_valid), topk_select(poisoned, num_valid))


def test_wide_pitch_and_out_buffer():
    generator = torch.Generator().manual_seed(4)
    base = torch.randn(6, 500, generator=generator)
    scores = base[:, :100]
    num_valid = torch.randint(1, 101, (6,), generator=generator, dtype=torch.int32)
    out = torch.full((6, 16), 12345, dtype=torch.int32)
    result = topk_select(scores, num_valid, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert out.tolist() == topk_select(scores.contiguous(), num_valid).tolist()


def test_quantised_value_below_zero_is_clamped():
    # A row whose spread is a few ulps of a large magnitude: bias loses the 1.5 and the smallest
    # scores land below zero before clamping.
    low = 1.0e6
    ulp = 2.0**-4  # ulp of 1e6 in fp32
    values = [low + ulp * (i % 4) for i in range(40)]
    spread = f32(max(values) - low)
    scale = round_to_f32(Fraction(65534) / Fraction(spread))
    bias = fmaf(-low, scale, 1.5)
    quantised = [fmaf(v, scale, bias) for v in values]
    assert min(quantised) < 0, "the case must exercise the clamp"
    scores = torch.tensor([values])
    got = topk_select(scores, torch.tensor([41], dtype=torch.int32)).tolist()
    assert got == loop_select(scores, torch.tensor([41]), 16)


def test_rounding_edge_rows_match_reference():
    # Scores a few ulps around values whose quantised level sits exactly on an integer boundary.
    rng = np.random.default_rng(7)
    rows = []
    for _ in range(200):
        low = float(np.float32(rng.uniform(-5, 5)))
        spread = float(np.float32(rng.choice([1.0, 3.0, 65534.0 / 1024, 2.0**-10])))
        base = [low, f32(low + spread)]
        base += [f32(low + spread * k / 65534) for k in rng.integers(0, 65535, 30)]
        base += [float(np.nextafter(np.float32(v), np.float32(np.inf))) for v in base[2:12]]
        rows.append(base[:40])
    scores = torch.tensor(rows, dtype=torch.float32)
    num_valid = torch.full((len(rows),), 41, dtype=torch.int32)
    assert topk_select(scores, num_valid).tolist() == loop_select(scores, num_valid, 16)


@pytest.mark.parametrize("topk", [1, 3, 16, 32])
def test_other_topk_values(topk):
    generator = torch.Generator().manual_seed(topk)
    scores = torch.randn(10, 80, generator=generator)
    num_valid = torch.randint(1, 81, (10,), generator=generator, dtype=torch.int32)
    got = topk_select(scores, num_valid, topk=topk)
    assert got.shape == (10, topk)
    assert got.tolist() == loop_select(scores, num_valid, topk)


def test_large_rows_up_to_the_page_limit():
    generator = torch.Generator().manual_seed(11)
    scores = torch.randn(2, 65535, generator=generator)
    num_valid = torch.tensor([65536, 9000], dtype=torch.int32)
    got = topk_select(scores, num_valid)
    expected = [loop_topk_row(scores[0].tolist(), 65536, 16), loop_topk_row(scores[1].tolist(), 9000, 16)]
    assert got.tolist() == expected
    assert math.isclose(scores[0, got[0, 0]].item(), scores[0, :65535].max().item(), rel_tol=1e-4)
