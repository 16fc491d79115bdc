"""No host synchronization per local step: local SGD and the evaluation sums read nothing from the device, and
every algorithm reads a client's results a fixed number of times per client, however many steps it takes
(mpifl/training/syncdebug.py says why). The counter sees the reads a GPU would wait for; on a GPU the tests
also count CUDA's own synchronization warnings."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpifl.algorithms.base import ClientAlgorithm
from mpifl.algorithms.fedavg import FedAvgClient
from mpifl.comm import Message, Placement, Transport
from mpifl.comm.exactsum import ExactSum, _backends
from mpifl.comm.exactsum.distributed import DistributedSum
from mpifl.models import FlatModel
from mpifl.registry import get_algorithm
from mpifl.runtime.walker import PlanWalker
from mpifl.training import executor, sgd
from mpifl.training.config import ClientConfig
from mpifl.training.executor import local_sgd
from mpifl.training.sgd import client_generator, evaluate
from mpifl.training.syncdebug import (
    CASES,
    UPLOAD,
    HostSyncError,
    check,
    example,
    host_reads,
    host_syncs,
    host_traffic,
    main,
    refusing_host_syncs,
    step_configs,
)
from mpifl.training.vectorizing import VECTORIZABLE_MODELS
from tests.conftest import CUDA_ONLY, _merge, needs_cuda, run_engine
from tests.test_checkpoint import CONFIGS

DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]


def test_the_counter_sees_every_kind_of_read():
    t = torch.arange(3.0)
    with host_reads() as counts:
        if t[0] < 1:  # __bool__
            pass
        float(t[1]), int(t[2]), t[0].item(), t.tolist(), t.numpy(), t.cpu(), np.asarray(t), range(t[2].long())
    assert counts == Counter({"__bool__": 1, "__float__": 1, "__int__": 1, "item": 1, "tolist": 1, "numpy": 1,
                              "cpu": 1, "__array__": 1, "__index__": 1})
    assert "__bool__" not in vars(torch.Tensor) and bool(torch.tensor(1.0))  # the methods are torch's own again


def test_the_counter_sees_blocking_uploads_and_not_the_others():
    """A host tensor or host data moved to a device with a wait counts as an upload (on the CPU, the constructors
    that name a device: the copy they would make on a GPU); a pinned, non-blocking copy, a dtype change and a
    constructor without a device do not."""
    t = torch.arange(3.0)
    with host_reads() as counts:
        torch.tensor([1.0, 2.0], device="cpu"), torch.as_tensor(np.ones(3), device="cpu")
        torch.tensor([1.0]), torch.as_tensor(t, device="cpu"), t.to(torch.float64), t.to("cpu"), t.clone().copy_(t)
    assert counts == Counter({UPLOAD: 2})
    assert "to" not in vars(torch.Tensor) and torch.tensor.__module__ != __name__  # torch's own again
    if torch.cuda.is_available():
        with host_reads() as counts:
            t.to("cuda"), t.cuda(), torch.zeros(3, device="cuda").copy_(t), t.pin_memory().to("cuda")
            t.pin_memory().to("cuda", non_blocking=True), torch.zeros(3, device="cuda").copy_(t.pin_memory(), True)
        assert counts == Counter({UPLOAD: 4})


def test_the_traffic_counts_the_bytes_a_gpu_would_copy_each_way():
    """On the CPU nothing is copied, so the counter counts what a GPU rank would copy: a read copies what it reads
    (one element for a scalar; ``cpu().numpy()`` once), a door of ``DOORS`` its host data (a model loaded from a
    tensor nothing), host data built on a device or a host-made tensor moved to one its bytes; a dtype change, the
    host named as ``"cpu"`` and a tensor not made from host data inside the block (a device tensor, for the
    counter) copy nothing."""
    t = torch.arange(6.0)  # 24 bytes
    model = FlatModel(torch.nn.Linear(2, 1))  # 3 parameters: 12 bytes
    plan = sgd.BatchPlan(torch.arange(5), [0, 5], None)  # 40 bytes of int64 indices
    with host_traffic(sites=True) as traffic:
        float(t[1]), t[2].item(), t.numpy(), t.cpu().numpy(), t.tolist()
        assert traffic.to_host == 4 + 4 + 24 + 24 + 24 and traffic.to_device == 0
        sgd.to_device(t, "cpu"), executor.to_device(t, "cpu"), plan.to("cpu")
        model.load(np.zeros(3, np.float32)), model.load(torch.zeros(3))
        torch.tensor([1.0, 2.0], device="cpu"), torch.from_numpy(np.ones(2)).to(torch.device("cpu"))
        t.to(torch.float64), t.to("cpu"), t.to(torch.device("cpu")), torch.from_numpy(np.ones(2)).to("cpu")
    assert traffic.to_device == 24 + 24 + 40 + 12 + 8 + 16
    assert traffic.reads["numpy"] == 3  # the load's copy on the host is a read of the counter's, as before
    assert sum(traffic.sites.values()) == traffic.to_device + traffic.to_host  # type: ignore[union-attr]
    assert traffic.copies == {("to_host", 4): 2, ("to_host", 24): 3, ("to_device", 24): 2, ("to_device", 40): 1,
                              ("to_device", 12): 1, ("to_device", 8): 1, ("to_device", 16): 1}  # each copy's size
    assert all(where.startswith("tests/test_syncs.py:") for _, where in traffic.sites)  # type: ignore[union-attr]
    assert sgd.to_device is executor.to_device and "counted" not in sgd.to_device.__code__.co_name  # the originals
    assert "to" not in vars(sgd.BatchPlan) or sgd.BatchPlan.to.__code__.co_name == "to"


@needs_cuda
def test_the_traffic_counts_a_real_copy_once():
    """On a GPU a door's copy is counted once, by the door, not again by the copy it makes."""
    t = torch.arange(6.0)
    with host_traffic() as traffic:
        device = sgd.to_device(t, "cuda")
        FlatModel(torch.nn.Linear(2, 1).cuda()).load(np.zeros(3, np.float32))
        t.to("cuda"), device.cpu()
    assert (traffic.to_device, traffic.to_host) == (24 + 12 + 24, 24)


def syncs_do_not_grow(work, sizes=(2, 6)) -> list[int]:  # noqa: ANN001 - a callable of a batch size
    """The generic check: ``work(n)``'s host syncs (reads and blocking uploads) for each ``n`` of ``sizes`` (clients
    or rows of one batch) are equal, or the assertion says how they grew; returns them."""
    syncs = host_syncs(work, sizes)
    assert len(set(syncs)) == 1, f"host syncs grow with the batch: {dict(zip(sizes, syncs))}"
    return syncs


@pytest.mark.parametrize("device", DEVICES)
def test_the_exact_fold_syncs_once_per_batch_whatever_its_clients_and_groups(device):
    """The walker's fold of a worker's device rows (``DistributedSum.add_rows``, several groups: each group's total
    leaves the others' rows out on the device) reads the windows once per group and uploads nothing with a wait,
    for 2 or 6 clients; so does the batched fold alone (syncdebug's case)."""
    rows = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)).to(device)

    def fold(clients: int) -> None:
        msg = Message("delta", "up", 300, summed="weighting", groups=2)
        summed = DistributedSum(msg, Transport(None, Placement.balanced(np.ones(6, dtype=np.int64), 1)))
        summed.totals = [ExactSum(300, device=device) for _ in range(2)]  # torch's fold (CPU rows fold with numpy)
        summed.add_rows(rows[:clients], np.linspace(0.5, 1.0, clients), np.arange(clients) % 2)

    assert syncs_do_not_grow(fold) == [2, 2]
    assert dict(check(device, []))["exact fold of a batch of rows"] is None


def test_a_pageable_upload_per_block_fails_the_fold_check(monkeypatch):
    """Host arrays uploaded as the fold's weights were before (``torch.tensor(weights, device=...)``, pageable: a
    wait per block of rows) fail syncdebug's fold case, and a sync per row fails the generic check."""
    monkeypatch.setattr(_backends.TorchOps, "upload",
                        lambda self, array: torch.tensor(array, device=self.device))
    failure = dict(check("cpu", []))["exact fold of a batch of rows"]
    # the weights' and the kept rows' index uploads wait, beside the windows' read; so does a host wire's upload
    assert failure == "host syncs for 2 and 6 rows: [3, 3]; rounding a host and a device wire: [1, 0]"
    with pytest.raises(AssertionError, match="grow with the batch"):
        syncs_do_not_grow(lambda n: [torch.tensor([1.0] * 4, device="cpu") for _ in range(n)])


def test_refusing_fails_on_a_read_and_passes_without():
    with refusing_host_syncs("cpu") as counts:
        torch.ones(3).sum().mul_(2)
    assert not counts
    with pytest.raises(HostSyncError, match="__float__"), refusing_host_syncs("cpu"):
        float(torch.ones(3).sum())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_local_sgd_and_evaluation_sums_read_nothing(name, device):
    """Every model kind, with clipping, momentum, weight decay, crop-and-flip and both samplings, in the loop and
    (where it trains the kind) the batched kernel, and the batched exact fold (the GPU check's cases, also under
    CUDA's sync debug mode there)."""
    results = check(device, [name])
    ways = 2 if name in VECTORIZABLE_MODELS else 1
    assert len(results) == ways * len(step_configs(len(CASES[name][1]) == 3)) + 1
    assert sum(case.endswith(" kernel") for case, _ in results) == (ways - 1) * (len(results) - 1) // ways
    assert all(failure is None for _, failure in results), results


def clip_with_a_host_branch(params, grads, momentum, lr, cfg):  # noqa: ANN001, ANN201 - the step before PR 27
    if cfg.clip_norm is not None:
        norm = torch.linalg.vector_norm(grads)
        if norm > cfg.clip_norm:
            grads.mul_(cfg.clip_norm / (norm + 1e-6))
    params.add_(grads, alpha=-lr)


def test_a_host_branch_on_the_norm_is_caught(monkeypatch):
    """The check fails if the clipping branch on the host comes back: one read per step."""
    model, loss_fn, x, y = example("mlp", torch.device("cpu"))
    cfg = ClientConfig(steps=5, batch_size=4, clip_norm=0.1)
    monkeypatch.setattr(executor, "sgd_update", clip_with_a_host_branch)  # the executor's one update
    with host_reads() as counts:
        local_sgd(model, x, y, loss_fn, cfg, client_generator(0, 1, 0))
    assert counts == {"__bool__": 5}
    failures = dict(check("cpu", ["mlp"]))
    assert "__bool__" in failures["mlp epochs"] and failures["mlp fresh"] is None  # fresh: no clipping


def test_clipping_without_a_branch_is_the_branch_bitwise():
    """The factor is exactly 1.0 when no clipping is needed, and the branch's factor otherwise."""
    for scale in (1e-3, 1.0, 50.0):
        grads = torch.randn(100, generator=torch.Generator().manual_seed(1)) * scale
        branch, factor = grads.clone(), grads.clone()
        clip_with_a_host_branch(torch.zeros(100), branch, None, 0.0, ClientConfig(clip_norm=1.0))
        factor.mul_(sgd.clip_factor(torch.linalg.vector_norm(factor), 1.0))
        assert torch.equal(branch, factor)


@pytest.mark.parametrize("device", DEVICES)
def test_evaluation_reads_once_whatever_the_batches(device):
    for name in ("mlp", "linear"):
        model, loss_fn, x, y = example(name, torch.device(device))
        rows = []
        for batch in (1000, 3):
            with host_reads() as counts:
                rows.append(evaluate(model.module, x, y, loss_fn, batch=batch))
            assert sum(counts.values()) == 1, counts
        np.testing.assert_allclose(rows[0], rows[1], rtol=1e-6)


class ReadsPerClient:
    """Host reads per client of each call of a client side's local step and evaluation, by stage."""

    def __init__(self, monkeypatch, client_type: type[ClientAlgorithm]):  # noqa: ANN001
        self.calls: Counter[tuple[str, float]] = Counter()
        self.cuda_syncs: Counter[tuple[str, int]] = Counter()
        for method in ("compute_clients", "evaluate"):
            original = getattr(client_type, method)
            monkeypatch.setattr(client_type, method, self.counting(original))

    def counting(self, original):  # noqa: ANN001, ANN201
        def counted(client: ClientAlgorithm, step, *args):  # noqa: ANN001, ANN002, ANN202
            per = len(args[0]) if isinstance(args[0], np.ndarray) else 1  # compute_clients' clients, or one
            with warnings.catch_warnings(record=True) as caught, host_reads() as counts:
                warnings.simplefilter("always")
                if client.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = original(client, step, *args)
                finally:
                    if client.device.type == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
            syncs = sum("synchronizing" in str(w.message) for w in caught)
            self.calls[original.__name__, step.stage, sum(counts.values()) / per] += 1
            self.cuda_syncs[original.__name__, step.stage, syncs / per] += 1
            return result

        return counted


# few and many local steps for every algorithm: client.steps, the batch size (algorithms counting epochs) and
# FedALS's τ; kNN-Per searches a 2-point and an 11-point grid of λ
FEW = {"rounds": 1, "eval_every": 1, "client": {"steps": 2, "batch_size": 16}, "fedals": {"tau": 2},
       "knnper": {"k": [5], "weights": [0.0, 1.0]}}
MANY = {"rounds": 1, "eval_every": 1, "client": {"steps": 6, "batch_size": 5}, "fedals": {"tau": 6}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
def test_each_algorithm_reads_per_client_not_per_step(algorithm, device, tmp_path, monkeypatch):
    """The host reads of a client's local step and of its evaluation do not grow with its local steps (nor with
    kNN-Per's grid): a read inside a step loop, a per-batch loss read or ``if norm > clip`` would."""
    client_type = get_algorithm(algorithm).client
    counted = []
    for tag, overrides in (("few", FEW), ("many", MANY)):
        reads = ReadsPerClient(monkeypatch, client_type)
        run_engine(_merge(CONFIGS[algorithm], {**overrides, "device": device}), MPI.COMM_SELF, tmp_path / f"{tag}.h5")
        monkeypatch.undo()
        counted.append(reads)
    few, many = counted
    assert few.calls and few.calls == many.calls
    assert few.cuda_syncs == many.cuda_syncs


# the algorithms whose clients' local step is to read the host at most a few times a round, however many clients
BATCHED = ("fedavg", "fedprox", "scaffold", "fedals", "ifca", "fedbuff", "pefll")


@pytest.mark.parametrize("algorithm", BATCHED)
def test_a_batched_local_step_syncs_as_often_for_2_or_6_clients(algorithm, tmp_path, monkeypatch):
    """Through the executor's batch (``client.vectorize: true``), a call of the local step for 2 or for 6 clients
    makes the same number of host syncs (reads and blocking uploads): the losses, the rows kept on the host, the
    pick of IFCA's clusters each read once for all clients, never once per client."""
    client_type = get_algorithm(algorithm).client
    original = client_type.compute_clients
    per_call: list[int] = []

    def counted(client, step, clients):  # noqa: ANN001, ANN202
        with host_reads() as counts:
            seconds = original(client, step, clients)
        if step.stage == "train" and len(clients):
            per_call.append(sum(counts.values()))
        return seconds

    monkeypatch.setattr(client_type, "compute_clients", counted)

    def job(clients: int) -> None:
        per_call.clear()
        raw = _merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 2, "clients_per_round": clients,
                                          "client": {"vectorize": True}})
        run_engine(raw, MPI.COMM_SELF, tmp_path / f"{clients}.h5")

    syncs = {}
    for clients in (2, 6):
        job(clients)
        syncs[clients] = sorted(set(per_call))
    assert syncs[2] == syncs[6] and len(syncs[2]) == 1 and syncs[2][0] <= 3, syncs


def training_walk_syncs(raw: dict, out: Path, monkeypatch, stage: str = "train") -> list[int]:  # noqa: ANN001
    """The host syncs (reads and blocking uploads) of each training walk (or each walk of ``stage``) of ``raw``'s
    run on one rank: every message of the round both ways, the clients' local step and the server's side."""
    original, syncs = PlanWalker.walk, []

    def counted(walker: PlanWalker, round_: int, walked: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with host_reads() as counts:
            walk = original(walker, round_, walked, *args, **kwargs)
        if walked == stage:
            syncs.append(sum(counts.values()))
        return walk

    monkeypatch.setattr(PlanWalker, "walk", counted)
    run_engine(raw, MPI.COMM_SELF, out)
    monkeypatch.setattr(PlanWalker, "walk", original)
    return syncs


def device_deltas(client: FedAvgClient, step, clients: list[int], trained) -> None:  # noqa: ANN001
    """FedAvgClient.local_end's GPU branch on any device: the deltas left as rows of the trained tensor."""
    client.deltas.update(zip(clients, trained.params))


@pytest.mark.parametrize("algorithm", ["fedbuff", "pefll"])
def test_a_training_round_syncs_as_often_for_2_or_6_clients(algorithm, tmp_path, monkeypatch):
    """Issue 59: a whole training round on one rank (``client.vectorize: true``) syncs with the device as often for
    2 clients as for 6, and FedBuff's at most twice (the losses, the deltas). FedBuff's deltas travel as rows: left
    on the device, as FedAvg's GPU branch leaves a summed upload's (emulated here, as
    ``benchmarks/dispatch_proxy.py`` does), each would come to the host alone. PeFLL's φ load, descriptors and Δη_v
    cross between host and device once a step, not once a client (its round also reads the losses, the deltas and,
    on the server, η_v, the models, the Δv's, the update's norm and Adam's step counts, which live on the host)."""
    raw = _merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 2, "client": {"vectorize": True}})
    if algorithm == "fedbuff":  # equal links, as many in flight as a step takes: a round is one walk of them all
        raw = _merge(raw, {"network": {"distribution": "fixed"}})
        monkeypatch.setattr(FedAvgClient, "local_end", device_deltas)
    syncs = {}
    for clients in (2, 6):
        more = {"fedbuff": {"buffer_size": clients}} if algorithm == "fedbuff" else {}
        syncs[clients] = training_walk_syncs(_merge(raw, {"clients_per_round": clients, **more}),
                                             tmp_path / f"{clients}.h5", monkeypatch)
    assert syncs[2] == syncs[6] and (algorithm != "fedbuff" or max(syncs[2]) <= 2), syncs


def test_the_sync_check_runs_the_model_kinds_named(capsys):
    """``--models`` (the CPU rehearsal's, benchmarks/gpu_check.py --quick): those kinds' cases and the fold only;
    a kind it does not know is one line and exit code 2."""
    assert main(["--device", "cpu", "--models", "logistic"]) == 0
    cases = [line.split(None, 2)[2] for line in capsys.readouterr().out.splitlines()]
    assert cases == ["logistic epochs", "logistic epochs kernel", "logistic fresh", "logistic fresh kernel",
                     "exact fold of a batch of rows"]
    with pytest.raises(SystemExit) as stopped:
        main(["--models", "logistic,cnn3"])
    assert stopped.value.code == 2 and capsys.readouterr().err.endswith("error: --models: no cnn3\n")


def test_device_rows_of_a_rows_message_come_to_the_host_in_one_copy_a_step(tmp_path, monkeypatch):
    """A rows message's device rows (FedALS's extractors before an evaluation, kept on the device with each seen
    client's state) come to the host with the other clients' of the step, in one copy (``PlanWalker._read_together``):
    the evaluation's prelude reads as often for 3 seen clients as for 6, not once a client (before: 1,000 reads an
    evaluation with W2's 1,000 clients)."""
    from mpifl.algorithms.fedals import FedALSClient

    kept_on_host = FedALSClient.send_extractor  # the CPU keeps the state as arrays: a GPU's would be tensors
    monkeypatch.setattr(FedALSClient, "send_extractor",
                        lambda client, step, c: torch.from_numpy(np.array(kept_on_host(client, step, c))))
    syncs = {}
    for clients in (3, 6):
        raw = _merge(CONFIGS["fedals"], {"rounds": 2, "eval_every": 2, "clients_per_round": clients,
                                         "data": {"num_clients": clients}})
        syncs[clients] = training_walk_syncs(raw, tmp_path / f"{clients}.h5", monkeypatch, "eval_prelude")
    assert syncs[3] == syncs[6] and len(syncs[3]) == 1, syncs
