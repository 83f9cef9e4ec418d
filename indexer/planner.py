"""The task plan the persistent score kernel consumes (docs/INDEXER.md, "Task plan").

Everything runs as torch ops on the device that holds the metadata: no device-to-host copy, every
shape comes from host-side upper bounds (``PlanShape``), and the result is deterministic (stable
sorts only, no atomics). ``build_task_plan`` can refill an existing plan in place, which is what
``replan()`` does after the caller updates the metadata tensors, and CUDA graphs can capture it (the wrapper replays
one per plan shape).
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from .contract import ERROR_WORDS, MAX_PAGES_PER_ROW, ErrorWord

__all__ = [
    "DescriptorWord",
    "DESCRIPTOR_WORDS",
    "MIN_PAGE_CHUNK",
    "BALANCED_MIN_PAGE_CHUNK",
    "MAX_PAGE_CHUNK",
    "DEFAULT_TILE_ROWS",
    "DEFAULT_NUM_SMS",
    "PlanError",
    "PlanShape",
    "TaskPlan",
    "plan_shape",
    "snake_slots",
    "allocate_task_plan",
    "build_task_plan",
    "decode_descriptors",
    "describe_plan_errors",
]

DESCRIPTOR_WORDS = 4
MIN_PAGE_CHUNK = 8
MAX_PAGE_CHUNK = 128
MAX_TILE_TOKENS = 256
DEFAULT_TILE_ROWS = 128
DEFAULT_NUM_SMS = 132  # H200
_TASK_OVERHEAD_PAGES = 2  # per-task cost (Q tile load, pipeline fill and drain) in pages of work, for the model
BALANCED_MIN_PAGE_CHUNK = 2
"""Short queries over long contexts may need chunks below ``MIN_PAGE_CHUNK`` to give every SM a task."""
_BALANCED_MODEL_MAX_WAVES = 32
"""Plans whose SM-filling chunk already gives this many tasks per SM are balanced enough: the model is skipped."""
_BALANCED_MODEL_MAX_TASKS = 1 << 20
_BALANCED_CANDIDATES = (BALANCED_MIN_PAGE_CHUNK, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)

_INT32_MAX = (1 << 31) - 1


class DescriptorWord(enum.IntEnum):
    """The four int32 words of a task descriptor (docs/INDEXER.md); the kernel reads them by these indices."""

    TOKEN_BEGIN = 0
    POSITION_BEGIN = 1
    REQUEST = 2
    PACKED = 3  # page_begin | (page_count - 1) << 16 | (tokens - 1) << 23


_PAGE_BEGIN_BITS = 16
PAGE_BEGIN_MASK = (1 << _PAGE_BEGIN_BITS) - 1
PAGE_COUNT_SHIFT = 16
_PAGE_COUNT_BITS = 7
PAGE_COUNT_MASK = (1 << _PAGE_COUNT_BITS) - 1
TOKENS_SHIFT = 23
_TOKENS_BITS = 8
TOKENS_MASK = (1 << _TOKENS_BITS) - 1


class PlanError(enum.IntFlag):
    """Bits of ``TaskPlan.errors[ErrorWord.PLAN]``: metadata that contradicts the host-side bounds. The plan is built
    from clamped metadata then (offsets into ``[0, total_q]`` and non-decreasing, context lengths into
    ``[query length, max_pages * page_size]``), so no task reaches outside the buffers."""

    TOTAL_Q_MISMATCH = 1  # cu_seqlens_q[-1] != total_q
    CU_SEQLENS_NOT_MONOTONE = 2  # cu_seqlens_q[0] != 0, a negative query length, or an offset beyond total_q
    QUERY_TOO_LONG = 4  # a query length > max_seqlen_q
    KV_LENGTH_INVALID = 8  # seq_lens[b] < query length, or > max_seqlen_k
    TILE_CAPACITY = 16  # more q tiles than q_tile_capacity (cannot happen after the clamps; kept as a guard)


@dataclass(frozen=True)
class PlanShape:
    """Host-side sizes of a plan, derived from the host ints alone."""

    num_requests: int
    total_q: int
    num_heads: int
    page_size: int
    tile_rows: int
    max_seqlen_q: int
    max_seqlen_k: int
    num_sms: int
    tile_tokens: int
    max_pages: int  # score columns: ceil(max_seqlen_k / page_size)
    max_history_pages: int  # (max_seqlen_k - 1) // page_size
    q_tile_capacity: int
    page_chunk: int
    chunks_per_tile_capacity: int
    task_capacity: int

    @property
    def graph_key(self) -> tuple:
        """What the device work of ``build_task_plan`` depends on: every field but the two length bounds, which
        reach it as a device word (``PlanInputs.bounds``), so a decode step's growing context reuses its plan."""
        return (self.num_requests, self.total_q, self.num_heads, self.page_size, self.tile_rows, self.num_sms,
                self.tile_tokens, self.max_pages, self.max_history_pages, self.q_tile_capacity, self.page_chunk,
                self.chunks_per_tile_capacity, self.task_capacity)


@dataclass
class TaskPlan:
    """Device tensors of a plan. ``descriptors[:num_tasks]`` are the tasks, heaviest first in the snake layout."""

    shape: PlanShape
    num_valid_pages: torch.Tensor  # [total_q * H] int32
    descriptors: torch.Tensor  # [task_capacity, 4] int32
    num_tasks: torch.Tensor  # [1] int32
    errors: torch.Tensor  # [ERROR_WORDS] int32 (contract.ErrorWord): PlanError bits, then the kernels' words

    @property
    def error_flags(self) -> torch.Tensor:
        """``[1]`` int32: the ``PlanError`` bits of the latest build."""
        return self.errors[int(ErrorWord.PLAN):int(ErrorWord.PLAN) + 1]


def plan_shape(
    *,
    num_requests: int,
    total_q: int,
    num_heads: int,
    page_size: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    tile_rows: Optional[int] = None,
    num_sms: int = DEFAULT_NUM_SMS,
    request_lengths: Optional[Sequence[Tuple[int, int]]] = None,
) -> PlanShape:
    """Capacities of the plan. Python ints throughout, so nothing overflows; limits raise ValueError.

    ``tile_rows`` defaults to the largest multiple of ``num_heads`` not above ``DEFAULT_TILE_ROWS``.
    ``request_lengths``: ``(query tokens, context tokens)`` per request as host ints, when the caller has them;
    the chunk model (``balanced_page_chunk``) then uses them instead of modelling every request at ``max_seqlen_q``
    tokens after ``max_seqlen_k`` of context. Only the page chunk depends on them (capacities come from the bounds),
    so the plan is correct whatever they say. Memoised: a repeated call costs a dictionary lookup.
    """
    if request_lengths is not None:
        request_lengths = tuple(request_lengths)
    return _plan_shape(num_requests, total_q, num_heads, page_size, max_seqlen_q, max_seqlen_k, tile_rows, num_sms,
                       request_lengths)


@functools.lru_cache(maxsize=1024)
def _plan_shape(num_requests, total_q, num_heads, page_size, max_seqlen_q, max_seqlen_k, tile_rows, num_sms,
                request_lengths) -> PlanShape:
    if tile_rows is None:
        tile_rows = max(1, DEFAULT_TILE_ROWS // num_heads) * num_heads
    if tile_rows % num_heads != 0:
        raise ValueError(f"tile_rows ({tile_rows}) must be a multiple of num_heads ({num_heads})")
    tile_tokens = tile_rows // num_heads
    if not 1 <= tile_tokens <= MAX_TILE_TOKENS:
        raise ValueError(f"tile_rows // num_heads must lie in [1, {MAX_TILE_TOKENS}], got {tile_tokens}")
    if total_q * num_heads > _INT32_MAX:
        raise ValueError(f"total_q * num_heads must be < 2^31 score rows, got {total_q * num_heads}")
    max_pages = -(-max_seqlen_k // page_size)
    if max_pages > MAX_PAGES_PER_ROW:
        raise ValueError(
            f"max_seqlen_k = {max_seqlen_k} needs {max_pages} pages per row; at most {MAX_PAGES_PER_ROW} are supported"
        )
    max_history_pages = (max_seqlen_k - 1) // page_size
    q_tile_capacity = min(total_q, -(-total_q // tile_tokens) + num_requests - 1)
    # enough chunks per tile that even a few q tiles give every SM a task; the balanced model refines it
    chunks_per_tile_target = max(1, -(-num_sms // max(1, q_tile_capacity)))
    page_chunk = min(MAX_PAGE_CHUNK, max(MIN_PAGE_CHUNK, max_history_pages // chunks_per_tile_target))
    filling_tasks = q_tile_capacity * -(-max_history_pages // page_chunk)
    if filling_tasks < _BALANCED_MODEL_MAX_WAVES * num_sms:
        if request_lengths is None:
            requests = modelled_requests(total_q, max_seqlen_q, max_seqlen_k)
        else:
            requests = tuple((int(q_len), int(kv_len)) for q_len, kv_len in request_lengths)
        # the model depends on whole pages, so contexts rounded up to a page keep the memo valid for a page's
        # worth of decode steps
        requests = tuple((q_len, -(-kv_len // page_size) * page_size) for q_len, kv_len in requests if q_len > 0)
        page_chunk = balanced_page_chunk(requests, page_size, tile_tokens, num_heads, num_sms) or page_chunk
    chunks_per_tile_capacity = -(-max_history_pages // page_chunk)
    task_capacity = q_tile_capacity * chunks_per_tile_capacity
    if task_capacity > _INT32_MAX:
        raise ValueError(f"the plan would need {task_capacity} task slots; at most 2^31 - 1 are supported")
    return PlanShape(
        num_requests=num_requests,
        total_q=total_q,
        num_heads=num_heads,
        page_size=page_size,
        tile_rows=tile_rows,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        num_sms=num_sms,
        tile_tokens=tile_tokens,
        max_pages=max_pages,
        max_history_pages=max_history_pages,
        q_tile_capacity=q_tile_capacity,
        page_chunk=page_chunk,
        chunks_per_tile_capacity=chunks_per_tile_capacity,
        task_capacity=task_capacity,
    )


def modelled_requests(total_q: int, max_seqlen_q: int, max_seqlen_k: int) -> tuple:
    """``(query tokens, context tokens)`` per request when only the bounds are known: full requests of
    ``max_seqlen_q`` query tokens (the last one shorter) at the end of ``max_seqlen_k`` tokens of context (exact for
    one request)."""
    count = -(-total_q // max_seqlen_q)
    return tuple((q_len, max_seqlen_k) for q_len in [max_seqlen_q] * (count - 1) + [total_q - max_seqlen_q * (count - 1)])


def task_cost(rows, pages):
    """What a task costs the score kernel, in row-pages: its tile's rows times its pages plus a per-task overhead.
    The planner's heavy-first order and the chunk model both use it. A partial tile costs as much as a full one: its
    idle warpgroups skip their wgmmas, but the active ones then lose the overlap of their reductions with the others'
    wgmmas (costing active warpgroups instead was measured slower on the suite, docs/PERFORMANCE.md)."""
    return rows * (pages + _TASK_OVERHEAD_PAGES)


@functools.lru_cache(maxsize=256)
def balanced_page_chunk(requests: tuple, page_size, tile_tokens, num_heads, num_sms) -> Optional[int]:
    """The chunk minimising the predicted makespan of the kernel's static round robin over the plan's tasks, laid out
    heaviest first in the snake order, each costing ``task_cost``; ties go to the larger chunk (fewer tasks).

    ``requests``: ``(query tokens, context tokens)`` per request, host ints (no device data). Host arithmetic in
    numpy: a chunked prefill plans a new shape every chunk, and the model is on its host path (the torch ops it
    replaced cost about 5 ms per new shape on the H200's host). A tile of ``h`` history pages gives ``h // chunk``
    full tasks and one of ``h % chunk`` pages, so the heaviest-first order is every full task, then the remainders
    in descending order. The per-CTA sums are of integers, exact in float64 whatever the order.
    """
    if not requests:
        return MIN_PAGE_CHUNK
    history = []
    for q_len, kv_len in requests:
        for start in range(0, q_len, tile_tokens):
            tokens = min(tile_tokens, q_len - start)
            history.append((kv_len - q_len + start + tokens - 1) // page_size)
    history = np.asarray(history, dtype=np.int64)
    if int(history.sum()) == 0:
        return MIN_PAGE_CHUNK
    tile_rows = tile_tokens * num_heads
    best = None
    for chunk in _BALANCED_CANDIDATES:
        full = history // chunk
        remainders = history % chunk
        remainders = -np.sort(-remainders[remainders > 0])
        count = int(full.sum()) + remainders.size
        if count > _BALANCED_MODEL_MAX_TASKS:
            continue
        pages = np.concatenate([np.full(int(full.sum()), chunk, dtype=np.int64), remainders])
        work = task_cost(tile_rows, pages).astype(np.float64)
        slots = snake_slots(np.arange(count), count, num_sms)
        makespan = float(np.bincount(slots % num_sms, weights=work, minlength=num_sms).max())
        if best is None or makespan <= best[0]:
            best = (makespan, chunk)
    return None if best is None else best[1]


def snake_slots(ranks: torch.Tensor, count, num_ctas: int) -> torch.Tensor:
    """Where the task of rank ``ranks`` (0 = heaviest) of ``count`` goes in the snake layout: every odd wave of
    ``num_ctas`` tasks is reversed when it is full (a partial last wave keeps its order: the round robin gives it to
    the first CTAs whatever the layout), so a CTA that drew one of a wave's heavier tasks draws one of the next wave's
    lighter ones. ``ranks`` is a tensor or a numpy array; ``count`` may be a device tensor; ranks at or beyond it stay
    in place."""
    wave = ranks // num_ctas
    lane = ranks % num_ctas
    reversed_wave = (wave % 2 == 1) & ((wave + 1) * num_ctas <= count)
    where = np.where if isinstance(ranks, np.ndarray) else torch.where
    return wave * num_ctas + where(reversed_wave, num_ctas - 1 - lane, lane)


def allocate_task_plan(shape: PlanShape, device: torch.device) -> TaskPlan:
    def empty(*size):
        return torch.empty(*size, dtype=torch.int32, device=device)

    return TaskPlan(
        shape=shape,
        num_valid_pages=empty(shape.total_q * shape.num_heads),
        descriptors=empty(max(1, shape.task_capacity), DESCRIPTOR_WORDS),
        num_tasks=empty(1),
        errors=torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device),
    )


def length_bounds(max_seqlen_q: int, max_seqlen_k: int) -> int:
    """The host bounds as the one int64 word ``build_task_plan`` reads from the device."""
    return (max_seqlen_q << 32) | max_seqlen_k


def build_task_plan(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    shape: PlanShape,
    out: Optional[TaskPlan] = None,
    bounds: Optional[torch.Tensor] = None,
) -> TaskPlan:
    """Compute ``num_valid_pages``, the task descriptors and the ``PlanError`` bits; refills ``out`` in place when
    given. ``bounds``: a ``[1]`` int64 device tensor holding ``length_bounds(max_seqlen_q, max_seqlen_k)`` (the
    shape's when omitted), which keeps the length bounds out of a captured replay.

    The metadata is clamped before use (see ``PlanError``), so a plan never holds a row beyond ``total_q``, a
    column beyond ``max_pages`` or a request beyond ``B``, whatever the metadata says; the bits say what was
    clamped. Only torch ops on the metadata's device, no synchronisation, no data-dependent shapes: CUDA graphs can
    capture it."""
    device = cu_seqlens_q.device
    plan = out if out is not None else allocate_task_plan(shape, device)
    if bounds is None:
        bounds = torch.full((1,), length_bounds(shape.max_seqlen_q, shape.max_seqlen_k), dtype=torch.int64,
                            device=device)
    raw_starts = cu_seqlens_q.to(torch.int64)
    raw_kv_lens = seq_lens.to(torch.int64)
    errors = _metadata_errors(raw_starts, raw_kv_lens, bounds, shape)

    # offsets inside [0, total_q] and non-decreasing: every token row lies inside the score buffer
    starts = torch.cummax(raw_starts.clamp(0, shape.total_q), 0).values
    q_lens = starts[1:] - starts[:-1]
    # contexts inside [query length, max_pages * page_size]: every local page lies inside the score columns
    kv_lens = torch.minimum(torch.maximum(raw_kv_lens, q_lens), torch.full_like(q_lens, shape.max_pages * shape.page_size))
    prefixes = kv_lens - q_lens

    token_request, token_local = _locate(starts[1:], starts[:-1], shape.total_q, shape.num_requests, device)
    positions = prefixes[token_request] + token_local
    valid_pages = (positions.clamp(min=0) // shape.page_size + 1).clamp(max=shape.max_pages).to(torch.int32)
    plan.num_valid_pages.view(shape.total_q, shape.num_heads).copy_(valid_pages[:, None].expand(-1, shape.num_heads))

    tiles_per_request = (q_lens + shape.tile_tokens - 1) // shape.tile_tokens
    tile_end = torch.cumsum(tiles_per_request, 0)
    tile_request, tile_index = _locate(tile_end, tile_end - tiles_per_request, shape.q_tile_capacity, shape.num_requests, device)
    tile_valid = torch.arange(shape.q_tile_capacity, device=device) < tile_end[-1]
    token_begin = tile_index * shape.tile_tokens
    tile_tokens = (q_lens[tile_request] - token_begin).clamp(min=1, max=shape.tile_tokens)
    position_begin = prefixes[tile_request] + token_begin
    # History of a tile = pages before the local page of its last token; shorter rows skip the tail.
    history = ((position_begin + tile_tokens - 1).clamp(min=0) // shape.page_size).clamp(max=shape.max_history_pages)
    history = torch.where(tile_valid, history, 0)
    chunks = (history + shape.page_chunk - 1) // shape.page_chunk
    task_end = torch.cumsum(chunks, 0)
    task_tile, task_chunk = _locate(task_end, task_end - chunks, shape.task_capacity, shape.q_tile_capacity, device)
    task_valid = torch.arange(shape.task_capacity, device=device) < task_end[-1]
    page_begin = task_chunk * shape.page_chunk
    page_count = (history[task_tile] - page_begin).clamp(min=1, max=shape.page_chunk)

    # Heaviest first by exact cost (ties chunk-major, so concurrent CTAs stream the same K pages), then the snake.
    heaviest_cost = task_cost(shape.tile_rows, shape.page_chunk)
    rank_key = heaviest_cost - task_cost(shape.tile_rows, page_count)
    order_key = rank_key * (shape.chunks_per_tile_capacity + 1) + task_chunk
    order_key = torch.where(task_valid, order_key, (heaviest_cost + 1) * (shape.chunks_per_tile_capacity + 1))
    order = torch.sort(order_key, stable=True).indices
    slots = snake_slots(torch.arange(shape.task_capacity, device=device), task_end[-1], shape.num_sms)
    order = torch.empty_like(order).scatter_(0, slots, order)
    tile_of_task = task_tile[order]
    packed = (
        page_begin[order]
        | ((page_count[order] - 1) << PAGE_COUNT_SHIFT)
        | ((tile_tokens[tile_of_task] - 1) << TOKENS_SHIFT)
    )
    descriptors = torch.stack(
        [
            starts[tile_request[tile_of_task]] + token_begin[tile_of_task],
            position_begin[tile_of_task],
            tile_request[tile_of_task],
            packed,
        ],
        dim=1,
    )
    descriptors = torch.where(task_valid[order][:, None], descriptors, 0)
    if shape.task_capacity > 0:
        plan.descriptors.copy_(descriptors.to(torch.int32))
    else:
        plan.descriptors.zero_()

    # Tasks exist only for the first q_tile_capacity tiles, each with at most chunks_per_tile_capacity
    # chunks, so the task count never exceeds task_capacity; extra tiles are flagged instead.
    plan.num_tasks.copy_(task_end[-1].reshape(1).to(torch.int32))
    errors = errors | torch.where(tile_end[-1] > shape.q_tile_capacity, int(PlanError.TILE_CAPACITY), 0)
    plan.error_flags.copy_(errors.reshape(1).to(torch.int32))
    return plan


def _locate(ends: torch.Tensor, begins: torch.Tensor, count: int, num_groups: int, device):
    """For slots ``0..count-1`` laid out group after group, the group of each slot and its index in it."""
    slots = torch.arange(count, device=device, dtype=torch.int64)
    if num_groups == 0:
        zeros = torch.zeros(count, dtype=torch.int64, device=device)
        return zeros, zeros
    group = torch.searchsorted(ends.contiguous(), slots, right=True).clamp(max=num_groups - 1)
    return group, slots - begins[group]


def _metadata_errors(starts, kv_lens, bounds, shape: PlanShape) -> torch.Tensor:
    def flag(condition, bit):
        return torch.where(condition, int(bit), 0)

    max_seqlen_q = bounds >> 32
    max_seqlen_k = bounds & 0xFFFFFFFF
    q_lens = starts[1:] - starts[:-1]
    errors = flag(starts[-1] != shape.total_q, PlanError.TOTAL_Q_MISMATCH)
    errors = errors | flag((starts[0] != 0) | (q_lens < 0).any() | (starts > shape.total_q).any(),
                           PlanError.CU_SEQLENS_NOT_MONOTONE)
    errors = errors | flag((q_lens > max_seqlen_q).any(), PlanError.QUERY_TOO_LONG)
    errors = errors | flag(((kv_lens < q_lens) | (kv_lens > max_seqlen_k)).any(), PlanError.KV_LENGTH_INVALID)
    return errors.reshape(())


def describe_plan_errors(flags: int) -> str:
    messages = {
        PlanError.TOTAL_Q_MISMATCH: "cu_seqlens_q[-1] must equal total_q",
        PlanError.CU_SEQLENS_NOT_MONOTONE: "cu_seqlens_q must start at 0 and be non-decreasing",
        PlanError.QUERY_TOO_LONG: "every query length (cu_seqlens_q[b+1] - cu_seqlens_q[b]) must be <= max_seqlen_q",
        PlanError.KV_LENGTH_INVALID: "every seq_lens[b] must be >= its query length and <= max_seqlen_k",
        PlanError.TILE_CAPACITY: "the metadata produces more q tiles than the host bounds allow",
    }
    return "; ".join(text for bit, text in messages.items() if flags & bit)


def decode_descriptors(descriptors: torch.Tensor) -> dict:
    """Unpack ``[n, 4]`` descriptors into named int64 columns (tests and tools; the kernel unpacks its own)."""
    d = descriptors.to(torch.int64)
    packed = d[:, DescriptorWord.PACKED]
    return {
        "token_begin": d[:, DescriptorWord.TOKEN_BEGIN],
        "position_begin": d[:, DescriptorWord.POSITION_BEGIN],
        "request": d[:, DescriptorWord.REQUEST],
        "page_begin": packed & PAGE_BEGIN_MASK,
        "page_count": ((packed >> PAGE_COUNT_SHIFT) & PAGE_COUNT_MASK) + 1,
        "tokens": ((packed >> TOKENS_SHIFT) & TOKENS_MASK) + 1,
    }


def descriptor_field_limits() -> dict:
    """Largest value each packed field can hold (documented in docs/INDEXER.md)."""
    return {
        "page_begin": (1 << _PAGE_BEGIN_BITS) - 1,
        "page_count": 1 << _PAGE_COUNT_BITS,
        "tokens": 1 << _TOKENS_BITS,
    }


assert MAX_PAGE_CHUNK <= descriptor_field_limits()["page_count"]
assert MAX_TILE_TOKENS <= descriptor_field_limits()["tokens"]
assert math.log2(MAX_PAGES_PER_ROW) == _PAGE_BEGIN_BITS
