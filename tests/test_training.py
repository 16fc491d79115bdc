"""The local-training kernels' batch plans and augmentation, and each algorithm's declared work per round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpifl.algorithms.base import RunContext
from mpifl.data import build_federated_dataset
from mpifl.registry import get_algorithm, parse_config
from mpifl.training.config import ClientConfig
from mpifl.training.sgd import batch_schedule, crop_flip, planned_samples
from tests.algorithms.conftest import SHARDS
from tests.conftest import _merge
from tests.test_checkpoint import CONFIGS


@pytest.mark.parametrize("cfg", [ClientConfig(steps=7, batch_size=16), ClientConfig(epochs=3, batch_size=16),
                                 ClientConfig(steps=9, batch_size=16, drop_last=True),
                                 ClientConfig(epochs=2, batch_size=16, drop_last=True),
                                 ClientConfig(steps=5, batch_size=16, batch_sampling="fresh")])
def test_planned_samples_count_what_the_schedule_yields(cfg):
    sizes = np.array([5, 16, 40, 33, 100])
    yielded = [sum(len(b) for b in batch_schedule(int(n), cfg, torch.Generator().manual_seed(0))) for n in sizes]
    assert planned_samples(sizes, cfg).tolist() == yielded


def test_fresh_batches_are_always_full_and_drawn_anew_each_step():
    """The reference code's next(iter(loader)): every step the first batch of a new permutation."""
    cfg = ClientConfig(steps=50, batch_size=8, batch_sampling="fresh")
    batches = list(batch_schedule(20, cfg, torch.Generator().manual_seed(1)))
    assert len(batches) == 50 and all(len(b) == 8 and len(set(b.tolist())) == 8 for b in batches)
    counts = np.bincount(torch.cat(batches).numpy(), minlength=20)
    assert counts.min() > 0 and counts.max() > 50 * 8 / 20  # with replacement across steps, unlike epochs
    epochs = list(batch_schedule(20, ClientConfig(steps=50, batch_size=8), torch.Generator().manual_seed(1)))
    assert any(len(b) < 8 for b in epochs)  # the last batch of each pass is partial


def test_crop_flip_is_a_shifted_window_of_the_padded_image_maybe_mirrored():
    x = torch.arange(2 * 3 * 6 * 5, dtype=torch.float32).reshape(2, 3, 6, 5) + 1
    gen = torch.Generator().manual_seed(3)
    out = crop_flip(x, gen, pad=2)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):
        windows = [padded[i, :, dy : dy + 6, dx : dx + 5] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(out[i], w) or torch.equal(out[i], w.flip(-1)) for w in windows)
    again = crop_flip(x, torch.Generator().manual_seed(3), pad=2)
    assert torch.equal(out, again)  # drawn from the client's generator: reproducible
    many = crop_flip(x.repeat(64, 1, 1, 1), gen, pad=2)
    assert len({tuple(m.flatten().tolist()) for m in many}) > 10


def test_augmentation_needs_images():
    from mpifl.runtime.assembly import check_run
    from mpifl.schema import ConfigError

    cfg = parse_config(_merge(SHARDS, {"client": {"augment": "crop_flip"}, "data": {"dataset": "gaussian_images",
                                       "synthetic": {"image_shape": [12]}}}))
    with pytest.raises(ConfigError, match="client.augment: 'crop_flip' crops and flips images"):
        check_run(cfg, build_federated_dataset(cfg.data, cfg.seed).layout)


def samples(algorithm: str, overrides: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(the algorithm's samples per round, the configured local SGD's) for every client."""
    cfg = parse_config(_merge(CONFIGS[algorithm], overrides or {}))
    layout = build_federated_dataset(cfg.data, cfg.seed).layout
    protocol = get_algorithm(algorithm).server.protocol_type(RunContext(cfg, layout))
    return protocol.samples_per_round(), planned_samples(layout.train_sizes, cfg.client)


def test_each_algorithm_declares_its_own_work_per_round():
    """Load balancing and deadlines charge what the algorithm really computes, not the configured SGD."""
    ours, sgd = samples("fedavg")
    assert np.array_equal(ours, sgd)
    ours, _ = samples("fedals", {"fedals": {"tau": 11}})
    batch = np.minimum(SHARDS["client"]["batch_size"], build_sizes("fedals"))
    assert np.array_equal(ours, 11 * batch)  # τ steps, not client.steps
    assert np.array_equal(samples("feddeper")[0], 2 * samples("feddeper")[1])  # a gradient at y and at v
    ours, sgd = samples("pfedme", {"pfedme": {"inner_steps": 3}})
    assert np.array_equal(ours, 3 * sgd)
    ours, sgd = samples("pefll")
    assert np.array_equal(ours, sgd + 2 * np.minimum(32, build_sizes("pefll")))  # φ forward and backward
    assert np.array_equal(samples("fedsgd")[0], build_sizes("fedsgd"))  # one full-batch gradient
    assert samples("local", {"local": {"mode": "all"}})[0].sum() == 0  # all training happens before round 1


def build_sizes(algorithm: str) -> np.ndarray:
    cfg = parse_config(CONFIGS[algorithm])
    return build_federated_dataset(cfg.data, cfg.seed).layout.train_sizes


def test_the_deadline_charges_fedals_tau_steps(tmp_path):
    """A deadline that 4 local steps meet but τ = 40 steps miss: FedALS's clients are all cut."""
    from mpi4py import MPI

    from mpifl.results import read_results
    from tests.conftest import run_engine

    base = {"rounds": 2, "eval_every": 2, "network": {"latency_s": 0.0, "seconds_per_sample": 1e-3},
            "faults": {"deadline_s": 0.5}}  # 4 steps × 16 samples × 1 ms = 0.064 s (+ transfer) < 0.5 s
    for tau, participants in ((4, 6), (40, 0)):  # 40 × 16 × 1 ms = 0.64 s > 0.5 s
        path = run_engine(_merge(CONFIGS["fedals"], {**base, "fedals": {"tau": tau}}), MPI.COMM_SELF,
                          tmp_path / f"tau{tau}.h5")
        assert read_results(path).table("rounds")["participants"].tolist() == [participants] * 2
