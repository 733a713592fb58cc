"""The state store's snapshot of a round's partial sums (durable sums, coordinator/store.py): two slot files
beside the database, the table pointing at the one last committed. A crash at any moment, including between a
slot's write and the transaction that points at it, must leave a whole snapshot matching the committed rows."""
import sqlite3

import pytest

from coordinator.store import Store

TASK = "run-r1a1"


def _open(st: Store, task: str = TASK) -> None:
    st.apply("open", {"round": 1, "attempt": 1, "task_id": task, "selected": ["d0", "d1", "d2"],
                      "deadline": 100.0, "opened_at": 0.0})


def _report(device: str, task: str = TASK) -> tuple[str, dict]:
    return "report", {"task_id": task, "device_id": device, "n": 10, "norm": 1.5, "nbytes": 800, "payload": None}


def _sums(blob: bytes, task: str = TASK) -> tuple[str, dict]:
    return "sums", {"task_id": task, "blob": blob}


def _restored(path) -> tuple[bytes | None, list[str]]:
    """What a restarted coordinator reads: the snapshot and the devices whose reports it holds."""
    st = Store(path)
    try:
        info, _ = st.open_round()
        return info["sums"], [d for d, _n, _norm in info["accepted"]]
    finally:
        st.close()


def _failing_batch(st: Store, records: list) -> None:
    """A batch whose transaction fails after its snapshot is written (an unknown record rolls it back)."""
    with pytest.raises(ValueError, match="unknown persist record"):
        st.apply_batch(records + [("no-such-record", {"task_id": TASK})])


@pytest.mark.parametrize("fsync", [False, True])
def test_snapshots_alternate_slots_and_a_restart_reads_the_last(tmp_path, fsync):
    st = Store(tmp_path / "s.sqlite", fsync=fsync)
    _open(st)
    st.apply_batch([_report("d0"), _sums(b"A" * 1000)])
    st.apply_batch([_report("d1"), _sums(b"B" * 1200)])
    files = {p.name: p.read_bytes() for p in st.reports_dir.glob("*.sums*")}
    assert files == {f"{TASK}.sums0": b"A" * 1000, f"{TASK}.sums1": b"B" * 1200}
    st.close()
    assert _restored(tmp_path / "s.sqlite") == (b"B" * 1200, ["d0", "d1"])


def test_a_shorter_snapshot_is_read_at_its_own_length(tmp_path):
    """A slot keeps the tail of a longer snapshot written there before: the row's length decides."""
    st = Store(tmp_path / "s.sqlite")
    _open(st)
    st.apply_batch([_report("d0"), _sums(b"A" * 1000)])
    st.apply_batch([_sums(b"B" * 10)])
    st.apply_batch([_sums(b"C" * 10)])  # slot 0 again, over 1000 bytes of A
    st.close()
    assert _restored(tmp_path / "s.sqlite")[0] == b"C" * 10


@pytest.mark.parametrize("fsync", [False, True])
def test_a_failed_batch_leaves_the_last_committed_snapshot_whole(tmp_path, fsync):
    """The batch's snapshot reaches its slot file before the transaction; if the transaction fails, the table
    still points at the other slot, untouched, and the next batch writes the free slot again."""
    st = Store(tmp_path / "s.sqlite", fsync=fsync)
    _open(st)
    st.apply_batch([_report("d0"), _sums(b"A" * 100)])
    _failing_batch(st, [_report("d1"), _sums(b"X" * 100)])
    _failing_batch(st, [_report("d1"), _sums(b"W" * 100)])  # a failure must not flip the slot it writes next
    assert _restored(tmp_path / "s.sqlite") == (b"A" * 100, ["d0"])
    st.apply_batch([_report("d1"), _sums(b"B" * 100)])
    _failing_batch(st, [_report("d2"), _sums(b"Y" * 100)])
    assert _restored(tmp_path / "s.sqlite") == (b"B" * 100, ["d0", "d1"])
    st.close()


def test_a_restarted_store_writes_the_slot_the_table_does_not_point_at(tmp_path):
    """After a restart the store learns the pointed-at slot from the table, not from its own memory."""
    for batches in (1, 2):  # the table points at slot 0, then at slot 1
        path = tmp_path / f"s{batches}.sqlite"
        st = Store(path)
        _open(st)
        for i in range(batches):
            st.apply_batch([_report(f"d{i}"), _sums(bytes([65 + i]) * 100)])
        last = bytes([65 + batches - 1]) * 100
        st.close()
        st = Store(path)
        _failing_batch(st, [_report("d2"), _sums(b"Z" * 100)])
        st.close()
        assert _restored(path) == (last, [f"d{i}" for i in range(batches)])


def test_commit_and_abandon_remove_the_slots_and_a_restart_removes_orphans(tmp_path):
    st = Store(tmp_path / "s.sqlite")
    _open(st)
    st.apply_batch([_report("d0"), _sums(b"A" * 100)])
    st.apply_batch([_sums(b"B" * 100)])
    st.apply("abandon", {"round": 1, "attempt": 1, "task_id": TASK})
    assert list(st.reports_dir.iterdir()) == []
    _open(st, "run-r1a2")
    st.apply_batch([_report("d0", "run-r1a2"), _sums(b"C" * 100, "run-r1a2")])
    (st.reports_dir / f"{TASK}.sums1").write_bytes(b"left by a crash between commit and cleanup")
    st.close()
    st = Store(tmp_path / "s.sqlite")
    assert sorted(p.name for p in st.reports_dir.iterdir()) == ["run-r1a2.sums0"]
    st.close()


def test_a_missing_or_cut_snapshot_is_named(tmp_path):
    st = Store(tmp_path / "s.sqlite")
    _open(st)
    st.apply_batch([_report("d0"), _sums(b"A" * 100)])
    st.close()
    slot = tmp_path / "s.sqlite.reports" / f"{TASK}.sums0"
    slot.write_bytes(b"A" * 60)
    with pytest.raises(ValueError, match=r"sums0 holds 60 bytes, the state says 100"):
        _restored(tmp_path / "s.sqlite")
    slot.unlink()
    with pytest.raises(ValueError, match=r"sums0 is missing"):
        _restored(tmp_path / "s.sqlite")


def test_a_snapshot_stored_in_the_table_by_an_older_version_is_still_read(tmp_path):
    st = Store(tmp_path / "s.sqlite")
    _open(st)
    st.apply_batch([_report("d0")])
    st.close()
    db = sqlite3.connect(tmp_path / "s.sqlite")
    db.execute("INSERT INTO sums (task_id, blob) VALUES (?, ?)", (TASK, b"old" * 50))
    db.commit()
    db.close()
    assert _restored(tmp_path / "s.sqlite") == (b"old" * 50, ["d0"])
    st = Store(tmp_path / "s.sqlite")
    st.apply_batch([_report("d1"), _sums(b"new" * 50)])  # the first slot file; the row now points at it
    st.close()
    assert _restored(tmp_path / "s.sqlite") == (b"new" * 50, ["d0", "d1"])


# ---- a state file that cannot be resumed (issue #30): one line and exit 2, never a traceback or a fresh start
def _committed_state(path, rounds: int = 3) -> None:
    """A state file as a coordinator leaves it after ``rounds`` committed rounds."""
    import numpy as np

    from coordinator.strategies.base import ServerState
    st = Store(path)
    st.run_id()
    st.save_initial_state(ServerState(0, {"w": np.zeros(3, np.float32)}))
    for r in range(1, rounds + 1):
        task = f"run-r{r}a1"
        st.apply("open", {"round": r, "attempt": 1, "task_id": task, "selected": ["d0"], "deadline": 100.0,
                          "opened_at": 0.0})
        st.apply("commit", {"task_id": task, "state": ServerState(r, {"w": np.full(3, r, np.float32)}),
                            "summary": {"round": r}})
    st.close()


def _coordinator(path, capsys) -> tuple[int, str]:
    from coordinator.cli import main
    rc = main(["coordinator", "--state", str(path), "--broker", "mqtt://127.0.0.1:1"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("damage", ["garbage", "text", "header only", "truncated", "zeroed"])
def test_a_damaged_state_file_is_one_line_and_exit_2(tmp_path, capsys, damage):
    import os
    path = tmp_path / "s.sqlite"
    _committed_state(path)
    data = path.read_bytes()
    path.write_bytes({"garbage": os.urandom(len(data)), "text": b"round = 3\n" * 100, "header only": data[:100],
                      "truncated": data[:len(data) // 2],
                      "zeroed": data[:len(data) // 2] + bytes(len(data) - len(data) // 2)}[damage])
    rc, err = _coordinator(path, capsys)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"fedge coordinator: {path}") and "restore it from a backup" in err, err
    with pytest.raises(Exception, match="not a whole fedge state file|is damaged"):
        Store(path)


@pytest.mark.parametrize("delete, says", [
    ("DELETE FROM state", "round 3 is committed but no model is saved"),
    ("DELETE FROM state WHERE round = 3", "round 3 is committed but the last model saved is of round 2"),
    ("DELETE FROM rounds", "the model of round 3 is saved but no committed round is"),
])
def test_a_state_with_missing_rows_is_refused_not_reset(tmp_path, capsys, delete, says):
    path = tmp_path / "s.sqlite"
    _committed_state(path)
    db = sqlite3.connect(path)
    db.execute(delete)
    db.commit()
    db.close()
    rc, err = _coordinator(path, capsys)
    assert rc == 2 and err.count("\n") == 1 and says in err, err
    assert "resuming" not in capsys.readouterr().out


def test_a_whole_state_still_opens(tmp_path):
    path = tmp_path / "s.sqlite"
    _committed_state(path)
    st = Store(path)
    assert st.latest_state().round == 3 and [s["round"] for s in st.summaries()] == [1, 2, 3]
    st.close()
    (tmp_path / "empty.sqlite").write_bytes(b"")  # SQLite's new database: a new run
    Store(tmp_path / "empty.sqlite").close()


def _payload_report(device: str, payload: bytes, task: str) -> tuple[str, dict]:
    return "report", {"task_id": task, "device_id": device, "n": 10, "norm": 1.5, "payload": payload}


def test_a_closed_tasks_report_log_is_written_over_by_the_next_and_restores_exactly(tmp_path, monkeypatch):
    """The last closed task's report log becomes the next task's (coordinator/store.py: SPARE_LOG), written over
    from its start: a restart reads the open round's reports exactly, not the older bytes beyond them; a log
    larger than SPARE_LOG_MAX_BYTES is removed, and a restart removes the spare."""
    import coordinator.store as S
    st = Store(tmp_path / "s.sqlite")
    _open(st, "run-r1a1")
    st.apply_batch([_payload_report("d0", b"x" * 3000, "run-r1a1"), _payload_report("d1", b"y" * 5000, "run-r1a1")])
    st.apply("abandon", {"round": 1, "attempt": 1, "task_id": "run-r1a1"})
    assert sorted(p.name for p in st.reports_dir.iterdir()) == [S.SPARE_LOG]
    inode = (st.reports_dir / S.SPARE_LOG).stat().st_ino
    _open(st, "run-r1a2")
    st.apply_batch([_payload_report("d0", b"p" * 10, "run-r1a2")])
    st.apply_batch([_payload_report("d2", b"q" * 20, "run-r1a2")])
    log = st.reports_dir / "run-r1a2.log"
    assert sorted(p.name for p in st.reports_dir.iterdir()) == ["run-r1a2.log"]
    assert log.stat().st_ino == inode and log.stat().st_size == 8000  # the old bytes are still there, past the rows
    st.close()  # a crash with the round open
    st = Store(tmp_path / "s.sqlite")
    info, reports = st.open_round()
    assert info["task_id"] == "run-r1a2" and reports == [b"p" * 10, b"q" * 20]
    st.apply_batch([_payload_report("d3", b"r" * 7, "run-r1a2")])  # a restarted coordinator appends
    st.close()
    st = Store(tmp_path / "s.sqlite")
    assert st.open_round()[1] == [b"p" * 10, b"q" * 20, b"r" * 7]
    monkeypatch.setattr(S, "SPARE_LOG_MAX_BYTES", 4096)  # this log (8,007 bytes) is over it: removed
    st.apply("abandon", {"round": 1, "attempt": 2, "task_id": "run-r1a2"})
    assert list(st.reports_dir.iterdir()) == []
    _open(st, "run-r1a3")
    st.apply_batch([_payload_report("d0", b"s" * 100, "run-r1a3")])
    st.apply("abandon", {"round": 1, "attempt": 3, "task_id": "run-r1a3"})
    assert sorted(p.name for p in st.reports_dir.iterdir()) == [S.SPARE_LOG]
    st.close()
    st = Store(tmp_path / "s.sqlite")
    assert list(st.reports_dir.iterdir()) == []  # no open round: a restart removes the spare
    st.close()
