"""What secure aggregation costs on the wire: the protocol's own messages, per client and round.

The simulator sums the updates in the clear; a real deployment runs SecAgg (Bonawitz et al. 2017, "Practical
Secure Aggregation for Privacy-Preserving Machine Learning", CCS; every client shares its secrets with all n-1
others) or SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS;
the same rounds, but each client talks only to its k = O(log n) neighbours in a random k-regular graph, §3).
This module gives the bytes each of those rounds moves, so the ledger and the simulated round time see them.

Semi-honest (honest-but-curious) setting: no signatures, no ConsistencyCheck round (Bonawitz et al. Fig. 4,
the parts for active adversaries are left out). Per participating client and round, n = cohort, k = degree
(:func:`secagg_degree`), s = survivors (clients whose masked input arrived), K = ``key_bytes``,
S = ``share_bytes``, A = ``aead_overhead_bytes``, d = the update's entries, b = ``field_bits``; a client id is
4 bytes:

======================  ====  ===========================  =====================================================
message                 dir   bytes (one client)           source
======================  ====  ===========================  =====================================================
secagg_advertise_keys   up    2·K                          Bonawitz Fig. 4 Round 0 (AdvertiseKeys): c_u^PK, s_u^PK
secagg_neighbour_keys   down  k·(4 + 2·K)                  Bonawitz Fig. 4 Round 0, server's broadcast of
                                                           (v, c_v^PK, s_v^PK); Bell §3: only u's k neighbours
secagg_share_keys       up    k·(8 + 2·S + A)              Bonawitz Fig. 4 Round 1 (ShareKeys): one
                                                           e_{u,v} = AE.enc(u ‖ v ‖ s_{u,v}^SK ‖ b_{u,v}) per
                                                           neighbour v (Bell §3: k of them)
secagg_forward_shares   down  k·(8 + 2·S + A)              Bonawitz Fig. 4 Round 1, server forwards the e_{v,u}
                                                           addressed to u
secagg_masked_input     up    ceil(d·b / 8)                Bonawitz Fig. 4 Round 2 (MaskedInputCollection): y_u
                                                           in Z_R^d, R = 2^b
secagg_survivors        down  4·ceil(k·(s-1) / (n-1))      Bonawitz Fig. 4 Round 4 (Unmasking): the list U_3;
                                                           here only the ids of u's surviving neighbours (SecAgg:
                                                           all s-1 others; SecAgg+: their expected number under
                                                           the random labelling of the graph, rounded up)
secagg_unmask           up    k·(4 + S)                    Bonawitz Fig. 4 Round 4: per neighbour v, v's id and
                                                           a share of b_v (v survived) or s_v^SK (v dropped)
======================  ====  ===========================  =====================================================

The masked input replaces the plain upload of the update: the runtime counts it once, at its masked size, and
never also the plain upload. The last two messages reach (and come from) the survivors only
(:data:`UNMASKING_ROUND`); the shares of the dropped clients' s^SK let the server remove their pairwise masks.
Sizes are exact integers; SecAgg is SecAgg+ with k = n-1 (the complete graph).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from mpifl.comm.config import SecAggConfig
from mpifl.comm.messages import Direction, masked_nbytes

PROTOCOLS = ("secagg", "secagg_plus")  # the protocol names of ``secure_aggregation:``, 'none' aside
ID_BYTES = 4  # one client id on the wire
MASKED_INPUT = "secagg_masked_input"  # the update itself, masked: counted where the update is sent
UNMASKING_ROUND = frozenset({"secagg_survivors", "secagg_unmask"})  # between the server and the survivors only

# Bell et al.'s degree rule (see secagg_degree): statistical security 2^-40, failure probability 2^-20.
SECURITY_BITS = 40
CORRECTNESS_BITS = 20


@dataclass(frozen=True)
class SecAggMessage:
    """One message of a secure round as the ledger sees it: its size for one client."""

    name: str
    direction: Direction
    nbytes: int  # bytes ONE client sends (up) or receives (down) for this message this round


def secagg_messages(protocol: str, cohort: int, model_numel: int, cfg: SecAggConfig,
                    survivors: int | None = None) -> list[SecAggMessage]:
    """Every message one client of a ``cohort``-client round exchanges, in protocol order (module docstring's
    table), including the masked input: it replaces the plain upload of the update, which the runtime must not
    count as well. ``survivors``: clients whose masked input reached the server (default: all)."""
    k = secagg_degree(protocol, cohort, cfg)
    survivors = cohort if survivors is None else survivors
    if not 0 <= survivors <= cohort:
        raise ValueError(f"secure aggregation: {survivors} survivors of a cohort of {cohort}")
    share = 2 * ID_BYTES + 2 * cfg.share_bytes + cfg.aead_overhead_bytes  # e_{u,v}: u ‖ v ‖ s^SK ‖ b, sealed
    surviving_neighbours = -(-k * max(survivors - 1, 0) // (cohort - 1)) if cohort > 1 else 0
    return [
        SecAggMessage("secagg_advertise_keys", "up", 2 * cfg.key_bytes),
        SecAggMessage("secagg_neighbour_keys", "down", k * (ID_BYTES + 2 * cfg.key_bytes)),
        SecAggMessage("secagg_share_keys", "up", k * share),
        SecAggMessage("secagg_forward_shares", "down", k * share),
        SecAggMessage(MASKED_INPUT, "up", masked_nbytes(model_numel, cfg.field_bits)),
        SecAggMessage("secagg_survivors", "down", ID_BYTES * surviving_neighbours),
        SecAggMessage("secagg_unmask", "up", k * (ID_BYTES + cfg.share_bytes)),
    ]


def secagg_round_trips(protocol: str) -> int:
    """Latency-bound client↔server round trips a secure round adds to the plain protocol's one.

    Both protocols have four request/response exchanges (AdvertiseKeys, ShareKeys, MaskedInputCollection,
    Unmasking; Bonawitz et al. Fig. 4 without the active-adversary ConsistencyCheck; Bell et al. §3 keeps the
    rounds), each waiting for the server's answer to the previous one. The plain round is one exchange (model
    down, update up): the model download rides on an exchange the protocol has anyway and the masked input
    replaces the update's upload, so 4 - 1 = 3 exchanges are extra."""
    _check(protocol)
    return 3


def secagg_degree(protocol: str, cohort: int, cfg: SecAggConfig) -> int:
    """k, the number of clients each client shares secrets with.

    ``secagg``: the complete graph, k = n-1. ``secagg_plus``: ``cfg.degree`` if set (capped at n-1); otherwise
    the smallest even k for which a random k-regular (Harary) graph gives Bell et al.'s guarantees (§3: the
    graph of honest survivors stays connected, and a Shamir threshold t exists that no client's corrupt
    neighbours reach but its surviving neighbours do), with a fraction ``cfg.adversarial_rate`` of corrupt and
    ``cfg.dropout_rate`` of dropped clients, statistical security 2^-40 and failure probability 2^-20 per round;
    k = n-1 when no smaller k does. The bounds used for this (:func:`_degree_ok`) are those of the authors'
    team's open-source SecAgg+ (google-parfait/federated-compute, ``fcp/secagg/server/graph_parameter_finder``),
    rederived here: the paper's text was not at hand, so its exact parameter table is not quoted. For the
    default γ = δ = 0.33 this gives k = 8, 68, 286, 422, 480 at n = 10, 100, 1000, 10^4, 10^5 (the values in that
    implementation's tests): k grows as O(log n) once n is well above k; small cohorts need nearly all n-1.
    """
    _check(protocol)
    if cohort < 0:
        raise ValueError(f"secure aggregation: a cohort of {cohort} clients")
    complete = max(cohort - 1, 0)
    if protocol == "secagg":
        return complete
    if cfg.degree:
        return min(cfg.degree, complete)
    return _paper_degree(cohort, cfg.adversarial_rate, cfg.dropout_rate)


def _check(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"secure aggregation: unknown protocol {protocol!r} (expected one of {PROTOCOLS})")


@functools.lru_cache(maxsize=256)
def _paper_degree(n: int, adversarial_rate: float, dropout_rate: float) -> int:
    """The smallest even k < n-1 that :func:`_degree_ok` accepts, else n-1 (cached: every round asks again)."""
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    corrupt = math.floor(adversarial_rate * n + 1e-9)
    dropped = math.floor(dropout_rate * n + 1e-9)
    for k in range(2, n - 1, 2):
        if _degree_ok(n, k, corrupt, dropped, log_fact):
            return k
    return max(n - 1, 0)


def _degree_ok(n: int, k: int, corrupt: int, dropped: int, log_fact: np.ndarray) -> bool:
    """Whether degree k is secure and correct with ``corrupt`` corrupt and ``dropped`` dropped clients of n.

    Security (2^-41 per bad event, the 2^-40 split over two): (a) removing the bad clients disconnects a
    Harary graph only if some k/2 consecutive nodes at two places are all bad: at most n(n-k-1)/2 such pairs,
    each with probability C(n-k, B-k)/C(n, B) for B bad clients (union bound); (b) the threshold t is the
    smallest with Pr[a client has >= t corrupt neighbours] <= 2^-41/n (hypergeometric, union over clients).
    Correctness: Pr[a client has < t surviving neighbours] <= 2^-20/n.
    """
    bad = corrupt + dropped
    if k <= bad:
        log_disconnect = (math.log(n * (n - k - 1) / 2) + log_fact[bad] + log_fact[n - k]
                          - log_fact[n] - log_fact[bad - k])
        if log_disconnect >= -(SECURITY_BITS + 1) * math.log(2):
            return False
    corrupt_tail = np.cumsum(_hypergeometric(n, corrupt, k, log_fact)[::-1])[::-1]  # Pr[>= t corrupt]
    secure = corrupt_tail <= 2.0 ** -(SECURITY_BITS + 1) / n
    t = int(np.argmax(secure)) if secure.any() else k + 1
    surviving_below_t = _hypergeometric(n, n - dropped, k, log_fact)[:t].sum()  # Pr[< t surviving]
    return bool(surviving_below_t <= 2.0 ** -CORRECTNESS_BITS / n)


def _hypergeometric(n: int, marked: int, draws: int, log_fact: np.ndarray) -> np.ndarray:
    """Pr[x of ``draws`` clients drawn without replacement from n are among ``marked``], x = 0..draws."""
    x = np.arange(draws + 1)
    ok = (x <= marked) & (draws - x <= n - marked)
    xs = x[ok]
    log_pmf = (log_fact[marked] - log_fact[xs] - log_fact[marked - xs]
               + log_fact[n - marked] - log_fact[draws - xs] - log_fact[n - marked - draws + xs]
               - log_fact[n] + log_fact[draws] + log_fact[n - draws])
    pmf = np.zeros(draws + 1)
    pmf[ok] = np.exp(log_pmf)
    return pmf
