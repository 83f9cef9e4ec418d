"""The inputs of a model's sparse attention layers during one forward, captured by hooks.

Indexer training (the KL target) and indexer recall both need what a sparse layer saw: its packed input ``x``
(after ``input_layernorm``), the rotary ``cos``/``sin`` and the forward's packed-token layout. From these the
layer's own methods recompute attention's q/k (``query_key_value``) and the indexer's q/k (``index_query_key``),
so no math of the model is re-typed here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List

import torch

__all__ = ["SparseLayerInput", "capture_sparse_layer_inputs", "sparse_attention_layers", "single_pass"]


@dataclass
class SparseLayerInput:
    attention: torch.nn.Module  # the layer's MiniMaxM3Attention
    x: torch.Tensor  # [T, hidden], packed tokens
    cos: torch.Tensor
    sin: torch.Tensor
    metadata: object  # minimax_m3.sparse_attention.ForwardMetadata

    @property
    def layer_index(self) -> int:
        return self.attention.layer_idx

    def sequences(self) -> Iterator[tuple]:
        """``(sequence, token slice, positions)`` per sequence of a fresh prefill (keys = the sequence's own tokens,
        at positions ``0 .. n-1`` in packed order)."""
        metadata = self.metadata
        for sequence, (start, count, kv_length) in enumerate(
                zip(metadata.query_starts, metadata.query_lengths, metadata.kv_lengths)):
            if count != kv_length:
                raise ValueError(f"sequence {sequence} has {kv_length - count} cached tokens: only fresh prefills "
                                 f"(no past_key_values) are supported")
            if count:
                yield sequence, slice(start, start + count), metadata.positions[start : start + count]


def sparse_attention_layers(model) -> list:
    """The ``MiniMaxM3Attention`` modules of the sparse layers of a ``MiniMaxM3ForCausalLM``, in order."""
    layers = [layer.self_attn for layer in model.model.layers if layer.self_attn.is_sparse]
    if not layers:
        raise ValueError("the model has no sparse attention layer (layer_types has no 'minimax_m3_sparse')")
    return layers


@contextlib.contextmanager
def capture_sparse_layer_inputs(model) -> Iterator[List[SparseLayerInput]]:
    """Within the block, every forward of a sparse attention layer appends a ``SparseLayerInput`` (inputs
    detached) to the yielded list. A forward that runs as query chunks (``max_score_buffer_bytes``) appends one
    per chunk; ``single_pass`` checks that it did not."""
    captured: List[SparseLayerInput] = []

    def record(module, args):
        x, cos, sin, _cache, metadata = args[:5]
        captured.append(SparseLayerInput(module, x.detach(), cos, sin, metadata))

    handles = [layer.register_forward_pre_hook(record) for layer in sparse_attention_layers(model)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def single_pass(model, captured: List[SparseLayerInput]) -> List[SparseLayerInput]:
    """``captured`` when it holds exactly one input per sparse layer (one forward, not query chunks)."""
    expected = len(sparse_attention_layers(model))
    if len(captured) != expected:
        raise ValueError(f"captured {len(captured)} sparse-layer inputs, expected {expected} (one forward in one pass; "
                         f"raise config.max_score_buffer_bytes if the forward ran in query chunks)")
    return captured

