"""The space estimate against real files: small runs of different shapes (every algorithm's test config with
checkpoints; evaluation cadence, checkpoints kept, more clients, a longer run), each estimated before round 1 as
``mpifl run`` does (:mod:`mpifl.runtime.footprint`), run, and measured: the results file and the checkpoint files
left beside it. Prints one line per run and the largest relative error; exits 1 if one is past ``--within``::

    python benchmarks/space_estimate.py [--only NAME ...] [--long]   # --long: also a 1,500-round run and W2
    mpirun -n 3 --oversubscribe python benchmarks/space_estimate.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from tests.conftest import REPO, TINY, _merge  # noqa: E402
from tests.test_checkpoint import CONFIGS  # noqa: E402

CHECKPOINTED = {"rounds": 6, "eval_every": 2, "checkpoint_every": 2, "checkpoint_keep": 2}
SHAPES = {
    **{name: _merge(raw, CHECKPOINTED) for name, raw in CONFIGS.items()},
    "tiny": TINY,
    "eval_every_1": _merge(TINY, {"rounds": 30, "eval_every": 1}),
    "eval_every_10": _merge(TINY, {"rounds": 30, "eval_every": 10}),
    "keep_1": _merge(TINY, {"rounds": 12, "checkpoint_every": 2, "checkpoint_keep": 1}),
    "keep_4": _merge(TINY, {"rounds": 12, "checkpoint_every": 2, "checkpoint_keep": 4}),
    "scaffold_keep_3": _merge(TINY, {"algorithm": "scaffold", "rounds": 12, "checkpoint_every": 3,
                                     "checkpoint_keep": 3, "data": {"num_clients": 40}, "clients_per_round": 8}),
    "many_clients": _merge(TINY, {"rounds": 4, "clients_per_round": 30, "data": {"num_clients": 120},
                                  "model": {"name": "mlp", "hidden": [8]}}),
}
LONG = {"long": _merge(TINY, {"rounds": 1500, "eval_every": 100, "clients_per_round": 8, "checkpoint_every": 500,
                              "model": {"name": "mlp", "hidden": [8]}, "client": {"batch_size": 64}}),
        "w2": _merge(yaml.safe_load((REPO / "configs" / "w2.yaml").read_text()),
                     {"rounds": 2, "eval_every": 2, "checkpoint_every": 1, "data": {"num_clients": 100}})}
"""Past the first chunk of the rounds table and of the ledger; W2's model (tens of MB of checkpoints) on 100 clients
(a minute or two each)."""


def on_disk(path: Path) -> int:
    from mpifl.results import shard_dir

    folder = shard_dir(path)
    files = list(folder.iterdir()) if folder.is_dir() else []
    return path.stat().st_size + sum(f.stat().st_size for f in files)


def measure(name: str, raw: dict, folder: Path) -> float | None:
    """Estimate, run and measure one shape; rank 0 prints its line and returns the relative error."""
    from mpi4py import MPI

    from mpifl.registry import parse_config
    from mpifl.runtime.engine import Engine
    from mpifl.runtime.footprint import estimate

    comm = MPI.COMM_WORLD
    out = folder / f"{name}.h5"
    engine = Engine(parse_config(raw), comm, out)
    engine.prepare()
    footprint = estimate(engine) if comm.Get_rank() == 0 else None
    engine.run(progress=False)
    comm.Barrier()
    if footprint is None:
        return None
    real = on_disk(out)
    error = footprint.at_end / real - 1
    print(f"{name:22s} estimate {footprint.at_end / 1e3:9.1f} kB (results {footprint.results / 1e3:8.1f}, "
          f"{footprint.kept} x checkpoint {footprint.checkpoint / 1e3:7.1f})  real {real / 1e3:9.1f} kB "
          f"(results {out.stat().st_size / 1e3:8.1f})  {100 * error:+6.1f}%", flush=True)
    return error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these shapes only")
    parser.add_argument("--long", action="store_true", help="also a 1,500-round run and W2 (a few minutes)")
    parser.add_argument("--within", type=float, default=0.25, help="the largest relative error accepted")
    args = parser.parse_args()
    from mpi4py import MPI

    shapes = {**SHAPES, **(LONG if args.long else {})}
    names = args.only or list(shapes)
    folder = Path(tempfile.mkdtemp(prefix="mpifl-space-")) if MPI.COMM_WORLD.Get_rank() == 0 else None
    folder = MPI.COMM_WORLD.bcast(folder)
    errors = [measure(name, shapes[name], folder) for name in names]
    if MPI.COMM_WORLD.Get_rank() != 0:
        return 0
    worst = max(abs(e) for e in errors if e is not None)
    print(f"{len(names)} runs on {MPI.COMM_WORLD.Get_size()} rank(s): the estimate within {100 * worst:.1f}% of "
          "the real files")
    return 0 if worst <= args.within else 1


if __name__ == "__main__":
    sys.exit(main())
