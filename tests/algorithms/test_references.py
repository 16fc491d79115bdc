"""Every algorithm's client step and server step against an independent computation.

The problem is least squares: each client i of a small synthetic ridge task holds (Xᵢ, yᵢ) and a linear
model θ = (w, b) with loss fᵢ(θ) = mean((Xᵢw + b − yᵢ)²), whose gradient has the closed form
(2/nᵢ)·[Xᵢᵀr, Σr] with r = Xᵢw + b − yᵢ. Batches hold a client's whole training split, so every local
step is a full gradient step and the reference below needs no random numbers: it is plain numpy in
float64, written from each paper's update rule and never calling mpifl's training code. mpifl computes in
float32 (and sums a batch in a permuted order), hence the tolerances.

In the style of pfl-research's tests/algorithm/test_scaffold.py: each half of an algorithm is checked on
its own (the rows a client sends; the state the server reaches), plus a few properties that only hold if
the whole algorithm is right (SCAFFOLD's control variates converge to the clients' gradients at the optimum).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpifl.data import build_federated_dataset
from mpifl.registry import parse_config
from mpifl.results import read_results
from mpifl.state_io import read_client_states
from tests.algorithms.conftest import both_sides, walk
from tests.conftest import _merge, run_engine

RIDGE = {
    "rounds": 1,
    "clients_per_round": 3,
    "seed": 4,
    "eval_every": 1,
    "data": {"dataset": "karula_ridge", "partition": "natural", "num_clients": 4,
             "synthetic": {"num_features": 3, "ridge_min_samples": 6, "ridge_max_samples": 12}},
    "model": {"name": "linear"},
    "client": {"lr": 0.05, "steps": 3, "batch_size": 64},
}
SAMPLED = np.array([0, 2, 3])
TOL = {"rtol": 1e-4, "atol": 1e-6}


def config(algorithm: str, **overrides) -> dict:  # noqa: ANN003
    return _merge(RIDGE, {"algorithm": algorithm, **overrides})


def data(cfg: dict) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    parsed = parse_config(cfg)
    dataset = build_federated_dataset(parsed.data, parsed.seed)
    splits = dataset.load_clients(range(dataset.layout.num_clients))
    return {c: (s.x_train.astype(np.float64), s.y_train.astype(np.float64)) for c, s in splits.items()}


def grad(theta: np.ndarray, xy: tuple[np.ndarray, np.ndarray], weight_decay: float = 0.0) -> np.ndarray:
    """∇ of mean((Xw + b − y)²) + (wd/2)‖θ‖² at θ = (w, b)."""
    x, y = xy
    r = x @ theta[:-1] + theta[-1] - y
    return 2 / len(y) * np.append(x.T @ r, r.sum()) + weight_decay * theta


def sgd(theta: np.ndarray, xy, steps: int, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,  # noqa: ANN001
        extra=None) -> tuple[np.ndarray, list[np.ndarray]]:  # noqa: ANN001
    """``steps`` full-batch steps of torch.optim.SGD's rule; ``extra(θ)`` is added to each gradient after it
    is recorded. Returns the final θ and the recorded gradients of the local objective."""
    theta, buf, seen = theta.astype(np.float64).copy(), np.zeros(len(theta)), []
    for _ in range(steps):
        g = grad(theta, xy, weight_decay)
        seen.append(g)
        if extra is not None:
            g = g + extra(theta)
        buf = momentum * buf + g
        theta = theta - lr * buf
    return theta, seen


def weights(xys: dict, clients) -> np.ndarray:  # noqa: ANN001
    n = np.array([len(xys[c][1]) for c in clients], dtype=np.float64)
    return n / n.sum()


# ------------------------------------------------------------------------------------------- FedAvg
@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 1e-2)])
def test_fedavg_client_steps_and_weighted_server_average(momentum, weight_decay):
    cfg = config("fedavg", client={"momentum": momentum, "weight_decay": weight_decay},
                 server={"lr": 0.7, "momentum": 0.5})
    ctx, server, client = both_sides(cfg)
    xys, x0 = data(cfg), server.params.astype(np.float64)
    rows = walk(server, client, server.protocol.train_plan(1), 1, SAMPLED)
    deltas = [sgd(x0, xys[c], 3, 0.05, momentum, weight_decay)[0] - x0 for c in SAMPLED]
    np.testing.assert_allclose(rows["delta"], deltas, **TOL)
    velocity = weights(xys, SAMPLED) @ np.array(deltas)  # v = 0.5·0 + Σ (nᵢ/n)Δᵢ;  x = x + 0.7·v
    np.testing.assert_allclose(server.params, x0 + 0.7 * velocity, **TOL)
    x1 = server.params.astype(np.float64)
    walk(server, client, server.protocol.train_plan(2), 2, SAMPLED[:2])
    deltas = [sgd(x1, xys[c], 3, 0.05, momentum, weight_decay)[0] - x1 for c in SAMPLED[:2]]
    velocity = 0.5 * velocity + weights(xys, SAMPLED[:2]) @ np.array(deltas)
    np.testing.assert_allclose(server.params, x1 + 0.7 * velocity, **TOL)


def test_fedprox_adds_the_proximal_gradient():
    cfg = config("fedprox", fedprox={"mu": 2.0}, client={"momentum": 0.5})
    _, server, client = both_sides(cfg)
    xys, x0 = data(cfg), server.params.astype(np.float64)
    rows = walk(server, client, server.protocol.train_plan(1), 1, SAMPLED)
    expected = [sgd(x0, xys[c], 3, 0.05, 0.5, extra=lambda t: 2.0 * (t - x0))[0] - x0 for c in SAMPLED]
    np.testing.assert_allclose(rows["delta"], expected, **TOL)


def test_fedsgd_steps_on_the_weighted_full_gradient():
    cfg = config("fedsgd", client={"weight_decay": 1e-2})
    _, server, client = both_sides(cfg)
    xys, x0 = data(cfg), server.params.astype(np.float64)
    rows = walk(server, client, server.protocol.train_plan(1), 1, SAMPLED)
    grads = np.array([grad(x0, xys[c], 1e-2) for c in SAMPLED])
    np.testing.assert_allclose(rows["gradient"], grads, **TOL)
    np.testing.assert_allclose(server.params, x0 - 0.05 * weights(xys, SAMPLED) @ grads, **TOL)


# ------------------------------------------------------------------------------------------- SCAFFOLD
def scaffold_client(x, c, ci, xy, steps, lr, momentum=0.0, weight_decay=0.0):  # noqa: ANN001, ANN201
    """Karimireddy et al. Alg. 1 with option II read as the mean local gradient."""
    y, grads = sgd(x, xy, steps, lr, momentum, weight_decay, extra=lambda _: c - ci)
    return y, np.mean(grads, axis=0)


def test_scaffold_option_ii_is_the_mean_local_gradient_under_plain_sgd():
    """cᵢ⁺ = cᵢ − c + (x − yᵢ)/(Kη) (the paper's formula) equals (1/K)Σₖ gₖ when the steps are plain SGD."""
    cfg = config("scaffold")
    _, server, client = both_sides(cfg)
    xys = data(cfg)
    for round_ in (1, 2):  # round 2 starts from nonzero c and cᵢ
        x, c = server.params.astype(np.float64), server.control.astype(np.float64)
        own = {i: client.own_control(i).numpy().astype(np.float64) for i in SAMPLED}
        rows = walk(server, client, server.protocol.train_plan(round_), round_, SAMPLED)
        for k, i in enumerate(SAMPLED):
            y, mean_grad = scaffold_client(x, c, own[i], xys[i], 3, 0.05)
            option_ii = own[i] - c + (x - y) / (3 * 0.05)
            np.testing.assert_allclose(option_ii, mean_grad, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(rows["delta"][k], y - x, **TOL)
            np.testing.assert_allclose(rows["control_delta"][k], mean_grad - own[i], **TOL)
        # the server: x ← x + Σ (nᵢ/n_S)Δyᵢ, c ← c + Σ (nᵢ/n_all)Δcᵢ over every seen client's share
        population = np.array([len(xys[i][1]) for i in SAMPLED]) / sum(len(v[1]) for v in xys.values())
        np.testing.assert_allclose(server.control, c + population @ rows["control_delta"], **TOL)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_scaffold_client_under_momentum_and_weight_decay(momentum):
    cfg = config("scaffold", client={"momentum": momentum, "weight_decay": 1e-2})
    _, server, client = both_sides(cfg)
    xys = data(cfg)
    walk(server, client, server.protocol.train_plan(1), 1, SAMPLED)  # nonzero c, cᵢ from here on
    x, c = server.params.astype(np.float64), server.control.astype(np.float64)
    own = {i: client.own_control(i).numpy().astype(np.float64) for i in SAMPLED}
    rows = walk(server, client, server.protocol.train_plan(2), 2, SAMPLED)
    for k, i in enumerate(SAMPLED):
        y, mean_grad = scaffold_client(x, c, own[i], xys[i], 3, 0.05, momentum, 1e-2)
        np.testing.assert_allclose(rows["delta"][k], y - x, **TOL)
        np.testing.assert_allclose(client.own_control(i).numpy(), mean_grad, **TOL)


def pooled_optimum(xys: dict, weight_decay: float = 0.0) -> np.ndarray:
    """argmin Σᵢ (nᵢ/n)·fᵢ(θ) + (wd/2)‖θ‖²: least squares on the pooled data (a ridge term if wd > 0)."""
    a = np.vstack([np.hstack([x, np.ones((len(x), 1))]) for x, _ in xys.values()])
    b = np.concatenate([y for _, y in xys.values()])
    return np.linalg.solve(2 * a.T @ a / len(b) + weight_decay * np.eye(a.shape[1]), 2 * a.T @ b / len(b))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_scaffold_controls_reach_the_clients_gradients_at_the_optimum(momentum, tmp_path):
    """On heterogeneous quadratics with full participation, x → x* and cᵢ → ∇fᵢ(x*) (so c → 0): the drift
    correction is exact at the fixed point. This fails with the printed option II under momentum (cᵢ
    grows by 1/(1 − β) each round and the run diverges)."""
    cfg = config("scaffold", rounds=150, eval_every=150, checkpoint_every=150, clients_per_round=4,
                 client={"momentum": momentum, "lr": 0.02, "steps": 5})
    path = run_engine(cfg, MPI.COMM_SELF, tmp_path / "s.h5")
    final = read_results(path).table("model")
    xys = data(cfg)
    optimum = pooled_optimum(xys)
    np.testing.assert_allclose(final["global_model"], optimum, rtol=1e-3, atol=1e-3)
    for i, state in client_states(path).items():
        np.testing.assert_allclose(state["control"], grad(optimum, xys[i]), rtol=1e-2, atol=2e-3)
    assert np.abs(final["control"]).max() < 2e-3


def test_scaffold_server_control_stays_the_population_mean_under_rejected_updates(tmp_path):
    """A client whose update is rejected keeps its old cᵢ, so c = Σᵢ (nᵢ/n)cᵢ after every round."""
    cfg = config("scaffold", rounds=6, eval_every=6, checkpoint_every=6, client={"momentum": 0.9},
                 faults={"corrupt": 0.3})
    path = run_engine(cfg, MPI.COMM_SELF, tmp_path / "s.h5")
    assert read_results(path).table("rounds")["rejected_updates"].sum() > 0
    assert_control_is_the_population_mean(path, data(cfg))


def client_states(path) -> dict[int, dict[str, np.ndarray]]:  # noqa: ANN001
    """Every client's state in a results file's last checkpoint."""
    return {c: s for worker in read_client_states(path).values() for c, s in worker.items()}


def assert_control_is_the_population_mean(path, xys: dict) -> None:  # noqa: ANN001
    share = weights(xys, sorted(xys))
    controls = client_states(path)
    expected = sum(share[i] * controls[i]["control"].astype(np.float64) for i in controls)
    np.testing.assert_allclose(read_results(path).table("model")["control"], expected, rtol=1e-5, atol=1e-7)


def test_scaffold_rejection_of_the_control_delta_alone_rolls_back_the_client(tmp_path, monkeypatch):
    """Δyᵢ finite but Δcᵢ broken: the client's update (its two uploads) is rejected as a whole, so neither
    reaches the server and cᵢ and c stay as they were, while every byte it sent is counted."""
    from mpifl.algorithms.scaffold import ScaffoldClient

    send = ScaffoldClient.send

    def broken_control(self, msg, step, client):  # noqa: ANN001, ANN202
        row = send(self, msg, step, client)
        return row * np.nan if msg.name == "control_delta" and client == 2 and step.round == 2 else row

    monkeypatch.setattr(ScaffoldClient, "send", broken_control)
    cfg = config("scaffold", rounds=2, eval_every=1, checkpoint_every=1, clients_per_round=4)
    one = run_engine({**cfg, "rounds": 1}, MPI.COMM_SELF, tmp_path / "one.h5")
    two = run_engine(cfg, MPI.COMM_SELF, tmp_path / "two.h5")
    res = read_results(two)
    assert res.table("rounds")["rejected_updates"].tolist() == [0, 1]
    ledger, names = res.table("ledger"), res.table_attrs["ledger"]["message_names"]
    sent = (ledger["round"] == 2) & (ledger["client"] == 2) & (ledger["stage"] == 0)
    assert sorted(names[m] for m in ledger["message"][sent]) == ["control", "control_delta", "delta", "model"]
    np.testing.assert_array_equal(client_states(two)[2]["control"], client_states(one)[2]["control"])
    assert not np.array_equal(client_states(two)[1]["control"], client_states(one)[1]["control"])
    assert_control_is_the_population_mean(two, data(cfg))


# ------------------------------------------------------------------------------------------- FedDeper
def test_feddeper_y_and_v_steps_and_mixing_by_formula():
    """y ← y − η·g(y) − ρ(v + y − 2x), v ← v − η·g(v) (both at the step's old values), then v ← (1 − λ)v + λy."""
    eta, rho, lam = 0.05, 0.03, 0.4
    cfg = config("feddeper", feddeper={"rho": rho, "mixing": lam})
    _, server, client = both_sides(cfg)
    xys = data(cfg)
    personal = {i: server.params.astype(np.float64) for i in xys}
    for round_ in (1, 2):  # round 2: v ≠ x, so the penalty acts from the first step
        x = server.params.astype(np.float64)
        rows = walk(server, client, server.protocol.train_plan(round_), round_, SAMPLED)
        for k, i in enumerate(SAMPLED):
            y, v = x.copy(), personal[i].copy()
            for _ in range(3):
                y, v = y - eta * grad(y, xys[i]) - rho * (v + y - 2 * x), v - eta * grad(v, xys[i])
            personal[i] = (1 - lam) * v + lam * y
            np.testing.assert_allclose(rows["delta"][k], y - x, **TOL)
            np.testing.assert_allclose(client.personal(i), personal[i], **TOL)
        np.testing.assert_allclose(server.params, x + weights(xys, SAMPLED) @ rows["delta"], **TOL)
    assert np.array_equal(client.personal(1), client.initial)  # never sampled: vᵢ is the initial model


# ------------------------------------------------------------------------------------------- pFedMe
@pytest.mark.parametrize("personalize", ["sampled", "all"])
def test_pfedme_moreau_steps_and_beta_average(personalize):
    """Per local step: K inner steps θ ← θ − p·(∇f(θ) + λ(θ − w)), then w ← w − ηλ(w − θ); the server moves
    x ← x + β·Σ(nᵢ/n_S)(wᵢ − x). With ``personalize: all`` every seen client updates θᵢ, only the sampled send."""
    lam, plr, inner, beta = 2.0, 0.02, 4, 0.6
    cfg = config("pfedme", server={"lr": beta},
                 pfedme={"lam": lam, "personal_lr": plr, "inner_steps": inner, "personalize": personalize})
    _, server, client = both_sides(cfg)
    xys, x = data(cfg), server.params.astype(np.float64)
    everyone = np.arange(4) if personalize == "all" else SAMPLED
    rows = walk(server, client, server.protocol.train_plan(1), 1, SAMPLED, everyone)
    deltas = {}
    for i in everyone:
        theta, w = x.copy(), x.copy()
        for _ in range(3):
            for _ in range(inner):
                theta = theta - plr * (grad(theta, xys[i]) + lam * (theta - w))
            w = w - 0.05 * lam * (w - theta)
        deltas[i] = w - x
        np.testing.assert_allclose(client.state.get(i, "personal"), theta, **TOL)
    np.testing.assert_allclose(rows["delta"], [deltas[i] for i in SAMPLED], **TOL)
    np.testing.assert_allclose(server.params, x + beta * weights(xys, SAMPLED) @ rows["delta"], **TOL)
    assert (client.state.get(1, "personal") is None) == (personalize == "sampled")


# ------------------------------------------------------------------------------------------- IFCA
def test_ifca_clients_join_their_best_cluster_and_clusters_average_their_members():
    cfg = config("ifca", ifca={"clusters": 3}, clients_per_round=4)
    _, server, client = both_sides(cfg)
    xys, models = data(cfg), server.params.astype(np.float64)
    rows = walk(server, client, server.protocol.train_plan(1), 1, np.arange(4))

    def loss(theta: np.ndarray, xy) -> float:  # noqa: ANN001
        return float(np.mean((xy[0] @ theta[:-1] + theta[-1] - xy[1]) ** 2))

    chosen = [int(np.argmin([loss(m, xys[i]) for m in models])) for i in range(4)]
    assert rows["cluster_id"][:, 0].tolist() == chosen
    deltas = [sgd(models[j], xys[i], 3, 0.05)[0] - models[j] for i, j in enumerate(chosen)]
    np.testing.assert_allclose(rows["delta"], deltas, **TOL)
    for j in range(3):
        members = [i for i in range(4) if chosen[i] == j]
        expected = models[j] + (weights(xys, members) @ np.array([deltas[i] for i in members]) if members else 0)
        np.testing.assert_allclose(server.params[j], expected, **TOL)


# ------------------------------------------------------------------------------------------- Local
def test_local_trains_each_clients_own_model_and_mode_all_trains_unseen_clients_first():
    cfg = config("local", data={"unseen_fraction": 0.25})
    _, server, client = both_sides(cfg)
    xys, x0 = data(cfg), client.initial.astype(np.float64)
    seen = np.array([0, 1, 2])
    walk(server, client, server.protocol.train_plan(1), 1, seen)
    walk(server, client, server.protocol.train_plan(2), 2, seen[:1])
    np.testing.assert_allclose(client.model(0), sgd(x0, xys[0], 6, 0.05)[0], **TOL)  # 3 + 3 steps
    np.testing.assert_allclose(client.model(1), sgd(x0, xys[1], 3, 0.05)[0], **TOL)
    assert np.array_equal(client.model(3), client.initial)  # unseen: never trained
    cfg = config("local", data={"unseen_fraction": 0.25}, local={"mode": "all", "epochs": 7})
    _, server, client = both_sides(cfg)
    assert server.protocol.train_plan(1) == ()
    walk(server, client, server.protocol.setup_plan(), 0, np.arange(4), stage="setup")  # every client, unseen too
    for i in range(4):  # one batch per epoch: 7 epochs = 7 full-batch steps
        np.testing.assert_allclose(client.model(i), sgd(x0, xys[i], 7, 0.05)[0], **TOL)


# ------------------------------------------------------------------------------------------- Karula
def test_karula_server_step_is_saga_then_projection():
    """Unconstrained (huge t): θ⁺ = θ − η·ν, ν = table + (n/s)(gₛ − tableₛ) with table rows αᵢ∇fᵢ/n, αᵢ = n·Nᵢ/ΣN."""
    cfg = config("karula", karula={"t": 1e9, "lr": 0.3, "reference_size": 5, "standardize": False},
                 client={"weight_decay": 0.0})
    ctx, server, client = both_sides(cfg)
    xys, n = data(cfg), 4
    alpha = n * weights(xys, range(n))
    walk(server, client, server.protocol.setup_plan(), 0, np.arange(n), stage="setup")
    theta = server.theta.copy()
    table = np.array([alpha[i] * grad(theta[i], xys[i]) / n for i in range(n)])
    np.testing.assert_allclose(server.table, table, **TOL)
    rows = walk(server, client, server.protocol.train_plan(1), 1, SAMPLED)
    np.testing.assert_allclose(rows["gradient"], [grad(theta[i].astype(np.float32), xys[i]) for i in SAMPLED],
                               **TOL)
    fresh = np.array([alpha[i] * grad(theta[i], xys[i]) / n for i in SAMPLED])
    direction = table.copy()
    direction[SAMPLED] += n / len(SAMPLED) * (fresh - table[SAMPLED])
    np.testing.assert_allclose(server.theta, theta - 0.3 * direction, **TOL)
