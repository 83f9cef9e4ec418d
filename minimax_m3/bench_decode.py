"""Where a decode step's time goes: ``python -m minimax_m3.bench_decode``.

A model of ``minimax_m3.bench_prefill.geometry_config`` (M3's attention geometry, 1 dense + ``--sparse-layers``
sparse layers, tiny MoE, random weights; ``--tiny`` for the CPU-sized one) decodes ``--steps`` one-token steps of
``--batch`` sequences after a ``--context``-token context written into a static cache as random keys, values and
index keys (``fill_random_context``: a step's work does not depend on how the context got there). With CUDA graphs
(default on CUDA, as ``generate`` runs) or ``--eager``. Prints the median step time (CUDA events; host clock on CPU)
and the torch profiler's kernels per step, grouped by name: how many, and their time. ``--eager --by-operator``
groups the device time by operator and input shapes instead, which tells GEMMs of different shapes apart (a graph
replay records no operators). ``--timeline`` (CUDA) also prints one more step's kernels in the order they ran, each
with its start, duration and the stream the profiler reports (in a graph replay, the streams the graph's branches
ran on, which need not be the capture's), and how much of the step's kernel span no kernel covered: with the step's
branches on two streams the kernels' summed time exceeds the step's, and what counts is which kernels lie on the
longer branch (overlapping starts and ends show it).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict

import torch

from .command_line import device_argument, positive_int
from .bench_prefill import build, geometry_config
from .cache import MiniMaxM3StaticCache
from .timing import median_cuda_ms

__all__ = ["fill_random_context", "decode_step_profile", "kernel_label", "main", "timeline_summary"]

_QUALIFIER = re.compile(r"(?:\(anonymous namespace\)|[A-Za-z_]\w*)::")


def kernel_label(name: str, width: int = 120) -> str:
    """A CUDA kernel's name without namespace qualifiers, cut to ``width``: ATen's elementwise kernels differ only
    in the functor deep inside their template arguments, which a plain cut loses."""
    return _QUALIFIER.sub("", name.removeprefix("void "))[:width]


def fill_random_context(model, cache: MiniMaxM3StaticCache, prompt: torch.Tensor, length: int,
                        generator: torch.Generator) -> None:
    """Give every sequence of ``cache`` a ``length``-token context of random keys, values and index keys: one
    real token (``prompt[:, :1]``) allocates the stores, then they are overwritten and the lengths set."""
    with torch.no_grad():
        model(input_ids=prompt[:, :1], past_key_values=cache, logits_to_keep=1)
    for layer in cache.layers:
        for _, tensor in layer.tensors():
            values = torch.randn(tensor.shape, generator=generator, device=tensor.device, dtype=torch.float32)
            tensor.copy_(values.to(tensor.dtype))
    cache._set_lengths([length] * prompt.shape[0])
    cache.columns_seen = length


def timeline_summary(kernels) -> dict:
    """Of one step's kernels ``[(start, end, stream, name)]`` (µs, any order): the span from the first start to the
    last end, the time some kernel ran (the union of their intervals), the idle rest, and the summed kernel time.
    The span starts at the first kernel that is not a memory copy or set: a step stages its inputs by copies the host
    issues before it launches the graph, and the host's time between them is not the device's idle time; copies
    inside the span count as work."""
    first = min((start for start, _, _, name in kernels if not name.startswith(("Memcpy", "Memset"))), default=None)
    ordered = sorted(kernel for kernel in kernels if first is not None and kernel[0] >= first)
    busy, covered_to = 0.0, None
    for start, end, _, _ in ordered:
        if covered_to is None or start > covered_to:
            busy += end - start
            covered_to = end
        elif end > covered_to:
            busy += end - covered_to
            covered_to = end
    span = (max(end for _, end, _, _ in ordered) - ordered[0][0]) if ordered else 0.0
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy,
            "kernel_us": sum(end - start for start, end, _, _ in ordered)}


def decode_step_profile(model, *, context: int, batch: int, steps: int, graphs: bool, by_operator: bool = False,
                        timeline: bool = False) -> dict:
    """Median seconds per step and the profiled kernels (CUDA) or operators (CPU) per step; ``by_operator``: per
    (operator, input shapes) instead, with the device time of the kernels each launched itself (CUDA, eager);
    ``timeline``: also one more step's kernels as ``[(start µs from the step's first, end, stream, name)]``."""
    if by_operator and graphs:
        raise ValueError("by_operator needs eager steps (graphs=False): a graph replay records no operators")
    device = model.get_input_embeddings().weight.device
    if timeline and device.type != "cuda":
        raise ValueError("timeline needs CUDA: it orders the step's kernels on the device")
    generator = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (batch, 1), device=device, generator=generator)
    cache = MiniMaxM3StaticCache(model.config, max_cache_len=context + 3 * steps + 2)
    fill_random_context(model, cache, prompt, context, generator)
    state = {"token": prompt}

    def step():
        with torch.no_grad():
            logits = model(input_ids=state["token"], past_key_values=cache, logits_to_keep=1,
                           decode_cuda_graphs=graphs).logits
            state["token"] = logits[:, -1:].argmax(-1)

    step()  # the first graphed step captures
    cuda = device.type == "cuda"
    if cuda:
        median_seconds = median_cuda_ms(step, steps) / 1e3
    else:
        step()
        seconds = []
        for _ in range(steps):
            began = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - began)
        median_seconds = statistics.median(seconds)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, record_shapes=by_operator) as profile:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0, 0.0])  # name -> [count, microseconds]
    if by_operator:
        for entry in profile.key_averages(group_by_input_shape=True):
            micros = entry.self_device_time_total if cuda else entry.self_cpu_time_total
            if micros > 0 and entry.key.startswith("aten::"):
                name = f"{entry.key} {entry.input_shapes}"
                kernels[name][0] += entry.count
                kernels[name][1] += micros
    for event in ([] if by_operator else profile.events()):
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if cuda and not on_device:
            continue
        if not cuda and (event.cpu_parent is not None or not event.name.startswith("aten::")):
            continue  # top-level operators only
        entry = kernels[event.name]
        entry[0] += 1
        entry[1] += (event.device_time if on_device else event.cpu_time)
    per_step = {name: (count / steps, total / steps) for name, (count, total) in kernels.items()}
    result = {"seconds": median_seconds, "per_step": per_step, "device": str(device), "graphs": graphs}
    if timeline:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            step()
            torch.cuda.synchronize()
        spans = [(event.time_range.start, event.time_range.end, event.device_resource_id, event.name)
                 for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
        first = min((start for start, _, _, _ in spans), default=0.0)
        result["timeline"] = sorted((start - first, end - first, stream, name) for start, end, stream, name in spans)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=positive_int, default=131072)
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--sparse-layers", type=positive_int, default=3)
    parser.add_argument("--mode", choices=["sparse", "dense"], default="sparse")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--by-operator", action="store_true",
                        help="with --eager: device time per operator and input shapes instead of per kernel name")
    parser.add_argument("--tiny", action="store_true", help="the CPU-sized geometry")
    parser.add_argument("--device", type=device_argument, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--top", type=positive_int, default=25, help="kernel names to list")
    parser.add_argument("--timeline", action="store_true",
                        help="CUDA: one more step's kernels in order, with start, duration and stream")
    args = parser.parse_args(argv)
    if args.by_operator and not args.eager:
        parser.error("--by-operator needs --eager: a CUDA graph replay records no operators")
    device = args.device
    if args.timeline and device.type != "cuda":
        parser.error("--timeline needs a CUDA device: it orders the step's kernels on the device")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(args.mode, geometry_config(args.sparse_layers, tiny=args.tiny), device, dtype)
    result = decode_step_profile(model, context=args.context, batch=args.batch, steps=args.steps,
                                 graphs=not args.eager, by_operator=args.by_operator, timeline=args.timeline)
    rows = sorted(result["per_step"].items(), key=lambda item: -item[1][1])
    unit = "kernels" if device.type == "cuda" and not args.by_operator else "operators"
    print(f"{args.mode}, context {args.context:,}, batch {args.batch}, {'graphs' if not args.eager else 'eager'} on "
          f"{device}: {result['seconds'] * 1e3:.3f} ms per step (median of {args.steps}); "
          f"{sum(c for c, _ in result['per_step'].values()):.0f} {unit} and "
          f"{sum(t for _, t in result['per_step'].values()):,.0f} us of them per step")
    print(f"| {unit[:-1]} | per step | us per step |\n|---|---|---|")
    for name, (count, micros) in rows[: args.top]:
        label = kernel_label(name) if unit == "kernels" else name[:150]
        print(f"| {label} | {count:g} | {micros:,.1f} |")
    if args.timeline:
        kernels = result["timeline"]
        summary = timeline_summary(kernels)
        print(f"\none more step: {len(kernels)} kernels and copies; the kernels span {summary['span_us']:,.1f} us, "
              f"some kernel running for {summary['busy_us']:,.1f} us (idle {summary['idle_us']:,.1f} us), "
              f"{summary['kernel_us']:,.1f} us of kernels summed")
        print("| start us | us | stream | kernel |\n|---|---|---|---|")
        for start, end, stream, name in kernels:
            print(f"| {start:,.1f} | {end - start:.1f} | {stream} | {kernel_label(name, 90)} |")


if __name__ == "__main__":
    main()
