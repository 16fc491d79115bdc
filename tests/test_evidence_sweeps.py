"""Every evidence sweep file (``configs/evidence/*.yaml``; their bases live in ``configs/evidence/base/``) still
expands, validates and runs, so the files that issue 14's tables come from never rot: all runs validated, then
each distinct method (variant × algorithm) trained for a round on 1 seed, on a fifth of Fashion-MNIST's rows
(``SAMPLE``). The single-seed sweeps behind the older tables (``configs/evidence/older/``) are validated too, and
each of their algorithms trained for a round. A method whose one-round config an earlier sweep file already trains
(pefll_500's methods are pefll's, at another horizon) is not trained twice. A new sweep file is covered by being
there."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from mpifl.cli import main
from mpifl.config import apply_overrides, load_raw
from mpifl.data.formats import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, IdxFile
from mpifl.data.pooled import FASHION_MNIST_DEFAULT_ROOT
from mpifl.results import read_results
from mpifl.sweep import Run, load_sweep
from tests.data.data_files import write_idx

EVIDENCE = Path(__file__).resolve().parents[1] / "configs" / "evidence"
SWEEPS = sorted(EVIDENCE.glob("*.yaml"))
OLDER = sorted((EVIDENCE / "older").glob("*.yaml"))
SMOKE = ["rounds=1", "eval_every=1"]
# Work sizes the smoke shrinks (per algorithm; what a run exercises stays): Local's pre-training epochs (every
# client trains before round 1), pFedHN's rounds for a new client's embedding, FedRep's head epochs.
SHRINK = {"local": ["local.epochs=1"], "pfedhn": ["pfedhn.new_client_rounds=1"],
          "fedrep": ["fedrep.head_epochs=1", "fedrep.new_head_epochs=1"]}


def _method(base: Path, run: Run) -> tuple[str, str]:
    return run.variant, apply_overrides(load_raw(base), list(run.overrides))["algorithm"]


SPLIT = 0.05
"""The smoke's largest test and validation fractions: the splits exist and are evaluated, as in the sweep, but the
evaluation of Fashion-MNIST's 100 clients (most of a one-round run) reads a third of the rows."""


def smaller_splits(data: dict) -> list[str]:
    return [f"data.{key}={SPLIT}" for key in ("test_fraction", "val_fraction") if data[key] > SPLIT]


SAMPLE = 0.2
"""The share of Fashion-MNIST's rows the smoke runs read: the first rows of each of Debian's files, written in the
same IDX format. Every method's work per client and per sample stays (PeFLL's descriptors, Local's and
Per-FedAvg's passes over every client, kNN-Per's datastores: most of a one-round run), on a fifth of the samples;
each client still has tens of rows of each split."""


@pytest.fixture(scope="module")
def fashion_mnist_sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first ``SAMPLE`` of Debian's Fashion-MNIST train and t10k files, as IDX files in a folder of their own."""
    folder = tmp_path_factory.mktemp("fashion_mnist")
    for split in ("train", "t10k"):
        images = IdxFile(Path(FASHION_MNIST_DEFAULT_ROOT, f"{split}-images-idx3-ubyte.gz"), IDX_IMAGES_MAGIC)
        labels = IdxFile(Path(FASHION_MNIST_DEFAULT_ROOT, f"{split}-labels-idx1-ubyte.gz"), IDX_LABELS_MAGIC)
        rows = range(int(images.shape[0] * SAMPLE))
        write_idx(folder / f"{split}-images-idx3-ubyte", images.read_rows(rows))
        write_idx(folder / f"{split}-labels-idx1-ubyte", labels.read_rows(rows))
    return folder


def _one_round(run: Run) -> str:
    """What a smoke run trains, whatever its file and its horizon's settings: its whole config but for its
    output and checkpoint_every (a one-round run writes no checkpoint at any interval)."""
    return json.dumps({k: v for k, v in run.config.items() if k not in ("output", "checkpoint_every")},
                      sort_keys=True, default=str)


@cache
def _one_round_configs(sweep: Path) -> frozenset[str]:
    """The one-round configs a sweep file's smoke runs train (each file expanded once per session)."""
    return frozenset(_one_round(run) for run in load_sweep(sweep, SMOKE, [0], "/nonexistent")[2])


def _trained_before(sweep: Path) -> set[str]:
    """The one-round configs the sweep files before ``sweep`` (in the test's order) train."""
    files = SWEEPS + OLDER
    return set().union(*map(_one_round_configs, files[:files.index(sweep)]))


def test_evidence_sweeps_exist():
    names = {p.stem for p in SWEEPS}
    assert {"pefll", "pefll_dirichlet", "fedals", "feddeper", "karula"} <= names


@pytest.mark.parametrize("sweep", SWEEPS + OLDER, ids=lambda p: p.stem)
def test_evidence_sweep_validates_and_each_method_runs(sweep: Path, tmp_path: Path, capsys,
                                                       request: pytest.FixtureRequest):
    base, spec, runs = load_sweep(sweep)  # every run of the real sweep validates
    older = sweep in OLDER
    assert (older or len(spec.seeds) >= 3) and len(runs) == len({r.output for r in runs})
    raw = load_raw(base)
    if raw["data"]["dataset"] == "fashion_mnist" and not Path(FASHION_MNIST_DEFAULT_ROOT).is_dir():
        pytest.skip(f"{FASHION_MNIST_DEFAULT_ROOT} absent (apt-get install dataset-fashion-mnist)")
    sample = ([f"data.root={request.getfixturevalue('fashion_mnist_sample')}"]
              if raw["data"]["dataset"] == "fashion_mnist" else [])
    base, _, smoke = load_sweep(sweep, SMOKE, [0], str(tmp_path))

    def method(run: Run) -> tuple[str, str]:  # an older sweep's variants differ in settings only: one per algorithm
        variant, algorithm = _method(base, run)
        return ("", algorithm) if older else (variant, algorithm)

    methods = {method(r) for r in runs}
    chosen: dict[tuple[str, str], Run] = {}
    for run in smoke:
        chosen.setdefault(method(run), run)
    assert set(chosen) == methods
    trained = _trained_before(sweep)
    for (_, algorithm), run in chosen.items():
        if _one_round(run) in trained:
            continue
        args = ["run", str(base), "--out", str(run.output), "--quiet"]
        steps = ["client.steps=2"] if "steps" in raw["client"] else []  # a base's fixed local steps, shrunk too
        sets = [*run.overrides, *SHRINK.get(algorithm, []), *steps, *smaller_splits(run.config["data"]), *sample]
        assert main([*args, *(a for o in sets for a in ("--set", o))]) == 0, run.name
        res = read_results(run.output)
        assert list(res.table("eval")["round"]) == [1], run.name
    capsys.readouterr()
