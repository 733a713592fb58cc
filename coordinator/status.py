"""``fedge status``: a run's progress for the terminal, from a coordinator's status endpoint or its state file.

Both sources give the dict of :meth:`coordinator.metrics.FleetMetrics.status` (the status page's
``/status.json``); a state file knows less (no configured round count, no eligibility, no answer counts),
and those fields are ``None``. The state file is opened read-only: reading it never disturbs a running
coordinator.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from edge.runtime.config import ConfigError

from .metrics import _row, reason_kind, run_status
from .store import Store, lock_held, lock_holder


class StateReader(Store):
    """A state file opened read-only: the :class:`Store`'s read methods, without its lock, its schema
    migration or its clean-up of report files (which a running coordinator owns)."""

    def __init__(self, path: str | Path):  # noqa: D107 - deliberately not Store.__init__
        self.path = str(path)
        self._lock = None
        self.reports_dir = Path(self.path + ".reports")
        self.keep_states = 0
        self._logs = {}  # never written: the reader only reads
        uri = "file:" + urllib.parse.quote(os.path.abspath(self.path)) + "?mode=ro"
        self.db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)

    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def open_round_info(self) -> dict[str, Any] | None:
        """The open round, if any, with how many reports it has accepted (without reading them)."""
        row = self.db.execute("SELECT round, attempt, task_id, selected, deadline, opened_at FROM rounds "
                              "WHERE status='open' ORDER BY round DESC, attempt DESC LIMIT 1").fetchone()
        if row is None:
            return None
        info = dict(zip(("round", "attempt", "task_id", "selected", "deadline", "opened_at"), row))
        info["selected"] = len(json.loads(info["selected"]))
        try:
            info["accepted"] = self.db.execute("SELECT COUNT(*) FROM reports WHERE task_id=?",
                                               (info["task_id"],)).fetchone()[0]
        except sqlite3.Error:
            info["accepted"] = None
        return info

    def abandoned(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM rounds WHERE status='abandoned'").fetchone()[0]


def coordinator_running(path: str | Path) -> int | None:
    """The pid of the coordinator that holds this state (its exclusive lock, :meth:`Store._take_lock`), -1 if
    ``<path>.lock`` does not name it, or None if none holds it."""
    if not lock_held(path):
        return None
    who = lock_holder(path)
    return int(who.split()[-1]) if who.startswith("pid ") and who.split()[-1].isdigit() else -1


def from_state(path: str | Path, *, last_rounds: int = 20, now: float | None = None) -> dict[str, Any]:
    """The status dict, read from a coordinator's SQLite state file."""
    if not Path(path).is_file():
        raise ConfigError(f"{path}: no such state file")
    now = time.time() if now is None else now
    try:
        st = StateReader(path)
    except sqlite3.Error as e:
        raise ConfigError(f"{path}: cannot open the state file: {e}") from None
    try:
        try:
            rows = [_row(s) for s in st.summaries()]
            devices = st.devices()
            rejections = st.rejections()
            run = json.loads(st.meta("run") or "{}")
            run_id = st.meta("run_id") or ""
            open_round = st.open_round_info()
            abandoned = st.abandoned()
        except sqlite3.DatabaseError as e:
            raise ConfigError(f"{path}: not a coordinator state file ({e})") from None
    finally:
        st.close()
    pid = coordinator_running(path)
    if open_round is not None:
        open_round["age_s"] = round(now - open_round["opened_at"], 2)
        open_round["left_s"] = round(open_round["deadline"] - now, 2)
    quarantined = sorted(({"device_id": d["device_id"], "left_s": round(d["quarantined_until"] - now, 1),
                           "quarantines": d["quarantines"], "last_reason": ""}
                          for d in devices if d["quarantined_until"] > now), key=lambda r: -r["left_s"])
    last_reason = {}
    for r in rejections:
        prev = last_reason.get(r["device_id"])
        if prev is None or (r["last_ts"] or 0) >= prev[0]:
            last_reason[r["device_id"]] = (r["last_ts"] or 0, f"{r['what']}: {r['last_reason']}")
    for q in quarantined:
        q["last_reason"] = last_reason.get(q["device_id"], (0, ""))[1]
    by_kind: dict[str, int] = {}
    for r in rejections:  # the state keeps only each device's last reason per message kind: kinds are approximate
        k = reason_kind(r["last_reason"] or "")
        by_kind[k] = by_kind.get(k, 0) + r["count"]
    mtime = max((os.path.getmtime(p) for p in (str(path), str(path) + "-wal") if os.path.exists(p)), default=None)
    out = run_status(rows, last_rounds=last_rounds)
    out.update({
        "source": "state", "state_path": str(path), "now": now, "updated": mtime, "coordinator_pid": pid,
        "fleet": run.get("fleet", ""), "run_id": run_id, "strategy": run.get("strategy", ""),
        "rounds_target": None, "clients_per_round": None,
        "phase": "round open" if open_round else ("not running" if not pid else "between rounds" if rows else
                                                  "waiting for devices"),
        "open_round": open_round, "resumed_after": None,
        "devices": {"registered": len(devices), "online": sum(d["online"] for d in devices),
                    "available": sum(d["online"] and d["available"] for d in devices), "eligible": None,
                    "quarantined": len(quarantined)},
        "quarantined": quarantined[:50],
        "reports": None,
        "rejections": {"total": sum(r["count"] for r in rejections), "by_kind": dict(sorted(by_kind.items())),
                       "strikes": sum(r["strikes"] for r in rejections)},
        "rounds_abandoned": abandoned, "ingest_reports_per_s": None,
    })
    return out


def from_url(url: str, *, timeout: float = 10.0) -> dict[str, Any]:
    """The status dict from a coordinator's HTTP server (``http://host:port``; ``/status.json`` is added)."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url {url!r}: expected http://host:port")
    full = url if url.rstrip("/").endswith(".json") else url.rstrip("/") + "/status.json"
    try:
        with urllib.request.urlopen(full, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(f"{full}: {reason}") from None


def _clean(text: Any, n: int = 80) -> str:
    """Device-supplied text (ids are checked, reasons may quote anything) made safe for a terminal."""
    s = "".join(c if c.isprintable() else "?" for c in str(text))
    return s if len(s) <= n else s[:n - 1] + "~"


def _mb(b: int | float | None) -> str:
    return "-" if b is None else f"{b / 1e6:.2f}"


def _f(v: float | None, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


def render(s: dict[str, Any], *, rounds: int = 10, width: int = 30) -> str:
    """The status dict as a person reads it in a terminal."""
    out = []
    src = (f"state file {s.get('state_path')}" + (f", coordinator pid {s['coordinator_pid']}"
                                                   if s.get("coordinator_pid") else ", no coordinator running")
           if s.get("source") == "state" else "live")
    ident = [f"fleet {_clean(s['fleet'])}" if s.get("fleet") else "", f"run {_clean(s.get('run_id') or '?')}",
             _clean(s.get("strategy") or "")]
    out.append(", ".join(x for x in ident if x) + f" ({src})")
    target, done = s.get("rounds_target"), s.get("round", 0)
    if target:
        filled = min(width, round(width * done / target))
        prog = f"round {done} of {target} committed [{'#' * filled}{'.' * (width - filled)}] {100 * done / target:.0f}%"
    else:
        prog = f"round {done} committed"
    o = s.get("open_round")
    if s.get("phase") == "finished":
        prog += "; finished"
    elif o:
        prog += (f"; round {o['round']} open (attempt {o['attempt']}): "
                 f"{'?' if o.get('accepted') is None else o['accepted']} of {o['selected']} selected reported, "
                 f"{max(0.0, o['left_s']):.0f} s to its deadline")
    elif s.get("phase"):
        prog += f"; {s['phase']}"
    out.append(prog)
    b = s.get("bytes", {})
    out.append(f"accuracy {_f(s.get('accuracy'))} (best {_f(s.get('best_accuracy'))}), loss {_f(s.get('loss'))}; "
               f"{_mb(b.get('total'))} MB on the wire ({_mb(b.get('down'))} down, {_mb(b.get('up'))} up)"
               + (f"; {s['rounds_abandoned']} attempts abandoned" if s.get("rounds_abandoned") else ""))
    d = s.get("devices", {})
    out.append("devices: " + ", ".join(f"{d[k]} {k}" for k in ("registered", "online", "available", "eligible",
                                                               "quarantined") if d.get(k) is not None))
    rep, rej = s.get("reports"), s.get("rejections") or {}
    line = []
    if rep:
        line.append("reports since start: " + ", ".join(f"{rep[k]} {k}" for k in ("accepted", "late", "rejected",
                                                                                 "duplicate")))
    if rej.get("total"):
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(rej["by_kind"].items(), key=lambda kv: -kv[1]))
        line.append(f"{rej['total']} rejected messages ({kinds}), {rej.get('strikes', 0)} strikes")
    if s.get("ingest_reports_per_s"):
        line.append(f"ingest {s['ingest_reports_per_s']:.1f} reports/s")
    if line:
        out.append("; ".join(line))
    rows = s.get("rounds", [])[-rounds:] if rounds else []
    if rows:
        out.append("")
        out.append(f"{'round':>5} {'accuracy':>8} {'loss':>7} {'MB down':>8} {'MB up':>8} {'reports':>7} "
                   f"{'unused':>7} {'s':>7} {'export s':>8}")
        for r in rows:
            out.append(f"{r['round']:>5} {_f(r.get('accuracy')):>8} {_f(r.get('loss'), '.3f'):>7} "
                       f"{_mb(r['bytes_down']):>8} {_mb(r['bytes_up']):>8} {r.get('reports') or 0:>7} "
                       f"{r.get('dropped') or 0:>7} {_f(r.get('wall_s'), '.2f'):>7} {_f(r.get('export_s') or 0.0, '.2f'):>8}"
                       + (f"  ({r['attempts']} attempts)" if (r.get("attempts") or 1) > 1 else "")
                       + (f"  excluded: {', '.join(_clean(d, 24) for d in r['excluded'][:8])}"
                          if r.get("excluded") else ""))
    q = s.get("quarantined") or []
    if q:
        out.append("")
        out.append("quarantined:")
        for r in q:
            out.append(f"  {_clean(r['device_id'], 24):<24} {r['left_s']:>6.0f} s more (#{r['quarantines']})  "
                       f"{_clean(r.get('last_reason', ''), 70)}")
    return "\n".join(out)
