"""What ``plan()`` decides once and ``run()`` never again, the plan state a repeated shape reuses, the torch
backend's refusal of inconsistent metadata, the compile check's kernels, and the packaged benchmark data (CPU)."""

import pathlib
import subprocess
import sys
import zipfile

import pytest
import torch

from indexer import BatchPrefillIndexerQ8KV8Wrapper, backends
from indexer.planner import plan_shape
from cases import make_case

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_run_makes_no_backend_decision(monkeypatch):
    case = make_case([(300, 9000), (40, 5000)], num_heads=2, seed=1)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2)
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    expected = wrapper.run(case.q, case.k_cache).clone()

    def refuse(*args, **kwargs):
        raise AssertionError("run() must not decide the backend")

    monkeypatch.setattr(backends, "resolve_backend", refuse)
    monkeypatch.setattr(backends, "kernel_unsupported_reason", refuse)
    assert torch.equal(wrapper.run(case.q, case.k_cache), expected)
    wrapper.run_scores(case.q, case.k_cache)
    # a second plan on the same device reuses the first plan's decision
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    assert wrapper.active_backend == "torch"


def test_a_repeated_shape_reuses_its_plan_tensors_and_buffers():
    lengths = [(300, 9000), (40, 5000)]
    case = make_case(lengths, num_heads=2, seed=2)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2)
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    first = wrapper.run(case.q, case.k_cache).clone()
    pointers = [t.data_ptr() for t in (wrapper.task_plan.descriptors, wrapper.scores, wrapper.num_valid_pages)]
    # the next decode step: a longer context within the same pages, the same device work
    grown = case.seq_lens + 1
    kwargs = dict(case.plan_kwargs(), max_seqlen_k=case.max_seqlen_k + 1)
    wrapper.plan(case.cu_seqlens_q, grown, case.block_table, **kwargs)
    assert [t.data_ptr() for t in (wrapper.task_plan.descriptors, wrapper.scores, wrapper.num_valid_pages)] == pointers
    assert wrapper.task_plan.shape.max_seqlen_k == case.max_seqlen_k + 1
    fresh = BatchPrefillIndexerQ8KV8Wrapper(2)
    fresh.plan(case.cu_seqlens_q, grown, case.block_table, **kwargs)
    for name in ("descriptors", "num_tasks", "num_valid_pages", "errors"):
        assert torch.equal(getattr(wrapper.task_plan, name), getattr(fresh.task_plan, name)), name
    assert torch.equal(wrapper.run(case.q, case.k_cache), fresh.run(case.q, case.k_cache))
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    assert torch.equal(wrapper.run(case.q, case.k_cache), first)


@pytest.mark.parametrize("cu, seq_lens, message", [([0, 1000], [4000], "cu_seqlens_q"),
                                                   ([0, 300], [40000], "seq_lens")])
def test_the_torch_backend_raises_on_inconsistent_metadata_before_writing(cu, seq_lens, message):
    """The planner clamps and flags (tests/test_planner.py); the torch backend reads the lengths anyway, so it raises
    before any score is written."""
    cu = torch.tensor(cu, dtype=torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    block_table = torch.randperm(400)[None, :].to(torch.int32).contiguous()
    q = torch.randn(300, 1, 128).to(torch.float8_e4m3fn)
    k = torch.randn(400, 128, 128).to(torch.float8_e4m3fn)
    scores = torch.full((300, 32), float("nan"))
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(1)
    wrapper.plan(cu, seq_lens, block_table, total_q=300, max_seqlen_q=300, max_seqlen_k=4096, score_out=scores)
    with pytest.raises(ValueError, match=message):
        wrapper.run(q, k)
    assert scores.isnan().all()
    with pytest.raises(ValueError, match=message):
        wrapper.check_errors()


@pytest.mark.parametrize("bad_page", [-1, 400, 1 << 30])
def test_the_torch_backend_raises_on_a_page_id_outside_the_cache_before_writing(bad_page):
    case = make_case([(300, 9000), (40, 5000)], num_heads=1, seed=4)
    case.block_table[1, 2] = bad_page
    scores = torch.full((case.total_q, case.block_table.shape[1]), float("nan"))
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(1)
    wrapper.plan(*case.metadata(), **case.plan_kwargs(), score_out=scores)
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]"):
        wrapper.run_scores(case.q, case.k_cache[:399])
    assert scores.isnan().all()


def test_check_errors_passes_on_good_metadata_and_needs_a_plan():
    from indexer.wrapper import PlanRequiredError

    case = make_case([(30, 900)], num_heads=1, seed=5)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(1)
    with pytest.raises(PlanRequiredError):
        wrapper.check_errors()
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    wrapper.check_errors()


def test_the_compile_check_compiles_exactly_the_runtimes_kernels(monkeypatch):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from indexer import compile_check, cute_backend, cute_runtime

    def signature(kernel, arguments):
        return type(kernel).__name__, sorted(vars(kernel).items(), key=lambda item: item[0]).__repr__(), \
            [type(argument).__name__ for argument in arguments]

    checked = [signature(kernel, arguments) for _, kernel, arguments, _ in compile_check.variants()]
    compiled = []
    monkeypatch.setattr(cute_backend, "compile_once", lambda key, build: build())
    monkeypatch.setattr(cute_backend, "compile_tvm_ffi", lambda kernel, arguments: compiled.append(
        signature(kernel, arguments)))
    for key in cute_backend.kernel_keys():
        cute_backend.compiled_kernel(key)
    assert compiled == checked
    # every choice the host makes maps onto one of them
    keys = set(cute_backend.kernel_keys())
    for exact in (False, True):
        for scores in (torch.empty(8, 12), torch.empty(8, 13)):
            for page_parallel in (False, True):
                key = cute_backend.score_kernel_key(4, exact, scores, 132,
                                                    page_parallel and cute_backend.score_page_parallel(exact, 4, 16))
                assert key in keys
    assert {cute_backend.topk_kernel_key(rows, columns) for rows in (1, 2048, 4096) for columns in (16, 600)} <= keys
    assert cute_runtime.TVM_FFI_OPTIONS in cute_runtime.compile_options("--gpu-arch sm_90a")


def test_the_wheel_carries_the_benchmark_suite(tmp_path):
    """``python -m indexer.bench`` reads its cases from the installed package, not the source tree."""
    try:
        import setuptools  # noqa: F401
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert "indexer/bench_data/prefill_benchmark_cases_v1.json" in archive.namelist()
        archive.extractall(tmp_path / "site")
    reader = "from indexer.bench import load_cases; print(len(load_cases(False)), len(load_cases(True)))"
    result = subprocess.run([sys.executable, "-c", reader], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")},
                            check=True, capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["128", "16"]


def test_the_kernel_runner_hands_inputs_it_cannot_take_to_the_torch_backend_under_auto(monkeypatch):
    """backend="auto" with bf16/fp32 index inputs (the model's precision ablations): the runner the plan built for
    the kernel scores them with the torch backend (logged once), as before; backend="cute" raises naming the reason.
    The kernel runner is built here without a GPU: only its input dispatch runs."""
    from indexer import wrapper as wrapper_module
    from indexer.backends import BackendChoice

    case = make_case([(40, 900), (3, 300)], num_heads=2, seed=6, dtype=torch.bfloat16)
    for backend in ("auto", "cute"):
        wrapper = BatchPrefillIndexerQ8KV8Wrapper(2)
        wrapper.plan(*case.metadata(), **case.plan_kwargs())
        torch_runner = wrapper._runner
        runner = object.__new__(wrapper_module._KernelRunner)
        # as if the plan had chosen the kernel for this backend setting
        runner.__dict__.update(torch_runner.__dict__, operand_dtype=torch.float8_e4m3fn, torch_runners={},
                               choice=BackendChoice("cute", "test"),
                               settings=torch_runner.settings._replace(backend=backend))
        if backend == "cute":
            with pytest.raises(ValueError, match="backend='cute' cannot score these inputs"):
                runner.score(case.q, case.k_cache)
            continue
        scores = runner.score(case.q, case.k_cache)
        reference = torch_runner.score(case.q, case.k_cache.clone())
        assert scores is torch_runner.scores and torch.equal(scores.nan_to_num(), reference.nan_to_num())
        (fallback,) = runner.torch_runners.values()
        assert fallback.choice.name == "torch" and "CUDA" in fallback.choice.reason


def test_a_plan_with_the_same_tensors_reuses_its_runner_and_sees_in_place_updates():
    case = make_case([(300, 9000), (40, 5000)], num_heads=2, seed=7)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(2)
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    first_runner = wrapper._runner
    wrapper.run(case.q, case.k_cache)
    # the same tensor objects with new values (a server updating its metadata buffers in place)
    case.seq_lens.copy_(torch.tensor([8000, 4500], dtype=torch.int32))
    wrapper.plan(*case.metadata(), **case.plan_kwargs())
    assert wrapper._runner is first_runner
    fresh = BatchPrefillIndexerQ8KV8Wrapper(2)
    fresh.plan(case.cu_seqlens_q.clone(), case.seq_lens.clone(), case.block_table, **case.plan_kwargs())
    assert torch.equal(wrapper.run(case.q, case.k_cache), fresh.run(case.q, case.k_cache))
    # other tensors, or validation, build another runner
    wrapper.plan(case.cu_seqlens_q.clone(), case.seq_lens, case.block_table, **case.plan_kwargs())
    assert wrapper._runner is not first_runner
    wrapper.plan(*case.metadata(), **case.plan_kwargs(), validate=True)
    assert wrapper._runner.validate


def test_owned_score_buffers_of_earlier_shapes_are_freed_beyond_the_budget(monkeypatch):
    from indexer import wrapper as wrapper_module

    monkeypatch.setattr(wrapper_module, "_OWNED_SCORE_BYTES_FLOOR", 0)
    wrapper = BatchPrefillIndexerQ8KV8Wrapper(1)
    cases = [make_case([(q, 4000)], num_heads=1, seed=q) for q in (100, 200, 300, 400)]
    for case in cases:
        wrapper.plan(*case.metadata(), **case.plan_kwargs())
        wrapper.run(case.q, case.k_cache)
    owned = [state for state in wrapper._states.values() if state.own_scores is not None]
    sizes = [state.own_scores.untyped_storage().nbytes() for state in owned]
    assert sum(sizes) <= 2 * max(sizes) and owned[-1].shape.total_q == 400
    # a freed shape gets its buffer back, with the same results
    wrapper.plan(*cases[0].metadata(), **cases[0].plan_kwargs())
    fresh = BatchPrefillIndexerQ8KV8Wrapper(1)
    fresh.plan(*cases[0].metadata(), **cases[0].plan_kwargs())
    assert torch.equal(wrapper.run(cases[0].q, cases[0].k_cache), fresh.run(cases[0].q, cases[0].k_cache))


def test_a_dropped_wrapper_is_freed_without_the_garbage_collector():
    """No reference cycles: a wrapper, its plan states and runners (and on CUDA its plan graphs) go when the last
    reference does. Left to the cyclic collector, a graph could be freed in the middle of another CUDA graph
    capture, which that capture does not survive."""
    import gc
    import weakref

    collecting = gc.isenabled()
    gc.disable()
    try:
        wrapper = BatchPrefillIndexerQ8KV8Wrapper(2)
        for lengths in ([(300, 9000), (40, 5000)], [(20, 700)]):
            case = make_case(lengths, num_heads=2, seed=8)
            for _ in range(3):  # repeated shapes: runner reuse, plan state reuse
                wrapper.plan(*case.metadata(), **case.plan_kwargs())
                wrapper.run(case.q, case.k_cache)
        references = [weakref.ref(wrapper), weakref.ref(wrapper._runner)]
        references += [weakref.ref(state) for state in wrapper._states.values()]
        del wrapper
        assert [reference() for reference in references] == [None] * len(references)
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_plans_whose_tiles_hold_at_most_64_rows_take_the_page_parallel_score_kernel(num_heads):
    """Decode and verify steps and short chunks (``max_seqlen_q * H <= 64``) take the FP8 kernel's 64-row,
    page-parallel variant, with direct stores; longer queries and the exact precision keep their tiles."""
    from indexer import cute_backend

    scores = torch.empty(8, 16)
    longest = 64 // num_heads
    for max_seqlen_q, expected in ((1, True), (longest, True), (longest + 1, False), (4096, False)):
        assert cute_backend.score_page_parallel(False, num_heads, max_seqlen_q) is expected
        key = cute_backend.score_kernel_key(num_heads, False, scores, 132, page_parallel=expected)
        assert key.page_parallel is expected and (key.tma_stores is not expected)
        assert cute_backend.score_tile_rows(False, expected) == (64 if expected else 256)
        assert not cute_backend.score_page_parallel(True, num_heads, max_seqlen_q)
    shape = plan_shape(num_requests=4, total_q=4, num_heads=num_heads, page_size=128, max_seqlen_q=1,
                       max_seqlen_k=131072, tile_rows=cute_backend.score_tile_rows(False, True), num_sms=132)
    assert shape.tile_tokens == 64 // num_heads


def test_the_score_kernels_variants_refuse_contradicting_options_by_name():
    """The page-parallel variant is FP8 with direct stores; its 64-row tiles and 12 K stages fit the shared memory."""
    score_sm90 = pytest.importorskip("indexer.kernels.score_sm90", reason="needs nvidia-cutlass-dsl")
    for options in (dict(exact=True), dict(tma_stores=True)):
        with pytest.raises(ValueError, match="page_parallel"):
            score_sm90.PageScoreKernelSm90(4, page_parallel=True, **options)
    kernel = score_sm90.PageScoreKernelSm90(4, page_parallel=True)
    assert (kernel.tile_rows, kernel.k_stages, kernel.num_consumer_warpgroups) == (64, 12, 4)
    assert not kernel.issue_ring and not kernel.staged_stores
    assert kernel._shared_memory_bytes_needed() <= kernel.shared_memory_bytes
