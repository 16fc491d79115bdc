"""When a rank's clients train in the vectorized path and in calls of how many rows: decided from the config alone, so
a client's bits never depend on the rank count (:mod:`mpifl.training.executor` explains why)."""

from __future__ import annotations

import math

import torch

from mpifl.training.config import ClientConfig

CPU_CHUNK, GPU_CHUNK = 16, 64
"""``client.vectorize_chunk: auto``'s rows per call on the CPU, and the most on a GPU (:func:`auto_chunk`)."""


DENSE_MODELS = ("linear", "logistic", "mlp")


# no buffers (BatchNorm keeps no running statistics) and no randomness in the forward pass
VECTORIZABLE_MODELS = (*DENSE_MODELS, "cnn", "lenet", "convnet", "resnet20", "simple_cnn")


def vectorize_wanted(cfg: ClientConfig, model_name: str, device: torch.device, cpu_default: bool) -> bool:
    """Whether a rank's clients train in the vectorized path. ``client.vectorize`` true or false decides for every
    vectorizable model. ``auto`` is the vectorized path on a GPU, where one launch for many clients should beat one per
    client; that default awaits a measurement on a GPU (benchmarks/bench_w2.py --device cuda). On the CPU
    ``auto`` keeps what was measured faster and was the default before, so CPU results stay as they were: the
    batch for dense models when the algorithm's step is FedAvg's without a transform (``cpu_default``;
    0.5–0.9× the loop's time, bench_vectorize.py), the loop for convolutional models (the vectorized path took 1.2–1.3×
    the loop's time for B1 unpadded, 1.5–2.4× padded, 2.0–2.9× for W2: RESULTS.md) and for the other
    algorithms."""
    if model_name not in VECTORIZABLE_MODELS or cfg.vectorize is False:
        return False
    if cfg.vectorize is True or device.type != "cpu":
        return True
    return cpu_default and model_name in DENSE_MODELS


PADDING_BOUND = 1.25
"""The most rows a GPU's calls may compute per real client row, for a round's cohort spread evenly over any of
:data:`WORKER_COUNTS` worker ranks (padding copies are work whose results are dropped)."""


WORKER_COUNTS = (1, 2, 4)


def padded_work(cohort: int, workers: int, chunk: int) -> float:
    """Rows computed per real row when ``cohort`` clients are spread evenly over ``workers`` ranks, each rank's
    clients in calls of exactly ``chunk`` rows."""
    sizes = [cohort // workers + (w < cohort % workers) for w in range(workers)]
    return sum(math.ceil(n / chunk) * chunk for n in sizes) / cohort


def auto_chunk(cohort: int, device: torch.device) -> int:
    """``client.vectorize_chunk: auto``: the rows of every call. A client's bits may depend on the call's size (a
    grouped convolution's algorithm may change with it), never on its company, so the size is fixed for a run by
    its config alone, never by the rank count. On the CPU 16, as before (CPU results keep their bits); on a GPU the
    size up to 64 whose padding stays within :data:`PADDING_BOUND` for the round's ``cohort`` on each of
    :data:`WORKER_COUNTS` worker ranks that makes the fewest calls, the least padded of those (W2's 50 clients a
    round: 13, 4 calls a step, 1.04× on 1, 2 and 4 workers, where 64 rows were 1.28×, 2.56× and 5.1×; 1,000 clients
    a round: 64, 1.02×). Fewest calls first, because every call is a launch of the whole step: a smaller chunk pads
    less on more workers (7 rows: 1.12× on 8 too) but takes twice the calls (bench_padding.py)."""
    if device.type == "cpu":
        return CPU_CHUNK
    cohort = max(cohort, 1)
    counts = [w for w in WORKER_COUNTS if w <= cohort]
    padding = {chunk: max(padded_work(cohort, w, chunk) for w in counts) for chunk in range(1, GPU_CHUNK + 1)}
    return min((chunk for chunk, worst in padding.items() if worst <= PADDING_BOUND),
               key=lambda chunk: (math.ceil(cohort / chunk), padding[chunk]))


def padded_rows(count: int, chunk: int | None) -> list[int]:
    """Which run each row trains: every run once, then, with a fixed chunk, copies of the last call's first run up
    to a whole number of chunks (their results are dropped)."""
    if chunk is None or count % chunk == 0:
        return list(range(count))
    last = count - count % chunk
    return list(range(count)) + [last] * (chunk - count % chunk)


def call_slices(rows: int, chunk: int | None) -> list[slice]:
    """The rows of each call: all at once, or consecutive blocks of exactly ``chunk``."""
    step = chunk or rows
    return [slice(start, start + step) for start in range(0, rows, step)]
