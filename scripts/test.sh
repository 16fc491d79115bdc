#!/usr/bin/env bash
# Set everything up and run the whole test suite: lint, the single-process suite (which also
# launches real mpirun jobs), and the pytest-mpi suite on 3 and 4 ranks. Each phase's line says when it began
# (seconds since the start), so a stopped run shows where it stood. What leaves a core idle overlaps other work:
# Debian's packages install while pip sets up .venv; the lint and the two pytest-mpi runs go side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
began=$SECONDS
# Python keeps each module's bytecode (an environment may turn that off), so the suite's hundreds of processes do
# not each compile mpifl's modules again
unset PYTHONDONTWRITEBYTECODE
# and pip compiles none at install (here and in the suite's own installs): the modules a test imports compile then,
# once; compiling torch's and the test tools' thousands of others took about 50 s of a one-core set-up
export MPIFL_NO_COMPILE=1
phase() { echo "== $* [$(date -u +%T), +$((SECONDS - began)) s]"; }
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT
# Debian's Fashion-MNIST lets the IDX loader be tested on the real files, Debian's Slurm lets the batch scripts be
# tested on a real local Slurm, qemu-user runs a job on an emulated CPU and btrfs-progs makes a file system with
# a quota (each skipped with the reason if unavailable).
apt=""
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  wanted=()
  [ -d /usr/share/datasets/fashion-mnist ] || wanted+=(dataset-fashion-mnist)
  command -v slurmctld >/dev/null || wanted+=(slurmctld slurmd slurm-client munge libpmix-dev)
  # qemu's user-mode emulator runs a job on another vendor's CPU: the same bits on every node (test_cpu_kernels.py)
  command -v qemu-x86_64 >/dev/null || [ "$(uname -m)" != x86_64 ] || wanted+=(qemu-user)
  # btrfs's quotas give a real "Disk quota exceeded" in the middle of a run (test_storage_faults.py)
  command -v mkfs.btrfs >/dev/null || wanted+=(btrfs-progs)
  command -v mkfs.ext4 >/dev/null || wanted+=(e2fsprogs)  # and ext4 one that goes read-only, or fails (EIO)
  if [ ${#wanted[@]} -gt 0 ]; then
    phase "installing ${wanted[*]} (apt-get, beside the set-up)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${wanted[@]}" >/dev/null) \
      >"$logs/apt" 2>&1 &
    apt=$!
  fi
fi
phase "set-up (scripts/setup.sh)"
MPIFL_EXTRAS=test scripts/setup.sh
if [ -n "$apt" ] && ! wait "$apt"; then
  cat "$logs/apt"
  echo "note: could not install ${wanted[*]}; the tests that need them will be skipped"
fi
source .venv/bin/activate
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# Three phases at once, each with its log (printed when it ends): the pytest-mpi ranks wait on each other and
# on the one-process reference runs, which leaves cores idle that the others fill (146-155 s together, both cores
# busy, against 211 s one after another: docs/how-to/tests.md)
# NAME COMMAND...: COMMAND in the background, its output to $logs/NAME, its exit code and seconds to $logs/NAME.rc
background() {
  local name=$1
  shift
  (set +e; start=$SECONDS; "$@" >"$logs/$name" 2>&1; echo "$? $((SECONDS - start))" >"$logs/$name.rc") &
}
lint() { ruff check mpifl tests benchmarks && lint-imports && mypy; }  # lint-imports: the layers, no import cycles
phase "lint (ruff, lint-imports, mypy), pytest-mpi on 3 ranks, and on 4 (transport, engine, every algorithm on" \
  "1-4 ranks), side by side"
background lint lint
background mpi3 timeout 900 mpirun -n 3 --oversubscribe python -m pytest -q -p no:cacheprovider --with-mpi tests/mpi
# the 4-rank family with each CPU library told to take its AVX-512 path, as a node's environment might: mpifl's
# pinned kernels (mpifl/cpukernels.py) must give the bits of the other runs all the same
background mpi4 timeout 600 mpirun -n 4 --oversubscribe \
  env MKL_CBWR=AVX512 ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE python -m pytest -q -p no:cacheprovider --with-mpi \
  tests/mpi/test_transport_mpi.py tests/mpi/test_engine_mpi.py tests/mpi/test_rank_counts_mpi.py
wait
failed=""
for name in lint mpi3 mpi4; do
  read -r code seconds <"$logs/$name.rc"
  phase "$name: exit code $code after $seconds s"
  cat "$logs/$name"
  [ "$code" = 0 ] || failed+=" $name"
done
[ -z "$failed" ] || { echo "failed:$failed"; exit 1; }
phase "single-process suite"
# "slow" marks duplicates of what the pytest-mpi suite above already checks (kept for local runs). Two
# pytest-xdist workers (the CI machine's two cores); tests/conftest.py groups the tests that share a fixture.
python -m pytest -q -p no:cacheprovider --durations=40 -n 2 --dist loadgroup -m "not slow and not alone"
phase "the tests that measure wall time (shaped links), with nothing of the suite beside them"
# their file alone (tests/conftest.py's ALONE): collecting the whole suite to select them took 5 s more
python -m pytest -q -p no:cacheprovider -m "not slow and alone" tests/multinode/test_netmodel.py
phase "passed"
