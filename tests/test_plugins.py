"""Bring your own algorithm, model and dataset without forking mpifl: the tutorials' example package
(``examples/plugin``) is built and installed outside the environment, found through its entry points
on 1 and 3 ranks (bitwise the same, exact bytes), named by ``module:callable`` paths, and refused with one
line when a name is unknown or a plug-in is broken."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from mpifl.registry import known_algorithms
from mpifl.results import read_results
from tests.conftest import HANG_S, REPO, assert_same, deterministic, mpi_env, mpirun_cmd, run_config
from tests.test_fuzz import call

EXAMPLE = REPO / "examples" / "plugin"
ENTRY_POINTS = yaml.safe_load((EXAMPLE / "damped_blobs.yaml").read_text())  # the tutorial's example config
# tanh_mlp on blobs' 8 features and 3 classes, two hidden layers of 16: 8·16+16 + 16·16+16 + 16·3+3 parameters
PARAMS = 467


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:  # noqa: ANN001
    """The example package built from a copy and installed into a directory of its own, offline, so the shared
    environment never sees it; processes find its entry points when the directory is on their path."""
    root = tmp_path_factory.mktemp("plugin")
    shutil.copytree(EXAMPLE, root / "src")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = subprocess.run([*pip, "--target", str(root / "site"), str(root / "src")], capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    return root / "site"


@pytest.fixture
def on_path(site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The installed example importable in this process too (and a folder for single-module plug-ins)."""
    monkeypatch.syspath_prepend(str(site))
    return site


def write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(site: Path, config: Path, out: Path, ranks: int) -> None:
    """``mpifl run`` in a fresh process (under ``mpirun -n ranks`` when ranks > 1) that sees the plug-ins."""
    env = {**mpi_env(), "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    cmd = (mpirun_cmd(ranks) if ranks > 1 else []) + [sys.executable, "-m", "mpifl", "run", str(config), "--out",
                                                      str(out), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_entry_points_run_bitwise_the_same_on_1_and_3_ranks_with_exact_bytes(site, tmp_path):
    config = write(tmp_path / "cfg.yaml", ENTRY_POINTS)
    for ranks in (1, 3):
        run(site, config, tmp_path / f"p{ranks}.h5", ranks)
    assert_same(deterministic(tmp_path / "p1.h5"), deterministic(tmp_path / "p3.h5"))
    res = read_results(tmp_path / "p3.h5")
    assert res.attrs["algorithm"] == "damped_fedavg" and res.table("model")["global_model"].shape == (PARAMS,)
    ledger, attrs = res.table("ledger"), res.table_attrs["ledger"]
    names = np.asarray(attrs["message_names"])[ledger["message"]]
    stages = np.asarray(attrs["stages"])[ledger["stage"]]
    train = stages == "train"
    assert np.all(ledger["bytes"] == 4 * PARAMS)  # every row: the fp32 model or its delta, one client
    for message in ("model", "delta"):  # 3 rounds × 4 clients, each way
        assert ledger["bytes"][train & (names == message)].sum() == 3 * 4 * 4 * PARAMS
    assert ledger["bytes"][~train].sum() == 3 * 8 * 4 * PARAMS  # 3 evaluations, the model to all 8 clients
    assert res.table("eval")["global.seen.acc_pooled"][-1] > 0.5  # 3 balanced classes: better than chance


def test_module_callable_paths_and_the_algorithms_option(on_path, tmp_path):
    """The same plug-ins named by path, in this process; ``rate`` reaches the server: damped FedAvg at rate r
    is FedAvg at server.lr = r, bit for bit (the default rate, 0.5, would differ)."""
    algorithm = "mpifl_example.algorithm:ALGORITHM"
    paths = {**ENTRY_POINTS, "algorithm": algorithm, algorithm: ENTRY_POINTS["damped_fedavg"],
             "data": {**ENTRY_POINTS["data"], "dataset": "mpifl_example.data:load"},
             "model": {**ENTRY_POINTS["model"], "name": "mpifl_example.model:build"}}
    del paths["damped_fedavg"]
    run_config(write(tmp_path / "paths.yaml", paths), tmp_path / "paths.h5")
    fedavg = {**paths, "algorithm": "fedavg", "server": {"lr": 0.25}}
    del fedavg[algorithm]
    run_config(write(tmp_path / "fedavg.yaml", fedavg), tmp_path / "fedavg.h5")
    assert_same(deterministic(tmp_path / "paths.h5"), deterministic(tmp_path / "fedavg.h5"))
    assert read_results(tmp_path / "paths.h5").attrs["algorithm"] == algorithm


BROKEN_MODULE = "import not_installed_dependency  # noqa: F401\n\n\ndef build(cfg, layout):\n    pass\n"


@pytest.mark.parametrize("change, error", [
    ({"algorithm": "damped_fedav"},
     "algorithm: unknown algorithm 'damped_fedav' (did you mean 'damped_fedavg'?); built-in: fedals, fedasync, "
     "fedavg, "),
    ({"model": {"name": "tanh_mpl"}}, "model.name: unknown model 'tanh_mpl' (did you mean 'tanh_mlp'?); built-in: "),
    ({"data": {"dataset": "blob"}}, "data.dataset: unknown dataset 'blob' (did you mean 'blobs'?); built-in: "),
    ({"model": {"name": "broken_plugin:build"}},
     "model.name: model plug-in 'broken_plugin:build': cannot import module 'broken_plugin': ModuleNotFoundError: "
     "No module named 'not_installed_dependency'"),
    ({"model": {"name": "not_on_any_path:build"}},  # the plug-in itself missing: how the ranks find it
     "model.name: model plug-in 'not_on_any_path:build': cannot import module 'not_on_any_path': ModuleNotFoundError: "
     "No module named 'not_on_any_path'; every rank imports it: install it, or put its folder on PYTHONPATH, which "
     "mpirun passes on with 'mpirun -x PYTHONPATH ...'"),
    ({"model": {"name": "mpifl_example.model:biuld"}},
     "model.name: model plug-in 'mpifl_example.model:biuld': module 'mpifl_example.model' has no attribute 'biuld'"),
    ({"algorithm": "mpifl_example.model:build"},
     "algorithm: plug-in 'mpifl_example.model:build' must be a tuple (options dataclass or None, ServerAlgorithm "
     "subclass, ClientAlgorithm subclass), got <function build"),
    ({"model": {"name": "mpifl_example:"}}, "model.name: 'mpifl_example:' is not a 'module:callable' path"),
    ({"model": {"options": {"widht": 8}}}, "model.options: unknown key 'widht' (did you mean 'width'?)"),
    ({"damped_fedavg": {"rate": 2}}, "damped_fedavg.rate: must be <= 1, got 2.0"),
    ({"model": {"name": "mlp"}}, "model.options: only plug-in models take options; 'mlp' is built in"),
])
def test_unknown_or_broken_plugins_are_one_line_and_exit_code_2(on_path, tmp_path, change, error):
    (on_path / "broken_plugin.py").write_text(BROKEN_MODULE)
    cfg = {**ENTRY_POINTS, **{k: {**ENTRY_POINTS[k], **v} if isinstance(v, dict) else v for k, v in change.items()}}
    code, err = call(["validate", str(write(tmp_path / "cfg.yaml", cfg))])
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"mpifl: error: {error}"), err


UNHANDLED_MODULE = """from mpifl.algorithms.fedavg import FedAvgClient, FedAvgServer


class NoDeltaServer(FedAvgServer):
    def handlers(self):
        return {msg: fn for msg, fn in super().handlers().items() if msg.name != "delta"}


ALGORITHM = (None, NoDeltaServer, FedAvgClient)
"""


def test_a_message_without_a_handler_is_refused_at_set_up(on_path, tmp_path):
    """A plug-in whose plan names a message its server does not handle: one line, exit 2, nothing written."""
    (on_path / "unhandled_plugin.py").write_text(UNHANDLED_MODULE)
    config = write(tmp_path / "cfg.yaml", {**ENTRY_POINTS, "algorithm": "unhandled_plugin:ALGORITHM"})
    code, err = call(["run", str(config), "--out", str(tmp_path / "r.h5"), "--quiet"])
    assert code == 2 and err == ("mpifl: error: algorithm NoDeltaServer: no server handler for message(s) delta "
                                 "(declare them in its handlers())\n")
    assert not (tmp_path / "r.h5").exists()


def test_an_unknown_name_lists_the_choices_and_says_how_to_add_one(on_path, tmp_path):
    code, err = call(["validate", str(write(tmp_path / "cfg.yaml", {**ENTRY_POINTS, "algorithm": "fedavgg"}))])
    assert code == 2 and err == (
        f"mpifl: error: algorithm: unknown algorithm 'fedavgg' (did you mean 'fedavg'?); built-in: "
        f"{', '.join(known_algorithms())}; installed plug-ins: damped_fedavg; add your own as an entry point in "
        "group 'mpifl.algorithms' or name it as 'module:callable' (docs/tutorials/own-algorithm.md)\n")


def test_a_broken_plugin_stops_3_ranks_with_one_line(site, tmp_path):
    (tmp_path / "broken_plugin.py").write_text(BROKEN_MODULE)
    config = write(tmp_path / "cfg.yaml", {**ENTRY_POINTS, "model": {"name": "broken_plugin:build"}})
    env = {**mpi_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(site), str(REPO)])}
    cmd = [*mpirun_cmd(3), sys.executable, "-m", "mpifl", "run", str(config), "--out", str(tmp_path / "x.h5")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=env, cwd=REPO)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpifl")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert lines == ["mpifl: error: model.name: model plug-in 'broken_plugin:build': cannot import module "
                     "'broken_plugin': ModuleNotFoundError: No module named 'not_installed_dependency'"]
    assert not (tmp_path / "x.h5").exists()


def test_the_tutorials_show_the_example_as_it_is():
    """The tutorials (writing an algorithm, bringing your own data) show the package these tests install, file
    for file."""
    pages = "".join((REPO / "docs" / "tutorials" / name).read_text() for name in ("own-algorithm.md", "own-data.md"))
    files = [EXAMPLE / "pyproject.toml", EXAMPLE / "damped_blobs.yaml", *(EXAMPLE / "mpifl_example").glob("[!_]*.py")]
    assert len(files) == 5
    for path in files:
        assert f"\n{path.read_text()}```" in pages, path


RECORDING = '''
import numpy as np
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgServer

TRAINED = []


class RecordingClient(FedAvgClient):
    """Records each client it trains."""

    def compute(self, step, client):
        super().compute(step, client)
        TRAINED.append((type(self).__name__, step.round, client, float(np.abs(np.asarray(self.deltas[client])).sum())))


class Freezing:
    """A mixin, before the algorithm's class in the MRO: its compute overrides the stated step as well."""

    def compute(self, step, client):
        super().compute(step, client)
        self.deltas[client] = np.zeros_like(np.asarray(self.deltas[client]))


class FrozenClient(Freezing, RecordingClient):
    pass


RECORD = (None, FedAvgServer, RecordingClient)
FREEZE = (None, FedAvgServer, FrozenClient)
'''


@pytest.mark.parametrize("vectorize", [False, True])
def test_an_override_of_compute_on_a_stated_local_step_is_honoured(on_path, write_config, tmp_path, vectorize):
    """A plug-in that overrides ``compute`` on FedAvg (which states its local step for the executor) sees every
    client it trains, in the loop and where the batch would otherwise train them all at once, and what it changes
    reaches the results: recording alone leaves FedAvg's bits, a zero delta leaves the model where it started."""
    (on_path / "recording_fedavg.py").write_text(RECORDING)
    import importlib

    plugin = importlib.import_module("recording_fedavg")
    plugin.TRAINED.clear()
    base = {"rounds": 2, "eval_every": 1, "model": {"name": "mlp", "hidden": [16]},
            "client": {"vectorize": vectorize}}
    runs = {}
    for name in ("fedavg", "recording_fedavg:RECORD", "recording_fedavg:FREEZE"):
        config = write_config({**base, "algorithm": name}, f"{name.replace(':', '_')}.yaml")
        run_config(config, tmp_path / f"{name.replace(':', '_')}.h5")
        runs[name] = deterministic(tmp_path / f"{name.replace(':', '_')}.h5")
    assert len(plugin.TRAINED) == 2 * 2 * 4  # 2 plug-ins x 2 rounds x 4 clients a round, each seen once
    assert len(set(plugin.TRAINED)) == len(plugin.TRAINED)
    assert all(trained > 0 for *_, trained in plugin.TRAINED)
    assert_same(runs["fedavg"], runs["recording_fedavg:RECORD"])
    frozen = runs["recording_fedavg:FREEZE"]["model/global_model"]
    assert not np.array_equal(frozen, runs["fedavg"]["model/global_model"])
    once = write_config({**base, "rounds": 1, "algorithm": "recording_fedavg:FREEZE"}, "once.yaml")
    run_config(once, tmp_path / "once.h5")  # every update zero: after 1 round the model is where 2 leave it
    assert np.array_equal(frozen, deterministic(tmp_path / "once.h5")["model/global_model"])


STALE_MODULE = '''from mpifl.algorithms.ifca import IFCAClient, IFCAServer
from mpifl.algorithms.pefll import PeFLLClient, PeFLLServer


class Recording:
    def report(self, client, j, trained):  # IFCA's, until issue 59: nothing calls it now
        raise AssertionError("never called")


class RecordingIFCA(Recording, IFCAClient):
    pass


class NoisyPeFLL(PeFLLClient):
    def send_eval_descriptor(self, step, client):
        raise AssertionError("never called")


IFCA = (None, IFCAServer, RecordingIFCA)
PEFLL = (None, PeFLLServer, NoisyPeFLL)
'''


@pytest.mark.parametrize("plugin, line", [
    ("IFCA", "Recording.report overrides IFCAClient.report, which mpifl no longer calls; override local_end (it keeps "
             "each client's cluster and delta) instead (docs/tutorials/own-algorithm.md)"),
    ("PEFLL", "NoisyPeFLL.send_eval_descriptor overrides PeFLLClient.send_eval_descriptor, which mpifl no longer "
              "calls; override send_descriptor (it sends the evaluation's descriptors too) instead "
              "(docs/tutorials/own-algorithm.md)"),
])
def test_an_override_of_a_method_mpifl_no_longer_calls_is_refused_in_one_line(on_path, tmp_path, plugin, line):
    """A plug-in written for an older mpifl that overrides a method since retired (IFCA's ``report``, PeFLL's
    ``send_eval_descriptor``, gone with issue 59) would run and change nothing: refused at load instead, naming
    what to override (exit 2, before anything is trained)."""
    (on_path / "stale_plugin.py").write_text(STALE_MODULE)
    config = write(tmp_path / "cfg.yaml", {**ENTRY_POINTS, "algorithm": f"stale_plugin:{plugin}"})
    code, err = call(["validate", str(config)])
    assert (code, err) == (2, f"mpifl: error: algorithm: plug-in 'stale_plugin:{plugin}': {line}\n")


def test_no_built_in_algorithm_defines_a_method_it_retired():
    """The refusal above names a method mpifl no longer calls: no built-in side may define one (nor be refused)."""
    from mpifl.algorithms.base import stale_overrides
    from mpifl.registry import get_algorithm

    sides = [side for name in known_algorithms() for side in (get_algorithm(name).server, get_algorithm(name).client)]
    assert [line for side in sides for line in stale_overrides(side)] == []
    assert sum(bool(vars(klass).get("retired")) for side in sides for klass in side.__mro__) > 0
