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
last, and named in its file name with the value given), ``--seeds`` and ``--output-dir`` shrink or move a sweep
without editing it (a smoke test: ``--set rounds=2 --seeds 0 --output-dir /tmp/smoke``). ``mpifl sweep FILE
--slurm`` writes a SLURM job array (one task per run) and its run list instead, for ``sbatch``. ``mpifl report
DIR`` then aggregates the results over seeds.

A sweep picks up where it stopped: a run whose results file is completed with the same config is skipped, one
that was interrupted continues from its checkpoint (``run --resume``) or, without one, starts again; a file that
holds a different config stops the sweep before anything runs, unless ``--overwrite`` (every run starts again).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mpifl.config import (
    RESULT_NEUTRAL,
    apply_overrides,
    check_required,
    config_differences,
    config_to_dict,
    load_raw,
)
from mpifl.registry import parse_config
from mpifl.results.guard import OutputLock, inspect_output, refuse_unless_ours, results_names, writable_directory
from mpifl.results.space import STORAGE_EXIT, written_whole
from mpifl.results.writing import check_names
from mpifl.schema import ConfigError, build, limits

SET_BY_SLURM_TASK = ("threads_per_rank",)
"""Config keys a SLURM task sets itself from its allocation, after the sweep's: not compared when planning one."""


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
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # as config_to_dict gives it


@dataclass(frozen=True)
class Step:
    """What a sweep does with one run: ``new`` (no file yet), ``skip`` (completed with the same config),
    ``resume`` (unfinished, from its checkpoint) or ``restart`` (its file replaced: unfinished without a
    checkpoint, or ``--overwrite``)."""

    run: Run
    action: str
    checkpoint_round: int | None = None
    force_start: bool = False  # start even where the run's estimate does not fit (run --force-start)

    def flags(self) -> list[str]:
        """The ``mpifl run`` options, beside ``--out``, that let the run take its file as it is."""
        taking = {"resume": ["--resume", str(self.run.output)], "restart": ["--overwrite"]}.get(self.action, [])
        return taking + ["--force-start"] * self.force_start

    def describe(self) -> str:
        if self.action == "resume":
            return f"{self.run.name} (resumed from its checkpoint at round {self.checkpoint_round})"
        return f"{self.run.name} (started again)" if self.action == "restart" else self.run.name


def _fmt(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _settings(mapping: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{k}={_fmt(v)}" for k, v in mapping.items())


def _file_name(parts: Iterable[str]) -> str:
    return ",".join(p.replace("/", "_").replace(" ", "") for p in parts)


def _by_key(settings: Iterable[str]) -> dict[str, str]:
    """``key=value`` settings by key, each value as written; a later setting of a key replaces the earlier one
    where it stood, so a name shows every key once, with the value the run has."""
    out: dict[str, str] = {}
    for item in settings:
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip()
    return out


def _variants(spec: SweepSpec) -> list[tuple[str, bool, tuple[str, ...]]]:
    """(name, named, overrides) of every variant (an unnamed one is named after its overrides); one unnamed
    variant without overrides when the file has none."""
    if not spec.variants:
        return [("", False, ())]
    out: list[tuple[str, bool, tuple[str, ...]]] = []
    for i, v in enumerate(spec.variants):
        overrides = _settings(v.set)
        name = _file_name([v.name] if v.name is not None else overrides)
        if not name:
            raise ConfigError(f"sweep.variants[{i}]: give it a name or a non-empty set")
        if name in (earlier for earlier, _, _ in out):
            raise ConfigError(f"sweep.variants[{i}]: the name {name!r} is used twice (run names must be unique)")
        out.append((name, v.name is not None, overrides))
    return out


def load_sweep(path: str | Path, overrides: list[str] | None = None, seeds: list[int] | None = None,
               output_dir: str | None = None) -> tuple[Path, SweepSpec, list[Run]]:
    """Parse a sweep file and expand it, validating every run's config before anything starts.

    ``overrides`` apply to every run after its own and are named in its file name with the value given (one
    that sets a grid key names that key's value once, as the run has it; grid points it makes equal are one
    run); ``seeds`` and ``output_dir`` replace the file's."""
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
    extra = tuple(overrides or ())
    if "seed" in _by_key(extra):
        raise ConfigError("sweep --set seed=...: the sweep sets every run's seed; give --seeds instead")
    keys = list(spec.grid)
    runs: dict[str, Run] = {}
    raw_base = load_raw(base)
    for variant, named, own in _variants(spec):
        for combo in itertools.product(*(spec.grid[k] for k in keys)):
            point = tuple(f"{k}={_fmt(v)}" for k, v in zip(keys, combo))
            for seed in spec.seeds:
                settings = own + point + extra + (f"seed={seed}",)
                shown = _by_key((() if named else own) + point + extra + (f"seed={seed}",))
                name = _file_name([variant] * named + [f"{k}={v}" for k, v in shown.items()])
                if name in runs:
                    continue
                try:
                    raw = apply_overrides(raw_base, list(settings))
                    check_required(raw, base)
                    config = config_to_dict(parse_config(raw))
                except ConfigError as exc:
                    raise ConfigError(f"sweep run {' '.join(settings)}: {exc}") from None
                output = Path(spec.output_dir) / f"{name}.h5"
                try:  # a long variant name or grid value: before any run starts, not in the middle of the sweep
                    check_names(output, results_names(output, resume=False))
                except ConfigError as exc:
                    raise ConfigError(f"sweep run {name[:40]}…: {exc}" if len(name) > 40 else
                                      f"sweep run {name}: {exc}") from None
                runs[name] = Run(name, variant, settings, output, config)
    return base, spec, list(runs.values())


def _differences(stored: str, run: Run, ignored: tuple[str, ...]) -> list[str]:
    """How the config stored in a run's results file differs from the run's (keys in ``ignored`` aside), as
    this version reads it (a key added since takes its default)."""
    try:
        saved = config_to_dict(parse_config(yaml.safe_load(stored)))
    except (ConfigError, yaml.YAMLError) as exc:
        return [f"its config does not load in this version ({str(exc).splitlines()[0]})"]
    given = dict(run.config)
    for key in ignored:
        saved.pop(key, None)
        given.pop(key, None)
    return config_differences(saved, given)


def plan(runs: list[Run], overwrite: bool, ignored: tuple[str, ...] = RESULT_NEUTRAL) -> list[Step]:
    """What to do with each run, given what its results file holds; raises :class:`ConfigError` (one line,
    nothing run) for a file the sweep must not take: not an mpifl results file, being written by a run now,
    or holding a different config (unless ``overwrite``)."""
    steps, conflicts = [], []
    for run in runs:
        state = inspect_output(run.output)
        if state.kind == "foreign":
            raise ConfigError(f"sweep run {run.name}: output {run.output} is not an mpifl results file; it is never "
                              "replaced: move it, or give another --output-dir")
        try:
            OutputLock.acquire(run.output).release()  # refused while another run writes it
        except ConfigError as exc:
            raise ConfigError(f"sweep run {run.name}: {exc}") from None
        if state.kind == "absent":
            steps.append(Step(run, "new"))
        elif overwrite:
            steps.append(Step(run, "restart"))
        elif changed := _differences(str(state.config), run, ignored):
            conflicts.append(f"sweep run {run.name}: {run.output} holds a run with another config "
                             f"({'; '.join(changed)})")
        elif state.status == "completed":
            steps.append(Step(run, "skip"))
        elif state.checkpoint_round is not None:
            steps.append(Step(run, "resume", state.checkpoint_round))
        else:
            steps.append(Step(run, "restart"))
    if conflicts:
        more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
        raise ConfigError(f"{conflicts[0]}{more}; --overwrite replaces them, or give another --output-dir")
    return steps


def _count(steps: list[Step]) -> str:
    """How many runs the sweep skips, resumes, starts again and starts: for the line before it runs any."""
    counts = {action: sum(s.action == action for s in steps) for action in ("skip", "resume", "restart", "new")}
    said = [f"{counts['skip']} completed already (skipped)", f"{counts['resume']} resumed from a checkpoint",
            f"{counts['restart']} started again", f"{counts['new']} new"]
    runs = f"{len(steps)} run{'s' * (len(steps) != 1)}"
    return f"{runs}: " + ", ".join(text for text, n in zip(said, counts.values()) if n)


def _run_command(base: Path, step: Step, ranks: int, launcher: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "mpifl", "run", str(base), "--out", str(step.run.output), "--quiet", *step.flags()]
    for item in step.run.overrides:
        cmd += ["--set", item]
    return (launcher + ["-n", str(ranks)] if ranks > 1 else []) + cmd


def run_sweep(path: str, slurm: bool = False, dry_run: bool = False, overrides: list[str] | None = None,
              seeds: list[int] | None = None, output_dir: str | None = None, overwrite: bool = False,
              force_start: bool = False) -> int:
    base, spec, runs = load_sweep(path, overrides, seeds, output_dir)
    out_dir = writable_directory(spec.output_dir, "--output-dir" if output_dir is not None else "sweep.output_dir")
    steps = plan(runs, overwrite, RESULT_NEUTRAL + SET_BY_SLURM_TASK if slurm else RESULT_NEUTRAL)
    steps = [dataclasses.replace(step, force_start=force_start) for step in steps]
    print(f"mpifl: {_count(steps)}", flush=True)
    todo = [s for s in steps if s.action != "skip"]
    if slurm:
        if todo:
            print(f"submit with: sbatch {write_slurm_array(base, spec, todo, out_dir)}")
        return 0
    again = ["python", "-m", "mpifl", "sweep", path, *(a for o in overrides or () for a in ("--set", o))]
    again += ["--seeds", *map(str, seeds)] if seeds else []
    again += ["--output-dir", output_dir] if output_dir is not None else []
    again += ["--force-start"] if force_start else []
    return execute(base, spec.ranks, todo, dry_run, shlex.join(again))


def child_environment() -> dict[str, str]:
    """The environment of a sweep's runs: this one, and as root what Open MPI needs to start at all (as
    ``jobs/run_local.sh`` sets it)."""
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def execute(base: Path, ranks: int, steps: list[Step], dry_run: bool = False, again: str = "mpifl sweep") -> int:
    """Run ``steps`` one after another (each its own process, under mpirun when ``ranks`` > 1); 1 if any failed
    (named, with the command ``again`` that does them once more). SIGINT or SIGTERM (Ctrl-C reaches the run under
    way too, which stops with a checkpoint) stops the sweep after the run under way, with ``again`` and exit code
    128 + the signal; a run the file system stopped (exit code 75: full, over quota, failing) stops it too, with
    what is complete, ``again`` and 75, as every run after it would fail the same way."""
    mpirun = [shutil.which("mpirun") or "mpirun", "--oversubscribe"]
    env = child_environment()
    failed: list[str] = []
    asked: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: asked.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i, step in enumerate(steps, 1):
            cmd = _run_command(base, step, ranks, mpirun)
            print(f"[{i}/{len(steps)}] {step.describe()}", flush=True)
            if dry_run:
                print("  " + shlex.join(cmd))
                continue
            proc = subprocess.run(cmd, env=env)
            if proc.returncode == STORAGE_EXIT:
                done = i - 1 - len(failed)
                print(f"mpifl: the file system stopped run {i} of {len(steps)} ({step.run.name}; what its file keeps: "
                      f"the line above); {done} run{'s' * (done != 1)} before it completed"
                      f"{f', {len(failed)} failed' if failed else ''}; free space (or mend what the line above "
                      f"names), then continue with: {again} (completed runs are skipped, a stopped one resumes from "
                      "its checkpoint)", file=sys.stderr)
                return STORAGE_EXIT
            if proc.returncode != 0:
                failed.append(step.run.name)
            if asked:
                print(f"mpifl: {signal.Signals(asked[0]).name}: sweep stopped after run {i} of {len(steps)} (an "
                      f"interrupted run resumes from its checkpoint); continue with: {again}", file=sys.stderr)
                return 128 + asked[0]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failed:
        print(f"mpifl: {len(failed)} of {len(steps)} runs failed ({', '.join(failed)}: their lines above say why); "
              f"the others completed; {again} does the failed ones again", file=sys.stderr)
    return 1 if failed else 0


def _environment_lines() -> str:
    """Shell lines that give a SLURM task the environment this sweep was planned in: its directory (the
    relative paths of the sweep and its configs hold there), its virtual environment (mpirun and the Python
    packages), and as root what Open MPI needs, as ``jobs/mpifl.sbatch`` does."""
    lines = [f"cd {shlex.quote(str(Path.cwd()))}"]
    activate = Path(sys.prefix) / "bin" / "activate"
    if sys.prefix != sys.base_prefix and activate.is_file():
        lines.append(f"source {shlex.quote(str(activate))}")
    lines.append('if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi')
    lines.append('export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}')
    return "\n".join(lines)


RUN_LIST_MARK = "# written by mpifl sweep --slurm: one run a line (its results file, flags and overrides)\n"
SCRIPT_MARK = "#!/bin/bash\n# written by mpifl sweep --slurm"
"""What starts the files ``--slurm`` writes: a user's file of the same name (without it) is never replaced."""


def write_slurm_array(base: Path, spec: SweepSpec, steps: list[Step], out_dir: Path) -> Path:
    """A job array with one task per run to do; each task reads its options (how it takes its file, its
    overrides) from runs.txt."""
    run_list, script = out_dir / "runs.txt", out_dir / "sweep.sbatch"
    refuse_unless_ours(run_list, RUN_LIST_MARK)
    refuse_unless_ours(script, SCRIPT_MARK)
    with written_whole(run_list, "the sweep's run list") as tmp:
        tmp.write_text(RUN_LIST_MARK + "".join(
            shlex.join([str(s.run.output), *s.flags(), *(a for o in s.run.overrides for a in ("--set", o))]) + "\n"
            for s in steps
        ))
    with written_whole(script, "the sweep's batch script") as tmp:
        tmp.write_text(f"""{SCRIPT_MARK} for the runs still to do; after an interruption, write it again (completed
# runs are left out, interrupted ones resume) and submit it again.
#SBATCH --job-name=mpifl-sweep
#SBATCH --array=0-{len(steps) - 1}
#SBATCH --ntasks={spec.ranks}
#SBATCH --cpus-per-task=1
#SBATCH --output={out_dir.resolve()}/slurm-%A_%a.out
# Launcher as in jobs/mpifl.sbatch: srun (MPIFL_SRUN_MPI=pmix with the PyPI Open MPI wheel) or
# MPIFL_LAUNCHER=mpirun.
set -euo pipefail
{_environment_lines()}
line=$(sed -n "$((SLURM_ARRAY_TASK_ID + 2))p" {shlex.quote(str(run_list.resolve()))})
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
