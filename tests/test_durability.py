"""Issue #30, from inside the rules: an ack follows the durable write even when the write fails (a full disk),
one coordinator per state even when its ``.lock`` file is deleted, and a committed round's record is final.

The daemon tests drive a real :class:`Coordinator` (its store, its ingest inbox, its group commit) through its
link callbacks with a fake link in place of MQTT, and device agents that train for real (tests/conftest.py)."""
from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SPEC, make_bus
from coordinator import store as store_mod
from coordinator.daemon import Coordinator, CoordinatorConfig, ProgramCatalog
from coordinator.ingest import Inbox, inbox_path
from coordinator.rounds import RoundConfig
from coordinator.status import coordinator_running
from coordinator.store import StateInUse, Store
from coordinator.strategies.fedavg import FedAvg
from edge.protocol import wire
from edge.runtime.mqtt import BrokerAddress

ROOT = Path(__file__).resolve().parents[1]
FULL = "database or disk is full"  # what SQLite raises on ENOSPC (SQLITE_FULL)


class FakeLink:
    """Records what the daemon publishes; at each ack "accepted" or "duplicate" it reads the state file on its
    own connection and fails the test if the report is not there: an ack must follow the durable write."""

    def __init__(self, state_path: str):
        self.sent: list[tuple[str, bytes]] = []
        self.acks: list[wire.Ack] = []
        self.unwritten: list[wire.Ack] = []  # acks sent before their report was on disk (the daemon would
        self.state_path = state_path         # swallow an assertion raised here, as it logs a failed pass)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        if "/ack/" in topic:
            ack = wire.decode(payload)
            self.acks.append(ack)
            if ack.status in ("accepted", "duplicate") and not _durable(self.state_path, ack.task_id,
                                                                        ack.device_id):
                self.unwritten.append(ack)
        self.sent.append((topic, payload))

    def in_flight(self, stale_s: float = 60.0) -> int:
        return 0

    def call_soon(self, fn) -> None:
        fn()

    def stop(self) -> None:
        pass


def _durable(path: str, task_id: str, device_id: str) -> bool:
    db = sqlite3.connect(path)
    try:
        row = db.execute("SELECT 1 FROM reports WHERE task_id=? AND device_id=?", (task_id, device_id)).fetchone()
        done = db.execute("SELECT 1 FROM rounds WHERE task_id=? AND status='committed'", (task_id,)).fetchone()
        return row is not None or done is not None
    finally:
        db.close()


class FullDisk:
    """A store connection whose next writes of report rows fail as SQLite fails on a full disk (``armed``)."""

    def __init__(self, db):
        self.db, self.armed, self.failed = db, False, 0

    def executemany(self, sql, rows):
        if self.armed and "INTO reports" in sql:
            self.failed += 1
            raise sqlite3.OperationalError(FULL)
        return self.db.executemany(sql, rows)

    def __getattr__(self, name):
        return getattr(self.db, name)

    def __enter__(self):
        return self.db.__enter__()

    def __exit__(self, *exc):
        return self.db.__exit__(*exc)


def _coordinator(tmp_path, ingest: str, durable_sums: bool) -> tuple[Coordinator, FakeLink]:
    rc = RoundConfig(rounds=1, clients_per_round=4, over_selection=1.0, min_reports=4, round_timeout_s=1e6,
                     selection_timeout_s=1e6, seed=0, durable_sums=durable_sums)
    path = str(tmp_path / "state.sqlite")
    coord = Coordinator(CoordinatorConfig(rc, BrokerAddress(), path, ingest=ingest),
                        FedAvg(spec=SPEC, lr=0.1, epochs=1, batch_size=10), programs=ProgramCatalog())
    coord.link = link = FakeLink(path)
    return coord, link


class Harness:
    """Four device agents and a coordinator, delivering messages one pass of the network loop at a time."""

    def __init__(self, tmp_path, ingest: str):
        self.bus = make_bus(tmp_path, 4, rounds=1, per_round=4)  # its agents and data (its machine is unused)
        self.ingest = ingest
        self.inbox = Inbox(inbox_path(tmp_path / "state.sqlite")) if ingest == "shared" else None  # a worker's
        self.now = 1000.0

    def to_devices(self, link: FakeLink) -> None:
        sent, link.sent = link.sent, []
        for topic, payload in sent:
            dev = topic.split("/")[4]
            if dev in self.bus.agents:
                self.bus._device_actions(dev, self.bus.agents[dev].received(topic, payload, self.now))

    def deliver(self, coord: Coordinator, msgs: list[tuple[str, bytes]]) -> None:
        """One pass: these messages in (through the broker, or spooled by an ingest worker), then the pass's end."""
        for topic, payload in msgs:
            if self.inbox is not None and "/report/" in topic:
                self.inbox.append([(topic, payload, None, 0, "w0", self.now)])
            else:
                coord.on_message(coord.link, topic, payload, self.now)
        coord.on_pass_end(coord.link, self.now)

    def reports_out(self, coord: Coordinator) -> list[tuple[str, bytes]]:
        """Check in, open the round, send the plans: the reports the devices send back (not yet delivered)."""
        for d, ag in self.bus.agents.items():
            self.bus._device_actions(d, ag.connected(self.now))
        msgs, self.bus.queue = self.bus.queue, []
        self.deliver(coord, msgs)
        coord.on_tick(coord.link, self.now)
        coord.on_pass_end(coord.link, self.now)
        assert coord.machine.open is not None
        self.to_devices(coord.link)
        reports = [m for m in self.bus.queue if "/report/" in m[0]]
        assert len(reports) == 4
        self.bus.queue = []
        return reports


@pytest.mark.parametrize("ingest,durable_sums,where", [("direct", True, "rows"), ("direct", False, "rows"),
                                                       ("direct", True, "sums"), ("shared", True, "rows"),
                                                       ("shared", False, "rows")])
def test_a_failed_write_acks_nothing_and_loses_nothing(tmp_path, monkeypatch, ingest, durable_sums, where):
    """The measured attack: state on a full disk, "failed to write its state", then an ack 2 ms later for a
    report that was never written, lost at the restart. Now the batch that fails acks nothing, the daemon
    receives, writes and publishes nothing more (a resend would have been acked as a duplicate), and after a
    restart the report is accepted (replayed from the ingest inbox, or resent by its device) and only then
    acked. FakeLink checks at every ack that its report is on disk."""
    h = Harness(tmp_path, ingest)
    coord, link = _coordinator(tmp_path, ingest, durable_sums)
    reports = h.reports_out(coord)
    h.deliver(coord, reports[:2])  # two written and acked
    assert sorted(a.device_id for a in link.acks if a.status == "accepted") == sorted(
        t.rsplit("/", 1)[1] for t, _ in reports[:2])
    if where == "rows":
        coord.store.db = full = FullDisk(coord.store.db)
        full.armed = True
    else:  # the partial sums' snapshot: its slot file cannot be written
        def pwrite(*_a):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(store_mod.os, "pwrite", pwrite)
    h.deliver(coord, reports[2:3])
    assert coord.error is not None and coord.done.is_set()
    assert len(link.acks) == 2, "an ack went out for a report whose write failed"
    # the next passes (the measured ack came 2 ms later), a resend of the failed report, the last report
    sent = len(link.sent)
    h.deliver(coord, reports[2:3])
    h.deliver(coord, reports[3:])
    coord.on_tick(coord.link, h.now + 1)
    coord.on_pass_end(coord.link, h.now + 1)
    assert link.unwritten == [], "an ack went out for a report that is not on disk"
    assert len(link.sent) == sent and len(link.acks) == 2, "a halted coordinator published"
    monkeypatch.undo()
    if where == "rows":
        full.armed = False  # the disk has room again: stop() must still write nothing the machine counted
    coord.stop()

    # restart: the round re-opens with the two reports written; the others come again and are accepted
    coord2, link2 = _coordinator(tmp_path, ingest, durable_sums)
    assert coord2.machine.open is not None and len(coord2.machine.open.accepted) == 2
    if ingest == "shared":  # the inbox rows the failed pass took were never deleted: they are replayed
        h.deliver(coord2, [])
    else:  # the devices resend what went unacked
        h.deliver(coord2, reports[:1])  # a resend of a report acked before the failure: a duplicate
        assert [(a.device_id, a.status) for a in link2.acks] == [(reports[0][0].rsplit("/", 1)[1], "duplicate")]
        h.deliver(coord2, reports[2:])
    assert coord2.done.is_set() and coord2.error is None  # the round committed with all four
    assert link.unwritten == link2.unwritten == []
    summary = coord2.store.summaries()[-1]
    acked = {a.device_id for a in link.acks + link2.acks if a.status == "accepted"}
    assert acked == {t.rsplit("/", 1)[1] for t, _ in reports} == set(summary["accepted"])
    coord2.stop()
    if h.inbox is not None:
        h.inbox.close()


def test_a_failed_commit_acks_nothing_and_the_round_survives(tmp_path):
    """The last report's batch carries the commit: if it fails, neither its ack nor the commit's goes out, and
    the restarted coordinator holds the round open with what was written before."""
    h = Harness(tmp_path, "direct")
    coord, link = _coordinator(tmp_path, "direct", True)
    reports = h.reports_out(coord)
    h.deliver(coord, reports[:3])
    real = coord.store._row

    def row(what, d):
        if what == "commit":
            raise sqlite3.OperationalError(FULL)
        return real(what, d)
    coord.store._row = row
    h.deliver(coord, reports[3:])
    assert coord.error is not None and len(link.acks) == 3
    coord.stop()
    coord2, link2 = _coordinator(tmp_path, "direct", True)
    assert coord2.store.summaries() == [] and len(coord2.machine.open.accepted) == 3
    h.deliver(coord2, reports[3:])
    assert coord2.done.is_set() and [a.status for a in link2.acks] == ["accepted"]
    assert link.unwritten == link2.unwritten == []
    coord2.stop()


def test_deleting_the_lock_file_does_not_free_the_state(tmp_path):
    """The measured attack: ``.lock`` deleted under a running coordinator, a second one started on the same
    state, both ran. The lock is held on the state itself (its reports directory), not on that file."""
    path = tmp_path / "s.sqlite"
    first = Store(path, lock=True)
    assert coordinator_running(path) == os.getpid()
    os.unlink(str(path) + ".lock")
    with pytest.raises(StateInUse, match="in use by another coordinator"):
        Store(path, lock=True)
    assert coordinator_running(path) == -1  # held, though nothing names the holder now
    # another process too (flock is per open file, so this one holds against itself as well)
    code = ("import sys; from coordinator.store import Store, StateInUse\n"
            "try:\n    Store(sys.argv[1], lock=True)\nexcept StateInUse as e:\n    print(e); sys.exit(2)\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "in use by another coordinator" in r.stdout, r.stdout + r.stderr
    first.close()
    assert coordinator_running(path) is None
    Store(path, lock=True).close()  # free once the first is gone


def test_a_second_coordinator_exits_with_one_line_and_status_2(tmp_path):
    path = tmp_path / "s.sqlite"
    first = Store(path, lock=True)
    os.unlink(str(path) + ".lock")
    code = ("import sys; from coordinator.cli import main\n"
            "sys.argv = ['fedge', 'coordinator', '--state', sys.argv[1]]\nsys.exit(main())\n")
    try:
        r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    finally:
        first.close()
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "in use by another coordinator" in lines[0], r.stderr


def _commit(st: Store, task: str, round_: int = 1) -> None:
    state = FedAvg(spec=SPEC).init(0)
    state.round = round_
    st.apply("commit", {"round": round_, "task_id": task, "state": state, "summary": {"round": round_}})


def _open(st: Store, task: str, round_: int = 1, attempt: int = 1) -> None:
    st.apply("open", {"round": round_, "attempt": attempt, "task_id": task, "selected": ["d0"],
                      "deadline": 100.0, "opened_at": 0.0})


def test_a_committed_round_is_never_rewritten(tmp_path):
    """The measured attack: a second coordinator wrote "abandoned" over a committed round's record. The store
    refuses to change a committed round (a trigger), to re-open its task id, or to commit its round again."""
    st = Store(tmp_path / "s.sqlite")
    _open(st, "run-r1a1")
    _commit(st, "run-r1a1")
    for what, d in (("abandon", {"round": 1, "attempt": 1, "task_id": "run-r1a1"}),
                    ("open", {"round": 1, "attempt": 1, "task_id": "run-r1a1", "selected": [], "deadline": 1.0,
                              "opened_at": 0.0})):
        with pytest.raises(sqlite3.IntegrityError, match="a committed round is final"):
            st.apply(what, d)
    with pytest.raises(sqlite3.IntegrityError, match="a committed round is final"):
        _commit(st, "run-r1a1")
    with pytest.raises(sqlite3.IntegrityError, match="a committed round is final"):
        st.db.execute("UPDATE rounds SET status='abandoned' WHERE task_id='run-r1a1'")
    _open(st, "run-r1a2", attempt=2)  # another attempt at a committed round cannot commit it again
    with pytest.raises(sqlite3.IntegrityError):
        _commit(st, "run-r1a2")
    st.apply("abandon", {"round": 1, "attempt": 2, "task_id": "run-r1a2"})  # an open round may be abandoned
    st.close()
    st = Store(tmp_path / "s.sqlite")  # the rule holds in a state file opened again
    assert [s["round"] for s in st.summaries()] == [1] and st.abandoned_attempts(1) == 1
    with pytest.raises(sqlite3.IntegrityError):
        st.apply("abandon", {"round": 1, "attempt": 1, "task_id": "run-r1a1"})
    st.close()


def test_an_abandoned_attempt_may_be_opened_again(tmp_path):
    """Only committed rounds are final: a restart after an abandoned attempt may open its task id again."""
    st = Store(tmp_path / "s.sqlite")
    _open(st, "run-r1a1")
    st.apply("abandon", {"round": 1, "attempt": 1, "task_id": "run-r1a1"})
    _open(st, "run-r1a1")
    assert st.open_round()[0]["task_id"] == "run-r1a1"
    _commit(st, "run-r1a1")
    assert [s["round"] for s in st.summaries()] == [1]
    st.close()
