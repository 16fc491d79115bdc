"""pFedHN: what it sends, and new clients adapting their own embedding against a frozen hypernetwork."""

from __future__ import annotations

import numpy as np
import pytest

from mpifl.algorithms.base import RunContext
from mpifl.algorithms.pfedhn import PFedHNClient, PFedHNServer
from mpifl.config import parse_config
from mpifl.data import build_federated_dataset
from mpifl.models import FlatModel, build_model
from tests.algorithms.conftest import hosting_all
from tests.algorithms.test_pefll import PEFLL, assert_identical_results, evaluate_in_chunks
from tests.conftest import _merge

PFEDHN = _merge({k: v for k, v in PEFLL.items() if k != "pefll"},
                {"algorithm": "pfedhn", "pfedhn": {"hyper_hidden": 24, "hyper_layers": 2, "new_client_rounds": 2}})


def test_logical_bytes(run_algo):
    res = run_algo("pfedhn", PFEDHN)
    cfg = parse_config(PFEDHN)
    layout = build_federated_dataset(cfg.data, cfg.seed).layout
    d = FlatModel(build_model(cfg.model, layout, cfg.seed)).numel
    ledger = res.table("ledger")
    names = res.table_attrs["ledger"]["message_names"]
    train = ledger["stage"] == 0
    assert [names[m] for m in np.unique(ledger["message"][train])] == ["model", "delta"]  # embeddings stay home
    keys, inverse = np.unique(np.stack([ledger["round"][train], ledger["client"][train]], 1), axis=0,
                              return_inverse=True)
    assert len(keys) == cfg.rounds * cfg.clients_per_round and not layout.unseen[keys[:, 1]].any()
    assert np.all(np.bincount(inverse.ravel(), weights=ledger["bytes"][train]) == 4 * 2 * d)
    evals = ~train
    per_client = np.bincount(ledger["client"][evals], weights=ledger["bytes"][evals], minlength=layout.num_clients)
    rounds = cfg.algorithm_options.new_client_rounds
    # per evaluation: θ for every client; new clients first adapt over R round trips of θ down, Δθ up
    assert np.array_equal(per_client, 4 * d * np.where(layout.unseen, 1 + 2 * rounds, 1))


def test_new_clients_adapt_without_touching_the_server_state(run_algo):
    fast = {"new_client_lr": 10.0}
    frozen = run_algo("pfedhn", _merge(PFEDHN, {"pfedhn": {**fast, "new_client_rounds": 0}}), tag="r0")
    adapted = run_algo("pfedhn", _merge(PFEDHN, {"pfedhn": {**fast, "new_client_rounds": 3}}), tag="r3")
    for key in ("hypernetwork", "client_embeddings"):
        assert np.array_equal(frozen.table("model")[key], adapted.table("model")[key])
    before, after = frozen.table("eval"), adapted.table("eval")
    assert np.array_equal(before["personal.seen.loss"], after["personal.seen.loss"])
    assert after["personal.unseen.loss"][-1] < before["personal.unseen.loss"][-1] - 0.01


def test_chunked_evaluation_gives_identical_results(run_algo, tmp_path):
    """Chunks of 3 (5 unseen clients: chunks of 3 and 2 adapt separately) equal one pass over all clients."""
    config = _merge(PFEDHN, {"eval_every": 1, "data": {"unseen_fraction": 0.5}})
    run_algo("pfedhn", config, tag="_whole")
    run_algo("pfedhn", {**config, "eval_chunk": 3}, tag="_chunked")
    assert_identical_results(tmp_path / "pfedhn_whole_p0.h5", tmp_path / "pfedhn_chunked_p0.h5")



@pytest.mark.parametrize("chunk", [1, 3])
def test_each_chunk_of_new_clients_adapts_as_in_one_pass(chunk):
    """5 new clients adapting 3 + 2 (or one by one) reach bitwise the models of all 5 adapting at once."""
    def evaluate(chunk: int) -> np.ndarray:
        cfg = parse_config(_merge(PFEDHN, {"data": {"unseen_fraction": 0.5}, "pfedhn": {"hyper_hidden": 100}}))
        dataset = build_federated_dataset(cfg.data, cfg.seed)
        ctx = RunContext(cfg, dataset.layout)
        client = PFedHNClient(ctx, hosting_all(dataset))
        return evaluate_in_chunks(PFedHNServer(ctx), client, chunk)[0]

    assert np.array_equal(evaluate(chunk), evaluate(10))
