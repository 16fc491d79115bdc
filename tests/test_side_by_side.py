"""The speed command (benchmarks/gpu_side_by_side.py) rehearsed on the CPU, as one test: every job kind, at small
sizes, through the code that runs on the GPU.

What a lease cannot afford to find out there: pfl-research on 2 and 4 processes sharing one device (the same
device-selection and process-group path as on a GPU, the device being the CPU), every job's clients staged
before its first timed round, mpifl on 1 rank and on 2 and 4 worker ranks, the captured-step floor taking its
eager path with the same bits as the batched floor, and caps that leave a rerun room in one lease. pfl-research is
installed from ``.whl/pfl`` (``scripts/pfl_wheels.sh .whl/pfl 3.11``) or taken from ``MPIFL_PFL_SITE``; without
either its rows must say so, and the test ends skipped after checking the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_side_by_side  # noqa: E402

SKIPPED = ("mpifl_w2_1_worker_rank_p_2", "bare_loop_floor")  # the code paths of rows that run: time saved


def pfl_site(tmp: Path) -> Path | None:
    """A folder with pfl-research importable, or None."""
    if os.environ.get("MPIFL_PFL_SITE"):
        return Path(os.environ["MPIFL_PFL_SITE"])
    wheels = sorted((REPO / ".whl" / "pfl").glob("*.whl"))
    if not wheels:
        return None
    site = tmp / "pfl-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    *map(str, wheels)], check=True)
    return site


def test_caps_leave_a_rerun_room_in_one_lease():
    """Caps within 70% of a budget of at most 360 s: two runs and a machine's start fit 15 minutes."""
    assert gpu_side_by_side.BUDGET <= 360
    assert sum(s.cap for s in gpu_side_by_side.SETTINGS) <= gpu_side_by_side.CAP_SHARE * gpu_side_by_side.BUDGET


@pytest.mark.timeout(360)
def test_rehearsal_on_the_cpu(tmp_path: Path):
    site = pfl_site(tmp_path)
    keep = [s.name for s in gpu_side_by_side.SETTINGS if s.slug not in SKIPPED]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_side_by_side.py"), "--device", "cpu", "--rounds", "2",
         "--cohort", "6", "--set", "data.synthetic.image_shape=[3,16,16]", "--cap-scale", "4", "--budget", "1000",
         "--out", str(tmp_path / "out"), "--skip", ",".join(SKIPPED), *(["--pfl-site", str(site)] if site else [])],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=340)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "out" / "side_by_side.md").read_text()
    assert (tmp_path / "out" / "logs.tar.gz").is_file()
    rows = {cells[0]: cells for line in report.splitlines()
            if line.startswith("| ") and len(cells := [c.strip() for c in line.strip("|").split("|")]) == 7}
    assert set(keep) <= set(rows), report
    for name in keep:
        exit_code, median, note = rows[name][1], rows[name][5], rows[name][6]
        if name.startswith("pfl-research") and site is None:
            assert exit_code == "not run: no --pfl-site"
            continue
        assert exit_code == "0", report
        if name.startswith("mpifl W2"):
            assert note.startswith("round 1 staged all 6 clients"), report
        if not name.startswith("trace"):
            assert float(median) > 0, report
    floor, graph = rows["bare batched floor"][6], rows["bare batched floor, a CUDA graph a step"][6]
    assert graph == floor + "; not captured: CUDA graphs need a CUDA device; the fixed-buffer step ran eagerly"
    assert "| ≤ 1.5 × the batched floor" in report
    if site is None:
        pytest.skip("pfl-research's rows not rehearsed: no .whl/pfl (scripts/pfl_wheels.sh .whl/pfl 3.11)")
    assert rows["pfl-research, 1 process"][6] == "every process on cpu, backend none"
    for processes in (2, 4):
        assert rows[f"pfl-research, {processes} processes"][6] == "every process on cpu, backend gloo", report
