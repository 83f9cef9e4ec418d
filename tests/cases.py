"""Random indexer batches for the tests: metadata, paged K with scattered or shared page tables."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

UNUSED_PAGE = 1 << 30  # block-table entries no request may read; an access would fail loudly


@dataclass
class Case:
    q: torch.Tensor  # [total_q, H, D]
    k_cache: torch.Tensor  # [num_pages, page_size, D]
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    total_q: int
    max_seqlen_q: int
    max_seqlen_k: int
    page_size: int

    def plan_kwargs(self):
        return dict(total_q=self.total_q, max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k)

    def metadata(self):
        return self.cu_seqlens_q, self.seq_lens, self.block_table

    def loop_inputs(self):
        """numpy float64 values and Python-list metadata for tests/loop_reference.py."""
        return dict(
            q=self.q.to(torch.float64).numpy(),
            k_cache=self.k_cache.to(torch.float64).numpy(),
            cu_seqlens_q=self.cu_seqlens_q.tolist(),
            seq_lens=self.seq_lens.tolist(),
            block_table=self.block_table.tolist(),
            page_size=self.page_size,
        )


def make_case(
    lengths,
    *,
    num_heads: int,
    seed: int,
    page_size: int = 128,
    head_dim: int = 128,
    dtype: torch.dtype = torch.float8_e4m3fn,
    values: str = "normal",
    page_table: str = "scattered",
    extra_columns: int = 0,
) -> Case:
    """``lengths`` is a list of ``(q_len, kv_len)``; ``values`` is normal | zeros | ties;
    ``page_table`` is scattered (a random permutation) or shared (requests share request 0's prefix pages)."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    q_lens = [q for q, _ in lengths]
    kv_lens = [k for _, k in lengths]
    total_q = sum(q_lens)
    pages_per_request = [-(-k // page_size) for k in kv_lens]
    max_pages = max(pages_per_request) + extra_columns
    num_pages = sum(pages_per_request) + 3
    permutation = rng.permutation(num_pages)
    block_table = np.full((len(lengths), max_pages), UNUSED_PAGE, dtype=np.int64)
    cursor = 0
    for request, pages in enumerate(pages_per_request):
        block_table[request, :pages] = permutation[cursor : cursor + pages]
        cursor += pages
    if page_table == "shared":
        for request in range(1, len(lengths)):
            shared = min(pages_per_request[0], pages_per_request[request]) // 2 + 1
            shared = min(shared, pages_per_request[request], pages_per_request[0])
            block_table[request, :shared] = block_table[0, :shared]

    def draw(*shape, scale):
        if values == "zeros":
            return torch.zeros(*shape)
        if values == "ties":
            return torch.randint(-1, 2, shape, generator=generator).float() * 0.5
        return torch.randn(*shape, generator=generator) * scale

    heads_scale = torch.arange(1, num_heads + 1).float().view(1, num_heads, 1)
    q = (draw(total_q, num_heads, head_dim, scale=0.25) * (heads_scale if values == "normal" else 1)).to(dtype)
    k_cache = draw(num_pages, page_size, head_dim, scale=0.25).to(dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return Case(
        q=q.contiguous(),
        k_cache=k_cache,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_table=torch.tensor(block_table, dtype=torch.int32),
        total_q=total_q,
        max_seqlen_q=max(max(q_lens), 1),
        max_seqlen_k=max(kv_lens),
        page_size=page_size,
    )
