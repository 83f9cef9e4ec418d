"""eval.stats and eval.report: the McNemar test against hand-computed values, spreads, tables and strict JSON."""

import json
import math

import pytest

from eval.report import format_number, format_table, write_json
from eval.stats import mcnemar_exact_p_value, paired_outcome, spread


@pytest.mark.parametrize(
    "b, c, expected",
    [
        (0, 0, 1.0),  # no discordant pairs
        (1, 0, 1.0),  # 2 * C(1,0) / 2 = 1
        (3, 0, 0.25),  # 2 * 1/8
        (0, 5, 0.0625),  # 2 * 1/32
        (5, 1, 0.21875),  # 2 * (1 + 6) / 64 = 14/64
        (2, 8, 0.109375),  # 2 * (1 + 10 + 45) / 1024 = 112/1024
        (10, 10, 1.0),  # capped at 1
        (25, 5, 2 * sum(math.comb(30, i) for i in range(6)) / 2**30),  # = 3.249e-4 (PR-style: 25 vs 5 discordant)
    ],
)
def test_mcnemar_exact_matches_hand_computed_values(b, c, expected):
    assert mcnemar_exact_p_value(b, c) == pytest.approx(expected, rel=1e-12)
    assert mcnemar_exact_p_value(c, b) == pytest.approx(expected, rel=1e-12)  # two-sided: symmetric


def test_mcnemar_stays_finite_for_thousands_of_pairs():
    assert 0.0 <= mcnemar_exact_p_value(2100, 1900) < 0.01
    assert mcnemar_exact_p_value(5000, 5000) == 1.0
    b, c = 700, 620
    assert mcnemar_exact_p_value(b, c) == pytest.approx(2 * sum(math.comb(b + c, i) for i in range(c + 1)) / 2 ** (b + c))


@pytest.mark.parametrize("b, c", [(-1, 0), (1.5, 0), (True, 2), ("3", 1)])
def test_mcnemar_rejects_bad_counts(b, c):
    with pytest.raises(ValueError, match="only_first_correct|only_second_correct"):
        mcnemar_exact_p_value(b, c)


def test_paired_outcome_counts_the_four_cells():
    first = {0: True, 1: True, 2: False, 3: False, 4: 1.0, 5: 0}
    second = {0: True, 1: False, 2: True, 3: False, 4: 0.0, 5: 0}
    outcome = paired_outcome(first, second)
    assert (outcome.both_correct, outcome.only_first_correct, outcome.only_second_correct, outcome.both_wrong) == (1, 2, 1, 2)
    assert outcome.samples == 6
    assert outcome.p_value == pytest.approx(mcnemar_exact_p_value(2, 1))


def test_paired_outcome_needs_the_same_samples_and_binary_values():
    with pytest.raises(ValueError, match="same keys"):
        paired_outcome({0: True, 1: False}, {0: True})
    with pytest.raises(ValueError, match="0/1"):
        paired_outcome({0: 0.5}, {0: 1})


def test_spread_and_number_formatting():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([]) is None
    assert format_number(None) == "-" and format_number(12345.6) == "12,346" and format_number(0.012345) == "0.0123"
    assert format_number(float("nan")) == "nan"


def test_format_table_pads_columns_and_checks_row_width():
    table = format_table(["a", "long header"], [[1, "x"], ["wide cell", 2]])
    lines = table.splitlines()
    assert lines[0] == "| a         | long header |"
    assert lines[1] == "|-----------|-------------|"
    assert len({len(line) for line in lines}) == 1
    with pytest.raises(ValueError, match="2 cells"):
        format_table(["a", "b", "c"], [[1, 2]])


def test_write_json_is_strict(tmp_path):
    path = write_json(tmp_path / "sub" / "out.json", {"a": float("nan"), "b": (1, 2), "c": float("inf"), "d": 1.5})
    assert json.loads(path.read_text()) == {"a": None, "b": [1, 2], "c": None, "d": 1.5}
