"""PeFLL's remaining baselines (Per-FedAvg, FedRep, kNN-Per) against independent computations.

As in test_references.py: small problems whose every step a float64 numpy reference recomputes from the
papers' update rules, never calling mpifl's training code (a client's batch is its whole training split,
so no random numbers matter); each half of an algorithm is checked on its own; and the bytes each sends.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mpifl.algorithms.base import EvalLayout, RunContext, StepContext
from mpifl.algorithms.knnper import knn_probabilities
from mpifl.comm.messages import Message
from mpifl.data import FederatedLayout
from mpifl.registry import get_algorithm, load_config
from mpifl.schema import ConfigError
from tests.algorithms.conftest import SHARDS, both_sides, walk
from tests.algorithms.test_references import SAMPLED, TOL, config, data, grad, weights
from tests.conftest import CUDA_ONLY, REPO, _merge

# ------------------------------------------------------------------------------------------- Per-FedAvg


def hessian(xy: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """∇² of mean((Xw + b − y)²): (2/n)·AᵀA with A = [X 1]."""
    a = np.hstack([xy[0], np.ones((len(xy[1]), 1))])
    return 2 / len(xy[1]) * a.T @ a


@pytest.mark.parametrize("variant, meta_steps", [("fo", 2), ("hf", 1)])
def test_perfedavg_meta_steps_uniform_average_and_personalization(variant, meta_steps):
    """FO: w ← w − β∇f(w − α∇f(w)); HF: w ← w − β(I − α∇²f)∇f(w − α∇f(w)) (the finite difference is exact on a
    quadratic). Four full batches per round (epochs 4) make 2 FO meta-steps or 1 HF step (3 batches, one
    dropped). Weight decay and momentum do not apply. The server averages Δw uniformly; evaluation takes
    ``personalize_epochs`` plain steps at α from the global model."""
    alpha, beta = 0.04, 0.3
    cfg = config("perfedavg", client={"momentum": 0.9, "weight_decay": 1e-2}, server={"lr": 0.7},
                 perfedavg={"variant": variant, "alpha": alpha, "beta": beta, "epochs": 4, "personalize_epochs": 2})
    _, server, client = both_sides(cfg)
    xys, x = data(cfg), server.params.astype(np.float64)
    rows = walk(server, client, server.protocol.train_plan(1), 1, SAMPLED)
    for k, i in enumerate(SAMPLED):
        w = x.copy()
        for _ in range(meta_steps):
            meta = grad(w - alpha * grad(w, xys[i]), xys[i])
            if variant == "hf":
                meta = meta - alpha * hessian(xys[i]) @ meta
            w = w - beta * meta
        np.testing.assert_allclose(rows["delta"][k], w - x, rtol=1e-3 if variant == "hf" else 1e-4, atol=1e-5)
    np.testing.assert_allclose(server.params, x + 0.7 * rows["delta"].mean(axis=0), **TOL)  # every client weighs 1
    global_ = server.params.astype(np.float64)
    walk(server, client, server.protocol.eval_plan(), 1, np.arange(4), stage="eval")
    step = StepContext(1, "eval", np.arange(4))
    for i in (1, 3):  # sampled or not, every client personalizes afresh
        client.eval_model(step, i, "personal")
        personal = global_.copy()
        for _ in range(2):
            personal = personal - alpha * grad(personal, xys[i])
        np.testing.assert_allclose(client.workspace.numpy(), personal, **TOL)
        client.eval_model(step, i, "global")
        np.testing.assert_allclose(client.workspace.numpy(), global_, **TOL)


def test_perfedavg_takes_one_meta_step_when_the_data_fits_one_batch():
    """One epoch of one batch: FL-Bench would take ⌊1/2⌋ = 0 meta-steps; mpifl takes one (2 batches)."""
    cfg = config("perfedavg", perfedavg={"epochs": 1})
    ctx, server, _ = both_sides(cfg)
    protocol = server.protocol
    assert protocol.batches(np.array([10])).tolist() == [2]
    sizes = ctx.layout.train_sizes
    assert np.array_equal(protocol.samples_per_round(), 2 * sizes)  # two full passes of one batch each


# ------------------------------------------------------------------------------------------- FedRep
MLP = {"model": {"name": "mlp", "hidden": [4]}}
HEAD = slice(16, 21)  # Linear(3, 4) = 16 floats of body, Linear(4, 1) = 5 of head
BODY = slice(0, 16)


def mlp_grad(theta: np.ndarray, xy: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """∇ of mean((relu(XW₁ᵀ + b₁)w₂ + b₂ − y)²) at θ = (W₁ row-major, b₁, w₂, b₂)."""
    x, y = xy
    w1, b1, w2, b2 = theta[:12].reshape(4, 3), theta[12:16], theta[16:20], theta[20]
    pre = x @ w1.T + b1
    hidden = np.maximum(pre, 0)
    r = 2 / len(y) * (hidden @ w2 + b2 - y)
    back = np.outer(r, w2) * (pre > 0)
    return np.concatenate([(back.T @ x).ravel(), back.sum(0), hidden.T @ r, [r.sum()]])


def part_sgd(theta: np.ndarray, xy, part: slice, steps: int, lr: float, momentum: float,  # noqa: ANN001
             weight_decay: float) -> np.ndarray:
    """``steps`` full-batch steps of torch.optim.SGD on ``theta[part]`` alone, from a zero momentum buffer."""
    theta, buf = theta.copy(), np.zeros(part.stop - part.start)
    for _ in range(steps):
        buf = momentum * buf + mlp_grad(theta, xy)[part] + weight_decay * theta[part]
        theta[part] -= lr * buf
    return theta


def test_fedrep_trains_the_head_then_the_body_and_averages_the_body():
    """Per round: head_epochs steps on h (φ frozen), then body_epochs steps on φ (h frozen), each with a fresh
    momentum buffer; h stays in the client's state, Δφ goes to the server, which averages by sample count. An
    unseen client trains a head from the initial one on the frozen φ before its evaluation."""
    lr, momentum, wd = 0.05, 0.5, 1e-2
    cfg = config("fedrep", **MLP, data={"unseen_fraction": 0.25}, client={"momentum": momentum, "weight_decay": wd},
                 fedrep={"head_epochs": 3, "body_epochs": 2, "new_head_epochs": 4})
    _, server, client = both_sides(cfg)
    assert (server.protocol.body, server.protocol.head) == (BODY, HEAD)
    xys, initial = data(cfg), server.model.params.astype(np.float64)
    heads = {i: initial[HEAD] for i in range(4)}
    for round_, sampled in ((1, np.array([0, 1])), (2, np.array([0, 2]))):  # round 2: client 0 brings its head
        body = server.model.params[BODY].astype(np.float64)
        rows = walk(server, client, server.protocol.train_plan(round_), round_, sampled)
        assert rows["body"].shape == (len(sampled), 16) and rows["body_delta"].shape == (len(sampled), 16)
        for k, i in enumerate(sampled):
            theta = np.concatenate([body, heads[i]])
            theta = part_sgd(theta, xys[i], HEAD, 3, lr, momentum, wd)
            theta = part_sgd(theta, xys[i], BODY, 2, lr, momentum, wd)
            np.testing.assert_allclose(client.state.get(i, "head"), theta[HEAD], **TOL)
            np.testing.assert_allclose(rows["body_delta"][k], theta[BODY] - body, **TOL)
            heads[i] = theta[HEAD]
        np.testing.assert_allclose(server.model.params[BODY], body + weights(xys, sampled) @ rows["body_delta"], **TOL)
        np.testing.assert_array_equal(server.model.params[HEAD], initial[HEAD].astype(np.float32))  # never moves
    body = server.model.params[BODY].astype(np.float64)
    walk(server, client, server.protocol.eval_plan(), 2, np.arange(4), stage="eval")
    step = StepContext(2, "eval", np.arange(4))
    for i in range(3):  # seen: the body with its own head
        client.eval_model(step, i, "personal")
        np.testing.assert_allclose(client.workspace.numpy(), np.concatenate([body, heads[i]]), **TOL)
    client.eval_model(step, 3, "personal")  # unseen: a new head, 4 epochs on the frozen body
    fresh = part_sgd(np.concatenate([body, initial[HEAD]]), xys[3], HEAD, 4, lr, momentum, wd)
    np.testing.assert_allclose(client.workspace.numpy(), fresh, **TOL)
    assert client.state.get(3, "head") is None  # and forgets it


def test_fedrep_needs_a_body():
    cfg = config("fedrep", fedrep={"head_layers": 1})  # the linear model is one layer group: all head
    with pytest.raises(ConfigError, match="fedrep.head_layers: 1 leaves no body"):
        both_sides(cfg)


# ------------------------------------------------------------------------------------------- kNN-Per
@pytest.mark.parametrize("overrides, message", [
    ({}, "knnper interpolates class probabilities; it needs a classification dataset"),  # ridge: regression
    ({"data": {"dataset": "digits", "partition": "iid"}, "model": {"name": "logistic"}, "knnper": {"k": []}},
     "knnper: k and weights each need at least one value to search"),
])
def test_knnper_refuses_what_it_cannot_search(overrides, message):
    with pytest.raises(ConfigError, match=message):
        both_sides(config("knnper", **overrides))


def mlp_forward(theta: np.ndarray, x: np.ndarray, hidden: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """SHARDS' MLP (Flatten, Linear(d, hidden), ReLU, Linear(hidden, classes)): penultimate features, logits."""
    d = x[0].size
    w1 = theta[: hidden * d].reshape(hidden, d)
    b1 = theta[hidden * d : hidden * d + hidden]
    rest = theta[hidden * d + hidden :]
    w2, b2 = rest[: classes * hidden].reshape(classes, hidden), rest[classes * hidden :]
    features = np.maximum(x.reshape(len(x), -1) @ w1.T + b1, 0)
    return features, features @ w2.T + b2


def knn_mixture(query: np.ndarray, store: np.ndarray, labels: np.ndarray, logits: np.ndarray, k: int, lam: float,
                temperature: float, classes: int, leave_one_out: bool = False) -> np.ndarray:
    """λ·p_kNN + (1 − λ)·softmax(logits), p_kNN from the k nearest (squared Euclidean) with weights exp(−d/T)."""
    out = np.empty((len(query), classes))
    for q in range(len(query)):
        d = ((store - query[q]) ** 2).sum(1)
        if leave_one_out:
            d[q] = np.inf
        near = np.argsort(d, kind="stable")[:k]
        w = np.exp(-(d[near] - d[near].min()) / temperature)
        p_knn = np.bincount(labels[near], weights=w / w.sum(), minlength=classes)
        z = np.exp(logits[q] - logits[q].max())
        out[q] = lam * p_knn + (1 - lam) * z / z.sum()
    return np.maximum(out, np.finfo(np.float64).tiny)  # mpifl's log-probabilities are clamped there


KNN = _merge(SHARDS, {"algorithm": "knnper", "rounds": 2, "clients_per_round": 3,
                      "knnper": {"scale": 0.5, "k": [1, 3, 5], "weights": [0.0, 0.3, 0.7, 1.0]}})


@pytest.mark.parametrize("val_fraction", [0.0, 0.2])
def test_knnper_interpolates_the_global_model_with_a_knn_over_training_features(val_fraction):
    """Training is FedAvg's; the personal prediction is the mixture above over the global model's penultimate
    features, with (k, λ) the grid's most accurate pair on the client's validation split, or leave-one-out on
    its training split without one (first pair on ties). The evaluated row's correct count and loss
    (−log p of the true class) match the reference's."""
    cfg = _merge(KNN, {"data": {"val_fraction": val_fraction}})
    _, server, client = both_sides(cfg)
    for round_ in (1, 2):
        walk(server, client, server.protocol.train_plan(round_), round_, np.array([0, 2, 4]))
    walk(server, client, server.protocol.eval_plan(), 2, np.arange(6), stage="eval")
    theta = server.params.astype(np.float64)
    opts = client.ctx.options
    temperature = 16 * opts.scale  # dim · scale
    step = StepContext(2, "eval", np.arange(6))
    layout = EvalLayout(client.protocol.eval_kinds, ("test",))
    chosen = set()
    for i in range(6):
        split = {name: getattr(client.data[i], name).numpy() for name in ("x_train", "y_train", "x_val", "y_val",
                                                                           "x_test", "y_test")}
        store, train_logits = mlp_forward(theta, split["x_train"].astype(np.float64), 16, 10)
        if val_fraction:
            queries, query_logits = mlp_forward(theta, split["x_val"].astype(np.float64), 16, 10)
            truth, loo = split["y_val"], False
        else:
            queries, query_logits, truth, loo = store, train_logits, split["y_train"], True
        best, choice = -1, None
        for k in opts.k:
            for lam in opts.weights:
                p = knn_mixture(queries, store, split["y_train"], query_logits, k, lam, temperature, 10, loo)
                if (correct := int((p.argmax(1) == truth).sum())) > best:
                    best, choice = correct, (k, lam)
        chosen.add(choice)
        test_features, test_logits = mlp_forward(theta, split["x_test"].astype(np.float64), 16, 10)
        p = knn_mixture(test_features, store, split["y_train"], test_logits, *choice, temperature, 10)
        personal, global_ = client.evaluate(step, i, layout).reshape(2, -1)  # kinds: personal, global
        assert personal[1] == (p.argmax(1) == split["y_test"]).sum()
        np.testing.assert_allclose(personal[2], -np.log(p[np.arange(len(p)), split["y_test"]]).sum(), rtol=1e-4)
        assert global_[1] == (test_logits.argmax(1) == split["y_test"]).sum()
    if val_fraction:  # the search is per client: here not every client settles on the same pair
        assert len(chosen) > 1


# ------------------------------------------------------------------------------------------- bytes
D = 64 * 16 + 16 + 16 * 10 + 10  # SHARDS' MLP on 8×8 digits
HEAD_FLOATS = 16 * 10 + 10  # its last Linear


@pytest.mark.parametrize("algorithm, train_floats, eval_floats", [
    ("perfedavg", 2 * D, D), ("knnper", 2 * D, D), ("fedrep", 2 * (D - HEAD_FLOATS), D - HEAD_FLOATS)])
def test_each_client_round_moves_exactly_the_declared_floats(run_algo, algorithm, train_floats, eval_floats):
    """Per-FedAvg and kNN-Per: FedAvg's 2·d·4 bytes per client and round; FedRep: the body only, 2·|φ|·4."""
    res = run_algo(algorithm, {"clients_per_round": 3, "data": {"unseen_fraction": 0.34}})
    ledger = res.table("ledger")
    for stage, floats, count in ((0, train_floats, 4 * 3), (1, eval_floats, 2 * 6)):  # 4 rounds × 3; 2 evals × 6
        mask = ledger["stage"] == stage
        keys, per = np.unique(np.stack([ledger["round"][mask], ledger["client"][mask]], 1), axis=0,
                              return_inverse=True)
        assert len(keys) == count
        assert np.all(np.bincount(per.ravel(), weights=ledger["bytes"][mask]) == 4 * floats)
    ev = res.table("eval")
    for group in ("seen", "unseen"):
        assert 0 <= ev[f"personal.{group}.acc_pooled"][-1] <= 1


PEFLL_CONFIGS = sorted([*(REPO / "configs").glob("pefll_*.yaml"), *(REPO / "configs" / "papers").glob("pefll_*.yaml")])


@pytest.mark.parametrize("path", PEFLL_CONFIGS, ids=lambda p: p.stem)
def test_every_pefll_config_runs_each_baseline_with_its_bytes(path: Path):
    """``--set algorithm=perfedavg|fedrep|knnper`` on every PeFLL config: its section is taken, and a client's
    round moves 2·|θ| floats (Per-FedAvg, kNN-Per) or 2·|φ| (FedRep, θ without its last Linear)."""
    for algorithm in ("perfedavg", "fedrep", "knnper"):
        cfg = load_config(path, [f"algorithm={algorithm}"])
        shape = {"cifar10": (3, 32, 32), "cifar100": (3, 32, 32), "femnist": (1, 32, 32),
                 "fashion_mnist": (1, 28, 28), "digits": (1, 16, 16)}[cfg.data.dataset]
        classes = {"cifar100": 100, "femnist": 62}.get(cfg.data.dataset, 10)
        n = cfg.data.num_clients or 10
        layout = FederatedLayout(n, np.full(n, 64), np.zeros(n, dtype=bool), shape, classes, "classification",
                                 "float32", np.ones((n, classes), dtype=np.int64))
        ctx = RunContext(cfg, layout)
        numel = ctx.new_model().numel
        plan = get_algorithm(algorithm).server.protocol_type(ctx).train_plan(1)
        floats = sum(step.numel for step in plan if isinstance(step, Message))
        assert floats == 2 * (numel - (84 * classes + classes) if algorithm == "fedrep" else numel), algorithm
    opts = {a: load_config(path, [f"algorithm={a}"]).algorithm_options for a in ("perfedavg", "fedrep", "knnper")}
    assert (opts["perfedavg"].variant, opts["perfedavg"].epochs) == ("fo", 1)  # spec §4.2's settings
    assert (opts["fedrep"].head_epochs, opts["fedrep"].body_epochs, opts["fedrep"].new_head_epochs) == (5, 1, 20)
    assert (opts["knnper"].scale, opts["knnper"].k, len(opts["knnper"].weights)) == (100, (5, 10), 11)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_ONLY)])
def test_knn_probabilities_add_neighbours_in_a_fixed_order(device):
    """One neighbour per row and addition: on the CPU bitwise what one ``scatter_add_`` over all neighbours gives
    (its order), and on a GPU the same bits run after run (no two atomic adds meet in one cell); the weights
    sum to 1 per query. Few classes and many neighbours, so every class gathers many weights."""
    gen = torch.Generator().manual_seed(4)
    distances = torch.rand(300, 500, generator=gen, dtype=torch.float64).to(device)
    labels = torch.randint(0, 3, (500,), generator=gen).to(device)
    probabilities = knn_probabilities(distances, labels, 64, 0.05, 3)
    nearest, index = torch.topk(distances, 64, dim=1, largest=False)
    weights = torch.softmax(-nearest / 0.05, dim=1)
    if device == "cpu":
        at_once = torch.zeros(300, 3, dtype=torch.float64).scatter_add_(1, labels[index], weights)
        assert torch.equal(probabilities, at_once)
    else:
        assert torch.equal(probabilities, knn_probabilities(distances, labels, 64, 0.05, 3))
    np.testing.assert_allclose(probabilities.sum(1).cpu().numpy(), 1.0, rtol=1e-12)
