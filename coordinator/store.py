"""Durable coordinator state in SQLite (WAL): devices, rounds, accepted reports, committed global state.

A round commits in one transaction (new state in, the round's reports out), so a coordinator killed with
SIGKILL restarts from the last committed round together with the open round's accepted reports.

With durable sums (coordinator/rounds.py, RoundConfig.durable_sums) an accepted report is only a row (device,
n, norm), and the round's partial sums are written once per batch: a batch of reports costs one accumulator's
bytes, whatever their number. The snapshot goes to one of two slot files beside the database
(``<task>.sums0``, ``<task>.sums1``), always the one the table ``sums`` does not point at, and is flushed before
the batch's transaction points the table at it (with its length), so a crash at any moment leaves the table
pointing at a whole snapshot that matches the committed rows. Through SQLite the same 1.6 MB cost 4 to 5 ms of
CPU a batch (WAL frames with their checksums, the checkpoint's second copy, the old blob's pages zeroed by
Debian's secure_delete); a pwrite costs under 1 ms.

Otherwise, report payloads (up to megabytes each) are appended to one log file per task beside the database, and
the table holds only their place in it: a blob in SQLite is written twice (WAL, then checkpoint) and its
deletion walks every page, which capped ingest near 100 reports/s for 0.8 MB reports (measured by
benchmarks/fedavg_mqtt.py), and a file per report cost a create, a write and a rename each. Writes come in
batches (:meth:`Store.apply_batch`, one per pass of the daemon's network loop): the batch's payloads are
appended and flushed first, then one transaction indexes them, so a row always points at bytes that are
there, and the daemon acks a report only after its batch is written (group commit); a batch that raises has
written no row (its transaction rolls back) and the daemon then acks none of it (coordinator/daemon.py halts).
A committed round's row is final (the trigger ``committed_rounds_are_final``). With ``fsync`` the
logs and sums slots are fsynced (with their directory when one is created) and SQLite runs
``synchronous=FULL``, which survives a power cut; without (the default),
like WAL with synchronous=NORMAL, a batch survives a process crash (the coordinator's failure mode).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

from .strategies.base import ServerState

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS devices (device_id TEXT PRIMARY KEY, caps TEXT, programs TEXT, n INTEGER,
                                    online INTEGER, updated REAL, available INTEGER DEFAULT 1,
                                    quarantined_until REAL DEFAULT 0, quarantines INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS rejections (device_id TEXT, what TEXT, count INTEGER, strikes INTEGER, last_reason TEXT,
                                       last_ts REAL, PRIMARY KEY (device_id, what));
CREATE TABLE IF NOT EXISTS state (round INTEGER PRIMARY KEY, blob BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (round INTEGER, attempt INTEGER, task_id TEXT PRIMARY KEY, selected TEXT,
                                   deadline REAL, opened_at REAL, status TEXT, summary TEXT);
CREATE TABLE IF NOT EXISTS reports (task_id TEXT, device_id TEXT, n INTEGER, file TEXT, off INTEGER, len INTEGER,
                                    PRIMARY KEY (task_id, device_id));
CREATE TABLE IF NOT EXISTS metrics (round INTEGER PRIMARY KEY, data TEXT);
CREATE TABLE IF NOT EXISTS sums (task_id TEXT PRIMARY KEY, blob BLOB NOT NULL);
CREATE TRIGGER IF NOT EXISTS committed_rounds_are_final BEFORE UPDATE ON rounds WHEN OLD.status = 'committed'
BEGIN SELECT RAISE(ABORT, 'a committed round is final: its record is never rewritten'); END;
"""


_OWN_FILE = re.compile(r"\.(log|sums[01])$")  # what a task's files beside the database end with
SPARE_LOG = "spare.log"  # a closed task's report log, kept for the next task's (Store._forget)
SPARE_LOG_MAX_BYTES = 64 << 20  # a larger one (a round of many reports) is removed: no idle file holds more disk


class StateInUse(RuntimeError):
    """Another coordinator holds this state file."""


class OtherRun(RuntimeError):
    """The state file holds another run (strategy, model, data or seed differ)."""


class BadState(RuntimeError):
    """The state file cannot be resumed: not SQLite, damaged or truncated, or rows of the run are missing (a
    committed round without its model, say). Refused rather than started afresh, which would forget the run."""


class _StateLock:
    """The descriptor that holds a store's lock (:meth:`Store._take_lock`); closing it frees the lock."""

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_holder(path: str | Path) -> str:
    """Who holds a state's lock, as ``<path>.lock`` names it ("another process" if it does not)."""
    try:
        return Path(str(path) + ".lock").read_text().strip()[:40] or "another process"
    except OSError:
        return "another process"


def lock_held(path: str | Path) -> bool:
    """Whether a coordinator holds this state's lock (:meth:`Store._take_lock`) now."""
    try:
        fd = os.open(str(path) + ".reports", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class Store:
    def __init__(self, path: str | Path, *, keep_states: int = 2, lock: bool = False, fsync: bool = False):
        """``lock``: hold an exclusive lock on the state (:meth:`_take_lock`) for as long as this store is open,
        so a second coordinator on the same state refuses to start (:class:`StateInUse`) instead of fighting
        the first for its broker session and its rounds."""
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock() if lock else None
        self.reports_dir = Path(self.path + ".reports")
        self.reports_dir.mkdir(exist_ok=True)
        self.db = None
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA page_size=65536")  # state blobs are large; takes effect on a new database
            self.db.execute("PRAGMA journal_mode=WAL")
            self.fsync = fsync
            # WAL + NORMAL: durable across process crashes; FULL: across power cuts too
            self.db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
            self._logs: dict[str, Any] = {}  # task id -> its open report log
            self._slots: dict[str, int | None] = {}  # task id -> the sums slot its row points at (None: no row yet)
            self._check_whole()
            self.db.executescript(SCHEMA)
            self._add_columns()
            self._check_rows()
        except BaseException as e:
            if self.db is not None:
                self.db.close()
            if self._lock is not None:
                self._lock.close()
            if isinstance(e, sqlite3.DatabaseError) and e.sqlite_errorname in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
                raise BadState(f"{self.path} is not a whole fedge state file ({e}); restore it from a backup, or "
                               "give a new state path to start another run") from None
            if isinstance(e, sqlite3.DatabaseError) and e.sqlite_errorname == "SQLITE_CANTOPEN":
                raise BadState(f"{self.path}: cannot open the state file ({e})") from None
            raise
        self.keep_states = keep_states
        self._drop_orphans()

    def _check_whole(self) -> None:
        """SQLite's own check of an existing file (its first problem only): a truncated or overwritten file is
        refused before anything reads or tidies it."""
        if Path(self.path).stat().st_size == 0:
            return  # new (SQLite makes a database of an empty file)
        row = self.db.execute("PRAGMA quick_check(1)").fetchone()
        if row is None or row[0] != "ok":
            what = " ".join(str(row[0]).replace("*** in database main ***", "").split()) if row else "no answer"
            raise BadState(f"{self.path} is damaged ({what}); restore it from a backup, "
                           "or give a new state path to start another run")

    def _check_rows(self) -> None:
        """The model of the last committed round must be there (a state without it would resume from a fresh
        model, and say it resumed)."""
        last = self.db.execute("SELECT MAX(round) FROM rounds WHERE status='committed'").fetchone()[0]
        have = self.db.execute("SELECT MAX(round) FROM state").fetchone()[0]
        if last is not None and have != last:
            raise BadState(f"{self.path}: round {last} is committed but "
                           + ("no model is saved" if have is None else f"the last model saved is of round {have}")
                           + "; restore the state file from a backup, or give a new state path to start another run")
        if last is None and have:
            raise BadState(f"{self.path}: the model of round {have} is saved but no committed round is; restore the "
                           "state file from a backup, or give a new state path to start another run")

    def _take_lock(self) -> "_StateLock":
        """An exclusive ``flock`` on the state's reports directory (``<path>.reports``, made if missing), held
        on an open descriptor until :meth:`close` or the process's end (a SIGKILL too). It is the lock: deleting
        a file frees nothing (removing the directory itself would lose the open round's reports whatever the
        lock). Not the database file itself: closing any descriptor of it would
        drop SQLite's own POSIX locks in this process. ``<path>.lock`` only names the holder (``pid N``) for a
        second coordinator's message and ``fedge status``; deleting it frees nothing."""
        where = Path(self.path + ".reports")
        where.mkdir(exist_ok=True)
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateInUse(f"{self.path} is in use by another coordinator ({lock_holder(self.path)}); stop it "
                             "first, or give this one its own state path") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            with open(self.path + ".lock", "w") as f:
                f.write(f"pid {os.getpid()}")
        except OSError:  # a name for messages only: the lock is held
            pass
        return _StateLock(fd)

    def _add_columns(self) -> None:
        """State files written before a column existed get it (with its default)."""
        for table, cols in (("devices", (("available", "INTEGER DEFAULT 1"), ("quarantined_until", "REAL DEFAULT 0"),
                                         ("quarantines", "INTEGER DEFAULT 0"))),
                            ("reports", (("off", "INTEGER"), ("len", "INTEGER"), ("norm", "REAL"))),
                            ("sums", (("slot", "INTEGER"), ("len", "INTEGER")))):
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for col, decl in cols:
                if col not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {decl}")

    def run_id(self) -> str:
        """A short random id made when the state is created: part of task ids and of the coordinator's MQTT
        client id, so a new run never takes an old run's queued messages for its own."""
        row = self.db.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()
        if row:
            return row[0]
        rid = secrets.token_hex(4)
        self.db.execute("INSERT OR IGNORE INTO meta VALUES ('run_id', ?)", (rid,))
        return self.db.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()[0]

    def secret(self, name: str) -> str:
        """A random token made once per state file and kept (the tail of the coordinator's MQTT client id, which
        a device must not be able to guess from the run id in its task ids: docs/security.md)."""
        key = f"secret:{name}"
        self.db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (key, secrets.token_hex(8)))
        return self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()[0]

    def _drop_orphans(self) -> None:
        """Report logs of tasks that are no longer open (a crash between commit and cleanup)."""
        open_tasks = {r[0] for r in self.db.execute("SELECT task_id FROM rounds WHERE status='open'")}
        for f in self.reports_dir.iterdir():
            if _OWN_FILE.sub("", f.name) not in open_tasks:
                shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)

    def _log_path(self, task_id: str) -> Path:
        return self.reports_dir / f"{task_id}.log"

    def _sums_path(self, task_id: str, slot: int) -> Path:
        return self.reports_dir / f"{task_id}.sums{slot}"

    def _write_sums(self, task_id: str, blob: bytes) -> tuple[int, int]:
        """Write a snapshot into the slot the table does not point at; (slot, length) for its row. The row is
        written after this returns, in the batch's transaction: until then the table points at the other slot,
        which nothing touches."""
        if task_id not in self._slots:  # first write of this process: the row may predate it (a restart)
            row = self.db.execute("SELECT slot FROM sums WHERE task_id=?", (task_id,)).fetchone()
            self._slots[task_id] = row[0] if row else None
        slot = 1 if self._slots[task_id] == 0 else 0
        path = self._sums_path(task_id, slot)
        created = self.fsync and not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            view, at = memoryview(blob), 0
            while at < len(view):  # pwrite may write less than asked
                at += os.pwrite(fd, view[at:], at)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            self._fsync_dir()
        return slot, len(blob)

    def _fsync_dir(self) -> None:
        """A new file's name is durable only once its directory is synced (with ``fsync``: a power cut)."""
        fd = os.open(self.reports_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _append(self, task_id: str, payload: bytes) -> int:
        """Append a payload to its task's log; returns its offset (flushed with the batch). A new task's log is
        the last closed task's file when there is one (:meth:`_forget`), written over from its start: a row says
        where its report lies, and nothing reads past the rows, so the old bytes beyond are never read."""
        f = self._logs.get(task_id)
        if f is None:
            path, spare = self._log_path(task_id), self.reports_dir / SPARE_LOG
            if not path.exists() and spare.exists():
                os.replace(spare, path)
                f = self._logs[task_id] = open(path, "r+b")
            else:  # a log a restarted coordinator's open round already has is appended to
                f = self._logs[task_id] = open(path, "ab")
            if self.fsync:
                self._fsync_dir()  # before any row can point into it (its data is synced with the batch)
        off = f.tell()
        f.write(payload)
        return off

    def _forget(self, task_id: str) -> None:
        """Drop a closed task's files. Its report log is kept for the next task (SPARE_LOG) when it is not
        larger than SPARE_LOG_MAX_BYTES: writing over a file's pages costs a quarter of the CPU of a new file's
        (page allocation) and its unlink (measured: 0.4 against 2 ms for a round of ten 0.8 MB reports)."""
        f = self._logs.pop(task_id, None)
        if f is not None:
            f.close()
        path, spare = self._log_path(task_id), self.reports_dir / SPARE_LOG
        try:
            if not spare.exists() and path.stat().st_size <= SPARE_LOG_MAX_BYTES:
                os.replace(path, spare)
        except FileNotFoundError:
            pass
        path.unlink(missing_ok=True)
        self._slots.pop(task_id, None)
        for slot in (0, 1):
            self._sums_path(task_id, slot).unlink(missing_ok=True)

    def close(self) -> None:
        for f in self._logs.values():
            try:
                f.close()
            except OSError:  # bytes of a batch that failed (a full disk): no row points at them
                pass
        self._logs.clear()
        self.db.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # ---- run guard: a store belongs to one run (model, strategy, data); where the broker is may change
    def check_run(self, run: dict[str, Any]) -> None:
        """Refuse a state that holds another run. ``run`` is what defines it (strategy, model, data, seed,
        fleet); the broker, round counts, timeouts and defences may change across restarts."""
        text = json.dumps(run, sort_keys=True)
        row = self.db.execute("SELECT value FROM meta WHERE key='run'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta VALUES ('run', ?)", (text,))
            return
        if row[0] != text:
            old = json.loads(row[0])
            diff = sorted(k for k in set(old) | set(run) if old.get(k) != run.get(k))
            raise OtherRun(f"{self.path} holds a run with another {', '.join(diff)}; use a new state path "
                               "to start another run")

    # ---- writes (Persist actions, in batches)
    def apply(self, what: str, d: dict[str, Any]) -> None:
        self.apply_batch([(what, d)])

    def apply_batch(self, records: list[tuple[str, dict[str, Any]]]) -> None:
        """Write records in their order: report payloads appended to their logs and flushed first, then every
        row in one transaction, then the logs of committed or abandoned tasks removed."""
        if not records:
            return
        places: list[int | None] = []
        for what, d in records:
            places.append(self._append(d["task_id"], d["payload"])
                          if what == "report" and d.get("payload") is not None else None)
        for f in self._logs.values():
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        # the batch's last snapshot per task (an earlier one in the same batch would be replaced at once)
        snaps = {d["task_id"]: d["blob"] for what, d in records if what == "sums"}
        written = {task: self._write_sums(task, blob) for task, blob in snaps.items()}
        done: list[str] = []
        with self.db:
            self.db.execute("BEGIN")
            reports: list[tuple] = []  # a run of report rows goes in one executemany
            for (what, d), off in zip(records, places):
                if what == "report":
                    reports.append(self._report_row(d, off))
                    continue
                self._insert_reports(reports)
                if what == "sums":
                    slot, size = written[d["task_id"]]
                    self.db.execute("INSERT OR REPLACE INTO sums (task_id, blob, slot, len) VALUES (?,?,?,?)",
                                    (d["task_id"], b"", slot, size))
                else:
                    self._row(what, d)
                if what in ("commit", "abandon"):
                    done.append(d["task_id"])
            self._insert_reports(reports)
        for task, (slot, _) in written.items():  # committed: the table points at these slots now
            self._slots[task] = slot
        for task in done:
            self._forget(task)

    def _row(self, what: str, d: dict[str, Any]) -> None:
        db = self.db
        if what == "device":
            db.execute("INSERT INTO devices (device_id, caps, programs, n, online, updated, available) "
                       "VALUES (?,?,?,?,1,?,?) ON CONFLICT(device_id) DO UPDATE SET caps=excluded.caps, "
                       "programs=excluded.programs, n=excluded.n, online=1, updated=excluded.updated, "
                       "available=excluded.available",
                       (d["device_id"], json.dumps(d["caps"]), json.dumps(d["programs"]), d["n"], time.time(),
                        int(d.get("available", True))))
        elif what == "device_offline":
            db.execute("UPDATE devices SET online=0, available=0 WHERE device_id=?", (d["device_id"],))
        elif what == "forget":  # not heard from for [rounds] forget_after_s: it registers again if it checks in
            db.executemany("DELETE FROM devices WHERE device_id=?", [(x,) for x in d["device_ids"]])
        elif what == "open":
            # an UPDATE on a task id met before (committed_rounds_are_final refuses it for a committed one)
            db.execute("INSERT INTO rounds VALUES (?,?,?,?,?,?,'open',NULL) ON CONFLICT(task_id) DO UPDATE SET "
                       "round=excluded.round, attempt=excluded.attempt, selected=excluded.selected, "
                       "deadline=excluded.deadline, opened_at=excluded.opened_at, status='open', summary=NULL",
                       (d["round"], d["attempt"], d["task_id"], json.dumps(d["selected"]), d["deadline"],
                        d["opened_at"]))
            # busy until they check in again, across a restart too
            db.executemany("UPDATE devices SET available=0 WHERE device_id=?", [(x,) for x in d["selected"]])
        elif what == "rejection":
            strike = int(bool(d.get("strike", True)))
            db.execute("INSERT INTO rejections VALUES (?,?,1,?,?,?) ON CONFLICT(device_id, what) DO UPDATE SET "
                       "count=count+1, strikes=strikes+excluded.strikes, last_reason=excluded.last_reason, "
                       "last_ts=excluded.last_ts", (d["device_id"], d["what"], strike, d["reason"], d["ts"]))
            if d.get("quarantines"):
                db.execute("UPDATE devices SET quarantined_until=?, quarantines=? WHERE device_id=?",
                           (d["quarantined_until"], d["quarantines"], d["device_id"]))
        elif what == "abandon":
            db.execute("UPDATE rounds SET status='abandoned' WHERE task_id=?", (d["task_id"],))
            db.execute("DELETE FROM reports WHERE task_id=?", (d["task_id"],))
            db.execute("DELETE FROM sums WHERE task_id=?", (d["task_id"],))
        elif what == "commit":
            st: ServerState = d["state"]
            db.execute("UPDATE rounds SET status='committed', summary=? WHERE task_id=?",
                       (json.dumps(d["summary"]), d["task_id"]))
            # a round's model is written once: a second commit of the round fails (and rolls the batch back)
            db.execute("INSERT INTO state VALUES (?,?)", (st.round, st.to_bytes()))
            db.execute("DELETE FROM reports WHERE task_id=?", (d["task_id"],))
            db.execute("DELETE FROM sums WHERE task_id=?", (d["task_id"],))
            db.execute("DELETE FROM state WHERE round <= ?", (st.round - self.keep_states,))
        else:
            raise ValueError(f"unknown persist record {what!r}")

    def _report_row(self, d: dict[str, Any], off: int | None) -> tuple:
        """A report's row: its payload's place in the task's log, or (durable sums) no payload."""
        payload = d.get("payload")
        file = None if payload is None else self._log_path(d["task_id"]).name
        size = d.get("nbytes", 0) if payload is None else len(payload)
        return d["task_id"], d["device_id"], d["n"], file, off, size, d.get("norm")

    def _insert_reports(self, rows: list[tuple]) -> None:
        if rows:
            self.db.executemany("INSERT OR IGNORE INTO reports (task_id, device_id, n, file, off, len, norm) "
                                "VALUES (?,?,?,?,?,?,?)", rows)
            rows.clear()

    def save_metrics(self, round_: int, data: dict[str, Any]) -> None:
        self.db.execute("INSERT OR REPLACE INTO metrics VALUES (?,?)", (round_, json.dumps(data)))

    # ---- reads (on start)
    def latest_state(self) -> ServerState | None:
        row = self.db.execute("SELECT blob FROM state ORDER BY round DESC LIMIT 1").fetchone()
        return ServerState.from_bytes(row[0]) if row else None

    def save_initial_state(self, st: ServerState) -> None:
        self.db.execute("INSERT OR IGNORE INTO state VALUES (?,?)", (st.round, st.to_bytes()))

    def open_round(self) -> tuple[dict[str, Any], list[bytes]] | None:
        """The round in flight: its record, with ``sums`` (the last snapshot of its partial sums, or None) and
        ``accepted`` ((device, n, norm) of the reports those sums hold), and the payloads of its other
        accepted reports, in arrival order."""
        row = self.db.execute("SELECT round, attempt, task_id, selected, deadline, opened_at FROM rounds "
                              "WHERE status='open' ORDER BY round DESC, attempt DESC LIMIT 1").fetchone()
        if row is None:
            return None
        info = dict(zip(("round", "attempt", "task_id", "selected", "deadline", "opened_at"), row))
        info["selected"] = json.loads(info["selected"])
        reports = []
        snap = self.db.execute("SELECT blob, slot, len FROM sums WHERE task_id=?", (info["task_id"],)).fetchone()
        info["sums"] = None if snap is None else snap[0] if snap[1] is None else self._read_sums(info["task_id"],
                                                                                                   *snap[1:])
        info["accepted"] = [tuple(r) for r in self.db.execute(
            "SELECT device_id, n, norm FROM reports WHERE task_id=? AND file IS NULL ORDER BY rowid",
            (info["task_id"],))]
        rows = self.db.execute("SELECT file, off, len FROM reports WHERE task_id=? AND file IS NOT NULL "
                               "ORDER BY rowid", (info["task_id"],)).fetchall()
        if rows:
            with open(self.reports_dir / rows[0][0], "rb") as f:
                for _file, off, n in rows:
                    f.seek(off)
                    reports.append(f.read(n))
        return info, reports

    def _read_sums(self, task_id: str, slot: int, size: int) -> bytes:
        """The snapshot the table points at (a row written before the slot files holds it as a blob)."""
        path = self._sums_path(task_id, slot)
        try:
            with open(path, "rb") as f:
                blob = f.read(size)
        except FileNotFoundError:
            raise ValueError(f"{path} is missing: the open round's partial sums are lost") from None
        if len(blob) != size:
            raise ValueError(f"{path} holds {len(blob)} bytes, the state says {size}: the open round's partial "
                             "sums are cut short")
        return blob

    def devices(self) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT device_id, caps, programs, n, online, available, quarantined_until, "
                               "quarantines FROM devices ORDER BY device_id")
        return [{"device_id": r[0], "caps": json.loads(r[1]), "programs": json.loads(r[2]), "n": r[3],
                 "online": bool(r[4]), "available": bool(r[5]), "quarantined_until": r[6] or 0.0,
                 "quarantines": r[7] or 0} for r in rows]

    def rejections(self) -> list[dict[str, Any]]:
        """Per device and message kind: how many were rejected, how many were strikes, the last reason."""
        rows = self.db.execute("SELECT device_id, what, count, strikes, last_reason, last_ts FROM rejections "
                               "ORDER BY device_id, what")
        return [dict(zip(("device_id", "what", "count", "strikes", "last_reason", "last_ts"), r)) for r in rows]

    def closed_tasks(self, limit: int = 256) -> list[str]:
        rows = self.db.execute("SELECT task_id FROM rounds WHERE status != 'open' ORDER BY rowid DESC LIMIT ?",
                               (limit,)).fetchall()
        return [r[0] for r in reversed(rows)]

    def summaries(self) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT r.summary, m.data FROM rounds r LEFT JOIN metrics m ON m.round = r.round "
                               "WHERE r.status='committed' ORDER BY r.round").fetchall()
        return [json.loads(s) | (json.loads(m) if m else {}) for s, m in rows]

    def abandoned_attempts(self, round_: int) -> int:
        return self.db.execute("SELECT COUNT(*) FROM rounds WHERE round=? AND status='abandoned'",
                               (round_,)).fetchone()[0]
