"""W2 on one GPU, mpifl beside pfl-research and the bare floors, and the round's trace: one lease command.

    python benchmarks/gpu_side_by_side.py --out DIR [--device cuda] [--rounds 6] [--budget 360] [--cohort 50]
                                          [--pfl-site DIR] [--set KEY=VALUE ...] [--only SLUGS] [--skip SLUGS]
                                          [--cap-scale 1]

Runs, most valuable first, each as its own process with its own cap, the whole under ``--budget`` seconds (a step
that would not fit is recorded as not run; the caps add up to at most 70% of the default budget, so what overruns
still fits, and the budget, 360 s, lets one lease of 15 minutes run the command twice): mpifl W2 on 1 rank
(``client.vectorize: auto``, the batched kernel on a GPU); the bare batched floor (``bare_w2.py --batched``: the
same clients' steps as one vmap each, nothing else); pfl-research 0.6 on 1 process; the batched floor with one
local step captured as a CUDA graph and replayed (``--graph``: an experiment, eager on the CPU); the trace of one
mpifl round (``trace_round.py``); pfl-research on 2 and 4 processes and mpifl on 2 and 4 worker ranks (P = 3 and
5: rank 0 is the server), all sharing the one GPU; mpifl on 1 worker rank (P = 2); the bare loop floor.

Every job trains W2's round (50 clients, 5 local steps of 10 images) with every client staged before its first
timed round: the population is the cohort (``--cohort``, default W2's 50: ``data.num_clients`` =
``clients_per_round``), so each round trains all clients; pfl-research and the floors put every client's data on
the device before training, mpifl stages them in round 1 (checked: round 1's participants are the cohort), and
every median is of rounds 2..R. (On W2's 1,000 clients mpifl would stage a round's new clients inside it.)
pfl-research's processes all use the one device, over gloo (``pfl_w2.py``'s ``shared_device``). No evaluation
inside the timed rounds (``eval_every=1000``).

Each result is appended to ``DIR/side_by_side.md`` as it comes (so a stopped command still returns what
finished), with the 1-minute load average at its end and a note (mpifl: round 1's participants and the clients a
round through the kernel; pfl: device and backend; floors: the final weights' digest and whether the graph was
captured), and the jobs' logs, the trace and its operator table to ``DIR/logs.tar.gz`` (two files in all: a lease
returns at most 8), then the ratios the issue's targets name: mpifl on 1 rank against 0.10 s, against
pfl-research's best process count and against the batched floor. ``--pfl-site``: a folder with pfl-research and
the dependencies the image lacks (``scripts/pfl_wheels.sh``, installed with ``pip install --no-deps --target``),
on pfl's jobs' ``PYTHONPATH`` only; without it pfl-research is recorded as not run. ``--device cpu`` rehearses the
command anywhere (``tests/test_side_by_side.py``, at small sizes with ``--cap-scale``: the caps are the GPU's).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

from common import launched  # noqa: E402

BUDGET = 360.0  # seconds: twice this and a machine's start fit one 15-minute lease
CAP_SHARE = 0.7  # the caps add up to at most this share of the budget


@dataclass(frozen=True)
class Setting:
    name: str
    cap: int  # seconds
    kind: str  # mpifl, pfl, floor, trace
    count: int = 1  # ranks or processes
    extra: tuple[str, ...] = ()  # further --set overrides, or the floor's flags

    @property
    def slug(self) -> str:
        """The setting's name as a file name (and as ``--only`` and ``--skip`` name it)."""
        return re.sub(r"[^a-z0-9]+", "_", self.name.lower()).strip("_")


SETTINGS = (
    Setting("mpifl W2, 1 rank", 25, "mpifl", 1),
    Setting("bare batched floor", 15, "floor", 1, ("--batched",)),
    Setting("pfl-research, 1 process", 25, "pfl", 1),
    Setting("bare batched floor, a CUDA graph a step", 15, "floor", 1, ("--batched", "--graph")),
    Setting("trace of an mpifl round (kernel)", 25, "trace", 1, ("client.vectorize=true",)),
    Setting("pfl-research, 2 processes", 25, "pfl", 2),
    Setting("mpifl W2, 2 worker ranks (P = 3)", 25, "mpifl", 3),
    Setting("pfl-research, 4 processes", 30, "pfl", 4),
    Setting("mpifl W2, 4 worker ranks (P = 5)", 30, "mpifl", 5),
    Setting("mpifl W2, 1 worker rank (P = 2)", 20, "mpifl", 2),
    Setting("bare loop floor", 15, "floor", 1),
)
"""Most valuable first. The caps come from the lease of 2026-11-28 (W2 on an H200: 1.3 s a round at worst, jobs
started in 7-14 s) with headroom; they add up to 250 s, under 70% of the 360 s budget."""


def command(setting: Setting, args: argparse.Namespace, scratch: Path) -> tuple[list[str], dict[str, str]]:
    """The process of ``setting`` and its environment (pfl-research's folder on pfl's jobs' path only: its pinned
    dependencies must not shadow mpifl's)."""
    site = [str(args.pfl_site)] if args.pfl_site and setting.kind == "pfl" else []
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *site]))
    sets = [f"clients_per_round={args.cohort}", f"data.num_clients={args.cohort}", "eval_every=1000",
            *args.overrides]
    extra = list(setting.extra)
    if setting.kind == "mpifl":
        out = scratch / f"{setting.slug}.h5"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "mpifl", "run", str(REPO / "configs" / "w2.yaml"), "--out", str(out), "--quiet",
               *(x for s in [f"rounds={args.rounds}", f"device={args.device}", *sets, *extra] for x in ("--set", s))]
        return launched(cmd, setting.count), env
    if setting.kind == "pfl":
        return [sys.executable, str(BENCH / "pfl_w2.py"), "--rounds", str(args.rounds), "--processes",
                str(setting.count), "--device", args.device, "--times", str(scratch / f"{setting.slug}.json"),
                *(x for s in sets for x in ("--set", s))], env
    if setting.kind == "floor":
        return [sys.executable, str(BENCH / "bare_w2.py"), "--rounds", str(args.rounds), "--device", args.device,
                *extra, *(x for s in sets for x in ("--set", s))], env
    return [sys.executable, str(BENCH / "trace_round.py"), "--device", args.device, "--round", "3",
            "--out", str(scratch / setting.slug),
            *(x for s in [*sets, *extra] for x in ("--set", s))], env


def outcome(setting: Setting, stdout: str, scratch: Path, cohort: int) -> tuple[float | None, str]:
    """The setting's median seconds of a training round (rounds 2..R) and its note, from what it left."""
    if setting.kind == "mpifl":
        import h5py

        with h5py.File(scratch / f"{setting.slug}.h5") as f:
            times = np.asarray(f["rounds"]["wall_time_s"][()], dtype=float)
            first = int(f["rounds"]["participants"][0])
            ranks = f["ranks"]
            loads = int(np.sum(ranks["client_data_loads"][()])) if "client_data_loads" in ranks else None
            kernel = (int(np.sum(ranks["clients_trained_vectorized"][()])) // len(times)
                      if "clients_trained_vectorized" in ranks else None)
        if first != cohort or loads not in (None, cohort):
            raise ValueError(f"round 1 trained {first} of {cohort} clients and {loads} were staged: "
                             "a timed round staged clients")
        note = f"round 1 staged all {first} clients" + ("" if kernel is None else f", {kernel} a round in the kernel")
        return float(np.median(times[1:] if len(times) > 1 else times)), note
    if setting.kind == "pfl":
        found = re.search(r" on (\S+) \(backend (\w+)\)", stdout)
        note = f"every process on {found.group(1)}, backend {found.group(2)}" if found else ""
        return float(json.loads((scratch / f"{setting.slug}.json").read_text())["median"]), note
    if setting.kind == "floor":
        found = re.search(r"bare [\w, ]+: ([0-9.]+) s/round.*final weights (\w+)(?:; precision ([^;]*))?"
                          r"(?:; graph (.*))?", stdout)
        if not found:
            return None, ""
        notes = [f"final weights {found.group(2)}"] + [f"precision {found.group(3)}"] * bool(found.group(3)) + [
            found.group(4)] * bool(found.group(4))
        return float(found.group(1)), "; ".join(notes)
    return None, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every job (rounds 2..R are timed)")
    parser.add_argument("--cohort", type=int, default=50,
                        help="clients a round, and all clients of every job (W2's 50; staged before timing)")
    parser.add_argument("--budget", type=float, default=BUDGET, help="seconds for the whole command")
    parser.add_argument("--cap-scale", type=float, default=1.0,
                        help="every cap times this (a CPU rehearsal: the caps are a GPU's)")
    parser.add_argument("--pfl-site", type=Path, help="pfl-research and its dependencies (pip --target)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--only", help="comma-separated substrings of the settings' slugs to run (a rehearsal)")
    parser.add_argument("--skip", help="comma-separated substrings of the settings' slugs not to run")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (round 1 stages the clients and is not timed)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mpifl-side-by-side-") as tmp:  # what matters is in logs.tar.gz
        run_all(args, Path(tmp))
    return 0


def run_all(args: argparse.Namespace, scratch: Path) -> None:
    """Every chosen setting in turn, each row of ``side_by_side.md`` as it comes, then the targets."""
    report = args.out / "side_by_side.md"
    deadline = time.monotonic() + args.budget
    chosen = [s for s in SETTINGS if (not args.only or any(part in s.slug for part in args.only.split(",")))
              and not (args.skip and any(part in s.slug for part in args.skip.split(",")))]
    caps = {s.name: round(s.cap * args.cap_scale) for s in chosen}
    medians: dict[str, float] = {}

    def write(line: str) -> None:
        with open(report, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)

    write(f"`python benchmarks/gpu_side_by_side.py --device {args.device} --rounds {args.rounds} --cohort "
          f"{args.cohort} --budget {args.budget:g}"
          + (f" --cap-scale {args.cap_scale:g}" if args.cap_scale != 1 else "")
          + (f" --only {args.only}" if args.only else "") + (f" --skip {args.skip}" if args.skip else "")
          + "".join(f" --set {o}" for o in args.overrides) + "`")
    write("")
    if sum(caps.values()) > CAP_SHARE * args.budget:
        write(f"(the caps add up to {sum(caps.values())} s, over {CAP_SHARE:.0%} of the budget: the last may not run)")
        write("")
    header = ["| setting | exit | cap s | job s | load (1 min) | median s/round (rounds 2..R) | note |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for line in header:
        write(line)
    for setting in chosen:
        cap = caps[setting.name]
        if setting.kind == "pfl" and args.pfl_site is None:
            write(f"| {setting.name} | not run: no --pfl-site | {cap} | – | – | – | |")
            continue
        if time.monotonic() + cap > deadline:
            write(f"| {setting.name} | not run: budget | {cap} | – | – | – | |")
            continue
        cmd, env = command(setting, args, scratch)
        began = time.monotonic()
        code: int | str
        try:
            done = subprocess.run(cmd, env=env, cwd=BENCH, capture_output=True, text=True, timeout=cap)
            code, stdout = done.returncode, done.stdout
            log = done.stdout + done.stderr
        except subprocess.TimeoutExpired as stopped:
            code, stdout = "cap", ""
            log = "".join(out.decode(errors="replace") if isinstance(out, bytes) else out or ""  # bytes, even so
                          for out in (stopped.stdout, stopped.stderr))
        seconds = time.monotonic() - began
        (scratch / f"{setting.slug}.log").write_text(str(log)[-20000:])
        median, note = None, ""
        if code == 0:
            try:
                median, note = outcome(setting, stdout, scratch, args.cohort)
            except (OSError, KeyError, ValueError) as exc:
                code, note = f"no result ({type(exc).__name__})", str(exc)
        with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:  # anew after each job: what finished comes back
            for path in sorted(scratch.rglob("*")):
                if path.is_file() and path.suffix != ".h5":
                    tar.add(path, arcname=str(path.relative_to(scratch)))
        if median is not None:
            medians[setting.name] = median
        write(f"| {setting.name} | {code} | {cap} | {seconds:.0f} | {os.getloadavg()[0]:.1f} | "
              f"{'–' if median is None else f'{median:.4f}'} | {note} |")
        if setting.kind == "trace" and code == 0:
            write("")
            write(f"{setting.name}:")
            write("")
            for line in (line for line in stdout.splitlines() if line.startswith("|")):
                write(line)
            write("")
            for line in header:
                write(line)
    targets(write, medians)


def targets(write: Callable[[str], None], medians: dict[str, float]) -> None:
    """The issue's targets for mpifl's W2 on 1 rank, as far as their settings ran."""
    mine = medians.get(SETTINGS[0].name)
    pfl = [v for k, v in medians.items() if k.startswith("pfl-research")]
    floor = medians.get(SETTINGS[1].name)
    write("")
    write("| target (W2, mpifl on 1 rank) | measured | met |")
    write("|---|---:|---|")
    if mine is None:
        return
    write(f"| ≤ 0.10 s a round | {mine:.4f} s | {'yes' if mine <= 0.10 else 'no'} |")
    if pfl:
        write(f"| ≤ 0.5 × pfl-research's best ({min(pfl):.4f} s) | {mine / min(pfl):.2f} × | "
              f"{'yes' if mine <= 0.5 * min(pfl) else 'no'} |")
    if floor is not None:
        write(f"| ≤ 1.5 × the batched floor ({floor:.4f} s) | {mine / floor:.2f} × | "
              f"{'yes' if mine <= 1.5 * floor else 'no'} |")


if __name__ == "__main__":
    sys.exit(main())
