"""Independent branches of a layer on two CUDA streams while a CUDA graph is captured.

A decode step is hundreds of small kernels, most of them far from the GPU's limits: a projection of a few rows
reads its weight on a fraction of the SMs, a top-k over four rows runs one CTA. Kernels of one stream still run one
after another, so such a step costs the sum of their latencies. Inside a captured graph, work forked onto a second
stream becomes a parallel branch of the graph, and its kernels share the GPU with the main stream's. Serving engines
overlap the same branches (vLLM and SGLang run a MoE's shared expert on a second stream beside the routed experts).

Only captured work forks: eagerly the host launches slower than such kernels run, so a fork gains nothing there and
would make every eager forward pay for stream switches. Each branch runs the same kernels on the same inputs either
way, so the results are the same bit for bit.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

import torch

__all__ = ["run_branches", "side_stream"]

logger = logging.getLogger(__name__)

Side = TypeVar("Side")
Main = TypeVar("Main")

_side_streams: dict = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of ``device``, one per device and process (created outside capture: see ``run_branches``)."""
    device = torch.device(device)
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def run_branches(side: Callable[[], Side], main: Callable[[], Main], device: torch.device) -> tuple[Side, Main]:
    """``(side(), main())``: two branches that share no state they write. While the current CUDA stream is being
    captured, ``side`` is enqueued on the device's second stream after everything queued so far, and the current
    stream waits for it before anything enqueued after this call; otherwise both run in order on the current stream.

    Both branches' inputs must stay referenced until this returns (the caller's arguments are): a tensor freed
    while the other stream may still read it could be handed out again by the caching allocator."""
    device = torch.device(device)
    if device.type != "cuda":
        return side(), main()
    if not torch.cuda.is_current_stream_capturing():
        side_stream(device)  # created here, on an eager call (the warm-up before a capture), never inside a capture
        return side(), main()
    second = _side_streams.get(device)
    if second is None:
        logger.warning("no side stream for %s was created before this CUDA graph capture (run the forward once "
                       "eagerly first); its branches are captured in order", device)
        return side(), main()
    current = torch.cuda.current_stream(device)
    second.wait_stream(current)
    with torch.cuda.stream(second):
        side_result = side()
    main_result = main()
    current.wait_stream(second)
    return side_result, main_result
