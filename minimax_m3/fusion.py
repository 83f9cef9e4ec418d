"""Compiled elementwise chains for inference on CUDA.

Eagerly each op of a chain (fp32 norms, SwiGLU, the experts' weighted sum) is a pass over ``[T, hidden]`` in fp32:
together about 25 % of a 128K-token prefill's kernel time; fused, the prefill takes 15 % less (H200). The math is
the same Python functions; training and CPU run them eagerly.

Chains over packed tokens are compiled per width and generic only in the token count. Compiled with every
dimension dynamic (``dynamic=True``), inductor cannot prove a row's width or stride divisible by 16 and loads
element by element: at real width and 128K tokens those chains took 1.2–5.9× the time of the same chains
specialised to their widths (norm and RoPE of the queries 15.2 against 2.6 ms on an H100; docs/PERFORMANCE.md).
"""

from __future__ import annotations

import logging
import types

import torch

__all__ = ["fuse", "compiled"]

logger = logging.getLogger(__name__)

_compiled_functions = {}


def fuse(x: torch.Tensor) -> bool:
    """Whether a chain on ``x`` runs compiled: inference on CUDA."""
    return x.device.type == "cuda" and not torch.is_grad_enabled()


def _inductor_options() -> dict:
    # Inductor otherwise times its reduction configs (block sizes, warps) on the device at the first call and keeps
    # the fastest, so two processes may sum a norm in different orders: logits one bf16 ulp apart, and pages of
    # near-tied scores swapped. Deterministic mode picks them from the shapes alone (torch >= 2.10).
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "deterministic"):
        logger.warning("torch %s's inductor has no deterministic mode: compiled norms may round differently from "
                       "one process to the next (torch >= 2.10 has it)", torch.__version__)
        return {}
    return {"deterministic": True}


def _signature(args) -> tuple:
    """What a compiled chain is specialised to: every tensor argument's dtype, device, sizes after the first and
    strides, and every other argument's value."""
    return tuple((arg.dtype, arg.device, tuple(arg.shape[1:]), arg.stride()) if isinstance(arg, torch.Tensor) else arg
                 for arg in args)


class _TokenDynamicChain:
    """``function`` compiled once per signature (``_signature``), each compilation generic in the first (token)
    dimension of its tensor arguments, so a new length does not recompile; a length of 1 gets its own kernels
    (torch specialises sizes 0 and 1). Each signature compiles its own copy of ``function``: torch keeps compiled
    graphs per code object and stops compiling one after ``recompile_limit`` (8) of them, and a model calls one
    chain at several widths, dtypes and devices."""

    def __init__(self, function):
        self.function = function
        self._by_signature = {}

    def __call__(self, *args):
        if torch.compiler.is_compiling():  # inside a compiled caller: traced into its graph
            return self.function(*args)
        signature = _signature(args)
        chain = self._by_signature.get(signature)
        if chain is None:
            function = self.function
            copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                                      function.__defaults__, function.__closure__)
            chain = self._by_signature[signature] = torch.compile(copy, dynamic=False, options=_inductor_options())
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() >= 1:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return chain(*args)

    def signatures(self) -> int:
        """How many signatures have been compiled."""
        return len(self._by_signature)


def compiled(name: str, function, *, tokens_first: bool = True):
    """``function`` compiled once per process, with the same kernels in every process. ``tokens_first``: the first
    dimension of every tensor argument counts tokens, and the chain is compiled per signature (widths, dtypes,
    devices; any number of tokens). Otherwise every dimension is dynamic: for chains over ``[B, H, tokens, D]``
    blocks (the split-KV merge of a chunk's attention), which would compile again for every chunk length."""
    if name not in _compiled_functions:
        _compiled_functions[name] = (_TokenDynamicChain(function) if tokens_first else
                                     torch.compile(function, dynamic=True, options=_inductor_options()))
    return _compiled_functions[name]
