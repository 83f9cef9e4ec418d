"""What loading a checkpoint costs: ``python -m minimax_m3.bench_loading PATH [--device cuda]``.

Loads ``PATH`` (any layout ``from_pretrained`` reads, e.g. ``minimax_m3.synthetic_checkpoint``'s) with
``MiniMaxM3ForCausalLM.from_pretrained(PATH, dtype=bfloat16, device_map=DEVICE)`` and reports the wall time, the
process's host memory before loading and its peak during the load, the largest shard, and on CUDA the peak and final
GPU memory the allocator saw. Host memory is reported twice (Linux): the memory the process allocated (``RssAnon``,
sampled every 2 ms) and its whole resident set (``VmHWM``, reset first through ``/proc/self/clear_refs``), which also
counts the pages of the memory-mapped shards that the loader has read: page cache that the kernel reclaims under
pressure, so a host with less memory than the checkpoint still loads it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from typing import Optional

import torch

__all__ = ["host_memory_bytes", "reset_peak_host_memory", "HostMemorySampler", "load_measured", "measure_loading",
           "describe", "main"]


def _status_field(name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_memory_bytes() -> dict:
    """The process's resident memory now and its peak (``VmRSS`` / ``VmHWM``; None where /proc is missing)."""
    return {"resident": _status_field("VmRSS"), "peak": _status_field("VmHWM")}


def reset_peak_host_memory() -> bool:
    """Reset the kernel's record of the peak resident memory (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class HostMemorySampler:
    """The peak of the process's anonymous resident memory (``RssAnon``: what it allocated) and of its file-backed
    resident memory (``RssFile``: mapped shard pages, the kernel's page cache, reclaimable), sampled every
    ``interval`` seconds by a thread; the kernel keeps only the peak of their sum (``VmHWM``)."""

    def __init__(self, interval: float = 0.002):
        import threading

        self.interval = interval
        self.peak_anonymous = self.peak_file = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        anonymous, file = _status_field("RssAnon"), _status_field("RssFile")
        if anonymous is not None:
            self.peak_anonymous = max(self.peak_anonymous or 0, anonymous)
        if file is not None:
            self.peak_file = max(self.peak_file or 0, file)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()
        self._sample()


def _largest_shard_bytes(path: pathlib.Path) -> int:
    return max((file.stat().st_size for file in path.glob("*.safetensors")), default=0)


def measure_loading(path, device: str = "cuda") -> dict:
    """Load ``path`` as bf16 onto ``device`` and return the measurements (the model is dropped afterwards)."""
    model, result = load_measured(path, device)
    del model
    return result


def load_measured(path, device: str = "cuda", **from_pretrained_kwargs):
    """``(model, measurements)``: ``path`` loaded as bf16 onto ``device``, ``from_pretrained_kwargs`` passed on."""
    from .modeling_minimax_m3 import MiniMaxM3ForCausalLM

    path = pathlib.Path(path)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = host_memory_bytes()["resident"]
    anonymous_before = _status_field("RssAnon")
    peak_reset = reset_peak_host_memory()
    start = time.perf_counter()
    with HostMemorySampler() as sampler:
        model = MiniMaxM3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device,
                                                     **from_pretrained_kwargs)
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    host = host_memory_bytes()
    result = {
        "path": str(path), "device": device, "load_seconds": seconds,
        "host_resident_before_bytes": before, "host_peak_bytes": host["peak"] if peak_reset else None,
        "host_anonymous_before_bytes": anonymous_before, "host_anonymous_peak_bytes": sampler.peak_anonymous,
        "host_file_backed_peak_bytes": sampler.peak_file,
        "host_resident_after_bytes": host["resident"], "largest_shard_bytes": _largest_shard_bytes(path),
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "layers": model.config.num_hidden_layers,
    }
    if cuda:
        result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        result["gpu_allocated_bytes"] = torch.cuda.memory_allocated()
    return model, result


def describe(result: dict) -> str:
    """One line of ``measure_loading``'s result."""
    gib = 2.0**30

    def shown(value):
        return "n/a" if value is None else f"{value / gib:.2f} GiB"

    line = (f"loaded {result['layers']} layers ({result['parameter_bytes'] / gib:.1f} GiB of bf16/fp32 weights) in "
            f"{result['load_seconds']:.1f} s; host memory: allocated {shown(result['host_anonymous_before_bytes'])} "
            f"before, peak {shown(result['host_anonymous_peak_bytes'])}; mapped shard pages peak "
            f"{shown(result['host_file_backed_peak_bytes'])}; resident peak {shown(result['host_peak_bytes'])} "
            f"(largest shard {shown(result['largest_shard_bytes'])})")
    if "gpu_peak_bytes" in result:
        line += f"; GPU peak {shown(result['gpu_peak_bytes'])}, after {shown(result['gpu_allocated_bytes'])}"
    return line


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a checkpoint directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    path = pathlib.Path(args.path)
    if not (path / "config.json").is_file():
        parser.error(f"{path} is not a checkpoint directory (no config.json)")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device")
    result = measure_loading(path, args.device)
    print(describe(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
