"""Client state beyond ``state_memory_gb`` spills to disk, least recently used first, and comes back bit for
bit: the store's bookkeeping by hand, and whole runs of stateful algorithms (faults and a resume included) that
give the same results as with all state in memory."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from mpifl.algorithms.state import ClientState
from mpifl.cli import main
from tests.conftest import _merge, assert_same, deterministic, needs_cuda, run_config, run_mpifl_batch
from tests.test_checkpoint import CONFIGS

KB = 2**10


def write(tmp_path: Path, raw: dict, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def states(n: int) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {c: {"w": rng.standard_normal(64).astype(np.float32), "count": np.array(c, dtype=np.int64),
                "mask": rng.random((2, 3)) < 0.5, "empty": np.zeros((0, 4), np.float64)} for c in range(n)}


def test_the_least_recently_used_states_spill_and_come_back_bitwise():
    want = states(6)
    one = sum(a.nbytes for a in want[0].values())  # 256 + 8 + 6 + 0 bytes
    store = ClientState(budget_bytes=2.5 * one)
    folder = Path(store._disk.name)
    for c in range(6):
        store.edit(c).update(want[c])
    store.commit(range(6))
    assert store.memory_bytes == 2 * one and store.spills == 4 and len(list(folder.iterdir())) == 4
    assert store.clients() == list(range(6))
    got = store.read(0)  # spilled: read back, now in memory; the least recent other one goes out
    assert store.reloads == 1 and store.memory_bytes == 2 * one
    for name, value in want[0].items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape
        assert np.array_equal(got[name], value) and not got[name].flags.writeable
    exported = store.export_states([1, 2])  # for a checkpoint: read, not kept
    assert store.reloads == 1 and store.memory_bytes == 2 * one
    assert all(np.array_equal(exported[c]["w"], want[c]["w"]) for c in (1, 2))
    store.edit(3)["w"][:] = 0  # a rejected update: the spilled state stays as it was
    store.discard([3])
    assert np.array_equal(store.get(3, "w"), want[3]["w"])
    store.drop([4])
    assert 4 not in store.clients() and not (folder / "4.npz").exists()
    store.close()
    assert not folder.exists()


SPILL = {"state_memory_gb": KB / 2**30}  # under one client's state for most: nearly every state spills
STATEFUL = ["scaffold", "feddeper", "fedrep"]
BAD_SETTINGS = [
    (["state_memory_gb=-1"], "state_memory_gb"),
    (["state_memory_gb=1", "state_spill_dir=/nonexistent/spill"], "state_spill_dir: cannot make a spill folder"),
]


def stateful_raw(algorithm: str) -> dict:
    return _merge(CONFIGS[algorithm], {"rounds": 4, "faults": {"corrupt": 0.3}})


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> dict:
    """The 3-rank jobs of this file, all in one launch: each :data:`STATEFUL` algorithm with its state spilled
    (its results file), and each of :data:`BAD_SETTINGS` (its result)."""
    folder = tmp_path_factory.mktemp("spill3")
    jobs = [["run", str(write(folder, _merge(stateful_raw(a), SPILL), f"{a}.yaml")), "--out", str(folder / f"{a}.h5"),
             "--quiet"] for a in STATEFUL]
    jobs += [["run", str(write(folder, CONFIGS["scaffold"])), "--out", str(folder / f"bad{i}.h5"),
              *[a for item in setting for a in ("--set", item)]] for i, (setting, _) in enumerate(BAD_SETTINGS)]
    results = run_mpifl_batch(jobs, 3, folder / "batch")
    for algorithm, proc in zip(STATEFUL, results):
        assert proc.returncode == 0, (algorithm, proc.stderr)
    return {**{a: folder / f"{a}.h5" for a in STATEFUL}, **dict(enumerate(results[len(STATEFUL):]))}


@pytest.mark.parametrize("algorithm", STATEFUL)
def test_stateful_algorithms_give_the_same_bits_with_their_state_on_disk(algorithm, tmp_path, three_ranks):
    """Rejected updates included (faults.corrupt): a client whose upload is refused keeps its spilled state."""
    raw = stateful_raw(algorithm)
    run_config(write(tmp_path, raw), tmp_path / "memory.h5")
    spilled = write(tmp_path, _merge(raw, SPILL), "spill.yaml")
    run_config(spilled, tmp_path / "disk.h5")
    reference = deterministic(tmp_path / "memory.h5")
    assert_same(reference, deterministic(tmp_path / "disk.h5"))
    assert_same(reference, deterministic(three_ranks[algorithm]))
    with h5py.File(three_ranks[algorithm]) as f:
        assert f["ranks"]["states_spilled"][1:].min() > 0 and f["ranks"]["states_reloaded"][1:].min() > 0
        assert f["rounds"]["rejected_updates"][()].sum() > 0


def test_a_resume_with_state_on_disk_is_bitwise(tmp_path, monkeypatch):
    config = write(tmp_path, _merge(CONFIGS["feddeper"], {**SPILL, "rounds": 5, "checkpoint_every": 2}))
    run_config(config, tmp_path / "full.h5")
    monkeypatch.setenv("MPIFL_INJECT_FAULT", "0:4")
    assert main(["run", str(config), "--out", str(tmp_path / "part.h5"), "--quiet"]) == 1
    monkeypatch.delenv("MPIFL_INJECT_FAULT")
    assert main(["run", str(config), "--resume", str(tmp_path / "part.h5"), "--quiet"]) == 0
    assert_same(deterministic(tmp_path / "full.h5"), deterministic(tmp_path / "part.h5"))


@pytest.mark.parametrize(("setting", "message"), BAD_SETTINGS)
def test_bad_spill_settings_are_one_line(three_ranks, setting, message):
    proc = three_ranks[BAD_SETTINGS.index((setting, message))]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpifl")]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_a_tensor_entry_on_the_cpu_is_kept_as_its_array():
    """A tensor committed on the CPU becomes an array (the host is the device there), the same bits; edits of it
    and reads as a tensor give those bits too."""
    import torch

    state = ClientState()
    row = torch.randn(16, generator=torch.Generator().manual_seed(0))
    state.edit(3)["control"] = row
    state.commit([3])
    kept = state.get(3, "control")
    assert isinstance(kept, np.ndarray) and not kept.flags.writeable and state.device_bytes == 0
    assert np.array_equal(kept.view(np.int32), row.numpy().view(np.int32))
    assert torch.equal(state.get_on(3, "control", torch.device("cpu")), row)
    assert state.export_states()[3]["control"].tobytes() == row.numpy().tobytes()



def test_a_row_of_a_batch_is_kept_in_memory_of_its_own():
    """SCAFFOLD's cᵢ⁺ are rows of the call's batch of mean gradients: kept as views, each client's row held its
    whole batch (50 rows here) until the client trained again, several times the bytes the state counts and
    budgets. Now each is copied out, the same bits; an array or tensor of its own is kept as it is."""
    import torch

    state = ClientState()
    batch = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    host_batch = np.random.default_rng(0).standard_normal((50, 64)).astype(np.float32)
    whole = torch.randn(64)
    for c in range(50):
        state.edit(c).update(control=batch[c], moment=host_batch[c])
    state.edit(50)["control"] = whole
    state.commit(range(51))
    for c in range(50):
        kept = state.read(c)
        assert not np.shares_memory(kept["control"], batch.numpy()) and not np.shares_memory(kept["moment"], host_batch)
        assert np.array_equal(kept["control"], batch[c].numpy()) and np.array_equal(kept["moment"], host_batch[c])
    assert np.shares_memory(state.read(50)["control"], whole.numpy())  # its own memory already: no copy
    assert state.memory_bytes == 50 * 2 * 64 * 4 + 64 * 4

@needs_cuda
def test_tensor_entries_stay_on_the_gpu_within_the_budget_and_come_to_the_host_beyond_it():
    import torch

    state = ClientState(device_budget_bytes=2 * 64 * 4)  # two clients' rows
    rows = {c: torch.randn(64, device="cuda") for c in range(3)}
    for c, row in rows.items():
        state.edit(c)["control"] = row
        state.commit([c])
    assert state.device_bytes == 2 * 64 * 4  # clients 1 and 2 on the GPU, 0 (least recent) on the host
    assert isinstance(state.read(0)["control"], np.ndarray) and state.read(2)["control"].is_cuda
    assert state.get_on(2, "control", torch.device("cuda")) is state.read(2)["control"]  # no copy
    exported = state.export_states()
    for c, row in rows.items():
        assert exported[c]["control"].tobytes() == row.cpu().numpy().tobytes()
