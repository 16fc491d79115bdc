"""The GPU time model of the CPU proxies (benchmarks/gpu_model.py): its arithmetic, without running a round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.func import functional_call, grad, vmap

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_model  # noqa: E402
from dispatch_proxy import Count  # noqa: E402
from gpu_model import LEASE, Counts, Model, fit  # noqa: E402

LOOP = Counts(launching=10_000, reads=250, to_device=325e6, to_host=39e6, flops=250e9, host_s=0.6)
BATCHED = Counts(launching=3_000, reads=54, to_device=325e6, to_host=325e6, flops=318e9, host_s=1.4)


def test_the_fit_gives_the_two_lease_rounds_and_its_terms_add_up():
    model = fit(LOOP, BATCHED)
    assert model.seconds(LOOP) == pytest.approx(LEASE["loop", 1])
    assert model.seconds(BATCHED) == pytest.approx(LEASE["batched", 1])
    terms = model.terms(LOOP)
    assert terms["reads"] == pytest.approx(250 * gpu_model.READ_S)
    assert terms["bytes"] == pytest.approx(364e6 / gpu_model.BANDWIDTH)
    assert sum(terms.values()) == pytest.approx(model.seconds(LOOP))


def test_the_fit_recovers_a_model_that_made_the_times(monkeypatch):
    made = Model(host_scale=0.8, launch_s=40e-6)
    monkeypatch.setitem(LEASE, ("loop", 1), made.seconds(LOOP))
    monkeypatch.setitem(LEASE, ("batched", 1), made.seconds(BATCHED))
    model = fit(LOOP, BATCHED)
    assert (model.host_scale, model.launch_s) == (pytest.approx(0.8), pytest.approx(40e-6))


def test_ranks_take_the_busiest_workers_share_and_add_the_mpi_tree():
    model = Model(host_scale=1.0, launch_s=50e-6)
    one = model.on_ranks(LOOP, 1)
    assert one == model.seconds(LOOP)
    assert model.on_ranks(LOOP, 3) < one and model.on_ranks(LOOP, 9) < model.on_ranks(LOOP, 5)
    assert model.on_ranks(LOOP, 9) > 7 / 50 * one  # the tree comes on top of the busiest worker's 7 clients


def test_the_proxy_counts_a_grouped_convolutions_flops_per_group():
    """vmap runs a convolution of 5 rows as one grouped convolution: its FLOPs, forward and backward, are 5 times
    one row's (torch.utils.flop_counter counted the grouped backward 3 times over)."""
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    names = [n for n, _ in module.named_parameters()]

    def loss(params, x, y):  # noqa: ANN001, ANN202
        out = functional_call(module, dict(zip(names, params)), (x,))
        return torch.nn.functional.cross_entropy(out, y)

    one, five = Count(), Count()
    with one.mode:
        loss(tuple(module.parameters()), x, y).backward()
    rows = tuple(p.detach().expand(5, *p.shape).clone() for p in module.parameters())
    with five.mode:
        vmap(grad(loss), in_dims=(0, None, None))(rows, x, y)
    conv = 2 * (2 * 4 * 6 * 6) * (3 * 3 * 3)  # forward: 2 per multiply-add of each output
    linear = 2 * 2 * (4 * 6 * 6) * 2
    assert one.flops == conv * 2 + linear * 3  # no input gradient for the convolution: forward and weights
    assert five.flops == 5 * one.flops
