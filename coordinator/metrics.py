"""What a running coordinator has done, for Prometheus (``/metrics``) and the status page (``/status.json``).

:class:`FleetMetrics` is an :class:`~coordinator.observe.Observer`: the daemon tells it every message in and
out, every durable record, every stage timing and every commit, on its network thread. It keeps counters and
histograms under one lock (a few increments per event) and renders them on demand, from the HTTP thread, in
Prometheus's text exposition format (version 0.0.4). Device counts are read off the registry at scrape time.

Counters count since this process started (Prometheus's convention: ``rate()`` copes with restarts); the
status page's rounds, curve and bytes cover the whole run, seeded from the state file when the coordinator
resumes. Nothing here touches the round machine's internals except to read them.
"""
from __future__ import annotations

import math
import os
import re
import threading
import time
from bisect import bisect_left
from typing import Any

from edge.protocol import wire

from .observe import Observer

# open -> commit of a round: from well under a second (a quiet test fleet) to the 120 s default timeout and
# retried attempts beyond it
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# one piece of the daemon's work: a tick is ~50 us, a report's persist ~1 ms, an evaluation or export seconds
STAGE_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
ACK_STATUSES = ("accepted", "duplicate", "late", "rejected")
IN_KINDS = ("checkin", "report", "status")
OUT_KINDS = ("plan", "ack", "pace")
DEVICE_STATES = ("registered", "online", "available", "eligible", "quarantined")
WINDOW_S = 10  # the ingest-rate gauges average over this many seconds

# A rejection's reason is free text (coordinator/rounds.py, admission.py, the strategies, edge/protocol/wire.py);
# its kind is a small fixed set, so it can be a label. First match wins.
REASON_KINDS = (
    ("unknown_task", re.compile(r"unknown task")),
    ("not_selected", re.compile(r"not selected for")),
    ("no_plan", re.compile(r"from a device with no plan")),
    ("too_large", re.compile(r"exceeds (the|this sender's) limit")),
    ("wrong_topic", re.compile(r"wrote on the topic of")),
    ("internal_error", re.compile(r"^internal error")),
    ("sample_count", re.compile(r"sample count|samples is more than max_samples")),
    ("norm_bound", re.compile(r"update norm .* above the bound")),
    ("value_bound", re.compile(r"a value of magnitude above")),
    ("capabilities", re.compile(r"^capability |registry is full")),
    ("not_as_planned", re.compile(r"^(\S+-)?r\d+a\d+: ")),  # a report that decoded but is not what its plan asked
)
REASON_KIND_NAMES = tuple(k for k, _ in REASON_KINDS) + ("malformed",)


def reason_kind(reason: str) -> str:
    """The kind of a rejection (a label value) from its reason text; ``malformed`` if nothing else fits (what
    did not decode: bad msgpack, fields, arrays, masks, ids)."""
    for kind, rx in REASON_KINDS:
        if rx.search(reason):
            return kind
    return "malformed"


class Histogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1  # Prometheus buckets are upper-inclusive ("le")
        self.sum += v
        self.count += 1

    def copy(self) -> "Histogram":
        h = Histogram(self.bounds)
        h.counts, h.sum, h.count = list(self.counts), self.sum, self.count
        return h


def _topic_kind(topic: str, known: tuple[str, ...]) -> str:
    parts = topic.split("/")
    return parts[3] if len(parts) == 5 and parts[3] in known else "other"


class FleetMetrics(Observer):
    """Counters, histograms and the run's rounds, fed by the daemon; read by the HTTP server.

    Use: ``m = FleetMetrics(); coord = Coordinator(..., observer=m); m.attach(coord)`` before
    ``coord.start()`` (attach reads the state file on the calling thread)."""

    def __init__(self, *, clock=time.time):
        self.clock = clock
        self.started = clock()
        self._lock = threading.Lock()
        self.coord = None
        self.registry = None
        self.rules = None
        self.info: dict[str, Any] = {"fleet": "", "run_id": "", "strategy": "", "rounds_target": 0,
                                     "clients_per_round": 0, "state_path": ""}
        self.rows: list[dict[str, Any]] = []  # every committed round of the run, oldest first
        self.resumed_after = 0  # rounds committed before this process started
        self.open_round: dict[str, Any] | None = None
        self._first_open: dict[int, float] = {}  # round -> when its first attempt opened
        self._opened: dict[str, float] = {}  # task id -> when it opened
        self.rounds_committed = 0
        self.rounds_abandoned = 0
        self.round_hist = Histogram(ROUND_BUCKETS)
        self.attempt_hist = {"committed": Histogram(ROUND_BUCKETS), "abandoned": Histogram(ROUND_BUCKETS)}
        self.reports_accepted = 0
        self.report_bytes = 0
        self.acks = dict.fromkeys(ACK_STATUSES, 0)
        self.rejections: dict[tuple[str, str], int] = {}
        self.strikes = 0
        self.quarantines = 0
        self._quarantine_count: dict[str, int] = {}
        self.rx_msgs = dict.fromkeys(IN_KINDS + ("other",), 0)
        self.rx_bytes = dict.fromkeys(IN_KINDS + ("other",), 0)
        self.tx_msgs = dict.fromkeys(OUT_KINDS + ("other",), 0)
        self.tx_bytes = dict.fromkeys(OUT_KINDS + ("other",), 0)
        self.round_bytes = {"down": 0, "up": 0}
        self.persisted_records: dict[str, int] = {}
        self.stage_wall: dict[str, float] = {}
        self.stage_cpu: dict[str, float] = {}
        self.stage_hist: dict[str, Histogram] = {}
        # accepted reports and their bytes per wall-clock second, a ring of WINDOW_S + 1 slots
        self._ring_t = [-1] * (WINDOW_S + 1)
        self._ring_n = [0] * (WINDOW_S + 1)
        self._ring_b = [0] * (WINDOW_S + 1)

    # ------------------------------------------------------------------ wiring
    def attach(self, coord) -> "FleetMetrics":
        """Learn the run from a constructed, not yet started :class:`~coordinator.daemon.Coordinator`: its
        identity, the registry to count devices in, the rounds already committed, the round re-opened."""
        m = coord.machine
        self.coord, self.registry, self.rules = coord, m.registry, m.cfg.eligibility
        self.info = {"fleet": m.cfg.fleet, "run_id": m.cfg.run_id, "strategy": coord.strategy.name,
                     "rounds_target": m.cfg.rounds, "clients_per_round": m.cfg.clients_per_round,
                     "state_path": coord.cfg.state_path}
        self.rows = [_row(s) for s in coord.store.summaries()]
        self.resumed_after = len(self.rows)
        o = m.open
        if o is not None:  # re-opened after a restart: no "open" record will come for it
            self.open_round = {"round": o.round, "attempt": o.attempt, "task_id": o.task_id,
                               "selected": len(o.selected), "accepted": len(o.accepted), "deadline": o.deadline,
                               "opened_at": o.opened_at}
            self._opened[o.task_id] = o.opened_at
        return self

    # ------------------------------------------------------------------ Observer (network thread)
    def message(self, topic: str, nbytes: int, now: float) -> None:
        kind = _topic_kind(topic, IN_KINDS)
        with self._lock:
            self.rx_msgs[kind] += 1
            self.rx_bytes[kind] += nbytes

    def published(self, topic: str, payload: bytes) -> None:
        kind = _topic_kind(topic, OUT_KINDS)
        status = None
        if kind == "ack":
            try:
                status = wire.decode(payload, expect=("ack",)).status
            except wire.WireError:
                pass
        with self._lock:
            self.tx_msgs[kind] += 1
            self.tx_bytes[kind] += len(payload)
            if status in self.acks:
                self.acks[status] += 1

    def stage(self, name: str, wall_s: float, cpu_s: float) -> None:
        with self._lock:
            self.stage_wall[name] = self.stage_wall.get(name, 0.0) + wall_s
            self.stage_cpu[name] = self.stage_cpu.get(name, 0.0) + cpu_s
            h = self.stage_hist.get(name)
            if h is None:
                h = self.stage_hist[name] = Histogram(STAGE_BUCKETS)
            h.observe(wall_s)

    def persisted(self, what: str, data: dict[str, Any]) -> None:
        now = self.clock()
        with self._lock:
            self.persisted_records[what] = self.persisted_records.get(what, 0) + 1
            if what == "report":
                self.reports_accepted += 1
                nbytes = data["nbytes"] if "nbytes" in data else len(data.get("payload") or b"")
                self.report_bytes += nbytes
                sec = int(now)
                i = sec % len(self._ring_t)
                if self._ring_t[i] != sec:
                    self._ring_t[i], self._ring_n[i], self._ring_b[i] = sec, 0, 0
                self._ring_n[i] += 1
                self._ring_b[i] += nbytes
                o = self.open_round
                if o is not None and o["task_id"] == data.get("task_id"):
                    o["accepted"] += 1
            elif what == "open":
                self.open_round = {"round": data["round"], "attempt": data["attempt"], "task_id": data["task_id"],
                                   "selected": len(data["selected"]), "accepted": 0, "deadline": data["deadline"],
                                   "opened_at": data["opened_at"]}
                self._opened[data["task_id"]] = data["opened_at"]
                self._first_open.setdefault(data["round"], data["opened_at"])
            elif what == "abandon":
                self.rounds_abandoned += 1
                opened = self._opened.pop(data.get("task_id"), None)
                if opened is not None:
                    self.attempt_hist["abandoned"].observe(max(0.0, now - opened))
                self.open_round = None
            elif what == "rejection":
                key = (str(data.get("what", "other")), reason_kind(str(data.get("reason", ""))))
                self.rejections[key] = self.rejections.get(key, 0) + 1
                if data.get("strike", True):
                    self.strikes += 1
                dev, q = data.get("device_id"), int(data.get("quarantines") or 0)
                if q > self._quarantine_count.get(dev, 0):
                    self.quarantines += q - self._quarantine_count.get(dev, 0)
                    self._quarantine_count[dev] = q

    def committed(self, summary: dict[str, Any]) -> None:
        now = self.clock()
        row = _row(summary)
        with self._lock:
            self.rounds_committed += 1
            self.rows.append(row)
            self.round_bytes["down"] += row["bytes_down"]
            self.round_bytes["up"] += row["bytes_up"]
            # from our own clock: the commit is durable now, after the evaluation that vetted it (the summary's
            # wall_s stops before it); a round re-opened after a restart falls back on wall_s
            wall = float(summary.get("wall_s") or 0.0)
            first = self._first_open.pop(row["round"], None)
            opened = self._opened.pop(summary.get("task_id"), None)
            self.round_hist.observe(max(0.0, now - first) if first is not None else wall)
            self.attempt_hist["committed"].observe(max(0.0, now - opened) if opened is not None else wall)
            self.open_round = None

    # ------------------------------------------------------------------ reads (any thread)
    def devices(self, now: float | None = None) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """Device counts by state (not disjoint: online devices are registered, and so on) and the quarantined
        devices, from a snapshot of the registry."""
        now = self.clock() if now is None else now
        counts = dict.fromkeys(DEVICE_STATES, 0)
        quarantined: list[dict[str, Any]] = []
        if self.registry is None:
            return counts, quarantined
        recs = list(self.registry.devices.values())  # one C-level copy: safe against the network thread
        counts["registered"] = len(recs)
        for d in recs:
            q = d.quarantined(now)
            if q:
                counts["quarantined"] += 1
                quarantined.append({"device_id": d.device_id, "left_s": round(d.quarantined_until - now, 1),
                                    "quarantines": d.quarantines, "last_reason": d.last_reason})
            if d.online:
                counts["online"] += 1
                if d.available:
                    counts["available"] += 1
                    if not q and (self.rules is None or self.rules.reason_against(d.capabilities) is None):
                        counts["eligible"] += 1
        quarantined.sort(key=lambda r: -r["left_s"])
        return counts, quarantined

    def ingest_rate(self, now: float | None = None) -> tuple[float, float]:
        """Accepted reports per second and their bytes per second, over the last ``WINDOW_S`` whole seconds."""
        sec = int(self.clock() if now is None else now)
        with self._lock:
            n = sum(c for t, c in zip(self._ring_t, self._ring_n) if sec - WINDOW_S <= t < sec)
            b = sum(c for t, c in zip(self._ring_t, self._ring_b) if sec - WINDOW_S <= t < sec)
        return n / WINDOW_S, b / WINDOW_S

    def finished(self) -> bool:
        m = getattr(self.coord, "machine", None)
        if m is not None:
            return bool(m.finished)
        target = self.info["rounds_target"]
        return bool(target) and bool(self.rows) and self.rows[-1]["round"] >= target

    def exposition(self) -> str:
        """All metrics in Prometheus's text format."""
        now = self.clock()
        devices, _ = self.devices(now)
        rate, byte_rate = self.ingest_rate(now)
        with self._lock:
            s = {k: getattr(self, k) for k in ("rounds_committed", "rounds_abandoned", "reports_accepted", "strikes",
                                               "quarantines")}
            s |= {k: dict(getattr(self, k)) for k in ("acks", "rejections", "rx_msgs", "rx_bytes", "tx_msgs",
                                                      "tx_bytes", "round_bytes", "persisted_records", "stage_wall",
                                                      "stage_cpu")}
            s["round_hist"] = self.round_hist.copy()
            s["attempt_hist"] = {k: h.copy() for k, h in self.attempt_hist.items()}
            s["stage_hist"] = {k: h.copy() for k, h in self.stage_hist.items()}
            last = dict(self.rows[-1]) if self.rows else None
            open_round = dict(self.open_round) if self.open_round else None
        t = _Text()
        info = self.info
        t.gauge("fedge_info", "The run this coordinator serves (value 1).",
                [({"fleet": info["fleet"], "run_id": info["run_id"], "strategy": info["strategy"]}, 1)])
        t.gauge("fedge_start_time_seconds", "When this coordinator process started (Unix time).",
                [({}, self.started)])
        t.gauge("fedge_rounds_target", "Rounds the run is configured for.", [({}, info["rounds_target"])])
        t.gauge("fedge_round", "The last committed round of the run (0 before the first).",
                [({}, last["round"] if last else 0)])
        t.counter("fedge_rounds_committed_total", "Rounds committed by this process.", [({}, s["rounds_committed"])])
        t.counter("fedge_rounds_abandoned_total", "Round attempts abandoned (too few reports by the deadline, or a "
                  "refused commit) by this process.", [({}, s["rounds_abandoned"])])
        t.gauge("fedge_round_open", "1 while a round is open.", [({}, 1 if open_round else 0)])
        t.gauge("fedge_open_round_selected", "Devices selected for the open round.",
                [({}, open_round["selected"] if open_round else 0)])
        t.gauge("fedge_open_round_reports", "Reports accepted so far in the open round.",
                [({}, open_round["accepted"] if open_round else 0)])
        if last is not None and last.get("accuracy") is not None:
            t.gauge("fedge_accuracy", "Test accuracy of the last committed global model.", [({}, last["accuracy"])])
        if last is not None and last.get("loss") is not None:
            t.gauge("fedge_loss", "Test loss of the last committed global model.", [({}, last["loss"])])
        t.histogram("fedge_round_duration_seconds", "From the opening of a round's first attempt to its commit.",
                    [({}, s["round_hist"])])
        t.histogram("fedge_round_attempt_duration_seconds", "From the opening of one attempt to its commit or "
                    "abandonment.", [({"outcome": k}, h) for k, h in sorted(s["attempt_hist"].items())])
        t.counter("fedge_reports_accepted_total", "Reports accepted (written to durable state).",
                  [({}, s["reports_accepted"])])
        machine = getattr(self.coord, "machine", None)
        t.counter("fedge_reports_plain_path_total", "Reports accepted on the plain report's fast path (dense float32 "
                  "weights of exactly the plan's tensors); the others took the general path.",
                  [({}, getattr(machine, "plain_reports", 0))])
        t.counter("fedge_report_acks_total", "Answers to reports, by status (accepted, duplicate, late, rejected).",
                  [({"status": k}, v) for k, v in s["acks"].items()])
        t.counter("fedge_rejections_total", "Messages rejected, by message kind and reason kind.",
                  [({"what": w, "kind": k}, v) for (w, k), v in sorted(s["rejections"].items())])
        t.counter("fedge_strikes_total", "Rejections that count towards a device's quarantine.", [({}, s["strikes"])])
        t.counter("fedge_quarantines_total", "Devices put in quarantine.", [({}, s["quarantines"])])
        t.gauge("fedge_devices", "Devices by state: registered, online, available (online and free), eligible "
                "(available, not quarantined, passing the eligibility rules), quarantined.",
                [({"state": k}, v) for k, v in devices.items()])
        t.counter("fedge_received_messages_total", "MQTT messages received, by topic kind.",
                  [({"kind": k}, v) for k, v in s["rx_msgs"].items()])
        t.counter("fedge_received_bytes_total", "Payload bytes received (bytes up), by topic kind.",
                  [({"kind": k}, v) for k, v in s["rx_bytes"].items()])
        t.counter("fedge_sent_messages_total", "MQTT messages published, by topic kind (each chunk once).",
                  [({"kind": k}, v) for k, v in s["tx_msgs"].items()])
        t.counter("fedge_sent_bytes_total", "Payload bytes published (bytes down), by topic kind.",
                  [({"kind": k}, v) for k, v in s["tx_bytes"].items()])
        t.counter("fedge_round_bytes_total", "Plan (down) and report (up) bytes counted into rounds committed by "
                  "this process, as the run report counts them.",
                  [({"direction": k}, v) for k, v in s["round_bytes"].items()])
        t.gauge("fedge_ingest_reports_per_second", f"Reports accepted per second over the last {WINDOW_S} s.",
                [({}, rate)])
        t.gauge("fedge_ingest_bytes_per_second", f"Bytes of accepted reports per second over the last {WINDOW_S} s.",
                [({}, byte_rate)])
        t.counter("fedge_persisted_records_total", "Durable records written, by kind.",
                  [({"what": k}, v) for k, v in sorted(s["persisted_records"].items())])
        t.counter("fedge_stage_seconds_total", "Wall seconds of the daemon's work by stage (receive and tick include "
                  "evaluate; see coordinator/observe.py).",
                  [({"stage": k}, v) for k, v in sorted(s["stage_wall"].items())])
        t.counter("fedge_stage_cpu_seconds_total", "Thread CPU seconds of the daemon's work by stage.",
                  [({"stage": k}, v) for k, v in sorted(s["stage_cpu"].items())])
        t.histogram("fedge_stage_duration_seconds", "Wall seconds of one piece of the daemon's work, by stage.",
                    [({"stage": k}, h) for k, h in sorted(s["stage_hist"].items())])
        cpu = os.times()
        t.counter("process_cpu_seconds_total", "User and system CPU seconds of this process.",
                  [({}, cpu.user + cpu.system)])
        rss = _rss_bytes()
        if rss is not None:
            t.gauge("process_resident_memory_bytes", "Resident memory of this process.", [({}, rss)])
        return t.text()

    def status(self, *, last_rounds: int = 20, max_points: int = 1000) -> dict[str, Any]:
        """The status page's data (``/status.json``); :func:`coordinator.status.from_state` gives the same shape
        from a state file."""
        now = self.clock()
        devices, quarantined = self.devices(now)
        rate, _ = self.ingest_rate(now)
        with self._lock:
            rows = list(self.rows)
            open_round = dict(self.open_round) if self.open_round else None
            acks = dict(self.acks)
            rej = dict(self.rejections)
            abandoned, accepted, strikes = self.rounds_abandoned, self.reports_accepted, self.strikes
        if open_round is not None:
            open_round["age_s"] = round(now - open_round["opened_at"], 2)
            open_round["left_s"] = round(open_round["deadline"] - now, 2)
        by_kind: dict[str, int] = {}
        for (_, k), v in rej.items():
            by_kind[k] = by_kind.get(k, 0) + v
        finished = self.finished()
        out = run_status(rows, last_rounds=last_rounds, max_points=max_points)
        out.update({
            "source": "live", "now": now, "started": self.started, "uptime_s": round(now - self.started, 1),
            **{k: self.info[k] for k in ("fleet", "run_id", "strategy", "rounds_target", "clients_per_round")},
            # between rounds the machine waits for enough eligible devices to open the next one
            "phase": ("finished" if finished else "round open" if open_round else
                      "between rounds" if rows else "waiting for devices"),
            "open_round": None if finished else open_round,
            "resumed_after": self.resumed_after,
            "devices": devices, "quarantined": quarantined[:50],
            "reports": {"accepted": accepted, "late": acks["late"], "rejected": acks["rejected"],
                        "duplicate": acks["duplicate"]},
            "rejections": {"total": sum(rej.values()), "by_kind": dict(sorted(by_kind.items())), "strikes": strikes},
            "rounds_abandoned": abandoned, "ingest_reports_per_s": round(rate, 2),
        })
        return out


def run_status(rows: list[dict[str, Any]], *, last_rounds: int = 20, max_points: int = 1000) -> dict[str, Any]:
    """What the status page shows of the committed rounds: the last few, the accuracy-against-MB curve
    (thinned to ``max_points``), totals."""
    curve, mb = [], 0.0
    for r in rows:
        mb += (r["bytes_down"] + r["bytes_up"]) / 1e6
        if r.get("accuracy") is not None:
            curve.append([round(mb, 6), r["accuracy"], r["round"]])
    if len(curve) > max_points:
        step = math.ceil(len(curve) / max_points)
        curve = curve[::step] + ([curve[-1]] if (len(curve) - 1) % step else [])
    down = sum(r["bytes_down"] for r in rows)
    up = sum(r["bytes_up"] for r in rows)
    accs = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
    last = rows[-1] if rows else None
    return {"round": last["round"] if last else 0, "rounds_committed": len(rows),
            "accuracy": last.get("accuracy") if last else None, "loss": last.get("loss") if last else None,
            "best_accuracy": max(accs) if accs else None,
            "bytes": {"down": down, "up": up, "total": down + up},
            "rounds_wall_s": round(sum(r.get("wall_s") or 0.0 for r in rows), 3),
            "rounds": rows[-last_rounds:] if last_rounds else [], "curve": curve}


ROW_KEYS = ("round", "accuracy", "loss", "bytes_down", "bytes_up", "reports", "dropped", "wall_s", "export_s",
            "attempts")


def _row(summary: dict[str, Any]) -> dict[str, Any]:
    """A round's summary as the status page, the log line and the run report use it: every figure, without
    the list of accepted devices (a thousand ids a round would grow without bound over a long run)."""
    r = {k: summary.get(k) for k in ROW_KEYS} | {k: v for k, v in summary.items()
                                                 if k not in ROW_KEYS and k not in ("accepted", "task_id")}
    r["bytes_down"], r["bytes_up"] = int(r["bytes_down"] or 0), int(r["bytes_up"] or 0)
    r["attempts"] = r["attempts"] or 1
    return r


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------------- text exposition format 0.0.4

def _value(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def _head(self, name: str, typ: str, doc: str) -> None:
        self.lines.append(f"# HELP {name} {doc.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
        self.lines.append(f"# TYPE {name} {typ}")

    def gauge(self, name: str, doc: str, samples) -> None:
        self._head(name, "gauge", doc)
        self.lines += [f"{name}{_labels(lab)} {_value(v)}" for lab, v in samples]

    def counter(self, name: str, doc: str, samples) -> None:
        self._head(name, "counter", doc)
        self.lines += [f"{name}{_labels(lab)} {_value(v)}" for lab, v in samples]

    def histogram(self, name: str, doc: str, samples) -> None:
        self._head(name, "histogram", doc)
        for lab, h in samples:
            cum = 0
            for b, c in zip(h.bounds, h.counts):
                cum += c
                self.lines.append(f"{name}_bucket{_labels(lab | {'le': _value(float(b))})} {cum}")
            self.lines.append(f"{name}_bucket{_labels(lab | {'le': '+Inf'})} {h.count}")
            self.lines.append(f"{name}_sum{_labels(lab)} {_value(h.sum)}")
            self.lines.append(f"{name}_count{_labels(lab)} {h.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
