"""``BatchPrefillIndexerQ8KV8Wrapper``: plan once, score and select for many layers (docs/INDEXER.md).

``plan()`` makes every decision once: the backend, the precision, the compiled kernels and their variants (TMA
stores, the top-k row split), the buffers, and the plan's device work, which a CUDA graph replays when a plan shape
repeats. ``run()`` and ``run_scores()`` check only what may change between calls (the ``q`` and ``k_cache`` tensors,
by cheap host checks) and launch. A wrapper holds mutable state: it is not safe to share between threads (give each
thread its own).
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from . import backends, cute_backend
from .contract import (
    BACKENDS,
    DEFAULT_TOPK,
    ERROR_WORDS,
    FP8_DTYPE,
    HEAD_DIM,
    KERNEL_NUM_HEADS,
    PAGE_SIZE,
    PRECISIONS,
    SCORE_DTYPES,
    ErrorWord,
    score_row_pitch,
)
from .planner import (
    DEFAULT_NUM_SMS,
    PlanError,
    PlanShape,
    TaskPlan,
    allocate_task_plan,
    build_task_plan,
    describe_plan_errors,
    length_bounds,
    plan_shape,
)
from .planner import _metadata_errors as metadata_error_bits
from .topk import topk_select, validate_topk_inputs
from .torch_backend import HostMetadata, compute_page_scores, read_host_metadata
from .validation import check_alignment, check_host_int, check_tensor, check_unit_stride_1d

__all__ = ["BatchPrefillIndexerQ8KV8Wrapper", "PlanRequiredError", "IndexerRunError"]

logger = logging.getLogger("indexer")


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


class IndexerRunError(ValueError):
    """``check_errors()`` found an error the device recorded: metadata that contradicted the plan's bounds, a
    block-table page id outside the K cache, or a top-k row length outside the score buffer."""


_TMA_ALIGNMENT = 16
_METADATA_ALIGNMENT = 4
_CACHED_PLAN_SHAPES = 16
"""Plan shapes a wrapper keeps (tensors, buffers and the replay graph each); the least recently planned goes first."""
_CAPTURE_AFTER_BUILDS = 2
"""A plan shape's device work is captured into a CUDA graph on its second build: shapes seen once cost no capture."""
_OWNED_SCORE_BYTES_FLOOR = 256 << 20
"""The score buffers the wrapper owns for earlier plan shapes are kept while all of them together take at most
twice the largest one or this much, whichever is more; older ones are freed (and re-allocated if their shape
returns), so a wrapper that sees many long prefills does not hold a buffer per shape."""


class _Settings(NamedTuple):
    """The wrapper's configuration, as its runners read it."""

    num_heads: int
    backend: str
    precision: str
    page_size: int
    topk: int


class _PlanParts(NamedTuple):
    """What a runner uses of its plan state: the plan (its ``shape`` kept current by repeated plans), the top-k
    buffer and the compiled kernels."""

    plan: TaskPlan
    topk_out: torch.Tensor
    kernels: dict


class _PlanState:
    """Everything one plan shape owns on one device: the plan tensors, the score and top-k buffers when the wrapper
    owns them, the metadata copies a graph reads, and the graph once the shape repeats."""

    def __init__(self, shape: PlanShape, device: torch.device, errors: torch.Tensor, num_heads: int, topk: int,
                 plan_kernel=None):
        self.shape = shape
        self.device = device
        self.plan_kernel = plan_kernel  # the one-CTA plan kernel's compiled function, for a shape it serves
        self.plan = allocate_task_plan(shape, device)
        self.plan.errors = errors  # shared by the wrapper's plans: kernel words stay until check_errors()
        # the metadata a graph reads, filled by one concatenation: cu_seqlens_q, then seq_lens
        self.metadata = torch.empty(2 * shape.num_requests + 1, dtype=torch.int32, device=device)
        self.cu_seqlens_q = self.metadata[: shape.num_requests + 1]
        self.seq_lens = self.metadata[shape.num_requests + 1:]
        self.bounds = torch.empty(1, dtype=torch.int64, device=device)
        self.bounds_words = self.bounds.view(torch.int32)  # the plan kernel reads the word as two int32
        self.bounds_value: Optional[int] = None
        self.own_scores: Optional[torch.Tensor] = None
        self.topk_out = torch.empty(shape.total_q, num_heads, topk, dtype=torch.int32, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.capture_failed = False
        self.builds = 0
        self.kernels: dict = {}  # kernel key -> compiled function, so a repeated plan looks nothing else up
        self.parts = _PlanParts(self.plan, self.topk_out, self.kernels)
        self.runner = None  # the last plan's runner, reused while a plan passes the same tensors

    def scores_buffer(self) -> torch.Tensor:
        if self.own_scores is None:
            rows = self.shape.total_q * self.shape.num_heads
            pitch = score_row_pitch(self.shape.max_pages)
            storage = torch.empty(rows, pitch, dtype=torch.float32, device=self.device)
            self.own_scores = storage[:, : self.shape.max_pages]
        return self.own_scores

    def build(self, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, bounds: int) -> None:
        """Refill the plan from the metadata: one launch of the plan kernel where it serves the shape; else copies
        into the graph's inputs, then the graph's replay (from the second build on), the captured ops themselves
        before, or, inside a caller's capture, the ops."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing or bounds != self.bounds_value:
            self.bounds.fill_(bounds)
            # inside a caller's capture the fill is part of its graph: its replays set these bounds again
            self.bounds_value = None if capturing else bounds
        if self.plan_kernel is not None:
            shape, plan = self.shape, self.plan
            self.plan_kernel(cu_seqlens_q, seq_lens, self.bounds_words, plan.num_valid_pages, plan.descriptors,
                             plan.num_tasks, plan.errors, shape.total_q, shape.num_heads, shape.page_size,
                             shape.tile_tokens, shape.max_pages, shape.max_history_pages, shape.q_tile_capacity,
                             shape.page_chunk, shape.num_sms)
            return
        if self.device.type != "cuda" or capturing:
            build_task_plan(cu_seqlens_q, seq_lens, self.shape, out=self.plan, bounds=self.bounds)
            return
        torch.cat((cu_seqlens_q, seq_lens), out=self.metadata)
        self.builds += 1
        if self.graph is None and self.builds >= _CAPTURE_AFTER_BUILDS and not self.capture_failed:
            self.graph = self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            build_task_plan(self.cu_seqlens_q, self.seq_lens, self.shape, out=self.plan, bounds=self.bounds)

    def _capture(self) -> torch.cuda.CUDAGraph:
        # a side stream, as capture requires; no device synchronisation: nothing runs during capture, the replay
        # that follows computes the plan. The garbage collector stays off meanwhile: freeing other cyclic garbage
        # that holds a CUDA graph (a caller's) would end this capture
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    build_task_plan(self.cu_seqlens_q, self.seq_lens, self.shape, out=self.plan, bounds=self.bounds)
                finally:
                    graph.capture_end()
        except RuntimeError as error:  # the same plan either way: only plan()'s host time differs
            self.capture_failed = True
            logger.warning("indexer: the plan of %s could not be captured in a CUDA graph (%s); plan() builds it "
                           "with eager torch ops", self.shape, str(error).splitlines()[0])
            return None
        finally:
            if collecting:
                gc.enable()
            current.wait_stream(side)
        return graph


class BatchPrefillIndexerQ8KV8Wrapper:
    """Paged FP8 prefill indexer: page scores ``[total_q * H, pitch]`` and forced-local-page top-k.

    ``plan()`` validates the metadata on the host, adopts (or reuses its own) score buffer and builds
    ``num_valid_pages`` and the kernel's task plan on the metadata's device without synchronising.
    ``run_scores()`` fills the score buffer; ``run()`` adds the top-k selection. One plan serves every
    layer that shares the metadata; ``replan()`` refreshes it after in-place metadata updates.

    Nothing reads or writes outside its buffers whatever the metadata holds: the plan clamps it, and the kernels
    clamp page ids to the K cache and row lengths to the score buffer, recording each violation in a device-side
    error word that ``check_errors()`` raises on (``plan(validate=True)`` raises on metadata errors up front). Not
    safe to share between threads.
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
                raise RuntimeError("backend='cute' needs the CuTe DSL and TVM-FFI (pip install nvidia-cutlass-dsl "
                                   "apache-tvm-ffi); use 'auto' or 'torch'")
        self._settings = _Settings(num_heads, backend, precision, page_size, topk)
        self._runner = None
        self._plan_state: Optional[_PlanState] = None  # the state of the latest plan (the runner's)
        self._states: "OrderedDict[tuple, _PlanState]" = OrderedDict()
        self._errors: dict = {}
        self._choices: dict = {}

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
        unless ``validate=True``, which checks the metadata's values first (raising before anything is written)
        and page ids and finiteness in later runs.

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
        if max_seqlen_k >= 2**31:
            raise ValueError(f"max_seqlen_k must be < 2^31, got {max_seqlen_k}")
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
        if request_lengths is not None:
            request_lengths = _checked_request_lengths(request_lengths, total_q, max_seqlen_q, max_seqlen_k)

        device = _check_metadata(cu_seqlens_q, seq_lens, block_table)
        num_requests = cu_seqlens_q.shape[0] - 1
        if request_lengths is not None and len(request_lengths) != num_requests:
            raise ValueError(f"request_lengths must have {num_requests} (query, context) pairs (B from cu_seqlens_q), "
                             f"got {len(request_lengths)}")
        choice, num_sms = self._backend(device)
        kernel = choice.name == "cute"
        exact = self.precision == "exact"
        shape = plan_shape(
            num_requests=num_requests,
            total_q=total_q,
            num_heads=self.num_heads,
            page_size=self.page_size,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            tile_rows=(cute_backend.score_tile_rows(exact, cute_backend.score_page_parallel(exact, self.num_heads,
                                                                                            max_seqlen_q))
                       if kernel else None),
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
        bounds = length_bounds(max_seqlen_q, max_seqlen_k)
        if validate:
            _raise_on_metadata_errors(cu_seqlens_q, seq_lens, bounds, shape)
        # Validated: only now replace the state of a previous plan.
        state = self._state(shape, device, plan_kernel=kernel and cute_backend.plan_kernel_serves(shape))
        state.build(cu_seqlens_q, seq_lens, bounds)
        if score_out is not None:
            scores = score_out
        else:
            allocates = state.own_scores is None
            scores = state.scores_buffer()
            if allocates:
                self._trim_owned_score_buffers(keep=state)
        runner = state.runner
        if runner is not None and runner.serves(cu_seqlens_q, seq_lens, block_table, scores, validate, choice):
            runner.refresh()  # the same tensors, perhaps new values: only host copies of them are stale
        else:
            metadata = (cu_seqlens_q, seq_lens, block_table)
            if kernel:
                runner = _KernelRunner(self._settings, state.parts, metadata, scores, choice, validate, exact)
            else:
                runner = _TorchRunner(self._settings, state.parts, metadata, scores, choice, validate)
            state.runner = runner
        self._runner = runner
        self._plan_state = state

    def replan(self) -> None:
        """Rebuild the plan in place from the (updated) metadata tensors given to ``plan()``; CUDA graphs may capture
        it."""
        runner = self._require_runner("replan")
        state = self._plan_state
        cu_seqlens_q, seq_lens, _ = runner.metadata
        shape = state.shape
        state.build(cu_seqlens_q, seq_lens, length_bounds(shape.max_seqlen_q, shape.max_seqlen_k))
        runner.refresh()
        if runner.validate:
            _raise_on_plan_errors(state.plan)

    # ------------------------------------------------------------------ run
    def run_scores(self, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        """Fill the score buffer (columns ``p < L`` of each row) and return it. No top-k."""
        runner = self._runner
        if runner is None:
            raise PlanRequiredError("run_scores: call plan() first (no plan on this wrapper yet)")
        return runner.score(q, k_cache)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scores and top-k: returns ``[total_q, H, topk]`` int32 logical page ids (``out`` when given)."""
        runner = self._runner
        if runner is None:
            raise PlanRequiredError("run: call plan() first (no plan on this wrapper yet)")
        if out is not None:
            runner.check_out(out)
        else:
            out = runner.parts.topk_out
        scores = runner.score(q, k_cache)
        runner.select(scores, out)
        return out

    def check_errors(self) -> None:
        """Raise ``IndexerRunError`` if the device recorded an error since the last check (one synchronisation):
        metadata that contradicted the bounds in the latest plan, or a page id / row length the kernels clamped in
        any run since. The kernels' records are cleared by the check; the plan's stays until the next plan."""
        runner = self._require_runner("check_errors")
        errors = runner.parts.plan.errors
        words = errors.tolist()
        if not any(words):
            return
        if any(words[int(ErrorWord.PLAN) + 1:]):
            errors[int(ErrorWord.PLAN) + 1:].zero_()
        problems = []
        if words[ErrorWord.PLAN]:
            problems.append(f"metadata does not match the plan's bounds (clamped): {describe_plan_errors(words[ErrorWord.PLAN])}")
        if words[ErrorWord.PAGE_ID]:
            problems.append("a block_table entry in use was not a page of k_cache (expected 0 <= id < num_pages; "
                            "page 0 was read instead)")
        if words[ErrorWord.TOPK_ROW_LENGTH]:
            problems.append("a num_valid_pages entry lay outside [1, score columns + 1] (clamped)")
        raise IndexerRunError("; ".join(problems))

    # ------------------------------------------------------------------ state
    @property
    def num_heads(self) -> int:
        return self._settings.num_heads

    @property
    def backend(self) -> str:
        return self._settings.backend

    @property
    def precision(self) -> str:
        return self._settings.precision

    @property
    def page_size(self) -> int:
        return self._settings.page_size

    @property
    def topk(self) -> int:
        return self._settings.topk

    @property
    def num_valid_pages(self) -> torch.Tensor:
        """``[total_q * H]`` int32: ``L + 1`` per row, filled by ``plan()``/``replan()``."""
        return self._require_runner("num_valid_pages").parts.plan.num_valid_pages

    @property
    def scores(self) -> torch.Tensor:
        """The score buffer ``run_scores`` fills (``score_out`` when the caller gave one)."""
        return self._require_runner("scores").scores

    @property
    def task_plan(self) -> TaskPlan:
        """The kernel's task plan (descriptor format in docs/INDEXER.md)."""
        return self._require_runner("task_plan").parts.plan

    @property
    def active_backend(self) -> str:
        """The backend that serves runs of the current plan ("torch" or "cute")."""
        return self._require_runner("active_backend").choice.name

    @property
    def kernel_keys(self) -> tuple:
        """The compiled kernels the current plan launches (``cute_backend`` keys; empty for the torch backend)."""
        return getattr(self._require_runner("kernel_keys"), "keys", ())

    def _require_runner(self, what: str):
        if self._runner is None:
            raise PlanRequiredError(f"{what}: call plan() first (no plan on this wrapper yet)")
        return self._runner

    def _backend(self, device: torch.device):
        """The backend decision and SM count for ``device``, made once per device."""
        decision = self._choices.get(device)
        if decision is None:
            choice = backends.resolve_backend(self.backend, device=device, num_heads=self.num_heads,
                                              page_size=self.page_size, topk=self.topk, precision=self.precision)
            num_sms = _num_sms(device)
            decision = self._choices[device] = (choice, num_sms)
        return decision

    def _trim_owned_score_buffers(self, keep: _PlanState) -> None:
        owned = [state for state in self._states.values() if state.own_scores is not None]
        sizes = {id(state): state.own_scores.untyped_storage().nbytes() for state in owned}  # on a new buffer only
        budget = max(_OWNED_SCORE_BYTES_FLOOR, 2 * max(sizes.values(), default=0))
        total = sum(sizes.values())
        for state in owned:  # least recently planned first
            if total <= budget:
                break
            if state is keep:
                continue
            total -= sizes[id(state)]
            if state.runner is not None and state.runner.scores is state.own_scores:
                state.runner = None  # it would keep the buffer alive
            state.own_scores = None

    def _state(self, shape: PlanShape, device: torch.device, plan_kernel: bool) -> _PlanState:
        key = (device, shape.graph_key)
        state = self._states.get(key)
        if state is None:
            errors = self._errors.get(device)
            if errors is None:
                errors = self._errors[device] = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)
            compiled = None
            if plan_kernel:
                with torch.cuda.device(device):
                    compiled = cute_backend.compiled_kernel(cute_backend.PlanKernelKey())
            state = _PlanState(shape, device, errors, self.num_heads, self.topk, compiled)
            self._states[key] = state
            while len(self._states) > _CACHED_PLAN_SHAPES:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(key)
            state.shape = shape  # the same device work; the bounds a later check or replan reads
            state.plan.shape = shape
        return state


class _Runner:
    """What ``plan()`` decided for its runs: the buffers, the checks of ``q``/``k_cache`` and the launches."""

    def __init__(self, settings: "_Settings", parts: "_PlanParts", metadata: tuple, scores: torch.Tensor, choice,
                 validate: bool):
        # no reference back to the wrapper or its plan state: a dropped wrapper is freed at once, by reference
        # counting, and its CUDA graphs with it (the cyclic garbage collector could free them during a capture,
        # which that capture does not survive)
        self.settings = settings
        self.parts = parts
        self.metadata = metadata
        self.scores = scores
        self.choice = choice
        self.validate = validate
        self.host_metadata: Optional[HostMetadata] = None
        self.device = scores.device
        shape = parts.plan.shape
        self.q_shape = (shape.total_q, settings.num_heads)
        self.out_shape = (shape.total_q, settings.num_heads, settings.topk)

    def serves(self, cu_seqlens_q, seq_lens, block_table, scores, validate, choice) -> bool:
        """Whether a plan with these arguments would build this runner again (the same tensor objects)."""
        metadata = self.metadata
        return (metadata[0] is cu_seqlens_q and metadata[1] is seq_lens and metadata[2] is block_table
                and self.scores is scores and self.validate == validate and self.choice is choice)

    def refresh(self) -> None:
        """Forget host copies of the metadata's values (a new plan may follow in-place updates)."""
        self.host_metadata = None
        for runner in getattr(self, "torch_runners", {}).values():
            runner.refresh()

    def check_out(self, out) -> None:
        if not (type(out) is torch.Tensor and out.dtype is torch.int32 and out.device == self.device
                and out.shape == self.out_shape and out.is_contiguous()):
            check_tensor("out", out, dtypes=(torch.int32,), ndim=3, device=self.device)
            if tuple(out.shape) != self.out_shape:
                raise ValueError(f"out must have shape {list(self.out_shape)}, got {tuple(out.shape)}")
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")

    def host(self) -> HostMetadata:
        if self.host_metadata is None:
            cu_seqlens_q, seq_lens, _ = self.metadata
            self.host_metadata = read_host_metadata(cu_seqlens_q, seq_lens)
        return self.host_metadata

    def check_inputs(self, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        """Validate ``q``/``k_cache`` against the plan; return K as ``[num_pages, page_size, D]``."""
        settings = self.settings
        check_tensor("q", q, dtypes=SCORE_DTYPES, ndim=3, device=self.device)
        if tuple(q.shape[:2]) != self.q_shape:
            raise ValueError(
                f"q must have shape [total_q={self.q_shape[0]}, num_heads={settings.num_heads}, head_dim], got {tuple(q.shape)}"
            )
        if not q.is_contiguous():
            raise ValueError(f"q must be contiguous, got strides {q.stride()}")
        check_alignment("q", q, _TMA_ALIGNMENT)
        check_tensor("k_cache", k_cache, dtypes=(q.dtype,), device=self.device)
        head_dim = q.shape[2]
        if k_cache.dim() == 4:
            if k_cache.shape[1] != 1:
                raise ValueError(f"k_cache as 4-D must be [num_pages, 1, page_size, head_dim], got {tuple(k_cache.shape)}")
            k_pages = k_cache[:, 0]
        elif k_cache.dim() == 3:
            k_pages = k_cache
        else:
            raise ValueError(f"k_cache must be [num_pages, page_size, head_dim] or [num_pages, 1, page_size, head_dim], got {tuple(k_cache.shape)}")
        if tuple(k_pages.shape[1:]) != (settings.page_size, head_dim):
            raise ValueError(
                f"k_cache pages must be [page_size={settings.page_size}, head_dim={head_dim}] (head_dim from q), "
                f"got {tuple(k_pages.shape[1:])}"
            )
        if k_pages.stride(2) != 1 or k_pages.stride(1) != head_dim:
            raise ValueError(f"each k_cache page must be contiguous, got strides {k_cache.stride()}")
        page_bytes = k_pages.stride(0) * k_pages.element_size()
        if k_pages.shape[0] > 1 and (k_pages.stride(0) < settings.page_size * head_dim or page_bytes % _TMA_ALIGNMENT):
            raise ValueError(
                f"k_cache page stride must be >= page_size * head_dim elements and a multiple of {_TMA_ALIGNMENT} bytes, "
                f"got {k_pages.stride(0)} elements"
            )
        check_alignment("k_cache", k_pages, _TMA_ALIGNMENT)
        if k_pages.shape[0] < 1:
            raise ValueError("k_cache must hold at least one page")
        return k_pages

    def check_input_values(self, q: torch.Tensor, k_pages: torch.Tensor) -> None:
        """Debug checks that read device memory (``plan(validate=True)``)."""
        _raise_on_bad_page_ids(self.metadata[2], self.host().seq_lens, k_pages.shape[0], self.parts.plan.shape.max_pages,
                               self.settings.page_size)
        for name, tensor in (("q", q), ("k_cache", k_pages)):
            if not bool(torch.isfinite(tensor.float()).all()):
                raise ValueError(f"{name} must be finite (NaN/inf found)")


class _TorchRunner(_Runner):
    """The exact torch backend: it reads the lengths to the host once per plan (a sync on CUDA), so metadata that
    contradicts the plan's bounds, or a page id outside the K cache, raises a ValueError before any score is
    written."""

    def score(self, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        k_pages = self.check_inputs(q, k_cache)
        if self.host_metadata is None:  # once per plan: the lengths the plan was built from
            _raise_on_plan_errors(self.parts.plan)
        host = self.host()
        block_table = self.metadata[2]
        if self.validate:
            self.check_input_values(q, k_pages)  # the page ids included
        else:
            _raise_on_bad_page_ids(block_table, host.seq_lens, k_pages.shape[0], self.parts.plan.shape.max_pages,
                                   self.settings.page_size)
        compute_page_scores(q, k_pages, block_table, host, self.scores, page_size=self.settings.page_size)
        return self.scores

    def select(self, scores: torch.Tensor, out: torch.Tensor) -> None:
        topk_select(scores, self.parts.plan.num_valid_pages, topk=self.settings.topk, out=out.view(-1, self.settings.topk),
                    validate=self.validate, backend="torch")


class _KernelRunner(_Runner):
    """The SM90 kernels, compiled (or found compiled) at ``plan()``; a run checks ``q``/``k_cache`` and launches."""

    def __init__(self, settings, parts, metadata, scores, choice, validate, exact):
        super().__init__(settings, parts, metadata, scores, choice, validate)
        shape = parts.plan.shape
        self.exact = exact
        # plan() chose the variant with the tile size: the kernel's tiles are the plan's
        self.score_key = cute_backend.score_kernel_key(
            settings.num_heads, exact, scores, shape.num_sms,
            page_parallel=shape.tile_rows == cute_backend.PAGE_PARALLEL_TILE_ROWS)
        self.topk_key = cute_backend.topk_kernel_key(scores.shape[0], scores.shape[1])
        self.keys = (self.score_key, self.topk_key)
        self.torch_runners: dict = {}
        self.score_kernel = self._kernel(parts.kernels, self.score_key)
        self.topk_kernel = self._kernel(parts.kernels, self.topk_key)
        plan = parts.plan
        self.block_table = metadata[2]
        self.operand_dtype = FP8_DTYPE
        self.q_full_shape = (shape.total_q, settings.num_heads, HEAD_DIM)
        self.device_index = self.device.index
        self.page_size = settings.page_size
        self.page_elements = settings.page_size * HEAD_DIM  # one byte each: the TMA alignment is in elements too
        self.launch_arguments = (scores, self.block_table, plan.descriptors, plan.num_tasks, plan.errors)
        self.topk_arguments = (plan.num_valid_pages, plan.errors)
        self.topk_rows = (-1, settings.topk)
        self.own_rows = parts.topk_out.view(self.topk_rows)

    def _torch_runner(self, choice) -> "_TorchRunner":
        runner = self.torch_runners.get(choice)
        if runner is None:
            runner = self.torch_runners[choice] = _TorchRunner(self.settings, self.parts, self.metadata, self.scores,
                                                               choice, self.validate)
        return runner

    def _kernel(self, kernels: dict, key):
        kernel = kernels.get(key)
        if kernel is None:
            with torch.cuda.device(self.device):  # compiled functions are loaded per device
                kernel = kernels[key] = cute_backend.compiled_kernel(key)
        return kernel

    def _k_pages(self, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        """The checks of ``check_inputs`` that the kernel needs, on the common layouts in a few attribute reads; any
        other input takes ``check_inputs``, which raises the precise error or accepts it."""
        operand = self.operand_dtype
        if (type(q) is torch.Tensor and type(k_cache) is torch.Tensor and q.dtype is operand and k_cache.dtype is operand
                and q.shape == self.q_full_shape and q.get_device() == self.device_index
                and k_cache.get_device() == self.device_index and q.is_contiguous()
                and not q.data_ptr() % _TMA_ALIGNMENT and not k_cache.data_ptr() % _TMA_ALIGNMENT):
            shape, strides = k_cache.shape, k_cache.stride()
            if (len(shape) == 3 and shape[1] == self.page_size and shape[2] == HEAD_DIM and strides[2] == 1
                    and strides[1] == HEAD_DIM and shape[0] >= 1
                    and (shape[0] == 1 or strides[0] >= self.page_elements and not strides[0] % _TMA_ALIGNMENT)):
                return k_cache
        k_pages = self.check_inputs(q, k_cache)
        if q.dtype is not self.operand_dtype or q.shape[2] != HEAD_DIM:
            config = dict(device=q.device, num_heads=self.settings.num_heads, page_size=self.settings.page_size,
                          topk=self.settings.topk, precision=self.settings.precision, dtype=q.dtype, head_dim=q.shape[2])
            if self.settings.backend == "cute":
                raise ValueError(f"backend='cute' cannot score these inputs: {backends.kernel_unsupported_reason(**config)}")
            # backend="auto": the torch backend serves inputs the kernel cannot take (bf16/fp32 index ablations);
            # resolve_backend logs that once per configuration
            return None, backends.resolve_backend("auto", **config)
        return k_pages

    def score(self, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        k_pages = self._k_pages(q, k_cache)
        if type(k_pages) is tuple:
            return self._torch_runner(k_pages[1]).score(q, k_cache)
        if self.validate:
            self.check_input_values(q, k_pages)
        if self.exact:
            # e4m3 is a subset of bf16: the upcast is exact. It converts the whole cache, not just the pages the
            # batch reads (the exact mode is the precision reference, not the fast path).
            q = q.to(torch.bfloat16)
            k_pages = k_pages.to(torch.bfloat16)
        if torch.compiler.is_compiling():
            from . import ops

            key = self.score_key
            ops.page_scores_sm90(q, k_pages, *self.launch_arguments, key.num_heads, key.exact, key.tma_stores,
                                 key.num_ctas, key.page_parallel)
        else:
            self.score_kernel(q, k_pages, *self.launch_arguments)
        return self.scores

    def select(self, scores: torch.Tensor, out: torch.Tensor) -> None:
        rows = self.own_rows if out is self.parts.topk_out else out.view(self.topk_rows)
        if self.validate:
            validate_topk_inputs(scores, self.parts.plan.num_valid_pages, topk=self.settings.topk, out=rows, validate=True)
        num_valid_pages, errors = self.topk_arguments
        if torch.compiler.is_compiling():
            from . import ops

            ops.topk_select16(scores, num_valid_pages, rows, errors, self.topk_key.warps_per_row)
        else:
            self.topk_kernel(scores, num_valid_pages, rows, errors)


def _check_metadata(cu_seqlens_q, seq_lens, block_table) -> torch.device:
    """The metadata's device, or the error naming what is wrong with it; the common layouts in a few attribute reads."""
    if (type(cu_seqlens_q) is torch.Tensor and type(seq_lens) is torch.Tensor and type(block_table) is torch.Tensor
            and cu_seqlens_q.dtype is torch.int32 and seq_lens.dtype is torch.int32 and block_table.dtype is torch.int32
            and cu_seqlens_q.is_cuda and seq_lens.is_cuda and block_table.is_cuda
            and cu_seqlens_q.dim() == 1 and seq_lens.dim() == 1 and block_table.dim() == 2
            and cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous() and block_table.stride(1) == 1):
        requests = seq_lens.shape[0]
        index = cu_seqlens_q.get_device()
        if (cu_seqlens_q.shape[0] == requests + 1 and requests >= 1 and block_table.shape[0] == requests
                and seq_lens.get_device() == index and block_table.get_device() == index
                and not (cu_seqlens_q.data_ptr() | seq_lens.data_ptr() | block_table.data_ptr()) % _METADATA_ALIGNMENT):
            return cu_seqlens_q.device
    return _checked_metadata_device(cu_seqlens_q, seq_lens, block_table)


def _checked_metadata_device(cu_seqlens_q, seq_lens, block_table) -> torch.device:
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1)
    device = cu_seqlens_q.device
    if cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q must have B + 1 >= 2 entries, got shape {tuple(cu_seqlens_q.shape)}")
    num_requests = cu_seqlens_q.shape[0] - 1
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=device)
    if seq_lens.shape[0] != num_requests:
        raise ValueError(f"seq_lens must have shape [{num_requests}] (B from cu_seqlens_q), got {tuple(seq_lens.shape)}")
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=device)
    if block_table.shape[0] != num_requests:
        raise ValueError(f"block_table must have {num_requests} rows (one per request), got shape {tuple(block_table.shape)}")
    for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        check_unit_stride_1d(name, tensor)
        check_alignment(name, tensor, _METADATA_ALIGNMENT)
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must have stride(1) == 1, got strides {block_table.stride()}")
    check_alignment("block_table", block_table, _METADATA_ALIGNMENT)
    return device


def _raise_on_bad_page_ids(block_table, seq_lens, num_pages: int, max_pages: int, page_size: int) -> None:
    """A ValueError naming the first block-table entry in use that is not a page of the K cache."""
    used = block_table[:, :max_pages]
    columns = torch.arange(max_pages, device=used.device)
    pages_per_request = torch.tensor([min(-(-max(length, 0) // page_size), max_pages) for length in seq_lens],
                                     device=used.device)
    in_use = columns[None, :] < pages_per_request[:, None]
    bad = in_use & ((used < 0) | (used >= num_pages))
    if bool(bad.any()):
        request, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{request}, {column}] = {int(used[request, column])} is not a page of k_cache "
            f"(expected 0 <= id < {num_pages})"
        )


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


def _raise_on_metadata_errors(cu_seqlens_q, seq_lens, bounds: int, shape: PlanShape) -> None:
    """``plan(validate=True)``: the plan's own error bits, computed and read (one sync) before anything is built."""
    word = torch.full((1,), bounds, dtype=torch.int64, device=cu_seqlens_q.device)
    flags = int(metadata_error_bits(cu_seqlens_q.to(torch.int64), seq_lens.to(torch.int64), word, shape))
    if flags:
        raise ValueError(f"metadata does not match the plan's host bounds: {describe_plan_errors(PlanError(flags))}")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        from .cute_runtime import sm_count

        return sm_count(device)
    return DEFAULT_NUM_SMS
