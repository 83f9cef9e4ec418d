"""Prefill time and peak memory at MiniMax-M3's attention geometry: ``python -m minimax_m3.bench_prefill``.

A model with M3's attention geometry (hidden 6144, 64 query / 4 KV heads of 128, the real indexer: 4 index heads
of 128, pages of 128, top-16) and random bf16 weights: one dense layer and ``--sparse-layers`` sparse layers with a
tiny MoE. One sequence per length; modes: ``sparse`` (indexer ``backend="auto"``), ``dense`` (every layer full
attention) and ``native`` (transformers' ``MiniMaxM3VLForCausalLM`` with the same geometry, when installed).
Reports median prefill time over ``--repeats`` (CUDA events, after a warm-up) and peak memory; an OOM is reported
as OOM. ``--attention-only`` times one sparse layer's attention (indexer + top-k + sparse attention) against the
same layer in dense mode, the issue's 128K comparison. Prints a table; ``--output`` writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys

import torch

from . import MiniMaxM3Config, MiniMaxM3ForCausalLM
from .command_line import add_output_arguments, checked_output_argument, positive_int, positive_ints, write_results
from .configuration_minimax_m3 import SPARSE_ATTENTION
from .sparse_attention import SPARSE_ATTENTION_FUNCTIONS
from .timing import timed_seconds


REAL_MOE = dict(intermediate_size=3072, dense_intermediate_size=12288, shared_intermediate_size=3072,
                num_local_experts=128, num_experts_per_tok=4)
"""MiniMax-M3's MLP widths: 128 routed experts of 3072 (top-4) plus a shared expert of 3072; dense MLP 12288."""


def geometry_config(sparse_layers: int, *, tiny: bool, real_moe: bool = False, dense_layers: int = 1,
                    **overrides) -> MiniMaxM3Config:
    """M3's attention geometry with a tiny MoE (the attention is what is measured), or with M3's real MLP widths
    (``real_moe``: what a layer of the released model computes); ``dense_layers`` full-attention layers with dense
    MLPs first (M3 has 3, then 57 sparse layers)."""
    layers = dense_layers + sparse_layers
    kinds = [0] * dense_layers + [1] * sparse_layers
    if tiny:  # CPU smoke runs: small everything, the contract's page/top-k shape kept
        values = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
                      sparse_attention_config={"sparse_attention_freq": kinds, "sparse_num_index_heads": 2,
                                               "sparse_index_dim": 32, "sparse_block_size": 16, "sparse_topk_blocks": 4,
                                               "sparse_init_block": 0, "sparse_local_block": 1})
    else:
        values = dict(hidden_size=6144, num_attention_heads=64, num_key_value_heads=4, head_dim=128, rotary_dim=64,
                      sparse_attention_config={"sparse_attention_freq": kinds, "sparse_num_index_heads": 4,
                                               "sparse_index_dim": 128, "sparse_block_size": 128, "sparse_topk_blocks": 16,
                                               "sparse_init_block": 0, "sparse_local_block": 1})
    # A tiny MoE (the attention is what is measured), run by transformers' grouped_mm experts (the default): no
    # per-expert host synchronisations, which dominated short prefills with the older per-expert loop (H200).
    values.update(
        vocab_size=1024, num_hidden_layers=layers, intermediate_size=256, dense_intermediate_size=512,
        shared_intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, moe_layer_freq=kinds,
        partial_rotary_factor=None, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if real_moe:
        values.update(REAL_MOE)
    values.update(overrides)
    return MiniMaxM3Config(**values)


def build(mode: str, config: MiniMaxM3Config, device, dtype, experts_implementation=None):
    """``mode``'s model with random weights, built on ``device`` (a real-width MoE initialised on the CPU would take
    minutes); ``experts_implementation``: transformers' name, None for the default."""
    torch.manual_seed(0)
    if mode == "native":
        from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

        native = MiniMaxM3VLTextConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim, intermediate_size=config.intermediate_size,
            dense_intermediate_size=config.dense_intermediate_size, shared_intermediate_size=config.shared_intermediate_size,
            num_local_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
            rotary_dim=config.rotary_dim, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta,
                                                           "partial_rotary_factor": config.rotary_dim / config.head_dim},
            index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
            index_block_size=config.index_block_size, index_topk_blocks=config.index_topk_blocks, index_local_blocks=1,
            layer_types=config.layer_types, mlp_layer_types=config.mlp_layer_types,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        with torch.device(device):
            model = MiniMaxM3VLForCausalLM._from_config(native, attn_implementation="sdpa", dtype=dtype,
                                                        experts_implementation=experts_implementation)
    else:
        mode_config = MiniMaxM3Config(**{**config.to_dict(), "attention_mode": "dense" if mode == "dense" else "sparse"})
        with torch.device(device):
            model = MiniMaxM3ForCausalLM._from_config(mode_config, dtype=dtype,
                                                      experts_implementation=experts_implementation)
    return model.to(device).eval()


def measure(fn, device, repeats: int):
    """Median seconds of ``fn`` after one warm-up, and the peak memory of the last run (CUDA)."""
    def run_once():
        return timed_seconds(fn, device)

    run_once()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times.append(run_once())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def bench_model(mode, config, length, device, dtype, repeats, experts_implementation=None):
    try:
        model = build(mode, config, device, dtype, experts_implementation)
        ids = torch.randint(3, config.vocab_size, (1, length), device=device)

        def prefill():
            with torch.no_grad():
                model(ids, logits_to_keep=1, use_cache=False)

        seconds, peak = measure(prefill, device, repeats)
        result = dict(mode=mode, length=length, seconds=seconds, tokens_per_second=length / seconds, peak_gib=peak)
    except torch.OutOfMemoryError:
        result = dict(mode=mode, length=length, oom=True)
    except ImportError as error:
        result = dict(mode=mode, length=length, skipped=str(error))
    finally:
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["experts"] = experts_implementation or "default"
    return result


CLUSTER_PAGES = 24
"""Pages in the pool of a 128-token block for ``--selection clustered`` (the issue's calibration: a 24-page union
per 128-query block)."""


def clustered_selection(length: int, num_groups: int, topk: int, page_size: int, device, generator=None) -> torch.Tensor:
    """``[length, G, topk]`` selections with a trained model's locality: the tokens of a 128-token block draw their
    ``topk - 1`` history pages from one pool of ``CLUSTER_PAGES - 1`` pages of the block's history (per group), plus
    the forced local page. Tokens with at most ``topk`` pages select every page, as the contract does."""
    blocks = -(-length // page_size)
    token_block = torch.arange(length, device=device) // page_size
    candidates = torch.arange(topk, device=device)
    everything = torch.where(candidates <= token_block[:, None], candidates, -1)[:, None, :].expand(length, num_groups, topk)
    if blocks <= topk:
        return everything.to(torch.int32).contiguous()
    pool_size = min(CLUSTER_PAGES - 1, blocks)
    pages = torch.arange(blocks, device=device)
    # per (block, group): a random pool among the block's history pages (block b has pages 0..b-1)
    order = torch.rand(blocks, num_groups, blocks, device=device, generator=generator)
    order = torch.where(pages[None, None, :] < pages[:, None, None], order, 2.0)
    pool = order.argsort(dim=-1)[..., :pool_size]  # [blocks, G, pool]
    picks = torch.rand(length, num_groups, pool_size, device=device, generator=generator).argsort(dim=-1)[..., : topk - 1]
    chosen = torch.gather(pool[token_block], 2, picks)  # [length, G, topk - 1]
    chosen = torch.where(chosen < token_block[:, None, None], chosen, -1)  # pools of young blocks are short
    selection = torch.cat([chosen, token_block[:, None, None].expand(length, num_groups, 1)], dim=-1)
    selection = torch.where((token_block < topk)[:, None, None], everything, selection)
    return selection.to(torch.int32).contiguous()


@contextlib.contextmanager
def clustered_selections(selector, config, max_length: int, device, generator=None):
    """For the block, ``selector.select`` still runs the indexer (so it is timed) but returns, for every token, the
    row of ``clustered_selection(max_length, ...)`` at the token's position: a trained model's locality on a
    random-weight model. Every sequence of a batch and every chunk of a chunked prefill reads the same table."""
    table = clustered_selection(max_length, config.num_key_value_heads, config.index_topk_blocks,
                                config.index_block_size, device, generator)
    real_select = selector.select

    def select(layer_cache_pages, block_table, index_q, metadata):
        real_select(layer_cache_pages, block_table, index_q, metadata)
        if max(metadata.kv_lengths) > max_length:  # host ints: no device synchronisation
            raise ValueError(f"clustered selections were drawn for {max_length} positions, a sequence reaches "
                             f"{max(metadata.kv_lengths)}")
        return table[metadata.positions.to(table.device).long()]

    selector.select = select
    try:
        yield selector
    finally:
        selector.select = real_select


class _ComponentTimer:
    """Wraps callables so each call is bracketed by CUDA events; ``milliseconds()`` sums one pass's calls."""

    def __init__(self):
        self.pairs = []

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(*args, **kwargs)
            end.record()
            self.pairs.append((start, end))
            return result

        return timed

    def milliseconds(self) -> float:
        torch.cuda.synchronize()
        total = sum(start.elapsed_time(end) for start, end in self.pairs)
        self.pairs.clear()
        return total


def bench_attention(config, length, device, dtype, repeats, selection: str = "model", modes=("sparse", "dense")):
    """One sparse layer's attention (indexer scores + top-k + sparse attention) vs the same layer dense.

    Reports the whole attention block (projections, norms and RoPE included: the same work in both modes) and, on
    CUDA, its *core*: in sparse mode the page selection (indexer plan, scores, top-k) plus the sparse attention
    function; in dense mode the dense attention function -- the issue's "indexer scores + top-k + sparse attention,
    together" against "the dense attention of the same layer".

    ``selection="clustered"``: the indexer still runs (and is timed), but the attention uses
    ``clustered_selection`` instead of its output: a random-weight model selects nearly independent pages per
    token, while a trained model's neighbouring tokens share most pages, which is what block-sparse attention
    exploits.

    Lengths whose score buffer exceeds ``config.max_score_buffer_bytes`` run as the model runs them: query chunks
    over the cache (``MiniMaxM3Model._query_chunk_columns``), their times summed. ``modes``: the sides to time
    (a side left out reports NaN), e.g. sparse alone where dense attention would take minutes."""
    results, cores = {"sparse": float("nan"), "dense": float("nan")}, {}
    for mode in modes:
        model = build(mode, config, device, dtype)
        locality = (clustered_selections(model.model.page_selector, config, length, device)
                    if mode == "sparse" and selection == "clustered" else contextlib.nullcontext())
        with locality:
            results[mode], core = _time_attention_layer(model, length, device, dtype, repeats)
        if core is not None:
            cores[mode] = core
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = dict(length=length, selection=selection, sparse_attention_seconds=results["sparse"],
                  dense_attention_seconds=results["dense"], speedup=results["dense"] / results["sparse"])
    if cores:
        result.update(sparse_core_seconds=cores.get("sparse", float("nan")), dense_core_seconds=cores.get("dense", float("nan")),
                      core_speedup=cores.get("dense", float("nan")) / cores.get("sparse", float("nan")))
    return result


def _time_attention_layer(model, length, device, dtype, repeats):
    """Seconds of the first sparse layer's attention block (median of ``repeats``; NaN when out of memory) and, on CUDA, of its
    core (page selection + attention function, one pass), else None."""
    from . import modeling_minimax_m3
    from .cache import MiniMaxM3Cache

    config = model.config
    selector = model.model.page_selector
    timer = _ComponentTimer()
    select = selector.select
    if device.type == "cuda":
        selector.select = timer.wrap(select)
    layer = model.model.layers[config.layer_types.index(SPARSE_ATTENTION)]
    hidden = torch.randn(1, length, config.hidden_size, device=device, dtype=dtype)

    chunk = model.model._query_chunk_columns(MiniMaxM3Cache(config, 1), [length], length)

    def attention():
        with torch.no_grad():
            cache = MiniMaxM3Cache(config, 1)
            cache.reserve([length])
            for begin in range(0, length, chunk):
                columns = min(chunk, length - begin)
                real = torch.ones(1, columns, dtype=torch.bool, device=device)
                metadata = model.model._metadata(real, cache.lengths, [columns])
                cos, sin = model.model.rotary_emb(metadata.positions)
                layer.self_attn(layer.input_layernorm(hidden[0, begin:begin + columns]), cos, sin, cache, metadata,
                                selector)
                cache.advance([columns], columns)

    originals = (modeling_minimax_m3.dense_attention, modeling_minimax_m3.get_sparse_attention_function)
    if device.type == "cuda":
        modeling_minimax_m3.dense_attention = timer.wrap(originals[0])
        modeling_minimax_m3.get_sparse_attention_function = lambda *a, **k: timer.wrap(originals[1](*a, **k))
    core = None
    try:
        seconds, _ = measure(attention, device, repeats)
        if device.type == "cuda":
            timer.pairs.clear()
            attention()
            core = timer.milliseconds() / 1e3
    except torch.OutOfMemoryError:
        seconds = float("nan")
    finally:
        modeling_minimax_m3.dense_attention, modeling_minimax_m3.get_sparse_attention_function = originals
        selector.select = select
    return seconds, core


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=positive_ints, default=None,
                        help="comma-separated prompt lengths (default: 8K,32K,128K,256K on GPU)")
    parser.add_argument("--modes", default="sparse,dense,native")
    parser.add_argument("--sparse-layers", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--attention-only", action="store_true")
    parser.add_argument("--sparse-attention", default="auto", choices=["auto", *SPARSE_ATTENTION_FUNCTIONS],
                        help="the sparse layers' attention function (config.sparse_attention_implementation)")
    parser.add_argument("--selection", default="model", choices=["model", "clustered"],
                        help="--attention-only: attend over the indexer's selections or clustered ones (see bench_attention)")
    parser.add_argument("--real-moe", action="store_true",
                        help="M3's real MLP widths (128 experts of 3072, top-4, shared 3072; dense 12288), not a tiny MoE")
    parser.add_argument("--experts", default="default",
                        help="comma-separated experts implementations to compare (transformers' names: grouped_mm, "
                             "batched_mm, eager; default: the model's default)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    output = checked_output_argument(parser, args.output, args.overwrite)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = device.type == "cpu"
    lengths = args.lengths or ([96, 200] if tiny else [8192, 32768, 131072, 262144])
    dtype = torch.float32 if tiny else torch.bfloat16
    config = geometry_config(args.sparse_layers, tiny=tiny, real_moe=args.real_moe,
                             sparse_attention_implementation=args.sparse_attention)
    experts = [None if name == "default" else name for name in args.experts.split(",")]
    if tiny:
        print("no GPU: a tiny geometry at short lengths (a smoke run, not a measurement)", file=sys.stderr)
    results = []
    for length in lengths:
        if args.attention_only:
            results.append(bench_attention(config, length, device, dtype, args.repeats, args.selection))
            write_results(output, results, partial=True)
        else:
            for mode in args.modes.split(","):
                for experts_implementation in experts:
                    results.append(bench_model(mode, config, length, device, dtype, args.repeats, experts_implementation))
                    print(json.dumps(results[-1]), flush=True)
                    write_results(output, results, partial=True)
    write_results(output, results, partial=False)
    if args.attention_only:
        print("\n| length | selection | sparse block ms | dense block ms | block speed-up | sparse core ms | dense core ms | core speed-up |")
        print("|---|---|---|---|---|---|---|---|")
    else:
        print("\n| length | mode | experts | ms | tokens/s | peak GiB |")
        print("|---|---|---|---|---|---|")
    for r in results:
        if args.attention_only:
            core = (f"{r['sparse_core_seconds'] * 1e3:.1f} | {r['dense_core_seconds'] * 1e3:.1f} | {r['core_speedup']:.1f}x"
                    if "core_speedup" in r else "- | - | -")
            print(f"| {r['length']} | {r['selection']} | {r['sparse_attention_seconds'] * 1e3:.1f} | "
                  f"{r['dense_attention_seconds'] * 1e3:.1f} | {r['speedup']:.1f}x | {core} |")
        elif r.get("oom"):
            print(f"| {r['length']} | {r['mode']} | {r['experts']} | OOM | - | - |")
        elif r.get("skipped"):
            print(f"| {r['length']} | {r['mode']} | {r['experts']} | skipped ({r['skipped']}) | - | - |")
        else:
            print(f"| {r['length']} | {r['mode']} | {r['experts']} | {r['seconds'] * 1e3:.1f} | "
                  f"{r['tokens_per_second']:.0f} | {r['peak_gib']:.1f} |")


if __name__ == "__main__":
    main()
