"""Hostile input, generated: every broken config or data file either works or gives exit code 2 with
one ``mpifl: error:`` line — never another exception, never a traceback."""

import contextlib
import dataclasses
import gzip
import io
import json
import pickle
import tempfile
import typing
from pathlib import Path

import numpy as np
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mpifl.cli import main
from mpifl.config import RunConfig
from mpifl.data import build_federated_dataset
from mpifl.data.config import DataConfig
from mpifl.registry import get_algorithm, known_algorithms
from mpifl.schema import ConfigError
from tests.conftest import REPO, TINY, _merge, run_mpifl
from tests.data.data_files import write_idx

KEYS = [
    "algorithm", "rounds", "clients_per_round", "seed", "eval_every", "checkpoint_every", "checkpoint_keep",
    "checkpoint_minutes",
    "eval_chunk", "device",
    "threads_per_rank", "data_memory_gb", "state_memory_gb", "state_spill_dir", "state_device_gb", "allow_tf32",
    "server.device",
    "placement", "data.dataset", "data.num_clients", "data.partition", "data.classes_per_client", "data.alpha",
    "data.shards_per_client", "data.unseen_fraction", "data.test_fraction", "data.val_fraction", "data.max_clients",
    "data.pad_to", "data.synthetic.samples_per_client", "data.synthetic.size_sigma", "data.synthetic.image_shape",
    "data.synthetic.num_classes",
    "model.name", "model.hidden", "model.channels", "model.fc_hidden", "client.lr", "client.momentum",
    "client.epochs", "client.steps", "client.batch_size", "client.clip_norm", "client.vectorize", "server.lr",
    "network.up_mbps", "network.distribution", "faults.dropout", "faults.over_selection", "fedprox.mu", "bogus",
    "data.bogus", "compression.up.codec", "compression.up.fraction", "compression.down.error_feedback",
    "compression.messages", "privacy.mode", "privacy.noise_multiplier", "privacy.sampling", "secure_aggregation",
    "secagg.field_bits", "network.compute", "network.availability.mode", "network.availability.trace",
    "network.availability.mean_on_s", "fedbuff.buffer_size", "fedbuff.concurrency", "server.optimizer",
    "server.beta1", "server.tau", "network.speed.mode", "network.speed.sigma", "network.speed.file",
    "network.seconds_per_sample",
]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 10), st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["fedavg", "local", "fedprox", "digits", "gaussian_images", "mnist", "iid", "classes",
                     "dirichlet", "shards", "natural", "mlp", "cnn", "lenet", "linear", "logistic", "lognormal",
                     "auto", "static", "dynamic", "topk", "qsgd", "sign", "central", "poisson", "secagg_plus",
                     "fedbuff", "model", "onoff", "trace", "adam", "yogi", "adagrad", "file", "cuda", "cpu"]),
    st.lists(st.integers(-3, 40), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def set_path(cfg: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
    node[leaf] = value


def call(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


@settings(max_examples=300, deadline=None)
@given(mutations=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=4))
@example(mutations=[("model.channels", [-3])])  # was a traceback from torch's Conv2d
@example(mutations=[("model.name", "mlp"), ("model.hidden", [8, 0])])
@example(mutations=[("data.dataset", "gaussian_images"), ("data.synthetic.image_shape", [-1, 4])])
@example(mutations=[("data.pad_to", 32994)])  # a 70 GB cnn head: was torch's allocator traceback
@example(mutations=[("model.name", "mlp"), ("model.hidden", [2**20, 2**20])])  # 4.4 TB of weights
@example(mutations=[("data.pad_to", 2**40)])  # sizes past torch's 64 bits
@example(mutations=[("data.dataset", "gaussian_images"), ("data.num_clients", 2**26)])  # 32 GB of label counts
@example(mutations=[("data.dataset", "gaussian_images"), ("data.synthetic.num_classes", 2**20)])  # minutes to lay out
@example(mutations=[("data.dataset", "gaussian_images"), ("data.synthetic.samples_per_client", 2**30)])  # numpy's 10⁹
def test_broken_configs_validate_or_fail_with_one_line(mutations):
    with tempfile.TemporaryDirectory() as tmp:
        _validate_once(Path(tmp), mutations)


def _validate_once(tmp_path: Path, mutations) -> None:
    cfg = _merge(TINY, {})
    for key, value in mutations:
        set_path(cfg, key, value)
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, err = call(["validate", str(path)])
    assert code in (0, 2), err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mpifl: error: "), err


@settings(max_examples=40, deadline=None)
@given(dropped=st.sets(st.sampled_from(["algorithm", "data", "data.dataset", "model", "rounds", "eval_every"])))
@example(dropped={"algorithm", "data"})  # what an empty file lacks
def test_configs_lacking_keys_run_on_defaults_only_where_they_name_algorithm_and_dataset(dropped):
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _merge(TINY, {})
        for key in dropped:
            *parents, leaf = key.split(".")
            node = cfg
            for part in parents:
                node = node.get(part, {})
            node.pop(leaf, None)
        path = Path(tmp) / "short.yaml"
        path.write_text(yaml.safe_dump(cfg))
        code, err = call(["validate", str(path)])
    missing = [key for key in ("algorithm", "data.dataset") if any(f"{key}.".startswith(f"{d}.") for d in dropped)]
    if missing:
        assert (code, err) == (2, f"mpifl: error: {path}: missing {' and '.join(missing)}; name "
                                  f"{'them' if len(missing) > 1 else 'it'} in the file or with --set (e.g. algorithm: "
                                  "fedavg, data: {dataset: digits})\n")
    else:
        assert code == 0, err


@settings(max_examples=8, deadline=None)
@given(
    lr=st.floats(1e-6, 1e3), clients=st.integers(1, 12), momentum=st.floats(0, 0.99),
    partition=st.sampled_from(["iid", "classes", "dirichlet", "shards"]), dropout=st.floats(0, 0.9),
)
def test_extreme_but_valid_configs_run_to_a_complete_results_file(lr, clients, momentum, partition, dropout):
    with tempfile.TemporaryDirectory() as tmp:
        _run_once(Path(tmp), lr, clients, momentum, partition, dropout)


def _run_once(tmp_path: Path, lr, clients, momentum, partition, dropout) -> None:
    cfg = _merge(TINY, {"rounds": 1, "clients_per_round": min(clients, 8), "faults": {"dropout": dropout},
                        "data": {"partition": partition}, "client": {"lr": lr, "momentum": momentum}})
    path, out = tmp_path / "x.yaml", tmp_path / "x.h5"
    path.write_text(yaml.safe_dump(cfg))
    code, err = call(["run", str(path), "--out", str(out), "--quiet"])
    if code == 2:  # e.g. a partition impossible for these numbers: refused up front, nothing written
        assert len(err.strip().splitlines()) == 1 and not out.exists()
    else:
        assert code == 0, err
        from mpifl.results import read_results

        assert read_results(out).attrs["status"] == "completed"


def _corrupt(data: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    buf = bytearray(data[: max(0, min(cut, len(data)))])
    for position, value in flips:
        if buf:
            buf[position % len(buf)] = value
    return bytes(buf)


@settings(max_examples=150, deadline=None)
@given(
    target=st.sampled_from(["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"]),
    cut=st.integers(0, 2000), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
    nan=st.booleans(), gz=st.booleans(),
)
def test_damaged_idx_files_load_or_raise_config_error(target, cut, flips, nan, gz):
    with tempfile.TemporaryDirectory() as tmp:
        _load_damaged_idx(Path(tmp), target, cut, flips, nan, gz)


def _load_damaged_idx(tmp_path: Path, target, cut, flips, nan, gz) -> None:
    rng = np.random.default_rng(0)
    files = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (30, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(30) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(10) % 10).astype(np.uint8),
    }
    for name, array in files.items():
        path = write_idx(tmp_path / name, array)
        if name == target:
            path.write_bytes(_corrupt(path.read_bytes(), cut, flips))
        if gz:
            (tmp_path / f"{name}.gz").write_bytes(gzip.compress(path.read_bytes()))
            path.unlink()
    cfg = DataConfig(dataset="mnist", root=str(tmp_path), num_clients=4, normalize=not nan)
    try:
        data = build_federated_dataset(cfg, 0)
        data.load_clients(range(data.layout.num_clients))
    except ConfigError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(["cifar", "leaf"]), cut=st.integers(0, 4000),
       flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3))
@example(kind="cifar", cut=1, flips=[(0, 80)])  # the library's message spans lines
@example(kind="cifar", cut=9, flips=[(0, 149)])  # a damaged length asks for an impossible buffer: MemoryError
@example(kind="cifar", cut=52, flips=[(40, 1)])  # a damaged string encoding name: LookupError
@example(kind="cifar", cut=14, flips=[(0, 141), (64, 128)])  # a length past the address space: OverflowError
def test_damaged_cifar_pickles_and_leaf_json_raise_config_error(kind, cut, flips):
    with tempfile.TemporaryDirectory() as tmp:
        _load_damaged_files(Path(tmp), kind, cut, flips)


def _load_damaged_files(tmp_path: Path, kind, cut, flips) -> None:
    rng = np.random.default_rng(1)
    if kind == "cifar":
        root = tmp_path / "cifar-10-batches-py"
        root.mkdir()
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": list(range(4))}
            (root / name).write_bytes(pickle.dumps(batch, protocol=2))
        victim = root / "data_batch_1"
        cfg = DataConfig(dataset="cifar10", root=str(root), num_clients=2)
    else:
        root = tmp_path / "leaf"
        for split in ("train", "test"):
            (root / split).mkdir(parents=True)
            users = {f"u{i}": {"x": rng.random((3, 784)).tolist(), "y": [1, 2, 3]} for i in range(2)}
            doc = {"users": list(users), "num_samples": [3, 3], "user_data": users}
            (root / split / "all.json").write_text(json.dumps(doc))
        victim = root / "train" / "all.json"
        cfg = DataConfig(dataset="femnist", root=str(root), partition="natural")
    victim.write_bytes(_corrupt(victim.read_bytes(), cut, flips))
    try:
        data = build_federated_dataset(cfg, 0)
        data.load_clients(range(data.layout.num_clients))
    except ConfigError as exc:
        assert "\n" not in str(exc)


def int_fields(cls: type, prefix: str = "") -> dict[str, bool]:
    """The dotted path of every integer field (``int``, ``int | None``, ``tuple[int, ...]``) of a config
    dataclass and its sections, and whether it holds a list of them."""
    found = {}
    for name, tp in typing.get_type_hints(cls).items():
        path = f"{prefix}{name}"
        args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis] or [tp]
        if dataclasses.is_dataclass(tp):
            found.update(int_fields(tp, f"{path}."))
        elif int in args and bool not in args:
            found[path] = typing.get_origin(tp) is tuple
    return found


INT_FIELDS = {**int_fields(RunConfig), **{f"{name}.{path}": many for name in known_algorithms()
                                           for path, many in int_fields(get_algorithm(name).options_type).items()}}


def as_given(key: str, value: int) -> int | list[int]:
    return [value] if INT_FIELDS[key] else value


def test_the_issues_command_line_is_one_line_and_exit_2():
    """``--set rounds=100000000000000000000000`` (issue 29): past any counter mpifl stores."""
    for command in ("validate", "run"):
        proc = run_mpifl([command, str(REPO / "configs" / "quickstart.yaml"), "--set",
                          "rounds=100000000000000000000000"])
        assert proc.returncode == 2 and proc.stderr == (
            "mpifl: error: rounds: 100000000000000000000000 does not fit in a 64-bit integer "
            "(-9223372036854775808 to 9223372036854775807)\n"), proc.stderr


@settings(max_examples=len(INT_FIELDS) * 3, deadline=None)
@given(key=st.sampled_from(sorted(INT_FIELDS)),
       value=st.one_of(st.integers(min_value=2**63), st.integers(max_value=-2**63 - 1)))
@example(key="seed", value=2**64)  # past numpy's uint64 keys and torch's seeds
def test_no_integer_field_takes_a_value_beyond_64_bits(key, value):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.yaml"
        cfg = _merge(TINY, {})
        set_path(cfg, key, as_given(key, value))
        path.write_text(yaml.safe_dump(cfg))
        code, err = call(["validate", str(path)])
    assert code == 2 and err.startswith(f"mpifl: error: {key}") and "does not fit in a 64-bit integer" in err, err
    assert err.count("\n") == 1


@settings(max_examples=len(INT_FIELDS) * 2, deadline=None)
@given(key=st.sampled_from(sorted(INT_FIELDS)), value=st.integers(min_value=2**31 - 2, max_value=2**63 - 1))
@example(key="threads_per_rank", value=2**31)  # torch takes a C int
@example(key="client.steps", value=2**62)  # × the batch size: past int64 samples per round
@example(key="client.epochs", value=2**62)
@example(key="data.num_clients", value=2**62)  # more clients than samples, refused before any per-client array
def test_huge_but_64_bit_integers_validate_or_fail_with_one_line(key, value):
    """Every integer field at sizes up to int64's: either a valid config, or one line (never a wrapped count, a
    traceback or an allocation of the count's size)."""
    section = key.split(".")[0]
    with tempfile.TemporaryDirectory() as tmp:
        _validate_once(Path(tmp), [("algorithm", section if section in known_algorithms() else "fedavg"),
                                   (key, as_given(key, value))])


def test_schema_covers_every_top_level_key():
    assert {k.split(".")[0] for k in KEYS} >= set(RunConfig.__dataclass_fields__) - {"output", "algorithm_options",
                                                                                      "network", "server"} - {"seed"}
