"""The model's compiled elementwise chains at MiniMax-M3's real width: ``python -m minimax_m3.bench_fusion``.

Per chain, as the model calls it (the experts' SwiGLU on the strided halves of their ``[4T, 2I]`` projection, the
shared expert's SwiGLU, the experts' weighted token sum, the residual add and norm, the queries' norm and RoPE, the
router's top-k weights): ``fusion.compiled`` (compiled per width, generic in the token count; called at another
length first, so the timed call runs the length-generic kernels), ``torch.compile(dynamic=True)`` warmed the same
way, and eager. Floor: the chain's bytes (inputs read once, outputs written once) at the copy rate measured in the
same run. Median of 10 calls (CUDA events). Prints a table.
"""

from __future__ import annotations

import argparse

import torch

from .command_line import positive_int
from .experts import weighted_token_sum
from .fusion import _inductor_options, compiled
from .modeling_minimax_m3 import _add_and_norm_math, _norm_and_rope_math, route_weights, swiglu_oai
from .timing import median_cuda_ms, timed_seconds

TOP_K, HEADS, HEAD_DIM, ROTARY_HALF, EXPERTS = 4, 64, 128, 32, 128


def chain_inputs(name: str, tokens: int, hidden: int, intermediate: int, device, generator):
    """``(function, arguments, bytes moved)`` of one chain at ``tokens``."""
    def normal(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    if name == "experts SwiGLU":
        gate, up = normal(TOP_K * tokens, 2 * intermediate, scale=3.0).chunk(2, dim=-1)
        return swiglu_oai, (gate, up, 1.702, 7.0, 1.0), 3 * TOP_K * tokens * intermediate * 2
    if name == "shared SwiGLU":
        return (swiglu_oai, (normal(tokens, intermediate, scale=3.0), normal(tokens, intermediate), 1.702, 7.0, 1.0),
                3 * tokens * intermediate * 2)
    if name == "weighted token sum":
        slots = torch.randperm(TOP_K * tokens, generator=generator, device=device)
        weights = torch.rand(tokens, TOP_K, generator=generator, device=device)
        return weighted_token_sum, (normal(TOP_K * tokens, hidden), slots, weights), (TOP_K + 1) * tokens * hidden * 2
    if name == "add and norm":
        return (_add_and_norm_math, (normal(tokens, hidden), normal(tokens, hidden), normal(hidden, scale=0.1), 1e-6, 1.0),
                4 * tokens * hidden * 2)
    if name == "query norm and RoPE":
        angles = torch.rand(tokens, ROTARY_HALF, generator=generator, device=device) * 6
        return (_norm_and_rope_math, (normal(tokens, HEADS, HEAD_DIM), normal(HEAD_DIM, scale=0.1), 1e-6, 1.0,
                                      angles.cos(), angles.sin()), 2 * tokens * HEADS * HEAD_DIM * 2)
    if name == "route weights":
        return (route_weights, (normal(tokens, EXPERTS, dtype=torch.float32), normal(EXPERTS, dtype=torch.float32,
                                                                                        scale=0.01), TOP_K, 2.5),
                tokens * EXPERTS * 4 + tokens * TOP_K * 12)
    raise KeyError(name)


CHAINS = ("experts SwiGLU", "shared SwiGLU", "weighted token sum", "add and norm", "query norm and RoPE",
          "route weights")


def _flat(output) -> torch.Tensor:
    outputs = output if isinstance(output, tuple) else (output,)
    return torch.cat([part.float().flatten() for part in outputs])


def _time_ms(fn, device, repeats: int) -> float:
    if device.type == "cuda":
        return median_cuda_ms(fn, repeats)
    fn()
    return sorted(timed_seconds(fn, device) for _ in range(repeats))[repeats // 2] * 1e3


def copy_rate(device, repeats: int, nbytes: int) -> float:
    """Bytes per second of a device copy of ``nbytes`` (read and write counted)."""
    source = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    return nbytes / (_time_ms(lambda: target.copy_(source), device, repeats) / 1e3)


def run(tokens: int, hidden: int, intermediate: int, device, repeats: int = 10) -> list:
    rows = []
    for index, name in enumerate(CHAINS):
        generator = torch.Generator(device=device).manual_seed(index)
        function, arguments, nbytes = chain_inputs(name, tokens, hidden, intermediate, device, generator)
        _, other_length, _ = chain_inputs(name, tokens // 2 + 128, hidden, intermediate, device, generator)
        ours = compiled(function.__name__, function)
        torch._dynamo.reset()
        dynamic = torch.compile(function, dynamic=True, options=_inductor_options())
        row = {"chain": name, "tokens": tokens, "bytes": nbytes}
        reference = _flat(function(*arguments))
        for label, fn in (("ours", ours), ("dynamic", dynamic), ("eager", function)):
            fn(*other_length)
            row[f"{label}_error"] = float((_flat(fn(*arguments)) - reference).abs().max())
            row[f"{label}_ms"] = _time_ms(lambda: fn(*arguments), device, repeats)
        rows.append(row)
        del arguments, other_length, reference
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive_int, default=131072)
    parser.add_argument("--hidden", type=positive_int, default=6144)
    parser.add_argument("--intermediate", type=positive_int, default=3072, help="an expert's width (3072)")
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    rows = run(args.tokens, args.hidden, args.intermediate, device, args.repeats)
    rate = copy_rate(device, args.repeats, max(row["bytes"] for row in rows))
    print(f"\n{args.tokens} tokens, hidden {args.hidden}, expert width {args.intermediate}; copy rate "
          f"{rate / 1e9:.0f} GB/s (the floor)")
    print("| chain | ours ms | dynamic=True ms | eager ms | floor ms | ours / floor | dynamic / ours | max error vs eager |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        floor = row["bytes"] / rate * 1e3
        print(f"| {row['chain']} | {row['ours_ms']:.3f} | {row['dynamic_ms']:.3f} | {row['eager_ms']:.3f} | "
              f"{floor:.3f} | {row['ours_ms'] / floor:.2f} | {row['dynamic_ms'] / row['ours_ms']:.2f} | "
              f"{row['ours_error']:.1e} |")
    return rows


if __name__ == "__main__":
    main()
