"""Memory of a whole B1 job as proportional set size (PSS), sampled from /proc while it runs.

    python benchmarks/bench_memory.py [--ranks 3 1] [--interval 0.2] [--rounds 30] [--write]

Runs reference workload B1 (configs/b1.yaml: FedAvg, 200 Gaussian-image clients of 64 training samples,
20 per round, small CNN) through the real CLI: `mpirun -n P --oversubscribe python -m mpifl run ...` for
P > 1, `python -m mpifl run ...` for P = 1. Every `--interval` seconds it walks the launcher's process
tree (/proc/*/stat parent ids), finds the job's Python processes (their rank from OMPI_COMM_WORLD_RANK /
PMI_RANK in /proc/PID/environ; 0 without one) and reads `Pss`, `Pss_Anon`, `Pss_File` and `Rss` from
/proc/PID/smaps_rollup. PSS charges each shared page to the processes mapping it in equal parts, so the
ranks' PSS add up to the job's real footprint (libtorch's file pages count once, not once per rank);
RSS counts them in every process. Reported: the peak over samples of the summed PSS of all ranks (the
budget: 900 MB for P = 3), the launcher's (mpirun and its helpers) peak PSS, and each rank's own peak PSS,
anonymous PSS, file-backed PSS and RSS. PSS of file pages also shrinks when processes outside
the job map the same libraries (another job using the same torch), so the largest number of such
processes seen is reported too (this script itself does not import torch), and so is the footprint
the job would have alone: Σ anonymous PSS + its distinct resident file pages (the union of the ranks'
page frames from /proc/PID/pagemap, refreshed once a second as it is slow to read; needs root, else
n/a), which equals Σ PSS when nothing outside shares. For reference: the same figures for fresh
interpreters that import what a rank imports, step by step (one at a time; the registry imports only
the algorithm asked for). With --write the tables are appended to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from common import REPO, heading, launched, record

CONFIG = REPO / "configs" / "b1.yaml"
MB = 1024.0  # smaps_rollup reports kB
PAGE = os.sysconf("SC_PAGE_SIZE")
FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")
RANK_IMPORTS = "import torch, mpi4py.MPI, h5py, mpifl.cli, mpifl.runtime.engine"
BASELINES = {  # label: statement
    "`import torch`": "import torch",
    "a rank's imports before the algorithm (torch, mpi4py.MPI, h5py, mpifl.cli, mpifl.runtime.engine)":
        RANK_IMPORTS,
    "... + `get_algorithm('fedavg')` (imports FedAvg only)":
        f"{RANK_IMPORTS}\nfrom mpifl.registry import get_algorithm\nget_algorithm('fedavg')",
}


def rollup(pid: int) -> dict[str, float] | None:
    """The FIELDS of ``pid``'s smaps_rollup in MB, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out = {}
    for line in lines[1:]:
        key, _, rest = line.partition(":")
        if key in FIELDS:
            out[key] = int(rest.split()[0]) / MB
    return out if len(out) == len(FIELDS) else None


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (parent ids from /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # comm may contain spaces: split after it
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def outsiders_mapping_torch(job: set[int]) -> int:
    """Processes outside the job that map libtorch_cpu.so: they take a share of its pages' PSS."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in job or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                count += "libtorch_cpu.so" in f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return count


def file_pages(pid: int) -> np.ndarray | None:
    """Page frame numbers of the file-backed pages ``pid`` has mapped and resident (/proc/PID/pagemap:
    bit 63 present, bit 61 file page or shared, bits 0-54 the frame). None if the frames are hidden
    (they read as 0 without CAP_SYS_ADMIN) or the process is gone."""
    frames = []
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
            for line in maps:
                parts = line.split()
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                lo, hi = (int(x, 16) // PAGE for x in parts[0].split("-"))
                pagemap.seek(lo * 8)
                entries = np.frombuffer(pagemap.read((hi - lo) * 8), dtype=np.uint64)
                keep = (entries >> np.uint64(63)) & (entries >> np.uint64(61)) & np.uint64(1) == 1
                frames.append(entries[keep] & np.uint64((1 << 55) - 1))
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    frames = np.concatenate(frames) if frames else np.zeros(0, np.uint64)
    return None if len(frames) and not frames.any() else frames


def rank_of(pid: int) -> int | None:
    """The MPI rank of a job's Python process (0 when run without a launcher); None for other processes."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if not Path(argv[0].decode()).name.startswith("python"):
            return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
        return None
    for key in (b"OMPI_COMM_WORLD_RANK", b"PMI_RANK"):
        if key in env:
            return int(env[key])
    return 0


@dataclass
class JobMemory:
    samples: int = 0
    peak_sum_pss: float = 0.0
    peak_at_s: float = 0.0
    peak_launcher_pss: float = 0.0
    peak_sum_anon: float = 0.0
    peak_alone: float | None = 0.0  # Σ anonymous PSS + the job's distinct resident file pages; None: hidden
    outsiders: int = 0  # most processes outside the job seen sharing libtorch's pages at one sample
    ranks: dict[int, dict[str, float]] = field(default_factory=dict)  # per rank: peak of each field
    wall_s: float = 0.0
    trace: list[tuple[float, int, dict[str, float]]] = field(default_factory=list)  # (s, rank, sizes)


def sample_job(cmd: list[str], interval: float, env: dict[str, str]) -> JobMemory:
    """Run ``cmd`` and sample the PSS of its process tree every ``interval`` seconds until it exits."""
    mem = JobMemory()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    ranks_of: dict[int, int | None] = {}
    file_mb, file_at = 0.0, -1.0  # the job's distinct file pages, MB, and when they were counted
    while proc.poll() is None:
        total, anon, launcher, frames = 0.0, 0.0, 0.0, []
        count_files = time.perf_counter() - file_at >= 1.0 and mem.peak_alone is not None
        job = descendants(proc.pid)
        for pid in job:
            if pid not in ranks_of or ranks_of[pid] is None:  # a launcher may exec python later
                ranks_of[pid] = rank_of(pid)
            sizes = rollup(pid)
            if sizes is None:
                continue
            rank = ranks_of[pid]
            if rank is None:
                launcher += sizes["Pss"]
                continue
            total += sizes["Pss"]
            anon += sizes["Pss_Anon"]
            if count_files:
                frames.append(file_pages(pid))
            mem.trace.append((time.perf_counter() - start, rank, sizes))
            peaks = mem.ranks.setdefault(rank, dict.fromkeys(FIELDS, 0.0))
            for key in FIELDS:
                peaks[key] = max(peaks[key], sizes[key])
        mem.samples += 1
        if total > mem.peak_sum_pss:
            mem.peak_sum_pss, mem.peak_at_s = total, time.perf_counter() - start
        mem.peak_launcher_pss = max(mem.peak_launcher_pss, launcher)
        mem.peak_sum_anon = max(mem.peak_sum_anon, anon)
        if frames and any(f is None for f in frames):
            mem.peak_alone = None
        elif frames:
            file_mb, file_at = len(np.unique(np.concatenate(frames))) * PAGE / 2**20, time.perf_counter()
        if mem.peak_alone is not None:
            mem.peak_alone = max(mem.peak_alone, anon + file_mb)
        mem.outsiders = max(mem.outsiders, outsiders_mapping_torch(set(job)))
        time.sleep(interval)
    mem.wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return mem


def write_trace(mem: JobMemory, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(",".join(("t_s", "rank", *FIELDS)) + "\n")
        for t, rank, sizes in mem.trace:
            f.write(",".join((f"{t:.2f}", str(rank), *(f"{sizes[k]:.1f}" for k in FIELDS))) + "\n")


def job_command(ranks: int, rounds: int, out: Path) -> list[str]:
    return launched([sys.executable, "-m", "mpifl", "run", str(CONFIG), "--out", str(out), "--quiet",
                     "--set", f"rounds={rounds}", "--set", f"eval_every={rounds}"], ranks)


def baseline(statement: str) -> dict[str, float]:
    """The FIELDS of a fresh interpreter that runs ``statement`` and nothing else, in MB."""
    code = f"{statement}\nimport sys\nsys.stdout.write(open('/proc/self/smaps_rollup').read())"
    text = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO).stdout
    sizes = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        if key in FIELDS:
            sizes[key] = int(rest.split()[0]) / MB
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[3, 1])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--trace", type=Path, help="also write every sample to TRACE/b1_pP.csv")
    parser.add_argument("--write", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = parser.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    jobs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            jobs[ranks] = sample_job(job_command(ranks, args.rounds, Path(tmp) / f"b1_p{ranks}.h5"), args.interval, env)
            if args.trace:
                write_trace(jobs[ranks], args.trace / f"b1_p{ranks}.csv")
            print(f"P={ranks}: peak summed PSS {jobs[ranks].peak_sum_pss:.1f} MB ({jobs[ranks].samples} samples)",
                  flush=True)
    base = {label: baseline(stmt) for label, stmt in BASELINES.items()}
    record([
        heading("B1 job memory (PSS)"),
        "",
        f"`python benchmarks/bench_memory.py --ranks {' '.join(map(str, args.ranks))} --rounds {args.rounds} "
        f"--interval {args.interval}`",
        "",
        "| job | peak Σ PSS of ranks, MB | at s (of wall s) | peak Σ anonymous PSS, MB | peak footprint alone, MB | "
        "samples | launcher peak PSS, MB | other processes mapping libtorch |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| P={p} | {m.peak_sum_pss:.1f} | {m.peak_at_s:.1f} ({m.wall_s:.1f}) | {m.peak_sum_anon:.1f} | "
          f"{'n/a' if m.peak_alone is None else f'{m.peak_alone:.1f}'} | {m.samples} | {m.peak_launcher_pss:.1f} | "
          f"{m.outsiders} |" for p, m in jobs.items()),
        "",
        "| job | rank | peak PSS, MB | peak anonymous PSS, MB | peak file-backed PSS, MB | peak RSS, MB |",
        "|---|---|---|---|---|---|",
        *(f"| P={p} | {r} | {v['Pss']:.1f} | {v['Pss_Anon']:.1f} | {v['Pss_File']:.1f} | {v['Rss']:.1f} |"
          for p, m in jobs.items() for r, v in sorted(m.ranks.items())),
        *(f"| one process: {label} | – | {v['Pss']:.1f} | {v['Pss_Anon']:.1f} | {v['Pss_File']:.1f} | "
          f"{v['Rss']:.1f} |" for label, v in base.items()),
    ], args.write)


if __name__ == "__main__":
    main()
