"""Issue 45: every command that writes keeps the promise ``run`` keeps. A file that is not its own is never
replaced (not even with ``--overwrite``), its own finished output only with ``--overwrite``, and a folder it cannot
write is one line and exit 2; the bytes of every target are checked afterwards."""

from __future__ import annotations

import shutil

from mpifl.cli import main
from tests.conftest import REPO


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and err.startswith("mpifl: error: ") and "Traceback" not in err


def test_run_prepare_and_plot_replace_only_their_own_output(write_config, tmp_path, capsys, read_only_dir):
    config = str(write_config({"rounds": 2, "model": {"name": "logistic"}}))
    made = tmp_path / "made"
    made.mkdir()
    done, data, image = made / "done.h5", made / "data.h5", made / "plot.png"
    assert main(["run", config, "--out", str(done), "--quiet"]) == 0
    assert main(["prepare", config, "--out", str(data)]) == 0
    assert main(["plot", str(done), "-o", str(image)]) == 0
    csv = made / "mine.csv"
    csv.write_text("a,b\n1,2\n")
    kinds = {"run": done, "prepared": data, "plot": image, "readme": REPO / "README.md", "csv": csv}
    commands = {  # how each command writes its target, and which of the kinds above is its own
        "run": (lambda t: ["run", config, "--out", str(t), "--quiet"], "run"),
        "prepare": (lambda t: ["prepare", config, "--out", str(t)], "prepared"),
        "plot": (lambda t: ["plot", str(done), "-o", str(t)], "plot"),
    }
    capsys.readouterr()
    for command, (argv, own) in commands.items():
        for kind, source in kinds.items():
            target = tmp_path / command / kind / "target.png"  # an image name: plot takes no other
            target.parent.mkdir(parents=True)
            shutil.copyfile(source, target)
            before = target.read_bytes()
            for flags in ([], ["--overwrite"]):
                code = main([*argv(target), *flags])
                err = capsys.readouterr().err
                if kind == own and flags:
                    assert code == 0, (command, kind, err)
                else:
                    assert code == 2 and one_line(err), (command, kind, flags, err)
                    assert target.read_bytes() == before, (command, kind, flags)
        folder = read_only_dir(tmp_path / command / "read-only")
        assert main([*argv(folder / "target.png"), "--overwrite"]) == 2 and one_line(capsys.readouterr().err)
        assert list(folder.iterdir()) == []


def test_report_export_and_sweep_keep_what_is_not_theirs(write_config, tmp_path, capsys, read_only_dir):
    config = write_config({"rounds": 2, "model": {"name": "logistic"}})
    runs = tmp_path / "runs"
    assert main(["run", str(config), "--out", str(runs / "a.h5"), "--quiet"]) == 0
    mine = b"# my own notes\n"
    (runs / "summary.md").write_bytes(mine)
    capsys.readouterr()
    assert main(["report", str(runs)]) == 2 and one_line(capsys.readouterr().err)  # issue 45 row 2
    assert (runs / "summary.md").read_bytes() == mine and not (runs / "summary.csv").exists()
    (runs / "summary.md").unlink()
    assert main(["report", str(runs)]) == 0
    first = (runs / "summary.md").read_bytes()
    assert main(["report", str(runs)]) == 0 and (runs / "summary.md").read_bytes() == first  # its own: replaced
    locked = tmp_path / "locked"
    shutil.copytree(runs, locked)
    (locked / "summary.md").unlink()
    read_only_dir(locked)
    capsys.readouterr()
    assert main(["report", str(locked)]) == 2 and one_line(capsys.readouterr().err)  # issue 45 row 3
    assert not (locked / "summary.md").exists()

    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    (csv_dir / "rounds.csv").write_text("a,b\n1,2\n")
    for flags in ([], ["--overwrite"]):
        assert main(["export", str(runs / "a.h5"), "--csv", str(csv_dir), *flags]) == 2
        assert one_line(capsys.readouterr().err) and (csv_dir / "rounds.csv").read_text() == "a,b\n1,2\n"
    (csv_dir / "rounds.csv").unlink()
    assert main(["export", str(runs / "a.h5"), "--csv", str(csv_dir)]) == 0
    assert main(["export", str(runs / "a.h5"), "--csv", str(csv_dir)]) == 2
    assert main(["export", str(runs / "a.h5"), "--csv", str(csv_dir), "--overwrite"]) == 0
    capsys.readouterr()
    assert main(["export", str(runs / "a.h5"), "--csv", str(read_only_dir(tmp_path / "ro-csv"))]) == 2
    assert one_line(capsys.readouterr().err)

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"base: {config.name}\noutput_dir: out\nseeds: [0]\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    for out_dir in (a_file, read_only_dir(tmp_path / "ro-sweep")):  # issue 45 row 9
        assert main(["sweep", str(sweep), "--output-dir", str(out_dir)]) == 2
        assert one_line(capsys.readouterr().err)
    assert a_file.read_text() == "mine\n" and list((tmp_path / "ro-sweep").iterdir()) == []


def test_a_truncated_or_foreign_results_file_is_one_line_for_every_command(write_config, tmp_path, capsys):
    """Issue 45 row 8: a results file cut short (a copy that stopped half-way) or a file of another kind, given
    where a results file is read or continued, is one line and exit 2, and stays as it was."""
    config = str(write_config({"rounds": 2, "model": {"name": "logistic"}}))
    done = tmp_path / "done.h5"
    assert main(["run", config, "--out", str(done), "--quiet"]) == 0
    bad = {"truncated": done.read_bytes()[:2000], "readme": (REPO / "README.md").read_bytes()}
    for kind, content in bad.items():
        target = tmp_path / f"{kind}.h5"
        target.write_bytes(content)
        capsys.readouterr()
        for argv in (["run", "--resume", str(target)], ["run", config, "--resume", str(target)],
                     ["run", config, "--out", str(target), "--overwrite"], ["report", str(target)],
                     ["plot", str(target), "-o", str(tmp_path / f"{kind}.png")],
                     ["export", str(target), "--csv", str(tmp_path / f"{kind}-csv")]):
            assert main(argv) == 2 and one_line(capsys.readouterr().err), (kind, argv)
            assert target.read_bytes() == content, (kind, argv)
