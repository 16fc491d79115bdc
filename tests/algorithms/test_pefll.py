"""PeFLL: the split VJP equals one joint autograd, the paper's byte count, descriptor analysis, rank invariance."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from torch import nn

from mpifl.algorithms.base import RunContext
from mpifl.algorithms.pefll import (
    MaskedLogits,
    PeFLLClient,
    PeFLLProtocol,
    PeFLLServer,
    descriptor_correlations,
    descriptor_rows,
)
from mpifl.comm.messages import Message
from mpifl.data import FederatedLayout, build_federated_dataset
from mpifl.models import FlatModel
from mpifl.registry import load_config, parse_config
from mpifl.schema import ConfigError
from tests.algorithms.conftest import hosting_all, walk
from tests.conftest import REPO, _merge, rank_dependent

PEFLL = {
    "algorithm": "pefll",
    "rounds": 3,
    "clients_per_round": 4,
    "seed": 5,
    "eval_every": 3,
    "data": {"dataset": "digits", "num_clients": 10, "partition": "classes", "classes_per_client": 2,
             "unseen_fraction": 0.2},
    "model": {"name": "cnn", "channels": [4], "fc_hidden": 16},
    "client": {"lr": 0.05, "steps": 4, "batch_size": 16, "momentum": 0.9, "weight_decay": 5e-5, "clip_norm": 50},
    "pefll": {"embed_channels": [4], "embed_hidden": [16], "embed_kernel": 3, "hyper_hidden": 24, "hyper_layers": 2},
}


def build(overrides: dict | None = None) -> tuple[RunContext, PeFLLServer, PeFLLClient]:
    """Both sides in one process, the client side hosting every client."""
    cfg = parse_config(_merge(PEFLL, overrides or {}))
    dataset = build_federated_dataset(cfg.data, cfg.seed)
    ctx = RunContext(cfg, dataset.layout)
    return ctx, PeFLLServer(ctx), PeFLLClient(ctx, hosting_all(dataset))


def evaluate_in_chunks(server, client, chunk: int, round_: int = 1) -> tuple[np.ndarray, dict[str, float]]:  # noqa: ANN001
    """The engine's evaluation walk, ``chunk`` clients at a time: every client's eval model and the
    server's evaluation scalars."""
    layout = server.ctx.layout
    protocol = server.protocol
    for ids in np.split(np.flatnonzero(layout.unseen), range(chunk, int(layout.unseen.sum()), chunk)):
        walk(server, client, protocol.newcomer_plan(), round_, ids, stage="newcomer")
    models = [walk(server, client, protocol.eval_plan(), round_, ids, stage="eval")["eval_model"]
              for ids in np.split(np.arange(layout.num_clients), range(chunk, layout.num_clients, chunk))]
    return np.concatenate(models), server.eval_metrics()


def split_round(overrides: dict) -> tuple[RunContext, PeFLLServer, np.ndarray, torch.Tensor, dict[str, np.ndarray]]:
    """One training round through the message flow; returns η before it and the mean Δη the server used."""
    ctx, server, client = build(overrides)
    start = server.joint.params.clone()
    used = []
    step = server.step
    server.step = lambda mean_delta: (used.append(mean_delta.clone()), step(mean_delta))  # type: ignore[method-assign]
    clients = np.array([0, 3, 4, 7])
    rows = walk(server, client, server.protocol.train_plan(1), 1, clients)
    return ctx, server, clients, start, {**rows, "mean_delta": used[0]}


@pytest.mark.parametrize("pefll", [{"embedding": "cnn", "standardize": True},
                                   {"embedding": "linear", "standardize": False},
                                   {"embedding": "cnn", "embed_labels": False, "standardize": True}])
def test_split_vjp_equals_joint_autograd_of_the_composite(pefll):
    """Server VJP through h + Δv down + client VJP through φ = ∂/∂(η_v, η_h) of (1/c) Σ_i ⟨h(v(B_i)), Δθ_i⟩."""
    ctx, server, clients, start, rows = split_round({"pefll": {**pefll, "clip_norm": None}})
    protocol = server.protocol
    joint = FlatModel(nn.ModuleDict({"embed": protocol.new_embedding(), "hyper": protocol.new_hypernetwork()}))
    joint.load(start)
    data = build_federated_dataset(ctx.cfg.data, ctx.cfg.seed).load_clients(clients)
    descriptors = []
    for c in clients:
        x, y = torch.from_numpy(data[c].x_train), torch.from_numpy(data[c].y_train)
        batch = descriptor_rows(ctx.cfg.seed, 1, int(c), len(y), ctx.options.descriptor_batch)
        descriptors.append(joint.module["embed"](x[batch], y[batch]).mean(0))
    v = torch.stack(descriptors)
    assert np.array_equal(v.detach().numpy(), rows["descriptor"])
    if ctx.options.standardize:  # the code's frozen scalars come from the first descriptor
        first = v[0].detach()
        assert (server.shift, server.scale) == (float(first.mean()), float(first.std()))
    theta = joint.module["hyper"]((v - server.shift) / server.scale)
    joint.compute_gradient((theta * torch.from_numpy(rows["delta"])).sum() / len(clients))
    split = protocol.embed_msg.numel
    assert torch.allclose(rows["mean_delta"][split:], joint.grads[split:], rtol=1e-4, atol=1e-7)  # η_h
    assert torch.allclose(rows["mean_delta"][:split], joint.grads[:split], rtol=1e-4, atol=1e-7)  # η_v
    assert joint.grads[:split].abs().sum() > 0 and joint.grads[split:].abs().sum() > 0


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_paper_update_is_decay_plus_mean_delta(clip):
    beta, lam_h, lam_v = 0.1, 0.2, 0.3
    _, server, _, start, rows = split_round({"pefll": {"optimizer": "paper", "clip_norm": clip, "beta": beta,
                                                       "lambda_h": lam_h, "lambda_v": lam_v}})
    split = server.split
    decay = torch.ones_like(start)
    decay[:split], decay[split:] = 1 - 2 * beta * lam_v, 1 - 2 * beta * lam_h
    step = server.joint.params - decay * start
    mean_delta = rows["mean_delta"]
    if clip is None:
        assert torch.allclose(step, mean_delta, rtol=0, atol=1e-6)
    else:  # the outer clip (the code's 50) scales mean Δη down to the clip norm
        assert mean_delta.norm() > 10 * clip
        assert torch.allclose(step, mean_delta * clip / mean_delta.norm(), rtol=0, atol=1e-6)


def test_adam_descends_the_pseudo_gradient():
    lr = 1e-2
    _, server, _, start, rows = split_round({"pefll": {"clip_norm": None, "lr": lr}})
    # Adam's first step on the pseudo-gradient g = −mean Δη is −lr·g/(|g| + ε): towards mean Δη
    mean_delta = rows["mean_delta"]
    expected = lr * mean_delta / (mean_delta.abs() + 1e-8)
    assert torch.allclose(server.joint.params - start, expected, rtol=1e-3, atol=1e-6)


def test_logical_bytes_are_the_papers_count(run_algo):
    res = run_algo("pefll", PEFLL)
    ctx, server, _ = build()
    p = server.protocol
    dim, d, e = p.embed_dim, p.model_numel, p.embed_msg.numel
    assert (dim, e) == (int(1 + 10 / 4), FlatModel(p.new_embedding()).numel)
    ledger = res.table("ledger")
    per = {}
    for stage in (0, 1):  # train, eval
        mask = ledger["stage"] == stage
        keys = np.stack([ledger["round"][mask], ledger["client"][mask]], 1)
        uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
        per[stage] = (uniq, np.bincount(inverse.ravel(), weights=ledger["bytes"][mask]))
    uniq, total = per[0]
    assert len(uniq) == PEFLL["rounds"] * PEFLL["clients_per_round"]
    assert not ctx.layout.unseen[uniq[:, 1]].any()  # unseen clients never train
    assert np.all(total == 4 * (e + dim + d + d + dim + e))  # |η_v| + |v| + |θ| + |θ| + |v| + |η_v| floats
    uniq, total = per[1]
    assert sorted(uniq[:, 1]) == list(range(10))  # PeFLL-predict for every client, unseen ones included
    assert np.all(total == 4 * (e + d + dim))  # Alg. 1: |η_v| + |θ| down, |v| up
    directions = dict(zip(res.table_attrs["ledger"]["message_names"], res.table_attrs["ledger"]["directions"]))
    assert directions == {"embed_net": "down", "descriptor": "up", "model": "down", "delta": "up",
                          "descriptor_grad": "down", "embed_grad": "up", "eval_embed_net": "down",
                          "eval_descriptor": "up", "eval_model": "down"}
    ev = res.table("eval")
    for group in ("seen", "unseen"):
        assert 0 <= ev[f"personal.{group}.acc_pooled"][-1] <= 1
        assert -1 <= ev[f"descriptor_spearman_{group}"][-1] <= 1


def test_descriptor_correlation_is_the_mean_spearman_over_unseen_clients():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 20, size=(12, 4))
    descriptors = rng.normal(size=(12, 3))
    unseen = np.arange(12) >= 9
    got = descriptor_correlations(descriptors, counts, unseen)
    pi = counts / counts.sum(1, keepdims=True)
    expected = []
    for i in np.flatnonzero(unseen):
        others = np.arange(12) != i
        expected.append(spearmanr(np.linalg.norm(descriptors[others] - descriptors[i], axis=1),
                                  np.linalg.norm(pi[others] - pi[i], axis=1)).statistic)
    assert np.isclose(got["descriptor_spearman_unseen"], np.mean(expected))
    # descriptors that are the class proportions themselves rank perfectly
    assert np.isclose(descriptor_correlations(pi, counts, unseen)["descriptor_spearman_unseen"], 1.0)


def test_label_masking_zeroes_absent_logits():
    out = MaskedLogits(nn.Identity(), torch.tensor([1.0, 0.0, 1.0]))(torch.tensor([[2.0, 5.0, -1.0]]))
    assert torch.equal(out, torch.tensor([[2.0, 0.0, -1.0]]))


def test_linear_embedding_needs_labels():
    with pytest.raises(ConfigError, match="pefll.embed_labels"):
        parse_config(_merge(PEFLL, {"pefll": {"embedding": "linear", "embed_labels": False}}))


def assert_identical_results(path: Path, other: Path) -> None:
    """The final server state, every evaluation row, per-client metrics and the ledger, bit for bit; the
    ledger's rows in (round, stage, message, client) order (a chunked evaluation records them chunk by chunk)."""
    with h5py.File(path) as one, h5py.File(other) as two:
        for table in ("model", "eval", "clients", "ledger"):
            assert set(one[table]) == set(two[table])
            order = [np.lexsort([f["ledger"][k][()] for k in ("client", "message", "stage", "round")])
                     if table == "ledger" else slice(None) for f in (one, two)]
            for key in one[table]:
                if not rank_dependent(key):
                    a, b = one[table][key][()][order[0]], two[table][key][()][order[1]]
                    assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{table}/{key}"


def test_one_and_three_ranks_give_identical_results(run_algo, tmp_path):
    run_algo("pefll", PEFLL)
    assert run_algo("pefll", PEFLL, ranks=3).attrs["world_size"] == 3
    assert_identical_results(tmp_path / "pefll_p0.h5", tmp_path / "pefll_p3.h5")


@pytest.mark.parametrize("chunk", [1, 3])
def test_each_chunk_gets_the_models_of_one_pass(chunk):
    """h runs one descriptor at a time, so a chunk's models are bitwise those of an evaluation of all
    clients at once (a batched GEMM's rounding depends on the batch size); the correlation is the same."""
    overrides = {"data": {"unseen_fraction": 0.5}, "pefll": {"hyper_hidden": 100}}
    models, scalars = evaluate_in_chunks(*build(overrides)[1:], chunk)
    whole, whole_scalars = evaluate_in_chunks(*build(overrides)[1:], 10)
    assert np.array_equal(models, whole) and scalars == whole_scalars
    assert set(scalars) == {"descriptor_spearman_seen", "descriptor_spearman_unseen"}


def test_chunked_evaluation_gives_identical_results(run_algo, tmp_path):
    """Chunks of 3 of 10 clients (5 unseen): each chunk gets only its own models, and the descriptor rank
    correlation, gathered over the chunks, is the one over all clients, at every evaluation."""
    config = _merge(PEFLL, {"eval_every": 1, "data": {"unseen_fraction": 0.5}})
    whole = run_algo("pefll", config, tag="_whole")
    run_algo("pefll", {**config, "eval_chunk": 3}, tag="_chunked")
    assert np.isfinite(whole.table("eval")["descriptor_spearman_unseen"]).all()
    assert_identical_results(tmp_path / "pefll_whole_p0.h5", tmp_path / "pefll_chunked_p0.h5")


@pytest.mark.parametrize("config, clients, shape, classes, floats", [
    ("pefll_cifar10_100", 100, (3, 32, 32), 10, 495_500),
    ("pefll_cifar100_1000", 1000, (3, 32, 32), 100, 308_868),
    ("pefll_femnist", 3597, (1, 32, 32), 62, 693_068),
])
def test_paper_configs_send_the_specs_per_client_floats(config, clients, shape, classes, floats):
    """Spec §7.1's table: 2(|θ| + |η_v| + l) floats per client and round for the paper's architectures."""
    cfg = load_config(REPO / "configs" / "papers" / f"{config}.yaml")
    layout = FederatedLayout(clients, np.ones(clients, dtype=np.int64), np.zeros(clients, dtype=bool), shape,
                             classes, "classification", "float32", np.ones((clients, classes), dtype=np.int64))
    plan = PeFLLProtocol(RunContext(cfg, layout)).train_plan(1)
    assert sum(step.numel for step in plan if isinstance(step, Message)) == floats
