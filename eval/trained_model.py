"""Where the shipped trained tiny MiniMax-M3 lives (``eval/models/tiny-minimax-m3-retrieval``, model card inside).

It is trained by ``python -m eval.train_tiny`` (docs/TRAINING.md) and is the default model of
``eval.retrieval_accuracy`` and of ``eval.accuracy``'s retrieval-by-length report.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TRAINED_MODEL_NAME", "trained_model_dir"]

TRAINED_MODEL_NAME = "tiny-minimax-m3-retrieval"


def trained_model_dir() -> Path:
    path = Path(__file__).resolve().parent / "models" / TRAINED_MODEL_NAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the trained tiny model is not at {path}: train one with `python -m eval.train_tiny "
                                f"--output {path}` (docs/TRAINING.md) or pass --model")
    return path
