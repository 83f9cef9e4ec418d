"""The CuTe DSL runtime every SM90 kernel of the project shares (the indexer's and ``minimax_m3``'s).

It holds the DSL probe, the compile-once cache with its CUDA-graph capture guard, the TVM-FFI calling convention
every kernel launches through (torch tensors in, torch's current stream) and the SM count. Importing it never imports the DSL: the probe decides whether the kernels exist at all.
"""

from __future__ import annotations

import functools
import importlib.metadata
import threading

import torch

__all__ = [
    "dsl_available",
    "dsl_version",
    "sm_count",
    "compile_once",
    "compile_tvm_ffi",
    "compile_options",
    "make_tma_pipeline",
    "TVM_FFI_OPTIONS",
]

TVM_FFI_OPTIONS = "--enable-tvm-ffi"
"""Compiled functions take torch tensors directly and launch on torch's current stream: about 7 µs of host time per
call on the H200, where DLPack conversion per call took 130 µs and pre-built raw pointers through the DSL's own
executor 84 µs (docs/PERFORMANCE.md)."""

_lock = threading.Lock()
_compiled: dict = {}


@functools.cache
def dsl_version() -> str:
    # cached: a metadata lookup costs ~0.15 ms, and it is part of every compile key
    return importlib.metadata.version("nvidia-cutlass-dsl")


@functools.cache
def dsl_available() -> bool:
    """Whether the CuTe DSL and TVM-FFI import, so the SM90 kernels can be built and called."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception:  # both are optional at run time: the torch backends serve without them
        return False
    return True


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def compile_options(*extra: str) -> str:
    """The options every runtime compile passes, plus ``extra`` (the compile check adds its target and dump dir)."""
    return " ".join((TVM_FFI_OPTIONS, *extra))


def compile_once(key, compile_kernel):
    """``compile_kernel()``'s result for ``key`` on the current device (a module is loaded per device), built once.

    Raises inside CUDA-graph capture when the kernel is not compiled yet: compiling there would break the capture,
    so warm up (or ``plan()``) first."""
    key = (*key, dsl_version(), torch.cuda.current_device())
    compiled = _compiled.get(key)
    if compiled is not None:
        return compiled
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a CuTe kernel must be compiled before CUDA graph capture: run it once (warm-up) first")
    with _lock:
        if key not in _compiled:
            _compiled[key] = compile_kernel()
    return _compiled[key]


def compile_tvm_ffi(kernel, arguments, *extra_options: str):
    """``cute.compile`` under the TVM-FFI calling convention; returns the bare TVM-FFI function where the DSL
    exposes it (it skips the keyword-argument wrapper), else the compiled function."""
    import cutlass.cute as cute

    compiled = cute.compile(kernel, *arguments, options=compile_options(*extra_options))
    bare = getattr(compiled, "__tvm_ffi_object__", None)
    return bare() if bare is not None else compiled


def make_tma_pipeline(barriers, stages: int, stage_bytes: int, consumer_warps: int):
    """A TMA-filled shared-memory ring (trace time): one producer thread arms each stage with ``stage_bytes``,
    every consumer warp releases it."""
    import cutlass.pipeline as pipeline

    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=stage_bytes,
        defer_sync=True,
    )
