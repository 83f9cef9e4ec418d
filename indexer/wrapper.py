"""``BatchPrefillIndexerQ8KV8Wrapper``: plan once, score and select for many layers (docs/INDEXER.md)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import backends, ops
from .contract import (
    BACKENDS,
    DEFAULT_TOPK,
    KERNEL_NUM_HEADS,
    PAGE_SIZE,
    PRECISIONS,
    SCORE_DTYPES,
    score_row_pitch,
)
from .planner import DEFAULT_NUM_SMS, TaskPlan, build_task_plan, describe_plan_errors, plan_shape
from .topk import topk_select
from .torch_backend import HostMetadata, compute_page_scores, read_host_metadata
from .validation import check_alignment, check_host_int, check_tensor, check_unit_stride_1d

__all__ = ["BatchPrefillIndexerQ8KV8Wrapper", "PlanRequiredError"]


def _checked_request_lengths(request_lengths, total_q: int, max_seqlen_q: int, max_seqlen_k: int) -> tuple:
    """``request_lengths`` as a tuple of int pairs within the plan's bounds, or a ValueError naming the entry."""
    if isinstance(request_lengths, torch.Tensor) and request_lengths.device.type != "cpu":
        raise ValueError("request_lengths must be host ints (a list of pairs or a CPU tensor), not a device tensor")
    pairs = []
    for index, entry in enumerate(request_lengths):
        try:
            q_len, kv_len = (int(value) for value in entry)
        except (TypeError, ValueError):
            raise ValueError(f"request_lengths[{index}] must be a (query tokens, context tokens) pair of ints, "
                             f"got {entry!r}") from None
        if not (0 <= q_len <= min(kv_len, max_seqlen_q) and kv_len <= max_seqlen_k):
            raise ValueError(f"request_lengths[{index}] = ({q_len}, {kv_len}) must satisfy 0 <= query <= context, "
                             f"query <= max_seqlen_q = {max_seqlen_q} and context <= max_seqlen_k = {max_seqlen_k}")
        pairs.append((q_len, kv_len))
    if sum(q_len for q_len, _ in pairs) > total_q:
        raise ValueError(f"request_lengths hold {sum(q for q, _ in pairs)} query tokens, more than total_q = {total_q}")
    return tuple(pairs)


class PlanRequiredError(RuntimeError, ValueError):
    """A run/property was used before ``plan()``: a call-order error, catchable as either base."""


_TMA_ALIGNMENT = 16
_METADATA_ALIGNMENT = 4


class BatchPrefillIndexerQ8KV8Wrapper:
    """Paged FP8 prefill indexer: page scores ``[total_q * H, pitch]`` and forced-local-page top-k.

    ``plan()`` validates the metadata on the host, allocates (or adopts) the score buffer and builds
    ``num_valid_pages`` and the kernel's task plan on the metadata's device without synchronising.
    ``run_scores()`` fills the score buffer; ``run()`` adds the top-k selection. One plan serves every
    layer that shares the metadata; ``replan()`` refreshes it after in-place metadata updates.
    """

    def __init__(
        self,
        num_heads: int = 1,
        *,
        backend: str = "auto",
        precision: str = "auto",
        page_size: int = PAGE_SIZE,
        topk: int = DEFAULT_TOPK,
    ) -> None:
        check_host_int("num_heads", num_heads, minimum=1)
        check_host_int("page_size", page_size, minimum=1)
        check_host_int("topk", topk, minimum=1)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if backend == "cute":
            if num_heads not in KERNEL_NUM_HEADS:
                raise ValueError(f"num_heads must be in {KERNEL_NUM_HEADS} for backend='cute', got {num_heads}")
            if page_size != PAGE_SIZE or topk != DEFAULT_TOPK:
                raise ValueError(
                    f"backend='cute' needs page_size={PAGE_SIZE} and topk={DEFAULT_TOPK}, got {page_size} and {topk}"
                )
            if not backends.cute_kernel_available():
                raise RuntimeError("backend='cute' needs the CuTe DSL (pip install nvidia-cutlass-dsl); use 'auto' or 'torch'")
        self.num_heads = num_heads
        self.backend = backend
        self.precision = precision
        self.page_size = page_size
        self.topk = topk
        self._plan: Optional[TaskPlan] = None
        self._metadata: Optional[tuple] = None
        self._host_metadata: Optional[HostMetadata] = None
        self._scores: Optional[torch.Tensor] = None
        self._topk_out: Optional[torch.Tensor] = None
        self._kernel_backend = False
        self._validate = False

    # ------------------------------------------------------------------ plan
    def plan(
        self,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        total_q: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
        score_out: Optional[torch.Tensor] = None,
        validate: bool = False,
        request_lengths: Optional[Sequence[Tuple[int, int]]] = None,
    ) -> None:
        """Validate the metadata and build the plan. Host ints are upper bounds; no device sync
        unless ``validate=True``, which also checks page ids and finiteness in later runs.

        ``request_lengths``: optional ``(query tokens, context tokens)`` per request as host ints, for callers that
        have them (as FlashInfer's ``plan()`` takes host arrays); the page-chunk model then balances the actual
        requests instead of modelling each at the bounds. They must describe the batch of ``cu_seqlens_q`` and
        ``seq_lens`` (checked against the bounds only: the tensors stay on the device); whatever they say, the
        results are the same, only the schedule changes."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("plan() must be called outside CUDA graph capture; capture replan() and run() instead")
        check_host_int("total_q", total_q, minimum=1)
        check_host_int("max_seqlen_q", max_seqlen_q, minimum=1)
        check_host_int("max_seqlen_k", max_seqlen_k, minimum=1)
        if max_seqlen_k < max_seqlen_q:
            raise ValueError(f"max_seqlen_k ({max_seqlen_k}) must be >= max_seqlen_q ({max_seqlen_q})")
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
        if request_lengths is not None:
            request_lengths = _checked_request_lengths(request_lengths, total_q, max_seqlen_q, max_seqlen_k)

        check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1)
        device = cu_seqlens_q.device
        if cu_seqlens_q.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q must have B + 1 >= 2 entries, got shape {tuple(cu_seqlens_q.shape)}")
        num_requests = cu_seqlens_q.shape[0] - 1
        check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=device)
        if seq_lens.shape[0] != num_requests:
            raise ValueError(f"seq_lens must have shape [{num_requests}] (B from cu_seqlens_q), got {tuple(seq_lens.shape)}")
        if request_lengths is not None and len(request_lengths) != num_requests:
            raise ValueError(f"request_lengths must have {num_requests} (query, context) pairs (B from cu_seqlens_q), "
                             f"got {len(request_lengths)}")
        check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=device)
        if block_table.shape[0] != num_requests:
            raise ValueError(f"block_table must have {num_requests} rows (one per request), got shape {tuple(block_table.shape)}")
        for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
            check_unit_stride_1d(name, tensor)
            check_alignment(name, tensor, _METADATA_ALIGNMENT)
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise ValueError(f"block_table must have stride(1) == 1, got strides {block_table.stride()}")
        check_alignment("block_table", block_table, _METADATA_ALIGNMENT)

        choice = backends.resolve_backend(
            self.backend,
            device=device,
            num_heads=self.num_heads,
            page_size=self.page_size,
            topk=self.topk,
            precision=self.precision,
        )
        tile_rows = None
        if choice.name == "cute":
            from .cute_backend import SCORE_TILE_ROWS

            tile_rows = 128 if self.precision == "exact" else SCORE_TILE_ROWS
        num_sms = _num_sms(device)
        shape = plan_shape(
            num_requests=num_requests,
            total_q=total_q,
            num_heads=self.num_heads,
            page_size=self.page_size,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            tile_rows=tile_rows,
            num_sms=num_sms,
            request_lengths=request_lengths,
        )
        if block_table.shape[1] < shape.max_pages:
            raise ValueError(
                f"block_table capacity is smaller than the plan needs: shape[1] must be >= "
                f"ceil(max_seqlen_k / page_size) = {shape.max_pages}, got {block_table.shape[1]}"
            )
        if score_out is not None:
            _check_score_out(score_out, rows=total_q * self.num_heads, max_pages=shape.max_pages, device=device)
        plan = build_task_plan(cu_seqlens_q, seq_lens, shape)
        if validate:
            _raise_on_plan_errors(plan)
        # Validated: only now replace the state of a previous plan.
        self._plan = plan
        self._metadata = (cu_seqlens_q, seq_lens, block_table)
        self._host_metadata = None
        self._backend_choice = choice
        self._kernel_backend = choice.name == "cute"
        self._validate = validate
        if score_out is None:
            pitch = score_row_pitch(shape.max_pages)
            score_out = torch.empty(total_q * self.num_heads, pitch, dtype=torch.float32, device=device)[:, : shape.max_pages]
        self._scores = score_out
        self._topk_out = None

    def replan(self) -> None:
        """Rebuild the plan in place from the (updated) metadata tensors given to ``plan()``."""
        plan = self._require_plan("replan")
        cu_seqlens_q, seq_lens, _ = self._metadata
        build_task_plan(cu_seqlens_q, seq_lens, plan.shape, out=plan)
        self._host_metadata = None
        if self._validate:
            _raise_on_plan_errors(plan)

    # ------------------------------------------------------------------ run
    def run_scores(self, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        """Fill the score buffer (columns ``p < L`` of each row) and return it. No top-k."""
        self._require_plan("run_scores")
        return self._score(q, k_cache)

    def _score(self, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        k_pages = self._check_inputs(q, k_cache)
        if self._validate:
            self._check_input_values(q, k_pages)
        _, _, block_table = self._metadata
        if self._kernel_serves(q):
            plan = self._plan
            ops.page_scores_sm90(
                q,
                k_pages,
                self._scores,
                block_table,
                plan.descriptors,
                plan.num_tasks,
                self.num_heads,
                plan.shape.tile_rows,
                self.precision == "exact",
            )
        else:
            compute_page_scores(q, k_pages, block_table, self._host(), self._scores, page_size=self.page_size)
        return self._scores

    def _kernel_serves(self, q: torch.Tensor) -> bool:
        if not self._kernel_backend:
            return False
        reason = backends.kernel_unsupported_reason(
            device=q.device,
            num_heads=self.num_heads,
            page_size=self.page_size,
            topk=self.topk,
            precision=self.precision,
            dtype=q.dtype,
            head_dim=q.shape[2],
        )
        if reason is None:
            return True
        if self.backend == "cute":
            raise ValueError(f"backend='cute' cannot score these inputs: {reason}")
        backends.resolve_backend("auto", device=q.device, num_heads=self.num_heads, page_size=self.page_size,
                                 topk=self.topk, precision=self.precision, dtype=q.dtype, head_dim=q.shape[2])
        return False

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scores and top-k: returns ``[total_q, H, topk]`` int32 logical page ids (``out`` when given)."""
        plan = self._require_plan("run")
        shape = plan.shape
        expected = (shape.total_q, self.num_heads, self.topk)
        if out is not None:
            check_tensor("out", out, dtypes=(torch.int32,), ndim=3, device=self._scores.device)
            if tuple(out.shape) != expected:
                raise ValueError(f"out must have shape {list(expected)}, got {tuple(out.shape)}")
            if not out.is_contiguous():
                raise ValueError(f"out must be contiguous, got strides {out.stride()}")
        scores = self._score(q, k_cache)
        if out is None:
            if self._topk_out is None:
                self._topk_out = torch.empty(expected, dtype=torch.int32, device=scores.device)
            out = self._topk_out
        topk_select(
            scores,
            plan.num_valid_pages,
            topk=self.topk,
            out=out.view(-1, self.topk),
            validate=self._validate,
            backend="torch" if self._backend_choice.name == "torch" else "auto",
        )
        return out

    # ------------------------------------------------------------------ state
    @property
    def num_valid_pages(self) -> torch.Tensor:
        """``[total_q * H]`` int32: ``L + 1`` per row, filled by ``plan()``/``replan()``."""
        return self._require_plan("num_valid_pages").num_valid_pages

    @property
    def scores(self) -> torch.Tensor:
        """The score buffer ``run_scores`` fills (``score_out`` when the caller gave one)."""
        self._require_plan("scores")
        return self._scores

    @property
    def task_plan(self) -> TaskPlan:
        """The kernel's task plan (descriptor format in docs/INDEXER.md)."""
        return self._require_plan("task_plan")

    @property
    def active_backend(self) -> str:
        """The backend that serves runs of the current plan ("torch" or "cute")."""
        self._require_plan("active_backend")
        return self._backend_choice.name

    def _require_plan(self, what: str) -> TaskPlan:
        if self._plan is None:
            raise PlanRequiredError(f"{what}: call plan() first (no plan on this wrapper yet)")
        return self._plan

    def _host(self) -> HostMetadata:
        if self._host_metadata is None:
            cu_seqlens_q, seq_lens, _ = self._metadata
            self._host_metadata = read_host_metadata(cu_seqlens_q, seq_lens)
        return self._host_metadata

    def _check_inputs(self, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        """Validate ``q``/``k_cache`` against the plan; return K as ``[num_pages, page_size, D]``."""
        shape = self._plan.shape
        device = self._scores.device
        check_tensor("q", q, dtypes=SCORE_DTYPES, ndim=3, device=device)
        if q.shape[0] != shape.total_q or q.shape[1] != self.num_heads:
            raise ValueError(
                f"q must have shape [total_q={shape.total_q}, num_heads={self.num_heads}, head_dim], got {tuple(q.shape)}"
            )
        if not q.is_contiguous():
            raise ValueError(f"q must be contiguous, got strides {q.stride()}")
        check_alignment("q", q, _TMA_ALIGNMENT)
        check_tensor("k_cache", k_cache, dtypes=(q.dtype,), device=device)
        head_dim = q.shape[2]
        if k_cache.dim() == 4:
            if k_cache.shape[1] != 1:
                raise ValueError(f"k_cache as 4-D must be [num_pages, 1, page_size, head_dim], got {tuple(k_cache.shape)}")
            k_pages = k_cache[:, 0]
        elif k_cache.dim() == 3:
            k_pages = k_cache
        else:
            raise ValueError(f"k_cache must be [num_pages, page_size, head_dim] or [num_pages, 1, page_size, head_dim], got {tuple(k_cache.shape)}")
        if tuple(k_pages.shape[1:]) != (self.page_size, head_dim):
            raise ValueError(
                f"k_cache pages must be [page_size={self.page_size}, head_dim={head_dim}] (head_dim from q), "
                f"got {tuple(k_pages.shape[1:])}"
            )
        if k_pages.stride(2) != 1 or k_pages.stride(1) != head_dim:
            raise ValueError(f"each k_cache page must be contiguous, got strides {k_cache.stride()}")
        page_bytes = k_pages.stride(0) * k_pages.element_size()
        if k_pages.shape[0] > 1 and (k_pages.stride(0) < self.page_size * head_dim or page_bytes % _TMA_ALIGNMENT):
            raise ValueError(
                f"k_cache page stride must be >= page_size * head_dim elements and a multiple of {_TMA_ALIGNMENT} bytes, "
                f"got {k_pages.stride(0)} elements"
            )
        check_alignment("k_cache", k_pages, _TMA_ALIGNMENT)
        if k_pages.shape[0] < 1:
            raise ValueError("k_cache must hold at least one page")
        return k_pages

    def _check_input_values(self, q: torch.Tensor, k_pages: torch.Tensor) -> None:
        """Debug checks that read device memory (``plan(validate=True)``)."""
        _, _, block_table = self._metadata
        shape = self._plan.shape
        used = block_table[:, : shape.max_pages]
        host = self._host()
        columns = torch.arange(shape.max_pages, device=used.device)
        pages_per_request = torch.tensor(
            [-(-length // self.page_size) for length in host.seq_lens], device=used.device
        )
        in_use = columns[None, :] < pages_per_request[:, None]
        bad = in_use & ((used < 0) | (used >= k_pages.shape[0]))
        if bool(bad.any()):
            request, column = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"block_table[{request}, {column}] = {int(used[request, column])} is not a page of k_cache "
                f"(expected 0 <= id < {k_pages.shape[0]})"
            )
        for name, tensor in (("q", q), ("k_cache", k_pages)):
            if not bool(torch.isfinite(tensor.float()).all()):
                raise ValueError(f"{name} must be finite (NaN/inf found)")


def _check_score_out(score_out, *, rows: int, max_pages: int, device: torch.device) -> None:
    check_tensor("score_out", score_out, dtypes=(torch.float32,), ndim=2, device=device)
    if score_out.shape[0] != rows or score_out.shape[1] < max_pages:
        raise ValueError(
            f"score_out must have shape [total_q * num_heads = {rows}, >= max_pages = {max_pages}], "
            f"got {tuple(score_out.shape)}"
        )
    if score_out.stride(1) != 1:
        raise ValueError(f"score_out must have stride(1) == 1 (contiguous pages in a row), got strides {score_out.stride()}")
    if rows > 1 and score_out.stride(0) < score_out.shape[1]:
        raise ValueError(
            f"score_out rows must not overlap: stride(0) must be >= shape[1] = {score_out.shape[1]}, got {score_out.stride(0)}"
        )
    check_alignment("score_out", score_out, _METADATA_ALIGNMENT)


def _raise_on_plan_errors(plan: TaskPlan) -> None:
    flags = int(plan.error_flags[0])
    if flags:
        raise ValueError(f"metadata does not match the plan's host bounds: {describe_plan_errors(flags)}")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS
