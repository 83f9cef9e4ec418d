"""Reductions over a list of DSL values as trees built at trace time (each call emits the instructions inline)."""

from __future__ import annotations

__all__ = ["pairwise_tree", "ternary_tree"]


def pairwise_tree(values: list, combine):
    """``combine`` over ``values`` as a balanced binary tree: depth log2(n) instead of a chain of n - 1."""
    while len(values) > 1:
        values = [combine(*values[i:i + 2]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


def ternary_tree(values: list, combine):
    """``combine`` over ``values`` as ``combine(combine(a, b), c)`` nodes: each node's inner result has one use, so
    ptxas fuses the pair into one three-input instruction (``VIMNMX3`` for int32 min/max on sm_90)."""
    while len(values) > 1:
        reduced = []
        for i in range(0, len(values), 3):
            node = values[i]
            for value in values[i + 1:i + 3]:
                node = combine(node, value)
            reduced.append(node)
        values = reduced
    return values[0]
