"""W2 on one GPU, mpifl beside pfl-research and the bare floors, and the round's trace: one lease command.

    python benchmarks/gpu_side_by_side.py --out DIR [--device cuda] [--rounds 6] [--budget 450]
                                          [--pfl-site DIR] [--set KEY=VALUE ...]

Runs, most valuable first, each as its own process with its own cap, the whole under ``--budget`` seconds (a step
that would not fit is recorded as not run): mpifl W2 on 1 rank (``client.vectorize: auto``, the batched kernel
on a GPU); the bare batched floor (``bare_w2.py --batched``: the same clients' steps as one vmap each, nothing
else); pfl-research 0.6 on 1 process; the trace of one mpifl round (``trace_round.py``); pfl-research on 2 and 4
processes and mpifl on 3 and 5 ranks (2 and 4 workers) sharing the GPU; the bare loop floor; the trace of the
loop (``client.vectorize: false``); B1 (configs/b1.yaml) and W2 with resnet20 on 1 rank. Every setting trains
W2's round (50 clients, 5 local steps of 10 images) on ``data.num_clients: 200`` clients (the same work a round;
less to build before it). Each result is appended to ``DIR/side_by_side.md`` as it comes (so a stopped command
still returns what finished), and the jobs' logs, the traces and their operator tables to ``DIR/logs.tar.gz``
(two files in all: a lease returns at most 8), then the ratios the issue's targets name: mpifl on 1 rank
against 0.10 s, against pfl-research's best process count and against the batched floor. ``--pfl-site``: a
folder with pfl-research and the dependencies the image lacks (``scripts/pfl_wheels.sh``, installed with
``pip install --no-deps --target``); without it pfl-research is recorded as not run. ``--device cpu``
rehearses the command anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


@dataclass(frozen=True)
class Setting:
    name: str
    cap: int  # seconds
    kind: str  # mpifl, pfl, floor, trace
    count: int = 1  # ranks or processes
    extra: tuple[str, ...] = ()  # further --set overrides, or the floor's flag

    @property
    def slug(self) -> str:
        """The setting's name as a file name."""
        return re.sub(r"[^a-z0-9]+", "_", self.name.lower())


SETTINGS = (
    Setting("mpifl W2, 1 rank", 60, "mpifl", 1),
    Setting("bare batched floor, 1 process", 45, "floor", 1, ("--batched",)),
    Setting("pfl-research, 1 process", 60, "pfl", 1),
    Setting("trace of an mpifl round (kernel)", 60, "trace", 1, ("client.vectorize=true",)),
    Setting("pfl-research, 2 processes", 60, "pfl", 2),
    Setting("mpifl W2, 3 ranks (2 workers)", 60, "mpifl", 3),
    Setting("pfl-research, 4 processes", 75, "pfl", 4),
    Setting("mpifl W2, 5 ranks (4 workers)", 75, "mpifl", 5),
    Setting("bare loop floor, 1 process", 45, "floor", 1),
    Setting("trace of an mpifl round (loop)", 60, "trace", 1, ("client.vectorize=false",)),
    Setting("mpifl B1, 1 rank", 45, "mpifl", 1, ("config=b1",)),
    Setting("mpifl W2 resnet20, 1 rank", 60, "mpifl", 1, ("model.name=resnet20",)),
)


def command(setting: Setting, args: argparse.Namespace, scratch: Path) -> tuple[list[str], dict[str, str]]:
    """The process of ``setting`` and its environment."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *([str(args.pfl_site)] if args.pfl_site else [])]))
    sets = [f"data.num_clients={args.clients}", *args.overrides]
    config = REPO / "configs" / "w2.yaml"
    extra = list(setting.extra)
    if "config=b1" in extra:
        extra.remove("config=b1")
        config, sets = REPO / "configs" / "b1.yaml", list(args.overrides)
    if setting.kind == "mpifl":
        out = scratch / f"{setting.slug}.h5"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "mpifl", "run", str(config), "--out", str(out), "--quiet",
               *(x for s in [f"rounds={args.rounds}", f"device={args.device}", "eval_every=1000", *sets, *extra]
                 for x in ("--set", s))]
        if setting.count > 1:
            cmd = ["mpirun", "-n", str(setting.count), "--oversubscribe", *cmd]
        return cmd, env
    if setting.kind == "pfl":
        return [sys.executable, str(BENCH / "pfl_w2.py"), "--rounds", str(args.rounds), "--processes",
                str(setting.count), "--device", args.device, "--times", str(scratch / "pfl.json"),
                *(x for s in sets for x in ("--set", s))], env
    if setting.kind == "floor":
        return [sys.executable, str(BENCH / "bare_w2.py"), "--rounds", str(args.rounds), "--device", args.device,
                *extra, *(x for s in sets for x in ("--set", s))], env
    return [sys.executable, str(BENCH / "trace_round.py"), "--device", args.device, "--round", "3",
            "--out", str(scratch / setting.slug),
            *(x for s in [*sets, *extra] for x in ("--set", s))], env


def median_of(setting: Setting, stdout: str, scratch: Path) -> float | None:
    """The setting's median seconds of a training round (rounds 2..R), from what it left."""
    if setting.kind == "mpifl":
        import h5py

        out = scratch / f"{setting.slug}.h5"
        with h5py.File(out) as f:
            times = np.asarray(f["rounds"]["wall_time_s"][()], dtype=float)
        return float(np.median(times[1:] if len(times) > 1 else times))
    if setting.kind == "pfl":
        return float(json.loads((scratch / "pfl.json").read_text())["median"])
    if setting.kind == "floor":
        found = re.search(r"bare \w+: ([0-9.]+) s/round", stdout)
        return float(found.group(1)) if found else None
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=200, help="data.num_clients of every W2 setting")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole command")
    parser.add_argument("--pfl-site", type=Path, help="pfl-research and its dependencies (pip --target)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--only", help="comma-separated substrings of the settings to run (a rehearsal)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / "side_by_side.md"
    scratch = Path(tempfile.mkdtemp(prefix="mpifl-side-by-side-"))
    deadline = time.monotonic() + args.budget
    medians: dict[str, float] = {}

    def write(line: str) -> None:
        with open(report, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)

    write(f"`python benchmarks/gpu_side_by_side.py --device {args.device} --rounds {args.rounds} --clients "
          f"{args.clients}" + "".join(f" --set {o}" for o in args.overrides) + "`")
    write("")
    write("| setting | exit | cap s | job s | median s/round (rounds 2..R) |")
    write("|---|---:|---:|---:|---:|")
    for setting in SETTINGS:
        if args.only and not any(part in setting.name for part in args.only.split(",")):
            continue
        if setting.kind == "pfl" and args.pfl_site is None:
            write(f"| {setting.name} | not run: no --pfl-site | {setting.cap} | – | – |")
            continue
        if time.monotonic() + setting.cap > deadline:
            write(f"| {setting.name} | not run: budget | {setting.cap} | – | – |")
            continue
        cmd, env = command(setting, args, scratch)
        began = time.monotonic()
        try:
            done = subprocess.run(cmd, env=env, cwd=BENCH, capture_output=True, text=True, timeout=setting.cap)
            code, stdout = done.returncode, done.stdout
            log = done.stdout + done.stderr
        except subprocess.TimeoutExpired as stopped:
            code, stdout = "cap", ""
            log = f"{stopped.stdout or ''}{stopped.stderr or ''}"
        seconds = time.monotonic() - began
        (scratch / f"{setting.slug}.log").write_text(str(log)[-20000:])
        median = None
        if code == 0:
            try:
                median = median_of(setting, stdout, scratch)
            except (OSError, KeyError, ValueError) as exc:
                code = f"no result ({type(exc).__name__})"
        with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:  # anew after each job: what finished comes back
            for path in sorted(scratch.rglob("*")):
                if path.is_file() and path.suffix != ".h5":
                    tar.add(path, arcname=str(path.relative_to(scratch)))
        if median is not None:
            medians[setting.name] = median
        write(f"| {setting.name} | {code} | {setting.cap} | {seconds:.0f} | "
              f"{'–' if median is None else f'{median:.4f}'} |")
        if setting.kind == "trace" and code == 0:
            table = [line for line in stdout.splitlines() if line.startswith("|")]
            write("")
            write(f"{setting.name}:")
            write("")
            for line in table:
                write(line)
            write("")
            write("| setting | exit | cap s | job s | median s/round (rounds 2..R) |")
            write("|---|---:|---:|---:|---:|")
    mine = medians.get(SETTINGS[0].name)
    pfl = [v for k, v in medians.items() if k.startswith("pfl-research")]
    floor = medians.get(SETTINGS[1].name)
    write("")
    write("| target (W2, mpifl on 1 rank) | measured | met |")
    write("|---|---:|---|")
    if mine is not None:
        write(f"| ≤ 0.10 s a round | {mine:.4f} s | {'yes' if mine <= 0.10 else 'no'} |")
        if pfl:
            write(f"| ≤ 0.5 × pfl-research's best ({min(pfl):.4f} s) | {mine / min(pfl):.2f} × | "
                  f"{'yes' if mine <= 0.5 * min(pfl) else 'no'} |")
        if floor is not None:
            write(f"| ≤ 1.5 × the batched floor ({floor:.4f} s) | {mine / floor:.2f} × | "
                  f"{'yes' if mine <= 1.5 * floor else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
