"""Differential privacy on model updates (DP-FedAvg): clipping, keyed Gaussian noise, Poisson cohorts and the
privacy accountant that reports ε at ``privacy.delta`` after every round.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models", ICLR, Alg. 1) gives
user-level DP: a neighbouring run differs in one client's whole data. Each client's update is clipped to L2 norm
C = ``clip`` (:func:`clip_update`); Gaussian noise of std z·C (z = ``noise_multiplier``) is added to the sum by
the server (``central``) or to each update by its client (``local``) (:func:`noise`). ε is computed by Google's
``dp-accounting`` (the ``dp`` extra, imported only when privacy is on) from one event per round:

=========  ========  ================================================  =========================================
mode       sampling  event per round                                   neighbouring relation
=========  ========  ================================================  =========================================
central    poisson   PoissonSampledDpEvent(q, GaussianDpEvent(z))      ADD_OR_REMOVE_ONE (Abadi et al. 2016 §3.1,
                                                                       McMahan et al. 2018: each client kept
                                                                       with probability q, :func:`poisson_cohort`)
central    fixed     SampledWithoutReplacementDpEvent(N, m,            REPLACE_ONE (Wang, Balle & Kasiviswanathan
                     GaussianDpEvent(z / 2))                           2019, Thm 27: m of N clients uniformly,
                                                                       N public); RDP accountant only
local      (any)     GaussianDpEvent(z / 2), composed k times, k the   none needed: any two data of one client
                     most rounds any one client has taken part in      (no amplification: the server knows who
                                                                       took part); ε is the worst client's
=========  ========  ================================================  =========================================

q = m / N with m = ``clients_per_round`` and N = the seen clients. Why z / 2: dp-accounting defines a
GaussianDpEvent's multiplier as std / C (``dp_event.py``, GaussianDpEvent), but replacing one clipped update by
another moves the sum by up to 2C, and the library's RDP bound for sampling without replacement takes the
multiplier as std / sensitivity (``rdp_privacy_accountant.py``, ``_compute_rdp_sample_wor_gaussian``; reported as
google/differential-privacy#378): the true multiplier is z / 2. :func:`_wor_multiplier` checks which convention
the installed library follows, so a fixed library is not halved twice. Local DP protects any two updates of one
client, so the same 2C sensitivity applies; GaussianDpEvent(z / 2) under add-or-remove is that Gaussian exactly.

``accountant: rdp`` composes with ``dp_accounting.rdp.RdpAccountant`` (its default orders; Mironov 2017, RDP;
Mironov, Talwar & Zhang 2019 for the Poisson subsampled Gaussian), ``pld`` with the privacy loss distributions of
``dp_accounting.pld`` (Koskela et al. 2020; Doroshenko et al. 2022, connect-the-dots; the discretization 1e-4 and
pessimistic rounding of ``PLDAccountant``). dp-accounting 0.6 has no PLD bound for fixed-size sampling without
replacement (``pld_privacy_accountant.py`` rejects SampledWithoutReplacementDpEvent), so ``fixed`` + ``pld`` is a
config error. Both compose one round at a time; the PLD of one round is built once, not per round as
``PLDAccountant.compose`` would (about 0.3 s each). ``noise_multiplier: 0`` releases the clipped sum unnoised:
ε = inf, as dp-accounting itself reports for a noiseless Gaussian.

The noise is a simulation's: NumPy's PCG64 keyed by (seed, round, client, message), not a cryptographic source,
and not hardened against floating-point attacks (Mironov 2012).
"""

from __future__ import annotations

import logging
import math
import zlib
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from mpifl.comm.config import PrivacyConfig
from mpifl.comm.ledger import STAGES, Ledger
from mpifl.schema import ConfigError

_NOISE_TAG = 0x6E6F6973  # "nois": the DP noise's own stream
_POISSON_TAG = 0x706F6973  # "pois": the Poisson cohorts' own stream


def clip_update(row: np.ndarray, clip: float) -> np.ndarray:
    """``row * min(1, clip / ||row||_2)``, computed in float64 and cast back to ``row.dtype``; the row itself when
    within the clip (a zero row stays zero). A row with NaN or inf is returned unchanged: the runtime rejects it."""
    x = row.astype(np.float64)
    if not np.isfinite(x).all():
        return row
    scale = float(np.abs(x).max()) if x.size else 0.0
    if scale == 0.0:
        return row
    norm = scale * float(np.linalg.norm(x / scale))  # scaled first: a finite float64 row never overflows to inf
    return row if norm <= clip else (x * (clip / norm)).astype(row.dtype)


def _keyed_rng(seed: int, tag: int, *keys: int) -> np.random.Generator:
    """A stream keyed by the run seed, a fixed tag and ids only, so every rank count draws the same numbers."""
    return np.random.default_rng([seed, tag, *keys])


def noise(seed: int, round_: int, client: int, message: str, numel: int, std: float, dtype: DTypeLike
          ) -> np.ndarray:
    """``numel`` draws of N(0, std²) in ``dtype``, keyed by (seed, round, client, message) only; ``client`` is -1
    for the server's central noise (keyed as ``client + 1``: entropy is non-negative)."""
    rng = _keyed_rng(seed, _NOISE_TAG, round_, client + 1, zlib.crc32(message.encode()))
    return (rng.standard_normal(numel) * std).astype(dtype)


def poisson_cohort(seed: int, round_: int, population: np.ndarray, rate: float) -> np.ndarray:
    """Poisson sampling (what the ``poisson`` accounting assumes): each id kept independently with probability
    ``rate``, keyed by (seed, round) only; sorted ids, possibly none."""
    ids = np.sort(population)
    return ids[_keyed_rng(seed, _POISSON_TAG, round_).random(len(ids)) < rate]


def _library() -> Any:
    """dp-accounting, or the config error that says how to install it."""
    try:
        import dp_accounting
    except ImportError as e:
        raise ConfigError("privacy: needs the dp-accounting package (pip install 'mpifl[dp]')") from e
    # its numerical fall-backs log through absl on every composition (several lines a round): keep errors only
    logging.getLogger("absl").setLevel(logging.ERROR)
    return dp_accounting


def _wor_multiplier(dp: Any, z: float) -> float:
    """The multiplier to hand SampledWithoutReplacementDpEvent under REPLACE_ONE for noise std z·C: z / 2 while
    the library's bound reads it as std / sensitivity (google/differential-privacy#378), z once it accounts for
    the 2C itself. Probe: with all records sampled the event is one Gaussian; does replace-one cost the same as
    add-or-remove (sensitivity C, the issue) or more?"""
    whole = dp.SampledWithoutReplacementDpEvent(1, 1, dp.GaussianDpEvent(1.0))
    replace = dp.rdp.RdpAccountant([2.0], dp.NeighboringRelation.REPLACE_ONE).compose(whole).get_epsilon(0.5)
    add = dp.rdp.RdpAccountant([2.0]).compose(dp.GaussianDpEvent(1.0)).get_epsilon(0.5)
    return z / 2 if math.isclose(replace, add) else z


def check_privacy(cfg: PrivacyConfig, population: int, cohort: int) -> Any:
    """What a run's privacy settings need before anything trains (one :class:`ConfigError` line each): a cohort
    within the seen clients, an accountant that bounds the sampling, and dp-accounting itself (returned)."""
    if cfg.mode == "off":
        raise ValueError("privacy is off: nothing to account")
    if cfg.mode == "central" and not 0 < cohort <= population:
        raise ConfigError(f"privacy: a cohort of {cohort} clients out of {population} seen clients")
    if cfg.mode == "central" and cfg.sampling == "fixed" and cfg.accountant == "pld":
        raise ConfigError("privacy: sampling 'fixed' needs accountant 'rdp' (dp-accounting's PLD accountant "
                          "has no bound for sampling without replacement); or use sampling 'poisson'")
    return _library()


class PrivacyAccountant:
    """ε at ``cfg.delta`` after each round (module docstring): one event composed per round (``central``) or per
    new maximum of any client's participations (``local``)."""

    def __init__(self, cfg: PrivacyConfig, population: int, cohort: int, num_clients: int):
        dp = check_privacy(cfg, population, cohort)
        self.cfg = cfg
        self.counts = np.zeros(num_clients, np.int64)  # rounds each client took part in (local mode)
        self.composed = 0  # events composed so far: rounds (central) or the largest count (local)
        self._event: Any = None  # what one round (central) or one participation (local) releases
        self._rdp: Any = None  # the RDP accountant, or None with PLDs or without noise
        self._unit: Any = None  # the PLD of one event (accountant pld)
        self._pld: Any = None  # the PLD of all events so far (accountant pld)
        z = cfg.noise_multiplier
        if z == 0:  # no noise: nothing to compose, ε = inf
            return
        rel = dp.NeighboringRelation.ADD_OR_REMOVE_ONE
        if cfg.mode == "local":
            self._event = dp.GaussianDpEvent(z / 2)
        elif cfg.sampling == "poisson":
            self._event = dp.PoissonSampledDpEvent(cohort / population, dp.GaussianDpEvent(z))
        else:
            self._event = dp.SampledWithoutReplacementDpEvent(population, cohort,
                                                              dp.GaussianDpEvent(_wor_multiplier(dp, z)))
            rel = dp.NeighboringRelation.REPLACE_ONE
        if cfg.accountant == "rdp":
            self._rdp = dp.rdp.RdpAccountant(neighboring_relation=rel)
            return
        # PLDAccountant's arithmetic (discretization 1e-4, pessimistic), with one event's PLD built once
        sampled = isinstance(self._event, dp.PoissonSampledDpEvent)
        gaussian = self._event.event if sampled else self._event
        pld = dp.pld.privacy_loss_distribution
        self._unit = pld.from_gaussian_mechanism(gaussian.noise_multiplier, neighboring_relation=rel,
                                                 sampling_prob=self._event.sampling_probability if sampled else 1.0)
        self._pld = pld.identity()

    def resume(self, ledger: Ledger, round_: int) -> None:
        """ε up to ``round_`` again, every round with the clients that uploaded in it (read from ``ledger``,
        resumed from the run's results file)."""
        train_uploads = ledger.participants(STAGES.index("train"), "up")
        for past in range(1, round_ + 1):
            self.step(train_uploads.get(past, np.zeros(0, np.int64)))

    def step(self, participants: np.ndarray) -> float:
        """Account one round (``participants``: the ids that took part; local mode counts them) and return ε at
        ``cfg.delta`` so far (0 before the first event, inf without noise)."""
        np.add.at(self.counts, np.asarray(participants, np.int64), 1)
        due = int(self.counts.max(initial=0)) if self.cfg.mode == "local" else self.composed + 1
        for _ in range(self.composed, due):
            if self._rdp is not None:
                self._rdp.compose(self._event)
            elif self._pld is not None:
                self._pld = self._pld.compose(self._unit)
        self.composed = due
        if not due:
            return 0.0
        if self._rdp is not None:
            return float(self._rdp.get_epsilon(self.cfg.delta))
        return float(self._pld.get_epsilon_for_delta(self.cfg.delta)) if self._pld is not None else math.inf
