"""The server optimizers (``server.optimizer``) against numbers worked out by hand from Reddi et al., "Adaptive
Federated Optimization" (ICLR 2021), Algorithm 2: m ← β₁m + (1 − β₁)Δ; adagrad v ← v + Δ², yogi
v ← v − (1 − β₂)Δ²·sign(v − Δ²), adam v ← β₂v + (1 − β₂)Δ²; x ← x + η·m/(√v + τ), from m = 0 and v = τ².

Every intermediate value below is written out as a literal (chosen so the moments are exact in binary), never
computed by mpifl's own formula; the square roots of non-squares are the only arithmetic left to numpy."""

from __future__ import annotations

import numpy as np
import pytest

from mpifl.algorithms import fedavg
from mpifl.algorithms.base import RunContext
from mpifl.algorithms.fedavg import GlobalModel
from mpifl.data import build_federated_dataset
from mpifl.registry import parse_config
from mpifl.schema import ConfigError
from tests.algorithms.conftest import SHARDS, both_sides, walk
from tests.conftest import _merge


def model(shape: int | tuple[int, ...], **server) -> GlobalModel:  # noqa: ANN003
    """A global model of zeros of ``shape`` under ``server`` settings (a real run context on tiny data)."""
    cfg = parse_config(_merge(SHARDS, {"algorithm": "fedavg", "server": server}))
    ctx = RunContext(cfg, build_federated_dataset(cfg.data, cfg.seed).layout)
    return GlobalModel(ctx, np.zeros(shape, dtype=np.float32))


def step(g: GlobalModel, delta: list[float], part: slice | int = slice(None)) -> None:
    g.step(np.array(delta, dtype=np.float64), part)


def test_fedadam_two_steps_by_hand():
    g = model(2, optimizer="adam", lr=1.0, beta1=0.5, beta2=0.5, tau=1.0)
    assert g.first_moment.tolist() == [0, 0] and g.second_moment.tolist() == [1, 1]  # v₋₁ = τ² = 1
    step(g, [1.0, -7.0])
    # m = 0.5·0 + 0.5·Δ = [0.5, -3.5];  v = 0.5·1 + 0.5·[1, 49] = [1, 25];  x = m / ([1, 5] + 1)
    assert g.first_moment.tolist() == [0.5, -3.5] and g.second_moment.tolist() == [1.0, 25.0]
    np.testing.assert_allclose(g.params, [0.25, -7 / 12], rtol=1e-6)
    step(g, [7.0, 5.0])
    # m = [0.25 + 3.5, -1.75 + 2.5] = [3.75, 0.75];  v = [0.5 + 24.5, 12.5 + 12.5] = [25, 25];  x += m / 6
    assert g.first_moment.tolist() == [3.75, 0.75] and g.second_moment.tolist() == [25.0, 25.0]
    np.testing.assert_allclose(g.params, [0.875, -11 / 24], rtol=1e-6)


def test_fedadagrad_two_steps_by_hand():
    g = model(2, optimizer="adagrad", lr=2.0, beta1=0.5, tau=3.0)
    assert g.second_moment.tolist() == [9, 9]
    step(g, [4.0, -4.0])
    # m = [2, -2];  v = 9 + 16 = 25;  x = 2·m / (5 + 3)
    assert g.first_moment.tolist() == [2, -2] and g.second_moment.tolist() == [25, 25]
    assert g.params.tolist() == [0.5, -0.5]
    step(g, [0.0, 12.0])
    # m = [1, -1 + 6] = [1, 5];  v = [25 + 0, 25 + 144] = [25, 169];  x += 2·[1 / 8, 5 / 16]
    assert g.first_moment.tolist() == [1, 5] and g.second_moment.tolist() == [25, 169]
    assert g.params.tolist() == [0.75, 0.125]


def test_fedyogi_sign_term_by_hand():
    """Yogi's v moves towards Δ² by (1 − β₂)Δ²: down where v > Δ², up where v < Δ², not at all where equal; the
    second step flips the sign of v − Δ² in the first two coordinates."""
    g = model(3, optimizer="yogi", lr=1.0, beta1=0.5, beta2=0.5, tau=1.0)
    step(g, [0.5, 3.0, 1.0])
    # Δ² = [0.25, 9, 1];  v − Δ² = [0.75, -8, 0] → sign [+1, -1, 0];  v = 1 − 0.5·Δ²·sign = [0.875, 5.5, 1]
    assert g.second_moment.tolist() == [0.875, 5.5, 1.0]
    assert g.first_moment.tolist() == [0.25, 1.5, 0.5]
    x1 = np.array([0.25 / (np.sqrt(0.875) + 1), 1.5 / (np.sqrt(5.5) + 1), 0.5 / 2])
    np.testing.assert_allclose(g.params, x1, rtol=1e-6)
    step(g, [1.0, 1.0, 0.0])
    # Δ² = [1, 1, 0];  v − Δ² = [-0.125, 4.5, 1] → sign [-1, +1, +1];  v = [0.875 + 0.5, 5.5 - 0.5, 1 - 0]
    assert g.second_moment.tolist() == [1.375, 5.0, 1.0]
    assert g.first_moment.tolist() == [0.625, 1.25, 0.25]
    x2 = x1 + [0.625 / (np.sqrt(1.375) + 1), 1.25 / (np.sqrt(5.0) + 1), 0.25 / 2]
    np.testing.assert_allclose(g.params, x2, rtol=1e-6)


def test_adam_and_yogi_differ_where_the_paper_says():
    """On the same Δ, Adam's v is β₂v + (1 − β₂)Δ² = [0.625, 5, 1], Yogi's [0.875, 5.5, 1] (above)."""
    g = model(3, optimizer="adam", beta1=0.5, beta2=0.5, tau=1.0)
    step(g, [0.5, 3.0, 1.0])
    assert g.second_moment.tolist() == [0.625, 5.0, 1.0]


def test_a_part_or_a_row_steps_alone():
    """FedALS steps a slice, IFCA one cluster's row: the rest of the model and of the optimizer's state stay."""
    g = model(3, optimizer="adagrad", lr=2.0, beta1=0.5, tau=3.0)
    step(g, [4.0], slice(1, 2))
    assert g.params.tolist() == [0, 0.5, 0] and g.second_moment.tolist() == [9, 25, 9]
    rows = model((2, 2), optimizer="adagrad", lr=2.0, beta1=0.5, tau=3.0)
    step(rows, [4.0, -4.0], 1)
    assert rows.params.tolist() == [[0, 0], [0.5, -0.5]] and rows.second_moment.tolist() == [[9, 9], [25, 25]]


def test_sgd_keeps_no_adaptive_state_and_adaptive_no_velocity():
    sgd, adam = model(2), model(2, optimizer="adam")
    assert hasattr(sgd, "velocity") and not hasattr(sgd, "second_moment")
    assert hasattr(adam, "second_moment") and not hasattr(adam, "velocity")


def test_fedavg_with_yogi_steps_the_average_of_its_clients_deltas():
    """End to end on real clients: the server's model after two rounds is Algorithm 2 applied (in the test, by
    its own code) to the sample-weighted mean of the deltas the clients sent."""
    cfg = _merge(SHARDS, {"algorithm": "fedavg", "server": {"optimizer": "yogi", "lr": 0.1, "tau": 0.01}})
    _, server, client = both_sides(cfg)
    x = server.params.astype(np.float64)
    m, v = np.zeros_like(x), np.full_like(x, 0.01**2)
    clients = np.arange(6)
    sizes = server.ctx.layout.train_sizes[clients].astype(np.float64)
    for round_ in (1, 2):
        rows = walk(server, client, server.protocol.train_plan(round_), round_, clients)
        delta = (sizes / sizes.sum()) @ rows["delta"].astype(np.float64)
        m = 0.9 * m + 0.1 * delta
        v = v - 0.01 * delta**2 * np.sign(v - delta**2)
        x = x + 0.1 * m / (np.sqrt(v) + 0.01)
        np.testing.assert_allclose(server.params, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["local", "karula", "pefll", "pfedhn", "fedasync"])
def test_algorithms_without_a_global_model_step_refuse_adaptive_optimizers(algorithm):
    with pytest.raises(ConfigError, match=f"server.optimizer: adam steps a global model .*; {algorithm}'s server"):
        parse_config(_merge(SHARDS, {"algorithm": algorithm, "server": {"optimizer": "adam"}}))


def test_momentum_belongs_to_sgd():
    with pytest.raises(ConfigError, match="server.momentum: momentum is sgd's; yogi's first moment decays with "
                                          "server.beta1"):
        parse_config(_merge(SHARDS, {"algorithm": "fedavg", "server": {"optimizer": "yogi", "momentum": 0.9}}))


@pytest.mark.parametrize("server", [{}, {"lr": 0.7, "momentum": 0.9}, {"optimizer": "yogi", "lr": 0.01},
                                    {"optimizer": "adam", "lr": 0.01}, {"optimizer": "adagrad", "lr": 0.1}])
def test_the_step_span_by_span_has_the_whole_arrays_bits(monkeypatch, server):
    """Rank 0's step in cache-sized spans (several here, the last one short), the mean divided span by span, gives
    the bits of the step on whole arrays (one span; for SGD, whose velocity is now updated in place, the expressions
    it was before issue 48: v ← μ·v + Δ, x ← fl32(x + η·v)), signed zeros included, for a model and a part of it."""
    rng = np.random.default_rng(5)
    size = 2 * 16384 + 77
    spans, whole = model(size, **server), model(size, **server)
    spans.params = whole.params = rng.standard_normal(size).astype(np.float32)
    spans.params[:4] = [0.0, -0.0, -0.0, 0.0]
    velocity = np.zeros(size)
    for part in (slice(None), slice(100, size - 5), slice(None)):
        total = rng.standard_normal(size)[part] * 10.0 ** rng.uniform(-9, 1, size)[part]
        total[:3] = [-0.0, 0.0, -0.0]
        before = spans.params
        spans.step(total, part, divisor=7)
        with monkeypatch.context() as one:
            one.setattr(fedavg, "STEP_SPAN", size)
            whole.step(total / 7, part)
        assert np.array_equal(spans.params.view(np.int32), whole.params.view(np.int32))
        states = ((spans.velocity, whole.velocity) if spans.server.optimizer == "sgd" else
                  ((spans.first_moment, whole.first_moment), (spans.second_moment, whole.second_moment)))
        assert all(np.array_equal(a.view(np.int64), b.view(np.int64)) for a, b in np.reshape(states, (-1, 2, size)))
        if spans.server.optimizer == "sgd":
            velocity[part] = spans.server.momentum * velocity[part] + total / 7
            expected = before.copy()
            expected[part] = (before[part] + spans.server.lr * velocity[part]).astype(np.float32)
            assert np.array_equal(spans.params.view(np.int32), expected.view(np.int32))
