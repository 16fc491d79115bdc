"""Exact sums: bitwise the correctly rounded Σ wᵢ·rowᵢ (checked with Python's exact rationals) for any order,
any grouping over simulated ranks, adversarial magnitudes, the bounds, and one clear error for bad input."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpifl.comm import exactsum
from mpifl.comm.exactsum import (
    FOLDS_PER_NORMALISATION,
    MAX_EXPONENT,
    MAX_RANKS,
    ExactSum,
    Window,
    exact_sum,
    round_sum,
    words,
)

TINY = 5e-324  # the smallest subnormal


def reference(rows: np.ndarray, weights) -> np.ndarray:
    """Each coordinate's exact sum of the float64 products, as a rational, rounded once (Fraction → float is
    correctly rounded, ties to even); an exact zero is +0.0."""
    out = []
    for j in range(rows.shape[1]):
        total = sum((Fraction(float(w) * float(row[j])) for w, row in zip(weights, rows)), Fraction(0))
        out.append(float(total))
    return np.array(out, dtype=np.float64)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float64 and np.array_equal(a.view(np.int64), b.view(np.int64))


def over_ranks(rows: np.ndarray, weights, groups: list[list[int]]) -> np.ndarray:
    """What the reduction computes: each group of rows is one rank's total; the ranks agree on a window
    (MPI.MAX of the maxima), export, and their int64 buffers are added (MPI.SUM), then rounded once."""
    totals = []
    for group in groups:
        total = ExactSum(rows.shape[1])
        for i in group:
            total.add(rows[i], weights[i])
        totals.append(total)
    agreed = Window.from_maxima(np.max([t.window.maxima() for t in totals], axis=0))
    wire = np.sum([t.export(agreed) for t in totals], axis=0)
    return round_sum(wire, agreed)


def adversarial_rows(rng: np.random.Generator, count: int, size: int) -> np.ndarray:
    """Magnitudes from 1e-30 to 1e30 mixed in every column, subnormals, signed zeros, a row that cancels the
    others, and exact powers of two that put sums on rounding ties."""
    rows = rng.standard_normal((count, size)) * 10.0 ** rng.uniform(-30, 30, (count, size))
    rows[:, 0] = TINY * rng.integers(-5, 6, count)
    rows[:, 1] = rng.choice([0.0, -0.0], count)
    rows[0, 2], rows[1 % count, 2] = 1.0, 2.0**-53  # 1 + half an ulp: a tie, to even (1.0)
    rows[:, 3] = [2.0 ** int(e) for e in rng.integers(-1074, 900, count)]
    if count > 1:
        rows[-1, 4:] = -rows[:-1, 4:].sum(axis=0)  # heavy cancellation
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_exact_rational_sum_rounded_once(seed):
    rng = np.random.default_rng(seed)
    rows = adversarial_rows(rng, 7, 40)
    weights = 10.0 ** rng.uniform(-4, 4, 7) * rng.choice([-1.0, 1.0], 7)
    assert same_bits(exact_sum(rows, weights), reference(rows, weights))


def test_float32_rows_are_weighted_in_float64():
    """Each term is fl64(w·row), not fl32: 0.1·3.3f in float32 would round differently."""
    row = np.array([3.3, 1e-30, 7e30], dtype=np.float32)
    assert same_bits(exact_sum(row[None], [0.1]), 0.1 * row.astype(np.float64))


def test_rounding_ties_go_to_even_and_the_sticky_bit_breaks_them():
    one_ulp = 2.0**-52
    cases = {  # terms → the correctly rounded sum, by hand
        (1.0, 2.0**-53): 1.0,  # halfway between 1 and 1 + ulp: the even one
        (1.0 + one_ulp, 2.0**-53): 1.0 + 2 * one_ulp,  # halfway, the even one is above
        (1.0, 2.0**-53, TINY): 1.0 + one_ulp,  # a bit far below the tie tips it up
        (1.0, 2.0**-53, -TINY): 1.0,  # ... or down
        (2.0**900 - 2.0**847, 2.0**846): 2.0**900,  # the largest terms (|x| < 2**900) tie upwards
        (-1.0, -(2.0**-53)): -1.0,
        (1e30, 1.0, -1e30): 1.0,  # cancellation leaves the small term
        (TINY, TINY, -TINY): TINY,  # subnormals add exactly
        (-0.0, -0.0): 0.0,  # a zero total is +0.0
    }
    for terms, expected in cases.items():
        got = exact_sum(np.array(terms)[:, None])[0]
        assert math.copysign(1, got) == math.copysign(1, expected) and got == expected, (terms, got)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_order_and_grouping_over_ranks_gives_the_same_bits(data):
    finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e30, max_value=1e30, allow_subnormal=True)
    count = data.draw(st.integers(1, 8), label="rows")
    size = data.draw(st.integers(1, 5), label="size")
    rows = np.array(data.draw(st.lists(st.lists(finite, min_size=size, max_size=size), min_size=count,
                                       max_size=count)), dtype=np.float64).reshape(count, size)
    weights = data.draw(st.lists(st.floats(-1e3, 1e3), min_size=count, max_size=count))
    expected = reference(rows, weights)
    order = data.draw(st.permutations(range(count)), label="order")
    ranks = data.draw(st.integers(1, 4), label="ranks")
    groups = [[i for k, i in enumerate(order) if k % ranks == r] for r in range(ranks)]
    assert same_bits(over_ranks(rows, weights, groups), expected)


def test_groupings_of_many_rows_agree_bitwise(monkeypatch):
    """Several chunks per row (a small CHUNK), windows that differ per rank (one rank sees only the tiny
    rows), ranks with nothing folded."""
    monkeypatch.setattr(exactsum, "CHUNK", 8)
    rng = np.random.default_rng(11)
    rows = adversarial_rows(rng, 12, 30).astype(np.float64)
    rows[5:8] *= 1e-200
    weights = rng.uniform(-2, 2, 12)
    expected = reference(rows, weights)
    shuffled = list(range(12))
    random.Random(3).shuffle(shuffled)
    for groups in ([list(range(12))], [shuffled], [[5, 6, 7], [0, 1, 2, 3, 4, 8, 9, 10, 11], []],
                   [shuffled[0::3], shuffled[1::3], shuffled[2::3], []], [[i] for i in reversed(range(12))]):
        assert same_bits(over_ranks(rows, weights, groups), expected), groups


def test_rows_outside_the_levels_add_levels_mid_row(monkeypatch):
    """The first row sets the levels; later chunks far above and far below (down to subnormals, which re-cut
    the levels onto float64's smallest unit) widen them part-way through a row."""
    monkeypatch.setattr(exactsum, "CHUNK", 4)
    rows = np.ones((4, 12))
    rows[1, 4:8] = 1e250
    rows[2, 8:] = 1e-200
    rows[3, 5] = TINY
    rows[3, 9] = 3e-310
    total = ExactSum(12)
    for row in rows:
        total.add(row, 0.75)
    assert total.window.lowest == -1074 and total._grid_or_raise.base == -1074
    assert same_bits(round_sum(total.export(total.window), total.window), reference(rows, [0.75] * 4))


def test_a_tie_is_broken_by_a_bit_at_any_distance_below_it():
    """1 + 2^-53 is a tie; one more bit 2^-k, for every k down to float64's last, decides it (whichever level
    and digit that bit lands in)."""
    for k in range(54, 1075):
        for sign in (1.0, -1.0):
            terms = np.array([[sign], [sign * 2.0**-53], [sign * 2.0**-k]])
            assert exact_sum(terms)[0] == sign * (1.0 + 2.0**-52), k
            assert exact_sum(terms, [1.0, 1.0, -1.0])[0] == sign * 1.0, k


def test_no_level_overflows_when_every_term_fills_every_level():
    """Terms that put the largest digit, 2^(W−1), into every level (a subnormal pins the levels to float64's
    smallest unit, so the level boundaries −1074 + 50k are known), folded 2·FOLDS_PER_NORMALISATION + 3 times
    (twice the carries must move up, else the levels wrap past 2^63), and that total added over MAX_RANKS
    ranks (int64, as MPI.SUM adds it): still exact."""
    width = exactsum.WIDTH
    below_boundaries = [2.0 ** (-1074 + width * k - 1) for k in range(1, 6)]  # 2^(W−1) units of the level below
    top = 2.0 ** (-1074 + 6 * width - 1) * (1 - 2.0**-53)  # rounds to 2^(W−1) units of the top level
    row = np.array([TINY, *below_boundaries, top, -top])
    folds = 2 * FOLDS_PER_NORMALISATION + 3
    total = ExactSum(len(row))
    for _ in range(folds):
        total.add(row)
    assert total._grid_or_raise.base == -1074 and total._grid_or_raise.levels == 6
    wire = total.export(total.window)
    for copies in (folds, folds * MAX_RANKS):
        expected = np.array([float(Fraction(x) * copies) for x in row])
        assert same_bits(round_sum(wire * (copies // folds), total.window), expected), copies


def test_terms_up_to_the_range_limit_sum_exactly():
    largest = 2.0**MAX_EXPONENT - 2.0 ** (MAX_EXPONENT - 53)
    rows = np.array([[largest, -largest, largest], [largest, largest, -TINY]])
    assert same_bits(exact_sum(rows, [1.0, 1.0]), np.array([2 * largest, 0.0, largest]))


def test_the_wire_buffer_splits_at_whole_chunks(monkeypatch):
    """A reduce-scatter may hand each rank a block of whole chunks: rounding the blocks apart gives the
    whole's bits."""
    monkeypatch.setattr(exactsum, "CHUNK", 4)
    rng = np.random.default_rng(5)
    rows = adversarial_rows(rng, 3, 10)
    total = ExactSum(10)
    for row in rows:
        total.add(row, 0.5)
    wire, per = total.export(total.window), words(total.window)
    whole = round_sum(wire, total.window)
    parts = [round_sum(wire[start * per : (start + 4) * per], total.window) for start in (0, 4, 8)]
    assert same_bits(np.concatenate(parts), whole) and same_bits(whole, reference(rows, [0.5] * 3))


def test_nothing_folded_exports_zeros_and_an_empty_window():
    total = ExactSum(3)
    total.add(np.zeros(3, dtype=np.float32), 2.0)
    total.add(np.ones(3), 0.0)
    assert total.window.empty and total.nbytes == 0
    assert same_bits(round_sum(total.export(total.window), total.window), np.zeros(3))


def test_the_accumulator_is_small_for_typical_model_deltas():
    """Float32 deltas of 1e-10..1e1 weighted by 1e-3 (91 bits): two levels and the carry (24 bytes per entry)."""
    rng = np.random.default_rng(0)
    row = (rng.choice([-1.0, 1.0], 1000) * 10.0 ** rng.uniform(-10, 1, 1000)).astype(np.float32)
    row[:2] = [1e-10, 9.9]
    total = ExactSum(1000)
    total.add(row, 1e-3)
    assert total.nbytes == 24 * 1000 and words(total.window) == 3


@pytest.mark.parametrize(("row", "weight", "error", "match"), [
    (np.array([1.0, np.nan]), 1.0, ValueError, "NaN or ±inf"),
    (np.array([np.inf, 1.0], dtype=np.float32), 1.0, ValueError, "NaN or ±inf"),
    (np.array([1.0, 2.0]), math.inf, ValueError, "weight inf is not finite"),
    (np.array([2.0**MAX_EXPONENT, 1.0]), 1.0, ValueError, "out of range"),
    (np.array([1e300, 1.0]), 1e300, ValueError, "out of range"),
    (np.array([1, 2]), 1.0, TypeError, "float16, float32 or float64"),
    (np.ones(3), 1.0, ValueError, "does not match"),
])
def test_bad_rows_raise_one_clear_error(row, weight, error, match):
    with pytest.raises(error, match=match):
        ExactSum(2).add(row, weight)


def test_a_row_that_fails_part_way_leaves_the_total_unusable(monkeypatch):
    monkeypatch.setattr(exactsum, "CHUNK", 2)
    total = ExactSum(4)
    total.add(np.ones(4))
    with pytest.raises(ValueError, match="NaN"):
        total.add(np.array([1.0, 1.0, 1.0, np.nan]))
    with pytest.raises(RuntimeError, match="incomplete"):
        total.add(np.ones(4))


def test_an_agreed_window_must_cover_every_rank():
    total = ExactSum(2)
    total.add(np.array([1.0, 1e-20]))
    with pytest.raises(ValueError, match="does not cover"):
        total.export(Window(-60, 1))
    with pytest.raises(ValueError, match="words per entry"):
        round_sum(np.zeros(5, dtype=np.int64), total.window)
