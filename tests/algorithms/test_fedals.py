"""FedALS: schedule, exact bytes (paper Table 2), reduction to FedAvg/SCAFFOLD at α = 1, rank invariance."""

import math

import numpy as np
import pytest
import torch

from mpifl.algorithms.base import RunContext, StepContext
from mpifl.algorithms.fedals import FedALSOptions, FedALSProtocol, round_lr
from mpifl.algorithms.state import ClientState
from mpifl.comm import Message
from mpifl.config import RunConfig
from mpifl.data import FederatedLayout
from mpifl.models.config import ModelConfig
from mpifl.models.flat import layer_groups
from mpifl.report import logical_totals
from mpifl.schema import ConfigError
from tests.algorithms.conftest import SHARDS, _merge, assert_rank_invariant, both_sides, walk
from tests.algorithms.test_references import RIDGE, data
from tests.conftest import CUDA_ONLY


def resnet20_context(options: FedALSOptions) -> RunContext:
    """CIFAR-10's shapes (3×32×32, 10 classes) with the authors' ResNet-20 (BatchNorm) — no data needed."""
    n = 5
    layout = FederatedLayout(n, np.full(n, 10_000), np.zeros(n, dtype=bool), (3, 32, 32), 10, "classification",
                             "float32", np.zeros((n, 10), dtype=np.int64))
    cfg = RunConfig(algorithm="fedals", model=ModelConfig(name="resnet20", batch_norm=True), algorithm_options=options)
    return RunContext(cfg, layout)


def test_resnet20_layer_groups_follow_the_authors_code():
    protocol = FedALSProtocol(resnet20_context(FedALSOptions()))
    sizes = [g.stop - g.start for g in protocol.groups]
    assert len(sizes) == 20 and sum(sizes) == 292_954
    assert sizes[:2] == [464, 2_336] and sizes[8] == 13_952 and sizes[14] == 55_552 and sizes[-1] == 650
    assert np.cumsum(sizes)[15] == 181_328  # Table 3's L = 16
    head, = (p for p in protocol.parts if p.name == "head")
    assert head.numel == 650 and head.groups == (19,)  # default L = 19: every convolution is φ


@pytest.mark.parametrize(("alpha", "table2"), [(1, 2.344), (5, 0.473), (10, 0.239), (25, 0.099), (50, 0.052),
                                               (100, 0.029)])
def test_table2_communicated_parameters_for_resnet20(alpha, table2):
    """T = 20,000 local steps at τ = 5, up and down: 2·[(T/τ)·P_h + (T/(ατ))·P_φ] parameters per client."""
    protocol = FedALSProtocol(resnet20_context(FedALSOptions(alpha=alpha, tau=5)))
    rounds = 20_000 // 5
    params = sum(m.numel for r in range(1, rounds + 1) for m in protocol.train_plan(r)
                 if isinstance(m, Message) and m.logical)
    assert params == 2 * (rounds * 650 + rounds // alpha * 292_304)
    assert round(params / 1e9, 3) == table2


def test_alpha_one_is_fedavg_bitwise(run_algo):
    """α = 1 with FedAvg's fresh momentum per round is FedAvg with τ steps, element for element."""
    fedavg = run_algo("fedavg")
    fedals = run_algo("fedals", {"fedals": {"alpha": 1, "tau": SHARDS["client"]["steps"],
                                            "persistent_momentum": False}})
    assert np.array_equal(fedals.table("model")["global_model"], fedavg.table("model")["global_model"])
    for key in ("global.seen.loss", "global.seen.acc_pooled"):
        assert np.array_equal(fedals.table("eval")[key], fedavg.table("eval")[key])
    totals, reference = logical_totals(fedals)["train"], logical_totals(fedavg)["train"]
    for direction in ("up", "down"):
        assert sum(totals[direction].values()) == sum(reference[direction].values())


def test_scaffold_variant_at_alpha_one_is_scaffold_bitwise(run_algo):
    scaffold = run_algo("scaffold")
    fedals = run_algo("fedals", {"fedals": {"alpha": 1, "tau": 4, "scaffold": True, "persistent_momentum": False}})
    assert np.array_equal(fedals.table("model")["global_model"], scaffold.table("model")["global_model"])


@pytest.mark.parametrize("scaffold", [False, True])
def test_ledger_counts_head_and_extractor_at_their_own_frequency(run_algo, scaffold):
    rounds, alpha, clients = 6, 3, SHARDS["clients_per_round"]
    res = run_algo("fedals", {"rounds": rounds, "fedals": {"alpha": alpha, "scaffold": scaffold}})
    p = res.table("model")["global_model"].size
    p_head = 16 * 10 + 10  # the MLP's output layer; L defaults to all groups but the last
    p_ext = p - p_head
    totals = logical_totals(res)["train"]
    copies = 2 if scaffold else 1  # SCAFFOLD's control variates travel with the parameters
    for direction, suffix in (("down", ""), ("up", "_delta")):
        assert totals[direction]["head" + suffix] == 4 * clients * rounds * p_head
        assert totals[direction]["extractor" + suffix] == 4 * clients * rounds // alpha * p_ext
        assert sum(totals[direction].values()) == copies * 4 * clients * (rounds * p_head + rounds // alpha * p_ext)
    # per-layer consensus distance: head every round, extractor only when it syncs
    metrics = res.table("rounds")
    assert np.all(np.isfinite(metrics["consensus_layer02"]))
    assert np.array_equal(np.isfinite(metrics["consensus_layer01"]), np.arange(1, rounds + 1) % alpha == 0)


def test_split_layer_beyond_the_model_is_a_config_error():
    with pytest.raises(ConfigError, match="split_layer"):
        FedALSProtocol(resnet20_context(FedALSOptions(split_layer=21)))


def test_mlp_groups_are_its_linear_layers(run_algo):
    from mpifl.models import FlatModel, build_model

    model = FlatModel(build_model(ModelConfig(name="mlp", hidden=(8, 4)), resnet20_context(FedALSOptions()).layout, 0))
    assert [g.stop - g.start for g in layer_groups(model)] == [3072 * 8 + 8, 8 * 4 + 4, 4 * 10 + 10]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_ONLY)])
def test_client_state_stays_where_the_clients_train_within_its_budget(device, monkeypatch):
    """Each vector of a trained client's state (model, reference, momentum, SCAFFOLD's variates) is a tensor of the
    training device after its rounds where the device budget keeps it there (``state_device_gb``; on the CPU, where
    the host is the device, raised here as a GPU's), so no round moves a client's model between host and device, and
    a host array with a budget of 0; the step counts are always on the host. The same bits either way: the server,
    every upload (the evaluation's φ too) and the states. Partial participation, both parts synced."""
    config = _merge(SHARDS, {"algorithm": "fedals", "fedals": {"alpha": 2, "scaffold": True}})
    cohorts = [np.array(c) for c in ([0, 1, 2, 3], [2, 3, 4, 5], [0, 1, 4, 5], [0, 2, 3, 5])]
    runs = []
    for budget in (0.0, math.inf):
        if device == "cpu":
            monkeypatch.setattr(ClientState, "_device_budget", lambda self, where, budget=budget: budget)
        _, server, client = both_sides(config, device, ClientState(device_budget_bytes=budget))
        sent = [walk(server, client, server.protocol.train_plan(r), r, c) for r, c in enumerate(cohorts, 1)]
        sent.append(walk(server, client, server.protocol.eval_prelude(), 4, np.arange(6), stage="eval_prelude"))
        for c in range(6):
            kept = client.state.read(c)
            assert isinstance(kept["steps"], np.ndarray)
            for name in ("model", "reference", "momentum", "control", "global_control", "gradient_sum"):
                assert isinstance(kept[name], torch.Tensor if budget else np.ndarray), (c, name)
                assert not budget or kept[name].device.type == device
        runs.append([server.params, server.control, *(rows for seen in sent for rows in seen.values()),
                     *(array for state in client.state.export_states().values() for array in state.values())])
    assert [a.tobytes() for a in runs[0]] == [a.tobytes() for a in runs[1]]


def test_results_do_not_depend_on_the_rank_count(run_algo, tmp_path):
    """Clients keep model, momentum and control variates on their owner rank; partial participation."""
    assert_rank_invariant(run_algo, tmp_path, "fedals", {"clients_per_round": 4, "fedals": {"alpha": 2,
                                                                                           "scaffold": True}})


def test_authors_lr_decay():
    """lr_decay: authors is lr·10/(s/100 + 10) at the round's first local step s = (r − 1)·τ."""
    opts = FedALSOptions(tau=5, lr_decay="authors")
    assert round_lr(0.02, opts, 1) == 0.02
    assert round_lr(0.02, opts, 201) == pytest.approx(0.02 * 10 / 20)  # s = 1,000
    assert round_lr(0.02, FedALSOptions(tau=5), 201) == 0.02


def mlp_grad(theta: np.ndarray, x: np.ndarray, y: np.ndarray, hidden: int, weight_decay: float) -> np.ndarray:
    """∇ of mean((W₂·relu(W₁x + b₁) + b₂ − y)²) + (wd/2)‖θ‖², θ = (W₁, b₁, W₂, b₂) flat, by hand."""
    f = x.shape[1]
    w1, b1 = theta[: hidden * f].reshape(hidden, f), theta[hidden * f : hidden * f + hidden]
    w2, b2 = theta[hidden * f + hidden : -1], theta[-1]
    pre = x @ w1.T + b1
    h = np.maximum(pre, 0)
    r = 2 * (h @ w2 + b2 - y) / len(y)
    dpre = np.outer(r, w2) * (pre > 0)
    return np.concatenate([(dpre.T @ x).ravel(), dpre.sum(0), h.T @ r, [r.sum()]]) + weight_decay * theta


@pytest.mark.parametrize(("scaffold", "lr_decay", "weighting"), [(False, "none", "samples"), (True, "none", "samples"),
                                                                   (True, "authors", "samples"),
                                                                   (True, "none", "uniform")])
def test_schedule_and_control_variates_against_a_lockstep_simulation(scaffold, lr_decay, weighting):
    """The paper's clean schedule (spec §1.3), simulated independently in numpy: 4 clients in lock step, τ = 3
    momentum-SGD steps per round (buffers never reset), the head h averaged (nₖ/n) after every round, the
    extractor φ after every α = 2 rounds; with SCAFFOLD (Alg. 4) each step descends g − cₖ + c and at a
    part's sync cₖ⁺ is the mean gradient since the part's last sync, c the population mean. Checked: the
    server's model after each round, and the evaluated model of round 3 (φ not synced: the virtual average).
    With the authors' decay the rate of round r is lr·10/((r − 1)τ/100 + 10); cₖ⁺ does not depend on it.
    Under ``server.weighting: uniform`` every share (the syncs, c, the virtual average) is 1/4 instead."""
    hidden, lr, mu, wd, tau, alpha = 4, 0.05, 0.9, 1e-3, 3, 2
    cfg = _merge(RIDGE, {"algorithm": "fedals", "clients_per_round": 4, "model": {"name": "mlp", "hidden": [hidden]},
                         "client": {"lr": lr, "momentum": mu, "weight_decay": wd},
                         "fedals": {"alpha": alpha, "tau": tau, "scaffold": scaffold, "lr_decay": lr_decay},
                         "server": {"weighting": weighting}})
    _, server, client = both_sides(cfg)
    xys, clients = data(cfg), np.arange(4)
    share = np.array([len(xys[k][1]) for k in clients], dtype=np.float64)
    assert len(set(share)) > 1  # unequal clients: the two weightings differ
    share = np.full(4, 0.25) if weighting == "uniform" else share / share.sum()
    head = server.protocol.parts[1].span
    extractor = server.protocol.extractor.span
    theta = np.tile(server.params.astype(np.float64), (4, 1))
    buf, ck, c, sums, steps = (np.zeros_like(theta), np.zeros_like(theta), np.zeros(theta.shape[1]),
                               np.zeros_like(theta), {"h": 0, "phi": 0})
    for round_ in range(1, 5):
        walk(server, client, server.protocol.train_plan(round_), round_, clients)
        rate = lr * 10 / ((round_ - 1) * tau / 100 + 10) if lr_decay == "authors" else lr
        for _ in range(tau):
            for k in clients:
                g = mlp_grad(theta[k], *xys[k], hidden, wd)
                sums[k] += g
                if scaffold:
                    g = g - ck[k] + c
                buf[k] = mu * buf[k] + g
                theta[k] -= rate * buf[k]
        steps = {"h": steps["h"] + tau, "phi": steps["phi"] + tau}
        synced = [(head, "h")] + ([(extractor, "phi")] if round_ % alpha == 0 else [])
        for span, part in synced:
            if scaffold:
                new = sums[:, span] / steps[part]
                c[span] += share @ (new - ck[:, span])
                ck[:, span] = new
                sums[:, span] = 0
            theta[:, span] = share @ theta[:, span]
            steps[part] = 0
        np.testing.assert_allclose(server.params[head], theta[0, head], rtol=1e-4, atol=1e-6)
        if round_ % alpha == 0:
            np.testing.assert_allclose(server.params, theta[0], rtol=1e-4, atol=1e-6)
            if scaffold:
                np.testing.assert_allclose(server.control, c, rtol=1e-4, atol=1e-6)
        if round_ == 3:  # φ differs per client: the evaluated model takes their weighted average
            walk(server, client, server.protocol.eval_prelude(), round_, clients, stage="eval_prelude")
            evaluated = server.payload(server.protocol.eval_msg, StepContext(round_, "eval", clients))
            np.testing.assert_allclose(evaluated[extractor], share @ theta[:, extractor], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(evaluated[head], theta[0, head], rtol=1e-4, atol=1e-6)
            server.end_evaluation()
