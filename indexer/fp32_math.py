"""Correctly rounded fp32 arithmetic on any torch device.

The top-k contract is written in terms of C's ``fmaf`` and fp32 division. torch has neither a fused
multiply-add nor a guarantee about how a device evaluates a compound fp32 expression, so both are
emulated here in float64 with arguments that make the result bit-exact everywhere:

* Division and subtraction: for ``p = 53 >= 2 * 24 + 2`` the float64 result of one operation on two
  fp32 operands, rounded to fp32, is the correctly rounded fp32 result (double rounding is innocuous
  for +, -, *, / and sqrt when the wide format has at least 2p + 2 bits).
* ``fmaf(a, b, c)``: ``a * b`` of two fp32 values has at most 48 significant bits, so it is exact in
  float64. The sum ``a * b + c`` is then rounded *to odd* in float64 (the nearest float64 plus one
  ulp toward the exact value when the float64 sum is inexact and its last bit is even); rounding a
  round-to-odd value with 53 >= 24 + 2 bits to fp32 gives the correctly rounded fp32 of the exact sum
  (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding
  to odd", IEEE TC 2008). The exact error of the float64 sum comes from Knuth's branch-free TwoSum.
"""

from __future__ import annotations

import struct

import torch

__all__ = ["div_f32", "fma_f32", "round_to_odd_sum_f64"]


def round_to_odd_sum_f64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` for float64 tensors, rounded to odd instead of to nearest."""
    total = a + b
    # Knuth TwoSum: exact error of the rounded sum, no branch on |a| >= |b|.
    b_virtual = total - a
    a_virtual = total - b_virtual
    error = (a - a_virtual) + (b - b_virtual)
    bits = total.view(torch.int64)
    needs_odd = (error != 0) & ((bits & 1) == 0)
    # IEEE floats are sign-magnitude: +1 on the bit pattern moves away from zero.
    away_from_zero = (error > 0) == (total > 0)
    step = torch.where(away_from_zero, 1, -1).to(torch.int64)
    bits = torch.where(needs_odd, bits + step, bits)
    return bits.view(torch.float64)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """C's ``fmaf(a, b, c)`` elementwise (one rounding), for fp32 tensors or Python floats."""
    like = _first_tensor(a, b, c)
    product = _as_f64(a, like) * _as_f64(b, like)  # exact: 24 x 24 significant bits
    addend = _as_f64(c, like)
    product, addend = torch.broadcast_tensors(product, addend)
    return round_to_odd_sum_f64(product, addend).to(torch.float32)


def div_f32(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 division ``numerator / denominator``, correctly rounded."""
    like = _first_tensor(numerator, denominator)
    return (_as_f64(numerator, like) / _as_f64(denominator, like)).to(torch.float32)


def _first_tensor(*values) -> torch.Tensor:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError("at least one operand must be a torch.float32 tensor")


def _as_f64(x, like: torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float32:
            raise TypeError(f"expected a torch.float32 tensor, got {x.dtype}")
        return x.to(torch.float64)
    if struct.unpack("f", struct.pack("f", float(x)))[0] != float(x):
        raise ValueError(f"constant {x!r} is not exactly representable in fp32")
    # a fill kernel, not a host-to-device copy: keeps the top-k capturable in CUDA graphs
    return torch.full((), float(x), dtype=torch.float64, device=like.device)
