"""Hugging Face-style MiniMax-M3 whose sparse attention layers run on ``indexer`` (issue 4; not built yet)."""
