"""Projections of one input held in one weight, so that a forward computes them in one GEMM.

A sparse layer projects its input five ways (q, k and v; the indexer's q and k) and an MLP two (gate and up). At
decode sizes a projection is bound by its kernel's launch and ramp, not by its bytes: 6144 -> 512 over 4 rows takes
7.6 µs for 6 MB of weight, which HBM delivers in 1.5 µs (docs/PERFORMANCE.md). One GEMM over the group's rows
costs about what its largest member does alone.

The modules and parameters keep the checkpoint's names: ``pack`` moves a group's weights into one storage, rows after
rows, and each ``nn.Linear`` keeps its parameter (same object, now a view of its rows), so ``state_dict``,
``save_pretrained`` (transformers clones disjoint views that share a storage), optimizers and tied references are
unaffected. ``ProjectionGroup`` takes the GEMM over the span of any run of consecutive members. It projects module
by module instead, the same products one at a time, where a gradient is recorded for the weights (each parameter
then gets its own), and where the weights are not packed: tensor-parallel shards, quantised, offloaded or hooked
modules, or weights replaced after packing; ``pack`` and the first such forward say so in the log.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch import nn

__all__ = ["ProjectionGroup", "pack"]

logger = logging.getLogger(__name__)


def _unpackable(linears: Sequence[nn.Module]) -> Optional[str]:
    """Why ``linears`` cannot share one weight storage, or None."""
    if any(type(linear) is not nn.Linear for linear in linears):
        return "a module is not a plain nn.Linear (quantised or adapted)"
    if any(linear.bias is not None for linear in linears):
        return "a projection has a bias"
    if any(linear._forward_hooks or linear._forward_pre_hooks or hasattr(linear, "_hf_hook") for linear in linears):
        return "a module has forward hooks (offloading or adapters)"
    weights = [linear.weight for linear in linears]
    if any(type(weight.data) is not torch.Tensor for weight in weights):
        return "a weight is a tensor subclass (a tensor-parallel shard or a quantised tensor)"
    first = weights[0]
    if any(weight.device != first.device or weight.dtype != first.dtype for weight in weights):
        return "the weights differ in device or dtype"
    if any(weight.dim() != 2 or weight.shape[1] != first.shape[1] for weight in weights):
        return "the weights differ in input width"
    return None


def _span(linears: Sequence[nn.Linear]) -> Optional[torch.Tensor]:
    """The ``[sum of out_features, in_features]`` weight the members' rows form where they lie back to back in one
    storage (no gradient), else None."""
    first = linears[0].weight
    columns = first.shape[1]
    storage = first.untyped_storage().data_ptr()
    expected = first.storage_offset()
    for linear in linears:
        weight = linear.weight
        if (type(weight.data) is not torch.Tensor or weight.dim() != 2 or weight.shape[1] != columns
                or weight.dtype != first.dtype or weight.device != first.device or weight.stride() != (columns, 1)
                or weight.untyped_storage().data_ptr() != storage or weight.storage_offset() != expected):
            return None
        expected += weight.shape[0] * columns
    rows = (expected - first.storage_offset()) // columns
    return first.detach().as_strided((rows, columns), (columns, 1))


def pack(linears: Sequence[nn.Linear]) -> Optional[str]:
    """Give ``linears`` (same input, no bias) one weight storage, in order: each parameter stays the same object and
    holds a view of its rows. Returns None, or why they were left as they are (nothing is changed then)."""
    reason = _unpackable(linears)
    if reason is not None:
        return reason
    if _span(linears) is not None:
        return None
    with torch.no_grad():
        span = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = span[start:start + rows]
        start += rows
    return None


class ProjectionGroup:
    """Modules of one owner, by attribute name, that project the same input: ``group(owner, x)`` is
    ``[getattr(owner, name)(x) for name in names]``, in one GEMM where the weights are packed (``pack``).

    The checks behind that choice cost tens of µs of host time, so their answer is kept per run of members, keyed by
    the members, their weights' addresses and whether they have hooks; ``pack`` forgets it (a move re-packs)."""

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)
        self._spans = {}  # run of names -> (key, span or None)

    def modules(self, owner: nn.Module) -> list:
        return [getattr(owner, name) for name in self.names]

    def pack(self, owner: nn.Module) -> Optional[str]:
        """``pack`` of this group's modules; None, or why they stay separate."""
        self._spans.clear()
        return pack(self.modules(owner))

    def __call__(self, owner: nn.Module, x: torch.Tensor, names: Optional[Sequence[str]] = None) -> list:
        """The projections of ``x`` by the members ``names`` (consecutive, in order; default all)."""
        names = self.names if names is None else tuple(names)
        members = [getattr(owner, name) for name in names]
        if torch.is_grad_enabled() and any(member.weight.requires_grad for member in members):
            return [member(x) for member in members]
        span = self._packed_span(owner, names, members)
        if span is None:
            return [member(x) for member in members]
        return list(nn.functional.linear(x, span).split([member.weight.shape[0] for member in members], dim=-1))

    def _packed_span(self, owner: nn.Module, names: tuple, members: list) -> Optional[torch.Tensor]:
        if _global_hooks():
            return None
        key = tuple((id(member), member.weight.data_ptr(), bool(member._forward_hooks or member._forward_pre_hooks))
                    for member in members)
        known = self._spans.get(names)
        if known is not None and known[0] == key:
            return known[1]
        reason = _unpackable(members)
        span = None if reason else _span(members)
        if span is None:
            _report_once(f"{type(owner).__name__} {'/'.join(names)}", reason or "replaced after packing")
        self._spans[names] = (key, span)
        return span


def _global_hooks() -> bool:
    """Forward hooks registered for every module (``nn.modules.module.register_module_forward_hook``)."""
    module = nn.modules.module
    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


_reported: set = set()


def _report_once(what: str, reason: str) -> None:
    if (what, reason) not in _reported:
        _reported.add((what, reason))
        logger.info("%s: weights not packed (%s); projected one module at a time", what, reason)
