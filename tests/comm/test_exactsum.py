"""Exact sums: bitwise the correctly rounded Σ wᵢ·rowᵢ (checked with Python's exact rationals) for any order,
any grouping over simulated ranks, adversarial magnitudes, the bounds, and one clear error for bad input; on
every backend (numpy, torch on the CPU, torch on CUDA where there is one), with the same wire words."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpifl.comm import exactsum
from mpifl.comm.exactsum import (
    FOLDS_PER_NORMALISATION,
    MAX_EXPONENT,
    MAX_RANKS,
    ExactSum,
    Window,
    _accumulator,
    _backends,
    _grid,
    _wire,
    exact_sum,
    round_sum,
    words,
)

TINY = 5e-324  # the smallest subnormal
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = {"numpy": "numpy", "torch-cpu": "cpu", "torch-cuda": "cuda"}  # backend -> ExactSum's device
BACKENDS = ["numpy", "torch-cpu", pytest.param("torch-cuda", marks=CUDA)]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each test that takes it runs on every backend, its rows given as that backend's arrays."""
    return request.param


def on(backend: str, rows: np.ndarray):
    """``rows`` as the backend's arrays: numpy, or a tensor on the backend's device."""
    return rows if backend == "numpy" else torch.from_numpy(np.ascontiguousarray(rows)).to(DEVICES[backend])


def new_total(size: int, backend: str = "numpy") -> ExactSum:
    return ExactSum(size, device=DEVICES[backend])


def summed(rows: np.ndarray, weights=None, backend: str = "numpy") -> np.ndarray:
    """``exact_sum`` on ``backend``."""
    return exact_sum(on(backend, rows), weights, device=DEVICES[backend])


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


def over_ranks(rows: np.ndarray, weights, groups: list[list[int]], backend: str = "numpy") -> np.ndarray:
    """What the reduction computes: each group of rows is one rank's total; the ranks agree on a window
    (MPI.MAX of the maxima), export, and their int64 buffers are added (MPI.SUM), then rounded once."""
    totals, rows = [], on(backend, rows)
    for group in groups:
        total = new_total(rows.shape[1], backend)
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
def test_matches_the_exact_rational_sum_rounded_once(seed, backend):
    rng = np.random.default_rng(seed)
    rows = adversarial_rows(rng, 7, 40)
    weights = 10.0 ** rng.uniform(-4, 4, 7) * rng.choice([-1.0, 1.0], 7)
    assert same_bits(summed(rows, weights, backend), reference(rows, weights))


def test_float32_rows_are_weighted_in_float64(backend):
    """Each term is fl64(w·row), not fl32: 0.1·3.3f in float32 would round differently (torch would, were the
    row not widened first)."""
    row = np.array([3.3, 1e-30, 7e30], dtype=np.float32)
    assert same_bits(summed(row[None], [0.1], backend), 0.1 * row.astype(np.float64))


def test_rounding_ties_go_to_even_and_the_sticky_bit_breaks_them(backend):
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
        got = summed(np.array(terms)[:, None], backend=backend)[0]
        assert math.copysign(1, got) == math.copysign(1, expected) and got == expected, (terms, got)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_order_and_grouping_over_ranks_gives_the_same_bits(backend, data):
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
    assert same_bits(over_ranks(rows, weights, groups, backend), expected)


def test_groupings_of_many_rows_agree_bitwise(monkeypatch, backend):
    """Several chunks per row (a small CHUNK), windows that differ per rank (one rank sees only the tiny
    rows), ranks with nothing folded."""
    monkeypatch.setattr(_backends, "CHUNK", 8)
    rng = np.random.default_rng(11)
    rows = adversarial_rows(rng, 12, 30).astype(np.float64)
    rows[5:8] *= 1e-200
    weights = rng.uniform(-2, 2, 12)
    expected = reference(rows, weights)
    shuffled = list(range(12))
    random.Random(3).shuffle(shuffled)
    for groups in ([list(range(12))], [shuffled], [[5, 6, 7], [0, 1, 2, 3, 4, 8, 9, 10, 11], []],
                   [shuffled[0::3], shuffled[1::3], shuffled[2::3], []], [[i] for i in reversed(range(12))]):
        assert same_bits(over_ranks(rows, weights, groups, backend), expected), groups


def test_rows_outside_the_levels_add_levels_mid_row(monkeypatch, backend):
    """The first row sets the levels; later chunks far above and far below (down to subnormals, which re-cut
    the levels onto float64's smallest unit) widen them part-way through a row (on CUDA a row is one chunk)."""
    monkeypatch.setattr(_backends, "CHUNK", 4)
    rows = np.ones((4, 12))
    rows[1, 4:8] = 1e250
    rows[2, 8:] = 1e-200
    rows[3, 5] = TINY
    rows[3, 9] = 3e-310
    total = new_total(12, backend)
    for row in on(backend, rows):
        total.add(row, 0.75)
    assert total.window.lowest == -1074 and total._grid_or_raise.base == -1074
    assert same_bits(round_sum(total.export(total.window), total.window), reference(rows, [0.75] * 4))


def test_a_tie_is_broken_by_a_bit_at_any_distance_below_it(backend):
    """1 + 2^-53 is a tie; one more bit 2^-k, for every k down to float64's last, decides it (whichever level
    and digit that bit lands in: torch, slower per call, takes every third k, which still meets every bit of
    a level)."""
    for k in range(54, 1075, 1 if backend == "numpy" else 3):
        for sign in (1.0, -1.0):
            terms = np.array([[sign], [sign * 2.0**-53], [sign * 2.0**-k]])
            assert summed(terms, backend=backend)[0] == sign * (1.0 + 2.0**-52), k
            assert summed(terms, [1.0, 1.0, -1.0], backend)[0] == sign * 1.0, k


def test_no_level_overflows_when_every_term_fills_every_level(backend):
    """Terms that put the largest digit, 2^(W−1), into every level (a subnormal pins the levels to float64's
    smallest unit, so the level boundaries −1074 + 50k are known), folded 2·FOLDS_PER_NORMALISATION + 3 times
    (twice the carries must move up, else the levels wrap past 2^63), and that total added over MAX_RANKS
    ranks (int64, as MPI.SUM adds it): still exact."""
    width = exactsum.WIDTH
    below_boundaries = [2.0 ** (-1074 + width * k - 1) for k in range(1, 6)]  # 2^(W−1) units of the level below
    top = 2.0 ** (-1074 + 6 * width - 1) * (1 - 2.0**-53)  # rounds to 2^(W−1) units of the top level
    row = np.array([TINY, *below_boundaries, top, -top])
    folds = 2 * FOLDS_PER_NORMALISATION + 3
    total, device_row = new_total(len(row), backend), on(backend, row)
    for _ in range(folds):
        total.add(device_row)
    assert total._grid_or_raise.base == -1074 and total._grid_or_raise.levels == 6
    wire = total.export(total.window)
    for copies in (folds, folds * MAX_RANKS):
        expected = np.array([float(Fraction(x) * copies) for x in row])
        assert same_bits(round_sum(wire * (copies // folds), total.window), expected), copies


def test_fewer_than_few_terms_travel_without_a_carry_word_and_still_sum_exactly(backend):
    """With fewer than FEW_TERMS terms in all, the top word takes the carries: one word less per entry, and the
    largest terms (every level full, the top near the window's top) summed FEW_TERMS − 1 times over many
    simulated ranks stay exact; a total holding more terms than agreed refuses to export."""
    width = exactsum.WIDTH
    row = np.array([TINY, *[2.0 ** (-1074 + width * k - 1) for k in range(1, 6)],
                    2.0 ** (-1074 + 6 * width - 1) * (1 - 2.0**-53), -(2.0 ** (-1074 + 6 * width - 1))])
    folds = 5
    total, device_row = new_total(len(row), backend), on(backend, row)
    for _ in range(folds):
        total.add(device_row)
    few, ranks = exactsum.FEW_TERMS - 1, (exactsum.FEW_TERMS - 1) // folds
    assert words(total.window, few) == words(total.window) - 1 == words(total.window, exactsum.FEW_TERMS) - 1
    wire = total.export(total.window, few)
    assert len(wire) == len(row) * words(total.window, few)
    for copies in (1, ranks):
        expected = np.array([float(Fraction(x) * folds * copies) for x in row])
        assert same_bits(round_sum(wire * copies, total.window, few), expected), copies
    assert same_bits(round_sum(wire, total.window, few), round_sum(total.export(total.window), total.window))
    with pytest.raises(ValueError, match="5 terms, more than the 4 agreed"):
        total.export(total.window, 4)


def test_a_typical_delta_cohort_travels_in_two_words():
    """W2's case: float32 deltas weighted 1/50 span about 75 bits, 2 words of 48 bits for a cohort of 50 (3 with
    a carry word, for up to 2^50 terms), with the same bits."""
    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((50, 200)) * 1e-3).astype(np.float32)
    total = new_total(200)
    for row in rows:
        total.add(row, 1 / 50)
    assert words(total.window, 50) == 2 and words(total.window) == 3
    assert same_bits(round_sum(total.export(total.window, 50), total.window, 50),
                     reference(rows.astype(np.float64), [1 / 50] * 50))


def test_terms_up_to_the_range_limit_sum_exactly(backend):
    largest = 2.0**MAX_EXPONENT - 2.0 ** (MAX_EXPONENT - 53)
    rows = np.array([[largest, -largest, largest], [largest, largest, -TINY]])
    assert same_bits(summed(rows, [1.0, 1.0], backend), np.array([2 * largest, 0.0, largest]))


def test_the_wire_buffer_splits_at_whole_chunks(monkeypatch, backend):
    """A reduce-scatter may hand each rank a block of whole chunks: rounding the blocks apart gives the
    whole's bits."""
    monkeypatch.setattr(_backends, "CHUNK", 4)
    rng = np.random.default_rng(5)
    rows = adversarial_rows(rng, 3, 10)
    total = new_total(10, backend)
    for row in on(backend, rows):
        total.add(row, 0.5)
    for terms in (exactsum.ANY_TERMS, 3):  # with a carry word, and with the top word taking the carries
        wire, per = total.export(total.window, terms), words(total.window, terms)
        whole = round_sum(wire, total.window, terms)
        parts = [round_sum(wire[start * per : (start + 4) * per], total.window, terms) for start in (0, 4, 8)]
        assert same_bits(np.concatenate(parts), whole) and same_bits(whole, reference(rows, [0.5] * 3))


def test_nothing_folded_exports_zeros_and_an_empty_window(backend):
    total = new_total(3, backend)
    total.add(on(backend, np.zeros(3, dtype=np.float32)), 2.0)
    total.add(on(backend, np.ones(3)), 0.0)
    assert total.window.empty and total.nbytes == 0
    assert same_bits(round_sum(total.export(total.window), total.window), np.zeros(3))


def test_the_accumulator_is_small_for_typical_model_deltas(backend):
    """Float32 deltas of 1e-10..1e1 weighted by 1e-3 (91 bits): two levels and the carry (24 bytes per entry)."""
    rng = np.random.default_rng(0)
    row = (rng.choice([-1.0, 1.0], 1000) * 10.0 ** rng.uniform(-10, 1, 1000)).astype(np.float32)
    row[:2] = [1e-10, 9.9]
    total = new_total(1000, backend)
    total.add(on(backend, row), 1e-3)
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
def test_bad_rows_raise_one_clear_error(row, weight, error, match, backend):
    with pytest.raises(error, match=match):
        new_total(2, backend).add(on(backend, row), weight)


def test_a_row_that_fails_part_way_leaves_the_total_unusable(monkeypatch, backend):
    monkeypatch.setattr(_backends, "CHUNK", 2)
    total = new_total(4, backend)
    total.add(on(backend, np.ones(4)))
    with pytest.raises(ValueError, match="NaN"):
        total.add(on(backend, np.array([1.0, 1.0, 1.0, np.nan])))
    with pytest.raises(RuntimeError, match="incomplete"):
        total.add(on(backend, np.ones(4)))


def test_an_agreed_window_must_cover_every_rank(backend):
    total = new_total(2, backend)
    total.add(on(backend, np.array([1.0, 1e-20])))
    with pytest.raises(ValueError, match="does not cover"):
        total.export(Window(-60, 1))
    with pytest.raises(ValueError, match="words per entry"):
        round_sum(np.zeros(5, dtype=np.int64), total.window)


def comparison_rows(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Rows and weights that take the fold down each of its paths: float16/32/64 rows, subnormals of each type,
    huge and tiny weights, a first row that sets few levels and later rows that widen them below and above
    part-way, and a float64 subnormal that re-cuts them onto float64's smallest unit."""
    cases = {}
    for dtype in (np.float16, np.float32, np.float64):
        info = np.finfo(dtype)
        rows = (rng.standard_normal((6, 37)) * 10.0 ** rng.uniform(-3, 3, (6, 37))).astype(dtype)
        rows[1, 3], rows[2, 20] = info.smallest_subnormal, -info.smallest_subnormal
        rows[3, 36] = min(float(info.max) / 4, 2.0**800)  # the type's largest, or as large as the range allows
        rows[4] = 0
        cases[f"{np.dtype(dtype).name}, mixed weights"] = (rows, 10.0 ** rng.uniform(-5, 5, 6) * rng.choice([-1, 1], 6))
    huge = adversarial_rows(rng, 5, 37)
    huge[:, 3] = np.minimum(huge[:, 3], 2.0**600)  # the weights below would take 2**900 out of range
    cases["adversarial, huge and tiny weights"] = (huge, np.array([2.0**250, 1e-250, -3e100, 7e-300, 1.0]))
    widening = np.ones((5, 37))
    widening[1, 9:17] = 1e200  # above the first row's levels, part-way through a row
    widening[2, 20:28] = 1e-100  # below them
    widening[3, 30] = TINY  # below float64's smallest unit's reach: re-cut onto it
    widening[4, :5] = -1e-300
    cases["widening below, above and re-cut"] = (widening, np.array([0.5, -1.25, 3.0, 1.0, 1e-8]))
    return cases


def backend_wire(rows: np.ndarray, weights: np.ndarray, backend: str, window: Window | None = None):
    total = new_total(rows.shape[1], backend)
    for row, weight in zip(on(backend, rows), weights):
        total.add(row, weight)
    return total, total.export(total.window if window is None else window)


def chunked(monkeypatch, backend: str, chunk: int, spans: str) -> str:  # noqa: ANN001
    """The wire's blocks ``chunk`` entries long; a "whole rows" backend is torch on the CPU working in one span as on
    a GPU (``TorchOps``' method ``spans``: the fold's or the rounding's). Returns the backend to use."""
    monkeypatch.setattr(_backends, "CHUNK", chunk)
    if not backend.endswith("whole rows"):
        return backend
    monkeypatch.setattr(_backends.TorchOps, spans, lambda self, size: max(size, 1))
    return "torch-cpu"


@pytest.mark.parametrize("chunk", [8, 1 << 16])
@pytest.mark.parametrize("backend", ["torch-cpu", "torch-cpu, whole rows", pytest.param("torch-cuda", marks=CUDA)])
def test_torch_and_numpy_give_the_same_wire_words_and_sums(monkeypatch, backend, chunk):
    """Word for word the same wire buffers (and so the same rounded sums, the exact ones) from numpy and torch
    totals, with several chunks per row or one; "whole rows" folds each row in one span as on a GPU, which lays
    the wire's blocks out after the cut."""
    backend = chunked(monkeypatch, backend, chunk, "span")
    rng = np.random.default_rng(4)
    for name, (rows, weights) in comparison_rows(rng).items():
        expected_total, expected_wire = backend_wire(rows, weights, "numpy")
        total, wire = backend_wire(rows, weights, backend)
        assert total.backend == backend and total.window == expected_total.window, name
        assert total.nbytes == expected_total.nbytes, name
        assert isinstance(wire, np.ndarray) and wire.dtype == np.int64 and np.array_equal(wire, expected_wire), name
        low, high = expected_total.window.lowest, expected_total.window.highest
        wider = Window(max(low - 77, exactsum.LOWEST), min(high + 130, MAX_EXPONENT))  # as another rank's
        assert np.array_equal(backend_wire(rows, weights, backend, wider)[1],
                              backend_wire(rows, weights, "numpy", wider)[1]), name
        result = round_sum(wire, total.window)
        exact = reference(rows.astype(np.float64), weights)
        assert same_bits(result, exact) and same_bits(round_sum(expected_wire, total.window), exact), name


@pytest.mark.parametrize("chunk", [8, 1 << 16])
def test_a_total_rounded_where_it_is_equals_its_exported_wire_rounded(monkeypatch, backend, chunk):
    """``rounded`` (one rank: no re-cut onto the wire's grid) gives the bits of ``round_sum`` of the export, on the
    fold's own grid of 50-bit levels, for every path of the fold, totals normalised or not, and both are exact."""
    monkeypatch.setattr(_backends, "CHUNK", chunk)
    rng = np.random.default_rng(9)
    cases = comparison_rows(rng)
    cases["adversarial"] = (adversarial_rows(rng, 7, 40), 10.0 ** rng.uniform(-4, 4, 7) * rng.choice([-1.0, 1.0], 7))
    for name, (rows, weights) in cases.items():
        total, wire = backend_wire(rows, weights, backend)
        rounded = total.rounded()
        assert same_bits(rounded, round_sum(wire, total.window)), name
        assert same_bits(rounded, reference(rows.astype(np.float64), weights)), name
    assert same_bits(new_total(5, backend).rounded(), np.zeros(5))


@pytest.mark.parametrize("backend", ["numpy", "torch-cpu", pytest.param("torch-cuda", marks=CUDA)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_every_backend_rejects_non_finite_rows(backend, bad, dtype):
    row = np.ones(5, dtype=dtype)
    row[3] = bad
    with pytest.raises(ValueError, match="NaN or ±inf"):
        new_total(5, backend).add(on(backend, row), 0.5)


def test_torch_ldexp_gives_numpy_bits_down_to_and_below_the_smallest_unit():
    """Power-of-two scaling is exact unless the result is subnormal; there both round once, to nearest even
    (odd digits, and exponents below −1074 where most bits are lost)."""
    rng = np.random.default_rng(8)
    digits = np.concatenate([rng.integers(-(2**53) + 1, 2**53, 200), [0, 1, -1, 3, -3, 2**52 + 1, -(2**53) + 1]])
    ops = _backends.TorchOps("cpu")
    out = torch.empty(len(digits), dtype=torch.float64)
    for exponent in [*range(-1140, -1000), *range(-60, 61, 7), 900, 960]:
        ops.ldexp(torch.from_numpy(digits), exponent, out)
        expected = np.ldexp(digits.astype(np.float64), exponent)
        assert np.array_equal(out.numpy().view(np.int64), expected.view(np.int64)), exponent


def test_the_backend_follows_the_first_row_unless_named():
    """Numpy folds numpy rows and CPU tensors (the faster fold on CPU: benchmarks/bench_exactsum.py), sharing a
    CPU tensor's memory; a named device wins; a tensor on a GPU picks torch there (below, where there is one)."""
    row = np.arange(4.0)
    for first, device, expected in [(row, None, "numpy"), (torch.from_numpy(row), None, "numpy"),
                                    (row, "cpu", "torch-cpu"), (torch.from_numpy(row), "numpy", "numpy")]:
        total = ExactSum(4, device)
        assert total.backend is None
        total.add(first, 2.0)
        total.add(torch.from_numpy(row) if isinstance(first, np.ndarray) else row, 2.0)  # the other kind, too
        assert total.backend == expected
        assert same_bits(round_sum(total.export(total.window), total.window), 4.0 * row)
    tensor = torch.arange(4.0, dtype=torch.float64, requires_grad=True)
    assert _backends.NumpyOps().row(tensor).base is not None  # a view of the tensor's memory, not a copy


def test_torch_rows_in_half_precisions_are_widened_exactly():
    row = torch.tensor([1.5, -3e-3, 6e4, 2.0**-24], dtype=torch.float16)
    for half in (row, row.to(torch.bfloat16)):
        assert same_bits(exact_sum(half[None], [0.1], device="cpu"),
                         0.1 * half.to(torch.float64).numpy())


@CUDA
def test_a_cuda_row_folds_on_its_device_and_exports_to_the_host():
    rng = np.random.default_rng(6)
    rows = adversarial_rows(rng, 4, 50)
    total = ExactSum(50)
    for row in torch.from_numpy(rows).cuda():
        total.add(row, 0.3)
    assert total.backend == "torch-cuda" and total._levels.is_cuda
    wire = total.export(total.window)
    assert isinstance(wire, np.ndarray)
    assert same_bits(round_sum(wire, total.window), reference(rows, [0.3] * 4))


@pytest.mark.parametrize("few_folds", [False, True])
def test_a_batch_of_rows_folds_to_the_bits_of_folding_each_in_turn(monkeypatch, backend, few_folds):
    """``add_rows`` (one read of all windows, every level's digits added for all rows at once on a torch device)
    against ``add`` row by row: leading zero rows (no terms while there is no grid), zero weights, rows that
    widen the levels above and below (down to subnormals, which re-cut them), and with ``few_folds`` batches
    that cross a normalisation; the same wire words, terms and rounded sums, also after more rows."""
    if few_folds:
        monkeypatch.setattr(_accumulator, "FOLDS_PER_NORMALISATION", 3)
    rng = np.random.default_rng(5)
    rows = adversarial_rows(rng, 9, 40)
    rows[:2] = 0.0
    rows[4] *= 1e200
    rows[6, 3] = 3e-310
    weights = [1.0, 0.5, 0.25, 0.0, -1.5, 2.0, 0.75, 1e-3, 3.0]
    one_by_one, batched = new_total(40, backend), new_total(40, backend)
    for row, weight in zip(on(backend, rows), weights):
        one_by_one.add(row, weight)
    batched.add_rows(on(backend, rows[:5]), weights[:5])
    batched.add_rows(on(backend, rows[5:]), weights[5:])
    assert batched.terms == one_by_one.terms == 6
    assert batched.window == one_by_one.window
    window = one_by_one.window
    assert np.array_equal(batched.export(window), one_by_one.export(window))
    assert same_bits(batched.rounded(), one_by_one.rounded())
    assert same_bits(batched.rounded(), reference(rows, weights))


@pytest.mark.parametrize("backend", BACKENDS[1:])  # host rows fold one by one, as ``add``
def test_a_batch_with_a_bad_row_raises_before_folding_any(backend):
    rows = np.ones((3, 6))
    rows[2, 1] = np.nan
    total = new_total(6, backend)
    total.add(on(backend, rows[0]), 1.0)
    with pytest.raises(ValueError, match="NaN"):
        total.add_rows(on(backend, rows), [1.0, 1.0, 1.0])
    total.add(on(backend, rows[1]), 1.0)  # nothing of the batch went in: the total is usable and holds 2
    assert same_bits(total.rounded(), np.full(6, 2.0))


def rounding_cases(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The fold's paths (``comparison_rows``), adversarial rows, the ties, and typical deltas, whose wire words
    take the host's one-addition shortcut."""
    cases = comparison_rows(rng)
    cases["adversarial"] = (adversarial_rows(rng, 7, 40), 10.0 ** rng.uniform(-4, 4, 7) * rng.choice([-1.0, 1.0], 7))
    ties = np.zeros((3, 40))
    ties[:, :4] = [[1.0, 1.0 + 2.0**-52, 1.0, -1.0], [2.0**-53, 2.0**-53, 2.0**-53, -(2.0**-53)], [0, 0, TINY, 0]]
    cases["ties"] = (ties, np.ones(3))
    deltas = (rng.standard_normal((5, 40)) * 1e-3).astype(np.float32)
    cases["typical deltas"] = (deltas, np.full(5, 1 / 50))
    return cases


@pytest.mark.parametrize("chunk", [8, 1 << 16])
@pytest.mark.parametrize("backend", [*BACKENDS, "torch-cpu, whole rows"])
def test_round_sum_on_every_backend_gives_the_exact_bits_where_it_runs(monkeypatch, backend, chunk):
    """A reduced wire rounded by numpy, by torch on the CPU, and by torch on CUDA (and on the CPU in one span, as
    on a GPU: every whole block at once) gives the exactly rounded sums, bitwise, and returns them where it
    rounded: a host array, or a tensor on the device; a host wire given a device is rounded there."""
    backend = chunked(monkeypatch, backend, chunk, "round_span")
    rng = np.random.default_rng(11)
    for name, (rows, weights) in rounding_cases(rng).items():
        total, wire = backend_wire(rows, weights, "numpy")
        exact = reference(rows.astype(np.float64), weights)
        for terms in (exactsum.ANY_TERMS, 3 * len(rows)):
            wire = total.export(total.window, terms)
            for arrived in (wire, on(backend, wire)):
                result = round_sum(arrived, total.window, terms, device=DEVICES[backend])
                if backend != "numpy":
                    assert isinstance(result, torch.Tensor) and result.device.type == DEVICES[backend], name
                    result = result.cpu().numpy()
                assert same_bits(result, exact), (name, terms)


def test_the_hosts_one_addition_gives_the_general_ways_bits(monkeypatch):
    """Where a block's words allow it, numpy adds them in one addition; without the shortcut (as torch rounds) the
    general way gives the same bits, and both are exact; a block with three nonzero words, or a word of 2^53 or
    more, takes the general way."""
    rng = np.random.default_rng(11)  # (some seeds draw a term out of range)
    taken = []
    original = _wire._round_few
    monkeypatch.setattr(_wire, "_round_few", lambda *args: taken.append(out := original(*args)) or out)
    for name, (rows, weights) in rounding_cases(rng).items():
        total, wire = backend_wire(rows, weights, "numpy")
        with monkeypatch.context() as general:
            general.setattr(_backends.NumpyOps, "reads_free", False)
            slow = round_sum(wire, total.window)
        assert same_bits(round_sum(wire, total.window), slow), name
        assert same_bits(slow, reference(rows.astype(np.float64), weights)), name
    assert any(out is None for out in taken) and any(out is not None for out in taken)
    grid = _grid.Grid(0, 3, exactsum.WIRE_WIDTH)
    assert original(_backends.NumpyOps(), np.array([[1], [1], [1]]), grid) is None
    assert original(_backends.NumpyOps(), np.array([[2**53], [0], [0]]), grid) is None
    assert same_bits(original(_backends.NumpyOps(), np.array([[3], [0], [-1]]), grid), np.array([3.0 - 2.0**96]))
