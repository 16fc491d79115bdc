"""Outputs other than a run's results file are never replaced by accident either: ``prepare``, ``plot -o`` and
``export`` refuse an existing output (one line, exit 2, the file as it was) unless ``--overwrite``, and an image
path that cannot be written is one line, before anything is read."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpifl.cli import main
from tests.conftest import HANG_S


@pytest.fixture
def results(write_config, tmp_path):
    out = tmp_path / "r.h5"
    assert main(["run", str(write_config({"rounds": 2})), "--out", str(out), "--quiet"]) == 0
    return out


def refused(capsys, says: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("mpifl: error: ") and err.count("\n") == 1 and says in err, err


def test_prepare_refuses_an_existing_file_unless_overwrite(write_config, tmp_path, capsys):
    """Its own dataset only with --overwrite; anything else (here a user's file) never (issue 45)."""
    config = str(write_config({"data": {"unseen_fraction": 0}}))
    data = tmp_path / "data.h5"
    assert main(["prepare", config, "--out", str(data)]) == 0
    assert main(["prepare", config, "--out", str(data)]) == 2
    refused(capsys, f"output {data} exists; --overwrite replaces it, or give another path")
    assert main(["prepare", config, "--out", str(data), "--overwrite"]) == 0
    assert data.read_bytes()[:8] == b"\x89HDF\r\n\x1a\n"
    data.write_bytes(b"an earlier dataset")
    assert main(["prepare", config, "--out", str(data), "--overwrite"]) == 2
    refused(capsys, f"output {data}: is not what this command writes; it is never replaced")
    assert data.read_bytes() == b"an earlier dataset"


def test_plot_refuses_an_existing_image_unless_overwrite(results, tmp_path, capsys):
    png = tmp_path / "fig.png"
    assert main(["plot", str(results), "-o", str(png)]) == 0
    assert main(["plot", str(results), "-o", str(png)]) == 2
    refused(capsys, f"output {png} exists; --overwrite replaces it")
    assert main(["plot", str(results), "-o", str(png), "--overwrite"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    png.write_bytes(b"my figure")
    assert main(["plot", str(results), "-o", str(png), "--overwrite"]) == 2
    refused(capsys, f"output {png}: is not what this command writes; it is never replaced")
    assert png.read_bytes() == b"my figure"


@pytest.mark.parametrize("name, says", [
    ("fig.xyz", "-o {path}: '.xyz' is not an image format matplotlib writes; give one of "),
    ("fig", "-o {path}: no file extension; give one of "),
    ("file/fig.png", "output {path}: cannot be written: Not a directory"),
    ("locked/fig.png", "output {path}: cannot be written: Permission denied"),
])
def test_plot_to_a_path_it_cannot_write_is_one_line(results, tmp_path, capsys, name, says):
    (tmp_path / "file").touch()
    (tmp_path / "locked").mkdir(mode=0o500)
    if name.startswith("locked") and os.access(tmp_path / "locked", os.W_OK):
        pytest.skip("this user writes into a read-only folder (root): no permission to be denied")
    path = tmp_path / name
    assert main(["plot", str(results), "-o", str(path)]) == 2
    refused(capsys, says.format(path=path))
    assert not path.exists()


def test_export_refuses_what_an_earlier_export_wrote_unless_overwrite(results, tmp_path, capsys):
    csv, tensorboard, store = tmp_path / "csv", tmp_path / "tb", tmp_path / "mlruns"
    for flag, target in (("--csv", csv), ("--tensorboard", tensorboard), ("--mlflow", store)):
        assert main(["export", str(results), flag, str(target)]) == 0
    eval_csv, events = (csv / "eval.csv").read_bytes(), sorted(tensorboard.iterdir())
    capsys.readouterr()
    assert main(["export", str(results), "--csv", str(csv)]) == 2
    refused(capsys, f"output {csv / 'rounds.csv'} exists; --overwrite replaces it")
    assert main(["export", str(results), "--tensorboard", str(tensorboard)]) == 2
    refused(capsys, f"output {tensorboard} holds TensorBoard events already; --overwrite replaces them")
    assert main(["export", str(results), "--mlflow", str(store)]) == 2
    refused(capsys, f"--mlflow {store}: experiment '{tmp_path.name}' holds the run of {results} already; "
                    "--overwrite replaces it")
    # refused before anything is written: a CSV export beside a refused TensorBoard one writes nothing either
    assert main(["export", str(results), "--csv", str(tmp_path / "new"), "--tensorboard", str(tensorboard)]) == 2
    assert not (tmp_path / "new").exists() and sorted(tensorboard.iterdir()) == events
    for flag, target in (("--csv", csv), ("--tensorboard", tensorboard), ("--mlflow", store)):
        assert main(["export", str(results), flag, str(target), "--overwrite"]) == 0
    assert (csv / "eval.csv").read_bytes() == eval_csv
    assert len(list(tensorboard.iterdir())) == 1  # one event file: TensorBoard shows the run once


def test_a_report_whose_reader_has_gone_ends_quietly(results):
    """`mpifl report F.h5 | head`: once the reader has gone, a write fails (EPIPE); that is not an error: exit
    code 0 and nothing on stderr, no BrokenPipeError traceback. The pipe's read end is closed before the report
    starts, so its first write fails."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "mpifl", "report", str(results)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=HANG_S)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")
