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
BATCHED = Counts(launching=3_000, reads=54, to_device=325e6, to_host=325e6, flops=318e9, host_s=0.5,
                 grouped_flops=300e9)


def test_the_terms_add_up_to_the_round():
    model = Model(host_scale=1.5, grouped_rate=1e12)
    terms = model.terms(BATCHED)
    assert terms["host"] == pytest.approx(0.75) and terms["launches"] == pytest.approx(3_000 * gpu_model.LAUNCH_S)
    assert terms["reads"] == pytest.approx(54 * gpu_model.READ_S)
    assert terms["bytes"] == pytest.approx(650e6 / gpu_model.BANDWIDTH)
    assert terms["flops"] == pytest.approx(18e9 / gpu_model.PEAK_FLOPS) and terms["grouped"] == pytest.approx(0.3)
    assert sum(terms.values()) == pytest.approx(model.seconds(BATCHED))


def test_the_fit_gives_the_two_lease_rounds_and_recovers_a_model_that_made_them(monkeypatch):
    model = fit(LOOP, BATCHED)
    assert model.seconds(LOOP) == pytest.approx(LEASE["loop", 1])
    assert model.seconds(BATCHED) == pytest.approx(LEASE["batched", 1])
    made = Model(host_scale=1.7, grouped_rate=0.8e12)
    monkeypatch.setitem(LEASE, ("loop", 1), made.seconds(LOOP))
    monkeypatch.setitem(LEASE, ("batched", 1), made.seconds(BATCHED))
    model = fit(LOOP, BATCHED)
    assert (model.host_scale, model.grouped_rate) == (pytest.approx(1.7), pytest.approx(0.8e12))


def test_the_host_seconds_are_the_median_of_the_traces():
    trace = {"operations": 1, "launching": 2, "reads": 3, "to_device": 4, "to_host": 5, "flops": 6}
    traces = [{"r": {**trace, "host_s": h}} for h in (0.5, 0.2, 0.9)]
    assert gpu_model.medians(traces, "r") == Counts(2, 3, 4, 5, 6, 0.5)


def test_ranks_share_the_host_work_but_not_the_device():
    model = Model(host_scale=1.0, grouped_rate=1e12)
    one = model.on_ranks(LOOP, 1)
    assert one == model.seconds(LOOP)
    assert model.on_ranks(LOOP, 3) < one and model.on_ranks(LOOP, 9) < model.on_ranks(LOOP, 5)
    assert model.on_ranks(LOOP, 9) > 7 / 50 * one  # the tree comes on top of the busiest worker's 7 clients
    assert model.on_ranks(BATCHED, 9) == pytest.approx(0.3)  # every worker's grouped convolutions on one device


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
