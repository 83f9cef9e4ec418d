"""Output of the evaluations: aligned Markdown tables, strict JSON files and the throughput plot."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

from minimax_m3.command_line import atomic_write, check_writable_parent, checked_output_file

__all__ = ["RESULTS_DIRECTORY", "default_output_path", "checked_output_path", "checked_output_directory", "format_table", "format_number",
           "NOISY_MARK", "noisy_mark", "noise_footnote", "timing_cells", "write_json", "atomic_write", "to_jsonable", "pyplot", "save_figure", "plot_throughput",
           "environment"]

RESULTS_DIRECTORY = Path("eval_results")
NOISY_MARK = "*"


def default_output_path(kind: str) -> Path:
    """``eval_results/<kind>-<local time>.json`` under the current directory (git-ignored in the repository), with
    ``-2``, ``-3``, ... when a run of the same second already wrote that name: fresh per run."""
    stem = f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, number = RESULTS_DIRECTORY / f"{stem}.json", 1
    while path.exists() or path.with_suffix(".png").exists():
        number += 1
        path = RESULTS_DIRECTORY / f"{stem}-{number}.json"
    return path


def checked_output_path(output, kind: str, *, overwrite: bool, argument: str = "--output",
                        suffix: str = ".json") -> Path:
    """The results path of a command, checked before any work: ``default_output_path(kind)`` when ``output`` is
    None, else ``minimax_m3.command_line.checked_output_file``."""
    if output is None:
        return default_output_path(kind)
    return checked_output_file(output, overwrite=overwrite, argument=argument, example_name=kind + suffix)


def checked_output_directory(output, argument: str = "--output") -> Path:
    """An output directory, checked before any work: a file, or a directory (or the nearest existing parent of a
    new one) that cannot be written, raise ``SystemExit`` naming ``argument``; what it holds is the command's
    business."""
    path = Path(output)
    if path.exists() and not path.is_dir():
        raise SystemExit(f"{argument} {path} is a file: give a directory")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise SystemExit(f"{argument} {path} is not writable")
        return path
    check_writable_parent(path, argument)
    return path


def format_number(value, digits: int = 3) -> str:
    """``-`` for None, ``nan``/``inf`` spelled out, thousands separators for large values, else ``digits``
    significant figures."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def format_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A Markdown table with columns padded to their widest cell (readable as plain text too)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    for row in cells[1:]:
        if len(row) != len(headers):
            raise ValueError(f"table row has {len(row)} cells, the header {len(headers)}: {row}")
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)


def to_jsonable(value):
    """Plain JSON types; non-finite floats become None (strict JSON), tuples lists, paths and dtypes strings."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return to_jsonable(value.item())
    return str(value)


def noisy_mark(result: dict) -> str:
    """`` *`` after the timing of a result flagged ``noisy`` (``eval.stats.is_noisy``), else nothing."""
    return f" {NOISY_MARK}" if result.get("noisy") else ""


def noise_footnote(results: Iterable[dict]) -> Optional[str]:
    """The line under a table with noisy rows, None without any."""
    from .stats import NOISY_MAX_OVER_MIN

    ratios = [r["max_over_min"] for r in results if r.get("noisy")]
    if not ratios:
        return None
    return (f"{NOISY_MARK} noisy: the slowest timing took more than {NOISY_MAX_OVER_MIN}x the fastest (up to "
            f"{max(ratios):.2f}x here), so the median is unreliable; rerun on an idle machine or with more seeds")


def timing_cells(result: dict, decimals: int = 1) -> list:
    """A finished row's last four table cells: median [min–max] milliseconds (marked when noisy), median tokens/s,
    peak GiB and the speed-up over dense (or the status and dashes for a row that did not finish)."""
    if result["status"] != "ok":
        return [result["status"], "-", "-", "-"]
    s = result["seconds"]
    return [f"{s['median'] * 1e3:,.{decimals}f} [{s['min'] * 1e3:,.{decimals}f}–{s['max'] * 1e3:,.{decimals}f}]"
            + noisy_mark(result),
            format_number(result["tokens_per_second"]["median"]), format_number(result["peak_memory_gib"]),
            "-" if result.get("speedup_vs_dense") is None else f"{result['speedup_vs_dense']:.2f}x"]


def write_json(path, payload) -> Path:
    """Strict JSON (``to_jsonable``: non-finite floats become null), written atomically."""
    text = json.dumps(to_jsonable(payload), indent=1, allow_nan=False) + "\n"
    return atomic_write(path, lambda temporary: temporary.write_text(text))


def _tokens_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display on servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path, dpi: int = 120) -> Path:
    """Lay out, write (creating the directory) and close ``figure``; returns the path."""
    figure.tight_layout()
    try:
        # the format from the final name's suffix: the temporary one ends in .tmp
        atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=dpi, format=Path(path).suffix[1:] or "png"))
    finally:
        pyplot().close(figure)
    return Path(path)


def plot_throughput(results: Sequence[dict], path, title: Optional[str] = None) -> Optional[Path]:
    """Input tokens/s against prompt length, one line per (mode, batch size) for fresh prompts, one marker per
    mode for chunked prefill and for prefix-cached turns; with decode workloads, a second panel of milliseconds per
    output token against the context, one line per (mode, graphs or eager, batch size); every point the median
    with min–max error bars; log axes; OOM points as a red x on the axis. None when nothing finished."""
    plt = pyplot()

    prefill = [r for r in results if r["workload"] != "decode"]
    decode = [r for r in results if r["workload"] == "decode"]
    if not any(r.get("status") == "ok" for r in results):
        return None
    colours = {}
    for result in results:
        colours.setdefault(result["mode"], f"C{len(colours)}")
    panels = [p for p in (prefill, decode) if any(r.get("status") == "ok" for r in p)]
    figure, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.8), squeeze=False)
    for panel, rows in zip(axes[0], panels):
        if rows is prefill:
            _plot_prefill(panel, rows, colours)
            panel.set_title(title or "Prefill throughput")
        else:
            _plot_decode(panel, rows, colours)
            panel.set_title("Decode: time per output token")
    return save_figure(figure, path)


def _length_axis(axes, results, label: str) -> None:
    import matplotlib.ticker

    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    lengths = sorted({r["length"] for r in results})
    axes.set_xticks(lengths, [_tokens_label(n) for n in lengths])
    axes.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axes.set_xlabel(label)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)


def _plot_out_of_memory(axes, results, finished, value) -> None:
    out_of_memory = [r for r in results if r.get("status") == "OOM"]
    if out_of_memory:
        bottom = min(value(r) for r in finished)
        axes.scatter([r["length"] for r in out_of_memory], [bottom * 0.5] * len(out_of_memory), marker="x",
                     color="red", s=60, label="out of memory")


def _with_range(axes, points, **style) -> None:
    """``points``: ``(x, summary)`` with ``summary`` a ``spread``; the medians, with min–max error bars."""
    points = sorted(points, key=lambda p: p[0])
    medians = [p[1]["median"] for p in points]
    below = [m - p[1]["min"] for m, p in zip(medians, points)]
    above = [p[1]["max"] - m for m, p in zip(medians, points)]
    axes.errorbar([p[0] for p in points], medians, yerr=[below, above], capsize=3, elinewidth=1, **style)


def _milliseconds(summary: dict) -> dict:
    return {key: value * 1e3 for key, value in summary.items()}


def _plot_prefill(axes, results, colours) -> None:
    finished = [r for r in results if r.get("status") == "ok"]
    lines = {}
    for result in finished:
        if result["workload"] == "fresh":
            lines.setdefault((result["mode"], result["batch_size"]), []).append(
                (result["length"], result["tokens_per_second"]))
    for (mode, batch), points in sorted(lines.items()):
        label = mode if batch == 1 else f"{mode}, batch {batch}"
        _with_range(axes, points, marker="o", color=colours[mode], label=label, linestyle="-" if batch == 1 else "--")
    for result in finished:
        if result["workload"] in ("chunked", "turns"):
            chunked = result["workload"] == "chunked"
            label = (f"{result['mode']}, chunked ({result['chunk_size']}-token chunks)" if chunked
                     else f"{result['mode']}, {result['chunk_size']}-token turns over the prefix")
            _with_range(axes, [(result["length"], result["tokens_per_second"])], marker="s" if chunked else "D",
                        markersize=8 if chunked else 7, color=colours[result["mode"]], markeredgecolor="black",
                        linestyle="none", label=label)
    _plot_out_of_memory(axes, results, finished, lambda r: r["tokens_per_second"]["median"])
    axes.set_ylabel("input tokens / s (median, bars: min–max over seeds)")
    _length_axis(axes, results, "prompt / context length (tokens)")


def _plot_decode(axes, results, colours) -> None:
    finished = [r for r in results if r.get("status") == "ok"]
    lines = {}
    for result in finished:
        lines.setdefault((result["mode"], result["graphs"], result["batch_size"]), []).append(
            (result["length"], _milliseconds(result["seconds"])))
    for (mode, graphs, batch), points in sorted(lines.items()):
        label = f"{mode}, {'graphs' if graphs else 'eager'}" + ("" if batch == 1 else f", batch {batch}")
        _with_range(axes, points, marker="o" if graphs else "^", color=colours[mode], label=label,
                    linestyle="-" if graphs else ":")
    _plot_out_of_memory(axes, results, finished, lambda r: r["seconds"]["median"] * 1e3)
    axes.set_ylabel("ms per output token (median, bars: min–max over steps)")
    _length_axis(axes, results, "context length (tokens)")


def environment() -> dict:
    """Versions and the GPU, recorded with every result file."""
    import torch
    import transformers

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    lm_eval = sys.modules.get("lm_eval")
    if lm_eval is not None:
        info["lm_eval"] = getattr(lm_eval, "__version__", "unknown")
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info
