"""Ingest workers on an MQTT 5 shared subscription (coordinator/ingest.py): every report counted exactly once,
including when a worker dies mid-round holding reports the broker already gave it."""
from __future__ import annotations

import os
import threading
from collections import Counter

import numpy as np
import pytest

from coordinator.broker import Mosquitto, mosquitto_binary
from coordinator.datasets import digits_federated
from coordinator.inprocess import Loop
from coordinator.ingest import NO_PLAN_MAX_BYTES, Inbox, IngestWorker, inbox_path, shared_subscription
from coordinator.simulate import SimConfig, build_coordinator, prepare, start_ingest_workers
from coordinator.strategies.fedavg import FedAvg
from edge.model import mlp
from edge.protocol import wire
from edge.runtime.mqtt import BrokerAddress

from test_mqtt_integration import Fleet, wait_until  # noqa: E402


def _report(device: str, n: int = 10, rows: int = 4) -> bytes:
    x = np.ones((rows, 3), np.float32)
    return wire.encode(wire.Report(task_id="rabc-1", device_id=device, n_samples=n, metrics={"train_loss": 1.0},
                                   tensors={"w": wire.TensorUpdate(x.shape, x)}))


def test_worker_spools_what_passes_and_a_refusal_with_its_reason(tmp_path):
    path = inbox_path(tmp_path / "state.sqlite")
    inbox = Inbox(path)
    inbox.set_limits({"d1": 4096})
    w = IngestWorker(BrokerAddress(), "f", path, name="t")  # never connected: fed by hand
    topic = wire.topic("f", "report", "d1")
    good = _report("d1")
    w.on_message(w.link, topic, good, 1.0)
    w.on_message(w.link, topic, _report("d1", rows=1000), 1.0)  # 12 kB: beyond d1's plan
    w.on_message(w.link, topic, _report("d2"), 1.0)  # d2 writing as d1
    w.on_message(w.link, topic, b"\x81\xa1v\x01", 1.0)  # malformed
    w.on_message(w.link, wire.topic("f", "checkin", "d1"), good, 1.0)  # not a report topic: logged, no row
    w.on_message(w.link, wire.topic("g", "report", "d1"), good, 1.0)  # another fleet
    assert inbox.take(0) == []  # nothing is visible before the worker's pass ends (one transaction per pass)
    w.on_pass_end(w.link, 1.0)
    rows = inbox.take(0)
    assert [r.payload for r in rows] == [good, None, None, None]
    assert all(r.strike for r in rows[1:]) and not rows[0].strike
    assert "too large" in rows[1].reason.lower() or "exceeds" in rows[1].reason.lower(), rows[1].reason
    assert "d2" in rows[2].reason
    assert (w.spooled, w.refused) == (1, 3)
    # a device with no plan may send a small message (the leader answers it: unknown task, not selected)
    w.on_message(w.link, wire.topic("f", "report", "d9"), _report("d9"), 2.0)
    w.on_message(w.link, wire.topic("f", "report", "d9"), _report("d9", rows=NO_PLAN_MAX_BYTES // 12 + 10), 2.0)
    w.on_pass_end(w.link, 2.0)
    late = inbox.take(rows[-1].id)
    assert late[0].payload is not None and late[1].payload is None and not late[1].strike  # too large, no plan
    inbox.delete_through(late[0].id)
    assert [r.id for r in inbox.take(0)] == [late[1].id]
    assert shared_subscription("f") == "$share/fedge-ingest/fedge/v1/f/report/+"


def test_a_worker_that_cannot_write_its_inbox_stops_and_says_so(tmp_path, caplog):
    """A full disk under the inbox: the worker logs one line, writes nothing more and stops as a crashed worker
    would (what it held was never acked, so its devices resend it to a live worker); `fedge ingest` then exits 1.
    Before, the exception ended the link's thread silently and the process went on looking alive."""
    import sqlite3
    w = IngestWorker(BrokerAddress(), "f", inbox_path(tmp_path / "state.sqlite"), name="t")
    inbox = Inbox(inbox_path(tmp_path / "state.sqlite"))
    inbox.set_limits({"d1": 4096})

    def full(rows):
        raise sqlite3.OperationalError("database or disk is full")

    w.inbox.append = full
    w.on_message(w.link, wire.topic("f", "report", "d1"), _report("d1"), 1.0)
    with caplog.at_level("ERROR", logger="fedge.ingest"):
        w.on_pass_end(w.link, 1.0)
    assert w.done.wait(5) and "disk is full" in w.failed
    assert [r.getMessage() for r in caplog.records if "cannot write the inbox" in r.getMessage()] != []
    assert w.spooled == 0 and inbox.take(0) == []
    w.on_message(w.link, wire.topic("f", "report", "d1"), _report("d1"), 2.0)
    w.on_pass_end(w.link, 2.0)  # nothing more is tried
    assert len([r for r in caplog.records if "cannot write the inbox" in r.getMessage()]) == 1


def test_inbox_frees_a_chunk_without_rewriting_its_pages(tmp_path):
    """The leader deletes every chunk it takes. With SQLite's defaults (Debian builds secure_delete on) that
    wrote each freed overflow page again, as zeros, into the WAL: a seventh of the leader's CPU. Both ends'
    connections must run with 64 KiB pages and FAST, and a delete must write far fewer pages than it frees."""
    path = inbox_path(tmp_path / "state.sqlite")
    leader = Inbox(path)
    worker = IngestWorker(BrokerAddress(), "f", path, name="t").inbox  # a worker's own connection
    for c in (leader.db, worker.db):
        assert c.execute("PRAGMA page_size").fetchone()[0] == 65536
        assert c.execute("PRAGMA secure_delete").fetchone()[0] == 2  # FAST
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    chunk = os.urandom(256 * 1024)
    worker.append([(wire.topic("f", "report", "d1"), chunk, None, 0, "t", 0.0)] * 8)
    rows = leader.take(0)
    assert [r.payload for r in rows] == [chunk] * 8
    leader.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    wal = path + "-wal"
    leader.delete_through(rows[-1].id)
    frames = (os.path.getsize(wal) - 32) // (65536 + 24)
    assert 0 < frames < 8, frames  # 8 chunks of 4+ overflow pages each were freed, none rewritten
    assert leader.take(0) == []


mqtt = pytest.mark.skipif(mosquitto_binary() is None and not os.environ.get("CI"), reason="mosquitto not installed")


@mqtt
@pytest.mark.mosquitto
@pytest.mark.slow
def test_two_workers_one_killed_mid_round_every_report_counted_once(tmp_path):
    """Worker w0 dies (no DISCONNECT) at the first report the broker gives it, with that report and any after
    it acked to the broker but never spooled. The devices get no ack for those, resend, and w1 takes them. The
    run's model equals the in-process loop's bit for bit: a report lost or counted twice would change it."""
    with Mosquitto() as b:
        cfg = SimConfig(devices=6, clients_per_round=6, over_selection=1.0, rounds=2, seed=5, hidden=(16,),
                        broker=b.url, workdir=str(tmp_path / "w"), fleet="share", ingest_workers=2)
        specs, data = prepare(cfg)
        rows: list[dict] = []
        coord = build_coordinator(cfg, b.url, (data.x_test, data.y_test), rows.append)
        assert coord.inbox is not None and not any("/report/" in t for t in coord.link.subscriptions)
        coord.start()
        assert coord.link.connected.wait(10)
        w0, w1 = start_ingest_workers(2, coord)
        dead = threading.Event()
        lost: list[str] = []

        def crash(topic, payload):
            if not dead.is_set():
                dead.set()
                threading.Thread(target=w0.kill).start()
            lost.append(topic)
            return False  # held in a dying process: never written

        w0.on_receive = crash
        fleet = Fleet(specs, b.url)
        try:
            assert coord.wait(120) and coord.error is None
            # the last round's acks go out as the run ends: let them arrive before the devices go
            wait_until(lambda: len({(a.task_id, a.device_id) for a in fleet.acks if a.status == "accepted"}) >= 12,
                       10, "the last acks")
        finally:
            fleet.stop()
            w1.stop()
            coord.stop()
    assert dead.is_set() and lost, "w0 never got a report: the test did not exercise a worker's death"
    assert w1.spooled >= 12 - 0 and len(rows) == 2
    assert [r["reports"] for r in rows] == [6, 6]
    accepted = Counter((a.task_id, a.device_id) for a in fleet.acks if a.status == "accepted")
    assert len(accepted) == 12 and set(accepted.values()) == {1}, accepted
    data = digits_federated(6, cfg.alpha, cfg.seed)
    loop = Loop(FedAvg(spec=mlp([64, 16, 10]), lr=cfg.lr, epochs=cfg.epochs, batch_size=cfg.batch_size),
                data.shards, seed=cfg.seed, ids=[f"d{i:04d}" for i in range(6)], threads=1)
    for _ in range(2):
        loop.round_as_coordinator(6, 1.0)
    for k, w in loop.state.weights.items():
        assert np.array_equal(w, coord.state.weights[k]), (k, float(np.abs(w - coord.state.weights[k]).max()))
    loop.close()
