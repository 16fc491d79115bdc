import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mpifl.cli import main
from mpifl.config import apply_overrides, config_to_dict
from mpifl.registry import load_config, parse_config
from mpifl.results import check_writable, read_results
from mpifl.schema import ConfigError

REPO = Path(__file__).resolve().parents[1]
# run configs; a sweep file (its top-level ``base:`` names the run config it varies) is tested by test_sweep and
# tests/test_evidence_sweeps.py
SHIPPED = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "base" not in yaml.safe_load(p.read_text()))


def test_defaults_parse_and_round_trip():
    cfg = parse_config({})
    assert cfg.algorithm == "fedavg" and cfg.data.dataset == "digits"
    assert parse_config(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"roundz": 3}, "unknown key 'roundz' (did you mean 'rounds'?)"),
        ({"client": {"lrr": 0.1}}, "client: unknown key 'lrr' (did you mean 'lr'?)"),
        ({"client": {"lr": -0.1}}, "client.lr: must be > 0"),
        ({"rounds": "ten"}, "rounds: expected an integer"),
        ({"rounds": 2.5}, "rounds: expected an integer"),
        ({"client": {"lr": float("nan")}}, "client.lr: expected a finite number"),
        ({"data": {"partition": "dirichlett"}}, "did you mean 'dirichlet'?"),
        ({"algorithm": "fedavgg"}, "did you mean 'fedavg'?"),
        ({"clients_per_round": 20, "data": {"num_clients": 10}}, "clients_per_round: 20 exceeds data.num_clients"),
        ({"data": {"test_fraction": 0.6, "val_fraction": 0.5}}, "test_fraction + val_fraction"),
        ({"data": "digits"}, "data: expected a mapping"),
        ({"network": {"up_mbps": 0}}, "network.up_mbps: must be > 0"),
        ({"model": {"channels": [16, -3]}}, "model.channels: must be >= 1, got -3"),
        ({"model": {"hidden": [0]}}, "model.hidden: must be >= 1, got 0"),
        ({"data": {"synthetic": {"image_shape": [1, 0, 8]}}}, "data.synthetic.image_shape: must be >= 1, got 0"),
        ({"threads_per_rank": 0}, "threads_per_rank: must be >= 1"),
        ({"local": {"x": 1}}, "local: unknown key 'x'"),  # another algorithm's section is validated too
        ({"pefll": {"lambda_h": 0.1}}, "pefll.lambda_h: applies to Alg. 2's step (optimizer: paper) only"),
        ({"fedavg": {"x": 1}}, "fedavg: unknown key 'x'"),
        ({"checkpoint_every": -1}, "checkpoint_every: must be >= 0"),
        ({"device": "gpu"}, "device: 'gpu' is not one of"),
        # other frameworks' names for common keys (issue 57)
        ({"client": {"learning_rate": 0.1}}, "client: unknown key 'learning_rate' (did you mean 'lr'?)"),
        ({"client": {"local_epochs": 2}}, "client: unknown key 'local_epochs' (did you mean 'epochs'?)"),
        ({"num_rounds": 2}, "unknown key 'num_rounds' (did you mean 'rounds'?)"),
        ({"data": {"n_clients": 20}}, "data: unknown key 'n_clients' (did you mean 'num_clients'?)"),
        # a section of another algorithm named by its path, left behind by --set algorithm=fedavg
        ({"algorithm": "fedavg", "not_installed_feddyn:ALGORITHM": {"alpha": 0.1}},
         "cannot import module 'not_installed_feddyn'"),
        ({"algorithm": "fedavg", "not_installed_feddyn:ALGORITHM": {"alpha": 0.1}},
         "(this section holds not_installed_feddyn:ALGORITHM's options, not those of the run's algorithm, fedavg: "
         "correct it, or drop the section to run fedavg)"),
        ({"fedprox": {"mu": -1}}, "fedprox.mu: must be >= 0, got -1.0 (this section holds fedprox's options, not those "
                                  "of the run's algorithm, fedavg: correct it, or drop the section to run fedavg)"),
    ],
)
def test_bad_configs_give_one_clear_error(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_exponent_notation_is_a_number():
    assert parse_config({"client": {"lr": "1e-3", "weight_decay": "5E-4"}}).client.lr == 1e-3
    with pytest.raises(ConfigError, match="expected a number"):
        parse_config({"client": {"lr": "fast"}})


def test_set_overrides_use_yaml_types():
    raw = apply_overrides({"client": {"lr": 0.1}}, ["client.lr=0.5", "data.num_clients=20", "model.hidden=[3, 4]"])
    cfg = parse_config(raw)
    assert cfg.client.lr == 0.5 and cfg.data.num_clients == 20 and cfg.model.hidden == (3, 4)


@pytest.mark.parametrize("item", ["client.lr", "=3", "a..b=1"])
def test_malformed_overrides(item):
    with pytest.raises(ConfigError):
        apply_overrides({}, [item])


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_sections_of_other_algorithms_are_kept_out_of_the_run():
    """A paper config holds every compared method's options; --set algorithm=X picks X's section only."""
    raw = {"algorithm": "pfedhn", "pfedhn": {"server_steps": "averaged"}, "local": {"mode": "all"}}
    cfg = parse_config(raw)
    assert cfg.algorithm_options.server_steps == "averaged"
    assert "local" not in config_to_dict(cfg) and config_to_dict(cfg)["pfedhn"]["server_steps"] == "averaged"
    assert parse_config({**raw, "algorithm": "local"}).algorithm_options.mode == "all"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_shipped_configs_take_few_rounds_and_name_what_they_run(path):
    """A short trial run (--set rounds=3) of a config that evaluates every 5 rounds: the final round is evaluated
    anyway, so it is no error; every shipped config names its algorithm and dataset (no defaults silently)."""
    assert load_config(path, ["rounds=3"]).rounds == 3


def test_the_final_round_is_evaluated_when_eval_every_exceeds_rounds(write_config, tmp_path):
    out = tmp_path / "r.h5"
    assert main(["run", str(write_config({"rounds": 2, "eval_every": 5})), "--out", str(out), "--quiet"]) == 0
    assert list(read_results(out).table("eval")["round"]) == [2]


def test_an_empty_config_names_what_it_lacks(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty.yaml: missing algorithm and data.dataset; name them in the file"):
        load_config(empty)
    with pytest.raises(ConfigError, match=r"missing data.dataset; name it"):
        load_config(empty, ["algorithm=fedavg", "data.num_clients=4"])
    cfg = load_config(empty, ["algorithm=local", "data.dataset=gaussian_images"])  # --set supplies them
    assert (cfg.algorithm, cfg.data.dataset) == ("local", "gaussian_images")
    assert load_config(empty, ["data.dataset=digits"], required=("data.dataset",)).data.dataset == "digits"
    assert main(["validate", str(empty)]) == 2
    assert capsys.readouterr().err == (f"mpifl: error: {empty}: missing algorithm and data.dataset; name them in the "
                                       "file or with --set (e.g. algorithm: fedavg, data: {dataset: digits})\n")


def test_results_paths_that_cannot_be_written_are_refused_and_creatable_ones_left_alone(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError) as info:
        check_writable(blocker / "x" / "run.h5")
    assert str(info.value) == f"output {blocker}/x/run.h5: cannot be written: Not a directory ({blocker})"
    with pytest.raises(ConfigError, match="is a directory"):
        check_writable(tmp_path)
    check_writable(tmp_path / "new" / "dir" / "run.h5")  # created at the first write
    assert sorted(tmp_path.iterdir()) == [blocker]  # the check itself leaves nothing behind


def test_the_config_layer_imports_no_algorithm():
    """config → algorithms → config would be a cycle the import contracts cannot see (the registry imports
    algorithm modules by name): the config layer reads the algorithms' option schemas only through the catalog
    the registry hands it."""
    code = ("import sys, mpifl.config; print(sorted(m for m in sys.modules "
            "if m.startswith('mpifl.algorithms') or m == 'mpifl.registry'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_reading_a_config_loads_neither_torch_nor_h5py_nor_mpi():
    """A fresh interpreter imports mpifl.config alone: the package __init__ files it passes through hand their
    names on lazily, so nothing heavy comes along (import-linter's contract sees imports, not __init__ files)."""
    code = "import sys, mpifl.config; print(sorted(m for m in ('torch', 'h5py', 'mpi4py') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("text", "message"), [
    ("algorithm: fedavg\ndata:\n\tdataset: digits\n",
     "is not valid YAML: line 3, column 1: a tab character (YAML indents with spaces, never tabs)"),
    ("algorithm: fedavg\ndata: {dataset: digits\n", "is not valid YAML: line 3, column 1: expected ',' or '}'"),
])
def test_invalid_yaml_names_the_line_column_and_cause(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path} {message}") and "\n" not in str(info.value)
