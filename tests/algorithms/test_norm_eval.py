"""BatchNorm at evaluation: inference with statistics estimated on training data, never the test batch's own.

FedALS averages every seen client's statistics (the authors average running statistics); every other
algorithm uses the evaluating client's own training split."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import StepContext
from mpifl.models.norm import norm_size, norm_statistics, normalized_with
from mpifl.training.sgd import evaluate
from tests.algorithms.conftest import both_sides, walk
from tests.conftest import _merge

BN = {
    "rounds": 1,
    "clients_per_round": 4,
    "seed": 9,
    "eval_every": 1,
    "data": {"dataset": "gaussian_images", "num_clients": 5, "partition": "classes", "classes_per_client": 2,
             "synthetic": {"samples_per_client": 24, "image_shape": [3, 8, 8], "num_classes": 4}},
    "model": {"name": "resnet20", "batch_norm": True},
    "client": {"lr": 0.05, "steps": 2, "batch_size": 8, "momentum": 0.9},
}


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, track_running_stats=False), nn.ReLU(),
                         nn.Flatten(), nn.Linear(3 * 4 * 4, 2))


def test_statistics_are_the_sample_weighted_mean_of_batch_statistics():
    net = tiny_net()
    x = torch.randn(11, 2, 6, 6)
    stats = norm_statistics(net, x, batch=4)
    assert stats.shape == (norm_size(net),) == (6,)
    h = net[0](x).detach().double()
    means = [h[i : i + 4].mean(dim=(0, 2, 3)) for i in range(0, 11, 4)]
    variances = [h[i : i + 4].var(dim=(0, 2, 3)) for i in range(0, 11, 4)]
    sizes = torch.tensor([4.0, 4.0, 3.0], dtype=torch.float64)[:, None]
    np.testing.assert_allclose(stats[:3], (torch.stack(means) * sizes).sum(0) / 11, rtol=1e-6)
    np.testing.assert_allclose(stats[3:], (torch.stack(variances) * sizes).sum(0) / 11, rtol=1e-6)


def test_inference_with_given_statistics_does_not_depend_on_the_batch():
    net = tiny_net()
    x = torch.randn(6, 2, 6, 6)
    stats = norm_statistics(net, torch.randn(40, 2, 6, 6), batch=8)
    with normalized_with(net, stats):
        together = net(x)
        alone = torch.cat([net(x[i : i + 1]) for i in range(6)])
        bn = net[1]
        expected = bn.weight[None, :, None, None] * (net[0](x) - torch.tensor(stats[:3], dtype=torch.float32)[
            None, :, None, None]) / torch.sqrt(torch.tensor(stats[3:], dtype=torch.float32)[None, :, None, None]
                                               + bn.eps) + bn.bias[None, :, None, None]
        np.testing.assert_allclose(net[2:](expected).detach(), together.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(together, alone)
    assert net.training and net[1].running_mean is None  # back to batch statistics for training
    assert not torch.allclose(net(x[:2]), together[:2])


def test_fedals_evaluates_with_the_population_average_of_client_statistics():
    ctx, server, client = both_sides(_merge(BN, {"algorithm": "fedals", "fedals": {"alpha": 2, "tau": 2}}))
    seen = np.flatnonzero(~ctx.layout.unseen)
    walk(server, client, server.protocol.train_plan(1), 1, seen[:3])  # clients differ: 3 trained, others not
    prelude = walk(server, client, server.protocol.eval_prelude(), 1, seen, stage="eval_prelude")
    stats = {}
    for c in seen:
        client.workspace.load(client.current_model(int(c)))
        stats[int(c)] = norm_statistics(client.workspace.module, client.data[int(c)].x_train, 8)
    np.testing.assert_array_equal(prelude["norm_statistics"], np.stack([stats[int(c)] for c in seen]))
    sizes = ctx.layout.train_sizes[seen].astype(np.float64)
    average = (sizes / sizes.sum()) @ np.stack([stats[int(c)] for c in seen])
    rows = walk(server, client, server.protocol.eval_plan(), 1, np.arange(ctx.layout.num_clients), stage="eval")
    np.testing.assert_allclose(rows["eval_norm_statistics"][0], average, rtol=1e-12)
    for c in range(ctx.layout.num_clients):  # what the runtime evaluates: the global model with the average
        step = StepContext(1, "eval", np.arange(ctx.layout.num_clients))
        model = client.eval_model(step, c, "global")
        np.testing.assert_array_equal(client.eval_norm_statistics(step, c, "global", model),
                                      rows["eval_norm_statistics"][c])


def test_other_algorithms_evaluate_with_the_clients_own_training_statistics():
    ctx, server, client = both_sides(_merge(BN, {"algorithm": "fedavg"}))
    walk(server, client, server.protocol.eval_plan(), 1, np.arange(ctx.layout.num_clients), stage="eval")
    split = client.data[2]
    step = StepContext(1, "eval", np.arange(ctx.layout.num_clients))
    model = client.eval_model(step, 2, "global")
    stats = client.eval_norm_statistics(step, 2, "global", model)
    np.testing.assert_array_equal(stats, norm_statistics(model, split.x_train, 8))
    with normalized_with(model, stats):
        whole = evaluate(model, split.x_test, split.y_test, client.loss_fn)
        one_by_one = sum(evaluate(model, split.x_test[i : i + 1], split.y_test[i : i + 1], client.loss_fn)
                         for i in range(len(split.y_test)))
    np.testing.assert_allclose(whole, one_by_one, rtol=1e-5)  # the test batch's makeup does not matter
