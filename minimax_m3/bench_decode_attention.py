"""Decode attention at MiniMax-M3's geometry (64 query / 4 KV heads of 128, bf16), as a decode-step CUDA graph
replays it: ``python -m minimax_m3.bench_decode_attention`` (CUDA).

Dense: flash-decoding against SDPA with a length mask over the cache. Sparse (16 selected pages of 128 keys per
token and KV group, random, with the local page): the split-KV decode kernel against the page-union kernel the
prefill takes (whose tile of 8 tokens from 8 sequences walks a union of 8 x 16 pages in one CTA).

Per case (batch, context): the median of 50 graph replays after a 256 MiB L2 flush (CUDA events), the HBM floors of
reading the keys and values once (dense: the context; sparse: the selected pages) at 4.3 TB/s, and the largest
difference to an fp32 softmax over the first sequence's keys (dense) or to ``sparse_attention_reference`` (sparse).
"""

from __future__ import annotations

import argparse

import torch

from .decode_attention import flash_decode
from .dense_attention import decode_step_attention
from .sparse_attention import ForwardMetadata, sparse_attention_reference
from .sparse_attention_cute import sparse_attention_cute, sparse_union_attention_cute
from .timing import median_cuda_ms

CASES = ((1, 32768), (1, 131072), (16, 32768), (16, 131072))
HEADS, KV_HEADS, HEAD_DIM = 64, 4, 128
PAGE, TOPK = 128, 16
HBM_BYTES_PER_SECOND = 4.3e12


def graph_replay_us(fn, repeats: int = 50, flush_bytes: int = 256 << 20) -> float:
    """Median microseconds of replaying a CUDA graph of ``fn`` (captured after two warm-up calls on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_cuda_ms(graph.replay, repeats, flush_bytes) * 1e3


def run(cases=CASES) -> list:
    rows = []
    scale = HEAD_DIM ** -0.5
    for batch, context in cases:
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda").bfloat16()
        keys = torch.randn(batch, context, KV_HEADS, HEAD_DIM, device="cuda").bfloat16()
        values = torch.randn_like(keys)
        lengths = torch.full((batch,), context - 5, device="cuda", dtype=torch.int32)
        got = flash_decode(q, keys, values, lengths, scale=scale)[0].float().view(KV_HEADS, -1, HEAD_DIM)
        logits = torch.einsum("grd,kgd->grk", q[0].float().view(KV_HEADS, -1, HEAD_DIM), keys[0, : context - 5].float())
        expected = torch.einsum("grk,kgd->grd", torch.softmax(logits * scale, -1), values[0, : context - 5].float())
        rows.append({
            "batch": batch, "context": context,
            "flash_decode_us": graph_replay_us(lambda: flash_decode(q, keys, values, lengths, scale=scale)),
            "masked_sdpa_us": graph_replay_us(lambda: decode_step_attention(q, keys, values, lengths, scale=scale)),
            "floor_us": 2 * keys.numel() * keys.element_size() / HBM_BYTES_PER_SECOND * 1e6,
            "max_error": float((got - expected).abs().max()),
            **_sparse_case(q, keys, values, context - 5, scale),
        })
        del q, keys, values
    return rows


def random_decode_selection(batch: int, position: int) -> torch.Tensor:
    """``[batch, KV_HEADS, TOPK]`` int32: per token at ``position`` and KV group, its local page and 15 distinct
    random earlier pages."""
    local = position // PAGE
    history = torch.rand(batch, KV_HEADS, local, device="cuda").argsort(-1)[..., : TOPK - 1]
    return torch.cat([history, torch.full((batch, KV_HEADS, 1), local, device="cuda")], -1).to(torch.int32)


def _sparse_case(q, keys, values, length: int, scale: float) -> dict:
    batch = q.shape[0]
    position = length - 1
    metadata = ForwardMetadata(torch.arange(batch, device="cuda"), torch.full((batch,), position, device="cuda"),
                               [1] * batch, [length] * batch, list(range(batch)))
    selection = random_decode_selection(batch, position)
    got = sparse_attention_cute(q, keys, values, selection, metadata, scale=scale, page_size=PAGE)
    expected = sparse_attention_reference(q, keys, values, selection, metadata, scale=scale, page_size=PAGE)
    return {
        "sparse_decode_us": graph_replay_us(
            lambda: sparse_attention_cute(q, keys, values, selection, metadata, scale=scale, page_size=PAGE)),
        "sparse_union_us": graph_replay_us(
            lambda: sparse_union_attention_cute(q, keys, values, selection, metadata, scale=scale)),
        "sparse_floor_us": 2 * batch * KV_HEADS * TOPK * PAGE * HEAD_DIM * keys.element_size() / HBM_BYTES_PER_SECOND * 1e6,
        "sparse_max_error": float((got.float() - expected.float()).abs().max()),
    }


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention needs a CUDA GPU")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    rows = run()
    print("| batch | context | flash-decoding us | masked SDPA us | HBM floor us | max error vs fp32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']:,} | {r['flash_decode_us']:.1f} | {r['masked_sdpa_us']:.1f} | "
              f"{r['floor_us']:.1f} | {r['max_error']:.1e} |")
    print("\n| batch | context | sparse decode kernel us | page-union kernel us | HBM floor us | max error vs reference |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']:,} | {r['sparse_decode_us']:.1f} | {r['sparse_union_us']:.1f} | "
              f"{r['sparse_floor_us']:.2f} | {r['sparse_max_error']:.1e} |")


if __name__ == "__main__":
    main()
