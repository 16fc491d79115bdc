"""The runtime's jobs on their own: the plan walker, the recorder and the checkpointer, in one process with a
toy algorithm whose every callback records what the runtime told it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from mpifl.algorithms.base import ClientAlgorithm, EvalLayout, Protocol, RunContext, ServerAlgorithm, StepContext
from mpifl.comm import LOCAL, Ledger, Message, Placement, Transport
from mpifl.comm.messages import EVERYONE_LOCAL, require
from mpifl.comm.wire import WireFormat
from mpifl.data import build_federated_dataset
from mpifl.registry import parse_config
from mpifl.results import read_results
from mpifl.runtime.checkpointer import Checkpointer
from mpifl.runtime.faults import FaultModel
from mpifl.runtime.rank import RankContext
from mpifl.runtime.recorder import Recorder
from mpifl.runtime.store import ClientStore
from mpifl.runtime.timing import RankTimes
from mpifl.runtime.walker import PlanWalker
from mpifl.schema import ConfigError
from mpifl.training.sgd import EVAL_FIELDS
from tests.conftest import TINY, _merge


class EchoProtocol(Protocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.value = Message("value", "down", 3)
        self.reply = Message("reply", "up", 3)
        self.everyone_value = Message("everyone_value", "down", 3, broadcast=True, everyone=True)


@dataclass
class Seen:
    """What a callback was told (plain values, so the toy server's state can be checkpointed)."""

    round: int
    stage: str
    clients: list[int]

    @classmethod
    def of(cls, step: StepContext) -> Seen:
        return cls(step.round, step.stage, step.clients.tolist())


class EchoServer(ServerAlgorithm):
    """Sends each client (id, id, id), sums what comes back; records every call."""

    protocol_type = EchoProtocol
    protocol: EchoProtocol
    checkpoint_derived = ("calls",)  # the test's record, not the algorithm's state

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.calls: list[tuple[str, str, Seen]] = []
        self.total = np.zeros(3)

    def payload(self, msg: Message, step: StepContext) -> np.ndarray:
        self.calls.append(("payload", msg.name, Seen.of(step)))
        if msg.broadcast:
            return np.full(3, 7.0, dtype=np.float32)
        return np.repeat(step.clients[:, None], 3, axis=1).astype(np.float32)

    def consume(self, msg: Message, step: StepContext, rows: np.ndarray) -> None:
        self.calls.append(("consume", msg.name, Seen.of(step)))
        self.total += rows.sum(0)


class EchoClient(ClientAlgorithm):
    """Doubles what it received (NaN for client 3 when told so); counts its rounds in its state."""

    protocol_type = EchoProtocol
    protocol: EchoProtocol
    scratch = ("got",)

    def __init__(self, ctx: RunContext, data, state=None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.got: dict[int, np.ndarray] = {}
        self.calls: list[tuple[str, int, StepContext]] = []
        self.broken: set[int] = set()

    def receive(self, msg: Message, step: StepContext, client: int, row: np.ndarray) -> None:
        self.calls.append(("receive", client, step))
        self.got[client] = np.array(row)

    def compute(self, step: StepContext, client: int) -> None:
        self.calls.append(("compute", client, step))
        st = self.state.edit(client)
        st["rounds"] = st.get("rounds", np.zeros(1, dtype=np.int64)) + 1

    def send(self, msg: Message, step: StepContext, client: int) -> np.ndarray:
        self.calls.append(("send", client, step))
        row = 2 * self.got[client]
        return row * np.nan if client in self.broken else row


def parts(faults: dict | None = None):  # noqa: ANN201
    cfg = parse_config(_merge(TINY, {"faults": faults or {}}))
    dataset = build_federated_dataset(cfg.data, cfg.seed)
    ctx = RunContext(cfg, dataset.layout)
    placement = Placement.balanced(dataset.layout.train_sizes, 1)
    store = ClientStore(dataset, placement.clients_of(0), ctx.device)
    server, client = EchoServer(ctx), EchoClient(ctx, store)
    rank = RankContext(Transport(None, placement), Ledger(), WireFormat(), server, client, store, RankTimes())
    walker = PlanWalker(rank, FaultModel(cfg.faults, cfg.seed))
    return cfg, dataset, server, client, walker


def test_walk_moves_rows_and_tells_each_side_the_step():
    _, _, server, client, walker = parts()
    p = server.protocol
    clients = np.array([1, 3, 4])
    walk = walker.walk(5, "train", (p.value, LOCAL, p.reply), clients)
    assert walk.clients.tolist() == [1, 3, 4] and walk.local.tolist() == [1, 3, 4] and len(walk.seconds) == 3
    np.testing.assert_array_equal(server.total, 2 * np.full(3, 1 + 3 + 4))
    assert [(k, n, s.round, s.stage, s.clients) for k, n, s in server.calls] == [
        ("payload", "value", 5, "train", [1, 3, 4]), ("consume", "reply", 5, "train", [1, 3, 4])]
    assert [(k, c) for k, c, _ in client.calls] == [("receive", 1), ("receive", 3), ("receive", 4), ("compute", 1),
                                                     ("compute", 3), ("compute", 4), ("send", 1), ("send", 3),
                                                     ("send", 4)]
    assert all(s.round == 5 and s.stage == "train" for _, _, s in client.calls)
    assert client.state.get(3, "rounds").tolist() == [1]  # committed: the server accepted client 3
    ledger = walker.ledger.drain()
    assert ledger["bytes"].tolist() == [12] * 6 and ledger["client"].tolist() == [1, 3, 4] * 2


def test_a_rejected_upload_drops_the_client_and_rolls_its_state_back(capsys):
    _, _, server, client, walker = parts()
    p = server.protocol
    client.broken = {3}
    walk = walker.walk(1, "train", (p.value, LOCAL, p.reply, p.value, p.reply), np.array([1, 3]))
    assert walk.clients.tolist() == [1] and walk.rejected == 1
    assert "rejected non-finite reply of client(s) [3]" in capsys.readouterr().err
    consumed = [s.clients for k, _, s in server.calls if k == "consume"]
    assert consumed == [[1], [1]]  # the server never sees client 3's rows; the next message skips it
    assert client.state.get(3, "rounds") is None and client.state.get(1, "rounds").tolist() == [1]


def test_a_plan_ends_where_no_client_is_left():
    _, _, server, client, walker = parts()
    p = server.protocol
    client.broken = {2}
    walk = walker.walk(1, "train", (p.value, LOCAL, p.reply, p.value, LOCAL, p.reply), np.array([2]))
    assert walk.clients.tolist() == [] and [k for k, _, _ in server.calls] == ["payload"]
    assert walker.walk(2, "train", (p.value, LOCAL, p.reply), np.array([], dtype=np.int64)).clients.size == 0
    assert [k for k, _, _ in server.calls] == ["payload"]  # an empty round calls nothing


def test_everyone_steps_reach_the_audience_and_its_state_is_committed():
    _, _, server, client, walker = parts()
    p = server.protocol
    walker.walk(1, "train", (p.everyone_value, EVERYONE_LOCAL, p.value, p.reply), np.array([2]),
                audience=np.array([0, 2, 5]))
    assert sorted(c for k, c, _ in client.calls if k == "compute") == [0, 2, 5]
    assert [s.clients for k, _, s in server.calls] == [[0, 2, 5], [2], [2]]
    assert all(client.state.get(c, "rounds").tolist() == [1] for c in (0, 2, 5))


def test_faults_corrupt_breaks_training_uploads_only():
    _, _, server, client, walker = parts(faults={"corrupt": 1.0})
    p = server.protocol
    assert walker.walk(1, "eval", (p.value, p.reply), np.array([1, 2])).clients.tolist() == [1, 2]
    assert walker.walk(1, "train", (p.value, p.reply), np.array([1, 2])).clients.tolist() == []


def test_recorder_pools_rows_and_writes_a_readable_file(tmp_path):
    cfg, dataset, _, _, walker = parts()
    layout = dataset.layout
    recorder = Recorder(cfg, layout, EvalLayout(("global",), ("test", "val")), tmp_path / "r.h5", 1,
                        np.zeros(layout.num_clients, np.int64))
    rows = np.zeros((layout.num_clients, 2 * len(EVAL_FIELDS)))
    rows[:, 0], rows[:, 1], rows[:, 2] = 10, np.arange(layout.num_clients), 5.0  # test: n, correct, loss sum
    rows[:, 5], rows[:, 6] = 4, 4  # val: n, correct
    recorder.record_round({"round": 1, "train_loss": 0.5, "wall_time_s": 0.1, "sim_time_s": 1.0})
    recorder.record_evaluation(1, rows, 1234, {"extra": 2.0})
    recorder.write("completed", walker.ledger, walker.transport.physical, wait=True)
    res = read_results(tmp_path / "r.h5")
    ev = res.table("eval")
    seen = ~layout.unseen
    correct = np.arange(layout.num_clients)[seen].sum()
    assert ev["global.seen.acc_pooled"][0] == pytest.approx(correct / (10 * seen.sum()))
    assert ev["global.seen.val_acc_pooled"][0] == 1.0 and ev["cum_logical_bytes"][0] == 1234 and ev["extra"][0] == 2
    assert res.table("clients")["global.acc"].tolist() == pytest.approx(np.arange(layout.num_clients) / 10)
    assert res.attrs["status"] == "completed" and "round 1/3" in recorder.progress_line(1)


def test_checkpointer_round_trips_server_and_client_state(tmp_path):
    cfg, dataset, server, client, walker = parts()
    p = server.protocol
    walker.walk(1, "train", (p.value, LOCAL, p.reply), np.array([1, 4]))
    recorder = Recorder(cfg, dataset.layout, EvalLayout(("global",), ("test",)), tmp_path / "r.h5", 1,
                        np.zeros(dataset.layout.num_clients, np.int64))
    recorder.record_round({"round": 1, "train_loss": 0.5, "wall_time_s": 0.1})
    out = tmp_path / "r.h5"
    checkpointer = Checkpointer(walker.transport, RankTimes(), out, keep=2)
    checkpointer.take(1, server, client.state)
    recorder.write("running", walker.ledger, walker.transport.physical, checkpointer.latest, wait=True)
    _, _, fresh_server, fresh_client, _ = parts()

    def restore(cfg, server, state, clients):  # noqa: ANN001, ANN202
        return Checkpointer(walker.transport, RankTimes(), out, keep=2).load(out, cfg, server, state, clients)

    round_, saved = restore(cfg, fresh_server, fresh_client.state, np.arange(10))
    assert round_ == 1 and saved.table("rounds")["round"].tolist() == [1]
    np.testing.assert_array_equal(fresh_server.total, server.total)
    assert fresh_client.state.export_states().keys() == {1, 4}
    assert fresh_client.state.get(4, "rounds").tolist() == [1]
    restricted = parts()[3]
    restore(cfg, None, restricted.state, np.array([4]))
    assert restricted.state.clients() == [4]  # a worker takes only the clients it hosts now
    with pytest.raises(ConfigError, match="config differs"):
        restore(parse_config({**TINY, "seed": 8}), fresh_server, None, np.arange(10))


@pytest.mark.parametrize(("fields", "says"), [
    ({"direction": "up", "broadcast": True}, "only down messages can be broadcast"),
    ({"direction": "up", "everyone": True}, "only down messages can reach every client"),
    ({"direction": "down", "update": True}, "an update is a float upload"),
    ({"direction": "up", "numel": -1}, "negative size"),
    ({"direction": "up", "dtype": "int64", "summed": "samples"}, "only float uploads can be summed"),
    ({"direction": "up", "groups": 2}, "groups are sums side by side, at least one"),
])
def test_a_message_an_algorithm_cannot_mean_is_refused_when_declared(fields, says):
    """An algorithm's message declarations are checked when made, each refusal naming the message."""
    with pytest.raises(ValueError, match=f"^message m: {says}$"):
        Message("m", **{"numel": 4, **fields})


def test_a_plan_step_that_reads_what_no_earlier_step_set_is_an_algorithm_bug():
    with pytest.raises(RuntimeError, match="^the mean is missing: the plan's steps came out of order$"):
        require(None, "the mean")
    assert require(0, "zero") == 0
