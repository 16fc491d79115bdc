"""Start-up: the seconds a small ``mpifl run`` spends before and around its first round, against the bare
import of what every run needs (issue 44: a 1-round quickstart job should cost at most 1.25× that import).

    python benchmarks/bench_startup.py [--config configs/quickstart.yaml] [--repeats 7] [--device cpu|cuda]
                                       [--set KEY=VALUE]... [--write]

First the whole process, from outside: the 1-round job and ``python -c 'import mpifl.cli, torch, mpi4py.MPI,
h5py'`` in turn (pairs keep the ratio meaningful on a machine whose load drifts), wall seconds as median (min to
max). Then one job under cProfile: its phases (imports, MPI init, config, data, the rest of the set-up with the
model, the first round, its evaluation, the final writes), each its cumulative seconds. cProfile slows
Python-heavy code more than native code: read the phases as shares, the totals from the first table.
"""

from __future__ import annotations

import argparse
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from common import REPO, heading, job_options, record

BARE = "import mpifl.cli, torch, mpi4py.MPI, h5py"
PHASES = (  # (what, file, function): each phase's cumulative seconds in the profile; "imports" is the rest
    ("MPI init (import mpi4py.MPI)", "mpifl/runtime/launch.py", "load_mpi"),
    ("config", "mpifl/runtime/launch.py", "job_config"),
    ("data", "mpifl/data/federated.py", "build_federated_dataset"),
    ("set-up but data: devices, model, algorithm, assembly", "mpifl/runtime/engine.py", "prepare"),
    ("round 1's training", "mpifl/runtime/synchronous.py", "train_round"),
    ("round 1's evaluation", "mpifl/runtime/evaluation.py", "run"),
    ("final tables and writes", "mpifl/runtime/engine.py", "_finish"),
)


def job_command(config: Path, out: Path, overrides: Sequence[str]) -> list[str]:
    """A 1-round ``mpifl run`` of ``config``, alone (no launcher), replacing ``out``."""
    sets = [arg for item in ("rounds=1", *overrides) for arg in ("--set", item)]
    return ["-m", "mpifl", "run", str(config), "--out", str(out), "--overwrite", "--quiet", *sets]


def wall(cmd: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def cumulative(stats: pstats.Stats, file: str, function: str) -> float:
    """The cumulative seconds of ``function`` defined in ``file`` (0 where the job never called it)."""
    table = stats.stats  # type: ignore[attr-defined]  # pstats keeps its table untyped
    return sum(row[3] for (path, _, name), row in table.items() if path.endswith(file) and name == function)


def phases(job: list[str], folder: Path) -> tuple[float, list[tuple[str, float]]]:
    """One job under cProfile: its total seconds and its phases (see PHASES)."""
    profile = folder / "job.prof"
    subprocess.run([sys.executable, "-m", "cProfile", "-o", str(profile), *job], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    stats = pstats.Stats(str(profile))
    total = stats.total_tt  # type: ignore[attr-defined]
    found = {what: cumulative(stats, file, function) for what, file, function in PHASES}
    data = found["data"]
    found["set-up but data: devices, model, algorithm, assembly"] -= data
    job_seconds = cumulative(stats, "mpifl/runtime/launch.py", "run_job")
    return total, [("imports (python -m mpifl: cli, runtime, torch, numpy, h5py)", total - job_seconds),
                   *found.items(), ("the rest (the engine's own import, round 1's checkpoint, ...)",
                                    job_seconds - sum(found.values()))]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "quickstart.yaml")
    parser.add_argument("--repeats", type=int, default=7)
    job_options(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        job = job_command(args.config.resolve(), Path(tmp) / "run.h5", [f"device={args.device}", *args.overrides])
        wall([sys.executable, *job])  # warm-up: the page cache, the .pyc files
        pairs = [(wall([sys.executable, *job]), wall([sys.executable, "-c", BARE])) for _ in range(args.repeats)]
        profiled, rows = phases(job, Path(tmp))
    jobs, bares = zip(*pairs)
    ratios = [a / b for a, b in pairs]
    config = args.config.resolve()
    config = config.relative_to(REPO) if config.is_relative_to(REPO) else config
    shown = " ".join(["python", *job]).replace(tmp, "TMP").replace(str(REPO) + "/", "")

    def spread(values: Sequence[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    lines = [heading(f"Start-up of a 1-round job, {config}, device {args.device}"), "",
             f"`python benchmarks/bench_startup.py --config {config} --repeats {args.repeats}"
             f" --device {args.device}` (the job: `{shown}`)", "",
             "| what | wall s, median (min–max) |", "|---|---|",
             f"| the job | {spread(jobs)} |", f"| `python -c '{BARE}'` | {spread(bares)} |",
             f"| ratio, pair by pair | {spread(ratios)}× |", "",
             f"One job under cProfile: {profiled:.2f} s", "",
             "| phase | s (cumulative, under cProfile) |", "|---|---|",
             *(f"| {what} | {seconds:.3f} |" for what, seconds in rows)]
    record(lines, args.write)


if __name__ == "__main__":
    main()
