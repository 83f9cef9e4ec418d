"""Decode steps replayed as CUDA graphs: one graph per (static cache, batch size), captured at the first step.

``generate`` on CUDA runs every one-token step of a ``MiniMaxM3StaticCache`` through ``DecodeGraph`` (see
``MiniMaxM3ForCausalLM.prepare_inputs_for_generation``; ``decode_cuda_graphs=False`` keeps them eager). The graph
holds the whole model body (embedding to final norm) with every length on the device (``sparse_attention.
DecodeStep``): before each replay the host copies the new token ids and the cached lengths into the graph's input
buffers (pinned, asynchronous, no synchronisation); after it, the cache's host lengths advance by one.

The same step runs uncaptured on the CPU (``capture=False``), which is how its equality with the ordinary forward is
tested without a GPU.
"""

from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch

from .sparse_attention import STEP_SPARSE_ATTENTION, DecodeStep, ForwardMetadata, PageSelector, host_to_device

__all__ = ["DecodeGraph", "decode_graph_obstacle"]

logger = logging.getLogger(__name__)

GRAPH_EXPERTS = ("grouped_mm", "batched_mm")
"""Experts implementations without host synchronisation (the ``eager`` loop reads the chosen experts' ids)."""


def decode_graph_obstacle(config) -> Optional[str]:
    """Why a decode step of this config cannot be captured, or None."""
    if config.rope_type == "dynamic":
        return "a dynamic RoPE recomputes its frequencies from host lengths"
    if config._experts_implementation not in GRAPH_EXPERTS and "sparse" in config.mlp_layer_types:
        return f"experts_implementation={config._experts_implementation!r} synchronises (use one of {GRAPH_EXPERTS})"
    implementation = config.sparse_attention_implementation
    if implementation not in ("auto", *STEP_SPARSE_ATTENTION):
        return f"sparse_attention_implementation={implementation!r} reads host lengths (use 'auto' or {STEP_SPARSE_ATTENTION})"
    return None


class DecodeGraph:
    """One-token decode steps of ``model`` (a ``MiniMaxM3Model``) over one static ``cache``: the buffers, the step's
    own page selector and, with ``capture=True``, the CUDA graph."""

    def __init__(self, model, cache, *, capture: bool):
        if not cache.static or cache.batch_size is None:
            raise ValueError("decode graphs need a bound MiniMaxM3StaticCache (its tensors must never move)")
        self.model = model
        self._cache = weakref.ref(cache)  # the graph must not keep a finished generation's cache alive
        self.batch = cache.batch_size
        self.capture = capture
        self.graph = None
        device = model.embed_tokens.weight.device
        self.device = device
        self.input_ids = torch.zeros(self.batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.step = DecodeStep(
            kv_lengths=torch.ones(self.batch, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(self.batch + 1, dtype=torch.int32, device=device),
            capacity=cache.capacity,
            selector=PageSelector(model.config),
        )
        self.metadata = ForwardMetadata(
            batch_index=torch.arange(self.batch, device=device),
            positions=self.positions,
            query_lengths=[1] * self.batch,
            kv_lengths=[cache.capacity] * self.batch,  # bounds only: the step reads step.kv_lengths
            query_starts=list(range(self.batch)),
            step=self.step,
        )
        self.hidden: Optional[torch.Tensor] = None

    @property
    def cache(self):
        cache = self._cache()
        if cache is None:
            raise RuntimeError("the cache of this decode graph was freed")
        return cache

    def serves(self, cache) -> bool:
        return (self._cache() is cache and cache.batch_size == self.batch and cache.capacity == self.step.capacity
                and self.metadata.batch_index.device == self.device)

    def _body(self) -> torch.Tensor:
        """The captured work: lengths from the position buffer, then the model body on the token buffer."""
        self.step.kv_lengths.copy_(self.positions + 1)
        self.metadata.planned_devices.clear()  # the step's selector re-plans once per step (recorded once)
        self.metadata.derived.clear()  # and the shared per-forward tensors are recomputed from this step's buffers
        return self.model._decode_step_body(self.input_ids, self.cache, self.metadata)

    def _load_inputs(self, input_ids: torch.Tensor) -> None:
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.positions.copy_(host_to_device(torch.tensor(self.cache.lengths, dtype=torch.long), self.device),
                             non_blocking=True)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states ``[B, 1, hidden]`` of the step's tokens (a buffer the next step
        overwrites); the cache holds the new tokens afterwards."""
        if input_ids.shape != (self.batch, 1):
            raise ValueError(f"a decode step of this graph takes input_ids [{self.batch}, 1], got {tuple(input_ids.shape)}")
        if self.cache.capacity - max(self.cache.lengths) < 1:
            self.cache._grow(max(self.cache.lengths) + 1)  # a static cache raises, naming its capacity
        self._load_inputs(input_ids)
        if self.capture and self.graph is None:
            self._capture()
        if self.graph is None:
            hidden = self._body()
        else:
            self.graph.replay()
            hidden = self.hidden
        self.cache.advance([1] * self.batch, 1)
        return hidden

    def _capture(self) -> None:
        """Warm up on a side stream (compiles kernels, builds the plan and workspaces), then capture. Warm-up steps
        write this step's cache slots, which the replay writes again before any layer reads them."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body()
        current.wait_stream(side)
        if "torch" in self.step.selector.indexer_backends():
            # the indexer's torch backend reads each plan's lengths on the host (this geometry has no SM90 kernel)
            logger.warning("decode steps run uncaptured: the indexer's torch backend serves this geometry and "
                           "synchronises once per plan")
            self.capture = False
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.hidden = self._body()
        self.graph = graph
        logger.info("captured a CUDA graph of the decode step: batch %d, cache capacity %d", self.batch,
                    self.step.capacity)
