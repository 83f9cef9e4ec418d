"""The real-model evaluation's tables and its per-position loss plot."""

from __future__ import annotations

from pathlib import Path
from typing import List

__all__ = ["summary_table", "plot_position_loss"]


def _interval(comparison: dict) -> str:
    difference = comparison["difference"]
    return (f"{difference['mean']:+.4f} [{difference['low']:+.4f}, {difference['high']:+.4f}]  "
            f"ppl x{comparison['perplexity_ratio']:.4f}")


def summary_table(result: dict) -> str:
    """Per length: perplexity beyond the top-k pages' reach (loss difference to dense with its 95 % interval),
    pass-key and continuation accuracy with McNemar p-values (and the recall at the rows that predict the answer,
    min-mean over the sparse layers), and the mean recall of the sparse layers."""
    lines: List[str] = []
    for length, part in result["lengths"].items():
        perplexity = part.get("perplexity")
        bucket = perplexity["bucket"] if perplexity else None
        lines.append(f"{length} tokens" + (f" (beyond position {bucket}: loss difference to dense, 95 % interval)"
                                           if perplexity else ""))
        for name in result["variants"]:
            cells = [f"  {name:<18}"]
            if perplexity:
                rows = perplexity["buckets"][name]
                first = rows[f"0-{bucket}"]
                if name == "dense":
                    cells.append(f"ppl {first['perplexity']:.2f} below {bucket}")
                elif "beyond" in rows:
                    cells.append(_interval(rows["beyond"]["versus_dense"]))
                    if "versus_sparse" in rows["beyond"]:
                        cells.append(f"vs sparse {_interval(rows['beyond']['versus_sparse'])}")
            for kind in ("needle", "continuation"):
                if kind in part:
                    summary = part[kind]["summary"][name]
                    text = f"{kind} {summary['accuracy']:.3f} (greedy {summary['greedy_accuracy']:.3f})"
                    if "versus_dense" in summary:
                        text += f" p={summary['versus_dense']['mcnemar_p']:.3g}"
                    at_answer = [layer["recall_at_answer"] for layer in summary.get("recall", [])
                                 if layer.get("recall_at_answer") is not None]
                    if at_answer:
                        text += f" (recall at the answer {min(at_answer):.2f}-{sum(at_answer) / len(at_answer):.3f})"
                    cells.append(text)
            recall = (perplexity or {}).get("recall", {}).get(name)
            if recall:
                cells.append(f"recall {sum(r['recall'] for r in recall) / len(recall):.3f}")
            lines.append("  ".join(cells))
    return "\n".join(lines)


def plot_position_loss(result: dict, path: Path) -> Path:
    """The mean loss per 128 positions by variant, at the longest length measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    length = max(result["lengths"], key=int)
    perplexity = result["lengths"][length]["perplexity"]
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name, profile in perplexity["profile"].items():
        axis.plot([128 * (i + 0.5) for i in range(len(profile))], profile, label=name, linewidth=1.2)
    axis.axvline(perplexity["bucket"], color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel("position in the window (tokens)")
    axis.set_ylabel("mean loss per 128 positions (nats)")
    axis.set_title(f"Converted SmolLM2-135M, held-out books, {length}-token windows "
                   f"({len(perplexity['windows'])} windows)")
    axis.legend()
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from ..report import atomic_write

    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120))
    plt.close(figure)
    return path
