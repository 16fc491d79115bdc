"""What every benchmark script shares: running a real mpifl job and recording a table in RESULTS.md."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mpifl.results import Results, read_results  # noqa: E402


def mpifl_job(config: Path, ranks: int, out: Path, overrides: Sequence[str] = (), flags: Sequence[str] = ()
              ) -> Results:
    """``python -m mpifl run`` (under ``mpirun -n ranks --oversubscribe`` when ranks > 1; in this process when
    ranks is 0, one rank without another interpreter's, torch's and MPI's start) with ``flags`` (e.g.
    ``--profile``); its results. A new job (no ``--resume``) starts from no file at ``out``: benchmarks run job
    after job into one file, which mpifl run would refuse to replace."""
    if "--resume" not in flags:
        out.unlink(missing_ok=True)
    args = ["run", str(config), "--out", str(out), "--quiet", *flags]
    for item in overrides:
        args += ["--set", item]
    if ranks == 0:
        from mpifl.cli import main

        if code := main(args):
            raise SystemExit(f"mpifl {shlex.join(args)}: exit code {code}")
        return read_results(out)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    subprocess.run(launched([sys.executable, "-m", "mpifl", *args], ranks), check=True, env=env, cwd=REPO)
    return read_results(out)


def launched(cmd: list[str], ranks: int) -> list[str]:
    """``cmd`` as ``ranks`` MPI ranks: under ``mpirun -n ranks --oversubscribe`` (this interpreter's venv's
    ``mpirun`` first: the one its mpi4py was built with) when ranks > 1, else as it is."""
    if ranks <= 1:
        return cmd
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    return [mpirun or "mpirun", "-n", str(ranks), "--oversubscribe", *cmd]


def heading(title: str) -> str:
    """A RESULTS.md section heading naming the date and the machine (torch's version without importing
    it: the memory benchmark must not map libtorch itself)."""
    return (f"### {title} — {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
            f"torch {version('torch')}")


def record(lines: list[str], write: bool) -> None:
    """Print a result table; with ``write`` also append it to benchmarks/RESULTS.md."""
    print("\n".join(lines))
    if write:
        with open(REPO / "benchmarks" / "RESULTS.md", "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


def job_options(parser: argparse.ArgumentParser, set_help: str = "further config overrides, as mpifl run --set"
                ) -> None:
    """The options every job benchmark takes: its device, config overrides, and whether to record the table."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
