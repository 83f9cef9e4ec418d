"""How far sparse attention moves the model's next-token distributions from dense attention on long inputs.

Positions are split at ``topk * page_size`` tokens (2048 for MiniMax-M3): before it every page is selected, so
sparse must equal dense up to rounding (a control); beyond it the indexer drops pages. On sampled positions of
each group: KL(dense ‖ sparse) (mean, max), top-1 agreement and max |logit difference|.
"""

from __future__ import annotations

import json
from pathlib import Path
import torch

from .modes import attention_mode

__all__ = ["agreement_sequences", "logit_agreement", "default_agreement_length"]

_PUBLIC_DOMAIN = Path(__file__).resolve().parent / "tasks" / "data" / "public_domain.jsonl"


def default_agreement_length(config) -> int:
    """Four times the top-k window: three quarters of the positions lie where pages are dropped."""
    return 4 * config.index_topk_blocks * config.index_block_size


def agreement_sequences(tokenizer, vocab_size: int, length: int, count: int, seed: int = 0) -> torch.Tensor:
    """``[count, length]`` token ids: even rows from the bundled public-domain text (repeated to ``length``,
    each row from another offset), odd rows uniformly random tokens (``seed``)."""
    if length < 2 or count < 1:
        raise ValueError(f"length must be >= 2 and count >= 1, got length={length}, count={count}")
    with open(_PUBLIC_DOMAIN, encoding="utf-8") as handle:
        text = "\n\n".join(json.loads(line)["text"] for line in handle if line.strip())
    stream = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    repeats = -(-(length + count * 997) // len(stream))
    stream = torch.tensor((stream * repeats), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in range(count):
        if row % 2 == 0:
            offset = (row // 2) * 997  # distinct passages per row (997: prime, no alignment with anything)
            rows.append(stream[offset : offset + length])
        else:
            rows.append(torch.randint(0, vocab_size, (length,), generator=generator))
    return torch.stack(rows)


def _positions(begin: int, end: int, limit: int) -> torch.Tensor:
    if end <= begin:
        return torch.empty(0, dtype=torch.long)
    return torch.linspace(begin, end - 1, steps=min(limit, end - begin)).round().long().unique()


@torch.no_grad()
def logit_agreement(model, input_ids: torch.Tensor, *, modes=("sparse", "dense"), max_positions: int = 256) -> dict:
    """Compare ``modes[0]`` (candidate) against ``modes[1]`` (reference) on each row of ``input_ids``.

    Returns ``{"beyond_topk": stats, "within_topk": stats, ...}``; stats hold ``positions``, ``kl_mean``,
    ``kl_max`` (KL(reference ‖ candidate) in nats), ``top1_agreement`` and ``max_abs_logit_diff``."""
    config = model.config
    window = config.index_topk_blocks * config.index_block_size
    length = input_ids.shape[1]
    if length <= window:
        raise ValueError(f"input length ({length}) must exceed topk * page_size = {window} tokens so pages get dropped")
    groups = {"within_topk": _positions(0, window, max_positions), "beyond_topk": _positions(window, length, max_positions)}
    keep = torch.cat(list(groups.values()))
    device = model.get_input_embeddings().weight.device
    totals = {name: _Totals() for name in groups}
    for row in input_ids:  # one sequence at a time: [positions, vocab] logits of a 200K vocabulary are large
        logits = {}
        for mode in modes:
            with attention_mode(model, mode):
                # keep stays on the CPU: it indexes the last layer's output, which a device_map may put anywhere
                logits[mode] = model(row[None].to(device), logits_to_keep=keep, use_cache=False).logits[0]
        begin = 0
        for name, positions in groups.items():
            end = begin + positions.numel()
            totals[name].add(logits[modes[0]][begin:end], logits[modes[1]][begin:end])
            begin = end
    summary = {"modes": list(modes), "kl_direction": f"KL({modes[1]} ‖ {modes[0]})", "sequences": int(input_ids.shape[0]),
               "length": int(length), "topk_window_tokens": int(window)}
    summary.update({name: totals[name].result() for name in groups})
    return summary


class _Totals:
    """Running KL / top-1 / max |Δ| over position blocks, in float64 so that the within-window control (KL ~ 0)
    is not rounding noise."""

    BLOCK = 64  # positions per float64 log-softmax: bounded memory at a 200K vocabulary

    def __init__(self):
        self.positions = 0
        self.kl_sum = 0.0
        self.kl_max = 0.0
        self.top1_equal = 0
        self.max_abs_diff = 0.0

    def add(self, candidate: torch.Tensor, reference: torch.Tensor) -> None:
        for begin in range(0, candidate.shape[0], self.BLOCK):
            c, r = candidate[begin : begin + self.BLOCK].double(), reference[begin : begin + self.BLOCK].double()
            log_p, log_q = torch.log_softmax(r, dim=-1), torch.log_softmax(c, dim=-1)
            kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)  # rounding can make tiny KLs negative
            self.positions += kl.numel()
            self.kl_sum += float(kl.sum())
            self.kl_max = max(self.kl_max, float(kl.max()))
            self.top1_equal += int((c.argmax(-1) == r.argmax(-1)).sum())
            self.max_abs_diff = max(self.max_abs_diff, float((c - r).abs().max()))

    def result(self):
        if not self.positions:
            return None
        return {"positions": self.positions, "kl_mean": self.kl_sum / self.positions, "kl_max": self.kl_max,
                "top1_agreement": self.top1_equal / self.positions, "max_abs_logit_diff": self.max_abs_diff}
