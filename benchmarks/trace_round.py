"""Where one training round's time goes, under ``torch.profiler``: kernels, launches, host syncs, copies, Python.

    python benchmarks/trace_round.py [--config configs/w2.yaml] [--device cuda] [--round 3] [--out DIR]
                                     [--set KEY=VALUE ...]

Runs the config for ``--round`` rounds in this process on one rank (rank 0 is server and worker, evaluation only
at the end) and profiles the last round alone (CPU activities, and CUDA's on a GPU). Prints one markdown table:
the round's wall seconds; the device's kernel seconds (the sum of CUDA kernel durations: the arithmetic); the
launches (``cudaLaunchKernel`` and kin: count and host seconds); the host's waits for the device
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``: count and seconds); the copies
(``cudaMemcpy*``: count and host seconds); the ATen operations dispatched; and the rest of the wall, the host's
Python and framework time. With ``--out``, the chrome trace (``trace.json``) and the operator table go there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, job_options

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profiled_round(config: Path, round_: int, device: str, overrides: list[str]):  # noqa: ANN201 - a profile
    """(the profiler of round ``round_``, that round's wall seconds)."""
    import torch
    from mpi4py import MPI

    from mpifl.registry import load_config
    from mpifl.runtime.engine import Engine
    from mpifl.runtime.synchronous import SynchronousRounds

    cfg = load_config(config, [f"rounds={round_}", f"eval_every={10 * round_}", f"device={device}", *overrides])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    captured: dict[str, object] = {}
    original = SynchronousRounds.train_round

    def traced(self: SynchronousRounds, number: int) -> None:  # profiles the last round only
        if number != round_:
            return original(self, number)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            began = time.perf_counter()
            original(self, number)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            captured["wall"] = time.perf_counter() - began
        captured["prof"] = prof
        return None

    SynchronousRounds.train_round = traced  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            engine = Engine(cfg, MPI.COMM_SELF, Path(tmp) / "trace.h5")
            engine.prepare()
            engine.run(progress=False)
    finally:
        SynchronousRounds.train_round = original  # type: ignore[method-assign]
    return captured["prof"], float(captured["wall"])  # type: ignore[arg-type]


def summary(prof, wall: float) -> dict[str, float]:  # noqa: ANN001 - a torch.profiler.profile
    """The round's figures from the profiler's events."""
    events = prof.events()
    total = {"wall s": wall, "kernel s": 0.0, "launches": 0, "launch s": 0.0, "syncs": 0, "sync s": 0.0,
             "copies": 0, "copy s": 0.0, "aten ops": 0}
    for event in events:
        name, seconds = event.name, event.cpu_time_total / 1e6
        if event.device_type.name == "CUDA":
            total["kernel s"] += event.device_time_total / 1e6 if hasattr(event, "device_time_total") else 0.0
        elif name in LAUNCHES:
            total["launches"] += 1
            total["launch s"] += seconds
        elif name in SYNCS:
            total["syncs"] += 1
            total["sync s"] += seconds
        elif name.startswith("cudaMemcpy"):
            total["copies"] += 1
            total["copy s"] += seconds
        elif name.startswith("aten::"):
            total["aten ops"] += 1
    total["rest s"] = max(wall - total["launch s"] - total["sync s"] - total["copy s"], 0.0)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "w2.yaml")
    parser.add_argument("--round", type=int, default=3, help="the round profiled (the earlier ones warm up)")
    parser.add_argument("--out", type=Path, help="a folder for trace.json and the operator table")
    job_options(parser)
    args = parser.parse_args()
    prof, wall = profiled_round(args.config, args.round, args.device, args.overrides)
    figures = summary(prof, wall)
    settings = " ".join(f"--set {o}" for o in args.overrides)
    print(f"`python benchmarks/trace_round.py --config {args.config.name} --device {args.device} "
          f"--round {args.round} {settings}`".replace("  ", " "))
    print("")
    print("| " + " | ".join(figures) + " |")
    print("|" + "---:|" * len(figures))
    print("| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in figures.values()) + " |",
          flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(args.out / "trace.json"))
        sort = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
        (args.out / "operators.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))


if __name__ == "__main__":
    sys.exit(main())
