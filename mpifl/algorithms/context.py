"""What an algorithm is told: the run it belongs to (:class:`RunContext`), the step the runtime calls it for
(:class:`StepContext`) and how its evaluation rows are laid out (:class:`EvalLayout`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from mpifl.comm.messages import SumWeights
from mpifl.config import RunConfig
from mpifl.data import FederatedLayout
from mpifl.models import FlatModel, build_model
from mpifl.schema import limits
from mpifl.training.sgd import EVAL_FIELDS


@dataclass(frozen=True)
class NoOptions:
    """For algorithms without options of their own."""


@dataclass(frozen=True)
class RunContext:
    """What both sides know before training: the config, the data layout, the initial model; and where this
    rank's clients compute and the server's networks (the engine's choices from ``cfg.device`` and
    ``cfg.server.device``; the server's other state stays on the CPU)."""

    cfg: RunConfig
    layout: FederatedLayout
    device: torch.device = torch.device("cpu")
    server_device: torch.device = torch.device("cpu")

    @property
    def options(self):  # noqa: ANN201 - the algorithm's own frozen options dataclass
        return self.cfg.algorithm_options

    def new_model(self, device: torch.device | str = "cpu") -> FlatModel:
        """The initial model, identical on every rank (weights drawn on the CPU from the run's seed alone),
        on ``device``."""
        return FlatModel(build_model(self.cfg.model, self.layout, self.cfg.seed).to(device))

    def weights(self, clients: np.ndarray) -> np.ndarray:
        """Aggregation weights of ``clients``: by sample count (known to the server from the data layout), or
        equal (``server.weighting: uniform``); they sum to 1 except under DP's Poisson sampling."""
        return self.sum_weights("weighting", clients) / self.divisor(clients)

    def sum_weights(self, rule: SumWeights, clients: np.ndarray) -> np.ndarray:
        """What each of ``clients``' rows is multiplied by in a weighted sum (a :class:`Message`'s ``summed``):
        its training samples, or one (``uniform``; ``weighting``: as ``server.weighting`` says)."""
        if rule == "weighting":
            rule = "uniform" if self.cfg.server.weighting == "uniform" else "samples"
        if rule == "uniform":
            return np.ones(len(clients))
        return self.layout.train_sizes[clients].astype(np.float64)

    def divisor(self, clients: np.ndarray) -> float:
        """What a weighted sum over the accepted ``clients`` is divided by to be their mean: the sum of their
        weights; under DP's Poisson sampling with uniform weights, the expected cohort size instead (DP-FedAvg,
        McMahan et al. 2018: the cohort's size is random, and one client's influence must stay bounded by
        clip / expected size)."""
        poisson = self.cfg.privacy.mode != "off" and self.cfg.privacy.sampling == "poisson"
        if poisson and self.cfg.server.weighting == "uniform":
            return float(self.cfg.clients_per_round)
        return float(self.sum_weights("weighting", clients).sum())


Stage = Literal["setup", "train", "newcomer", "eval_prelude", "eval"]
@dataclass(frozen=True)
class StepContext:
    """What the runtime tells an algorithm about the step it calls it for (built fresh for every step).

    ``round`` is the training round (1, 2, ...); 0 for the set-up plan; for the evaluation stages, the round
    just trained. ``stage`` is the plan being walked: ``setup`` (:meth:`Protocol.setup_plan`), ``train``,
    ``newcomer`` (new clients before an evaluation), ``eval_prelude`` and ``eval``. ``clients`` are the
    clients taking part in this step, ascending ids: for a down message the recipients, for an up message
    the senders whose rows the server accepted, for a local step the clients that compute (all of them on
    the server; on a worker, only the ones that worker hosts in ``compute_clients``)."""

    round: int
    stage: Stage
    clients: np.ndarray

    def with_clients(self, clients: np.ndarray) -> StepContext:
        return dataclasses.replace(self, clients=clients)


@dataclass(frozen=True)
class EvalLayout:
    """How one client's evaluation row is laid out: the :data:`~mpifl.training.sgd.EVAL_FIELDS` sums of every
    model kind (:attr:`Protocol.eval_kinds`) on every data split, kinds outermost. The one place that says so:
    the client writes its row in this order, the runtime sizes the message by it, the recorder reads it back."""

    kinds: tuple[str, ...]
    splits: tuple[str, ...]

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return [(kind, split) for kind in self.kinds for split in self.splits]

    @property
    def width(self) -> int:
        return len(self.pairs) * len(EVAL_FIELDS)

    def blocks(self, rows: np.ndarray) -> list[tuple[tuple[str, str], np.ndarray]]:
        """Each (model kind, data split)'s :data:`EVAL_FIELDS` columns of evaluation ``rows``."""
        width = len(EVAL_FIELDS)
        return [(pair, rows[:, k * width : (k + 1) * width]) for k, pair in enumerate(self.pairs)]


@dataclass(frozen=True)
class AsynchronousOptions:
    """The options every asynchronous algorithm has."""

    concurrency: int = field(default=0, metadata=limits(ge=0))  # clients training at once; 0: clients_per_round
