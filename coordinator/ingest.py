"""Ingest workers: several processes split the devices' reports over an MQTT 5 shared subscription.

The broker hands each report message (or chunk) on ``$share/<group>/fedge/v1/<fleet>/report/+`` to exactly
one of the group's connected workers. A worker does the part of ingest that grows with the traffic and needs
no round state: it holds the broker connection, checks the topic and the sender, refuses what is oversized
for the device's plan or malformed (the full structural decode of :func:`edge.protocol.wire.decode`), and
appends what passes to the *inbox*, a SQLite file (WAL) beside the coordinator's state. The coordinator (the
one leader) takes the inbox in order and feeds each message to its round machine exactly as if it had come
from the broker; the machine admits, aggregates (streaming) and acks after its own durable write.

Why nothing is lost or counted twice, whatever worker dies when:

- A worker never acks a report: only the leader does, after the report is in the leader's state. A message
  that a dying worker held (in memory, in its broker session, or written to the inbox without commit) is
  never acked, so the device resends it (:mod:`edge.protocol.agent` retries with backoff until it gets an
  ack), and the broker gives the resend to a live worker.
- Counting is the leader's: its round machine counts a device's report once per task and answers a second
  delivery with ``duplicate`` (restored from its state across its own restarts). The inbox may therefore
  hold a message twice (a resend, or a row the leader processed but had not yet deleted when it died).
- The leader deletes inbox rows only after the records they produced are written, so a leader crash
  replays them; a replay is a duplicate delivery, which the machine answers and does not count.

Chunks of one message may land on different workers; they are forwarded as they are and the leader's
reassembler joins them, so reassembly keeps its single owner and its limits.

What a worker refuses becomes a row too (``reason``), so the leader records it against the device (strikes,
quarantine) as it does for what it receives itself.
"""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from edge.protocol import wire
from edge.protocol.wire import WireError
from edge.runtime.mqtt import BrokerAddress, MqttLink

log = logging.getLogger("fedge.ingest")

GROUP = "fedge-ingest"
NO_PLAN_MAX_BYTES = 256 * 1024  # a device with no plan has nothing large to send (as the round machine's limit)

# The inbox carries report chunks of up to 256 KiB as blobs, and every one is written once by a worker, then
# read and deleted by the leader. With SQLite's defaults (4 KiB pages; secure_delete on, as Debian builds it)
# a chunk is a chain of 64 overflow pages and deleting it writes them all again as zeros: the leader spent
# about a seventh of its CPU there (docs/operations.md). 64 KiB pages make it 4 pages, and FAST zeroes a
# deleted row only where that costs no extra write, so a freed chunk's pages are not rewritten
# (benchmarks/inbox.py measures both against the defaults). Deleted payloads then stay in free pages until
# reused, as the report logs' unlinked files stay on disk: the coordinator's disk is trusted (docs/security.md).
PAGE_SIZE = 65536
SECURE_DELETE = "FAST"

SCHEMA = """
CREATE TABLE IF NOT EXISTS inbox (id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, payload BLOB,
                                  reason TEXT, strike INTEGER, worker TEXT, ts REAL);
CREATE TABLE IF NOT EXISTS limits (device_id TEXT PRIMARY KEY, max_bytes INTEGER NOT NULL);
"""


def shared_subscription(fleet: str, group: str = GROUP) -> str:
    return f"$share/{group}/" + wire.topic(fleet, "report", "+")


def inbox_path(state_path: str | Path) -> str:
    return str(state_path) + ".inbox"


@dataclass
class Row:
    id: int
    topic: str
    payload: bytes | None
    reason: str | None
    strike: bool


class Inbox:
    """The spool between workers and the leader. Writers batch (one transaction per pass of their network
    loop); the leader reads in id order, which is each worker's arrival order."""

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30)
        self.db.execute(f"PRAGMA page_size={PAGE_SIZE}")  # before WAL: a new inbox only (a spool, so soon true)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(f"PRAGMA secure_delete={SECURE_DELETE}")  # per connection
        self.db.executescript(SCHEMA)
        self._limits: dict[str, int] = {}
        self._limits_read = -1e18

    # ---- workers
    def append(self, rows: list[tuple[str, bytes | None, str | None, int, str, float]]) -> None:
        """Rows of (topic, payload, reason, strike, worker, ts): a payload to feed, or a reason it was refused."""
        if rows:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.executemany("INSERT INTO inbox (topic, payload, reason, strike, worker, ts) "
                                    "VALUES (?,?,?,?,?,?)", rows)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def limit(self, device_id: str, now: float) -> int:
        """The largest message this device's latest plan lets it send (re-read at most once a second)."""
        if now - self._limits_read > 1.0 or (device_id not in self._limits and now - self._limits_read > 0.1):
            self._limits = dict(self.db.execute("SELECT device_id, max_bytes FROM limits"))
            self._limits_read = now
        return self._limits.get(device_id, 0)

    # ---- the leader
    def set_limits(self, limits: dict[str, int]) -> None:
        if limits:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany("INSERT OR REPLACE INTO limits VALUES (?, ?)", list(limits.items()))
            self.db.execute("COMMIT")

    def take(self, after: int, limit: int = 256) -> list[Row]:
        return [Row(*r) for r in self.db.execute(
            "SELECT id, topic, payload, reason, strike FROM inbox WHERE id > ? ORDER BY id LIMIT ?", (after, limit))]

    def delete_through(self, last_id: int) -> None:
        self.db.execute("DELETE FROM inbox WHERE id <= ?", (last_id,))

    def pending(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM inbox").fetchone()[0]

    def close(self) -> None:
        self.db.close()


class IngestWorker:
    """One worker: a shared-subscription MQTT 5 client that checks reports and spools them to the inbox."""

    def __init__(self, broker: BrokerAddress, fleet: str, inbox: str | Path, *, name: str = "",
                 group: str = GROUP):
        self.fleet = fleet
        self.name = name or f"w{uuid.uuid4().hex[:6]}"
        self.inbox = Inbox(inbox)
        self._rows: list[tuple[str, bytes | None, str | None, int, str, float]] = []
        self.received = self.spooled = self.refused = 0
        self.on_receive = None  # tests: called with (topic, payload) first; returning False drops the message
        # clean session, no expiry: a dead worker's queue dies with it; what it held comes back as resends
        self.link = MqttLink(broker, f"fedge-ingest-{fleet}-{self.name}", self,
                             subscriptions=[shared_subscription(fleet, group)], clean_session=True,
                             keepalive=30, tick_s=0.5, mqtt5=True, max_batch=512)
        self.done = threading.Event()  # set when it stopped by itself: ``failed`` says why
        self.failed: str | None = None

    def on_connected(self, link, now):
        log.info("ingest worker %s connected to %s", self.name, link.broker.url())

    def on_disconnected(self, link, now):
        pass

    def on_tick(self, link, now):
        pass

    def on_message(self, link, topic: str, payload: bytes, now: float) -> None:
        self.received += 1
        if self.on_receive is not None and self.on_receive(topic, payload) is False:
            return
        try:
            fleet, kind, ident = wire.parse_topic(topic)
        except WireError as e:
            log.error("ingest %s: dropped message on %r: %s", self.name, topic[:200], e)
            return
        if fleet != self.fleet or kind != "report" or not wire.ID_RE.match(ident):
            log.error("ingest %s: dropped message on %r: not a report topic", self.name, topic[:200])
            return
        limit = self.inbox.limit(ident, now)
        try:
            msg = wire.decode(payload, max_bytes=limit or NO_PLAN_MAX_BYTES, expect=("report", "chunk"),
                              finite_updates=False)
            if isinstance(msg, wire.Report) and msg.device_id != ident:
                raise WireError(f"device {msg.device_id!r} wrote on the topic of {ident!r}")
        except WireError as e:
            self.refused += 1
            # too large for a device with no plan (a straggler from before a restart, say): no strike, as
            # the round machine judges what it receives itself
            strike = not (isinstance(e, wire.TooLarge) and not limit)
            log.error("ingest %s: dropped report from %s: %s", self.name, ident, e)
            self._rows.append((topic, None, str(e)[:200], int(strike), self.name, now))
            return
        self._rows.append((topic, payload, None, 0, self.name, now))

    def on_pass_end(self, link, now) -> None:
        rows, self._rows = self._rows, []
        if rows and self.failed is None:
            try:
                self.inbox.append(rows)
            except (sqlite3.Error, OSError) as e:  # a full disk, say: die as a crashed worker does, and say so
                self.failed = f"{type(e).__name__}: {e}"
                log.error("ingest %s: cannot write the inbox (%s); stopping. The %d messages it held were not acked: "
                          "their devices resend them, to a live worker", self.name, self.failed, len(rows))
                self.done.set()
                threading.Thread(target=self.kill, name=f"ingest-{self.name}-stop", daemon=True).start()
                return
            self.spooled += sum(1 for r in rows if r[1] is not None)

    def start(self) -> "IngestWorker":
        self.link.start()
        return self

    def stop(self) -> None:
        self.link.stop()
        self.on_pass_end(self.link, time.time())
        self.inbox.close()

    def kill(self) -> None:
        """Die as a crashed process would: no DISCONNECT, nothing more written."""
        self.link.kill()
        self._rows = []
