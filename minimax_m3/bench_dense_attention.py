"""GQA-native dense attention against repeating K/V first, at MiniMax-M3's geometry:
``python -m minimax_m3.bench_dense_attention`` (CUDA).

Cases: a fresh 8K prefill, 2K-token chunks over 128K and 32K cached tokens, one token over 128K. Per case: the max
error of both against an fp32 reference on the last 64 queries (every head, bottom-right causal), their difference,
the median time of 10 calls after a 256 MiB L2 flush (CUDA events), and the kernels SDPA picked for ours. Prints a
table.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.attention.bias import causal_lower_right

from .command_line import positive_int
from .dense_attention import sdpa_attention_forward
from .timing import median_cuda_ms

CASES = (("fresh 8K", 8192, 8192), ("2K chunk over 128K", 2048, 131072), ("2K chunk over 32K", 2048, 32768),
         ("1 token over 128K", 1, 131072))


def _kernels(fn) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    names = {event.key[:60] for event in profile.key_averages() if event.device_type == torch.autograd.DeviceType.CUDA}
    return "; ".join(sorted(names))


def repeated_kv_attention(q, k, v, scale):
    """What the dense path did before: K/V repeated to every query head, then SDPA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q_length, kv_length = q.shape[2], k.shape[2]
    if q_length == kv_length:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif q_length == 1:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_length, kv_length),
                                                               scale=scale)
    return out.transpose(1, 2)


def reference_tail(q, k, v, scale, rows: int = 64):
    """fp32 bottom-right causal attention of the last ``rows`` queries, ``[1, rows, H, D]``."""
    group = q.shape[1] // k.shape[1]
    rows = min(rows, q.shape[2])
    kv_length = k.shape[2]
    logits = q[:, :, -rows:].float() @ k.repeat_interleave(group, 1).float().transpose(-1, -2) * scale
    positions = torch.arange(kv_length - rows, kv_length, device=q.device)
    logits = logits.masked_fill(torch.arange(kv_length, device=q.device)[None] > positions[:, None], float("-inf"))
    return (torch.softmax(logits, -1) @ v.repeat_interleave(group, 1).float()).transpose(1, 2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_dense_attention needs a CUDA GPU")
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 64, 4, 128
    scale = head_dim ** -0.5
    print("| case | error ours | error repeat-KV | ours - repeat | ours ms | repeat-KV ms | speed-up | kernels (ours) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, q_length, kv_length in CASES:
        q = torch.randn(1, heads, q_length, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, kv_length, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, kv_heads, kv_length, head_dim, device="cuda", dtype=torch.bfloat16)

        def ours():
            return sdpa_attention_forward(None, q, k, v, None, scaling=scale, is_causal=True)[0]

        def repeated():
            return repeated_kv_attention(q, k, v, scale)

        got, baseline, truth = ours(), repeated(), reference_tail(q, k, v, scale)
        rows = truth.shape[1]
        error = (got[:, -rows:].float() - truth).abs().max().item()
        baseline_error = (baseline[:, -rows:].float() - truth).abs().max().item()
        difference = (got.float() - baseline.float()).abs().max().item()
        ours_ms = median_cuda_ms(ours, args.repeats, flush_bytes=256 << 20)
        repeated_ms = median_cuda_ms(repeated, args.repeats, flush_bytes=256 << 20)
        print(f"| {name} | {error:.2e} | {baseline_error:.2e} | {difference:.2e} | {ours_ms:.3f} | {repeated_ms:.3f} | "
              f"{repeated_ms / ours_ms:.2f}x | {_kernels(ours)} |")


if __name__ == "__main__":
    main()
