"""The secure-aggregation cost model: exact bytes per message, the degree rule, growth in n, edge cases."""

from __future__ import annotations

import math

import pytest

from mpifl.comm.config import SecAggConfig
from mpifl.comm.secagg import (
    UNMASKING_ROUND,
    SecAggMessage,
    secagg_degree,
    secagg_messages,
    secagg_round_trips,
)

CFG = SecAggConfig()  # K = 32 key bytes, S = 16 share bytes, A = 28 AEAD bytes, 32-bit field, γ = δ = 0.33


def sizes(protocol: str, cohort: int, numel: int = 1000, cfg: SecAggConfig = CFG,
          survivors: int | None = None) -> dict[str, int]:
    return {m.name: m.nbytes for m in secagg_messages(protocol, cohort, numel, cfg, survivors)}


def overhead(protocol: str, cohort: int) -> int:
    """A client's protocol bytes beyond its masked input, both directions."""
    return sum(n for name, n in sizes(protocol, cohort).items() if name != "secagg_masked_input")


def test_hand_worked_round_of_100_clients() -> None:
    k = 68  # Bell et al.'s degree for n = 100, γ = δ = 0.33 (test_paper_degree)
    assert secagg_messages("secagg_plus", 100, 1000, CFG) == [
        SecAggMessage("secagg_advertise_keys", "up", 2 * 32),
        SecAggMessage("secagg_neighbour_keys", "down", k * (4 + 2 * 32)),
        SecAggMessage("secagg_share_keys", "up", k * (4 + 4 + 2 * 16 + 28)),
        SecAggMessage("secagg_forward_shares", "down", k * (4 + 4 + 2 * 16 + 28)),
        SecAggMessage("secagg_masked_input", "up", 1000 * 32 // 8),
        SecAggMessage("secagg_survivors", "down", 4 * k),  # all 99 others survived: all k neighbours
        SecAggMessage("secagg_unmask", "up", k * (4 + 16)),
    ]
    assert list(sizes("secagg_plus", 100).values()) == [64, 4624, 4624, 4624, 4000, 272, 1360]
    assert sizes("secagg", 100) == {"secagg_advertise_keys": 64, "secagg_neighbour_keys": 99 * 68,
                                    "secagg_share_keys": 99 * 68, "secagg_forward_shares": 99 * 68,
                                    "secagg_masked_input": 4000, "secagg_survivors": 99 * 4,
                                    "secagg_unmask": 99 * 20}


def test_masked_input_packs_field_elements() -> None:
    cfg = SecAggConfig(field_bits=20)
    assert sizes("secagg", 10, numel=7, cfg=cfg)["secagg_masked_input"] == math.ceil(7 * 20 / 8)  # 18 bytes


@pytest.mark.parametrize(("n", "gamma", "delta", "k"), [
    # the degrees in the tests of the SecAgg+ parameter finder of Google's federated-compute
    (10, 0.33, 0.33, 8), (100, 0.33, 0.33, 68), (1000, 0.33, 0.33, 286), (10000, 0.33, 0.33, 422),
    (100, 0.05, 0.33, 28), (10000, 0.05, 0.33, 86), (1000, 0.33, 0.05, 78), (1000, 0.45, 0.45, 822),
])
def test_paper_degree(n: int, gamma: float, delta: float, k: int) -> None:
    cfg = SecAggConfig(adversarial_rate=gamma, dropout_rate=delta)
    assert secagg_degree("secagg_plus", n, cfg) == k
    assert secagg_degree("secagg", n, cfg) == n - 1


def test_small_cohort_needs_the_complete_graph() -> None:
    # 1 corrupt and 1 dropped client of 4: k = 2 fails the bounds, so all n-1 others
    assert secagg_degree("secagg_plus", 4, CFG) == 3


def test_degree_setting_is_capped_and_only_for_secagg_plus() -> None:
    assert secagg_degree("secagg_plus", 100, SecAggConfig(degree=10)) == 10
    assert secagg_degree("secagg_plus", 100, SecAggConfig(degree=500)) == 99
    assert secagg_degree("secagg", 100, SecAggConfig(degree=10)) == 99
    assert sizes("secagg_plus", 100, cfg=SecAggConfig(degree=500)) == sizes("secagg", 100)
    assert sizes("secagg_plus", 100, cfg=SecAggConfig(degree=10))["secagg_unmask"] == 10 * (4 + 16)


def test_secagg_grows_linearly_secagg_plus_logarithmically() -> None:
    ns = [10, 100, 1000, 10000]
    full = [overhead("secagg", n) for n in ns]
    plus = [overhead("secagg_plus", n) for n in ns]
    assert full == [64 + (n - 1) * (68 + 68 + 68 + 4 + 20) for n in ns]
    assert all(b / a > 9 for a, b in zip(full, full[1:]))  # ×10 clients, ×~10 bytes
    assert all(p < f for p, f in zip(plus[1:], full[1:]))
    ratios = [b / a for a, b in zip(plus, plus[1:])]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < 1.5  # the last decade adds under half
    per_log = [p / math.log2(n) for p, n in zip(plus[2:], ns[2:])]
    assert max(per_log) / min(per_log) < 1.15  # bytes / log2 n levels off: O(log n)
    assert plus[-1] * 20 < full[-1]


def test_survivors_change_only_the_survivor_list() -> None:
    all_in = sizes("secagg_plus", 100)
    some = sizes("secagg_plus", 100, survivors=80)
    assert some["secagg_survivors"] == 4 * math.ceil(68 * 79 / 99)  # 55 surviving neighbours expected
    assert {n: b for n, b in some.items() if n != "secagg_survivors"} == {
        n: b for n, b in all_in.items() if n != "secagg_survivors"}
    assert sizes("secagg", 100, survivors=80)["secagg_survivors"] == 4 * 79  # exactly the other survivors
    assert sizes("secagg", 100, survivors=0)["secagg_survivors"] == 0
    assert UNMASKING_ROUND == {"secagg_survivors", "secagg_unmask"}


def test_cohort_of_one_shares_nothing() -> None:
    assert secagg_degree("secagg_plus", 1, CFG) == secagg_degree("secagg", 1, CFG) == 0
    assert sizes("secagg_plus", 1) == {"secagg_advertise_keys": 64, "secagg_neighbour_keys": 0,
                                       "secagg_share_keys": 0, "secagg_forward_shares": 0,
                                       "secagg_masked_input": 4000, "secagg_survivors": 0, "secagg_unmask": 0}


def test_round_trips() -> None:
    assert secagg_round_trips("secagg") == secagg_round_trips("secagg_plus") == 3


@pytest.mark.parametrize("protocol", ["none", "secagg++", ""])
def test_unknown_protocol(protocol: str) -> None:
    with pytest.raises(ValueError, match="unknown protocol"):
        secagg_messages(protocol, 10, 100, CFG)
    with pytest.raises(ValueError, match="unknown protocol"):
        secagg_round_trips(protocol)
    with pytest.raises(ValueError, match="unknown protocol"):
        secagg_degree(protocol, 10, CFG)


def test_bad_counts() -> None:
    with pytest.raises(ValueError, match="survivors"):
        secagg_messages("secagg", 10, 100, CFG, survivors=11)
    with pytest.raises(ValueError, match="cohort"):
        secagg_degree("secagg_plus", -1, CFG)
