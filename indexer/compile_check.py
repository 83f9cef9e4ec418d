"""Compile every CuTe DSL kernel of the indexer for sm_90a without a GPU: ``python -m indexer.compile_check``.

For each variant (FP8 score kernel at 128- and 256-row tiles and the exact bf16 one, each for
H = 1, 2, 4; the top-k select) it prints the wgmma instruction
kinds found in the PTX and, when ``ptxas`` is on PATH, the registers and spill bytes it reports.
Exits non-zero if a kernel fails to compile, a score variant lacks its wgmma kind, ptxas reports
spills or serialised wgmmas in a score kernel, or a setmaxnreg budget exceeds the launch allocation.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time


def _compile(kernel, arguments, dump_dir: pathlib.Path) -> pathlib.Path:
    import cutlass.cute as cute

    dump_dir.mkdir(parents=True, exist_ok=True)  # a missing dump dir fails silently
    cute.compile(kernel, *arguments, options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {dump_dir}")
    ptx_files = sorted(dump_dir.glob("*.ptx"))
    if not ptx_files:
        raise RuntimeError(f"no PTX was written to {dump_dir}")
    return ptx_files[-1]


def _ptx_text(path: pathlib.Path) -> str:
    return path.read_bytes().replace(b"\x00", b"").decode("utf-8", errors="replace")


def _ptxas_usage(ptx: str, work_dir: pathlib.Path):
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    source = work_dir / "kernel.ptx"
    source.write_text(ptx)
    result = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(source), "-o", str(work_dir / "kernel.cubin")],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed: {result.stderr.strip()[-2000:]}")
    registers = re.findall(r"Used (\d+) registers", result.stderr)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    serialized = "C7514" in result.stderr
    return dict(
        registers=max(int(r) for r in registers) if registers else None,
        spill_bytes=sum(int(a) + int(b) for a, b in spills),
        wgmma_serialized=serialized,
    )


def _register_budget_error(kernel, ptx: str, usage):
    """setmaxnreg can only redistribute the CTA's launch allocation; asking for more deadlocks."""
    decrease = re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+)", ptx)
    increase = re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+)", ptx)
    if not (decrease and increase and usage and usage["registers"]):
        return None
    threads = kernel.threads_per_cta
    producer_threads = kernel.threads_per_warpgroup
    needed = int(decrease[0]) * producer_threads + int(increase[0]) * (threads - producer_threads)
    available = usage["registers"] * threads
    if needed > available:
        return f"setmaxnreg asks for {needed} registers, the launch allocates {available} ({usage['registers']} x {threads})"
    return None


def variants():
    from .kernels.score_sm90 import PageScoreKernelSm90
    from .kernels.signatures import score_kernel_fake_arguments, topk_kernel_fake_arguments
    from .kernels.topk_select import TopkSelectKernel

    for consumer_warpgroups in (2, 3, 4):
        for num_heads in (1, 2, 4):
            q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments()
            yield (f"page_scores_sm90_h{num_heads}_rows{64 * consumer_warpgroups}",
                   PageScoreKernelSm90(num_heads, consumer_warpgroups=consumer_warpgroups),
                   (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "e4m3.e4m3")
    for num_heads, issue_ring in itertools.product((1, 2, 4), ("commit", "progress")):
        q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments()
        yield (f"page_scores_sm90_h{num_heads}_rows256_issue_ring_{issue_ring}",
               PageScoreKernelSm90(num_heads, consumer_warpgroups=4, issue_ring=issue_ring),
               (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "e4m3.e4m3")
    for num_heads in (1, 2, 4):
        q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments(tma_stores=True)
        yield (f"page_scores_sm90_h{num_heads}_rows256_tma_stores",
               PageScoreKernelSm90(num_heads, consumer_warpgroups=4, issue_ring="commit", tma_stores=True),
               (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "e4m3.e4m3")
    q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments(tma_stores=True)
    yield ("page_scores_sm90_h4_rows256_release_dependents",
           PageScoreKernelSm90(4, consumer_warpgroups=4, issue_ring="commit", tma_stores=True, release_dependents=True),
           (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "e4m3.e4m3")
    q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments()
    yield ("page_scores_sm90_h4_rows256_direct_stores",
           PageScoreKernelSm90(4, consumer_warpgroups=4, issue_ring="commit", staged_stores=False),
           (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "e4m3.e4m3")
    for num_heads in (1, 2, 4):  # the production kernels (session 10 on)
        q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments()
        yield (f"page_scores_sm90_h{num_heads}_rows256_integer_row_max",
               PageScoreKernelSm90(num_heads, consumer_warpgroups=4, issue_ring="commit", tma_stores=True,
                                   integer_row_max=True),
               (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "e4m3.e4m3")
    for num_heads in (1, 4):
        q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments()
        yield (f"page_scores_sm90_h{num_heads}_rows256_skip_idle_warpgroups",
               PageScoreKernelSm90(num_heads, consumer_warpgroups=4, issue_ring="commit", tma_stores=True,
                                   integer_row_max=True, skip_idle_warpgroups=True),
               (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "e4m3.e4m3")
    q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments()
    yield ("page_scores_sm90_h4_rows128_integer_row_max",
           PageScoreKernelSm90(4, consumer_warpgroups=2, integer_row_max=True),
           (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "e4m3.e4m3")
    q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments(exact=True)
    yield ("page_scores_sm90_h4_exact_float_row_max",
           PageScoreKernelSm90(4, consumer_warpgroups=2, exact=True),
           (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "bf16.bf16")
    for num_heads in (1, 2, 4):
        q, k, scores, block_table, descriptors, num_tasks, stream = score_kernel_fake_arguments(exact=True)
        yield (f"page_scores_sm90_h{num_heads}_exact",
               PageScoreKernelSm90(num_heads, consumer_warpgroups=2, exact=True, integer_row_max=True),
               (q, k, scores, block_table, descriptors, num_tasks, 132, stream), "bf16.bf16")
    from .cute_backend import TOPK_KERNEL_OPTIONS

    # the production options (session 10 on), then the plain kernel (every session-9 option off) and the opt-ins
    plain = dict(saturating_u16_levels=False, row_range_by_redux=False, winners_in_shared=False, longest_rows_first=False,
                 max_registers=None)
    yield "topk_select", TopkSelectKernel(**TOPK_KERNEL_OPTIONS), topk_kernel_fake_arguments(), None
    yield ("topk_select_programmatic", TopkSelectKernel(**TOPK_KERNEL_OPTIONS, programmatic_launch=True),
           topk_kernel_fake_arguments(), None)
    yield "topk_select_4_warps_per_row", TopkSelectKernel(**TOPK_KERNEL_OPTIONS, warps_per_row=4), topk_kernel_fake_arguments(), None
    yield "topk_select_plain", TopkSelectKernel(**plain), topk_kernel_fake_arguments(), None
    yield "topk_select_plain_rest_batch1", TopkSelectKernel(**plain, rest_batch=1), topk_kernel_fake_arguments(), None
    yield "topk_select_plain_32_registers", TopkSelectKernel(**dict(plain, max_registers=32)), topk_kernel_fake_arguments(), None
    yield ("topk_select_heads_in_registers", TopkSelectKernel(**dict(TOPK_KERNEL_OPTIONS, heads_in_registers=True)),
           topk_kernel_fake_arguments(), None)
    yield ("topk_select_plain_4_warps_per_row", TopkSelectKernel(**plain, warps_per_row=4),
           topk_kernel_fake_arguments(), None)


def run_compile_check(kernel_variants, description: str, argv=None) -> int:
    """Compile each ``(name, kernel, arguments, required_wgmma_kind)`` for sm_90a, print the table, return the exit
    status (shared by ``python -m indexer.compile_check`` and the model package's kernel check)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dump-dir", default=None, help="keep the PTX here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if os.environ.get("CUTE_DSL_ARCH") and importlib.metadata.version("nvidia-cutlass-dsl").startswith("4.3"):
        print("note: CUTE_DSL_ARCH is set; DSL 4.3.x then tries to load the CUDA driver", file=sys.stderr)
    root = pathlib.Path(args.dump_dir) if args.dump_dir else pathlib.Path(tempfile.mkdtemp(prefix="cute_ptx_"))
    print(f"nvidia-cutlass-dsl {importlib.metadata.version('nvidia-cutlass-dsl')}, target sm_90a, PTX in {root}")
    failures = []
    rows = []
    for name, kernel, arguments, required_wgmma in kernel_variants:
        start = time.perf_counter()
        try:
            ptx = _ptx_text(_compile(kernel, arguments, root / name))
        except Exception as error:  # report every variant, then fail
            failures.append(f"{name}: compile failed: {error}")
            rows.append((name, "FAILED", "-", "-", "-"))
            continue
        seconds = time.perf_counter() - start
        kinds = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)\s", ptx)))
        usage = _ptxas_usage(ptx, root / name)
        if required_wgmma and not any(kind.endswith(required_wgmma) for kind in kinds):
            failures.append(f"{name}: no {required_wgmma} wgmma in the PTX (found {kinds})")
        if usage and required_wgmma and usage["spill_bytes"]:
            failures.append(f"{name}: ptxas reports {usage['spill_bytes']} spill bytes")
        if usage and usage["wgmma_serialized"]:
            failures.append(f"{name}: ptxas serialises the wgmmas (C7514)")
        limit = getattr(kernel, "max_registers", None)
        if usage and limit and usage["registers"] > limit:
            failures.append(f"{name}: {usage['registers']} registers above its limit of {limit}")
        budget_error = _register_budget_error(kernel, ptx, usage)
        if budget_error:
            failures.append(f"{name}: {budget_error}")
        rows.append((
            name,
            f"{seconds:.1f} s",
            ", ".join(kinds) or "none (SIMT)",
            "-" if usage is None else str(usage["registers"]),
            "-" if usage is None else str(usage["spill_bytes"]),
        ))
    print("\n| kernel | compile | wgmma kinds in PTX | registers | spill bytes |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if shutil.which("ptxas") is None:
        print("(ptxas not on PATH: register and spill counts not available)")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv=None) -> int:
    return run_compile_check(variants(), __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
