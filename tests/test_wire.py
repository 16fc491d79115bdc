"""The wire format on real runs: every codec's bytes in the ledger are its formula, error feedback is client state,
differential privacy clips, noises and accounts, secure aggregation adds its own messages; bad settings are one
line. (Each piece on its own: tests/comm/; the same runs on 1-4 ranks: tests/mpi/test_rank_counts_mpi.py.)"""

import math

import numpy as np
import pytest

from mpifl.algorithms.base import RunContext
from mpifl.comm import Message
from mpifl.comm.codecs import index_width, sparse_k
from mpifl.comm.config import SecAggConfig
from mpifl.comm.secagg import secagg_messages
from mpifl.data import build_federated_dataset
from mpifl.registry import get_algorithm, parse_config
from mpifl.results import read_results
from mpifl.schema import ConfigError
from mpifl.state_io import read_client_states
from tests.algorithms.conftest import SHARDS
from tests.conftest import _merge, run_engine
from tests.test_checkpoint import CONFIGS

NUMEL = 64 * 16 + 16 + 16 * 10 + 10  # SHARDS' MLP on digits: 64-16-10
FORMULAS = {
    "fp16": 2 * NUMEL,
    "bf16": 2 * NUMEL,
    "qsgd": 4 + math.ceil(NUMEL * 4 / 8),  # bits: 4
    "topk": sparse_k(0.05, NUMEL) * (index_width(NUMEL) + 4),
    "randk": sparse_k(0.05, NUMEL) * (index_width(NUMEL) + 4),
    "sign": 4 + math.ceil(NUMEL / 8),
}


def run(tmp_path, extra: dict, name: str = "run.h5"):  # noqa: ANN201
    from mpi4py import MPI

    return read_results(run_engine(_merge(SHARDS, {"algorithm": "fedavg", **extra}), MPI.COMM_SELF, tmp_path / name))


def ledger_bytes(results, message: str, stage: int = 0) -> np.ndarray:  # noqa: ANN001
    """Each ledger row's bytes for ``message`` in ``stage`` (0: train)."""
    ledger = results.table("ledger")
    names = list(results.table_attrs["ledger"]["message_names"])
    rows = (ledger["message"] == names.index(message)) & (ledger["stage"] == stage)
    return ledger["bytes"][rows]


@pytest.mark.parametrize("codec", sorted(FORMULAS))
def test_every_client_upload_costs_its_codecs_formula(codec, tmp_path):
    results = run(tmp_path, {"compression": {"up": {"codec": codec, "bits": 4, "fraction": 0.05},
                                             "down": {"codec": "fp16"}}})
    delta, model = ledger_bytes(results, "delta"), ledger_bytes(results, "model")
    assert len(delta) == 4 * 6 and np.all(delta == FORMULAS[codec])
    assert np.all(model == 2 * NUMEL)
    rounds = results.table("rounds")
    assert np.all(rounds["logical_up_bytes"] == 6 * FORMULAS[codec])
    assert results.table("eval")["cum_logical_bytes"][-1] == 4 * 6 * (FORMULAS[codec] + 2 * NUMEL)


def test_compression_changes_the_model_and_no_compression_is_todays_run(tmp_path):
    plain = run(tmp_path, {}, "plain.h5").table("model")["global_model"]
    explicit = run(tmp_path, {"compression": {"up": {"codec": "none"}}}, "none.h5").table("model")["global_model"]
    topk = run(tmp_path, {"compression": {"up": {"codec": "topk", "fraction": 0.05}}}, "topk.h5")
    assert np.array_equal(plain, explicit)
    assert not np.array_equal(plain, topk.table("model")["global_model"])


def test_error_feedback_residual_is_each_clients_state(tmp_path):
    results_path = tmp_path / "ef.h5"
    from mpi4py import MPI

    cfg = _merge(SHARDS, {"algorithm": "fedavg", "checkpoint_every": 4,
                          "compression": {"up": {"codec": "topk", "fraction": 0.05, "error_feedback": True}}})
    run_engine(cfg, MPI.COMM_SELF, results_path)
    states = {c: s for worker in read_client_states(results_path).values() for c, s in worker.items()}
    residuals = {c: s["wire_residual:delta"] for c, s in states.items() if "wire_residual:delta" in s}
    assert sorted(residuals) == list(range(6))  # every client took part and keeps what top-k left out
    k = sparse_k(0.05, NUMEL)
    for residual in residuals.values():  # after sending the k largest, those k entries of the residual are zero
        assert residual.shape == (NUMEL,) and np.count_nonzero(residual) >= NUMEL - k - 1
        assert np.count_nonzero(residual) <= NUMEL - k


def test_local_dp_with_zero_noise_clips_every_update(tmp_path):
    """Uniform FedAvg with server lr 1: the global model moves by the mean of clipped deltas, so by ≤ clip."""
    results = run(tmp_path, {"rounds": 1, "eval_every": 1, "server": {"weighting": "uniform"},
                             "privacy": {"mode": "local", "clip": 0.01, "noise_multiplier": 0.0}}, "clip.h5")
    cfg = parse_config(_merge(SHARDS, {"algorithm": "fedavg"}))
    start = RunContext(cfg, build_federated_dataset(cfg.data, cfg.seed).layout).new_model().numpy()
    moved = np.linalg.norm(results.table("model")["global_model"].astype(np.float64) - start)
    assert 0 < moved <= 0.01 + 1e-6
    assert np.isinf(results.table("rounds")["epsilon"]).all()  # no noise: no privacy


def test_central_dp_reports_the_accountants_epsilon_every_round(tmp_path):
    import dp_accounting

    results = run(tmp_path, {"clients_per_round": 3, "server": {"weighting": "uniform"},
                             "privacy": {"mode": "central", "clip": 1.0, "noise_multiplier": 1.5,
                                         "delta": 1e-3, "sampling": "poisson"}})
    epsilon = results.table("rounds")["epsilon"]
    assert np.all(np.diff(epsilon) > 0)
    accountant = dp_accounting.rdp.RdpAccountant()  # add-or-remove-one: user-level DP-FedAvg's relation
    accountant.compose(dp_accounting.PoissonSampledDpEvent(3 / 6, dp_accounting.GaussianDpEvent(1.5)), 4)
    assert epsilon[-1] == pytest.approx(accountant.get_epsilon(1e-3), rel=1e-9)


def test_poisson_sampling_draws_cohorts_of_varying_size(tmp_path):
    results = run(tmp_path, {"rounds": 8, "eval_every": 8, "clients_per_round": 3, "server": {"weighting": "uniform"},
                             "privacy": {"mode": "central", "sampling": "poisson", "noise_multiplier": 1.0}})
    participants = results.table("rounds")["participants"]
    assert len(set(participants.tolist())) > 1 and participants.max() <= 6


def test_secure_aggregation_adds_its_messages_and_masks_the_update(tmp_path):
    results = run(tmp_path, {"secure_aggregation": "secagg_plus", "secagg": {"field_bits": 24}})
    assert np.all(ledger_bytes(results, "delta") == math.ceil(NUMEL * 24 / 8))
    expected = {m.name: m.nbytes for m in secagg_messages("secagg_plus", 6, NUMEL, SecAggConfig(field_bits=24))}
    for name, nbytes in expected.items():
        if name != "secagg_masked_input":
            assert np.all(ledger_bytes(results, name) == nbytes), name
            assert len(ledger_bytes(results, name)) == 4 * 6
    plain = run(tmp_path, {}, "plain.h5")
    model = results.table("model")["global_model"]
    assert np.array_equal(model, plain.table("model")["global_model"])  # the sum is computed in the clear
    latency = 0.05  # network.latency_s: 6 more messages (3 round trips), each paying it; the clients' measured
    extra = results.table("rounds")["sim_time_s"] - plain.table("rounds")["sim_time_s"]  # compute adds ms of noise
    assert np.median(np.abs(extra - 6 * latency)) < 0.02


@pytest.mark.parametrize("settings, message", [
    ({"compression": {"messages": {"nope": {"codec": "fp16"}}}}, "has no message 'nope'"),
    ({"compression": {"messages": {"model": {"codec": "topk", "error_feedback": True}}}}, "for uploads only"),
    ({"compression": {"down": {"codec": "topk", "error_feedback": True}}}, "for uploads only"),
    ({"privacy": {"mode": "central"}}, "server.weighting: uniform"),
    ({"algorithm": "local", "privacy": {"mode": "local"}}, "uploads no model update"),
    ({"secure_aggregation": "secagg", "compression": {"up": {"codec": "fp16"}}}, "cannot also be encoded"),
    ({"compression": {"up": {"codec": "zip"}}}, "is not one of"),
])
def test_bad_wire_settings_are_one_line(settings, message, tmp_path):
    from mpi4py import MPI

    with pytest.raises(ConfigError, match=message) as caught:
        run_engine(parse_config(_merge(SHARDS, {"algorithm": "fedavg", **settings})), MPI.COMM_SELF,
                   tmp_path / "bad.h5")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
def test_a_protocol_lists_every_message_its_plans_send(algorithm):
    """What ``compression.messages`` and the privacy check see is every message the plans can move."""
    cfg = parse_config(_merge(CONFIGS[algorithm], {"rounds": 1}))
    protocol = get_algorithm(algorithm).server.protocol_type(RunContext(cfg, build_federated_dataset(
        cfg.data, cfg.seed).layout))
    plans = [protocol.setup_plan(), protocol.eval_prelude(), protocol.eval_plan(), protocol.newcomer_plan(),
             *(protocol.train_plan(r) for r in range(1, 13))]
    sent = {step.name for plan in plans for step in plan if isinstance(step, Message)}
    assert sent <= {m.name for m in protocol.messages()}


def test_a_corrupt_upload_is_rejected_after_decoding_and_its_residual_rolled_back(tmp_path):
    """faults.corrupt sends NaN: every codec keeps it non-finite, the server rejects it, and the client's error
    feedback residual stays what it was before that round (its state edits are discarded with the update)."""
    results = run(tmp_path, {"rounds": 6, "faults": {"corrupt": 0.3},
                             "compression": {"up": {"codec": "topk", "fraction": 0.05, "error_feedback": True}}})
    rounds = results.table("rounds")
    assert rounds["rejected_updates"].sum() > 0
    assert np.isfinite(results.table("model")["global_model"]).all()


def test_resume_with_codecs_and_privacy_is_bitwise_an_uninterrupted_run(tmp_path, monkeypatch):
    """Error-feedback residuals are checkpointed client state and ε is replayed from the ledger."""
    import yaml

    from mpifl.cli import main
    from tests.conftest import assert_same, deterministic

    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(_merge(SHARDS, {
        "algorithm": "scaffold", "rounds": 5, "checkpoint_every": 2, "eval_every": 1, "clients_per_round": 4,
        "server": {"weighting": "uniform"},
        "compression": {"up": {"codec": "sign", "error_feedback": True}, "down": {"codec": "fp16"}},
        "privacy": {"mode": "central", "sampling": "poisson", "noise_multiplier": 0.5}})))
    full, part = tmp_path / "full.h5", tmp_path / "part.h5"
    assert main(["run", str(config), "--out", str(full), "--quiet"]) == 0
    monkeypatch.setenv("MPIFL_INJECT_FAULT", "0:4")
    assert main(["run", str(config), "--out", str(part), "--quiet"]) == 1
    monkeypatch.delenv("MPIFL_INJECT_FAULT")
    assert main(["run", str(config), "--resume", str(part), "--quiet"]) == 0
    assert_same(deterministic(full), deterministic(part))
    assert np.array_equal(read_results(full).table("rounds")["epsilon"], read_results(part).table("rounds")["epsilon"])


def test_report_shows_epsilon_per_run_and_per_sweep_group(tmp_path, capsys):
    from mpifl.cli import main
    from mpifl.report import aggregate

    results = run(tmp_path, {"server": {"weighting": "uniform"},
                             "privacy": {"mode": "central", "sampling": "poisson", "noise_multiplier": 1.0}})
    epsilon = results.table("rounds")["epsilon"][-1]
    assert main(["report", str(tmp_path / "run.h5")]) == 0
    assert f"differential privacy: ε = {epsilon:.4g} at δ = 1e-05 after round 4" in capsys.readouterr().out
    (row,) = aggregate(str(tmp_path))["rows"]
    assert row["epsilon"][0] == pytest.approx(epsilon)


@pytest.mark.parametrize("algorithm, wire", [
    ("fedavg", {"secure_aggregation": "secagg_plus", "compression": {"down": {"codec": "bf16"}}}),
    ("fedals", {"compression": {"up": {"codec": "topk", "fraction": 0.1}}}),
    ("pefll", {"compression": {"up": {"codec": "qsgd"}, "down": {"codec": "fp16"}}}),
])
def test_the_simulated_clock_counts_exactly_the_bytes_the_ledger_records(algorithm, wire, tmp_path):
    """One source for what a client moves: the traffic the simulated clock (and a deadline) reads off the plan is,
    client by client and round by round, what the ledger recorded (codecs, SecAgg's own messages, FedALS's rounds
    that sync only the head)."""
    from mpi4py import MPI

    from mpifl.runtime.engine import Engine

    raw = _merge(CONFIGS[algorithm], {"rounds": 3, "eval_every": 3, **wire})
    results = read_results(run_engine(raw, MPI.COMM_SELF, tmp_path / "r.h5"))
    engine = Engine(parse_config(raw), MPI.COMM_SELF, tmp_path / "probe.h5")
    engine.prepare()
    ledger, directions = results.table("ledger"), results.table_attrs["ledger"]["directions"]
    up = np.array([d == "up" for d in directions])[ledger["message"]]
    train = ledger["stage"] == 0
    for round_ in (1, 2, 3):
        rows = train & (ledger["round"] == round_)
        clients = np.unique(ledger["client"][rows])
        traffic = engine.rounds.simtime.traffic(engine.protocol.train_plan(round_), clients)
        for direction, mask, expected, messages in (("down", ~up, traffic.down_bytes, traffic.down_messages),
                                                    ("up", up, traffic.up_bytes, traffic.up_messages)):
            chosen = rows & mask
            recorded = np.bincount(np.searchsorted(clients, ledger["client"][chosen]), ledger["bytes"][chosen],
                                   minlength=len(clients))
            counted = np.bincount(np.searchsorted(clients, ledger["client"][chosen]), minlength=len(clients))
            assert recorded.tolist() == expected.tolist(), (round_, direction)
            assert counted.tolist() == messages.tolist(), (round_, direction)
