"""PeFLL (Scott, Zakerinia, Lampert, ICLR 2024): an embedding net φ (η_v) and a hypernetwork h (η_h) on the
server turn a client's descriptor v = mean φ(x, y) into its personal model θ = h(v) (pefll spec §2).

One round, per sampled client (Alg. 2, split learning): η_v goes down; the client sends v_i = φ(B_i) of one
batch; the server sends θ_i = h(v_i); the client trains θ_i for k local steps and sends Δθ_i = θ_i^new − θ_i;
the server backpropagates all Δθ_i through h at once (one forward over the stacked v's, one backward),
which gives its own update Σ J_hᵀΔθ_i and each Δv_i = J_vᵀΔθ_i; Δv_i goes down; the client backpropagates
it through φ on the same batch and sends Δη_v^(i). The server averages and updates η = (η_v, η_h) with
the paper's step (Alg. 2: η ← (1 − 2βλ)η + mean Δη) or the authors' default (Adam on −mean Δη, clipped).
Per client and round that is |η_v| + l + d + d + l + |η_v| floats (spec §7.1).

A new client needs one round trip and no training (Alg. 1): the eval plan sends η_v to every client, each
returns the descriptor of its whole training split, and the server sends back h(v). The engine may walk
the eval plan ``eval_chunk`` clients at a time: the server then holds the models of one chunk (K·d floats)
and keeps only the descriptors (l floats per client) for the rank correlation it reports at the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import Handler, Protocol, RunContext, ServerAlgorithm, StepContext
from mpifl.algorithms.state import ClientState
from mpifl.algorithms.toolkit import STATED_STEP, ClientStart, ClientToolkit
from mpifl.comm.messages import LOCAL, Message, Step, require
from mpifl.models import FlatModel
from mpifl.models.hyper import ConvEmbedding, HyperNetwork, LabelEmbedding, default_embed_dim, seeded
from mpifl.models.reductions import l2_norm
from mpifl.schema import ConfigError, limits
from mpifl.training.device import host_numpy
from mpifl.training.localstep import LocalStep, TrainedRows
from mpifl.training.sgd import client_generator, clip_factor, to_device

HYPER_STREAM, EMBED_STREAM = 0x4859504552, 0x454D424544  # seed streams of h's and φ's initial weights
DESCRIPTOR_PURPOSE = 1  # client_generator purpose of the descriptor batch (0: local training)


@dataclass(frozen=True)
class HyperOptions:
    """What PeFLL and pFedHN share: the hypernetwork's shape, the outer clip and label masking."""

    embed_dim: int | None = field(default=None, metadata=limits(ge=1))  # l; none: int(1 + n/4), n = all clients
    hyper_hidden: int = field(default=100, metadata=limits(ge=1))  # the hypernetwork's hidden width
    hyper_layers: int = field(default=3, metadata=limits(ge=0))  # hidden 100→100 layers after the first
    clip_norm: float | None = field(default=50.0, metadata=limits(gt=0))  # server pseudo-gradient; none: off
    mask_absent: bool = False  # at evaluation, zero the logits of classes absent from the client's train split


@dataclass(frozen=True)
class PeFLLOptions(HyperOptions):
    """PeFLL: an embedding net and a hypernetwork on the server make each client's model from a descriptor of its
    data, so an unseen client gets a model without training."""

    embedding: Literal["cnn", "linear"] = "cnn"  # φ: a CNN over (image, label), or a linear map of the labels only
    embed_labels: bool = True  # false: φ sees images only (clients with unlabelled data)
    embed_channels: tuple[int, ...] = field(default=(16, 32), metadata=limits(ge=1))  # φ's conv blocks (cnn)
    embed_hidden: tuple[int, ...] = field(default=(120, 84), metadata=limits(ge=1))  # φ's hidden FC widths (cnn)
    embed_kernel: int = field(default=5, metadata=limits(ge=1))  # φ's convolution kernel size (cnn)
    descriptor_batch: int = field(default=32, metadata=limits(ge=1))  # samples in the batch a descriptor is made of
    standardize: bool = True  # (v − m)/s, scalars m, s frozen from round 1's first descriptor (lowest id; code)
    # adam: the authors' code (Adam at lr, clipped at clip_norm); paper: Alg. 2's step η ← (1 − 2βλ)η + mean Δη
    optimizer: Literal["adam", "paper"] = "adam"
    lr: float | None = field(default=None, metadata=limits(gt=0))  # Adam's rate; none: 2e-4 (the code's)
    # Alg. 2's step (optimizer: paper): β (none: 2√c/(k√T) = 1.265e-3 for c=5, k=50, T=5000), and the decays
    # (1 − 2βλ) of η_h and η_v (none: 1e-3). The authors' Adam has no weight decay: they do not apply there.
    beta: float | None = field(default=None, metadata=limits(ge=0))
    lambda_h: float | None = field(default=None, metadata=limits(ge=0))  # optimizer paper: λ of η_h's decay
    lambda_v: float | None = field(default=None, metadata=limits(ge=0))  # optimizer paper: λ of η_v's decay

    def __post_init__(self) -> None:
        if self.embedding == "linear" and not self.embed_labels:
            raise ConfigError("pefll.embed_labels: the linear embedding sees labels only; use embedding: cnn")
        paper = {"beta": self.beta, "lambda_h": self.lambda_h, "lambda_v": self.lambda_v}
        given = [k for k, v in paper.items() if v is not None]
        if self.optimizer == "adam" and given:
            raise ConfigError(f"pefll.{given[0]}: applies to Alg. 2's step (optimizer: paper) only; the default "
                              "optimizer (adam, the authors' code) has no weight decay")
        if self.optimizer == "paper" and self.lr is not None:
            raise ConfigError("pefll.lr: is Adam's rate; Alg. 2's step (optimizer: paper) takes pefll.beta")
        defaults = {"lr": 2e-4} if self.optimizer == "adam" else {"beta": 1.265e-3, "lambda_h": 1e-3, "lambda_v": 1e-3}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)


def rowwise(hyper: nn.Module, v: torch.Tensor) -> torch.Tensor:
    """h applied to one row of ``v`` at a time, stacked: a GEMM's rounding depends on how many rows it
    multiplies, so a client's model must not depend on how many clients share its evaluation chunk."""
    return torch.cat([hyper(v[i : i + 1]) for i in range(len(v))])


class HyperProtocol(Protocol):
    """Sizes both hypernetwork algorithms need: the client model d and the descriptor/embedding l."""

    eval_kinds = ("personal",)

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        if ctx.layout.task != "classification":
            raise ConfigError(f"algorithm: {ctx.cfg.algorithm} needs a classification dataset")
        self.model_sizes = ctx.new_model().segment_sizes()
        self.model_numel = sum(self.model_sizes)
        self.embed_dim = ctx.options.embed_dim or default_embed_dim(ctx.layout.num_clients)

    def new_hypernetwork(self) -> HyperNetwork:
        opts = self.ctx.options
        return seeded(lambda: HyperNetwork(self.embed_dim, self.model_sizes, opts.hyper_hidden, opts.hyper_layers),
                      self.ctx.cfg.seed, HYPER_STREAM)


class PeFLLProtocol(HyperProtocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        if ctx.options.standardize and self.embed_dim < 2:
            raise ConfigError("pefll.standardize: needs embed_dim >= 2 (a scalar std of one value is undefined)")
        dim, d, e = self.embed_dim, self.model_numel, FlatModel(self.new_embedding()).numel
        self.embed_msg = Message("embed_net", "down", e, broadcast=True)
        self.descriptor_msg = Message("descriptor", "up", dim)
        self.model_msg = Message("model", "down", d)
        self.delta_msg = Message("delta", "up", d, update=True)
        self.descriptor_grad_msg = Message("descriptor_grad", "down", dim)
        self.embed_grad_msg = Message("embed_grad", "up", e, update=True, summed="uniform")
        self.eval_embed_msg = Message("eval_embed_net", "down", e, broadcast=True)
        self.eval_descriptor_msg = Message("eval_descriptor", "up", dim)
        self.eval_model_msg = Message("eval_model", "down", d)

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.embed_msg, self.descriptor_msg, self.model_msg, LOCAL, self.delta_msg,
                self.descriptor_grad_msg, self.embed_grad_msg)

    def samples_per_round(self) -> np.ndarray:
        """Local SGD, plus the descriptor batch twice through φ (forward, then backward with Δv)."""
        batch = np.minimum(self.ctx.options.descriptor_batch, self.ctx.layout.train_sizes)
        return super().samples_per_round() + 2 * batch

    def eval_plan(self) -> Sequence[Step]:
        return (self.eval_embed_msg, self.eval_descriptor_msg, self.eval_model_msg)

    def new_embedding(self) -> nn.Module:
        opts, layout = self.ctx.options, self.ctx.layout
        if opts.embedding == "linear":
            return seeded(lambda: LabelEmbedding(layout.num_classes, self.embed_dim), self.ctx.cfg.seed, EMBED_STREAM)
        if len(layout.input_shape) != 3:
            raise ConfigError(f"pefll.embedding: 'cnn' needs image inputs (C, H, W), got {layout.input_shape}")
        try:
            return seeded(lambda: ConvEmbedding(layout.input_shape, layout.num_classes, self.embed_dim,
                                                opts.embed_labels, opts.embed_channels, opts.embed_hidden,
                                                opts.embed_kernel), self.ctx.cfg.seed, EMBED_STREAM)
        except ValueError as exc:
            raise ConfigError(f"pefll.embed_channels: {exc}") from None


def clip_(grads: torch.Tensor, max_norm: float | None) -> float:
    """Scale ``grads`` in place to norm ≤ ``max_norm`` (as ``clip_grad_norm_``, the norm accumulated in float64);
    returns the norm before."""
    norm = l2_norm(grads)
    if max_norm is not None:
        grads.mul_(clip_factor(norm, max_norm))
    return float(norm)


class PeFLLServer(ServerAlgorithm):
    protocol_type: type[PeFLLProtocol] = PeFLLProtocol
    protocol: PeFLLProtocol
    networks = True

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.device = ctx.server_device  # φ, h and their optimizer; what crosses MPI stays numpy on the host
        self.hyper = self.protocol.new_hypernetwork()
        # η = (η_v, η_h) in one flat vector: η_v is sent as a slice, and the update is a few vector operations
        self.joint = FlatModel(nn.ModuleDict({"embed": self.protocol.new_embedding(), "hyper": self.hyper})
                               .to(self.device))
        self.split = self.protocol.embed_msg.numel
        opts = ctx.options
        self.adam = torch.optim.Adam(self.joint.module.parameters(), lr=opts.lr) if opts.optimizer == "adam" else None
        self.shift, self.scale = 0.0, 1.0
        self.standardizer_frozen = not opts.standardize
        self.described: np.ndarray | None = None  # clients whose v_i the server holds this round (id order)
        self.descriptors: torch.Tensor | None = None  # this round's stacked v_i (leaf of the VJP)
        self.models: torch.Tensor | None = None  # h(v_i), with its graph until Δθ arrives
        self.scalars: dict[str, float] = {}
        self.eval_descriptors: dict[int, np.ndarray] = {}  # this evaluation's v_i by client id, chunk after chunk

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.embed_msg: self.embedding_net, p.eval_embed_msg: self.embedding_net,
                p.descriptor_msg: self.take_descriptors, p.model_msg: self.personal_models,
                p.delta_msg: self.backpropagate_deltas, p.descriptor_grad_msg: self.descriptor_gradients,
                p.embed_grad_msg: self.apply_embedding_gradients,
                p.eval_descriptor_msg: self.take_eval_descriptors, p.eval_model_msg: self.evaluated_models}

    def embedding_net(self, step: StepContext) -> np.ndarray:
        """η_v alone: on a GPU the copy to the host is φ's, not all of η's (h's heads are d times its width)."""
        return host_numpy(self.joint.params[: self.split]).copy()

    def personal_models(self, step: StepContext) -> np.ndarray:
        return host_numpy(require(self.models, "the clients' models").detach())

    def evaluated_models(self, step: StepContext) -> np.ndarray:
        models, self.models = self.personal_models(step), None  # an evaluation chunk's models are not needed again
        return models

    def descriptor_gradients(self, step: StepContext) -> np.ndarray:
        gradient = require(require(self.descriptors, "the round's descriptors").grad, "their gradient")
        return host_numpy(gradient[rows_of(require(self.described, "the described clients"), step.clients)])

    def take_descriptors(self, step: StepContext, rows: np.ndarray) -> None:
        if not self.standardizer_frozen:  # the code's scalars: mean and (unbiased) std of the first descriptor
            first = torch.from_numpy(rows[0].copy())
            self.shift, self.scale = float(first.mean()), float(first.std())
            self.standardizer_frozen = True
        self.described = step.clients
        self.descriptors = to_device(torch.from_numpy(np.array(rows)), self.device).requires_grad_()  # no wait
        self.models = self.hyper((self.descriptors - self.shift) / self.scale)

    def take_eval_descriptors(self, step: StepContext, rows: np.ndarray) -> None:
        with torch.no_grad():
            descriptors = to_device(torch.from_numpy(rows.copy()), self.device)
            self.models = rowwise(self.hyper, (descriptors - self.shift) / self.scale)
        self.eval_descriptors.update(zip(step.clients.tolist(), rows.copy()))

    def backpropagate_deltas(self, step: StepContext, rows: np.ndarray) -> None:
        """Only the clients whose Δθ was accepted: their rows of h(V)."""
        self.joint.grads.zero_()
        accepted, models = step.clients, require(self.models, "the round's models")
        if len(accepted) < len(require(self.described, "the described clients")):
            models = models[rows_of(require(self.described, "the described clients"), accepted)]
        models.backward(to_device(torch.from_numpy(rows.copy()), self.device))  # Σ_i J_hᵀΔθ_i into η_h, Δv_i into v_i
        self.joint.grads[self.split :] /= len(accepted)
        self.models = None

    def apply_embedding_gradients(self, step: StepContext, total: np.ndarray) -> None:
        grads = self.joint.grads  # mean Δη: η_h's part from the VJP above, η_v's from the clients' sum
        grads[: self.split] = to_device(torch.from_numpy(total / len(step.clients)), self.device)
        self.step(grads)

    def step(self, mean_delta: torch.Tensor) -> None:
        """Alg. 2's update η ← (1 − 2βλ)η + mean Δη, or Adam descending −mean Δη (the code's default)."""
        opts = self.ctx.options
        self.scalars = {"update_norm": clip_(mean_delta, opts.clip_norm)}
        if self.adam is not None:
            mean_delta.neg_()  # the pseudo-gradient mean_i J_iᵀ(θ_i − θ_i^new)
            self.adam.step()
            return
        params = self.joint.params
        params[: self.split].mul_(1 - 2 * opts.beta * opts.lambda_v)
        params[self.split :].mul_(1 - 2 * opts.beta * opts.lambda_h)
        params.add_(mean_delta)

    def round_metrics(self) -> dict[str, float]:
        return self.scalars

    def eval_metrics(self) -> dict[str, float]:
        """The descriptor rank correlations over every client the evaluation's chunks described."""
        if not self.eval_descriptors:
            return {}
        ids = np.array(sorted(self.eval_descriptors))
        descriptors = np.stack([self.eval_descriptors[i] for i in ids])
        self.eval_descriptors = {}
        layout = self.ctx.layout
        return descriptor_correlations(descriptors, layout.class_counts[ids], layout.unseen[ids])

    def final_state(self) -> dict[str, np.ndarray]:
        flat = self.joint.numpy()
        return {"embed_net": flat[: self.split].copy(), "hypernetwork": flat[self.split :].copy(),
                "descriptor_standardizer": np.array([self.shift, self.scale])}


def rows_of(sent: np.ndarray, clients: np.ndarray) -> torch.Tensor:
    """Where ``clients`` sit among the clients ``sent`` this round's models (a rejected update drops a client)."""
    return torch.from_numpy(np.searchsorted(sent, clients))


def descriptor_correlations(descriptors: np.ndarray, class_counts: np.ndarray, unseen: np.ndarray
                            ) -> dict[str, float]:
    """Spec §2.5: for each client i, the Spearman correlation between its descriptor distances ‖v_i − v_j‖
    and its class-proportion distances ‖π_i − π_j‖ to every other client j, averaged over the unseen
    (and, separately, the seen) clients. π is each client's training-label histogram, normalized."""
    from scipy.spatial.distance import cdist  # scipy costs ≈ 0.7 s and 58 MB to import: only where it is used
    from scipy.stats import rankdata

    pi = class_counts / np.maximum(class_counts.sum(1, keepdims=True), 1)
    v = descriptors.astype(np.float64)
    out = {}
    for group, mask in (("seen", ~unseen), ("unseen", unseen)):
        ids = np.flatnonzero(mask)
        if len(ids) == 0 or len(v) < 3:
            continue
        others = np.ones((len(ids), len(v)), dtype=bool)
        others[np.arange(len(ids)), ids] = False
        dv = rankdata(cdist(v[ids], v)[others].reshape(len(ids), -1), axis=1)
        dpi = rankdata(cdist(pi[ids], pi)[others].reshape(len(ids), -1), axis=1)
        dv -= dv.mean(1, keepdims=True)
        dpi -= dpi.mean(1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = (dv * dpi).sum(1) / np.sqrt((dv**2).sum(1) * (dpi**2).sum(1))
        out[f"descriptor_spearman_{group}"] = float(np.nanmean(rho)) if np.isfinite(rho).any() else np.nan
    return out


class MaskedLogits(nn.Module):
    """The code's label masking: logits of classes absent from the client's training split are multiplied
    by 0 (zeroed, not set to −∞)."""

    def __init__(self, model: nn.Module, present: torch.Tensor):
        super().__init__()
        self.model = model
        self.present = present

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) * self.present


class HyperClient(ClientToolkit):
    """A stateless client of a hypernetwork algorithm: trains the personal model it is sent and returns
    Δθ = θ^new − θ; evaluates the model the eval plan sent it (label-masked if configured)."""

    scratch: tuple[str, ...] = ("start", "deltas", "eval_models")
    retired = {"train_from": STATED_STEP}

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.start: dict[int, np.ndarray] = {}
        self.deltas: dict[int, np.ndarray] = {}
        self.eval_models: dict[int, np.ndarray] = {}

    def receive_start(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.start[client] = row

    def receive_eval_model(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.eval_models[client] = row

    def send_delta(self, step: StepContext, client: int) -> np.ndarray:
        return self.deltas.pop(client)

    def local_step(self, step: StepContext) -> LocalStep | None:
        return LocalStep(delta=True)

    def local_start(self, step: StepContext, client: int) -> ClientStart:
        return ClientStart(self.start.pop(client), purpose=self.purpose(step, client))

    def purpose(self, step: StepContext, client: int) -> int:
        """What keys ``client``'s generator besides (seed, round, client)."""
        return 0

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        rows = trained.host("params")[0]
        self.deltas.update((client, rows[k]) for k, client in enumerate(clients))

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        self.workspace.load(self.eval_models.pop(client))
        if not self.ctx.options.mask_absent:
            return self.workspace.module
        labels = self.data[client].y_train
        present = (torch.bincount(labels, minlength=self.ctx.layout.num_classes) > 0).to(torch.float32)
        return MaskedLogits(self.workspace.module, present)


def descriptor_rows(seed: int, round_: int, client: int, n: int, batch: int) -> torch.Tensor:
    """The training samples of client's descriptor batch: drawn from (seed, round, client) alone."""
    gen = client_generator(seed, round_, client, DESCRIPTOR_PURPOSE)
    return torch.randperm(n, generator=gen)[: min(batch, n)]


class PeFLLClient(HyperClient):
    """PeFLL's client side. A client's descriptor and Δη_v are computed when what they need arrives and sent as
    they are, on φ's device: the runtime reads a step's clients' rows to the host together (one wait for the
    device a step, not one a client)."""

    protocol_type: type[PeFLLProtocol] = PeFLLProtocol
    retired = {"send_eval_descriptor": "send_descriptor (it sends the evaluation's descriptors too)"}
    protocol: PeFLLProtocol
    scratch: tuple[str, ...] = (*HyperClient.scratch, "batches", "described", "embed_grads")

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.embed = FlatModel(self.protocol.new_embedding().to(self.device))
        self.loaded: torch.Tensor | None = None  # the device copy of the φ row loaded last (on_device's)
        self.batches: dict[int, torch.Tensor] = {}
        self.described: dict[int, torch.Tensor] = {}  # descriptors on φ's device, not sent yet
        self.embed_grads: dict[int, torch.Tensor] = {}  # Δη_v on φ's device, not sent yet

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.embed_msg: self.receive_training_embedding_net, p.eval_embed_msg: self.receive_eval_embedding_net,
                p.descriptor_msg: self.send_descriptor, p.model_msg: self.receive_start,
                p.delta_msg: self.send_delta, p.descriptor_grad_msg: self.receive_descriptor_gradient,
                p.embed_grad_msg: self.send_embedding_gradient,
                p.eval_descriptor_msg: self.send_descriptor, p.eval_model_msg: self.receive_eval_model}

    def receive_embedding_net(self, step: StepContext, client: int, row: np.ndarray) -> None:
        """φ's weights, copied up once a broadcast (:meth:`ClientToolkit.on_device`) and loaded for the first client
        it reaches: a load per client would be a blocking upload per client on a GPU."""
        received = self.on_device(step, row)
        if received is not self.loaded:
            self.embed.load(received)
            self.loaded = received

    def receive_training_embedding_net(self, step: StepContext, client: int, row: np.ndarray) -> None:
        """φ, then ``client``'s descriptor of this round's batch."""
        self.receive_embedding_net(step, client, row)
        rows = descriptor_rows(self.ctx.cfg.seed, step.round, client, len(self.data[client].y_train),
                               self.ctx.options.descriptor_batch)
        self.batches[client] = rows
        with torch.no_grad():
            self.described[client] = self.describe(client, rows)

    def receive_eval_embedding_net(self, step: StepContext, client: int, row: np.ndarray) -> None:
        """φ, then ``client``'s evaluation descriptor."""
        self.receive_embedding_net(step, client, row)
        self.described[client] = self.describe_all(client)

    def send_descriptor(self, step: StepContext, client: int) -> torch.Tensor:
        return self.described.pop(client)

    def receive_descriptor_gradient(self, step: StepContext, client: int, row: np.ndarray) -> None:
        """Δη_v^(i) = (∂v_i/∂η_v)ᵀ Δv_i: the server's Δv_i backpropagated through φ on the same batch."""
        v = self.describe(client, self.batches.pop(client))
        self.embed.compute_gradient(torch.dot(v, to_device(torch.from_numpy(row), self.device)))
        self.embed_grads[client] = self.embed.grads.clone()  # the next client's gradient overwrites the buffer

    def send_embedding_gradient(self, step: StepContext, client: int) -> torch.Tensor:
        return self.embed_grads.pop(client)

    def describe(self, client: int, rows: torch.Tensor) -> torch.Tensor:
        split = self.data[client]
        return self.embed.module(split.x_train[rows], split.y_train[rows]).mean(0)

    @torch.no_grad()
    def describe_all(self, client: int, chunk: int = 1024) -> torch.Tensor:
        """The evaluation descriptor: the mean of φ over the client's whole training split (as the code)."""
        split = self.data[client]
        total = torch.zeros(self.protocol.embed_dim, dtype=torch.float64, device=self.device)
        for start in range(0, len(split.y_train), chunk):
            x, y = split.x_train[start : start + chunk], split.y_train[start : start + chunk]
            total += self.embed.module(x, y).sum(0, dtype=torch.float64)
        return (total / len(split.y_train)).to(torch.float32)
