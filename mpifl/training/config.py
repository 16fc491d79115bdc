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
    # train clients through the vectorized path (mpifl.training.executor), a rank's clients with equally many
    # local steps as one computation: fedavg, fedprox, scaffold, fedsgd, knnper, fedbuff, fedasync, local, ifca,
    # pefll, pfedhn with linear, logistic, mlp, cnn, lenet, convnet, resnet20 or simple_cnn; false: one at a time;
    # auto: the kernel on a GPU, and on the CPU where it is faster and was the default (dense models with FedAvg's
    # plain step: fedavg, knnper, fedbuff). A setting of the results: the kernel and the loop may round differently
    vectorize: bool | Literal["auto"] = "auto"
    # clients per kernel call where the kernel's rounding may depend on that count (convolutions; any model on a
    # GPU): every call is padded to exactly this many, so a client's update does not depend on the rank count;
    # auto: 16 on the CPU; on a GPU the largest size up to 64 whose padding stays within 1.25x for the round's
    # cohort spread over 1, 2 or 4 workers (W2's 50 clients: 13), from the config alone
    vectorize_chunk: int | Literal["auto"] = field(default="auto", metadata=limits(ge=1))
    # on CUDA, each batched call's local step captured as a CUDA graph once per group and batch size, then replayed
    # (one launch a step instead of one per operation); its parameters, momentum, sample indices and
    # inputs live in buffers reused across steps and rounds either way. On the CPU the same code runs eagerly:
    # the same bits as false. Untested on a GPU so far (docs/how-to/gpus.md)
    cuda_graph: bool = False

    def for_epochs(self, epochs: int) -> ClientConfig:
        """These settings with ``epochs`` passes in place of the configured steps or epochs (an algorithm whose
        paper fixes its local work in epochs: Local's 200, FedRep's head and body, Per-FedAvg's one)."""
        return dataclasses.replace(self, steps=None, epochs=epochs)
