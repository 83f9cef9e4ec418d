"""Prefill throughput of sparse vs dense attention on one model: ``python -m eval.throughput``.

Modes (``--modes``): ``sparse`` (indexer ``backend="auto"``), ``sparse-torch`` (the indexer's torch backend: the
difference to ``sparse`` is the kernels' contribution), ``dense`` (every layer full attention) — one model,
switched in place, so the weights are the same — and ``native`` (transformers' ``MiniMaxM3VLForCausalLM`` with the
same geometry and random weights, when transformers has it; presets only).

Workloads: fresh prompts at every ``--lengths`` x ``--batch-sizes``, and a chunked prefill that feeds a
``--chunked-context`` token context through the cache in ``--chunk-size`` chunks (Lq << Lk: where the indexer
dominates). Every prefill keeps only the last position's logits. Per configuration: one warm-up, then one timed
prefill per ``--seeds`` (its own random prompt); reported are time per prefill (TTFT; per chunk for chunked
prefill), input tokens/s, peak GPU memory and speed-up over dense, as median and min/max over the seeds; a
configuration whose slowest timing exceeds 1.5 times its fastest is flagged noisy (``*`` in the tables, ``"noisy"``
and ``"max_over_min"`` in the JSON). An out-of-memory error is reported as OOM. Decode workloads (``eval.decode``):
time per output token after a context of every ``--decode-contexts`` x ``--decode-batch-sizes``, with CUDA graphs
and eagerly. Prefix-cached turns
(``eval.turns``): a ``--turns-prefix`` token prefix in the cache, then ``--turns`` turns of ``--turn-tokens``
tokens, each timed. Then the sparse-layer-only comparison: one sparse layer's attention
(indexer + top-k + sparse attention) against the same layer in dense mode (``minimax_m3.bench_prefill``'s
``--attention-only``), on a two-layer model of the same attention geometry.

Selections (``--selection``, presets): ``model`` (default) attends over the random-weight model's own selections,
nearly independent per token; ``clustered`` keeps the indexer running but attends over pages drawn with a trained
indexer's locality (``minimax_m3.bench_prefill.clustered_selection``; measured in ``python -m
eval.selection_locality``), so both ends of the selection locality can be reported.

Models: ``--preset m3-geometry`` (default on CUDA): MiniMax-M3's attention geometry (hidden 6144, 64/4 heads of
128, index heads 4 x 128, pages of 128, top-16) with 1 dense layer + ``--sparse-layers`` sparse layers with a tiny
MoE and random bf16 weights; ``--preset m3-proportions``: the same geometry with M3's own layer mix, 3 dense and 57
sparse layers (about 6.4B parameters of attention); ``--preset tiny``: the same layer mix in a tiny geometry (default without CUDA, with
short lengths, fp32: a smoke run, not a measurement); ``--preset embedded``: the embedded default model of
``eval.default_model``; ``--model PATH``: a checkpoint (``device_map`` aware).

Prints a table, writes JSON (``--output``, default ``eval_results/throughput-<time>.json``) and a PNG plot of
tokens/s against length next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .decode import FILLS, WARMUP_STEPS, decode_table, measure_decode
from .turns import measure_turns, turns_table
from .modes import ALL_MODES, MODE_SETTINGS, NATIVE_MODE, forward_over_cache, indexer_backends_in_use, set_attention_mode
from .cli import add_debug_argument, checked_model, run_main
from .report import (checked_output_path, environment, format_number, format_table, noise_footnote, noisy_mark,
                     plot_throughput, write_json)
from .devices import checked_device
from .offline import enforce_offline
from .stats import is_noisy, max_over_min, spread
from .timing import peak_memory_gib, release_memory, reset_peak_memory, time_steps

__all__ = ["Workload", "ModelSpec", "GPU_DEFAULTS", "CPU_DEFAULTS", "run_throughput", "throughput_table",
           "sparse_layer_table", "run_command", "main"]

logger = logging.getLogger(__name__)

PRESETS = ("m3-geometry", "m3-proportions", "tiny", "embedded")
SELECTIONS = ("model", "clustered")
M3_DENSE_LAYERS, M3_SPARSE_LAYERS = 3, 57
"""MiniMax-M3's layer mix (preset m3-proportions): three full-attention layers, then 57 sparse ones."""
GPU_DEFAULTS = {"lengths": "8192,32768,131072", "chunked_context": 131072, "chunk_size": 2048,
                "decode_contexts": "32768,131072", "decode_steps": 32, "turns_prefix": 131072, "turn_tokens": 2048,
                "turns": 4}
CPU_DEFAULTS = {"lengths": "256,512", "chunked_context": 512, "chunk_size": 64, "decode_contexts": "256",
                "decode_steps": 4, "turns_prefix": 256, "turn_tokens": 32, "turns": 2}
FIRST_REGULAR_TOKEN = 3  # prompts avoid the pad/bos/eos ids of the presets and the embedded tokenizer


@dataclass(frozen=True)
class Workload:
    kind: str  # "fresh", "chunked", "decode" or "turns"
    length: int  # prompt length (fresh), whole context (chunked, decode) or cached prefix (turns)
    batch_size: int
    chunk_size: Optional[int] = None  # chunked: tokens per chunk; turns: tokens per turn
    steps: Optional[int] = None  # decode: timed one-token steps; turns: timed turns
    graphs: bool = False  # decode: replay CUDA graphs (decode_cuda_graphs=True)
    fill: str = "prefill"  # decode: how the context gets into the cache (eval.decode.FILLS)

    def __post_init__(self):
        if self.kind not in ("fresh", "chunked", "decode", "turns"):
            raise ValueError(f"workload kind must be 'fresh', 'chunked', 'decode' or 'turns', got {self.kind!r}")
        if self.length < 1 or self.batch_size < 1:
            raise ValueError(f"length and batch_size must be positive, got {self.length} and {self.batch_size}")
        if self.kind == "chunked" and not (self.chunk_size and 0 < self.chunk_size <= self.length):
            raise ValueError(f"chunk_size must be in [1, length={self.length}] for chunked prefill, got {self.chunk_size}")
        if self.kind in ("decode", "turns") and not (self.steps and self.steps > 0):
            raise ValueError(f"a {self.kind} workload needs steps >= 1, got {self.steps}")
        if self.kind == "turns" and not (self.chunk_size and self.chunk_size > 0):
            raise ValueError(f"a turns workload needs chunk_size (tokens per turn) >= 1, got {self.chunk_size}")
        if self.fill not in FILLS:
            raise ValueError(f"fill must be one of {FILLS}, got {self.fill!r}")

    @property
    def label(self) -> str:
        if self.kind == "decode":
            return f"decode ({'graphs' if self.graphs else 'eager'})"
        if self.kind == "turns":
            return f"turns ({self.steps} x {self.chunk_size})"
        return "fresh" if self.kind == "fresh" else f"chunked ({self.chunk_size})"


@dataclass
class ModelSpec:
    """Where the model comes from: a preset name or a checkpoint path."""

    preset: Optional[str]
    path: Optional[str]
    dtype: torch.dtype
    device: torch.device
    device_map: Optional[str] = None
    sparse_layers: int = 3
    sparse_attention: str = "auto"

    def describe(self) -> str:
        return f"--model {self.path}" if self.path else f"preset {self.preset}"


# ------------------------------------------------------------------ models
def build_preset_config(spec: ModelSpec):
    """The MiniMaxM3Config of a preset (the embedded model's is its saved one)."""
    from minimax_m3.bench_prefill import geometry_config

    if spec.preset == "m3-geometry":
        return geometry_config(spec.sparse_layers, tiny=False, sparse_attention_implementation=spec.sparse_attention)
    if spec.preset == "m3-proportions":
        return geometry_config(M3_SPARSE_LAYERS, dense_layers=M3_DENSE_LAYERS, tiny=False,
                               sparse_attention_implementation=spec.sparse_attention)
    if spec.preset == "tiny":
        return geometry_config(spec.sparse_layers, tiny=True, sparse_attention_implementation=spec.sparse_attention)
    raise ValueError(f"no generated config for preset {spec.preset!r}")


def load_our_model(spec: ModelSpec):
    """Our MiniMaxM3ForCausalLM for ``spec`` (sparse mode; switched in place per mode)."""
    if spec.path is not None:
        from minimax_m3 import load_model

        model = load_model(spec.path, dtype=spec.dtype, device_map=spec.device_map).eval()
        if spec.device_map is None:
            model = model.to(spec.device)
    elif spec.preset == "embedded":
        from .default_model import load_default_model

        model, _ = load_default_model(dtype=spec.dtype, device=str(spec.device))
    else:
        from minimax_m3.bench_prefill import build

        model = build("sparse", build_preset_config(spec), spec.device, spec.dtype)
    model.config.sparse_attention_implementation = spec.sparse_attention
    return model


def build_native_model(spec: ModelSpec, config):
    """transformers' MiniMaxM3VLForCausalLM with ``config``'s geometry (random weights)."""
    from minimax_m3.bench_prefill import build

    return build("native", config, spec.device, spec.dtype)


def model_devices(model) -> list:
    return sorted({p.device for p in model.parameters()}, key=str)


def single_sparse_layer_config(config):
    """A two-layer model (dense, then sparse) with ``config``'s attention geometry, for the attention-only timing
    (``bench_attention`` times the sparse layer); small MLPs and vocabulary: they are not timed."""
    from minimax_m3 import MiniMaxM3Config
    from minimax_m3.configuration_minimax_m3 import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION

    return MiniMaxM3Config(
        vocab_size=1024, hidden_size=config.hidden_size, num_hidden_layers=2,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, rotary_dim=config.rotary_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, intermediate_size=256, dense_intermediate_size=512,
        shared_intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
        index_block_size=config.index_block_size, index_topk_blocks=config.index_topk_blocks, index_local_blocks=1,
        layer_types=[FULL_ATTENTION, SPARSE_ATTENTION], mlp_layer_types=[DENSE_MLP, MOE_MLP],
        index_dtype=config.index_dtype, sparse_attention_implementation=config.sparse_attention_implementation,
        indexer_backend="auto", max_score_buffer_bytes=config.max_score_buffer_bytes,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


# ------------------------------------------------------------------ prefill steps
def prefill_steps(model, workload: Workload, input_ids: torch.Tensor, native: bool) -> list:
    """The callables of one prefill: one forward (fresh) or one per chunk over a cache (chunked)."""
    if workload.kind == "fresh":
        def fresh():
            with torch.no_grad():
                model(input_ids=input_ids, logits_to_keep=1, use_cache=False)
        return [fresh]

    from minimax_m3 import MiniMaxM3Cache

    state = {"cache": None}
    if not native:
        # a server allocates the KV pool for the whole context up front; so does the benchmark
        state["cache"] = MiniMaxM3Cache(model.config, workload.batch_size)
        state["cache"].reserve([workload.length] * workload.batch_size)

    def chunk(begin: int, end: int) -> Callable[[], None]:
        return lambda: forward_over_cache(model, input_ids[:, begin:end], state, native=native)

    return [chunk(b, min(b + workload.chunk_size, workload.length)) for b in range(0, workload.length, workload.chunk_size)]


def prompt(workload: Workload, vocab_size: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    length = workload.length + (workload.steps * workload.chunk_size if workload.kind == "turns" else 0)
    ids = torch.randint(FIRST_REGULAR_TOKEN, vocab_size, (workload.batch_size, length), generator=generator)
    return ids.to(device)


def measure(model, mode: str, workload: Workload, seeds: Sequence[int], warmup: int, vocab_size: int,
            input_device: torch.device, devices: Sequence[torch.device]) -> dict:
    """One (mode, workload): ``warmup`` untimed prefills, then one timed prefill per seed."""
    native = mode == NATIVE_MODE
    if workload.kind == "decode":
        return measure_decode(model, mode, workload, seeds, lambda seed: prompt(workload, vocab_size, seed, input_device),
                              devices, native=native)
    if workload.kind == "turns":
        return measure_turns(model, mode, workload, seeds, lambda seed: prompt(workload, vocab_size, seed, input_device),
                             devices, native=native)
    result = {"mode": mode, "workload": workload.kind, "length": workload.length, "batch_size": workload.batch_size,
              "chunk_size": workload.chunk_size, "tokens": workload.length * workload.batch_size}
    out_of_memory = False
    try:
        for index in range(warmup):
            for step in prefill_steps(model, workload, prompt(workload, vocab_size, 10_000 + index, input_device), native):
                step()
        per_seed, per_chunk, peaks = [], [], []
        for seed in seeds:
            steps = prefill_steps(model, workload, prompt(workload, vocab_size, seed, input_device), native)
            reset_peak_memory(devices)
            seconds = time_steps(steps, devices)
            peaks.append(peak_memory_gib(devices))
            per_seed.append(sum(seconds))
            per_chunk.append(seconds)
    except torch.OutOfMemoryError:
        out_of_memory = True
    if out_of_memory:  # released here, not in the except block, whose traceback still holds the tensors
        steps = None
        release_memory()
        return {**result, "status": "OOM"}
    result.update(
        status="ok",
        seeds=list(seeds),
        seconds=spread(per_seed),
        seconds_per_seed=per_seed,
        tokens_per_second=spread([result["tokens"] / s for s in per_seed]),
        peak_memory_gib=None if peaks[0] is None else max(peaks),
    )
    if workload.kind == "chunked":
        result["chunk_seconds"] = {"median": spread([s for seed in per_chunk for s in seed])["median"],
                                   "last": spread([seed[-1] for seed in per_chunk])["median"],
                                   "per_seed": per_chunk}
    if not native and MODE_SETTINGS[mode]["attention_mode"] == "sparse":
        result["indexer_backends"] = indexer_backends_in_use(model)
    return result


def flag_noise(result: dict) -> dict:
    """``max_over_min`` of the timings (None for a row that did not finish) and ``noisy`` when it exceeds
    ``eval.stats.NOISY_MAX_OVER_MIN``: a median between far-apart timings says little."""
    summary = result.get("seconds") if result.get("status") == "ok" else None
    result["max_over_min"] = max_over_min(summary)
    result["noisy"] = is_noisy(summary)
    return result


def add_speedups(results: list) -> None:
    """``speedup_vs_dense``: dense median seconds / this median seconds, for the same workload."""
    def key(r):
        return r["workload"], r["length"], r["batch_size"], r["chunk_size"], r.get("graphs")

    dense = {key(r): r for r in results if r["mode"] == "dense" and r.get("status") == "ok"}
    for result in results:
        reference = dense.get(key(result))
        finished = result.get("status") == "ok" and reference is not None
        result["speedup_vs_dense"] = reference["seconds"]["median"] / result["seconds"]["median"] if finished else None


def sparse_layer_comparison(config, lengths: Sequence[int], spec: ModelSpec, repeats: int, selection: str,
                            progress) -> list:
    """``bench_prefill.bench_attention`` per length, OOM as a status."""
    from minimax_m3.bench_prefill import bench_attention

    layer_config = single_sparse_layer_config(config)
    rows = []
    for length in lengths:
        progress.set_description(f"sparse layer only, {length} tokens")
        try:
            measured = bench_attention(layer_config, length, spec.device, spec.dtype, repeats, selection)
        except torch.OutOfMemoryError:  # while building the models; bench_attention catches it in the timing
            measured = dict(length=length, selection=selection, sparse_attention_seconds=float("nan"),
                            dense_attention_seconds=float("nan"), speedup=float("nan"))
        release_memory()
        # bench_attention reports an OOM of either side as NaN seconds; on CUDA it also times the core (page
        # selection + the attention function) apart from the whole block
        measured = {key: None if isinstance(value, float) and value != value else value for key, value in measured.items()}
        failed = [side for side in ("sparse", "dense") if measured[f"{side}_attention_seconds"] is None]
        measured["status"] = "ok" if not failed else "OOM" if len(failed) == 2 else f"OOM ({failed[0]})"
        if failed:
            measured["speedup"] = None
        rows.append(measured)
        progress.update(1)
    return rows


# ------------------------------------------------------------------ the run
def run_throughput(spec: ModelSpec, *, modes: Sequence[str], workloads: Sequence[Workload], seeds: Sequence[int],
                   warmup: int = 1, attention_lengths: Sequence[int] = (), attention_selection: str = "model",
                   attention_repeats: int = 3, selection: str = "model",
                   on_progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Everything ``python -m eval.throughput`` reports, as a JSON-ready dict. ``on_progress`` gets the results so
    far (the same dict, ``"partial": True``) after each workload, so an interrupted run keeps them.

    ``selection="clustered"`` (presets): the sparse modes' indexer runs as usual, but their attention reads
    ``minimax_m3.bench_prefill.clustered_selection``'s pages, with the locality of a trained indexer
    (``python -m eval.selection_locality``), instead of a random-weight model's nearly independent ones."""
    from tqdm.auto import tqdm

    from minimax_m3.bench_prefill import clustered_selections

    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be among {ALL_MODES}, got {list(modes)}")
    if not seeds:
        raise ValueError("seeds must not be empty")
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    if selection == "clustered" and spec.path is not None:
        raise ValueError("selection='clustered' replaces a random-weight preset's selections; a checkpoint's indexer "
                         "selects its own pages")
    if attention_repeats < 1:
        raise ValueError(f"attention_repeats must be >= 1, got {attention_repeats}")
    started = time.perf_counter()
    results = []
    header = {"kind": "throughput", "model": spec.describe(), "dtype": str(spec.dtype).replace("torch.", ""),
              "device": str(spec.device), "modes": list(modes), "seeds": list(seeds), "warmup": warmup,
              "selection": selection}

    def report_progress():
        if on_progress is not None:
            on_progress({**header, "partial": True, "results": results, "seconds": time.perf_counter() - started})

    ours = [m for m in modes if m != NATIVE_MODE]
    total = len(modes) * len(workloads) + len(attention_lengths)
    with tqdm(total=total, desc="throughput", unit="run", file=sys.stderr, dynamic_ncols=True) as progress:
        model = load_our_model(spec)
        config = model.config
        vocab_size = config.vocab_size
        input_device = model.get_input_embeddings().weight.device
        devices = model_devices(model)
        # a decode workload's static cache holds its steps too, in whole pages
        extra = {"decode": lambda w: w.steps + WARMUP_STEPS, "turns": lambda w: w.steps * w.chunk_size}
        longest = max(workload.length + extra.get(workload.kind, lambda w: 0)(workload) for workload in workloads)
        longest = -(-longest // config.index_block_size) * config.index_block_size
        for mode in ours:
            set_attention_mode(model, mode)
            sparse = MODE_SETTINGS[mode]["attention_mode"] == "sparse"
            locality = (clustered_selections(model.model.page_selector, config, longest, input_device)
                        if sparse and selection == "clustered" else contextlib.nullcontext())
            with locality:
                for workload in workloads:
                    progress.set_description(f"{mode}, {workload.label}, {workload.length} x {workload.batch_size}")
                    results.append(flag_noise(measure(model, mode, workload, seeds, warmup, vocab_size, input_device,
                                                      devices)))
                    progress.update(1)
                    report_progress()
        model = None
        release_memory()
        if NATIVE_MODE in modes:
            results += [flag_noise(r) for r in measure_native(spec, config, workloads, seeds, warmup, progress)]
            report_progress()
        config_summary = summarize_config(config)
        sparse_layer = (sparse_layer_comparison(config, attention_lengths, spec, attention_repeats, attention_selection,
                                                progress) if attention_lengths else [])
    add_speedups(results)
    return {
        **header,
        "partial": False,
        "config": config_summary,
        "results": results,
        "sparse_layer": sparse_layer,
        "sparse_layer_selection": attention_selection,
        "seconds": time.perf_counter() - started,
    }


def measure_native(spec: ModelSpec, config, workloads, seeds, warmup, progress) -> list:
    """The native mode's rows: measured, or one status for every workload when the model cannot be built."""
    status, reason, model = None, None, None
    if spec.path is not None:
        status, reason = "skipped", "native mode runs with presets only (transformers' class with random weights is not the checkpoint)"
    else:
        try:
            model = build_native_model(spec, config)
        except ImportError as error:
            status, reason = "skipped", f"transformers has no MiniMaxM3VLForCausalLM: {error}"
        except torch.OutOfMemoryError:
            status, reason = "OOM", "out of memory while building the model"
    release_memory()
    results = []
    for workload in workloads:
        progress.set_description(f"native, {workload.label}, {workload.length} x {workload.batch_size}")
        if model is None:
            results.append({"mode": NATIVE_MODE, "workload": workload.kind, "length": workload.length,
                            "batch_size": workload.batch_size, "chunk_size": workload.chunk_size,
                            "graphs": workload.graphs if workload.kind == "decode" else None,
                            "steps": workload.steps, "fill": workload.fill,
                            "tokens": workload.length * workload.batch_size, "status": status, "reason": reason})
        else:
            input_device = model.get_input_embeddings().weight.device
            results.append(measure(model, NATIVE_MODE, workload, seeds, warmup, config.vocab_size, input_device,
                                   model_devices(model)))
        progress.update(1)
    model = None
    release_memory()
    return results


def summarize_config(config) -> dict:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks", "index_dtype",
            "sparse_attention_implementation", "layer_types", "mlp_layer_types", "num_local_experts", "vocab_size")
    return {key: getattr(config, key) for key in keys}


# ------------------------------------------------------------------ report
def _ms(summary: Optional[dict]) -> str:
    if not summary:
        return "-"
    return f"{summary['median'] * 1e3:,.1f} [{summary['min'] * 1e3:,.1f}–{summary['max'] * 1e3:,.1f}]"


def throughput_table(results: Sequence[dict]) -> str:
    headers = ["workload", "tokens", "batch", "mode", "TTFT ms, median [min–max]", "chunk ms (median / last)",
               "input tokens/s", "peak GiB", "vs dense"]
    rows = []
    for r in results:
        if r["workload"] in ("decode", "turns"):
            continue  # decode_table, turns_table
        common = [r["workload"] if r["workload"] == "fresh" else f"chunked {r['chunk_size']}", f"{r['length']:,}",
                  r["batch_size"], r["mode"]]
        if r["status"] != "ok":
            rows.append(common + [r["status"], "-", "-", "-", "-"])
            continue
        chunk = r.get("chunk_seconds")
        rows.append(common + [
            _ms(r["seconds"]) + noisy_mark(r),
            f"{chunk['median'] * 1e3:,.1f} / {chunk['last'] * 1e3:,.1f}" if chunk else "-",
            format_number(r["tokens_per_second"]["median"]),
            format_number(r["peak_memory_gib"]),
            "-" if r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x",
        ])
    return format_table(headers, rows)


def sparse_layer_table(rows: Sequence[dict]) -> str:
    """Whole attention block per mode and, where measured (CUDA), its core: selection + attention function."""
    with_core = any("core_speedup" in r for r in rows)
    headers = ["tokens", "selection", "sparse block ms", "dense block ms", "block speed-up"]
    if with_core:
        headers += ["sparse core ms", "dense core ms", "core speed-up"]

    def milliseconds(seconds):
        return "OOM" if seconds is None else f"{seconds * 1e3:,.2f}"

    def ratio(value):
        return "-" if value is None else f"{value:.2f}x"

    body = []
    for r in rows:
        row = [f"{r['length']:,}", r["selection"], milliseconds(r["sparse_attention_seconds"]),
               milliseconds(r["dense_attention_seconds"]), ratio(r["speedup"])]
        if with_core:
            row += [milliseconds(r.get("sparse_core_seconds")), milliseconds(r.get("dense_core_seconds")),
                    ratio(r.get("core_speedup"))]
        body.append(row)
    return format_table(headers, body)


def print_throughput_report(result: dict, stream=None) -> None:
    stream = stream or sys.stdout  # looked up per call: pytest's capsys replaces it
    selection = "" if result.get("selection", "model") == "model" else f", sparse modes attend over {result['selection']} selections"
    print(f"\nPrefill throughput: {result['model']}, {result['dtype']} on {result['device']}, seeds "
          f"{','.join(map(str, result['seeds']))} (median [min–max]); logits of the last position only{selection}",
          file=stream)
    print(throughput_table(result["results"]), file=stream)
    _print_footnote([r for r in result["results"] if r["workload"] in ("fresh", "chunked")], stream)
    decoded = [r for r in result["results"] if r["workload"] == "decode"]
    if decoded:
        fills = sorted({r.get("fill", "prefill") for r in decoded})
        print(f"\nDecode: time per output token after the context ({', '.join(fills)} context; graphs: CUDA-graph "
              f"replays over a static cache, as generate runs on CUDA, and on the CPU the same step uncaptured; "
              f"median [min–max] over the steps of every seed)", file=stream)
        print(decode_table(decoded), file=stream)
        _print_footnote(decoded, stream)
    turns = [r for r in result["results"] if r["workload"] == "turns"]
    if turns:
        print("\nPrefix-cached turns: each turn's tokens in one forward over the cached prefix and the earlier turns "
              "(TTFT per turn; median [min–max] over the turns of every seed)", file=stream)
        print(turns_table(turns), file=stream)
        _print_footnote(turns, stream)
    reasons = sorted({(r["mode"], r["status"], r["reason"]) for r in result["results"] if r.get("reason")})
    for mode, status, reason in reasons:
        print(f"{mode}: {status}: {reason}", file=stream)
    if result["sparse_layer"]:
        print(f"\nOne sparse layer's attention vs the same layer dense, batch 1, {result['sparse_layer_selection']} "
              f"selections (block: projections, norms, RoPE and attention; core, CUDA only: indexer + top-k + sparse "
              f"attention against dense attention):", file=stream)
        print(sparse_layer_table(result["sparse_layer"]), file=stream)


def _print_footnote(results, stream) -> None:
    footnote = noise_footnote(results)
    if footnote:
        print(footnote, file=stream)


# ------------------------------------------------------------------ command line
def _ints(text: Optional[str], name: str) -> list:
    if text is None or not text.strip():
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{name} must be comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise SystemExit(f"{name} must not be negative, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.throughput", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--preset", choices=PRESETS, default=None,
                        help="m3-geometry (default on CUDA), m3-proportions (M3's 3 dense + 57 sparse layers at its "
                             "attention geometry), tiny (default without CUDA), embedded (eval's default model)")
    parser.add_argument("--model", default=None, help="checkpoint directory instead of a preset")
    parser.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma-separated, of {','.join(ALL_MODES)}")
    parser.add_argument("--lengths", default=None,
                        help=f"fresh prompt lengths (default {GPU_DEFAULTS['lengths']} on CUDA, {CPU_DEFAULTS['lengths']} otherwise; "
                             "empty: none)")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated; every length runs at every batch size")
    parser.add_argument("--chunked-context", type=int, default=None,
                        help=f"context of the chunked prefill (default {GPU_DEFAULTS['chunked_context']} on CUDA, "
                             f"{CPU_DEFAULTS['chunked_context']} otherwise; 0: no chunked prefill)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help=f"default {GPU_DEFAULTS['chunk_size']} on CUDA, {CPU_DEFAULTS['chunk_size']} otherwise")
    parser.add_argument("--seeds", default="0,1,2", help="one timed prefill per seed (its own random prompt)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed prefills per configuration")
    parser.add_argument("--sparse-layers", type=int, default=3, help="presets m3-geometry and tiny: sparse layers after the dense one")
    from minimax_m3.sparse_attention import SPARSE_ATTENTION_FUNCTIONS

    parser.add_argument("--sparse-attention", default="auto", choices=["auto", *SPARSE_ATTENTION_FUNCTIONS],
                        help="the sparse layers' attention function (config.sparse_attention_implementation)")
    parser.add_argument("--attention-lengths", default=None,
                        help="lengths of the sparse-layer-only comparison (default: --lengths; empty: skip it)")
    parser.add_argument("--selection", default="model", choices=list(SELECTIONS),
                        help="presets: the sparse modes attend over the indexer's selections (model) or over clustered "
                             "ones with a trained indexer's locality (the indexer still runs)")
    parser.add_argument("--attention-selection", default=None, choices=list(SELECTIONS),
                        help="the sparse-layer comparison's selections (default: --selection)")
    parser.add_argument("--attention-repeats", type=int, default=3, help="timed runs per sparse-layer measurement (median)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                        help="auto: bfloat16 on CUDA (float32 for the embedded model), float32 on CPU")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--device-map", default=None, help="for --model (default: auto on CUDA)")
    parser.add_argument("--output", default=None, help="JSON results (default: eval_results/throughput-<time>.json); "
                                                       "the plot goes next to it as .png")
    parser.add_argument("--decode-contexts", default=None,
                        help="contexts of the decode workloads (default 32768,131072 on CUDA, 256 otherwise; empty: none)")
    parser.add_argument("--decode-batch-sizes", default="1", help="comma-separated batch sizes of the decode workloads")
    parser.add_argument("--decode-steps", type=int, default=None,
                        help="timed one-token steps per decode workload and seed (default 32 on CUDA, 4 otherwise)")
    parser.add_argument("--decode-graphs", default="both", choices=["both", "on", "off"],
                        help="our modes' decode steps: CUDA graphs (on), eager (off) or both")
    parser.add_argument("--decode-fill", default="prefill", choices=list(FILLS),
                        help="the decode context: a prefill, or random keys written into the cache (our modes)")
    parser.add_argument("--turns-prefix", type=int, default=None,
                        help="cached prefix of the multi-turn workload (default 131072 on CUDA, 256 otherwise; 0: none)")
    parser.add_argument("--turn-tokens", type=int, default=None,
                        help="tokens per turn (default 2048 on CUDA, 32 otherwise)")
    parser.add_argument("--turns", type=int, default=None, help="timed turns per seed (default 4 on CUDA, 2 otherwise)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output (and its plot)")
    return add_debug_argument(parser)


def resolve_arguments(args) -> dict:
    """Model spec, modes, workloads and seeds from the parsed arguments, with the no-CUDA fallback (logged)."""
    if args.preset and args.model:
        raise SystemExit("pass either --preset or --model, not both")
    if args.model is not None and args.selection == "clustered":
        raise SystemExit("--selection clustered replaces a random-weight preset's selections; a checkpoint's indexer "
                         "selects its own pages (use a --preset)")
    if args.device_map is not None and args.model is None:
        raise SystemExit("--device-map applies to --model only (presets run on --device)")
    if args.sparse_layers < 1:
        raise SystemExit(f"--sparse-layers must be >= 1, got {args.sparse_layers}")
    if args.chunked_context is not None and args.chunked_context < 0:
        raise SystemExit(f"--chunked-context must not be negative (0: no chunked prefill), got {args.chunked_context}")
    if args.model is not None:
        checked_model(args.model)
    device = checked_device(args.device)
    on_gpu = device.type == "cuda"
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    preset = args.preset
    if preset is None and args.model is None:
        preset = "m3-geometry" if on_gpu else "tiny"
        if not on_gpu:
            logger.warning("no CUDA device: falling back from preset m3-geometry to preset tiny at lengths %s, "
                           "float32 (a smoke run, not a measurement)", args.lengths or defaults["lengths"])
    elif preset in ("m3-geometry", "m3-proportions") and not on_gpu:
        logger.warning("preset %s on %s: a 6144-wide model on the CPU is slow", preset, device)
    if args.dtype == "auto":
        dtype = torch.bfloat16 if on_gpu and preset != "embedded" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    device_map = args.device_map
    if args.model and device_map is None and on_gpu:
        device_map = "auto"
    spec = ModelSpec(preset=preset, path=args.model, dtype=dtype, device=device, device_map=device_map,
                     sparse_layers=args.sparse_layers, sparse_attention=args.sparse_attention)

    lengths = _ints(defaults["lengths"] if args.lengths is None else args.lengths, "--lengths")
    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    if not batch_sizes or 0 in lengths or 0 in batch_sizes:
        raise SystemExit("--lengths and --batch-sizes must list positive integers (--lengths may be empty: no "
                         "fresh prompts)")
    workloads = [Workload("fresh", length, batch) for batch in batch_sizes for length in lengths]
    context = defaults["chunked_context"] if args.chunked_context is None else args.chunked_context
    chunk_size = defaults["chunk_size"] if args.chunk_size is None else args.chunk_size
    if context:
        if chunk_size <= 0 or chunk_size > context:
            raise SystemExit(f"--chunk-size must be in [1, --chunked-context={context}], got {chunk_size}")
        workloads += [Workload("chunked", context, batch, chunk_size) for batch in batch_sizes]
    decode_contexts = _ints(defaults["decode_contexts"] if args.decode_contexts is None else args.decode_contexts,
                            "--decode-contexts")
    decode_batches = _ints(args.decode_batch_sizes, "--decode-batch-sizes")
    decode_steps = defaults["decode_steps"] if args.decode_steps is None else args.decode_steps
    if decode_contexts:
        if 0 in decode_contexts or not decode_batches or 0 in decode_batches or decode_steps < 1:
            raise SystemExit("--decode-contexts and --decode-batch-sizes must list positive integers and "
                             "--decode-steps must be >= 1")
        graphs = {"both": (True, False), "on": (True,), "off": (False,)}[args.decode_graphs]
        workloads += [Workload("decode", context, batch, steps=decode_steps, graphs=graphed, fill=args.decode_fill)
                      for graphed in graphs for batch in decode_batches for context in decode_contexts]
    turns_prefix = defaults["turns_prefix"] if args.turns_prefix is None else args.turns_prefix
    turn_tokens = defaults["turn_tokens"] if args.turn_tokens is None else args.turn_tokens
    turns = defaults["turns"] if args.turns is None else args.turns
    if turns_prefix:
        if turns_prefix < 0 or turn_tokens < 1 or turns < 1:
            raise SystemExit("--turns-prefix must not be negative, --turn-tokens and --turns must be >= 1")
        workloads += [Workload("turns", turns_prefix, batch, turn_tokens, steps=turns) for batch in batch_sizes]
    if not workloads:
        raise SystemExit("nothing to run: --lengths, --chunked-context, --decode-contexts and --turns-prefix are all "
                         "empty or 0")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes must be among {','.join(ALL_MODES)}, got {args.modes!r}")
    attention_lengths = lengths if args.attention_lengths is None else _ints(args.attention_lengths, "--attention-lengths")
    seeds = _ints(args.seeds, "--seeds")
    if not seeds:
        raise SystemExit("--seeds must list at least one seed")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must not be negative, got {args.warmup}")
    if args.attention_repeats < 1:
        raise SystemExit(f"--attention-repeats must be >= 1, got {args.attention_repeats}")
    return dict(spec=spec, modes=modes, workloads=workloads, seeds=seeds, warmup=args.warmup,
                attention_lengths=[n for n in attention_lengths if n > 0],
                attention_selection=args.attention_selection or args.selection,
                attention_repeats=args.attention_repeats, selection=args.selection)


def write_outputs(result: dict, path: Path, plot: bool) -> dict:
    if plot:
        plotted = plot_throughput(result["results"], path.with_suffix(".png"),
                                  title=f"Prefill throughput, {result['model']} ({result['dtype']}, {result['device']})")
        result["plot"] = None if plotted is None else str(plotted)
    json_path = write_json(path, result)
    return {"json": str(json_path), "plot": result.get("plot")}


def run_command(argv=None) -> dict:
    """The command line's work; returns the results (``main`` is the console-script entry point)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    enforce_offline()  # a --model hub id resolves from the local cache only, as checked_model requires
    resolved = resolve_arguments(args)
    path = checked_output_path(args.output, "throughput", overwrite=args.overwrite)
    if not args.no_plot and path.with_suffix(".png").exists() and not args.overwrite:
        raise SystemExit(f"the plot {path.with_suffix('.png')} exists: pass --overwrite to replace it, --no-plot, "
                         f"or choose another --output")
    run_environment = environment()
    flushed = []

    def flush(partial: dict) -> None:
        flushed.append(write_json(path, {**partial, "environment": run_environment}))

    try:
        result = run_throughput(**resolved, on_progress=flush)
    except KeyboardInterrupt:
        saved = f"the finished workloads are in {path} (\"partial\": true)" if flushed else "no workload had finished"
        print(f"\ninterrupted: {saved}", file=sys.stderr)
        raise SystemExit(130) from None
    result["environment"] = run_environment
    paths = write_outputs(result, path, plot=not args.no_plot)
    print_throughput_report(result)
    print(f"\nresults: {paths['json']}" + (f"\nplot: {paths['plot']}" if paths["plot"] else ""))
    return result


def main(argv=None) -> None:
    run_main(run_command, argv)


if __name__ == "__main__":
    main()
