"""Vectorized local SGD (torch.func): a client's update does not depend on the group it is trained in, is within
rounding of the one-at-a-time loop for every vectorizable model and algorithm, and bitwise that of the loop for
narrow dense layers."""

from __future__ import annotations

import math
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpifl.data import build_federated_dataset
from mpifl.models import FlatModel, build_model, loss_function
from mpifl.models.config import ModelConfig
from mpifl.registry import parse_config
from mpifl.schema import ConfigError
from mpifl.training.config import ClientConfig
from mpifl.training.executor import LocalSGD, local_sgd
from mpifl.training.localstep import ClientRun, ClientStart, LocalStep
from mpifl.training.sgd import client_generator
from mpifl.training.vectorizing import PADDING_BOUND, VECTORIZABLE_MODELS, auto_chunk, padded_work, vectorize_wanted
from tests.conftest import (
    HANG_S,
    REPO,
    _merge,
    assert_same,
    deterministic,
    mpi_env,
    needs_cuda,
    run_engine,
    run_mpifl,
)
from tests.test_checkpoint import CONFIGS
from tests.test_models import layout

# every vectorizable convolutional model, on images small enough for a quick test
CNNS = {
    "cnn": ({"name": "cnn", "channels": [4, 8], "fc_hidden": 16}, (1, 16, 16)),
    "lenet": ({"name": "lenet"}, (3, 16, 16)),
    "convnet": ({"name": "convnet", "channels": [4, 8], "kernel_size": 3, "hidden": [16, 8]}, (2, 14, 14)),
    "resnet20": ({"name": "resnet20"}, (3, 8, 8)),
    "resnet20 batch_norm": ({"name": "resnet20", "batch_norm": True}, (3, 8, 8)),
    "simple_cnn": ({"name": "simple_cnn"}, (3, 10, 10)),
}
SIZES = (20, 24, 19, 22, 24, 17, 23)  # 3 batches of 8 each, the last one 1 to 8 samples: one group, ragged steps


def clients(shape: tuple[int, ...], sizes=SIZES) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, *shape, generator=gen) for n in sizes]
    ys = [torch.randint(0, 10, (n,), generator=gen) for n in sizes]
    return xs, ys


def train(trainer: LocalSGD, start: np.ndarray, xs, ys, group, cfg: ClientConfig):  # noqa: ANN001, ANN201
    runs = [ClientRun(ClientStart(start), xs[c], ys[c], client_generator(3, 1, c)) for c in group]
    return trainer.train(runs, LocalStep(), cfg)


@pytest.mark.parametrize("name", CNNS)
def test_a_cnn_clients_update_is_the_same_in_any_group_and_within_rounding_of_the_loop(name):
    """Groups of 7 (two calls of 4, the second padded), 3, 1 and 2 (in reverse order): each client's update is
    bitwise the same, though a grouped convolution's rounding on this CPU changes with the number of clients
    (without the fixed calls of ``vectorize_chunk`` rows, a group of one or two rounds differently)."""
    torch.set_num_threads(1)
    model_cfg, shape = CNNS[name]
    flat = FlatModel(build_model(ModelConfig(**model_cfg), layout(shape), seed=0))
    start = flat.numpy().copy()
    loss_fn = torch.nn.CrossEntropyLoss()
    xs, ys = clients(shape)
    cfg = ClientConfig(lr=0.05, epochs=1, batch_size=8, momentum=0.9, weight_decay=1e-3, clip_norm=5.0,
                       augment="crop_flip", vectorize=True, vectorize_chunk=4)
    trainer = LocalSGD(flat, loss_fn, vectorized=True, chunk=4)
    assert trainer.chunk == 4
    updates: dict[int, list[torch.Tensor]] = {}
    for group in (range(7), range(2, 5), [4], [5, 1]):
        result = train(trainer, start, xs, ys, list(group), cfg)
        for k, c in enumerate(group):
            updates.setdefault(c, []).append(result.params[k].clone())
            if len(updates[c]) == 1:  # the loop, once per client
                flat.load(start)
                alone = local_sgd(flat, xs[c], ys[c], loss_fn, cfg, client_generator(3, 1, c))
                assert result.steps[k] == alone.steps == 3
                assert result.mean_losses()[k] == pytest.approx(alone.mean_loss, rel=1e-5)
                torch.testing.assert_close(result.params[k], flat.params, rtol=1e-4, atol=1e-6)
                assert not torch.equal(result.params[k], torch.from_numpy(start))
    for c, versions in updates.items():
        assert all(torch.equal(versions[0], v) for v in versions[1:]), f"client {c}"


@pytest.mark.parametrize("hidden", [None, [32, 16]])
@pytest.mark.parametrize("options", [{}, {"momentum": 0.9, "weight_decay": 1e-3, "clip_norm": 0.5},
                                     {"augment": "crop_flip"}])  # each client's crops from its own generator
def test_dense_groups_train_bitwise_as_one_client_at_a_time(hidden, options):
    """Also with unequal sample counts and so unequal last batches (35 to 40 samples: 5 batches of 8 per pass,
    the last 3 to 8), which the kernel computes in separate calls. (A batch of one sample rounds differently:
    the loop's matrix-vector product is not the kernel's batched product.)"""
    torch.set_num_threads(1)
    model_cfg = ModelConfig(name="logistic") if hidden is None else ModelConfig(name="mlp", hidden=tuple(hidden))
    shape = (1, 5, 4) if options.get("augment") else (20,)
    sizes = (37, 37, 35, 37, 40, 37, 36)
    flat = FlatModel(build_model(model_cfg, layout(shape), seed=0))
    start = flat.numpy().copy()
    loss_fn = torch.nn.CrossEntropyLoss()
    xs, ys = clients(shape, sizes)
    cfg = ClientConfig(lr=0.1, epochs=2, batch_size=8, **options)
    trainer = LocalSGD(flat, loss_fn, vectorized=True, chunk=4)
    assert trainer.chunk is None  # a dense model's rows are computed alone on the CPU: no padding needed
    for group in (range(7), range(2, 5)):
        result = train(trainer, start, xs, ys, list(group), cfg)
        for k, c in enumerate(group):
            flat.load(start)
            alone = local_sgd(flat, xs[c], ys[c], loss_fn, cfg, client_generator(3, 1, c))
            assert torch.equal(result.params[k], flat.params), f"client {c} in a group of {len(group)}"
            assert (result.steps[k], result.mean_losses()[k]) == (alone.steps, alone.mean_loss)


WIDE = """
import sys, torch
from mpifl.models import FlatModel, build_model
from mpifl.models.config import ModelConfig
from mpifl.training.config import ClientConfig
from mpifl.training.executor import LocalSGD
from mpifl.training.localstep import ClientRun, ClientStart, LocalStep
from mpifl.training.sgd import client_generator
from tests.test_models import layout
from tests.test_vectorized import clients
torch.set_num_threads(1)
flat = FlatModel(build_model(ModelConfig(name="mlp", hidden=(512, 128)), layout((300,)), seed=0))
start = flat.numpy().copy()
xs, ys = clients((300,), (300, 290, 300, 281, 300))
cfg = ClientConfig(lr=0.05, steps=3, batch_size=200, momentum=0.9, weight_decay=1e-3)
params = [LocalSGD(flat, torch.nn.CrossEntropyLoss(), batched, chunk=4).train(
    [ClientRun(ClientStart(start), x, y, client_generator(3, 1, c)) for c, (x, y) in enumerate(zip(xs, ys))],
    LocalStep(), cfg
).params.clone() for batched in (False, True)]
print(torch.equal(*params), float((params[0] - params[1]).abs().max()))
"""


@pytest.mark.parametrize("kernels", ["portable", "native"])
def test_wide_dense_layers_round_as_the_loop_on_any_cpu_path(kernels):
    """512 and 128 units fed 300 inputs, batches of 200 (the sums MKL rounds by code path once the batch's linear
    layers multiplied in another order than the loop's: mpifl/training/rounding.py), on the pinned CPU kernels and
    on this CPU's own: the batch gives the loop's bits."""
    proc = subprocess.run([sys.executable, "-c", WIDE], capture_output=True, text=True, timeout=HANG_S, cwd=REPO,
                          env={**mpi_env(), "MPIFL_CPU_KERNELS": kernels})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "True", proc.stdout


def test_clients_with_unequal_step_counts_train_in_separate_groups():
    """8, 16 and 16 samples in batches of 8: 1, 2 and 2 steps, the last two in one group; each client's steps
    and update are its own (as trained alone in the kernel, and within rounding of the loop)."""
    torch.set_num_threads(1)
    flat = FlatModel(build_model(ModelConfig(name="mlp", hidden=(8,)), layout((6,)), seed=0))
    start = flat.numpy().copy()
    loss_fn = torch.nn.CrossEntropyLoss()
    xs, ys = clients((6,), (8, 16, 16))
    cfg = ClientConfig(lr=0.1, batch_size=8)
    trainer = LocalSGD(flat, loss_fn, vectorized=True, chunk=4)
    result = train(trainer, start, xs, ys, [0, 1, 2], cfg)
    assert result.steps.tolist() == [1, 2, 2]
    assert result.seconds.shape == (3,) and result.seconds[1] == result.seconds[2]
    for c in range(3):
        assert torch.equal(result.params[c], train(trainer, start, xs, ys, [c], cfg).params[0])
        flat.load(start)
        local_sgd(flat, xs[c], ys[c], loss_fn, cfg, client_generator(3, 1, c))
        torch.testing.assert_close(result.params[c], flat.params, rtol=1e-5, atol=1e-7)
        assert not torch.equal(result.params[c], torch.from_numpy(start))


BATCH_IN_A_FRESH_PROCESS = """
import sys, torch
from mpifl.models import FlatModel, build_model
from mpifl.models.config import ModelConfig
from mpifl.training.config import ClientConfig
from mpifl.training.executor import LocalSGD
from mpifl.training.localstep import ClientRun, ClientStart, LocalStep
from mpifl.training.sgd import client_generator
from tests.test_models import layout
flat = FlatModel(build_model(ModelConfig(name="cnn", channels=(2,), fc_hidden=4), layout((1, 6, 6)), seed=0))
runs = [ClientRun(ClientStart(flat.numpy().copy()), torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8,)),
                  client_generator(3, 1, c)) for c in range(3)]
trained = LocalSGD(flat, torch.nn.CrossEntropyLoss(), vectorized=True, chunk=4).train(runs, LocalStep(),
                                                                                     ClientConfig(batch_size=4))
assert trained.steps.tolist() == [2, 2, 2], trained.steps
print(sorted(name for name in sys.modules if name.startswith("torch._dynamo")))
"""


def test_the_batch_does_not_import_torch_dynamo():
    """A worker that trains its clients in the batch starts no heavier than one that loops: ``torch.func.grad``
    imported ``torch._dynamo`` on its first call (a second of CPU per process); the batch's autograd over a
    vmapped forward pass does not (a fresh interpreter, as a rank is)."""
    proc = subprocess.run([sys.executable, "-c", BATCH_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                          timeout=HANG_S, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_a_clients_update_does_not_depend_on_its_group_even_on_two_threads():
    """A wide layer, where the kernel and the loop round differently, trained on a two-thread rank: the
    group (which is what the rank count changes) must not matter."""
    torch.set_num_threads(2)
    try:
        cfg = parse_config({"algorithm": "fedavg", "data": {"dataset": "gaussian_images", "num_clients": 5,
                            "synthetic": {"image_shape": [784], "samples_per_client": 100}},
                            "model": {"name": "mlp", "hidden": [64]}})
        data = build_federated_dataset(cfg.data, 0)
        splits = data.load_clients(range(5))
        flat = FlatModel(build_model(cfg.model, data.layout, 0))
        start = flat.numpy().copy()
        client_cfg = ClientConfig(lr=0.1, epochs=1, batch_size=32, momentum=0.9)
        trainer = LocalSGD(flat, loss_function(data.layout), vectorized=True, chunk=4)
        xs = [torch.from_numpy(splits[c].x_train) for c in range(5)]
        ys = [torch.from_numpy(splits[c].y_train) for c in range(5)]
        updates: dict[int, list[torch.Tensor]] = {}
        for group in (range(5), range(1, 4), range(2, 3)):
            result = train(trainer, start, xs, ys, list(group), client_cfg)
            for k, c in enumerate(group):
                updates.setdefault(c, []).append(result.params[k].clone())
        assert torch.get_num_threads() == 2  # the kernel's one thread is given back
        for c, versions in updates.items():
            assert all(torch.equal(versions[0], v) for v in versions[1:]), f"client {c}"
    finally:
        torch.set_num_threads(1)


def test_auto_is_the_kernel_on_a_gpu_and_on_the_cpu_only_where_it_was_measured_faster():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    auto, on, off = ClientConfig(), ClientConfig(vectorize=True), ClientConfig(vectorize=False)
    assert auto.vectorize == "auto"
    for model in VECTORIZABLE_MODELS:
        dense = model in ("linear", "logistic", "mlp")
        assert vectorize_wanted(auto, model, cpu, cpu_default=True) == dense
        assert not vectorize_wanted(auto, model, cpu, cpu_default=False)
        assert vectorize_wanted(auto, model, gpu, cpu_default=False)
        assert vectorize_wanted(on, model, cpu, cpu_default=False)
        assert not vectorize_wanted(off, model, gpu, cpu_default=True)
    assert not vectorize_wanted(on, "char_lstm", cpu, cpu_default=True)


@pytest.mark.parametrize("value", ["yes", 1, "Auto"])
def test_vectorize_takes_true_false_or_auto(value):
    with pytest.raises(ConfigError, match="client.vectorize"):
        parse_config({"client": {"vectorize": value}})


# FedAvg's local step and its variants: the gradient transforms, SCAFFOLD's control variates after training, FedSGD's
# full-batch gradients, kNN-Per's evaluation and FedBuff's clients starting from different model versions; and the
# other algorithms whose clients run plain local SGD from a start of their own: FedAsync (the model it downloaded),
# Local (its own model), IFCA (its cluster's), PeFLL and pFedHN (the generated one)
DENSE_ALGORITHMS = ("fedavg", "fedprox", "scaffold", "fedsgd", "knnper", "fedbuff", "fedasync", "local", "ifca")
KERNEL_ALGORITHMS = (*DENSE_ALGORITHMS, "pefll", "pfedhn")  # those that took the batch before the one executor
# FedALS: carried momentum, per-round rate and SCAFFOLD option as per-row state; FedRep: its head, then its body
NEWLY_BATCHED = ("fedals", "fedrep")
IMAGES = {"data": {"dataset": "gaussian_images", "num_clients": 6, "partition": "iid",
                   "synthetic": {"image_shape": [1, 16, 16], "samples_per_client": 30, "size_sigma": 0.3}},
          "model": CNNS["cnn"][0], "rounds": 2, "eval_every": 2, "client": {"vectorize_chunk": 4}}


def run_both(raw: dict, tmp_path) -> dict[str, h5py.File]:  # noqa: ANN001
    out = {}
    for mode in (False, True):
        path = run_engine(_merge(raw, {"client": {"vectorize": mode}}), MPI.COMM_SELF, tmp_path / f"{mode}.h5")
        out["kernel" if mode else "loop"] = h5py.File(path)
    return out


def assert_within_rounding(runs: dict[str, h5py.File]) -> None:
    """The batch's run within the rounding performance.md states of the loop's (1e-6 + 1e-4·|loop's value|) in every
    model entry, evaluation and loss, and not bitwise (else only one of the paths ran)."""
    assert runs["loop"]["ranks/clients_trained_vectorized"][()].sum() == 0
    assert runs["kernel"]["ranks/clients_trained_vectorized"][()].sum() > 0
    pairs = [(runs["kernel"][name][()], runs["loop"][name][()]) for name in
             [f"model/{k}" for k in runs["loop"]["model"]]  # the global model, cluster models, ...; Local keeps none
             + [f"eval/{k}" for k in runs["loop"]["eval"]] + ["rounds/train_loss"]]  # kNN-Per's evaluation included
    for kernel, loop in pairs:
        np.testing.assert_allclose(kernel, loop, rtol=1e-4, atol=1e-6)
    assert not all(np.array_equal(k, lo) for k, lo in pairs), "the same bits: did only one of the paths run?"


@pytest.mark.parametrize("algorithm", KERNEL_ALGORITHMS + NEWLY_BATCHED)
def test_every_kernel_algorithm_trains_a_cnn_within_rounding_of_the_loop(algorithm, tmp_path):
    """Clients of unequal sizes (log-normal) and 4 local steps: groups with unequal last batches."""
    assert_within_rounding(run_both(_merge(CONFIGS[algorithm], IMAGES), tmp_path))


# the algorithms whose local step changes the gradient (LocalStep.transform): FedProx's proximal term, SCAFFOLD's
# correction and its Σ gₖ, FedALS's SCAFFOLD option; μ large enough that FedProx's term is far above the rounding
TRANSFORMS = {"fedprox": _merge(CONFIGS["fedprox"], {"fedprox": {"mu": 1.0}}), "scaffold": CONFIGS["scaffold"],
              "fedals_scaffold": _merge(CONFIGS["fedals"], {"fedals": {"scaffold": True, "tau": 3}})}
# 24 iid clients of 59 or 60 training samples, 3 steps of 8: one group of equal batches, in calls of 5 rows (the
# CNN's fixed call size on the CPU), so 19 of the 24 clients train in a step's second to fifth call
CALLS = {"rounds": 2, "eval_every": 2, "clients_per_round": 24,
         "data": {"dataset": "digits", "num_clients": 24, "partition": "iid", "unseen_fraction": 0},
         "model": {"name": "cnn", "channels": [2], "fc_hidden": 8},
         "client": {"batch_size": 8, "steps": 3, "vectorize_chunk": 5}}


@pytest.mark.parametrize("algorithm", TRANSFORMS)
def test_the_gradient_transform_applies_on_every_call_of_a_batched_step(algorithm, tmp_path):
    """A step's rows beyond its first call get the transform with their own values (issue 59: the suite's groups
    fitted one call, so a transform skipped or misapplied on later calls passed every test)."""
    raw = _merge(TRANSFORMS[algorithm], CALLS)
    cfg = parse_config(raw)
    splits = build_federated_dataset(cfg.data, cfg.seed).load_clients(range(24))
    sizes = [len(split.y_train) for split in splits.values()]
    assert min(sizes) >= 3 * 8, sizes  # every client takes three full batches: one group
    runs = run_both(raw, tmp_path)
    assert runs["kernel"]["ranks/clients_trained_vectorized"][()].sum() == 2 * 24
    assert_within_rounding(runs)


@pytest.mark.parametrize("algorithm", DENSE_ALGORITHMS + NEWLY_BATCHED + ("fedals_scaffold",))
def test_every_kernel_algorithm_with_a_narrow_dense_model_is_bitwise_the_loop(algorithm, tmp_path):
    """SHARDS' MLP 16: here FedProx, SCAFFOLD, FedSGD, FedAsync, Local and IFCA give the same bits in the kernel as
    in the loop (their CPU default under ``auto``)."""
    raw = CONFIGS[algorithm] if algorithm in CONFIGS else _merge(CONFIGS["fedals"], {"fedals": {"scaffold": True}})
    runs = run_both(raw, tmp_path)
    assert runs["kernel"]["ranks/clients_trained_vectorized"][()].sum() > 0
    assert_same(deterministic(runs["kernel"].filename), deterministic(runs["loop"].filename))


def test_fedavg_job_vectorized_or_not_and_on_any_rank_count_gives_one_model(write_config, tmp_path):
    config = write_config({"rounds": 2, "clients_per_round": 6, "model": {"name": "mlp", "hidden": [16]},
                           "data": {"dataset": "gaussian_images", "num_clients": 12, "unseen_fraction": 0,
                                    "synthetic": {"image_shape": [30], "samples_per_client": 24}},
                           "client": {"momentum": 0.5, "batch_size": 8}})
    models, together = {}, {}
    for mode, ranks in (("false", 0), ("auto", 0), ("true", 3)):
        out = tmp_path / f"{mode}{ranks}.h5"
        proc = run_mpifl(["run", str(config), "--out", str(out), "--quiet", "--set", f"client.vectorize={mode}"],
                         ranks=ranks)
        assert proc.returncode == 0, proc.stderr
        with h5py.File(out) as f:
            models[mode, ranks] = f["model/global_model"][()]
            together[mode, ranks] = f["ranks/clients_trained_vectorized"][()].sum()
    assert together == {("false", 0): 0, ("auto", 0): 12, ("true", 3): 12}
    assert np.array_equal(models["false", 0], models["auto", 0])
    assert np.array_equal(models["false", 0], models["true", 3])


def test_wide_layers_on_two_threads_give_one_model_on_any_rank_count(write_config, tmp_path):
    config = write_config({"rounds": 2, "clients_per_round": 6, "threads_per_rank": 2,
                           "model": {"name": "mlp", "hidden": [64]},
                           "data": {"dataset": "gaussian_images", "num_clients": 6, "unseen_fraction": 0,
                                    "synthetic": {"image_shape": [784], "samples_per_client": 64}},
                           "client": {"momentum": 0.5, "batch_size": 16}})
    models = {}
    for ranks in (0, 3):  # one group of six clients, or groups of three on each worker
        out = tmp_path / f"{ranks}.h5"
        proc = run_mpifl(["run", str(config), "--out", str(out), "--quiet"], ranks=ranks)
        assert proc.returncode == 0, proc.stderr
        with h5py.File(out) as f:
            models[ranks] = f["model/global_model"][()]
    assert np.array_equal(models[0], models[3])


def test_auto_chunk_keeps_w2s_padding_small_on_any_worker_count_and_depends_on_the_config_alone():
    """W2's 50 clients a round spread over 1, 2 or 4 worker ranks: every call's rows at most 1.25× the real ones
    (64-row calls were 1.28×, 2.56× and 5.1×) in the fewest calls (13 rows: 4 a step); the chunk is a function of
    the cohort, not of the rank count (a client's bits may depend on its call's size), and 16 on the CPU as before."""
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    chunk = auto_chunk(50, gpu)
    assert [padded_work(50, w, 64) for w in (1, 2, 4)] == [1.28, 2.56, 5.12]
    assert chunk == 13 and all(padded_work(50, w, chunk) <= PADDING_BOUND for w in (1, 2, 4))
    assert math.ceil(1000 / auto_chunk(1000, gpu)) == 16 and auto_chunk(50, cpu) == 16  # 16 calls of ~64 rows
    for cohort in (1, 3, 7, 20, 100, 333, 5000):
        chunk = auto_chunk(cohort, gpu)
        assert all(padded_work(cohort, w, chunk) <= PADDING_BOUND for w in (1, 2, 4) if w <= cohort)


@pytest.mark.parametrize("batched", [False, True])
def test_a_start_may_be_a_tensor(batched):
    """Starts held as tensors (a client state kept on the device), some shared and some a client's own, train to
    the bits of the same starts as host arrays, in the loop and in the batch."""
    torch.set_num_threads(1)
    flat = FlatModel(build_model(ModelConfig(name="mlp", hidden=(16,)), layout((20,)), seed=0))
    shared = flat.numpy().copy()
    own = shared + np.float32(0.01)
    xs, ys = clients((20,))
    cfg = ClientConfig(lr=0.1, epochs=1, batch_size=8, momentum=0.9)
    trainer = LocalSGD(flat, torch.nn.CrossEntropyLoss(), vectorized=batched, chunk=4)
    starts = [shared, shared, own, shared, own.copy(), shared, shared]
    results = []
    for as_tensor in (False, True):
        held = {id(s): torch.from_numpy(s.copy()) for s in starts} if as_tensor else {}
        runs = [ClientRun(ClientStart(held.get(id(s), s)), xs[c], ys[c], client_generator(3, 1, c))
                for c, s in enumerate(starts)]
        results.append(trainer.train(runs, LocalStep(delta=True), cfg).params.clone())
    assert torch.equal(results[0], results[1])


def test_the_batched_step_keeps_its_storage_across_steps_and_rounds_and_reads_nothing(monkeypatch):
    """Every call's step (two calls of 4 rows, ragged last batches, momentum, FedProx-like transform) reads and
    writes the same parameters, momentum, sample indices, inputs and targets step after step and round
    after round: what a CUDA graph captures; and nothing inside it is read on the host. ``cuda_graph`` on the CPU is
    the same eager code, bitwise."""
    from mpifl.training import executor
    from mpifl.training.syncdebug import host_reads

    torch.set_num_threads(1)
    model_cfg, shape = CNNS["cnn"]
    flat = FlatModel(build_model(ModelConfig(**model_cfg), layout(shape), seed=0))
    start = flat.numpy().copy()
    xs, ys = clients(shape, (20,) * 6)  # one group: batches of 8, 8 and 4
    cfg = ClientConfig(lr=0.05, epochs=1, batch_size=8, momentum=0.9, clip_norm=5.0, augment="crop_flip")
    step = LocalStep(transform=lambda params, grads, rows: grads.add_(params - rows["start"], alpha=0.01))
    seen: dict[tuple, set[tuple[int, ...]]] = {}
    reads: list[dict] = []
    call_step = executor.LocalSGD._call_step

    def recorded(self, block, call, xb, yb, loss_sums, real, step, cfg):  # noqa: ANN001, ANN202
        index = self.buffers.held["index"][(tuple(yb.shape), torch.int64)]
        storage = tuple(t.untyped_storage().data_ptr() for t in (block.params, block.momentum, index, xb, yb))
        seen.setdefault((id(self), call.start, tuple(yb.shape)), set()).add(storage)
        with host_reads() as counts:
            call_step(self, block, call, xb, yb, loss_sums, real, step, cfg)
        reads.append(dict(counts))

    monkeypatch.setattr(executor.LocalSGD, "_call_step", recorded)
    results = []
    for cuda_graph in (False, True):
        trainer = LocalSGD(flat, loss_function(layout(shape)), vectorized=True, chunk=4, cuda_graph=cuda_graph)
        assert trainer.cuda_graph is False  # on the CPU: eager
        for round_ in (1, 2):
            runs = [ClientRun(ClientStart(start), x, y, client_generator(3, round_, c))
                    for c, (x, y) in enumerate(zip(xs, ys))]
            results.append(trainer.train(runs, step, cfg).params)
    assert len(seen) == 2 * 2 * 2  # two trainers, two calls, two batch sizes
    assert all(len(storages) == 1 for storages in seen.values()), seen  # the same storage every step and round
    assert len(reads) == 2 * 2 * 2 * 3 and not any(reads)  # 2 trainers x 2 rounds x 2 calls x 3 steps
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])
    assert not torch.equal(results[0], results[1])  # the rounds drew other batches


@needs_cuda
def test_a_captured_step_is_bitwise_the_eager_step_on_cuda():
    """``client.cuda_graph`` on a GPU: the captured and replayed step gives the eager step's bits."""
    model_cfg, shape = CNNS["cnn"]
    device = torch.device("cuda")
    results = []
    for cuda_graph in (False, True):
        flat = FlatModel(build_model(ModelConfig(**model_cfg), layout(shape), seed=0).to(device))
        xs, ys = clients(shape)
        runs = [ClientRun(ClientStart(flat.numpy().copy()), x.to(device), y.to(device), client_generator(3, 1, c))
                for c, (x, y) in enumerate(zip(xs, ys))]
        cfg = ClientConfig(lr=0.05, epochs=2, batch_size=8, momentum=0.9, clip_norm=5.0)
        trainer = LocalSGD(flat, loss_function(layout(shape)), vectorized=True, chunk=4, cuda_graph=cuda_graph)
        results.append(trainer.train(runs, LocalStep(delta=True), cfg).params.cpu())
    assert torch.equal(results[0], results[1])
