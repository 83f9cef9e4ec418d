"""MiniMax-M3 at the released model's width on one GPU: ``python -m eval.real_width --checkpoint PATH``.

Two parts, each optional:

* **The slice** (``--checkpoint``, e.g. the default of ``python -m minimax_m3.synthetic_checkpoint``: the release's
  3 dense layers and 2 sparse layers, its embedding and ``lm_head``, MXFP8). It is loaded once with
  ``from_pretrained`` (load time, host and GPU memory as ``minimax_m3.bench_loading`` measures them). Then, in
  sparse and in dense mode (``attention_mode``, switched in place), it times fresh prefills of ``--lengths`` tokens
  and one ``--chunk``-token chunk over a prefix that ends at ``--chunk-context`` tokens, with CUDA events around
  every decoder layer and its attention and MLP modules. From those layer times it **estimates** the whole model's
  time to first token as ``3 x dense layer + 57 x sparse layer + the rest`` (embedding, final norm, ``lm_head``;
  the release's layer counts), in each mode. The experts' share of a sparse layer at ``--experts-length`` tokens is
  set against ``torch.matmul`` on 8192^3 bf16 timed in the same run. ``native``: transformers' own
  ``MiniMaxM3VLForCausalLM`` with the same shapes (random bf16 weights: its loader is not the subject), the same
  workloads, OOM where it runs out of memory. A random-weight indexer selects nearly independent pages per token,
  the sparse-attention kernel's worst case; ``--selection clustered`` attends over pages with a trained indexer's
  locality instead (the indexer still runs and is timed).
* **One sparse layer at long context** (``--layer-lengths``, up to the release's 1,048,576 positions): the
  attention of one real-width sparse layer (indexer scores, top-k and sparse attention, query-chunked as the score
  buffer requires, as the model runs it) against the same layer's dense attention, timed at the lengths up to
  ``--layer-dense-max`` and extrapolated beyond as ``a L^2 + b L`` through the two longest timed lengths.

Prints tables; writes JSON (``--output``, atomically, after every part).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from minimax_m3.command_line import positive_ints

from minimax_m3 import MiniMaxM3Cache, MiniMaxM3Config
from minimax_m3.bench_prefill import clustered_selections
from minimax_m3.configuration_minimax_m3 import DENSE_MLP, FULL_ATTENTION, SPARSE_ATTENTION
from minimax_m3.timing import timed_seconds

from .devices import checked_device
from .modes import attention_mode
from .report import checked_output_path, write_json
from .timing import peak_memory_gib, release_memory, reset_peak_memory

__all__ = ["release_layer_counts", "LayerPartTimer", "estimate_time_to_first_token", "experts_flops",
           "quadratic_extrapolation", "matmul_tflops", "run", "main"]

FIRST_REGULAR_TOKEN = 3
MATMUL_SIZE = 8192


def release_layer_counts() -> tuple:
    """``(dense, sparse)``: the released model's full-attention dense-MLP layers and sparse-attention MoE layers
    (``MiniMaxM3Config``'s defaults are the release's: 3 and 57)."""
    release = MiniMaxM3Config()
    kinds = list(zip(release.layer_types, release.mlp_layer_types))
    dense = sum(1 for kind in kinds if kind == (FULL_ATTENTION, DENSE_MLP))
    return dense, len(kinds) - dense


def layer_kind(config, index: int) -> str:
    """``"dense"`` (full attention, dense MLP) or ``"sparse"`` (a sparse-attention layer, whatever the mode runs)."""
    return "sparse" if config.layer_types[index] == SPARSE_ATTENTION else "dense"


class LayerPartTimer:
    """Times every call of each decoder layer and of its attention and MLP modules: CUDA events on a GPU (the host
    does not wait), the host clock on the CPU. ``collect()`` returns ``{(layer, part): milliseconds}`` summed over
    the calls since the last ``collect()`` (a chunked forward calls each module once per chunk)."""

    PARTS = ("layer", "attention", "mlp")

    def __init__(self, model, device: torch.device):
        self.cuda = device.type == "cuda"
        self.records = []
        self.handles = []
        for index, layer in enumerate(model.model.layers):
            mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe")
            for part, module in zip(self.PARTS, (layer, layer.self_attn, mlp)):
                self._attach(module, (index, part))

    def _stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _attach(self, module, key) -> None:
        started = []

        def before(_module, _args):
            started.append(self._stamp())

        def after(_module, _args, _output):
            self.records.append((key, started.pop(), self._stamp()))

        self.handles.append(module.register_forward_pre_hook(before))
        self.handles.append(module.register_forward_hook(after))

    def collect(self) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
        totals = {}
        for key, start, end in self.records:
            milliseconds = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            totals[key] = totals.get(key, 0.0) + milliseconds
        self.records.clear()
        return totals

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _timed(fn, device: torch.device) -> float:
    """Milliseconds of one call of ``fn``."""
    return timed_seconds(fn, device) * 1e3


def matmul_tflops(device: torch.device, size: Optional[int] = None, repeats: int = 20) -> float:
    """``torch.matmul`` of two ``size``^2 bf16 matrices (default 8192; on the CPU fp32 of 1024): median TFLOP/s after
    a warm-up."""
    size = size or (MATMUL_SIZE if device.type == "cuda" else 1024)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)
    milliseconds = statistics.median(_timed(lambda: torch.matmul(a, b), device) for _ in range(repeats))
    return 2 * size**3 / (milliseconds * 1e-3) / 1e12


def experts_flops(config, tokens: int) -> int:
    """The multiply-adds x 2 of one MoE block over ``tokens`` tokens: the router, ``num_experts_per_tok`` routed
    experts and the shared expert, each a gated MLP of three matrices."""
    hidden = config.hidden_size
    per_token = 2 * hidden * config.num_local_experts + 2 * 3 * hidden * (
        config.num_experts_per_tok * config.intermediate_size + config.shared_intermediate_size)
    return per_token * tokens


def estimate_time_to_first_token(config, parts: dict, total_ms: float, counts: Optional[tuple] = None) -> dict:
    """The whole model's prefill time from one slice's: ``dense x`` the median dense layer + ``sparse x`` the median
    sparse-kind layer + what the slice spends outside its layers (embedding, final norm, ``lm_head``).
    ``counts``: ``(dense, sparse)`` layers of the whole model (default the release's)."""
    dense_count, sparse_count = counts or release_layer_counts()
    layers = sorted({index for index, _ in parts})
    by_kind = {"dense": [], "sparse": []}
    for index in layers:
        by_kind[layer_kind(config, index)].append(index)
    missing = [kind for kind, count in (("dense", dense_count), ("sparse", sparse_count)) if count and not by_kind[kind]]
    if missing:
        raise ValueError(f"the slice has no {' or '.join(missing)} layer to estimate from")

    def median_of(kind, part):
        return statistics.median(parts[(index, part)] for index in by_kind[kind]) if by_kind[kind] else 0.0

    rest = total_ms - sum(parts[(index, "layer")] for index in layers)
    estimate = {
        "dense_layer_ms": median_of("dense", "layer"), "sparse_layer_ms": median_of("sparse", "layer"),
        "sparse_layer_attention_ms": median_of("sparse", "attention"), "sparse_layer_mlp_ms": median_of("sparse", "mlp"),
        "dense_layer_attention_ms": median_of("dense", "attention"), "dense_layer_mlp_ms": median_of("dense", "mlp"),
        "outside_layers_ms": rest, "dense_layers": dense_count, "sparse_layers": sparse_count,
    }
    estimate["estimated_ms"] = dense_count * estimate["dense_layer_ms"] + sparse_count * estimate["sparse_layer_ms"] + rest
    return estimate


def quadratic_extrapolation(points: Sequence[tuple], length: int) -> float:
    """``a L^2 + b L`` through the last two ``(L, seconds)`` points (sorted by ``L``), at ``length``."""
    if len(points) < 2:
        raise ValueError(f"extrapolation needs two timed lengths, got {len(points)}")
    (l1, t1), (l2, t2) = sorted(points)[-2:]
    a = (t2 / l2 - t1 / l1) / (l2 - l1)
    b = t1 / l1 - a * l1
    return a * length**2 + b * length


# ------------------------------------------------------------------ the slice
def _ids(config, length: int, seed: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_REGULAR_TOKEN, config.vocab_size, (1, length), generator=generator).to(device)


def time_workloads(model, config, device, lengths: Sequence[int], chunk: int, chunk_context: int, repeats: int,
                   native: bool = False) -> list:
    """Fresh prefills of each of ``lengths`` and one ``chunk`` over a ``chunk_context - chunk`` prefix: one warm-up,
    then the median of ``repeats`` (per-layer parts from the timed run of median total; ``native``: totals only)."""
    from .modes import forward_over_cache

    timer = None if native else LayerPartTimer(model, device)
    rows = []
    try:
        for length in lengths:
            rows.append(_time_one(model, config, device, timer, repeats, "fresh", length, native, chunk=0))
        if chunk:
            rows.append(_time_one(model, config, device, timer, repeats, "chunk", chunk_context, native, chunk=chunk,
                                  forward_over_cache=forward_over_cache))
    finally:
        if timer is not None:
            timer.remove()
    return rows


def _time_one(model, config, device, timer, repeats, workload, length, native, chunk, forward_over_cache=None) -> dict:
    row = {"workload": workload, "tokens": chunk or length, "context": length}
    ids = _ids(config, length, seed=length, device=device)
    state = None
    try:
        with torch.no_grad():
            if workload == "fresh":
                def call():
                    model(input_ids=ids, logits_to_keep=1, use_cache=False)
            else:
                state = {"cache": None if native else MiniMaxM3Cache(model.config, 1)}
                if not native:
                    state["cache"].reserve([length])
                forward_over_cache(model, ids[:, : length - chunk], state, native=native)

                def call():
                    forward_over_cache(model, ids[:, length - chunk:], state, native=native)
                    # back to the prefix (a negative count removes tokens in both caches)
                    state["cache"].crop(-chunk)
            call()
            if timer is not None:
                timer.collect()
            runs = []
            for _ in range(repeats):
                reset_peak_memory([device])
                milliseconds = _timed(call, device)
                runs.append((milliseconds, timer.collect() if timer is not None else {}, peak_memory_gib([device])))
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    if row.get("status") == "OOM":
        state = call = None
        release_memory()
        return row
    runs.sort(key=lambda run: run[0])
    milliseconds, parts, peak = runs[len(runs) // 2]
    row.update(status="ok", ms=milliseconds, ms_runs=[run[0] for run in runs], peak_gib=peak,
               parts={f"{index}.{part}": value for (index, part), value in sorted(parts.items())})
    row["_parts"] = parts
    state = None
    release_memory()
    return row


def slice_part(checkpoint: Path, device, modes: Sequence[str], lengths, chunk, chunk_context, repeats,
               experts_length: int, native_lengths, flush, selection: str = "model") -> dict:
    from minimax_m3.bench_loading import load_measured

    matmul_size = MATMUL_SIZE if device.type == "cuda" else 1024
    result = {"checkpoint": str(checkpoint), "matmul_size": matmul_size,
              "matmul_tflops": matmul_tflops(device, matmul_size)}
    model, result["load"] = load_measured(checkpoint, str(device))
    config = model.config
    result["config"] = {key: getattr(config, key) for key in (
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "num_local_experts", "num_experts_per_tok", "intermediate_size", "shared_intermediate_size",
        "dense_intermediate_size", "max_position_embeddings", "layer_types", "mlp_layer_types")}
    flush(result)
    runs = result["runs"] = []
    longest = max([*lengths, chunk_context if chunk else 0])
    for mode in [m for m in modes if m != "native"]:
        with attention_mode(model, mode):
            clustered = mode == "sparse" and selection == "clustered"
            locality = (clustered_selections(model.model.page_selector, config, longest, device) if clustered
                        else contextlib.nullcontext())
            with locality:
                rows = time_workloads(model, config, device, lengths, chunk, chunk_context, repeats)
            for row in rows:
                parts = row.pop("_parts", None)
                if parts is not None:
                    row["estimate"] = estimate_time_to_first_token(config, parts, row["ms"])
                runs.append({"mode": mode, "selection": selection if mode == "sparse" else None, **row})
                flush(result)
    experts = [r for r in runs if r["mode"] == "sparse" and r["workload"] == "fresh" and r["tokens"] == experts_length
               and r.get("status") == "ok"]
    if experts:
        seconds = experts[0]["estimate"]["sparse_layer_mlp_ms"] / 1e3
        rate = experts_flops(config, experts_length) / seconds / 1e12
        result["experts"] = {"tokens": experts_length, "ms": seconds * 1e3, "tflops": rate,
                             "fraction_of_matmul": rate / result["matmul_tflops"]}
    result["estimates"] = _estimate_ratios(runs)
    flush(result)
    native_config = config
    model = None
    release_memory()
    if "native" in modes:
        from minimax_m3.bench_prefill import build

        try:
            native = build("native", native_config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        except torch.OutOfMemoryError:
            native = None
            runs.append({"mode": "native", "workload": "build", "status": "OOM"})
        if native is not None:
            for row in time_workloads(native, native_config, device, native_lengths, chunk, chunk_context, repeats,
                                      native=True):
                row.pop("_parts", None)
                runs.append({"mode": "native", **row})
                flush(result)
        native = None
        release_memory()
    return result


def _estimate_ratios(runs) -> list:
    """Per workload: the estimated whole-model times in sparse and dense mode and their ratio."""
    by_key = {}
    for run_row in runs:
        if run_row.get("status") == "ok" and "estimate" in run_row:
            by_key.setdefault((run_row["workload"], run_row["context"], run_row["tokens"]), {})[run_row["mode"]] = run_row
    rows = []
    for (workload, context, tokens), modes in sorted(by_key.items()):
        if "sparse" in modes and "dense" in modes:
            sparse = modes["sparse"]["estimate"]["estimated_ms"]
            dense = modes["dense"]["estimate"]["estimated_ms"]
            rows.append({"workload": workload, "context": context, "tokens": tokens,
                         "selection": modes["sparse"].get("selection"), "sparse_estimated_ms": sparse,
                         "dense_estimated_ms": dense, "dense_over_sparse": dense / sparse})
    return rows


# ------------------------------------------------------------------ one layer at long context
def layer_part(device, lengths: Sequence[int], dense_max: int, repeats: int, selection: str, flush, result) -> list:
    """One real-width sparse layer's attention (``bench_prefill.bench_attention``'s core and block) per length; dense
    up to ``dense_max`` tokens, extrapolated beyond."""
    from minimax_m3.bench_prefill import bench_attention, geometry_config

    tiny = device.type == "cpu"
    config = geometry_config(1, tiny=tiny, dense_layers=0, max_position_embeddings=max(max(lengths), 1 << 20))
    dtype = torch.float32 if tiny else torch.bfloat16
    rows = result["layer"] = []
    for length in sorted(lengths):
        modes = ("sparse", "dense") if length <= dense_max else ("sparse",)
        try:
            row = bench_attention(config, length, device, dtype, repeats, selection, modes=modes)
            row["status"] = "ok"
        except torch.OutOfMemoryError:
            row = {"length": length, "selection": selection, "status": "OOM"}
        row = {key: None if isinstance(value, float) and value != value else value for key, value in row.items()}
        row["dense_timed"] = "dense" in modes
        rows.append(row)
        release_memory()
        flush(result)
    for key in ("dense_core_seconds", "dense_attention_seconds"):
        points = [(r["length"], r[key]) for r in rows if r["dense_timed"] and r.get(key) is not None]
        for r in rows:
            if not r["dense_timed"] and len(points) >= 2:
                r[key.replace("_seconds", "_extrapolated_seconds")] = quadratic_extrapolation(points, r["length"])
    for r in rows:
        sparse, dense = r.get("sparse_core_seconds"), r.get("dense_core_seconds") or r.get("dense_core_extrapolated_seconds")
        r["core_speedup"] = dense / sparse if sparse and dense else None
    flush(result)
    return rows


# ------------------------------------------------------------------ tables
def _ms(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def print_report(result: dict, stream=None) -> None:
    stream = stream or sys.stdout
    if "load" in result:
        from minimax_m3.bench_loading import describe

        print(f"\n{describe(result['load'])}\nmatmul {result['matmul_size']}^3: {result['matmul_tflops']:.0f} TFLOP/s",
              file=stream)
    if result.get("runs"):
        print("\n| mode | workload | tokens | context | ms | dense layer ms | sparse layer ms (attention + MLP) | "
              "outside layers ms | estimated whole model ms | peak GiB |", file=stream)
        print("|---|---|---|---|---|---|---|---|---|---|", file=stream)
        for r in result["runs"]:
            mode = r["mode"] + (" (clustered)" if r.get("selection") == "clustered" else "")
            if r.get("status") != "ok":
                print(f"| {mode} | {r['workload']} | {r.get('tokens', '-')} | {r.get('context', '-')} | "
                      f"{r.get('status')} | - | - | - | - | - |", file=stream)
                continue
            e = r.get("estimate")
            layer = ("- | - | - | -" if e is None else
                     f"{_ms(e['dense_layer_ms'])} | {_ms(e['sparse_layer_ms'])} ({_ms(e['sparse_layer_attention_ms'])} + "
                     f"{_ms(e['sparse_layer_mlp_ms'])}) | {_ms(e['outside_layers_ms'])} | {_ms(e['estimated_ms'])}")
            peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
            print(f"| {mode} | {r['workload']} | {r['tokens']} | {r['context']} | {_ms(r['ms'])} | {layer} | {peak} |",
                  file=stream)
    for e in result.get("estimates", []):
        print(f"estimate, {e['workload']} {e['tokens']} over {e['context']}: whole model sparse"
              f"{' (clustered)' if e.get('selection') == 'clustered' else ''} "
              f"{e['sparse_estimated_ms'] / 1e3:.2f} s, dense {e['dense_estimated_ms'] / 1e3:.2f} s: "
              f"{e['dense_over_sparse']:.2f}x", file=stream)
    if "experts" in result:
        x = result["experts"]
        print(f"experts at {x['tokens']} tokens: {x['ms']:.1f} ms, {x['tflops']:.0f} TFLOP/s = "
              f"{x['fraction_of_matmul']:.0%} of the matmul rate", file=stream)
    if result.get("layer"):
        print("\n| length | sparse core ms | dense core ms | core speed-up | sparse block ms | dense block ms |", file=stream)
        print("|---|---|---|---|---|---|", file=stream)
        for r in result["layer"]:
            def seconds(key):
                value = r.get(key)
                return "-" if value is None else f"{value * 1e3:,.1f}"
            dense = seconds("dense_core_seconds") if r["dense_timed"] else f"~{seconds('dense_core_extrapolated_seconds')} (extrapolated)"
            block = (seconds("dense_attention_seconds") if r["dense_timed"]
                     else f"~{seconds('dense_attention_extrapolated_seconds')} (extrapolated)")
            speedup = "-" if r.get("core_speedup") is None else f"{r['core_speedup']:.1f}x"
            print(f"| {r['length']} | {seconds('sparse_core_seconds')} | {dense} | {speedup} | "
                  f"{seconds('sparse_attention_seconds')} | {block} |", file=stream)


# ------------------------------------------------------------------ command line
def _optional_positive_ints(text: str) -> tuple:
    """``positive_ints``, or nothing for an empty string (that part is skipped)."""
    return positive_ints(text) if text.strip() else ()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint at the release's shapes (python -m minimax_m3.synthetic_checkpoint)")
    parser.add_argument("--modes", default="sparse,dense,native", help="of sparse, dense, native")
    parser.add_argument("--lengths", type=positive_ints, default=(32768, 131072), help="fresh prefill lengths")
    parser.add_argument("--chunk", type=int, default=2048, help="chunk tokens (0: no chunk workload)")
    parser.add_argument("--chunk-context", type=int, default=131072, help="where the chunk ends")
    parser.add_argument("--experts-length", type=int, default=32768,
                        help="the fresh length whose sparse layers' MoE is set against the matmul rate")
    parser.add_argument("--native-lengths", type=positive_ints, default=(8192, 32768, 131072))
    parser.add_argument("--layer-lengths", type=_optional_positive_ints, default=(131072, 262144, 1048576),
                        help="one sparse layer's attention at these lengths ('' : skip)")
    parser.add_argument("--layer-dense-max", type=int, default=262144,
                        help="the longest length whose dense attention is timed (longer ones are extrapolated)")
    parser.add_argument("--selection", default="model", choices=["model", "clustered"],
                        help="sparse mode attends over the indexer's selections or over clustered ones with a trained "
                             "indexer's locality (the indexer still runs and is timed; minimax_m3.bench_prefill)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", default=None)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return parser


def run(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - {"sparse", "dense", "native"})
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from sparse, dense, native")
    lengths, native_lengths, layer_lengths = args.lengths, args.native_lengths, args.layer_lengths
    for name, value in (("--repeats", args.repeats), ("--chunk-context", args.chunk_context)):
        if value < 1:
            raise SystemExit(f"{name} must be >= 1, got {value}")
    if args.chunk < 0 or args.chunk >= args.chunk_context:
        raise SystemExit(f"--chunk must lie in [0, --chunk-context), got {args.chunk}")
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        raise SystemExit(f"--checkpoint {args.checkpoint}: not a checkpoint directory (no config.json)")
    if args.checkpoint is None and not layer_lengths:
        raise SystemExit("nothing to run: pass --checkpoint, --layer-lengths or both")
    device = checked_device(args.device)
    output = checked_output_path(args.output, "real_width", overwrite=args.overwrite)
    result = {"device": str(device), "argv": list(sys.argv[1:] if argv is None else argv), "partial": True}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)

    def flush(_partial=None):
        write_json(output, result)

    flush()
    if args.checkpoint is not None:
        result.update(slice_part(args.checkpoint, device, modes, lengths, args.chunk, args.chunk_context, args.repeats,
                                 args.experts_length, native_lengths, lambda part: (result.update(part), flush()),
                                 args.selection))
        flush()
    if layer_lengths:
        layer_part(device, layer_lengths, args.layer_dense_max, args.repeats, args.selection, flush, result)
    result["partial"] = False
    flush()
    print_report(result)
    print(f"\nwrote {output}")
    return result


def main(argv=None) -> None:
    from .cli import run_main

    run_main(run, argv)


if __name__ == "__main__":
    main()
