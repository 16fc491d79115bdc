"""mpifl beside pfl-research and the bare PyTorch floor on W2 (and W1), alternating, in one invocation.

    python benchmarks/compare_w2.py [--rounds 5] [--passes 2] [--workloads w2 | w1 w2] [--ranks 3]
                                    [--pfl-python /tmp/pfl-venv/bin/python] [--device cpu|cuda]
                                    [--set KEY=VALUE ...] [--write]

For every workload, five settings: mpifl on 1 rank; pfl-research in 1 process; the floor (a bare PyTorch FedAvg
loop, 1 process, 1 thread); mpifl on ``--ranks`` P ranks (1 server + P - 1 workers, under mpirun); pfl-research in
P - 1 processes (its own distributed simulation under torchrun: as many processes training clients as mpifl's
workers). Every setting runs as its own job, one at a time, with one torch thread a process; each pass runs them
all, the odd passes in this order and the even ones in the reverse order (workloads too), so that a drifting
load weighs on both ends alike. Reported: per workload and setting, the median seconds of a training round over
rounds 2..R in each pass (mpifl: the rounds table's ``wall_time_s``, evaluation timed apart; pfl-research: its
central iterations that evaluate nothing; the floor evaluates nothing), and in each pass the ratio to the floor
and, for mpifl, to pfl-research with as many training processes (P = 1 ↔ 1 process, P ↔ P - 1 processes).

W2 (configs/w2.yaml; ``--set`` overrides apply to it, e.g. CIFAR-10): mpifl through ``common.mpifl_job`` as
bench_w2.py (``client.vectorize`` as configured: ``auto``, the loop on the CPU for this CNN), pfl-research
through ``pfl_w2.py --times`` run by ``--pfl-python`` (a venv of its own: see pfl_w2.py), the floor
``bare_w2.bare_rounds`` in this process. W1 (configs/b1.yaml, on the CPU) reuses bench_fedavg.py: its
``mpifl_rounds`` (eval_every = R) and its ``bare_loop`` as the floor, with pfl-research through
``pfl_w2.py --config configs/b1.yaml --set eval_every=R``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bare_w2 import bare_rounds
from bench_fedavg import bare_loop, mpifl_rounds
from common import REPO, heading, job_options, mpifl_job, record

from mpifl.registry import load_config

CONFIGS = {"w1": REPO / "configs" / "b1.yaml", "w2": REPO / "configs" / "w2.yaml"}


def median_after_first(times: list[float]) -> float:
    """The median of rounds 2..R (round 1 alone when there is only one)."""
    return float(np.median(times[1:] if len(times) > 1 else times))


def pfl_median(args: argparse.Namespace, workload: str, processes: int, tmp: Path) -> float:
    """pfl-research's median seconds of a training iteration, from pfl_w2.py run in its venv."""
    times, log = tmp / "pfl_times.json", tmp / "pfl.log"
    cmd = [args.pfl_python, str(REPO / "benchmarks" / "pfl_w2.py"), "--rounds", str(args.rounds),
           "--processes", str(processes), "--times", str(times)]
    if workload == "w1":
        cmd += ["--config", str(CONFIGS["w1"]), "--set", f"eval_every={args.rounds}"]
    else:
        cmd += ["--device", args.device, *(x for o in args.overrides for x in ("--set", o))]
    for attempt in (1, 2):  # once more after a failure: its torchrun processes now and then abort
        times.unlink(missing_ok=True)
        with open(log, "w") as out:  # pfl prints every iteration's metrics: kept out of the table's way
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        if not done.returncode:
            return float(json.loads(times.read_text())["median"])
        print(log.read_text()[-4000:])
        print(f"compare_w2: pfl-research failed ({' '.join(cmd)}), exit status {done.returncode}"
              + (", running it once more" if attempt == 1 else ""), flush=True)
    raise SystemExit("compare_w2: pfl-research failed twice")


def mpifl_median(args: argparse.Namespace, workload: str, ranks: int, tmp: Path) -> float:
    if workload == "w1":
        return median_after_first(mpifl_rounds(ranks, args.rounds, tmp)[0])
    settings = [f"rounds={args.rounds}", f"device={args.device}", *args.overrides]
    res = mpifl_job(CONFIGS["w2"], ranks, tmp / "w2.h5", settings)
    return median_after_first(list(np.asarray(res.table("rounds")["wall_time_s"], dtype=float)))


def floor_median(args: argparse.Namespace, workload: str) -> float:
    if workload == "w1":
        return median_after_first(bare_loop(args.rounds))
    cfg = load_config(CONFIGS["w2"], [f"rounds={args.rounds}", *args.overrides])
    return median_after_first(bare_rounds(cfg, torch.device(args.device))[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=2, help="passes over all settings, alternating the order")
    parser.add_argument("--workloads", nargs="+", choices=sorted(CONFIGS), default=["w2"])
    parser.add_argument("--ranks", type=int, default=3, help="mpifl's P beside pfl-research's P - 1 processes")
    parser.add_argument("--pfl-python", default="/tmp/pfl-venv/bin/python",
                        help="the python of pfl-research's venv (see pfl_w2.py)")
    job_options(parser, "config overrides of configs/w2.yaml (W2 only), as mpifl run --set")
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be at least 2 (1 server + at least 1 worker)")
    if not Path(args.pfl_python).exists():
        parser.error(f"no {args.pfl_python}: install pfl-research in a venv of its own as pfl_w2.py says")
    workers = args.ranks - 1
    settings = {  # name: (kind, processes) in the odd passes' order
        "mpifl P=1": ("mpifl", 1),
        "pfl-research, 1 process": ("pfl", 1),
        "bare PyTorch loop (floor), 1 process": ("floor", 1),
        f"mpifl P={args.ranks} (1 server + {workers} workers)": ("mpifl", args.ranks),
        f"pfl-research, {workers} process{'es' if workers > 1 else ''}": ("pfl", workers),
    }
    order = [(w, name) for w in args.workloads for name in settings]
    medians: dict[tuple[str, str], list[float]] = {key: [] for key in order}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.passes):
            for workload, name in order if k % 2 == 0 else order[::-1]:
                kind, n = settings[name]
                began = time.perf_counter()
                if kind == "mpifl":
                    m = mpifl_median(args, workload, n, Path(tmp))
                elif kind == "pfl":
                    m = pfl_median(args, workload, n, Path(tmp))
                else:
                    m = floor_median(args, workload)
                medians[workload, name].append(m)
                print(f"pass {k + 1}, {workload.upper()}, {name}: {m:.3f} s/round (median of rounds 2..R), "
                      f"job {time.perf_counter() - began:.0f} s, load average {os.getloadavg()[0]:.1f}", flush=True)
    names = list(settings)
    rows = []
    for workload in args.workloads:
        floor = np.array(medians[workload, names[2]])
        for name in names:
            kind, n = settings[name]
            t = np.array(medians[workload, name])
            per_pass = " / ".join(f"{x:.3f}" for x in t)
            to_floor = " / ".join(f"{x:.2f}" for x in t / floor)
            to_pfl = "–"
            if kind == "mpifl":
                pfl = np.array(medians[workload, names[1] if n == 1 else names[4]])
                to_pfl = " / ".join(f"{x:.2f}" for x in t / pfl)
            rows.append(f"| {workload.upper()} | {name} | {per_pass} | {to_floor} | {to_pfl} |")
    command = (f"python benchmarks/compare_w2.py --rounds {args.rounds} --passes {args.passes} --workloads "
               f"{' '.join(args.workloads)} --ranks {args.ranks} --device {args.device}"
               + "".join(f" --set {o}" for o in args.overrides))
    passes = " / ".join(str(k + 1) for k in range(args.passes))
    record([
        heading("mpifl beside pfl-research and the bare PyTorch floor, alternating passes"),
        "",
        f"`{command}` (load average {load_before:.1f} → {os.getloadavg()[0]:.1f})",
        "",
        f"| workload | setting | median s/round (rounds 2..R), pass {passes} | ÷ floor, pass {passes} | "
        f"mpifl ÷ pfl-research (as many training processes), pass {passes} |",
        "|---|---|---|---|---|",
        *rows,
    ], args.write)


if __name__ == "__main__":
    main()
