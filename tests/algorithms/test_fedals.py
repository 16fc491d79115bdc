"""FedALS: schedule, exact bytes (paper Table 2), reduction to FedAvg/SCAFFOLD at α = 1, rank invariance."""

import numpy as np
import pytest

from mpifl.algorithms.base import RunContext
from mpifl.algorithms.fedals import FedALSOptions, FedALSProtocol, layer_groups, round_lr
from mpifl.comm import Message
from mpifl.config import ModelConfig, RunConfig
from mpifl.data import FederatedLayout
from mpifl.report import logical_totals
from mpifl.schema import ConfigError
from tests.algorithms.conftest import SHARDS, assert_rank_invariant


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
    params = sum(m.numel for r in range(1, rounds + 1) for m in protocol.train_plan(r) if isinstance(m, Message))
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
    # the paper's FedALS keeps momentum across rounds, which makes it a different trajectory
    persistent = run_algo("fedals", {"fedals": {"alpha": 1, "tau": 4}}, tag="persistent")
    assert not np.array_equal(persistent.table("model")["global_model"], fedavg.table("model")["global_model"])


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


def test_lr_decay_changes_the_trajectory_only_after_round_one(run_algo):
    first = {"rounds": 1, "eval_every": 1}
    const = run_algo("fedals", {**first, "fedals": {"alpha": 2}}, tag="const")
    decay = run_algo("fedals", {**first, "fedals": {"alpha": 2, "lr_decay": "authors"}}, tag="decay")
    assert np.array_equal(const.table("model")["global_model"], decay.table("model")["global_model"])
    const = run_algo("fedals", {"fedals": {"alpha": 2}}, tag="const4")
    decay = run_algo("fedals", {"fedals": {"alpha": 2, "lr_decay": "authors"}}, tag="decay4")
    assert not np.array_equal(const.table("model")["global_model"], decay.table("model")["global_model"])
