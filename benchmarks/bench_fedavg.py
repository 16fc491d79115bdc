"""FedAvg throughput on reference workload B1: mpifl vs a bare single-process PyTorch loop, same run.

    python benchmarks/bench_fedavg.py [--rounds 30] [--ranks 1 3] [--write]

B1 (configs/b1.yaml): class-conditional Gaussian images 1×28×28, 10 classes, 200 clients × 64
training samples (2 classes each), 20 clients per round, 2 local epochs of batch 16 (8 SGD steps),
plain SGD lr 0.05, Conv(1→16,5)-Pool-Conv(16→32,5)-Pool-FC(512→128)-FC(128→10). The bare loop
trains the same clients on the same data with one thread and averages the models the usual way
(state_dict copies, torch.optim.SGD). Reported: median seconds per round over rounds 2..R, and
each mpifl setting's ratio to the bare loop measured in this same run. With --write the table is
appended to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import REPO, heading, mpifl_job, record

from mpifl.data import build_federated_dataset
from mpifl.models import build_model
from mpifl.registry import load_config
from mpifl.runtime.sampling import sample_clients

CONFIG = REPO / "configs" / "b1.yaml"


def bare_loop(rounds: int) -> list[float]:
    """The textbook single-process FedAvg loop of B1, one thread."""
    torch.set_num_threads(1)
    cfg = load_config(CONFIG)
    data = build_federated_dataset(cfg.data, cfg.seed)
    clients = data.load_clients(range(data.layout.num_clients))
    xs = {c: torch.from_numpy(s.x_train) for c, s in clients.items()}
    ys = {c: torch.from_numpy(s.y_train) for c, s in clients.items()}
    model = build_model(cfg.model, data.layout, cfg.seed)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(0)
    times = []
    for round_ in range(1, rounds + 1):
        start = time.perf_counter()
        sampled = sample_clients(cfg.seed, round_, np.arange(data.layout.num_clients), cfg.clients_per_round)
        weights = data.layout.train_sizes[sampled] / data.layout.train_sizes[sampled].sum()
        new_state = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for client, w in zip(sampled, weights):
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=cfg.client.lr)
            x, y = xs[client], ys[client]
            for _ in range(cfg.client.epochs):
                order = torch.randperm(len(x), generator=gen)
                for i in range(0, len(x), cfg.client.batch_size):
                    idx = order[i : i + cfg.client.batch_size]
                    opt.zero_grad()
                    loss_fn(model(x[idx]), y[idx]).backward()
                    opt.step()
            for k, v in model.state_dict().items():
                new_state[k] += float(w) * v
        global_state = new_state
        times.append(time.perf_counter() - start)
    return times


def mpifl_rounds(ranks: int, rounds: int, workdir: Path) -> tuple[list[float], float]:
    """Seconds of each round, and the share of a core the server used while it waited (P > 1)."""
    results = mpifl_job(CONFIG, ranks, workdir / f"b1_p{ranks}.h5", [f"rounds={rounds}", f"eval_every={rounds}"])
    r = {k: v[0] for k, v in results.table("ranks").items()}  # rank 0
    busy = r["server_seconds"] + r["eval_seconds"] + r["io_seconds"] + r["serialization_seconds"]
    idle_cpu = (r["loop_cpu_seconds"] - busy) / r["loop_wall_seconds"] if ranks > 1 else np.nan
    return list(results.table("rounds")["wall_time_s"]), idle_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeats", type=int, default=1,
                        help="interleave this many passes (bare loop, then each P): ratios from each pass, "
                             "so a drifting machine speed cancels out")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    bare_label = "bare PyTorch loop, 1 process, 1 thread"
    labels = [bare_label] + [
        "mpifl, P=1" if ranks == 1 else f"mpifl, P={ranks} (1 server + {ranks - 1} workers)" for ranks in args.ranks
    ]
    passes, idle = [], []  # per pass: each setting's median s/round, and the server's idle CPU share
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            runs = [mpifl_rounds(ranks, args.rounds, Path(tmp)) for ranks in args.ranks]
            passes.append([float(np.median(bare_loop(args.rounds)[1:]))] + [float(np.median(t[1:])) for t, _ in runs])
            idle.append([np.nan] + [share for _, share in runs])
    table = np.array(passes)  # [pass, setting]
    ratios = np.median(table / table[:, :1], axis=0)
    idle_share = np.median(np.array(idle), axis=0)
    record([
        heading("FedAvg B1 throughput"),
        "",
        f"`python benchmarks/bench_fedavg.py --rounds {args.rounds} --ranks {' '.join(map(str, args.ranks))} "
        f"--repeats {args.repeats}`",
        "",
        "| setting | median s/round (rounds 2..R; median over passes) | ratio to bare loop (median over passes) "
        "| server's CPU share while waiting (target ≤ 5%) |",
        "|---|---|---|---|",
        *(f"| {label} | {np.median(table[:, j]):.3f} | {ratios[j]:.2f}× | "
          f"{'–' if np.isnan(idle_share[j]) else f'{idle_share[j]:.1%}'} |" for j, label in enumerate(labels)),
    ], args.write)


if __name__ == "__main__":
    main()
