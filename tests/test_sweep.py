"""Sweeps expand grid × seeds into runs; ``report DIR`` aggregates them over seeds."""

import csv
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from benchmarks.gpu_check import kill_session
from mpifl.cli import main
from mpifl.report import aggregate, plot, report
from mpifl.results import read_results
from mpifl.results.guard import inspect_output
from mpifl.schema import ConfigError
from mpifl.sweep import load_sweep
from tests.conftest import HANG_S, REPO, mpi_env


def write_sweep(tmp_path, config, grid, seeds=(0, 1)):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(config), "output_dir": str(tmp_path / "out"), "seeds": list(seeds),
                                    "grid": grid}))
    return path


def test_grid_times_seeds_expands_and_is_validated(write_config, tmp_path):
    grid = {"algorithm": ["fedavg", "local"], "client.lr": [0.1, 0.2]}
    sweep = write_sweep(tmp_path, write_config(), grid, (0, 1, 2))
    _, spec, runs = load_sweep(sweep)
    assert len(runs) == 12 and len({r.output for r in runs}) == 12
    assert runs[0].overrides == ("algorithm=fedavg", "client.lr=0.1", "seed=0")
    bad = write_sweep(tmp_path, write_config(), {"client.lr": [-1]})
    with pytest.raises(ConfigError, match="client.lr: must be > 0"):
        load_sweep(bad)


@pytest.mark.usefixtures("runs_in_this_process")
def test_sweep_runs_and_report_aggregates_over_seeds(write_config, tmp_path, capsys):
    sweep = write_sweep(tmp_path, write_config({"rounds": 2}), {"algorithm": ["fedavg", "local"]})
    assert main(["sweep", str(sweep)]) == 0
    assert main(["report", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "| algorithm | seeds |" in table and "| fedavg | 2 |" in table and "| local | 2 |" in table
    with open(tmp_path / "out" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    by_algo = {r["algorithm"]: r for r in rows}
    assert float(by_algo["local"]["train_MB_mean"]) == 0 and float(by_algo["fedavg"]["train_MB_mean"]) > 0
    finals = [read_results(f).table("eval")["global.seen.acc_pooled"][-1]
              for f in sorted((tmp_path / "out").glob("algorithm=fedavg*.h5"))]
    assert len(finals) == 2 and finals[0] != finals[1]
    # mean ± 2·SE with the sample standard deviation (ddof = 1), as the seed papers' tables
    assert float(by_algo["fedavg"]["global.seen.acc_pooled_mean"]) == pytest.approx(np.mean(finals))
    assert float(by_algo["fedavg"]["global.seen.acc_pooled_2se"]) == pytest.approx(
        2 * np.std(finals, ddof=1) / np.sqrt(2))


@pytest.mark.usefixtures("runs_in_this_process")
def test_report_selects_the_best_validation_round(write_config, tmp_path, capsys):
    """``--select best-val`` reports every run at its evaluation with the best validation accuracy of the seen
    clients (the PeFLL and pFedHN papers' model selection), for one file and over seeds."""
    config = write_config({"rounds": 6, "eval_every": 1, "data": {"val_fraction": 0.2}, "client": {"lr": 0.3}})
    sweep = write_sweep(tmp_path, config, {"client.lr": [0.3]})
    assert main(["sweep", str(sweep)]) == 0
    files = sorted((tmp_path / "out").glob("*.h5"))
    chosen = []
    for path in files:
        ev = read_results(path).table("eval")
        best = int(np.argmax(ev["global.seen.val_acc_pooled"]))
        chosen.append(ev["global.seen.acc_pooled"][best])
        summary = report(str(path), "best-val")
        assert summary["selected_round"] == ev["round"][best]
        assert summary["final"]["global.seen.acc_pooled"] == ev["global.seen.acc_pooled"][best]
    assert len(set(chosen)) > 1 or len(files) == 1
    assert main(["report", str(tmp_path / "out"), "--select", "best-val"]) == 0
    assert "best validation accuracy" in capsys.readouterr().out
    with open(tmp_path / "out" / "summary.csv") as f:
        row, = csv.DictReader(f)
    assert float(row["global.seen.acc_pooled_mean"]) == pytest.approx(np.mean(chosen))
    plain = tmp_path / "plain.h5"
    assert main(["run", str(write_config({"rounds": 2})), "--out", str(plain), "--quiet"]) == 0
    assert main(["report", str(plain), "--select", "best-val"]) == 2
    assert "has no validation accuracy (run with data.val_fraction > 0)" in capsys.readouterr().err


def test_slurm_array_script(write_config, tmp_path):
    sweep = write_sweep(tmp_path, write_config(), {"algorithm": ["fedavg", "local"]})
    assert main(["sweep", str(sweep), "--slurm"]) == 0
    script = (tmp_path / "out" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-3" in script and "srun" in script
    assert '--set "threads_per_rank=${SLURM_CPUS_PER_TASK:-1}" "$@")' in script  # a run's own --set wins
    assert len((tmp_path / "out" / "runs.txt").read_text().splitlines()) == 1 + 4  # its mark, then the runs
    assert main(["sweep", str(sweep), "--slurm"]) == 0  # its own files: written again
    mine = "#!/bin/bash\nsrun my_job\n"
    (tmp_path / "out" / "sweep.sbatch").write_text(mine)
    assert main(["sweep", str(sweep), "--slurm"]) == 2  # a user's script of that name: never replaced (issue 45)
    assert (tmp_path / "out" / "sweep.sbatch").read_text() == mine


def test_variants_times_grid_times_seeds_with_cli_overrides(write_config, tmp_path, capsys):
    """Each variant carries its own settings into every grid point and seed; run names stay unique and readable;
    ``--set``, ``--seeds`` and ``--output-dir`` shrink or move a sweep for a smoke test."""
    path = tmp_path / "sweep.yaml"
    variants = [{"name": "fedavg", "set": {"algorithm": "fedavg"}},
                {"set": {"algorithm": "local", "local.mode": "all"}}]
    path.write_text(yaml.safe_dump({"base": str(write_config()), "output_dir": str(tmp_path / "out"),
                                    "seeds": [0, 1], "variants": variants, "grid": {"client.lr": [0.1, 0.2]}}))
    _, _, runs = load_sweep(path)
    assert [r.name for r in runs[:2]] == ["fedavg,client.lr=0.1,seed=0", "fedavg,client.lr=0.1,seed=1"]
    assert runs[-1].name == "algorithm=local,local.mode=all,client.lr=0.2,seed=1" and len(runs) == 8
    assert runs[-1].overrides == ("algorithm=local", "local.mode=all", "client.lr=0.2", "seed=1")
    _, spec, smoke = load_sweep(path, ["rounds=2"], [3], str(tmp_path / "smoke"))
    assert len(smoke) == 4 and spec.output_dir == str(tmp_path / "smoke")
    assert smoke[0].overrides == ("algorithm=fedavg", "client.lr=0.1", "rounds=2", "seed=3")
    assert smoke[0].output == tmp_path / "smoke" / "fedavg,client.lr=0.1,rounds=2,seed=3.h5"
    assert main(["sweep", str(path), "--dry-run", "--set", "rounds=2", "--seeds", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mpifl: 4 runs: 4 new\n")
    assert "[4/4] algorithm=local,local.mode=all,client.lr=0.2,rounds=2,seed=5" in out
    assert "--set local.mode=all --set client.lr=0.2 --set rounds=2 --set seed=5" in out


@pytest.mark.parametrize("variants, message", [
    ([{"name": "a", "set": {"algorithm": "fedavg"}}, {"name": "a", "set": {"algorithm": "local"}}],
     r"sweep.variants\[1\]: the name 'a' is used twice"),
    ([{"set": {}}], r"sweep.variants\[0\]: give it a name or a non-empty set"),
    ([{"name": "x", "sets": {}}], r"sweep.variants\[0\]: unknown key 'sets' \(did you mean 'set'\?\)"),
    ([{"name": "bad", "set": {"client.lr": -1}}], "sweep run client.lr=-1 seed=0: client.lr: must be > 0"),
])
def test_bad_variants_are_one_error_line(write_config, tmp_path, capsys, variants, message):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(write_config()), "output_dir": str(tmp_path / "out"),
                                    "variants": variants}))
    with pytest.raises(ConfigError, match=message):
        load_sweep(path)
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpifl: error: sweep") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_overrides_are_named_with_the_values_the_runs_have(write_config, tmp_path):
    """A ``--set`` is part of each run's name with its own value: a smoke test's files never pass for the real
    sweep's (``rounds=2``, never ``rounds=20``), one that sets a grid key or an unnamed variant's key names it
    once, and grid points it makes equal are one run."""
    sweep = write_sweep(tmp_path, write_config(), {"client.lr": [0.1, 0.2], "rounds": [20]}, (0,))
    _, _, runs = load_sweep(sweep, ["rounds=2"])
    assert [r.name for r in runs] == ["client.lr=0.1,rounds=2,seed=0", "client.lr=0.2,rounds=2,seed=0"]
    assert [r.config["rounds"] for r in runs] == [2, 2]
    _, _, runs = load_sweep(sweep, ["client.lr=0.5", "client.momentum=0.9"])
    assert [r.name for r in runs] == ["client.lr=0.5,rounds=20,client.momentum=0.9,seed=0"]
    assert (runs[0].config["client"]["lr"], runs[0].config["client"]["momentum"]) == (0.5, 0.9)
    path = tmp_path / "variants.yaml"
    path.write_text(yaml.safe_dump({"base": str(write_config()), "output_dir": str(tmp_path / "out"),
                                    "variants": [{"set": {"algorithm": "local", "local.mode": "all"}}]}))
    _, _, runs = load_sweep(path, ["local.mode=rounds"])
    assert [r.name for r in runs] == ["algorithm=local,local.mode=rounds,seed=0"]
    with pytest.raises(ConfigError, match=r"sweep --set seed=\.\.\.: the sweep sets every run's seed; give --seeds"):
        load_sweep(sweep, ["seed=3"])


@pytest.mark.usefixtures("runs_in_this_process")
def test_a_sweep_run_again_skips_completed_runs_and_refuses_another_config(write_config, tmp_path, capsys):
    """Completed runs with the same config are skipped (and counted), their files untouched; a file holding
    another config stops the sweep before anything runs, unless --overwrite; a file that is not a results file
    is never replaced."""
    sweep = write_sweep(tmp_path, write_config({"rounds": 2}), {"algorithm": ["fedavg"]})
    assert main(["sweep", str(sweep)]) == 0
    files = sorted((tmp_path / "out").glob("*.h5"))
    before = {f: f.read_bytes() for f in files}
    capsys.readouterr()
    assert main(["sweep", str(sweep)]) == 0
    assert capsys.readouterr().out == "mpifl: 2 runs: 2 completed already (skipped)\n"
    assert {f: f.read_bytes() for f in files} == before
    write_config({"rounds": 2, "client": {"lr": 0.3}})  # the sweep's base, edited
    assert main(["sweep", str(sweep)]) == 2
    assert capsys.readouterr().err == (
        f"mpifl: error: sweep run algorithm=fedavg,seed=0: {files[0]} holds a run with another config (client.lr: "
        "0.1 in the file, 0.3 given) (and 1 more); --overwrite replaces them, or give another --output-dir\n")
    assert {f: f.read_bytes() for f in files} == before
    assert main(["sweep", str(sweep), "--overwrite"]) == 0
    assert capsys.readouterr().out.startswith("mpifl: 2 runs: 2 started again\n")
    assert [read_results(f).config["client"]["lr"] for f in files] == [0.3, 0.3]
    files[0].write_text("my notes")
    assert main(["sweep", str(sweep), "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"mpifl: error: sweep run algorithm=fedavg,seed=0: output {files[0]} is not an "
                                       "mpifl results file; it is never replaced: move it, or give another "
                                       "--output-dir\n")
    assert files[0].read_text() == "my notes"


def test_a_sweep_refuses_a_run_that_another_process_writes(write_config, tmp_path, capsys):
    sweep = write_sweep(tmp_path, write_config({"rounds": 2}), {"algorithm": ["fedavg"]}, (0,))
    output = tmp_path / "out" / "algorithm=fedavg,seed=0.h5"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mpifl.results.guard import OutputLock; "
                               "OutputLock.acquire(sys.argv[1]); print('locked', flush=True); time.sleep(120)",
                               str(output)], stdout=subprocess.PIPE, text=True, env=mpi_env())
    try:
        assert holder.stdout.readline() == "locked\n"
        assert main(["sweep", str(sweep)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mpifl: error: sweep run algorithm=fedavg,seed=0: output {output} is being written by "
                              f"another run (pid {holder.pid} on ") and err.count("\n") == 1
        assert not output.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_sweep_killed_half_way_and_run_again_does_every_run_once(write_config, tmp_path):
    """A sweep SIGKILLed at a random moment (after a random number of its runs, with their mpirun and ranks) and
    started again finishes: the runs completed before are skipped, their files untouched; the interrupted one
    resumes from its checkpoint, or starts again without one; the rest run. Run again, it skips them all. As
    root it needs no Open MPI variables in its environment (it sets them for its runs)."""
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    config = write_config({"rounds": 30, "eval_every": 15, "checkpoint_every": 3})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(config), "output_dir": str(tmp_path / "out"), "ranks": 2,
                                     "seeds": [0, 1, 2]}))
    outputs = [tmp_path / "out" / f"seed={s}.h5" for s in range(3)]
    env = {k: v for k, v in mpi_env().items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    command = [sys.executable, "-m", "mpifl", "sweep", str(sweep)]
    wait_for, delay = rng.randint(1, 2), rng.uniform(0, 4)
    job = subprocess.Popen(command, env=env, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while sum(inspect_output(o).status == "completed" for o in outputs) < wait_for:
        assert job.poll() is None, f"the sweep ended before it was killed (seed {seed}): {job.stderr.read()}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(delay)
    kill_session(job.pid)
    job.wait()
    states = [inspect_output(o) for o in outputs]
    done = [o for o, state in zip(outputs, states) if state.status == "completed"]
    assert 1 <= len(done) < 3, f"seed {seed}: {states}"
    before = {o: (o.read_bytes(), o.stat().st_mtime_ns) for o in done}
    again = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, f"seed {seed}: {again.stderr}"
    lines = again.stdout.splitlines()
    assert lines[0].startswith(f"mpifl: 3 runs: {len(done)} completed already (skipped), "), lines
    assert len(lines) == 1 + 3 - len(done), lines  # one line per run it ran
    interrupted = [o for o, state in zip(outputs, states) if state.unfinished]
    for output, state in zip(outputs, states):
        if state.unfinished and state.checkpoint_round is not None:
            assert f"{output.stem} (resumed from its checkpoint at round {state.checkpoint_round})" in again.stdout
        elif state.unfinished:
            assert f"{output.stem} (started again)" in again.stdout
    assert len(interrupted) <= 1, states
    assert {o: (o.read_bytes(), o.stat().st_mtime_ns) for o in done} == before
    for output in outputs:
        res = read_results(output)
        assert (res.attrs["status"], res.attrs["rounds_completed"]) == ("completed", 30)
        assert list(res.table("eval")["round"]) == [15, 30]
    finished = {o: o.read_bytes() for o in outputs}
    last = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert (last.returncode, last.stdout) == (0, "mpifl: 3 runs: 3 completed already (skipped)\n"), last.stderr
    assert {o: o.read_bytes() for o in outputs} == finished


def test_slurm_array_task_runs_in_the_environment_it_was_written_from(write_config, tmp_path, monkeypatch,
                                                                       capsys):
    """A task of ``sweep --slurm``'s array (run here by bash as Slurm would, with mpirun as the launcher) starts
    from another directory, without the virtual environment on its PATH and, as root, without Open MPI's
    variables: the script goes to the sweep's directory (its relative output_dir holds there), activates the
    environment it was written from and sets what Open MPI needs as root."""
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(write_config({"rounds": 2})), "output_dir": "out", "ranks": 2}))
    assert main(["sweep", str(sweep), "--slurm"]) == 0
    script = (tmp_path / "out" / "sweep.sbatch").read_text()
    assert f"cd {tmp_path}\n" in script and f"source {sys.prefix}/bin/activate\n" in script
    venv_bin = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("OMPI_ALLOW_RUN_AS_ROOT", "VIRTUAL_ENV"))}
    env.update(PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin),
               SLURM_ARRAY_TASK_ID="0", SLURM_NTASKS="2", MPIFL_LAUNCHER="mpirun")
    task = subprocess.run(["bash", str(tmp_path / "out" / "sweep.sbatch")], cwd="/", env=env, capture_output=True,
                          text=True, timeout=600)
    assert task.returncode == 0, task.stderr
    res = read_results(tmp_path / "out" / "seed=0.h5")
    assert (res.attrs["status"], res.attrs["world_size"], res.config["threads_per_rank"]) == ("completed", 2, 1)
    capsys.readouterr()
    assert main(["sweep", str(sweep), "--slurm"]) == 0  # from the sweep's directory, as the array ran
    assert capsys.readouterr().out == "mpifl: 1 run: 1 completed already (skipped)\n"  # nothing left to submit


def test_report_of_unrelated_runs_counts_each_seed_once_and_groups_by_config(write_config, tmp_path, capsys):
    """Three files of one config and seed (copies, or a run made three times) are one seed, not "3 seeds ±
    0.0000": the table counts distinct seeds, lists the repeats it left out, and the plot's labels say the same;
    runs of another config are a group of their own."""
    runs = tmp_path / "runs"
    first = runs / "a.h5"
    assert main(["run", str(write_config({"rounds": 2})), "--out", str(first), "--quiet"]) == 0
    for name in ("b.h5", "c.h5"):
        shutil.copy(first, runs / name)
    other = write_config({"rounds": 2, "client": {"lr": 0.3}}, name="other.yaml")
    for seed in (7, 8):
        assert main(["run", str(other), "--out", str(runs / f"lr{seed}.h5"), "--set", f"seed={seed}", "--quiet"]) == 0
    summary = aggregate(str(runs))
    assert [(row["client.lr"], row["seeds"], row["files"], row["repeats"]) for row in summary["rows"]] == [
        (0.1, 1, [str(first)], [str(runs / "b.h5"), str(runs / "c.h5")]),
        (0.3, 2, [str(runs / "lr7.h5"), str(runs / "lr8.h5")], [])]
    lines = summary["text"].splitlines()
    one = next(line for line in lines if line.startswith("| 0.1 | 1 |"))
    assert "±" not in one  # one seed: no spread to show
    assert lines[-1] == (f"Left out, as repeats of a seed already counted (same config and seed): {runs / 'b.h5'}, "
                         f"{runs / 'c.h5'}.")
    labels = [line.get_label() for line in plot([str(runs)], str(tmp_path / "fig.png")).axes[0].lines]
    assert {label.split(": ")[0] for label in labels} == {"client.lr=0.1 (1 seed)", "client.lr=0.3 (2 seeds)"}


def test_report_of_a_sweep_leaves_unfinished_runs_out_of_the_mean_and_lists_them(write_config, tmp_path,
                                                                                 monkeypatch):
    """A sweep still under way (or stopped) holds runs at an early round; mixing them into the seeds' mean would
    report a number no finished run has. The table counts completed runs only and names the others, each where it
    stands as ``report FILE`` says it (issue 50 row 4): a run that died still marked "running" is stopped, and
    not resumable without a checkpoint."""
    from mpi4py import MPI

    from mpifl.registry import load_config
    from mpifl.runtime.engine import Engine
    from mpifl.runtime.stopping import StopRequest

    runs = tmp_path / "runs"
    config = write_config({"rounds": 2})
    for seed in (0, 1):
        assert main(["run", str(config), "--out", str(runs / f"a,seed={seed}.h5"), "--set", f"seed={seed}",
                     "--quiet"]) == 0
    stopped = Engine(load_config(config, ["seed=2"]), MPI.COMM_SELF, runs / "a,seed=2.h5")
    stopped.prepare()
    asked = StopRequest(announce=False)
    asked.signum = signal.SIGTERM  # as Slurm's time limit, before the first round ends: it stops after round 1
    assert stopped.run(progress=False, stop=asked) == 1
    monkeypatch.setenv("MPIFL_INJECT_FAULT", "0:2")  # dies in round 2, its file still marked running
    assert main(["run", str(config), "--out", str(runs / "a,seed=3.h5"), "--set", "seed=3", "--quiet"]) == 1
    summary = aggregate(str(runs))
    (row,) = summary["rows"]
    assert (row["seeds"], row["files"]) == (2, [str(runs / "a,seed=0.h5"), str(runs / "a,seed=1.h5")])
    assert summary["text"].splitlines()[-1] == (
        f"Left out, as not finished: {runs / 'a,seed=2.h5'} (interrupted at round 1 of 2, resumable from round 1: a "
        f"rerun of the sweep resumes it); {runs / 'a,seed=3.h5'} (stopped at round 1 of 2, not resumable: a rerun "
        "of the sweep starts it again).")


def test_ctrl_c_stops_a_sweep_after_the_run_under_way_and_says_how_to_continue(write_config, tmp_path, monkeypatch,
                                                                                capsys):
    """Issue 45 row 4: SIGINT to the sweep's process group (a terminal's Ctrl-C) stops the run under way with a
    checkpoint and starts no other run; the sweep exits 130 with the command that continues it, which resumes the
    stopped run and starts the others."""
    config = write_config({"rounds": 100_000, "eval_every": 1, "model": {"name": "logistic"}})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(config), "output_dir": "out", "seeds": [0, 1, 2]}))
    first = tmp_path / "out" / "seed=0.h5"
    job = subprocess.Popen([sys.executable, "-m", "mpifl", "sweep", str(sweep)], env=mpi_env(), cwd=tmp_path,
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_S
        while inspect_output(first).rounds_completed < 2:
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(job.pid, signal.SIGINT)
        assert job.wait(timeout=HANG_S) == 130
    finally:
        if job.poll() is None:
            kill_session(job.pid)
    line = job.stderr.read().splitlines()[-1]
    assert line.startswith("mpifl: SIGINT: sweep stopped after run 1 of 3 (an interrupted run resumes from its ")
    assert sorted(p.name for p in (tmp_path / "out").glob("*.h5")) == ["seed=0.h5"]
    assert inspect_output(first).status == "interrupted" and inspect_output(first).checkpoint_round is not None
    again = line.split("continue with: ")[1].split()
    assert again[:3] == ["python", "-m", "mpifl"], line
    monkeypatch.chdir(tmp_path)  # where the sweep ran: its output_dir is relative
    capsys.readouterr()
    assert main([*again[3:], "--dry-run"]) == 0
    assert "3 runs: 1 resumed from a checkpoint, 2 new" in capsys.readouterr().out
