"""The ``client:`` section of a run config: every client's local optimizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from mpifl.schema import limits


@dataclass(frozen=True)
class ClientConfig:
    """Local optimizer of every client (plain SGD with the usual options)."""

    lr: float = field(default=0.05, metadata=limits(gt=0))  # local SGD's learning rate
    momentum: float = field(default=0.0, metadata=limits(ge=0, lt=1))  # the buffer restarts every round
    weight_decay: float = field(default=0.0, metadata=limits(ge=0))  # L2 penalty, as torch's SGD applies it
    epochs: int = field(default=1, metadata=limits(ge=1))  # passes over the client's data per round (unless steps)
    steps: int | None = field(default=None, metadata=limits(ge=1))  # batches per round; null: epochs passes
    batch_size: int = field(default=32, metadata=limits(ge=1))  # samples per local step
    clip_norm: float | None = field(default=None, metadata=limits(gt=0))  # clip each step's gradient to this L2 norm
    drop_last: bool = False  # batch_sampling epochs: skip the last, partial batch of a pass
    # epochs: passes over the shuffled data; fresh: each step the first batch_size of a new permutation
    # (the PeFLL/pFedHN reference code's next(iter(loader)): always full batches)
    batch_sampling: Literal["epochs", "fresh"] = "epochs"
    # crop_flip: each training batch randomly cropped from a 4-pixel zero-padded copy and flipped horizontally with
    # probability ½ (the FedALS authors' CIFAR/SVHN transform; images only)
    augment: Literal["none", "crop_flip"] = "none"
    # FedAvg with linear, logistic or mlp models: train every client through the torch.func kernel, a rank's
    # equally sized clients as one computation. A setting of the results: the kernel and the one-at-a-time
    # loop agree bitwise for narrow layers but may round differently for wide ones.
    vectorize: bool = True

    def for_epochs(self, epochs: int) -> ClientConfig:
        """These settings with ``epochs`` passes in place of the configured steps or epochs (an algorithm whose
        paper fixes its local work in epochs: Local's 200, FedRep's head and body, Per-FedAvg's one)."""
        return dataclasses.replace(self, steps=None, epochs=epochs)
