"""Accuracy and prefill-throughput evaluation of ``minimax_m3`` (issue 5; not built yet)."""
