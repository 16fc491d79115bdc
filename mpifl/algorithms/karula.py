"""Karula (Erickson & Johansson 2025): personalized models under pairwise dissimilarity constraints.

    minimize (1/n) Σ α_i f_i(θ_i)   subject to   ‖θ_i − θ_j‖² ≤ t·D_ij  for all pairs,

with D_ij a federated surrogate of W1 between client distributions (:mod:`.dissimilarity`), computed once
in the set-up plan, and α_i = n·N_i/ΣN. Algorithm 1 is an inexact projected stochastic gradient method
with SAGA-type variance reduction, run entirely on the server: each round the s sampled clients receive
their θ_i and return one gradient at it; the server keeps the table of the latest weighted gradient of
every client, forms ν, steps *all* n personalized models and projects onto the constraint set
(:mod:`.projection`). There is no local training. Set-up also collects every client's gradient at the
common initial model (the algorithm's "initial pass").

Estimator (karula.md §3.2): with g_i the stored α_i·G_i/n, the default (``unbiased``) is
ν = g^k + (n/s)(g^{k+1} − g^k), unbiased for ∇f(θ^k). ``literal`` keeps the paper's printed update
(g_i ← α_i·G_i, no 1/n, and ν = g^k + (g^{k+1} − g^k)/s), which is biased; it exists for comparison.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import Handler, Protocol, RunContext, ServerAlgorithm, StepContext
from mpifl.algorithms.dissimilarity import (
    Metric,
    data_points,
    dissimilarities,
    lot_embedding,
    moments,
    pooled_standardizer,
    reference_set,
)
from mpifl.algorithms.projection import Projector, Solver, pair_indices
from mpifl.algorithms.state import ClientState
from mpifl.algorithms.toolkit import ClientToolkit, send_from
from mpifl.comm.messages import LOCAL, Message, Step, require
from mpifl.config import RunConfig
from mpifl.data import FederatedLayout, build_federated_dataset
from mpifl.schema import ConfigError, limits
from mpifl.training.device import host_numpy
from mpifl.training.sgd import client_generator


@dataclass(frozen=True)
class KarulaOptions:
    """Karula: personalized models under pairwise dissimilarity constraints, projected SGD on the server."""

    t: float = field(default=1.0, metadata=limits(ge=0))  # constraint scale: ‖θ_i − θ_j‖² ≤ t·D_ij
    lr: float = field(default=1.0, metadata=limits(gt=0))  # server step size η on ν ≈ ∇f = (1/n)Σα_i∇f_i
    # unbiased: ν = g + (n/s)(g_new − g), unbiased for ∇f; literal: the paper's printed update (biased, to compare)
    estimator: Literal["unbiased", "literal"] = "unbiased"
    # fixed: η = lr. theory: η = 3/(8L) (Theorem 4.4), L = max_i α_i·λ_max(∇²f_i) (Assumption 4.1), each
    # client's λ_max measured at set-up by power iteration on gradient differences (exact for ridge)
    lr_rule: Literal["fixed", "theory"] = "fixed"
    # the logged estimation error: squared = mean_i ‖θ_i − θ_i^true‖², norm = mean_i ‖θ_i − θ_i^true‖
    estimation_error: Literal["squared", "norm"] = "squared"
    full_batch: bool = True  # False: one mini-batch of client.batch_size per gradient
    # the projection's solver: dual (L-BFGS-B on the Lagrange dual, O(n²d) + O(n³) per iteration) or dykstra
    # (alternating projections, the independent check)
    solver: Solver = "dual"
    tol: float = field(default=1e-6, metadata=limits(gt=0))  # projection gap relative to ½‖ϑ − ϑ̄‖²
    max_inner: int = field(default=1000, metadata=limits(ge=1))  # projection iterations per round
    reference_size: int = field(default=100, metadata=limits(ge=1))  # N0
    # the dissimilarity D_ij between OT embeddings: l21 (sum over reference points of the L2 distance: W1's cost
    # along the reference coupling) or l1 (the paper's literal entrywise norm)
    metric: Metric = "l21"
    standardize: bool = True  # z-score (x, y) with pooled statistics before OT
    label_scale: float = field(default=1.0, metadata=limits(gt=0))  # one-hot label weight (classification)


def point_dims(layout: FederatedLayout) -> tuple[int, int]:
    """(dimension of an OT point ξ = (x, y), how many of its leading coordinates are continuous)."""
    features = math.prod(layout.input_shape)
    if layout.task == "regression":
        return features + 1, features + 1
    return features + layout.num_classes, features


def ground_truth(cfg: RunConfig, numel: int) -> np.ndarray | None:
    """The true flat parameters [num_clients, numel] when the dataset has them (synthetic ridge: θ_i then
    a zero bias, the order of a linear model's weight and bias), else ``None``. Rebuilt from (config,
    seed): no data moves."""
    if cfg.data.dataset != "karula_ridge" or cfg.data.prepared is not None:
        return None  # only the synthetic ridge generator knows its true parameters: build no other twice
    dataset = build_federated_dataset(cfg.data, cfg.seed)
    if not hasattr(dataset, "true_parameters"):
        return None
    truth = np.stack([dataset.true_parameters(c) for c in range(dataset.layout.num_clients)])
    if truth.shape[1] + 1 != numel:
        return None
    return np.hstack([truth, np.zeros((len(truth), 1))])


def estimation_errors(models: np.ndarray, truth: np.ndarray, kind: str = "squared") -> np.ndarray:
    """Per-client estimation error, ‖θ̂_i − θ_i‖² (``squared``) or ‖θ̂_i − θ_i‖ (``norm``): Table 1(a) does
    not say which it averages (docs/papers/karula.md argues for ``norm``)."""
    squared = np.sum((models - truth) ** 2, axis=1)
    return squared if kind == "squared" else np.sqrt(squared)


POWER_ITERATIONS = 200
CURVATURE_PURPOSE = 0x4C  # client_generator stream of the power iteration's start vector


def curvature(gradient: Callable[[np.ndarray], np.ndarray], at: np.ndarray, start: np.ndarray,
              iterations: int = POWER_ITERATIONS) -> float:
    """λ_max of the Hessian at ``at`` by power iteration on H·v = ∇(at + v) − ∇(at), ‖v‖ = 1: needs only the
    gradient oracle the client already has, and is exact (up to rounding) for quadratic losses like ridge."""
    base = gradient(at).astype(np.float64)
    v, value = start / np.linalg.norm(start), 0.0
    for _ in range(iterations):
        hv = gradient((at + v).astype(at.dtype)).astype(np.float64) - base
        value = float(np.linalg.norm(hv))
        if value == 0.0:
            break
        v = hv / value
    return value


def theory_step_size(alpha: np.ndarray, curvatures: np.ndarray) -> tuple[float, float]:
    """(η, L) with L = max_i α_i·L_i, the smoothness constant of Assumption 4.1, and η = 3/(8L) (Thm 4.4)."""
    smoothness = float(np.max(alpha * curvatures))
    if not smoothness > 0:
        raise ConfigError("karula.lr_rule: theory needs a positive smoothness constant L; the losses are flat")
    return 3.0 / (8.0 * smoothness), smoothness


class KarulaProtocol(Protocol):
    eval_kinds = ("personal",)

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        opts: KarulaOptions = ctx.options
        numel = ctx.new_model().numel
        p, _ = point_dims(ctx.layout)
        self.moments_msg = Message("data_moments", "up", 2 * p + 1, "float64")
        self.standardizer_msg = Message("standardizer", "down", 2 * p, "float64", broadcast=True)
        self.reference_msg = Message("reference_set", "down", opts.reference_size * p, broadcast=True)
        self.embedding_msg = Message("embedding", "up", opts.reference_size * p)
        self.initial_grad_msg = Message("initial_gradient", "up", numel, update=True)
        self.curvature_msg = Message("curvature", "up", 1, "float64")
        self.model_msg = Message("personal_model", "down", numel)
        self.grad_msg = Message("gradient", "up", numel, update=True)
        self.eval_msg = Message("eval_personal_model", "down", numel)

    def setup_plan(self) -> Sequence[Step]:
        standardize = (self.moments_msg, self.standardizer_msg) if self.ctx.options.standardize else ()
        curvature = (self.curvature_msg,) if self.ctx.options.lr_rule == "theory" else ()
        return (*standardize, self.reference_msg, LOCAL, self.embedding_msg, self.initial_grad_msg, *curvature)

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.model_msg, LOCAL, self.grad_msg)

    def samples_per_round(self) -> np.ndarray:
        """One gradient: the whole training split, or one batch."""
        sizes = self.ctx.layout.train_sizes
        return sizes.copy() if self.ctx.options.full_batch else np.minimum(self.ctx.cfg.client.batch_size, sizes)

    def eval_plan(self) -> Sequence[Step]:
        return (self.eval_msg,)


class KarulaServer(ServerAlgorithm):
    """θ (n×d), the gradient table, D and the projection solver; all float64."""

    protocol_type: type[KarulaProtocol] = KarulaProtocol
    protocol: KarulaProtocol

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        layout, opts = ctx.layout, ctx.options
        if layout.unseen.any():
            raise ConfigError("data.unseen_fraction: karula personalizes only clients that train; use 0")
        self.opts: KarulaOptions = opts
        self.n = layout.num_clients
        initial = ctx.new_model().numpy().astype(np.float64)
        self.theta = np.tile(initial, (self.n, 1))
        self.table = np.zeros_like(self.theta)
        self.alpha = self.n * ctx.weights(np.arange(self.n))
        p, self.continuous = point_dims(layout)
        self.reference = reference_set(ctx.cfg.seed, opts.reference_size, p).astype(np.float32)
        self.standardizer = np.concatenate([np.zeros(p), np.ones(p)])
        self.dissimilarity: np.ndarray | None = None
        self.projector: Projector | None = None
        self.truth = ground_truth(ctx.cfg, initial.size)
        self.lr = opts.lr
        self.step_metrics: dict[str, float] = {}
        self.metrics: dict[str, float] = {}

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.moments_msg: self.pool_moments, p.standardizer_msg: self.send_standardizer,
                p.reference_msg: self.send_reference, p.embedding_msg: self.set_up_projection,
                p.initial_grad_msg: self.fill_table, p.curvature_msg: self.set_step_size,
                p.model_msg: self.personal_models, p.eval_msg: self.personal_models, p.grad_msg: self.take_gradients}

    def send_standardizer(self, step: StepContext) -> np.ndarray:
        return self.standardizer

    def send_reference(self, step: StepContext) -> np.ndarray:
        return self.reference.reshape(-1)

    def personal_models(self, step: StepContext) -> np.ndarray:
        return self.theta[step.clients].astype(np.float32)

    def pool_moments(self, step: StepContext, rows: np.ndarray) -> None:
        self.standardizer = pooled_standardizer(rows, self.continuous)

    def set_up_projection(self, step: StepContext, rows: np.ndarray) -> None:
        embeddings = rows.astype(np.float64).reshape(self.n, self.opts.reference_size, -1)
        self.dissimilarity = dissimilarities(embeddings, self.opts.metric)
        radii = self.opts.t * self.dissimilarity[pair_indices(self.n)]
        self.projector = Projector(radii, self.opts.solver, self.opts.tol, self.opts.max_inner)

    def fill_table(self, step: StepContext, rows: np.ndarray) -> None:
        self.table[step.clients] = self.weighted(step.clients, rows) / self.n

    def set_step_size(self, step: StepContext, rows: np.ndarray) -> None:
        self.lr, smoothness = theory_step_size(self.alpha[step.clients], rows[:, 0])
        self.step_metrics = {"step_size": self.lr, "smoothness_L": smoothness}

    def take_gradients(self, step: StepContext, rows: np.ndarray) -> None:
        self.step(step.clients, self.weighted(step.clients, rows))

    def weighted(self, clients: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return rows.astype(np.float64) * self.alpha[clients, None]

    def direction(self, clients: np.ndarray, grads: np.ndarray) -> np.ndarray:
        """ν from the gradient table and the sampled clients' new weighted gradients; updates the table."""
        n, s = self.n, len(clients)
        new, gain = (grads / n, n / s) if self.opts.estimator == "unbiased" else (grads, 1 / s)
        direction = self.table.copy()
        direction[clients] += gain * (new - self.table[clients])
        self.table[clients] = new
        return direction

    def step(self, clients: np.ndarray, grads: np.ndarray) -> None:
        """θ ← Π_𝒦^δ(θ − ην) for all n clients, logging the solver's certificate."""
        target = self.theta - self.lr * self.direction(clients, grads)
        start = time.perf_counter()
        result = require(self.projector, "the projector (set up from the dissimilarities)")(target)
        self.theta = result.theta
        self.metrics = {
            "proj_iterations": float(result.iterations),
            "proj_delta": result.gap / self.lr,
            "proj_max_violation": result.max_violation,
            "proj_seconds": time.perf_counter() - start,
            **self.step_metrics,
        }
        if self.truth is not None:
            errors = estimation_errors(self.theta, self.truth, self.opts.estimation_error)
            self.metrics["estimation_error"] = float(errors.mean())

    def round_metrics(self) -> dict[str, float]:
        return dict(self.metrics)

    def final_state(self) -> dict[str, np.ndarray]:
        dissimilarity = {} if self.dissimilarity is None else {"dissimilarity": self.dissimilarity}
        return {"personal_models": self.theta, **dissimilarity}


class KarulaClient(ClientToolkit):
    protocol_type: type[KarulaProtocol] = KarulaProtocol
    protocol: KarulaProtocol
    scratch: tuple[str, ...] = ("models", "embeddings", "initial_grads", "curvatures", "grads")

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.opts: KarulaOptions = ctx.options
        self.initial = self.workspace.numpy().copy()
        p, _ = point_dims(ctx.layout)
        self.standardizer = np.concatenate([np.zeros(p), np.ones(p)])
        self.reference: np.ndarray | None = None
        self.models: dict[int, np.ndarray] = {}
        # what each client computed for its next upload, by client id
        self.embeddings: dict[int, np.ndarray] = {}
        self.initial_grads: dict[int, np.ndarray] = {}
        self.curvatures: dict[int, np.ndarray] = {}
        self.grads: dict[int, np.ndarray] = {}

    def points(self, client: int) -> np.ndarray:
        split = self.data[client]
        return data_points(host_numpy(split.x_train), host_numpy(split.y_train), self.ctx.layout.num_classes,
                           self.opts.label_scale)

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.moments_msg: self.send_moments, p.standardizer_msg: self.receive_standardizer,
                p.reference_msg: self.receive_reference, p.embedding_msg: send_from(self.embeddings),
                p.initial_grad_msg: send_from(self.initial_grads), p.curvature_msg: send_from(self.curvatures),
                p.model_msg: self.receive_model, p.eval_msg: self.receive_model, p.grad_msg: send_from(self.grads)}

    def send_moments(self, step: StepContext, client: int) -> np.ndarray:
        return moments(self.points(client))

    def receive_standardizer(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.standardizer = np.array(row)

    def receive_reference(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.reference = row.astype(np.float64).reshape(self.opts.reference_size, -1)

    def receive_model(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.models[client] = np.array(row)

    def compute(self, step: StepContext, client: int) -> None:
        """Set-up (round 0): the LOT embedding and the gradient at the common initial model. Later: one
        gradient at the received personalized model."""
        if step.stage == "setup":
            mean, std = np.split(self.standardizer, 2)
            embedding = lot_embedding(require(self.reference, "the reference set"), (self.points(client) - mean) / std)
            self.embeddings[client] = embedding.astype(np.float32).reshape(-1)
            self.initial_grads[client] = self.gradient(step.round, client, self.initial)
            if self.opts.lr_rule == "theory":
                self.curvatures[client] = np.array([self.curvature(client)])
        else:
            self.grads[client] = self.gradient(step.round, client, self.models[client])

    def curvature(self, client: int) -> float:
        """L_i = λ_max(∇²f_i) of the full-batch loss at the common initial model (the start vector is keyed by
        (seed, client), so any rank computes the same)."""
        gen = client_generator(self.ctx.cfg.seed, 0, client, CURVATURE_PURPOSE)
        start = torch.randn(self.initial.size, generator=gen, dtype=torch.float64).numpy()
        return curvature(lambda params: self.gradient_at(client, params), self.initial, start)

    def gradient(self, round_: int, client: int, params: np.ndarray) -> np.ndarray:
        if self.opts.full_batch:
            return self.gradient_at(client, params)
        n = len(self.data[client].x_train)
        rows = torch.randperm(n, generator=client_generator(self.ctx.cfg.seed, round_, client))
        return self.gradient_at(client, params, rows[: self.ctx.cfg.client.batch_size])

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        self.workspace.load(self.models.get(client, self.initial))
        return self.workspace.module
