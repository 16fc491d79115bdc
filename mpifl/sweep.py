"""Parameter sweeps: variants × a grid of hyperparameters × seeds expanded into independent runs.

A sweep file names a base config, optional variants, a grid of ``--set`` keys and a list of seeds:

    base: configs/quickstart.yaml       # relative to the sweep file
    output_dir: results/sweep           # one results file per run, named after its variant and overrides
    ranks: 3                            # MPI ranks per run (1: no mpirun)
    seeds: [0, 1, 2]
    variants:                           # optional: methods that each need their own settings
      - {name: fedavg, set: {algorithm: fedavg}}
      - {set: {algorithm: local, local.mode: all}}   # name: its overrides, "algorithm=local,local.mode=all"
    grid:                               # optional: every variant runs every combination
      client.lr: [0.05, 0.1]

Runs are variants × grid × seeds, each a results file ``output_dir/VARIANT,KEY=VALUE,...,seed=S.h5``; the
grid's and a variant's overrides apply on top of the base (the grid's last). Every run's config is validated
before any starts. ``mpifl sweep FILE`` runs them one after another; ``--set KEY=VALUE`` (applied to every run,
last), ``--seeds`` and ``--output-dir`` shrink or move a sweep without editing it (a smoke test:
``--set rounds=2 --seeds 0 --output-dir /tmp/smoke``). ``mpifl sweep FILE --slurm`` writes a SLURM job
array (one task per run) and its run list instead, for ``sbatch``. ``mpifl report DIR`` then aggregates the
results over seeds.
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

from mpifl.config import apply_overrides, check_required, load_raw
from mpifl.registry import parse_config
from mpifl.schema import ConfigError, build, limits


@dataclass(frozen=True)
class Variant:
    """One method of a sweep: its own overrides (``set``), combined with every grid point and seed."""

    name: str | None = None  # default: its overrides, "key=value,..."
    set: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SweepSpec:
    base: str
    output_dir: str = "results/sweep"
    ranks: int = field(default=1, metadata=limits(ge=1))
    seeds: tuple[int, ...] = field(default=(0,), metadata=limits(ge=0))
    variants: tuple[Variant, ...] = ()
    grid: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    name: str
    variant: str  # the variant's name; "" for a sweep without variants
    overrides: tuple[str, ...]
    output: Path


def _fmt(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _settings(mapping: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{k}={_fmt(v)}" for k, v in mapping.items())


def _file_name(parts: list[str]) -> str:
    return ",".join(p.replace("/", "_").replace(" ", "") for p in parts)


def _variants(spec: SweepSpec) -> list[tuple[str, tuple[str, ...]]]:
    """(name, overrides) of every variant; one unnamed variant without overrides when the file has none."""
    if not spec.variants:
        return [("", ())]
    out: dict[str, tuple[str, ...]] = {}
    for i, v in enumerate(spec.variants):
        overrides = _settings(v.set)
        name = _file_name([v.name] if v.name is not None else list(overrides))
        if not name:
            raise ConfigError(f"sweep.variants[{i}]: give it a name or a non-empty set")
        if name in out:
            raise ConfigError(f"sweep.variants[{i}]: the name {name!r} is used twice (run names must be unique)")
        out[name] = overrides
    return list(out.items())


def load_sweep(path: str | Path, overrides: list[str] | None = None, seeds: list[int] | None = None,
               output_dir: str | None = None) -> tuple[Path, SweepSpec, list[Run]]:
    """Parse a sweep file and expand it, validating every run's config before anything starts.

    ``overrides`` apply to every run after its own; ``seeds`` and ``output_dir`` replace the file's."""
    path = Path(path)
    raw_spec = load_raw(path)
    if seeds is not None:
        raw_spec["seeds"] = seeds
    if output_dir is not None:
        raw_spec["output_dir"] = output_dir
    spec = build(SweepSpec, raw_spec, "sweep")
    base = (path.parent / spec.base).resolve()
    for key, values in spec.grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.grid.{key}: expected a non-empty list of values")
    if not spec.seeds:
        raise ConfigError("sweep.seeds: expected a non-empty list of seeds")
    keys = list(spec.grid)
    extra = tuple(overrides or ())
    runs = []
    raw_base = load_raw(base)
    for variant, own in _variants(spec):
        for combo in itertools.product(*(spec.grid[k] for k in keys)):
            point = tuple(f"{k}={_fmt(v)}" for k, v in zip(keys, combo))
            for seed in spec.seeds:
                settings = own + point + extra + (f"seed={seed}",)
                try:
                    raw = apply_overrides(raw_base, list(settings))
                    check_required(raw, base)
                    parse_config(raw)
                except ConfigError as exc:
                    raise ConfigError(f"sweep run {' '.join(settings)}: {exc}") from None
                name = _file_name(([variant] if variant else []) + list(point) + [f"seed={seed}"])
                runs.append(Run(name, variant, settings, Path(spec.output_dir) / f"{name}.h5"))
    return base, spec, runs


def _run_command(base: Path, run: Run, ranks: int, launcher: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "mpifl", "run", str(base), "--out", str(run.output), "--quiet"]
    for item in run.overrides:
        cmd += ["--set", item]
    return (launcher + ["-n", str(ranks)] if ranks > 1 else []) + cmd


def run_sweep(path: str, slurm: bool = False, dry_run: bool = False, overrides: list[str] | None = None,
              seeds: list[int] | None = None, output_dir: str | None = None) -> int:
    base, spec, runs = load_sweep(path, overrides, seeds, output_dir)
    out_dir = Path(spec.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if slurm:
        script = write_slurm_array(base, spec, runs, out_dir)
        print(f"{len(runs)} runs; submit with: sbatch {script}")
        return 0
    return execute(base, spec.ranks, runs, dry_run)


def execute(base: Path, ranks: int, runs: list[Run], dry_run: bool = False) -> int:
    """Run ``runs`` one after another (each its own process, under mpirun when ``ranks`` > 1); 1 if any failed."""
    mpirun = [shutil.which("mpirun") or "mpirun", "--oversubscribe"]
    failed = 0
    for i, run in enumerate(runs, 1):
        cmd = _run_command(base, run, ranks, mpirun)
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
