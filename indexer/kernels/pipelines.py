"""Shared-memory pipelines the SM90 kernels (the indexer's and the model's) build the same way."""

from __future__ import annotations

import cutlass.pipeline as pipeline

__all__ = ["make_tma_pipeline"]


def make_tma_pipeline(barriers, stages: int, stage_bytes: int, consumer_warps: int):
    """A TMA-filled ring: one producer thread arms each stage with ``stage_bytes``, every consumer warp releases it."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=stage_bytes,
        defer_sync=True,
    )
