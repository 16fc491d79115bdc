"""Gaussian blobs, one per class, drawn from the run's seed (`data.options`)."""

from dataclasses import dataclass, field

import numpy as np

from mpifl import schema


@dataclass(frozen=True)
class BlobOptions:
    samples: int = field(default=600, metadata=schema.limits(ge=1))
    features: int = field(default=8, metadata=schema.limits(ge=1))
    classes: int = field(default=3, metadata=schema.limits(ge=2))
    spread: float = field(default=1.0, metadata=schema.limits(gt=0))


def load(cfg, seed):
    opts = schema.build(BlobOptions, cfg.options, "data.options")
    rng = np.random.default_rng(seed)  # the seed, never global state: every rank draws the same data
    centers = rng.normal(0.0, 2.0, (opts.classes, opts.features))
    labels = np.arange(opts.samples) % opts.classes
    features = centers[labels] + opts.spread * rng.normal(size=(opts.samples, opts.features))
    return features.astype(np.float32), labels
