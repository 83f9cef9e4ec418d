"""Compile every CuTe DSL kernel of the indexer for sm_90a without a GPU: ``python -m indexer.compile_check``.

It compiles exactly the kernels the runtime can select (``cute_backend.kernel_keys``: the FP8 score kernel with TMA
stores and with the masked write-out and the exact bf16 one, each for H = 1, 2, 4; the top-k select with one and
four warps per row; the one-CTA task plan), under the runtime's options, and prints the wgmma instruction kinds found in the PTX and, when ``ptxas`` is on PATH, the registers and spill bytes it reports.
Exits non-zero if a kernel fails to compile, a score variant lacks its wgmma kind, ptxas reports
spills or serialised wgmmas in a score kernel, or a setmaxnreg budget exceeds the launch allocation.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time


def _compile(kernel, arguments, dump_dir: pathlib.Path, tvm_ffi: bool) -> pathlib.Path:
    import cutlass.cute as cute

    from .cute_runtime import compile_options

    dump_dir.mkdir(parents=True, exist_ok=True)  # a missing dump dir fails silently
    target = f"--gpu-arch sm_90a --keep-ptx --dump-dir {dump_dir}"
    cute.compile(kernel, *arguments, options=compile_options(target) if tvm_ffi else target)
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


def kernel_name(key) -> str:
    from .cute_backend import PlanKernelKey, ScoreKernelKey

    if isinstance(key, ScoreKernelKey):
        store = "exact" if key.exact else ("tma_stores" if key.tma_stores else "masked_stores")
        if key.page_parallel:
            store = "page_parallel"
        return f"page_scores_sm90_h{key.num_heads}_{store}"
    if isinstance(key, PlanKernelKey):
        return "task_plan"
    return f"topk_select_{key.warps_per_row}_warps_per_row"


def variants():
    """Exactly the kernels the runtime can select (``cute_backend.kernel_keys``), built by the runtime's
    ``build_kernel``."""
    from .cute_backend import ScoreKernelKey, build_kernel, kernel_keys

    for key in kernel_keys():
        kernel, arguments = build_kernel(key)
        required_wgmma = ("bf16.bf16" if key.exact else "e4m3.e4m3") if isinstance(key, ScoreKernelKey) else None
        yield kernel_name(key), kernel, arguments, required_wgmma


def run_compile_check(kernel_variants, description: str, argv=None, *, tvm_ffi: bool = True) -> int:
    """Compile each ``(name, kernel, arguments, required_wgmma_kind[, tvm_ffi])`` for sm_90a, print the table, return
    the exit status (shared by ``python -m indexer.compile_check`` and the model package's kernel check). ``tvm_ffi``
    (a variant's own fifth element overrides it): with the runtime's TVM-FFI calling convention or the classic one."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dump-dir", default=None, help="keep the PTX here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if os.environ.get("CUTE_DSL_ARCH") and importlib.metadata.version("nvidia-cutlass-dsl").startswith("4.3"):
        print("note: CUTE_DSL_ARCH is set; DSL 4.3.x then tries to load the CUDA driver", file=sys.stderr)
    root = pathlib.Path(args.dump_dir) if args.dump_dir else pathlib.Path(tempfile.mkdtemp(prefix="cute_ptx_"))
    print(f"nvidia-cutlass-dsl {importlib.metadata.version('nvidia-cutlass-dsl')}, target sm_90a, PTX in {root}")
    failures = []
    rows = []
    for name, kernel, arguments, required_wgmma, *convention in kernel_variants:
        start = time.perf_counter()
        try:
            ptx = _ptx_text(_compile(kernel, arguments, root / name, convention[0] if convention else tvm_ffi))
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
