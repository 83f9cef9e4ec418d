"""Statistics for the reports: the paired exact (McNemar) test, median/spread summaries and when a spread is noise."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

__all__ = ["PairedOutcome", "mcnemar_exact_p_value", "paired_outcome", "spread", "NOISY_MAX_OVER_MIN", "max_over_min",
           "is_noisy", "bootstrap_mean_interval"]

NOISY_MAX_OVER_MIN = 1.5
"""A timing whose slowest run takes more than this many times its fastest: its median is not to be trusted."""


def mcnemar_exact_p_value(only_first_correct: int, only_second_correct: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs.

    Under the null hypothesis (both systems equally accurate) each of the ``n = b + c`` discordant pairs goes
    either way with probability 1/2, so ``min(b, c)`` is Binomial(n, 1/2) in its lower tail:
    ``p = min(1, 2 * sum_{i <= min(b, c)} C(n, i) / 2^n)``; ``p = 1`` without discordant pairs.
    """
    for name, value in (("only_first_correct", only_first_correct), ("only_second_correct", only_second_correct)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    discordant = only_first_correct + only_second_correct
    if discordant == 0:
        return 1.0
    # exact integers up to the one division (no underflow for thousands of pairs); C(n, i+1) from C(n, i) keeps
    # the tail linear in min(b, c) where summing math.comb(n, i) term by term would be quadratic
    term = tail = 1
    for i in range(min(only_first_correct, only_second_correct)):
        term = term * (discordant - i) // (i + 1)
        tail += term
    return min(1.0, 2 * tail / 2**discordant)


@dataclass(frozen=True)
class PairedOutcome:
    """Per-sample correctness of two systems on the same samples (``first`` = sparse, ``second`` = dense)."""

    samples: int
    both_correct: int
    only_first_correct: int
    only_second_correct: int
    both_wrong: int
    p_value: float

    def as_dict(self) -> dict:
        return asdict(self)


def paired_outcome(first: dict, second: dict) -> PairedOutcome:
    """McNemar outcome of two ``{sample key: correct (bool or 0/1)}`` maps over the same keys."""
    if set(first) != set(second):
        missing = sorted(map(str, set(first) ^ set(second)))[:5]
        raise ValueError(f"paired samples must have the same keys; these differ (first 5): {missing}")
    counts = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
    for key, value in first.items():
        counts[(_as_correct(value, key), _as_correct(second[key], key))] += 1
    return PairedOutcome(
        samples=len(first),
        both_correct=counts[(True, True)],
        only_first_correct=counts[(True, False)],
        only_second_correct=counts[(False, True)],
        both_wrong=counts[(False, False)],
        p_value=mcnemar_exact_p_value(counts[(True, False)], counts[(False, True)]),
    )


def _as_correct(value, key) -> bool:
    if value in (0, 1):  # True/False, 0/1, 0.0/1.0
        return bool(value)
    raise ValueError(f"sample {key!r}: correctness must be 0/1 or a bool, got {value!r}")


def spread(values: Sequence[float]) -> Optional[dict]:
    """``{"median", "min", "max"}`` of ``values``; None when empty."""
    values = list(values)
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def max_over_min(summary: Optional[dict]) -> Optional[float]:
    """``max / min`` of a ``spread`` summary; None without one or with a minimum that is not positive."""
    if not summary or not summary["min"] > 0:
        return None
    return summary["max"] / summary["min"]


def is_noisy(summary: Optional[dict]) -> bool:
    ratio = max_over_min(summary)
    return ratio is not None and ratio > NOISY_MAX_OVER_MIN


def bootstrap_mean_interval(values: Sequence[float], *, confidence: float = 0.95, resamples: int = 10000,
                            seed: int = 0) -> dict:
    """``{"mean", "low", "high", "units"}``: the mean of ``values`` (one per independent unit, e.g. per document)
    and its percentile bootstrap interval at ``confidence`` over ``resamples`` resamplings of the units."""
    import numpy

    values = numpy.asarray(values, dtype=numpy.float64)
    if values.ndim != 1 or values.size < 2:
        raise ValueError(f"the bootstrap needs a 1-D sequence of at least 2 values, got shape {values.shape}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = numpy.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    return {"mean": float(values.mean()), "low": float(numpy.quantile(means, tail)),
            "high": float(numpy.quantile(means, 1 - tail)), "units": int(values.size)}
