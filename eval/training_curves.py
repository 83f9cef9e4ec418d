"""Loss curves of a ``python -m eval.train_tiny`` run, drawn from its ``training_log.jsonl``:
``python -m eval.training_curves RUN_DIR [--output PNG]``.

Stage 1: the training loss per logged window and the curriculum's held-out dense accuracy per task, with the
curriculum phases (document lengths) marked; stage 2: the indexer's KL per sparse layer. ``export`` of the trainer writes
``training_curves.png`` beside the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Optional, Sequence

from .cli import add_debug_argument, run_main
from .report import checked_output_path, pyplot, save_figure

__all__ = ["SUPERSEDED_EVENT", "read_log", "plot_training_curves", "run_command", "main"]


SUPERSEDED_EVENT = "superseded"
"""A resumed run's first record: the log's bytes ``[from_byte, to_byte)`` hold records written after the checkpoint
it resumed from, which it redoes."""


def read_log(path: Path) -> List[dict]:
    """A training log's records, without those a resumed run redid: a ``superseded`` record names the byte range of
    the records written after the checkpoint it resumed from (the log itself is never cut). A record cut short by a
    kill can only lie in such a range."""
    lines, offset = [], 0
    for line in Path(path).read_bytes().splitlines(keepends=True):
        if line.strip():
            lines.append((offset, line))
        offset += len(line)
    parsed = []
    for offset, line in lines:
        try:
            parsed.append((offset, json.loads(line)))
        except json.JSONDecodeError:
            parsed.append((offset, None))
    superseded = [(record["from_byte"], record["to_byte"]) for _, record in parsed
                  if record is not None and record.get("event") == SUPERSEDED_EVENT]
    records = []
    for offset, record in parsed:
        if any(begin <= offset < end for begin, end in superseded):
            continue
        if record is None:
            raise ValueError(f"{path}: the record at byte {offset} is not valid JSON")
        if record.get("event") != SUPERSEDED_EVENT:
            records.append(record)
    return records


def plot_training_curves(records: Sequence[dict], output: Path) -> Path:
    """Draw the curves of ``records`` (a training log) into ``output``."""
    plt = pyplot()
    stage1 = [r for r in records if r["event"] == "train" and r["stage"] == 1]
    stage2 = [r for r in records if r["event"] == "train" and r["stage"] == 2]
    curriculum = [r for r in records if r["event"] == "eval" and r.get("kind") == "curriculum"]
    figure, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    loss_axis, accuracy_axis, kl_axis = axes
    loss_axis.plot([r["step"] for r in stage1], [r["loss"] for r in stage1], linewidth=0.8)
    loss_axis.set_yscale("log")
    loss_axis.set_title("stage 1: training loss (answers + next token)")
    for task, style in (("passkey", "-"), ("key_value", "--")):
        points = [(r["step"], r["by_task"][task]) for r in curriculum if task in r.get("by_task", {})]
        if points:
            accuracy_axis.plot(*zip(*points), style, marker=".", linewidth=0.8, label=task)
    accuracy_axis.set_ylim(-0.02, 1.02)
    accuracy_axis.set_title("stage 1: held-out dense accuracy (curriculum)")
    if curriculum:
        accuracy_axis.legend(fontsize=8)
    boundary = 0
    for phase in (r for r in records if r["event"] == "phase_end"):  # phases end in order; steps are per phase
        lengths = "/".join(f"{length // 1024}K" if length >= 1024 else str(length) for length in phase["lengths"])
        for axis in (loss_axis, accuracy_axis):
            axis.axvline(boundary, color="grey", alpha=0.3, linewidth=0.8)
        accuracy_axis.text(boundary, 1.0, f" {lengths}", fontsize=6, color="grey", va="top", rotation=90)
        boundary += phase["steps"]
    for layer in sorted({key for r in stage2 for key in r.get("kl_by_layer", {})}, key=int):
        kl_axis.plot([r["step"] for r in stage2], [r["kl_by_layer"][layer] for r in stage2], label=f"layer {layer}")
    kl_axis.set_yscale("log")
    kl_axis.set_title("stage 2: KL(attention mass || indexer)")
    if stage2:
        kl_axis.legend(fontsize=8)
    for axis in axes:
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    return save_figure(figure, output, dpi=100)


def run_command(argv: Optional[Sequence[str]] = None) -> Path:
    """The command line's work; returns the plot's path (``main`` is the command-line entry point)."""
    parser = argparse.ArgumentParser(prog="python -m eval.training_curves", description=__doc__.splitlines()[0].replace("``", "`"))
    parser.add_argument("run", type=Path, help="the run's output directory (holds training_log.jsonl)")
    parser.add_argument("--output", type=Path, default=None,
                        help="PNG path (default: RUN/training_curves.png, the run's own plot, redrawn in place)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    arguments = add_debug_argument(parser).parse_args(argv)
    log = arguments.run / "training_log.jsonl"
    if not log.is_file():
        raise SystemExit(f"{arguments.run}: no training_log.jsonl (give the --output directory of python -m "
                         f"eval.train_tiny)")
    # the run's own plot is a drawing of its log, redrawn in place as the trainer's export does; any other path
    # keeps an existing file unless --overwrite
    output = checked_output_path(arguments.output or arguments.run / "training_curves.png", "training_curves",
                                 overwrite=arguments.overwrite or arguments.output is None, suffix=".png")
    path = plot_training_curves(read_log(log), output)
    print(f"curves: {path}")
    return path


def main(argv: Optional[Sequence[str]] = None) -> None:
    run_main(run_command, argv)


if __name__ == "__main__":
    main()
