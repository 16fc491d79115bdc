"""Parameter sweeps: a grid of algorithms × hyperparameters × seeds expanded into independent runs.

A sweep file names a base config, a grid of ``--set`` keys and a list of seeds:

    base: configs/quickstart.yaml       # relative to the sweep file
    output_dir: results/sweep           # one results file per run, named after its overrides
    ranks: 3                            # MPI ranks per run (1: no mpirun)
    seeds: [0, 1, 2]
    grid:
      algorithm: [fedavg, local]
      client.lr: [0.05, 0.1]

``mpifl sweep FILE`` runs them one after another; ``mpifl sweep FILE --slurm`` writes a SLURM
job array (one task per run) and its run list instead, for ``sbatch``. ``mpifl report DIR``
then aggregates the results over seeds.
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mpifl.config import apply_overrides, check_required, load_raw, parse_config
from mpifl.schema import ConfigError, build, limits


@dataclass(frozen=True)
class SweepSpec:
    base: str
    output_dir: str = "results/sweep"
    ranks: int = field(default=1, metadata=limits(ge=1))
    seeds: tuple[int, ...] = (0,)
    grid: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    name: str
    overrides: tuple[str, ...]
    output: Path


def _fmt(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def load_sweep(path: str | Path) -> tuple[Path, SweepSpec, list[Run]]:
    """Parse a sweep file and expand it, validating every run's config before anything starts."""
    path = Path(path)
    spec = build(SweepSpec, load_raw(path), "sweep")
    base = (path.parent / spec.base).resolve()
    for key, values in spec.grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.grid.{key}: expected a non-empty list of values")
    keys = list(spec.grid)
    runs = []
    raw_base = load_raw(base)
    for combo in itertools.product(*(spec.grid[k] for k in keys)):
        for seed in spec.seeds:
            overrides = tuple(f"{k}={_fmt(v)}" for k, v in zip(keys, combo)) + (f"seed={seed}",)
            try:
                raw = apply_overrides(raw_base, list(overrides))
                check_required(raw, base)
                parse_config(raw)
            except ConfigError as exc:
                raise ConfigError(f"sweep run {' '.join(overrides)}: {exc}") from None
            name = ",".join(o.replace("/", "_").replace(" ", "") for o in overrides)
            runs.append(Run(name, overrides, Path(spec.output_dir) / f"{name}.h5"))
    return base, spec, runs


def _run_command(base: Path, run: Run, ranks: int, launcher: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "mpifl", "run", str(base), "--out", str(run.output), "--quiet"]
    for item in run.overrides:
        cmd += ["--set", item]
    return (launcher + ["-n", str(ranks)] if ranks > 1 else []) + cmd


def run_sweep(path: str, slurm: bool = False, dry_run: bool = False) -> int:
    base, spec, runs = load_sweep(path)
    out_dir = Path(spec.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if slurm:
        script = write_slurm_array(base, spec, runs, out_dir)
        print(f"{len(runs)} runs; submit with: sbatch {script}")
        return 0
    mpirun = [shutil.which("mpirun") or "mpirun", "--oversubscribe"]
    failed = 0
    for i, run in enumerate(runs, 1):
        cmd = _run_command(base, run, spec.ranks, mpirun)
        print(f"[{i}/{len(runs)}] {run.name}", flush=True)
        if dry_run:
            print("  " + shlex.join(cmd))
            continue
        proc = subprocess.run(cmd, env=os.environ)
        failed += proc.returncode != 0
    if failed:
        print(f"mpifl: {failed} of {len(runs)} runs failed", file=sys.stderr)
    return 1 if failed else 0


def write_slurm_array(base: Path, spec: SweepSpec, runs: list[Run], out_dir: Path) -> Path:
    """A job array with one task per run; each task reads its overrides from runs.txt."""
    run_list = out_dir / "runs.txt"
    run_list.write_text("".join(
        shlex.join([str(r.output), *(a for o in r.overrides for a in ("--set", o))]) + "\n" for r in runs
    ))
    script = out_dir / "sweep.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=mpifl-sweep
#SBATCH --array=0-{len(runs) - 1}
#SBATCH --ntasks={spec.ranks}
#SBATCH --cpus-per-task=1
#SBATCH --output={out_dir.resolve()}/slurm-%A_%a.out
# Launcher as in jobs/mpifl.sbatch: srun (MPIFL_SRUN_MPI=pmix with the PyPI Open MPI wheel) or
# MPIFL_LAUNCHER=mpirun.
set -euo pipefail
line=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {run_list.resolve()})
eval "set -- $line"
out=$1; shift
# threads_per_rank from --cpus-per-task, unless the sweep's own overrides (after it) set it
run=({shlex.quote(sys.executable)} -m mpifl run {shlex.quote(str(base))} --out "$out" --quiet \\
     --set "threads_per_rank=${{SLURM_CPUS_PER_TASK:-1}}" "$@")
if [ "${{MPIFL_LAUNCHER:-srun}}" = mpirun ]; then
  exec mpirun --bind-to none -n "$SLURM_NTASKS" "${{run[@]}}"
fi
exec srun ${{MPIFL_SRUN_MPI:+--mpi=$MPIFL_SRUN_MPI}} "${{run[@]}}"
""")
    return script
