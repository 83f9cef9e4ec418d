"""Compile the model's CuTe DSL kernels (SM90 sparse attention: prefill and split-KV decode; the decode step's
grouped GEMV of the experts and the router, its routing, and its attention inputs' norms, RoPE and cache writes) for sm_90a
without a GPU: ``python -m minimax_m3.compile_check``.

Prints the wgmma kinds in their PTX (``bf16.bf16``) and, when ``ptxas`` is on PATH, registers and spills; exits
non-zero on a compile failure, spills, serialised wgmmas or a setmaxnreg budget beyond the launch allocation.
"""

from __future__ import annotations

import sys

from indexer.compile_check import run_compile_check


def variants():
    from .kernels.decode_routing_sm90 import DecodeRoutingSm90
    from .kernels.grouped_gemv_sm90 import CONFIGURATIONS, GroupedGemvSm90
    from .kernels.qk_norm_rope_sm90 import QkNormRopeSm90
    from .kernels.signatures import (decode_routing_arguments, grouped_gemv_arguments, qk_norm_rope_arguments,
                                     sparse_attention_fake_arguments, sparse_decode_attention_arguments)
    from .kernels.sparse_attention_sm90 import SparseAttentionSm90

    yield ("sparse_attention_sm90_g16", SparseAttentionSm90(16), sparse_attention_fake_arguments(), "bf16.bf16")
    yield ("sparse_decode_attention_sm90_g16", SparseAttentionSm90(16, decode=True), sparse_decode_attention_arguments(),
           "bf16.bf16")
    for name, configuration in CONFIGURATIONS.items():
        yield (f"grouped_gemv_sm90_{name}", GroupedGemvSm90(**configuration), grouped_gemv_arguments(name), None)
        if name != "router":  # the experts' first projection reads the tokens through the pairs' row index
            yield (f"grouped_gemv_sm90_{name}_indexed", GroupedGemvSm90(**configuration),
                   grouped_gemv_arguments(name, indexed=True), None)
    # M3's routing: top-4 (of 128 experts; the presets' 4 take top-2)
    yield ("decode_routing_sm90_top4", DecodeRoutingSm90(4), decode_routing_arguments(4), None)
    yield ("decode_routing_sm90_top2", DecodeRoutingSm90(2), decode_routing_arguments(2), None)
    # M3's attention geometry: 64 query and 4 KV heads of 128, 64 rotated dims, Gemma's norm
    yield ("qk_norm_rope_sm90", QkNormRopeSm90(64, 4, 128, 32, 1.0), qk_norm_rope_arguments(), None)
    # its index path: 4 index query heads and one index key head of 128, e4m3 outputs
    yield ("qk_norm_rope_sm90_index", QkNormRopeSm90(4, 1, 128, 32, 1.0, with_values=False, index_cast=True),
           qk_norm_rope_arguments(4, 1, 128, 32, with_values=False, index_cast=True), None)


def main(argv=None) -> int:
    return run_compile_check(variants(), __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
