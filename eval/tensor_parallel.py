"""Prefill throughput of one model three ways: tensor parallel over the GPUs of one host (transformers'
``tp_plan="auto"``, one process per GPU), on one GPU, and split layer by layer over the same GPUs with ``device_map``
(one GPU at a time):

    python -m torch.distributed.run --nproc_per_node 2 -m eval.tensor_parallel --layout tp --output tp.json
    python -m eval.tensor_parallel --layout single --output single.json
    python -m eval.tensor_parallel --layout device_map --gpus 2 --output device_map.json

The model is ``--checkpoint`` (written first, if it does not exist, with the ``--preset``'s random weights:
``m3-geometry`` is M3's attention geometry, 1 dense + 3 sparse layers with a tiny MoE; ``tiny`` is a CPU smoke run
over gloo). Each length is a fresh prefill of one sequence into a new cache, timed after a warm-up as the median of
``--repeats`` (every rank synchronised before and after). The JSON (rank 0's) holds the times and tokens/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from minimax_m3.command_line import positive_int, positive_ints

from .cli import UsageError, add_debug_argument, run_main
from .report import checked_output_path, write_json

__all__ = ["build_parser", "run_command", "main", "LAYOUTS", "layer_device_map"]

LAYOUTS = ("tp", "single", "device_map")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=LAYOUTS, required=True)
    parser.add_argument("--checkpoint", default="runs/tensor-parallel-m3-geometry",
                        help="the model (written with --preset's random weights if missing)")
    parser.add_argument("--preset", choices=("m3-geometry", "tiny"), default="m3-geometry")
    parser.add_argument("--lengths", type=positive_ints, default=(32768, 131072))
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--gpus", type=positive_int, default=2, help="device_map: the GPUs the layers are split over")
    parser.add_argument("--mode", choices=("sparse", "dense"), default="sparse")
    parser.add_argument("--output", default=None, help="JSON results (default: eval_results/tensor-parallel-<time>.json)")
    parser.add_argument("--overwrite", action="store_true")
    return add_debug_argument(parser)


def _write_checkpoint(path: Path, preset: str) -> None:
    from minimax_m3.bench_prefill import build, geometry_config

    config = geometry_config(3, tiny=preset == "tiny")
    model = build("sparse", config, "cpu", torch.float32 if preset == "tiny" else torch.bfloat16)
    staging = path.with_name(f".{path.name}.partial")
    model.save_pretrained(staging)
    staging.rename(path)


def layer_device_map(config, gpus: int) -> dict:
    """Contiguous layer blocks per GPU (embedding on the first, norm and head on the last): the pipeline a model too
    big for one GPU gets from ``device_map``, one GPU working at a time."""
    layers = config.num_hidden_layers
    mapping = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": gpus - 1, "lm_head": gpus - 1}
    for index in range(layers):
        mapping[f"model.layers.{index}"] = min(gpus - 1, index * gpus // layers)
    return mapping


def _load(args, device):
    import minimax_m3  # noqa: F401  (registers the Auto classes)
    from minimax_m3 import MiniMaxM3Config, MiniMaxM3ForCausalLM

    dtype = torch.float32 if args.preset == "tiny" else torch.bfloat16
    if args.layout == "tp":
        return MiniMaxM3ForCausalLM.from_pretrained(args.checkpoint, tp_plan="auto", dtype=dtype)
    if args.layout == "device_map":
        config = MiniMaxM3Config.from_pretrained(args.checkpoint)
        return MiniMaxM3ForCausalLM.from_pretrained(args.checkpoint, dtype=dtype,
                                                    device_map=layer_device_map(config, args.gpus))
    return MiniMaxM3ForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(device)


def _synchronize(distributed: bool) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if distributed:
        torch.distributed.barrier()


def run_command(argv: Optional[Sequence[str]] = None) -> Optional[dict]:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.gpus < 1:
        raise UsageError("--repeats and --gpus must be positive")
    distributed = args.layout == "tp"
    if distributed != ("RANK" in os.environ):
        raise UsageError("--layout tp runs under torch.distributed.run (one process per GPU); the other layouts in "
                         "one plain process")
    if args.layout == "device_map" and torch.cuda.device_count() < args.gpus:
        raise UsageError(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA devices")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rank = int(os.environ.get("RANK", 0))
    output = checked_output_path(args.output or Path("eval_results") / f"tensor-parallel-{stamp}.json",
                                 "tensor-parallel", overwrite=args.overwrite) if rank == 0 else None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if distributed:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    checkpoint = Path(args.checkpoint)
    if rank == 0 and not (checkpoint / "config.json").is_file():
        _write_checkpoint(checkpoint, args.preset)
    if distributed:
        torch.distributed.barrier()
    model = _load(args, device).eval()
    model.config.attention_mode = args.mode
    input_device = model.get_input_embeddings().weight.device
    if hasattr(model.get_input_embeddings().weight, "to_local"):
        input_device = device
    rows = []
    from minimax_m3 import MiniMaxM3Cache

    for length in args.lengths:
        ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        ids = ids.to(input_device)
        seconds = []
        for repeat in range(args.repeats + 1):  # the first is a warm-up (compilation, allocator)
            _synchronize(distributed)
            start = time.perf_counter()
            with torch.no_grad():
                model(input_ids=ids, past_key_values=MiniMaxM3Cache(model.config), use_cache=True, logits_to_keep=1)
            _synchronize(distributed)
            if repeat:
                seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds)
        rows.append({"length": length, "seconds": seconds, "median_seconds": median, "tokens_per_second": length / median})
        if rank == 0:
            print(f"{args.layout} {args.mode} {length} tokens: {median * 1e3:.1f} ms ({length / median:,.0f} tokens/s)",
                  flush=True)
    result = None
    if rank == 0:
        world = torch.distributed.get_world_size() if distributed else 1
        result = {"kind": "tensor_parallel", "layout": args.layout, "mode": args.mode, "preset": args.preset,
                  "checkpoint": str(checkpoint), "processes": world,
                  "gpus": world if distributed else (args.gpus if args.layout == "device_map" else 1),
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "rows": rows}
        write_json(output, result)
    if distributed:
        torch.distributed.destroy_process_group()
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    run_main(run_command, argv)


if __name__ == "__main__":
    main()
