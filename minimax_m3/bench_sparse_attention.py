"""The sparse-attention function alone at M3's attention geometry: ``python -m minimax_m3.bench_sparse_attention``.

One layer, one sequence: q ``[L, 64, 128]``, a K/V cache ``[1, L, 4, 128]`` (bf16), and two kinds of selections:
``clustered`` (a trained model's locality, ``bench_prefill.clustered_selection``) and ``random`` (the local page plus
15 uniform history pages per (token, KV group)). Times the CuTe kernel (page unions included, and each part alone),
FlexAttention (up to ``--flex-max-length``) and, as the baseline in the same run, dense SDPA of the same layer: CUDA
events, one warm-up, median of ``--repeats``. "useful" TFLOP/s count 16 pages x 128 keys per (token, head), QK and PV.
The kernel's work is counted in *warpgroup-pages* (``warpgroup_pages``); its time per warpgroup-page is the figure
to compare across selections. Needs an SM90 GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .command_line import add_output_arguments, checked_output_argument, positive_int, positive_ints, write_results
from .bench_prefill import clustered_selection
from .dense_attention import dense_attention
from .timing import median_cuda_ms
from .sparse_attention import ForwardMetadata, sparse_attention_flex
from .sparse_attention_cute import (UNION_TOKEN_SHIFT, attend_page_unions, cute_sparse_attention_supported,
                                    page_unions, sparse_attention_cute, union_tile_tokens)

PAGE, TOPK, HEADS, KV_HEADS, DIM = 128, 16, 64, 4, 128
TILE_TOKENS = union_tile_tokens(HEADS, KV_HEADS)
WARPGROUP_TOKENS = 64 // (HEADS // KV_HEADS)  # a consumer warpgroup's 64 accumulator rows


def random_selection(length: int, device) -> torch.Tensor:
    """``[length, KV_HEADS, TOPK]``: the local page plus up to 15 distinct uniform history pages (-1 padded)."""
    out = torch.empty(length, KV_HEADS, TOPK, dtype=torch.int32, device=device)
    pages = -(-length // PAGE)
    for begin in range(0, length, 8192):
        end = min(length, begin + 8192)
        local = torch.arange(begin, end, device=device) // PAGE
        draw = torch.rand(end - begin, KV_HEADS, pages, device=device)
        draw = torch.where(torch.arange(pages, device=device)[None, None] < local[:, None, None], draw, -1.0)
        values, indices = draw.topk(TOPK - 1, dim=-1)
        out[begin:end, :, : TOPK - 1] = torch.where(values >= 0, indices, -1).int()
        out[begin:end, :, TOPK - 1] = local[:, None].int()
    return out


def warpgroup_pages(union: torch.Tensor, count: torch.Tensor) -> dict:
    """Of ``page_unions``' output: the union pages over all tiles and KV groups, and the *warpgroup-pages*, each page
    counted once for every consumer warpgroup of the kernel (``WARPGROUP_TOKENS`` consecutive tokens of the tile) that
    selected it; the kernel's work follows the latter."""
    in_use = torch.arange(union.shape[-1], device=union.device) < count[..., None]
    token_bits = (union >> UNION_TOKEN_SHIFT) & ((1 << TILE_TOKENS) - 1)
    warpgroup_mask = (1 << WARPGROUP_TOKENS) - 1
    selected = sum(((token_bits >> first) & warpgroup_mask) != 0 for first in range(0, TILE_TOKENS, WARPGROUP_TOKENS))
    return {"union_pages": int(count.sum()), "warpgroup_pages": int((selected * in_use).sum())}


def bench(length: int, repeats: int, flex_max_length: int) -> list:
    device = "cuda"
    q = torch.randn(length, HEADS, DIM, device=device, dtype=torch.bfloat16)
    keys = torch.randn(1, length, KV_HEADS, DIM, device=device, dtype=torch.bfloat16)
    values = torch.randn(1, length, KV_HEADS, DIM, device=device, dtype=torch.bfloat16)
    metadata = ForwardMetadata(torch.zeros(length, dtype=torch.long, device=device), torch.arange(length, device=device),
                               [length], [length], [0])
    scale = DIM ** -0.5
    dense_ms = median_cuda_ms(lambda: dense_attention(q, keys, values, metadata, scale=scale), repeats)
    rows = []
    for name, selection in (("clustered", clustered_selection(length, KV_HEADS, TOPK, PAGE, device)),
                            ("random", random_selection(length, device))):
        build_unions = lambda: page_unions(selection, metadata.batch_index, length // PAGE, TILE_TOKENS)
        union, count = build_unions()
        cute_ms = median_cuda_ms(lambda: sparse_attention_cute(q, keys, values, selection, metadata, scale=scale, page_size=PAGE), repeats)
        unions_ms = median_cuda_ms(build_unions, repeats)
        out = torch.empty_like(q)
        own_slots = metadata.cache_slots(length)
        kernel_ms = median_cuda_ms(
            lambda: attend_page_unions(q, keys, values, union, count, own_slots, scale=scale, out=out), repeats)
        pages = warpgroup_pages(union, count)
        flex_ms = (median_cuda_ms(lambda: sparse_attention_flex(q, keys, values, selection, metadata, scale=scale, page_size=PAGE),
                              max(1, repeats // 2)) if length <= flex_max_length else None)
        useful_tflop = length * HEADS * TOPK * PAGE * DIM * 4 / 1e12
        tiles = -(-length // TILE_TOKENS)
        rows.append(dict(length=length, selection=name, mean_union_pages=pages["union_pages"] / (tiles * KV_HEADS),
                         warpgroup_pages=pages["warpgroup_pages"], unions_ms=unions_ms, kernel_ms=kernel_ms,
                         kernel_ns_per_warpgroup_page=kernel_ms * 1e6 / max(pages["warpgroup_pages"], 1), cute_ms=cute_ms,
                         flex_ms=flex_ms, dense_ms=dense_ms, cute_useful_tflops=useful_tflop / (cute_ms / 1e3),
                         dense_over_cute=dense_ms / cute_ms))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=positive_ints, default=[32768, 131072])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--flex-max-length", type=positive_int, default=32768,
                        help="longer lengths skip FlexAttention (slow)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    output = checked_output_argument(parser, args.output, args.overwrite)
    probe = torch.empty(1, HEADS, DIM, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    if not cute_sparse_attention_supported(probe, probe.new_empty(1, 1, KV_HEADS, DIM), PAGE):
        sys.exit("bench_sparse_attention needs an SM90 GPU (H100/H200) with nvidia-cutlass-dsl")
    rows = []
    for length in args.lengths:
        rows += bench(length, args.repeats, args.flex_max_length)
        write_results(output, rows, partial=True)
    write_results(output, rows, partial=False)
    print("\n| length | selection | mean union pages per tile | cute ms | of it: unions ms, kernel ms | kernel ns per "
          "warpgroup-page | FlexAttention ms | dense SDPA ms | cute useful TFLOP/s | dense / cute |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        flex = "-" if r["flex_ms"] is None else f"{r['flex_ms']:.2f}"
        print(f"| {r['length']} | {r['selection']} | {r['mean_union_pages']:.1f} | {r['cute_ms']:.2f} | "
              f"{r['unions_ms']:.2f}, {r['kernel_ms']:.2f} | {r['kernel_ns_per_warpgroup_page']:.1f} | {flex} | "
              f"{r['dense_ms']:.2f} | {r['cute_useful_tflops']:.0f} | {r['dense_over_cute']:.1f}x |")


if __name__ == "__main__":
    main()
