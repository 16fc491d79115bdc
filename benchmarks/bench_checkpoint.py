"""Checkpoint shards at scale: FedDeper's per-client personal models written by 3 ranks and resumed on 4, with
no rank holding more than its own clients' state plus a bounded overhead. (Issue 15, target 3.)

    python benchmarks/bench_checkpoint.py [--clients 10000] [--rounds 100] [--write]

Tabular Gaussian data (60 features, 10 classes, 16 samples per client), an MLP 60-480-440-10 (about 245k
parameters, so a personal model is 0.98 MB and 10,000 clients hold up to 9.8 GB), 200 clients per round for
``--rounds`` rounds (a client has state once it has trained: about 1 − (1 − 200/N)^R of them), checkpointed
at the last round; then ``--resume`` with one more round on 4 ranks, so every client's state moves to the
worker that hosts it now. Reported per rank of both jobs, from their results files: peak resident memory, the
client state it held (from the shards: its clients that have state × the model's bytes), their difference
(target ≤ 1.5 GB), and the seconds spent writing its shard (the first job) or reading them (set-up of the
second).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import h5py
import numpy as np
from common import REPO, heading, mpifl_job, read_results, record

from mpifl.results import shard_dir

CONFIG = REPO / "configs" / "b1.yaml"
MB = 2**20


def overrides(clients: int, rounds: int) -> list[str]:
    return ["algorithm=feddeper", f"data.num_clients={clients}", "data.partition=iid", "clients_per_round=200",
            "data.synthetic.image_shape=[60]", "data.synthetic.samples_per_client=16", "model.name=mlp",
            "model.hidden=[480,440]", "client.steps=1", f"rounds={rounds}", f"eval_every={rounds}",
            f"checkpoint_every={rounds}", "data_memory_gb=0.2", "placement=static"]


def clients_with_state(out: Path) -> np.ndarray:
    """Every client id that has state in the results file's checkpoint shards (group names only, no data)."""
    ids = []
    for shard in shard_dir(out).glob("round*-rank*.h5"):
        with h5py.File(shard, "r") as f:
            ids += [int(key[2:]) for key in f["states"]]
    return np.array(sorted(ids), dtype=np.int64)


def rank_rows(label: str, out: Path, state_bytes: int, seconds: str) -> list[str]:
    res = read_results(out)
    ranks, owner = res.table("ranks"), res.table("clients")["owner"]
    held = np.bincount(owner[clients_with_state(out)], minlength=len(ranks["rank"])) * state_bytes
    rows = []
    for r in range(len(ranks["rank"])):
        peak = ranks["peak_rss_bytes"][r]
        rows.append(f"| {label} | {r} | {peak / MB:,.0f} | {held[r] / MB:,.0f} | {(peak - held[r]) / MB:,.0f} | "
                    f"{ranks[seconds][r]:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "checkpoint.h5"
        first = mpifl_job(CONFIG, 3, out, overrides(args.clients, args.rounds))
        state_bytes = 4 * first.table("model")["global_model"].size
        have = len(clients_with_state(out))
        written = rank_rows("written on 3 ranks", out, state_bytes, "serialization_seconds")
        shards = sum(p.stat().st_size for p in shard_dir(out).glob("*.h5"))
        mpifl_job(CONFIG, 4, out, [*overrides(args.clients, args.rounds), f"rounds={args.rounds + 1}"],
                  ["--resume", str(out)])
        resumed = rank_rows("resumed on 4 ranks", out, state_bytes, "setup_wall_seconds")
    record([
        "",
        heading(f"Checkpoint shards: {args.clients:,} FedDeper clients"),
        "",
        f"`python benchmarks/bench_checkpoint.py --clients {args.clients} --rounds {args.rounds}`: "
        f"{have:,} clients with state ({have * state_bytes / 2**30:.2f} GiB of personal models, shards "
        f"{shards / 2**30:.2f} GiB on disk).",
        "",
        "| job | rank | peak RSS MiB | its clients' state MiB | peak − state MiB (target ≤ 1,536) | "
        "shard write / set-up s |",
        "|---|---|---|---|---|---|",
        *written,
        *resumed,
    ], args.write)


if __name__ == "__main__":
    main()
