"""The torch backend: exact page scores on any device, with bounded memory.

For e4m3 inputs every product is exact and every partial sum of a 128-term dot product is a multiple
of 2^-18 below 2^25 in magnitude, so float64 accumulation is exact in any order; rounding the page
maximum once to fp32 gives the contract's value bit for bit on every device and BLAS. bf16/fp16/fp32
inputs are multiplied and summed in fp32 by torch's matmul (summation order, and TF32 if the caller
enables it, are the library's); they serve small test models and precision ablations, not the exact
contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .contract import FP8_DTYPE

__all__ = ["HostMetadata", "read_host_metadata", "compute_page_scores", "DEFAULT_CHUNK_ELEMENTS"]

DEFAULT_CHUNK_ELEMENTS = 1 << 24
"""Largest ``rows x keys`` dot-product block materialised at once (128 MiB in float64)."""


@dataclass(frozen=True)
class HostMetadata:
    """Per-request lengths on the host; the torch backend loops over requests with them."""

    query_starts: Sequence[int]  # cu_seqlens_q, B + 1 entries
    seq_lens: Sequence[int]  # KV length per request, query tokens included

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)


def read_host_metadata(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> HostMetadata:
    """Copy the lengths to the host (one synchronisation on CUDA)."""
    return HostMetadata(tuple(cu_seqlens_q.tolist()), tuple(seq_lens.tolist()))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == FP8_DTYPE else torch.float32


def compute_page_scores(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    block_table: torch.Tensor,
    metadata: HostMetadata,
    out: torch.Tensor,
    *,
    page_size: int,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Write ``out[t * H + h, p]`` for every query token ``t``, head ``h`` and history page ``p < L``.

    ``q`` is ``[total_q, H, D]``, ``k_pages`` ``[num_pages, page_size, D]`` (any page stride),
    ``block_table`` ``[B, >= max_pages]``. Entries of ``out`` outside the history of their row are not
    written. Rows of tokens that share a local page form a *run*; runs are grouped into token chunks
    and pages into page chunks so that no block exceeds ``chunk_elements`` dot products.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    acc = accumulation_dtype(q.dtype)
    run_rows = page_size * num_heads
    for request in range(metadata.num_requests):
        q_begin = metadata.query_starts[request]
        q_len = metadata.query_starts[request + 1] - q_begin
        prefix = metadata.seq_lens[request] - q_len
        if q_len <= 0:
            continue
        last_local_page = (prefix + q_len - 1) // page_size
        if last_local_page == 0:
            continue
        page_chunk = max(1, min(last_local_page, chunk_elements // (run_rows * page_size)))
        runs_per_chunk = max(1, chunk_elements // (page_chunk * page_size * run_rows))
        first = max(0, page_size - prefix)  # tokens on page 0 have no history
        while first < q_len:
            first_page = (prefix + first) // page_size
            end = min(q_len, (first_page + runs_per_chunk) * page_size - prefix)
            _score_token_chunk(
                q[q_begin + first : q_begin + end],
                k_pages,
                block_table[request],
                out,
                row_begin=(q_begin + first) * num_heads,
                first_position=prefix + first,
                page_size=page_size,
                page_chunk=page_chunk,
                acc=acc,
                head_dim=head_dim,
            )
            first = end
    return out


def _score_token_chunk(q_chunk, k_pages, pages_of_request, out, *, row_begin, first_position, page_size, page_chunk, acc, head_dim):
    num_tokens, num_heads = q_chunk.shape[0], q_chunk.shape[1]
    q_rows = q_chunk.reshape(num_tokens * num_heads, head_dim).to(acc)
    last_position = first_position + num_tokens - 1
    history_pages = last_position // page_size
    for page_begin in range(0, history_pages, page_chunk):
        page_end = min(history_pages, page_begin + page_chunk)
        physical = pages_of_request[page_begin:page_end].to(torch.int64)
        keys = k_pages.index_select(0, physical).reshape(-1, head_dim).to(acc)
        block = (q_rows @ keys.T).view(q_rows.shape[0], page_end - page_begin, page_size).amax(dim=2)
        block = block.to(torch.float32)
        # Each run of tokens sharing local page L writes columns [page_begin, min(page_end, L)).
        position = first_position
        while position <= last_position:
            local_page = position // page_size
            run_end = min(last_position + 1, (local_page + 1) * page_size)
            columns = min(page_end, local_page) - page_begin
            if columns > 0:
                r0 = (position - first_position) * num_heads
                r1 = (run_end - first_position) * num_heads
                out[row_begin + r0 : row_begin + r1, page_begin : page_begin + columns] = block[r0:r1, :columns]
            position = run_end
