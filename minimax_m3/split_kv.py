"""The merge of split-KV attention: each split of a query row's keys gives a row normalised over the split and its
log-sum-exp; the row over all keys is their average weighted by ``exp(lse)``. Used by the dense decode path
(``decode_attention.flash_decode``) and the chunked prefill over a long prefix; the sparse decode kernel merges its
splits itself, by the same rule."""

from __future__ import annotations

import torch

from .fusion import compiled, fuse

__all__ = ["merge_split_outputs", "merge_two_splits"]


def _merge(partial: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, valid=None):
    """The merged rows in ``dtype`` and their log-sum-exp over every split (fp32; ``-inf`` for a row no split saw)."""
    lse = lse.float()
    if valid is not None:
        lse = torch.where(valid.view(*valid.shape, *([1] * (lse.dim() - 2))) > 0, lse, float("-inf"))
    top = lse.amax(1, keepdim=True)
    top = torch.where(top == float("-inf"), 0.0, top)  # a row no split saw: every weight 0, output 0
    weights = torch.exp(lse - top)  # [N, S, H]
    total = weights.sum(1)
    merged = (partial.float() * weights[..., None]).sum(1)
    return (merged / torch.where(total > 0, total, 1.0)[..., None]).to(dtype), top[:, 0] + torch.log(total)


def merge_split_outputs(partial: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype,
                        valid: torch.Tensor = None) -> torch.Tensor:
    """``partial [N, S, *heads, D]`` (rows normalised over each of ``S`` splits, any float dtype, any strides) and
    ``lse [N, S, *heads]`` (natural log-sum-exp per split row, ``-inf`` for a split without keys; ``valid [N, S]``
    zero marks more such splits, e.g. their key counts) -> ``[N, *heads, D]`` in ``dtype``, fp32 math (compiled on CUDA)."""
    merge = compiled("merge_split_outputs", _merge) if fuse(partial) else _merge
    return merge(partial, lse, dtype, valid)[0]


def _merge_two(output, lse, other, other_lse):
    return _merge(torch.stack([output.float(), other.float()], 1), torch.stack([lse, other_lse], 1), torch.float32)


def merge_two_splits(output: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor):
    """Two splits of the same rows' keys, each ``[*rows, D]`` normalised over its split with its natural log-sum-exp
    ``[*rows]`` (any float dtypes and strides): ``(rows normalised over both, their log-sum-exp)`` in fp32. Merging
    the splits one at a time into a running pair keeps two splits in memory, not all of them (compiled on CUDA)."""
    merge = compiled("merge_two_splits", _merge_two, tokens_first=False) if fuse(other) else _merge_two
    return merge(output, lse, other, other_lse)
