"""Which of mpifl's files one training round's number passes through, in the order it runs: a round read top-down.

    python benchmarks/round_path.py [--config configs/quickstart.yaml] [--round 2] [--set KEY=VALUE ...]
    mpirun -n 3 python benchmarks/round_path.py --rank 1 --set clients_per_round=40   # a worker's path

Runs the config on the ranks it is started on and, during ``--round``'s ``SynchronousRounds.train_round`` on rank
``--rank``, records every call from one of ``mpifl``'s files into another that hands the round's number on (the
callee has an argument named ``round_``, the name the code gives it everywhere, holding that round). Printed: how
many such calls, through how many files, and how many of them call up to a higher layer than the caller's (the
layers as the folders show them: runtime, algorithms, training, models, comm, data, top to bottom; a call up is a
lower layer reaching back into a higher one), then each call, ``caller -> callee``, indented by the callee's
layer. It measures the code as it runs, not as it reads: a branch the config does not take is not counted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from common import REPO

LAYERS = ("runtime", "algorithms", "training", "models", "comm", "data")
"""mpifl's layers, top to bottom: a file's layer is its folder (the package's own modules count as the top)."""


def layer(file: str) -> int:
    """The index in :data:`LAYERS` of ``file`` (a path relative to the package), -1 above them all."""
    folder = file.split("/")[0]
    return LAYERS.index(folder) if folder in LAYERS else -1


def round_calls(config: Path, round_: int, rank: int, overrides: list[str]) -> list[tuple[str, str]]:
    """(caller, callee) of every call between two of the package's files (relative to ``mpifl/``) that hands
    round ``round_``'s number on, in order, on rank ``rank``."""
    from mpi4py import MPI

    from mpifl.registry import load_config
    from mpifl.runtime.engine import Engine
    from mpifl.runtime.synchronous import SynchronousRounds

    package = str(REPO / "mpifl") + "/"
    calls: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:  # noqa: ANN401 - sys.setprofile's signature
        caller = frame.f_back
        if event != "call" or caller is None or not frame.f_code.co_filename.startswith(package):
            return
        names = frame.f_code.co_varnames[: frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
        here, there = frame.f_code.co_filename[len(package):], caller.f_code.co_filename[len(package):]
        if ("round_" in names and frame.f_locals.get("round_") == round_ and here != there
                and caller.f_code.co_filename.startswith(package)):
            calls.append((there, here))

    cfg = load_config(config, [f"rounds={round_}", f"eval_every={10 * round_}", *overrides])
    original = SynchronousRounds.train_round

    def traced(self: SynchronousRounds, number: int) -> None:
        if number != round_ or MPI.COMM_WORLD.rank != rank:
            return original(self, number)
        sys.setprofile(profile)
        try:
            return original(self, number)
        finally:
            sys.setprofile(None)

    SynchronousRounds.train_round = traced  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            engine = Engine(cfg, MPI.COMM_WORLD, Path(MPI.COMM_WORLD.bcast(tmp)) / "path.h5")
            engine.prepare()
            engine.run(progress=False)
    finally:
        SynchronousRounds.train_round = original  # type: ignore[method-assign]
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "quickstart.yaml")
    parser.add_argument("--round", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    from mpi4py import MPI

    calls = round_calls(args.config, args.round, args.rank, args.set)
    if MPI.COMM_WORLD.rank != args.rank:
        return
    files = {file for call in calls for file in call}
    up = sum(layer(callee) < layer(caller) for caller, callee in calls)
    print(f"rank {args.rank}, round {args.round}: {len(calls)} calls hand the round's number on, through "
          f"{len(files)} files; {up} call up to a higher layer")
    for caller, callee in calls:
        print(f"  {'  ' * (layer(callee) + 1)}{caller} -> {callee}{'   (up)' if layer(callee) < layer(caller) else ''}")


if __name__ == "__main__":
    main()
