"""The ingest inbox's cost per report chunk: ``python benchmarks/inbox.py``.

Why: with ``[ingest] shared = true`` every report chunk (256 KiB by default) is written into the inbox by a
worker, then read and deleted by the leader (coordinator/ingest.py). Profiled end to end, reading and deleting
those blobs was about a seventh of the leader's CPU with SQLite's defaults: 4 KiB pages, so a chunk is a chain
of 64 overflow pages, and secure_delete on (Debian builds it so), so deleting a chunk writes all of them
again as zeros. This measures CPU per chunk for the inbox as fedge opens it and for those defaults, in
alternating trials of the same run (the machine's speed wanders; only the ratio is compared). Writes
``runs/bench/inbox.json``: per configuration the median over trials of ``write_ms``, ``take_ms`` and
``delete_ms`` per chunk, and ``leader_ms_per_report`` = (take + delete) x the chunks of a 0.8 MB report.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator import ingest as I  # noqa: E402
from edge.protocol import wire  # noqa: E402

log = logging.getLogger("benchmarks.inbox")

CHUNK = 256 * 1024
REPORT_CHUNKS = 4  # a 200k-parameter float32 report (0.8 MB) at the default chunk size


def trial(workdir: Path, config: str, batches: int, per_batch: int) -> dict[str, float]:
    """One fresh inbox: ``batches`` worker transactions of ``per_batch`` chunks, each batch then taken and
    deleted by the leader, as the daemon alternates them. ``defaults`` reopens it the way SQLite would."""
    path = workdir / f"{config}.inbox"
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    if config == "defaults":
        page, sd = I.PAGE_SIZE, I.SECURE_DELETE
        I.PAGE_SIZE, I.SECURE_DELETE = 4096, "ON"
        try:
            worker, leader = I.Inbox(path), I.Inbox(path)
        finally:
            I.PAGE_SIZE, I.SECURE_DELETE = page, sd
    else:
        worker, leader = I.Inbox(path), I.Inbox(path)
    chunk = os.urandom(CHUNK)
    topic = wire.topic("bench", "report", "d1")
    w = t = d = 0.0
    last = 0
    for _ in range(batches):
        c = time.process_time()
        worker.append([(topic, chunk, None, 0, "w", 0.0)] * per_batch)
        w += time.process_time() - c
        c = time.process_time()
        rows = leader.take(last, per_batch)
        t += time.process_time() - c
        if len(rows) != per_batch or rows[-1].payload != chunk:
            raise RuntimeError(f"{config}: read back {len(rows)} rows, not the {per_batch} written")
        last = rows[-1].id
        c = time.process_time()
        leader.delete_through(last)
        d += time.process_time() - c
    page_size = leader.db.execute("PRAGMA page_size").fetchone()[0]
    worker.close()
    leader.close()
    n = batches * per_batch
    return {"write_ms": 1e3 * w / n, "take_ms": 1e3 * t / n, "delete_ms": 1e3 * d / n, "page_size": page_size}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "inbox.json"))
    ap.add_argument("--trials", type=int, default=5, help="alternating trials per configuration")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--per-batch", type=int, default=64, help="chunks per worker transaction")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    runs: dict[str, list[dict]] = {"fedge": [], "defaults": []}
    with tempfile.TemporaryDirectory(prefix="fedge-inbox-") as tmp:
        for i in range(a.trials):
            for config in (("fedge", "defaults") if i % 2 == 0 else ("defaults", "fedge")):
                runs[config].append(trial(Path(tmp), config, a.batches, a.per_batch))
    built = [r[0] for r in sqlite3.connect(":memory:").execute("PRAGMA compile_options")]
    res: dict = {"chunk_bytes": CHUNK, "trials": a.trials, "chunks_per_trial": a.batches * a.per_batch,
                 "report_chunks": REPORT_CHUNKS, "sqlite": sqlite3.sqlite_version,
                 "secure_delete_built_in": "SECURE_DELETE" in built}  # "defaults" runs it on either way
    for config, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("write_ms", "take_ms", "delete_ms")}
        med["page_size"] = rs[0]["page_size"]
        med["leader_ms_per_report"] = REPORT_CHUNKS * (med["take_ms"] + med["delete_ms"])
        med["worker_ms_per_report"] = REPORT_CHUNKS * med["write_ms"]
        res[config] = med
    f, d = res["fedge"], res["defaults"]
    res["leader_speedup"] = d["leader_ms_per_report"] / f["leader_ms_per_report"]
    res["worker_speedup"] = d["worker_ms_per_report"] / f["worker_ms_per_report"]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    for config in ("fedge", "defaults"):
        r = res[config]
        print(f"{config:8s} page {r['page_size']:5d}: write {r['write_ms']:.3f}, take {r['take_ms']:.3f}, delete "
              f"{r['delete_ms']:.3f} ms/chunk; leader {r['leader_ms_per_report']:.2f}, worker "
              f"{r['worker_ms_per_report']:.2f} ms per 0.8 MB report")
    print(f"leader {res['leader_speedup']:.1f}x, worker {res['worker_speedup']:.1f}x less CPU than SQLite's defaults")
    log.info("wrote %s", out)
    return res


if __name__ == "__main__":
    main()
