"""The CPU bitwise guard: every algorithm's test config (and the adaptive server optimizers), every kernel
algorithm on a small CNN through ``client.vectorize: true``, and W2 on 100 clients, 2 rounds each, written to one
results file per config; then two such folders compared bit for bit. A change that must not move a CPU bit (a
faster kernel, a new runtime path) runs it before and after, on 1 and on 3 ranks::

    git worktree add /tmp/base BASE_COMMIT
    (cd /tmp/base && PYTHONPATH=/tmp/base python benchmarks/bitwise_guard.py run /tmp/guard-base)
    python benchmarks/bitwise_guard.py run /tmp/guard-new
    mpirun -n 3 --oversubscribe python benchmarks/bitwise_guard.py run /tmp/guard-new-p3
    python benchmarks/bitwise_guard.py compare /tmp/guard-base /tmp/guard-new /tmp/guard-new-p3

``compare`` prints each config that differs (and in what) and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import _merge, deterministic, run_engine  # noqa: E402
from tests.test_checkpoint import RUNS  # noqa: E402
from tests.test_vectorized import IMAGES, KERNEL_ALGORITHMS  # noqa: E402

W2 = Path(__file__).resolve().parents[1] / "configs" / "w2.yaml"


def guard_configs() -> dict[str, dict]:
    """Name -> raw config of every guarded run."""
    import yaml

    configs = {name: _merge(raw, {"rounds": 2, "eval_every": 1}) for name, raw in RUNS.items()}
    for name in KERNEL_ALGORITHMS:
        kernel = {**IMAGES, "client": {**IMAGES["client"], "vectorize": True}}
        configs[f"{name}_kernel_cnn"] = _merge(RUNS[name], kernel)
    w2 = yaml.safe_load(W2.read_text())
    configs["w2"] = _merge(w2, {"rounds": 2, "eval_every": 2, "data": {"num_clients": 100}})
    return configs


def run_all(folder: Path) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=False)
    comm.Barrier()
    for name, raw in guard_configs().items():
        run_engine(raw, comm, folder / f"{name}.h5")
        if comm.Get_rank() == 0:
            print(f"{name}: done", flush=True)


def compare(base: Path, others: list[Path]) -> int:
    differ = 0
    for path in sorted(base.glob("*.h5")):
        reference = deterministic(path)
        for other in others:
            got = deterministic(other / path.name)
            bad = [key for key in reference if key not in got
                   or not np.array_equal(reference[key], got[key], equal_nan=reference[key].dtype.kind == "f")]
            if bad:
                differ += 1
                print(f"{other / path.name}: differs in {', '.join(bad)}")
    print(f"{len(list(base.glob('*.h5')))} configs x {len(others)} folders compared, {differ} differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run").add_argument("folder", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("base", type=Path)
    cmp.add_argument("others", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        run_all(args.folder)
        return 0
    return compare(args.base, args.others)


if __name__ == "__main__":
    sys.exit(main())
