import math
import struct
from fractions import Fraction

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.fp32_math import div_f32, fma_f32
from loop_reference import fmaf, round_to_f32

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_fma_resolves_double_rounding():
    # a * b = 1 + 2^-24 exactly: the midpoint between 1 and 1 + 2^-23. Adding 2^-80 puts the exact sum
    # just above the midpoint, but a float64 sum rounds back onto it and a second rounding to fp32
    # would give 1.0 (ties to even). The correctly rounded fmaf is 1 + 2^-23.
    a, b = 65281 * 2.0**-16, 257 * 2.0**-8
    assert Fraction(a) * Fraction(b) == 1 + Fraction(1, 2**24)
    naive = torch.tensor(a * b + 2.0**-80, dtype=torch.float64).float().item()
    assert naive == 1.0
    for c, expected in ((2.0**-80, 1 + 2.0**-23), (-(2.0**-80), 1.0), (0.0, 1.0)):
        got = fma_f32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c])).item()
        assert got == expected == fmaf(a, b, c)


def test_fma_negative_midpoint_and_magnitude_decrease():
    a, b = -65281 * 2.0**-16, 257 * 2.0**-8
    for c in (2.0**-80, -(2.0**-80)):
        got = fma_f32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c])).item()
        assert got == fmaf(a, b, c)


@settings(max_examples=400, deadline=None)
@given(finite_f32, finite_f32, finite_f32)
def test_fma_matches_exact_rational_rounding(a, b, c):
    got = fma_f32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c])).item()
    expected = fmaf(a, b, c)
    if math.isnan(got):
        assert False, f"NaN for finite inputs {a}, {b}, {c}"
    assert got == expected or (got == 0 and expected == 0)


@settings(max_examples=300, deadline=None)
@given(
    st.floats(min_value=-1e6, max_value=1e6, width=32),
    st.floats(min_value=2.0**-10, max_value=2.0**30, width=32),
    st.integers(min_value=-(2**20), max_value=2**20),
)
def test_fma_near_integer_boundaries(value, scale, offset):
    # quantisation-like operands: products of ~1e9 magnitude with small offsets, where rounding decides
    # which side of an integer the result lands on
    bias = f32(-value * scale + offset + 0.5)
    got = fma_f32(torch.tensor([value]), torch.tensor([scale]), torch.tensor([bias])).item()
    assert got == fmaf(value, scale, bias)


@settings(max_examples=300, deadline=None)
@given(finite_f32, finite_f32.filter(lambda x: x != 0))
def test_div_is_correctly_rounded(a, b):
    got = div_f32(torch.tensor([a]), torch.tensor([b])).item()
    assert got == round_to_f32(Fraction(a) / Fraction(b))


def test_fma_vectorised_and_constants():
    a = torch.randn(1000)
    b = torch.randn(1000) * 1e4
    out = fma_f32(a, b, 1.5)
    expected = [fmaf(x, y, 1.5) for x, y in zip(a.tolist(), b.tolist())]
    assert out.tolist() == expected
