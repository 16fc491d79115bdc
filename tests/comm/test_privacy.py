"""Differential privacy: clipping by hand, keyed noise and Poisson cohorts, and the accountant against numbers from
dp-accounting's own tests, its count=T composition and hand-derived Gaussian compositions."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import pytest

from mpifl.comm.config import PrivacyConfig
from mpifl.comm.privacy import PrivacyAccountant, clip_update, noise, poisson_cohort
from mpifl.schema import ConfigError

dp = pytest.importorskip("dp_accounting")

KEY = (7, 3, 5, "delta", 1000)  # seed, round, client, message, numel


def epsilons(rounds: int, population: int = 10, cohort: int = 2, **cfg: Any) -> list[float]:
    """ε after each of ``rounds`` rounds in which clients 0 and 1 take part (of 10)."""
    acc = PrivacyAccountant(PrivacyConfig(**cfg), population, cohort, 10)
    return [acc.step(np.arange(2)) for _ in range(rounds)]


# --- clip_update -------------------------------------------------------------------------------------------------

def test_clip_hand_example() -> None:
    assert clip_update(np.array([3.0, 4.0, 0.0]), 1.0) == pytest.approx([0.6, 0.8, 0.0], abs=1e-15)  # ||·|| = 5


def test_clip_leaves_rows_within_the_clip_zero_rows_and_non_finite_rows() -> None:
    row = np.array([3.0, 4.0])
    assert clip_update(row, 5.0) is row and clip_update(row, 6.0) is row
    zero = np.zeros(4)
    assert clip_update(zero, 1.0) is zero and not zero.any()
    bad = np.array([np.nan, 1e9])
    assert clip_update(bad, 1.0) is bad  # the runtime rejects it later


def test_clip_keeps_float32_and_clips_huge_float64_rows() -> None:
    row = np.array([3.0, 4.0, 12.0], np.float32)  # ||·|| = 13
    out = clip_update(row, 2.6)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.6, 0.8, 2.4], rtol=1e-6)
    huge = np.array([3e200, 4e200])  # ||·||² overflows float64: still clipped, to 1
    np.testing.assert_allclose(clip_update(huge, 1.0), [0.6, 0.8], rtol=1e-12)


# --- noise ------------------------------------------------------------------------------------------------------

def test_noise_same_key_same_draw_and_each_key_part_matters() -> None:
    base = noise(*KEY, 1.0, np.float64)
    np.testing.assert_array_equal(base, noise(*KEY, 1.0, np.float64))
    seed, round_, client, message, numel = KEY
    for other in [(8, round_, client, message), (seed, 4, client, message), (seed, round_, 6, message),
                  (seed, round_, -1, message), (seed, round_, client, "gradient")]:
        assert not np.allclose(base, noise(*other, numel, 1.0, np.float64)), other


def test_noise_std_and_dtype() -> None:
    """n = 200,000 draws of N(0, 2.5²): the sample std has standard error σ/√(2n) ≈ 0.0040 and the mean σ/√n ≈
    0.0056; 6 standard errors each (a fair draw fails with probability about 2e-9)."""
    n, std = 200_000, 2.5
    x = noise(1, 1, -1, "delta", n, std, np.float32)
    assert x.dtype == np.float32 and x.shape == (n,)
    assert abs(float(x.std()) - std) < 6 * std / math.sqrt(2 * n)
    assert abs(float(x.mean())) < 6 * std / math.sqrt(n)


# --- poisson_cohort ---------------------------------------------------------------------------------------------

def test_poisson_cohort_is_keyed_sorted_and_covers_the_extremes() -> None:
    population = np.array([9, 2, 7, 4, 0, 5, 11, 3])
    cohort = poisson_cohort(1, 4, population, 0.5)
    np.testing.assert_array_equal(cohort, poisson_cohort(1, 4, population[::-1], 0.5))  # keyed, not by order
    assert np.all(np.diff(cohort) > 0) and set(cohort) <= set(population)
    assert any(not np.array_equal(cohort, poisson_cohort(1, r, population, 0.5)) for r in range(5, 10))
    assert poisson_cohort(1, 4, population, 0.0).size == 0
    np.testing.assert_array_equal(poisson_cohort(1, 4, population, 1.0), np.sort(population))


def test_poisson_cohort_mean_size() -> None:
    """N = 50, q = 0.2 over R = 2000 rounds: the mean size qN = 10 has standard error √(Nq(1-q)/R) ≈ 0.063; 6 of
    them, and the sizes' variance Nq(1-q) = 8 within 20% (the sample variance's relative error is √(2/R) ≈ 3%)."""
    sizes = np.array([len(poisson_cohort(3, r, np.arange(50), 0.2)) for r in range(2000)])
    assert abs(sizes.mean() - 10) < 6 * math.sqrt(50 * 0.2 * 0.8 / 2000)
    assert sizes.var() == pytest.approx(8, rel=0.2)


# --- accountant -------------------------------------------------------------------------------------------------

def test_pld_matches_the_library_reference_for_a_poisson_round() -> None:
    """dp-accounting's own test, .venv/lib/python3.11/site-packages/dp_accounting/pld/privacy_loss_mechanism_test.py
    lines 936-946 (test_gaussian_get_delta_for_epsilon_vectorized, line 955): the Gaussian of σ = 1 sampled with
    q = 0.2 has δ(ε=1) = 0.00229682 under REMOVE (line 946) and δ = 0 already at ε = 0.3 under ADD (line 939), so
    under add-or-remove one round is (1, 0.00229682)-DP: q = 2/10, z = 1. RDP is looser, never tighter."""
    pld = epsilons(1, mode="central", sampling="poisson", accountant="pld", noise_multiplier=1.0, delta=0.00229682)
    rdp = epsilons(1, mode="central", sampling="poisson", accountant="rdp", noise_multiplier=1.0, delta=0.00229682)
    assert pld[0] == pytest.approx(1.0, abs=1e-3)
    assert rdp[0] > pld[0]


def test_local_noise_is_for_sensitivity_two_clips() -> None:
    """Local DP protects any two updates of a client, 2C apart: noise z·C with z = 2 is a Gaussian of σ = 1 for
    sensitivity 1, which is (1, 0.12693674)-DP (privacy_loss_mechanism_test.py lines 933-935, ADD, q = 1)."""
    eps = epsilons(1, mode="local", accountant="pld", noise_multiplier=2.0, delta=0.12693674)
    assert eps[0] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("sampling,accountant", [("poisson", "rdp"), ("poisson", "pld"), ("fixed", "rdp")])
def test_one_round_at_a_time_equals_one_composition_of_t(sampling: str, accountant: str) -> None:
    """T = 20 rounds of N = 10, m = 2, z = 1.1 against the library's own accountant composing the event 20 times in
    one call (fixed: the z / 2 of the module docstring, as dp-accounting 0.6 reads the multiplier)."""
    rounds, z = 20, 1.1
    ours = epsilons(rounds, mode="central", sampling=sampling, accountant=accountant, noise_multiplier=z)
    if sampling == "poisson":
        event = dp.PoissonSampledDpEvent(0.2, dp.GaussianDpEvent(z))
        library = dp.rdp.RdpAccountant() if accountant == "rdp" else dp.pld.PLDAccountant()
    else:
        event = dp.SampledWithoutReplacementDpEvent(10, 2, dp.GaussianDpEvent(z / 2))
        library = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
    assert ours[-1] == pytest.approx(library.compose(event, rounds).get_epsilon(1e-5), rel=1e-7)


@pytest.mark.parametrize("sampling,accountant", [("poisson", "rdp"), ("poisson", "pld"), ("fixed", "rdp")])
def test_epsilon_grows_with_rounds_and_falls_with_noise(sampling: str, accountant: str) -> None:
    cfg: dict[str, Any] = {"mode": "central", "sampling": sampling, "accountant": accountant}
    by_round = epsilons(4, noise_multiplier=1.0, **cfg)
    assert 0 < by_round[0] < by_round[1] < by_round[2] < by_round[3]
    by_noise = [epsilons(3, noise_multiplier=z, **cfg)[-1] for z in (0.8, 1.0, 2.0)]
    assert by_noise[0] > by_noise[1] > by_noise[2] > 0


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_local_epsilon_follows_the_busiest_client(accountant: Any) -> None:
    """Round 1: clients 1, 2, 3; round 2: clients 3, 4 (client 3 twice, the others once); round 3: client 0. Two
    Gaussians of multiplier z/2 compose to one of z/(2√2) (the RDP α/(2σ²) of each adds up, Mironov 2017;
    μ-GDP likewise, Dong, Roth & Su 2022), so ε after rounds 2 and 3 is that one Gaussian's, and after round 1
    that of z/2 alone."""
    z, delta = 1.5, 1e-5
    acc = PrivacyAccountant(PrivacyConfig(mode="local", accountant=accountant, noise_multiplier=z, delta=delta),
                            10, 3, 10)
    eps = [acc.step(np.array(p)) for p in ([1, 2, 3], [3, 4], [0])]
    library = dp.rdp.RdpAccountant if accountant == "rdp" else dp.pld.PLDAccountant
    once = library().compose(dp.GaussianDpEvent(z / 2)).get_epsilon(delta)
    twice = library().compose(dp.GaussianDpEvent(z / (2 * math.sqrt(2)))).get_epsilon(delta)
    tol = 1e-9 if accountant == "rdp" else 1e-3  # PLD: discretized at 1e-4 per composition
    assert eps[0] == pytest.approx(once, rel=tol)
    assert eps[1] == pytest.approx(twice, rel=tol) and eps[2] == eps[1]


def test_fixed_cohort_of_everyone_is_a_gaussian_of_sensitivity_two_clips() -> None:
    """m = N: every client takes part, and replacing one clipped update moves the sum by up to 2C; noise z·C is then
    a plain Gaussian of multiplier z/2, whichever way the installed library reads the multiplier (issue #378)."""
    eps = epsilons(1, population=5, cohort=5, mode="central", sampling="fixed", noise_multiplier=1.2)
    assert eps[0] == pytest.approx(dp.rdp.RdpAccountant().compose(dp.GaussianDpEvent(0.6)).get_epsilon(1e-5),
                                   rel=1e-9)


@pytest.mark.parametrize("cfg", [{"mode": "central", "sampling": "poisson", "accountant": "pld"},
                                 {"mode": "central", "sampling": "fixed"}, {"mode": "local"}])
def test_no_noise_is_infinite_epsilon(cfg: dict[str, Any]) -> None:
    assert epsilons(2, noise_multiplier=0.0, **cfg) == [math.inf, math.inf]


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="sampling 'fixed' needs accountant 'rdp'"):
        PrivacyAccountant(PrivacyConfig(mode="central", sampling="fixed", accountant="pld"), 10, 2, 10)
    with pytest.raises(ConfigError, match="a cohort of 11 clients out of 10 seen clients"):
        PrivacyAccountant(PrivacyConfig(mode="central"), 10, 11, 10)


def test_missing_library_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # what `import` sees when the package is absent
    with pytest.raises(ConfigError, match=r"needs the dp-accounting package \(pip install 'mpifl\[dp\]'\)"):
        PrivacyAccountant(PrivacyConfig(mode="local"), 10, 2, 10)
