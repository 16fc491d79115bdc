"""Vectorized local SGD (torch.func): a client's update does not depend on the group it is trained in, and
for narrow layers it is bitwise that of the one-at-a-time loop."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from mpifl.data import build_federated_dataset
from mpifl.models import FlatModel, build_model, loss_function
from mpifl.registry import parse_config
from mpifl.training.config import ClientConfig
from mpifl.training.sgd import client_generator, local_sgd
from mpifl.training.vectorized import VectorizedSGD
from tests.conftest import run_mpifl


@pytest.mark.parametrize("hidden", [None, [32, 16]])
@pytest.mark.parametrize("options", [{}, {"momentum": 0.9, "weight_decay": 1e-3, "clip_norm": 0.5},
                                     {"augment": "crop_flip"}])  # each client's crops from its own generator
def test_groups_train_bitwise_as_one_client_at_a_time(hidden, options):
    torch.set_num_threads(1)
    model_cfg = {"name": "logistic"} if hidden is None else {"name": "mlp", "hidden": hidden}
    shape = [1, 5, 4] if options.get("augment") else [20]
    cfg = parse_config({"data": {"dataset": "gaussian_images", "num_clients": 7, "synthetic": {
        "image_shape": shape, "samples_per_client": 37}}, "model": model_cfg})
    data = build_federated_dataset(cfg.data, 0)
    splits = data.load_clients(range(7))
    client_cfg = ClientConfig(lr=0.1, epochs=2, batch_size=8, **options)
    flat = FlatModel(build_model(cfg.model, data.layout, 0))
    start = flat.numpy().copy()
    loss_fn = loss_function(data.layout)
    xs = [torch.from_numpy(splits[c].x_train) for c in range(7)]
    ys = [torch.from_numpy(splits[c].y_train) for c in range(7)]
    assert len({len(x) for x in xs}) == 1 and len(xs[0]) % 8  # one group, with a short last batch
    trainer = VectorizedSGD(flat, loss_fn)
    for group in (range(7), range(2, 5)):
        params, stats = trainer.train(start, [xs[c] for c in group], [ys[c] for c in group],
                                      [client_generator(3, 1, c) for c in group], client_cfg)
        for k, c in enumerate(group):
            flat.load(start)
            alone = local_sgd(flat, xs[c], ys[c], loss_fn, client_cfg, client_generator(3, 1, c))
            assert torch.equal(params[k], flat.params), f"client {c} in a group of {len(group)}"
            assert (stats[k].steps, stats[k].mean_loss) == (alone.steps, alone.mean_loss)


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
        trainer = VectorizedSGD(flat, loss_function(data.layout))
        client_cfg = ClientConfig(lr=0.1, epochs=1, batch_size=32, momentum=0.9)
        updates: dict[int, list[torch.Tensor]] = {}
        for group in (range(5), range(1, 4), range(2, 3)):
            params, _ = trainer.train(start, [torch.from_numpy(splits[c].x_train) for c in group],
                                      [torch.from_numpy(splits[c].y_train) for c in group],
                                      [client_generator(3, 1, c) for c in group], client_cfg)
            for k, c in enumerate(group):
                updates.setdefault(c, []).append(params[k].clone())
        assert torch.get_num_threads() == 2  # the kernel's one thread is given back
        for c, versions in updates.items():
            assert all(torch.equal(versions[0], v) for v in versions[1:]), f"client {c}"
    finally:
        torch.set_num_threads(1)


def test_fedavg_job_vectorized_or_not_and_on_any_rank_count_gives_one_model(write_config, tmp_path):
    config = write_config({"rounds": 2, "clients_per_round": 6, "model": {"name": "mlp", "hidden": [16]},
                           "data": {"dataset": "gaussian_images", "num_clients": 12, "unseen_fraction": 0,
                                    "synthetic": {"image_shape": [30], "samples_per_client": 24}},
                           "client": {"momentum": 0.5, "batch_size": 8}})
    models, together = {}, {}
    for mode, ranks in (("false", 0), ("true", 0), ("true", 3)):
        out = tmp_path / f"{mode}{ranks}.h5"
        proc = run_mpifl(["run", str(config), "--out", str(out), "--quiet", "--set", f"client.vectorize={mode}"],
                         ranks=ranks)
        assert proc.returncode == 0, proc.stderr
        with h5py.File(out) as f:
            models[mode, ranks] = f["model/global_model"][()]
            together[mode, ranks] = f["ranks/clients_trained_vectorized"][()].sum()
    assert together == {("false", 0): 0, ("true", 0): 12, ("true", 3): 12}
    assert np.array_equal(models["false", 0], models["true", 0])
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
