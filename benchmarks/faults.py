"""Proof under fault (issue 8): the coordinator, run as a user runs it, against hostile input and crashes.

``python benchmarks/faults.py [--quick] [--only NAME ...]`` writes ``runs/bench/faults.json`` and prints a
summary. Every scenario runs real processes over a private Mosquitto (``coordinator.broker.Mosquitto``);
the coordinator is ``python -m coordinator.cli coordinator --config fleet.toml`` in a child process, except
in ``cut_mid_upload``, which needs to look inside it. Devices are ``edge.device`` agents on digits shards
(``coordinator.simulate.prepare``), in this process (with an ack spy) or, for the soak, in two children.

- **fuzz**: 10^5 hostile messages (``coordinator.faults.mutate`` of valid templates, raw bytes, and the
  named ``ATTACKS`` on a report of the run's model) published to the coordinator's topics of *fuzz ids*
  while 12 honest devices train. Without broker ACLs anyone may write any device's topic, and strikes
  would quarantine the honest ids, so the fuzz writes only other ids (with ``fedge credentials`` ACLs, no
  device can write another's topics). Fuzz check-ins declare a runtime the coordinator does not serve, so a
  mutation that stays valid registers an ineligible device instead of one that is selected and never
  reports (which would measure round time-outs, not robustness). Flow control: every 250 messages a marker
  report whose ack tells how far the coordinator has read, so the broker never drops a queued message and
  the coordinator's RSS is sampled against messages processed. The fuzz starts once round 1 has committed
  (which imports torch for the evaluation), and round r trains only once (r-1)/(rounds-1) of it is out, so
  the fuzz spans the rest of the run.
- **sigkill**: 20 SIGKILLs, each 0-1 s (seeded) after the coordinator's first commit since its last start,
  so they land mid-round, mid-commit or between rounds; each time restarted at once on the same state.
  6 devices, all needed every round (over-selection 1.0, min_reports = clients_per_round).
  ``reports_lost``: accepted acks whose task committed without that device. Then the same seed
  uninterrupted, and the final weights compared.
- **broker_restart**: Mosquitto stopped after the first accepted report of round 2 (its devices finish
  0.4 s apart, so the round is still open) and restarted on the same port 2 s later; it keeps no
  persistence, so every session and queued message is gone.
- **cut_mid_upload**: a device with 4 KiB chunks (a ~200 KB report) loses its socket after 10 chunks; the
  coordinator (in this process) must drop the partial transfer, and the round commits through
  over-selection.
- **poisoned_every_round**: every device selected every round, one of them a ``HostileDevice`` cycling over
  every attack family (quarantine off), against the same run without it, for FedAvg's mean with the default
  defences, ``median`` and ``trimmed_mean``; and a harsher variant whose device sends the well-formed
  sign-flipped update (``sign_flip_x5``) every round.
- **soak**: 200 devices in two processes, 200 rounds, coordinator RSS after every round; least-squares
  slope after a warm-up.

``crashes`` counts coordinator processes that died without being killed by the benchmark (and, for the
in-process coordinator, a handler that failed), over all scenarios.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.common import (SpyFleet, committed_rounds, honest_device, rss_mb, slope,  # noqa: E402
                               start_coordinator, wait_until, write_fleet_toml)
from coordinator.broker import Mosquitto  # noqa: E402

log = logging.getLogger("benchmarks.faults")
OUT = ROOT / "runs" / "bench" / "faults.json"
WORK = ROOT / "runs" / "bench" / "faults_work"
TINY = [64, 16, 10]
SMALL = [64, 32, 10]


@dataclass
class Ctx:
    """What every scenario gets: quick or full, where to put its files, the seed of its random choices."""

    quick: bool
    work: Path
    seed: int = 0


# ------------------------------------------------------------------ one run's files

@dataclass
class RunFiles:
    work: Path
    conf: Path
    state: Path
    log: Path
    specs: list[dict]
    test: tuple[np.ndarray, np.ndarray]
    rounds: int
    fleet: str


def _iid_specs(n: int, work: Path, fleet: str, seed: int) -> tuple[list[dict], tuple[np.ndarray, np.ndarray]]:
    """An even split of digits over ``n`` devices (a Dirichlet split of 1,438 images cannot give 200 devices
    five images each), written as ``prepare`` writes its shards."""
    from coordinator.datasets import load_digits_xy
    from edge.runtime.data import save_npz
    x, y = load_digits_xy()
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = len(y) // 5
    test, train = perm[:n_test], perm[n_test:]
    specs = []
    for i, idx in enumerate(np.array_split(train, n)):
        did = f"d{i:04d}"
        ddir = work / "devices" / did
        ddir.mkdir(parents=True, exist_ok=True)
        save_npz(ddir / "data.npz", x[idx], y[idx])
        specs.append({"id": did, "data": str(ddir / "data.npz"), "state": str(ddir), "fleet": fleet,
                      "chunk_bytes": 256 * 1024, "caps": {"runtime": "torch", "memory_mb": 2048, "battery": 0.9,
                                                          "charging": True, "network": "wifi", "idle": True}})
    return specs, (x[test], y[test])


def setup_run(work: Path, url: str, *, fleet: str, devices: int, rounds: dict[str, Any],
              strategy: dict[str, Any] | None = None, extra: dict[str, dict] | None = None, seed: int = 0,
              chunk_bytes: int = 256 * 1024, iid: bool = False) -> RunFiles:
    """A fresh directory with the devices' shards, the held-out test split and a ``fleet.toml``."""
    from coordinator.simulate import SimConfig, prepare
    from edge.runtime.data import save_npz
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    strategy = {"name": "fedavg", "sizes": TINY, "lr": 0.1} | (strategy or {})
    if iid:
        specs, test = _iid_specs(devices, work, fleet, seed)
    else:
        cfg = SimConfig(devices=devices, workdir=str(work), fleet=fleet, seed=seed, chunk_bytes=chunk_bytes)
        specs, data = prepare(cfg)
        test = (data.x_test, data.y_test)
    save_npz(work / "test.npz", *test)
    state = work / "state.sqlite"
    rounds = {"seed": seed, "fleet": fleet, "selection_timeout_s": 2} | rounds
    conf = write_fleet_toml(work / "fleet.toml", {
        "broker": {"url": url}, "state": {"path": str(state)}, "rounds": rounds,
        "eligibility": {"runtimes": ["torch"]}, "strategy": strategy, "data": {"test": str(work / "test.npz")},
        **(extra or {})})
    return RunFiles(work, conf, state, work / "coordinator.log", specs, test, rounds["rounds"], fleet)


def _ro(state: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=5.0)


def _run_id(state: Path) -> str:
    db = _ro(state)
    try:
        row = db.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()
        return row[0] if row else ""
    finally:
        db.close()


def _open_round(state: Path) -> tuple[str, int] | None:
    """The open task and how many reports it has accepted (read-only, while the coordinator runs)."""
    try:
        db = _ro(state)
        try:
            row = db.execute("SELECT task_id FROM rounds WHERE status='open' ORDER BY rowid DESC LIMIT 1").fetchone()
            if row is None:
                return None
            return row[0], db.execute("SELECT COUNT(*) FROM reports WHERE task_id=?", row).fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return None


def _finished_state(state: Path) -> dict[str, Any]:
    """What the state holds after the coordinator exited: committed rounds, abandoned tasks, weights,
    rejections (``Store`` may tidy report files now: nobody else has the state open)."""
    from coordinator.store import Store
    st = Store(state)
    try:
        rows = st.summaries()
        abandoned = [r[0] for r in st.db.execute("SELECT task_id FROM rounds WHERE status='abandoned'")]
        latest = st.latest_state()
        return {"summaries": rows, "abandoned": abandoned, "weights": latest.weights if latest else {},
                "rejections": st.rejections(), "devices": st.devices()}
    finally:
        st.close()


def _reports_lost(accepted: list[tuple[str, str]], fin: dict[str, Any]) -> dict[str, Any]:
    """Hold the state to the acks: an accepted (task, device) must be in that task's commit; a task that was
    abandoned is not a loss (the round was retried), one that is neither is."""
    committed = {r["task_id"]: set(r["accepted"]) for r in fin["summaries"]}
    abandoned = set(fin["abandoned"])
    pairs = sorted(set(accepted))
    lost = [p for p in pairs if p[0] in committed and p[1] not in committed[p[0]]]
    unknown = [p for p in pairs if p[0] not in committed and p[0] not in abandoned]
    return {"accepted_acks": len(pairs), "reports_lost": len(lost) + len(unknown), "lost": lost + unknown,
            "accepted_in_abandoned_tasks": sum(1 for p in pairs if p[0] in abandoned)}


def _finite(weights: dict[str, np.ndarray]) -> bool:
    return bool(weights) and all(np.isfinite(w).all() for w in weights.values())


def _acc(rows: list[dict], last: int = 3) -> float | None:
    accs = [r["accuracy"] for r in rows[-last:] if r.get("accuracy") is not None]
    return float(np.mean(accs)) if accs else None


class Daemon:
    """The coordinator subprocess of one run, restartable on its state. A death the benchmark did not cause
    is a crash; an exit 0 with every round committed is the end of the run."""

    def __init__(self, run: RunFiles):
        self.run = run
        self.proc: subprocess.Popen | None = None
        self.starts = self.crashes = 0
        self.crash_codes: list[int] = []
        self.started_at = 0.0
        self._exit_seen = True

    def start(self) -> "Daemon":
        self.proc = start_coordinator(self.run.conf, self.run.log)
        self.started_at = time.time()
        self.starts += 1
        self._exit_seen = False
        return self

    def running(self) -> bool:
        if self.proc is None:
            return False
        rc = self.proc.poll()
        if rc is None:
            return True
        if not self._exit_seen:
            self._exit_seen = True
            if rc != 0 or committed_rounds(self.run.state) < self.run.rounds:
                self.crashes += 1
                self.crash_codes.append(rc)
                log.error("coordinator exited with code %s; log tail:\n%s", rc, self.tail())
        return False

    def wait_connected(self, timeout: float = 60.0) -> None:
        def up() -> bool:
            if not self.running():
                raise RuntimeError(f"coordinator exited (code {self.proc.returncode}): {self.tail()}")
            return self.run.log.read_text(errors="replace").count("coordinator connected to") >= self.starts
        wait_until(up, timeout, "the coordinator to connect")

    def kill(self) -> None:
        """SIGKILL, as a power cut or the OOM killer would (not a crash: we did it)."""
        if self.proc is None or not self.running():  # gone already: counted as a crash if it was one
            return
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._exit_seen = True

    def finish(self, timeout: float) -> int | None:
        """Wait for the run to end; its exit code, or None if it did not end in time (it is then killed)."""
        end = time.time() + timeout
        while time.time() < end:
            if not self.running():
                return self.proc.returncode
            time.sleep(0.1)
        log.error("coordinator did not finish within %.0f s; log tail:\n%s", timeout, self.tail())
        self.kill()
        return None

    def tail(self, n: int = 3000) -> str:
        try:
            with open(self.run.log, "rb") as f:
                f.seek(max(0, os.path.getsize(self.run.log) - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stray_lines(self) -> int:
        """Log lines that do not start with the logger's timestamp (a traceback, or text a device smuggled in)."""
        with open(self.run.log, "rb") as f:
            return sum(1 for line in f if not line[:4].isdigit())

    def log_count(self, text: str) -> int:
        with open(self.run.log, "rb") as f:
            return sum(line.count(text.encode()) for line in f)


# ------------------------------------------------------------------ 1. fuzz

class Fuzzer:
    """Hostile messages for the coordinator's topics, written as fuzz ids. Nine in ten are
    ``faults.mutate`` of a valid message of the topic's kind (or a chunk), a quarter of those raw bytes; one
    in ten is a named attack (``faults.ATTACKS``) on a report shaped like the run's model."""

    def __init__(self, fleet: str, sizes: list[int], task: str, seed: int, n_ids: int = 32):
        from coordinator import faults
        from edge.model import init_weights, mlp
        from edge.protocol.wire import CheckIn, Chunk, Plan, Report, Status, TensorUpdate
        self.fleet, self.faults = fleet, faults
        self.rng = np.random.default_rng(seed)
        self.ids = [f"fz{i:02d}" for i in range(n_ids)]
        small = TensorUpdate((16, 64), np.ones((2, 64), np.float32), np.arange(16) < 2)
        msgs = [
            # a runtime nobody serves: a check-in that survives mutation registers an ineligible device
            CheckIn("fz00", {"runtime": "fuzz-rt", "charging": True, "battery": 0.5, "memory_mb": 1024}, [], 30,
                    task),
            Report(task, "fz00", 30, {"train_loss": 1.0},
                   {"fc0.weight": small, "fc0.bias": TensorUpdate((16,), np.ones(16, np.float32))},
                   {"qzs": np.ones(4, np.float32) / 4}),
            Status("fz00", "offline", 1.0),
            Chunk("m1", 0, 2, 600, b"x" * 300),
        ]
        tpl = faults.templates(msgs)
        self.templates = {k: [m for m in tpl if m["k"] in (k, "chunk")] for k in ("checkin", "report", "status")}
        w = init_weights(mlp(sizes), seed)
        rng = np.random.default_rng(seed + 1)
        self._model = {k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in w.items()}
        self._plan = Plan(task, 1, "fz00", 0.0, "fedavg", "torch", "0" * 64, w, {"lr": 0.1}, 1, {"dtype": "f4"})
        honest = Report(task, "fz00", 30, {"train_loss": 1.0},
                        {k: TensorUpdate(v.shape, v) for k, v in self._model.items()})
        # once each (rows_2_31 costs the attacker a 2 GiB mask to encode), then re-addressed per fuzz id
        self._attacks = {name: attack(honest, self._plan) for name, attack in faults.ATTACKS.items()}

    def next(self) -> tuple[str, bytes]:
        rng = self.rng
        dev = self.ids[int(rng.integers(len(self.ids)))]
        if rng.random() < 0.1:
            payload = list(self._attacks.values())[int(rng.integers(len(self._attacks)))]
            return self._topic("report", dev), _readdressed(payload, dev)
        kind = ("checkin", "report", "status")[int(rng.integers(3))]
        data = rng.bytes(int(rng.integers(1, 400)))
        return self._topic(kind, dev), self.faults.mutate(data, self.templates[kind], dev)

    def _topic(self, kind: str, dev: str) -> str:
        from edge.protocol import wire
        return wire.topic(self.fleet, kind, dev)


def _readdressed(payload: bytes, dev: str) -> bytes:
    """The message as if ``dev`` had sent it (unchanged if it is not a msgpack map with a device id)."""
    import msgpack
    try:
        m = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - truncated and other broken payloads go out as they are
        return payload
    if not isinstance(m, dict) or "device_id" not in m:
        return payload
    return msgpack.packb(m | {"device_id": dev}, use_bin_type=True)


class _Marks:
    """Markers in the fuzz stream: a report for an unknown task on ``fzmark``'s topic, which the coordinator
    acks 'rejected' once it has read everything published before it."""

    def __init__(self, pid: int, state: Path):
        self.pid, self.state = pid, state
        self.at: dict[str, int] = {}  # marker task id -> messages published before it
        self.confirmed = 0
        self.rss: list[tuple[int, float, int]] = []  # (messages confirmed, coordinator RSS MiB, rounds committed)
        self.cv = threading.Condition()

    def on_message(self, client, userdata, msg) -> None:
        from edge.protocol import wire
        try:
            ack = wire.decode(bytes(msg.payload))
        except wire.WireError:
            return
        with self.cv:
            n = self.at.get(ack.task_id)
            if n is not None and n > self.confirmed:
                self.confirmed = n
                try:
                    self.rss.append((n, rss_mb(self.pid), committed_rounds(self.state)))
                except (OSError, ValueError):
                    pass
                self.cv.notify_all()


def fuzz(ctx: Ctx) -> dict[str, Any]:
    """10^5 fuzzed messages through Mosquitto during a real run; the coordinator must stay up, keep its
    memory flat, and finish every round."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from edge.protocol import wire
    from edge.protocol.wire import Report
    n_msgs = 10_000 if ctx.quick else 100_000
    rounds = 8 if ctx.quick else 25
    every, window = 250, 2000
    with Mosquitto() as b:
        run = setup_run(ctx.work / "fuzz", b.url, fleet="fz", devices=12, seed=ctx.seed,
                        rounds={"rounds": rounds, "clients_per_round": 6, "over_selection": 1.3,
                                "round_timeout_s": 120})
        d = Daemon(run).start()
        pub = fleet = None
        progress = {"sent": 0}
        t_run = time.time()
        try:
            d.wait_connected()

            def paced(spec, url, pool):
                """Round r > 1 trains once (r - 1)/(rounds - 1) of the fuzz is out, so the fuzz spans the run
                after round 1 (which pays the torch imports: the devices' first training, the first evaluation)."""
                dev = honest_device(spec, url, pool)
                orig = dev._train

                def train(plan):
                    need = min(n_msgs, math.ceil(n_msgs * (plan.round - 1) / max(1, rounds - 1)))
                    end = time.time() + 600
                    while progress["sent"] < need and time.time() < end:
                        time.sleep(0.05)
                    orig(plan)
                dev._train = train
                return dev
            fleet = SpyFleet(run.specs, b.url, make=paced)
            wait_until(lambda: committed_rounds(run.state) >= 1 or not d.running(), 300, "round 1")
            fz = Fuzzer(run.fleet, TINY, f"{_run_id(run.state)}-r1a1", ctx.seed)
            marks = _Marks(d.proc.pid, run.state)
            pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fuzzer", clean_session=True,
                              protocol=mqtt.MQTTv311)
            pub.max_inflight_messages_set(1000)
            pub.max_queued_messages_set(0)
            pub.on_message = marks.on_message
            pub.connect("127.0.0.1", b.port)
            pub.subscribe(wire.topic(run.fleet, "ack", "fzmark"), qos=1)
            pub.loop_start()
            rss0 = rss_mb(d.proc.pid)
            t0 = time.time()
            bar = _bar(n_msgs, "fuzz messages")
            k, died = 0, False
            while progress["sent"] < n_msgs and not died:
                topic, payload = fz.next()
                pub.publish(topic, payload, qos=1)
                progress["sent"] += 1
                bar.update(1)
                if progress["sent"] % every == 0 or progress["sent"] == n_msgs:
                    k += 1
                    with marks.cv:
                        marks.at[f"mark{k}"] = progress["sent"]
                    pub.publish(wire.topic(run.fleet, "report", "fzmark"),
                                wire.encode(Report(f"mark{k}", "fzmark", 1, {}, {})), qos=1)
                    with marks.cv:  # flow control: the broker queues at most `window` unread messages
                        while progress["sent"] - marks.confirmed > window and not died:
                            died = not d.running()
                            marks.cv.wait(0.5)
                    died = died or not d.running()
            with marks.cv:
                end = time.time() + 120
                while marks.confirmed < n_msgs and time.time() < end and d.running():
                    marks.cv.wait(0.5)
            fuzz_s = time.time() - t0
            bar.close()
            rss_end = rss_mb(d.proc.pid) if d.running() else None
            rc = d.finish(300)
        finally:
            if pub is not None:
                pub.loop_stop()
                pub.disconnect()
            if fleet is not None:
                fleet.stop()
            d.kill()
    wall = time.time() - t_run
    fin = _finished_state(run.state)
    honest = {s["id"] for s in run.specs}
    rej_fuzz = sum(r["count"] for r in fin["rejections"] if r["device_id"] in fz.ids)
    rej_honest = [r for r in fin["rejections"] if r["device_id"] in honest]
    warm = [(n, r) for n, r, _ in marks.rss if n >= n_msgs // 10]
    rows = fin["summaries"]
    return {
        "messages": marks.confirmed, "published": progress["sent"], "markers": k,
        "messages_per_s": marks.confirmed / fuzz_s if fuzz_s else None, "fuzz_s": fuzz_s, "wall_s": wall,
        "rounds": len(rows), "rounds_wanted": rounds, "exit_code": rc, "crashes": d.crashes,
        "coordinator_died_during_fuzz": died,
        "rounds_committed_during_fuzz": (marks.rss[-1][2] - marks.rss[0][2]) if marks.rss else 0,
        "all_rounds_committed": [r["round"] for r in rows] == list(range(1, rounds + 1)),
        "final_weights_finite": _finite(fin["weights"]), "final_accuracy": _acc(rows, 1),
        "rejections_recorded_for_fuzz_ids": rej_fuzz,
        "fuzz_ids_registered": sum(1 for dv in fin["devices"] if dv["device_id"] in fz.ids),
        "honest_devices_rejected": [(r["device_id"], r["what"], r["last_reason"]) for r in rej_honest],
        "honest_devices_quarantined": sum(1 for dv in fin["devices"] if dv["device_id"] in honest
                                          and dv["quarantines"]),
        "internal_errors_logged": d.log_count("internal error"),
        "tracebacks_logged": d.log_count("Traceback"),
        "log_lines_not_from_a_log_call": d.stray_lines(),
        "rss_start_mb": rss0, "rss_end_mb": rss_end, "rss_max_mb": max((r for _, r, _ in marks.rss), default=None),
        "rss_after_warmup_mb": warm[0][1] if warm else None, "rss_warm_samples": len(warm),
        "rss_slope_mb_per_1e4_messages": slope([n for n, _ in warm], [r for _, r in warm]) * 1e4,
        "rss_slope_second_half_mb_per_1e4_messages": slope([n for n, _ in warm if n > n_msgs // 2],
                                                           [r for n, r in warm if n > n_msgs // 2]) * 1e4,
        "rss_series": _thin(marks.rss, 50),
        "note": "fuzz ids only: without broker ACLs anyone may write any device's topics, and strikes on an honest "
                "id would quarantine that device; with `fedge credentials` ACLs a device can write only its own. "
                "Fuzz check-ins declare a runtime the coordinator does not serve, so valid ones register "
                "ineligible devices. The fuzz starts once round 1 has committed (the first evaluation imports torch, "
                "~200 MB); the RSS slope is fitted over markers after 10% of the messages. rss_series: (messages, "
                "MiB, rounds committed).",
    }


def _thin(series: list, n: int) -> list:
    if len(series) <= n:
        return series
    step = len(series) / n
    return [series[int(i * step)] for i in range(n)] + [series[-1]]


def _bar(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="msg" if "message" in desc else "round", leave=False, disable=None)


# ------------------------------------------------------------------ 2. sigkill

def _sigkill_run(ctx: Ctx, url: str, name: str, rounds: int, kills: int) -> dict[str, Any]:
    """One run with ``kills`` SIGKILLs. Each start must resume (commit a round) within 120 s; the kill then
    comes 0-1 s later (seeded), wherever the run is: mid-round, committing, between rounds. Progress is read
    from the state, not from acks: an ack the dead process sent can reach a device after the restart."""
    run = setup_run(ctx.work / f"sigkill_{name}", url, fleet=f"sk{name}", devices=6, seed=ctx.seed,
                    rounds={"rounds": rounds, "clients_per_round": 6, "over_selection": 1.0, "min_reports": 6,
                            "round_timeout_s": 10})
    d = Daemon(run).start()
    fleet = None
    events: list[dict[str, Any]] = []
    rng = np.random.default_rng(ctx.seed + 17)
    t0 = time.time()
    base = 0  # rounds committed when the current process started
    try:
        d.wait_connected()
        fleet = SpyFleet(run.specs, url)
        for i in range(kills + 1):
            try:
                wait_until(lambda: committed_rounds(run.state) > base or not d.running(), 120,
                           "the coordinator to commit a round after its start")
                resumed = committed_rounds(run.state) > base
            except TimeoutError:
                resumed = False
            if events:
                events[-1]["resumed"] = resumed
                events[-1]["resume_s"] = round(time.time() - d.started_at, 3) if resumed else None
            if i == kills or not d.running():
                break
            at = time.time() + float(rng.uniform(0.0, 1.0))
            while time.time() < at and d.running():
                time.sleep(0.01)
            if not d.running():
                break
            opened = _open_round(run.state)
            ev = {"kill": i + 1, "after_start_s": round(time.time() - d.started_at, 3),
                  "open_task": opened[0] if opened else None, "open_accepted": opened[1] if opened else None}
            d.kill()
            base = ev["committed"] = committed_rounds(run.state)
            events.append(ev)
            d.start()
        if len(events) < kills:
            log.warning("the run ended after %d of %d kills", len(events), kills)
        rc = d.finish(300)
    finally:
        if fleet is not None:
            fleet.stop()
        d.kill()
    wall = time.time() - t0
    fin = _finished_state(run.state)
    rows = fin["summaries"]
    resume = [e["resume_s"] for e in events if e.get("resume_s") is not None]
    return {"rounds": len(rows), "exit_code": rc, "crashes": d.crashes, "starts": d.starts, "wall_s": wall,
            "kills": events, "weights": fin["weights"],
            "resume_s_median": float(np.median(resume)) if resume else None,
            "resume_s_max": max(resume) if resume else None,
            "kills_mid_round": sum(1 for e in events if e["open_task"] and e["open_accepted"]),
            "abandoned_attempts": len(fin["abandoned"]),
            "acks_duplicate": sum(1 for _, a in fleet.acks if a.status == "duplicate"),
            "acks_late": sum(1 for _, a in fleet.acks if a.status == "late"),
            "every_round_has_every_device": all(r["reports"] == 6 == len(r["accepted"]) for r in rows),
            "final_accuracy": _acc(rows, 1),
            **_reports_lost(fleet.accepted(), fin)}


CLOSE = 1e-5  # final weights of the killed run against the uninterrupted one (float32 summation order)


def sigkill(ctx: Ctx) -> dict[str, Any]:
    """SIGKILL the coordinator at random points of one run; nothing accepted may be lost, and the run must end
    with the model of an uninterrupted run of the same seed."""
    kills = 3 if ctx.quick else 20
    rounds = 20 if ctx.quick else 120
    with Mosquitto() as b:
        log.info("sigkill: the uninterrupted run (%d rounds)", rounds)
        ref = _sigkill_run(ctx, b.url, "ref", rounds, 0)
        log.info("sigkill: the run killed %d times", kills)
        got = _sigkill_run(ctx, b.url, "kill", rounds, kills)
    wa, wb = got.pop("weights"), ref.pop("weights")
    same_keys = bool(wa) and set(wa) == set(wb)
    equal = same_keys and all(wa[k].dtype == wb[k].dtype and np.array_equal(wa[k], wb[k]) for k in wa)
    diff = max(float(np.abs(wa[k].astype(np.float64) - wb[k]).max()) for k in wa) if same_keys else None
    n_diff = int(sum(int((wa[k] != wb[k]).sum()) for k in wa)) if same_keys else None
    return {"sigkills": len(got["kills"]), "sigkills_survived": sum(bool(e.get("resumed")) for e in got["kills"]),
            "reports_lost": got["reports_lost"], "final_weights_equal": equal, "max_abs_diff": diff,
            "final_weights_close": diff is not None and diff <= CLOSE,
            "weights_differing": n_diff, "weights_total": int(sum(v.size for v in wa.values())) if wa else 0,
            "crashes": got["crashes"] + ref["crashes"], "killed": got, "uninterrupted": ref,
            "note": "6 devices, all needed every round (over_selection 1.0, min_reports 6). Each kill 0-1 s (seeded) "
                    "after the coordinator's first commit since its last start; a restart survived if it committed "
                    "a round within 120 s (resume_s: from the restart to that commit, which includes importing "
                    "torch for the first evaluation). reports_lost: accepted acks whose task committed without "
                    "that device (accepted_in_abandoned_tasks: a retried round, not a loss). The coordinator "
                    "runs in production mode, where FedAvg sums updates in a float32 buffer (folded into float64 "
                    "every 32 reports), so the aggregate depends on the order reports arrive in at float32 "
                    "rounding: final_weights_close (max |diff| <= 1e-5) is the check; a lost or doubled report "
                    "moves weights by a tenth of an update. Reproducible mode sums in a seeded order and is bit "
                    "for bit (tests/test_reproducible.py)."}


# ------------------------------------------------------------------ 3. broker restart

def broker_restart(ctx: Ctx) -> dict[str, Any]:
    """Mosquitto stopped mid-round and started again on the same port: the run must finish."""
    rounds, down_s = (4 if ctx.quick else 6), 2.0
    b = Mosquitto()
    port = b.port
    run = setup_run(ctx.work / "broker_restart", b.url, fleet="br", devices=8, seed=ctx.seed,
                    rounds={"rounds": rounds, "clients_per_round": 4, "over_selection": 1.5, "round_timeout_s": 10,
                            "selection_timeout_s": 1})
    d = Daemon(run).start()
    fleet = None
    out: dict[str, Any] = {}
    order = {s["id"]: i for i, s in enumerate(run.specs)}

    def staggered(spec, url, pool):
        """In round 2 the devices finish 0.4 s apart, so the round is open with some reports in when the
        broker goes (a round of this model otherwise lasts a few tens of ms)."""
        dev = honest_device(spec, url, pool)
        orig = dev._train
        dev._train = lambda plan: (time.sleep(0.4 * order[spec["id"]] if plan.round == 2 else 0), orig(plan))
        return dev
    try:
        d.wait_connected()
        fleet = SpyFleet(run.specs, b.url, make=staggered, threads=len(run.specs))
        wait_until(lambda: any("-r2a" in t for t, _ in fleet.accepted()) or not d.running(), 120,
                   "a report accepted in round 2")
        out["committed_at_stop"] = committed_rounds(run.state)
        opened = _open_round(run.state)
        out["open_task_at_stop"], out["accepted_at_stop"] = opened if opened else (None, None)
        b.stop()
        t_down = time.time()
        time.sleep(down_s)
        b = Mosquitto(port)
        t_up = time.time()
        out["broker_down_s"] = t_up - t_down
        wait_until(lambda: fleet.accepted(since=t_up) or not d.running(), 120, "a report accepted after the restart")
        first = min((t for t, a in list(fleet.acks) if a.status == "accepted" and t >= t_up), default=None)
        out["recover_first_accept_s"] = first - t_up if first else None
        wait_until(lambda: committed_rounds(run.state) > out["committed_at_stop"] or not d.running(), 120,
                   "a commit after the restart")
        out["recover_commit_s"] = time.time() - t_up
        rc = d.finish(180)
    finally:
        if fleet is not None:
            fleet.stop()
        d.kill()
        b.stop()
    fin = _finished_state(run.state)
    rows = fin["summaries"]
    again = [t for t in _log_times(run.log, "coordinator connected to") if t >= t_up - 0.01]
    out["coordinator_reconnected_s"] = again[0] - t_up if again else None
    return out | {"rounds": len(rows), "rounds_wanted": rounds, "exit_code": rc, "crashes": d.crashes,
                  "abandoned_attempts": len(fin["abandoned"]), "final_accuracy": _acc(rows, 1),
                  **_reports_lost(fleet.accepted(), fin),
                  "note": "times from the broker's restart: the coordinator's reconnection (its log; back-off with "
                          "jitter), the first accepted report (device side), the next commit (state polled at 50 "
                          "ms)."}


def _log_times(path: Path, text: str) -> list[float]:
    """Epoch times of the log lines that contain ``text`` (the logger's asctime is local time, ms)."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            if text in line:
                try:
                    out.append(time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1e3)
                except ValueError:
                    pass
    return out


# ------------------------------------------------------------------ 4. cut mid-upload

def cut_mid_upload(ctx: Ctx) -> dict[str, Any]:
    """A device's socket dropped after 10 of ~50 chunks of its report: the coordinator must free the partial
    transfer at once (the broker's last will says the device is gone) and commit through over-selection."""
    from coordinator.simulate import SimConfig, build_coordinator, prepare
    from edge.protocol import wire
    victim, after = "d0000", 10
    with Mosquitto() as b:
        # 6 devices, 6 selected (4 x 1.5): the victim is always in round 1
        cfg = SimConfig(devices=6, clients_per_round=4, over_selection=1.5, rounds=3, hidden=(256, 128),
                        chunk_bytes=4096, round_timeout_s=60, selection_timeout_s=1, seed=ctx.seed, fleet="cut",
                        workdir=str(ctx.work / "cut_mid_upload"))
        shutil.rmtree(cfg.workdir, ignore_errors=True)
        specs, data = prepare(cfg)
        rows: list[dict] = []
        commit_times: list[float] = []
        coord = build_coordinator(cfg, b.url, (data.x_test, data.y_test),
                                  lambda r: (rows.append(r), commit_times.append(time.time()))).start()
        reasm = coord.machine._reasm
        release, cut = threading.Event(), threading.Event()
        sent: dict[str, Any] = {"chunks": 0, "total": None, "bytes": None}
        out: dict[str, Any] = {}

        def make(spec, url, pool):
            dev = honest_device(spec, url, pool)
            if spec["id"] != victim:  # the others wait until the cut is done, so the round is still open
                orig = dev._train
                dev._train = lambda plan, orig=orig: (release.wait(120), orig(plan))
                return dev
            publish = dev.link.publish
            report_topic = wire.topic(spec["fleet"], "report", victim)

            def cut_after(topic, payload, qos=1, retain=False):
                if topic != report_topic:
                    return publish(topic, payload, qos, retain)
                if sent["total"] is None:
                    sent["total"] = len(dev.agent._report_msgs)
                    sent["bytes"] = sum(len(m) for m in dev.agent._report_msgs)
                if sent["chunks"] < after:
                    sent["chunks"] += 1
                    publish(topic, payload, qos, retain)
                else:
                    cut.set()  # the rest never leaves: the device is about to lose its socket
            dev.link.publish = cut_after
            return dev

        fleet = None
        try:
            if not coord.link.connected.wait(30):
                raise TimeoutError("coordinator did not connect")
            # a thread per device: the held ones must not keep the victim's training waiting in the queue
            fleet = SpyFleet(specs, b.url, make=make, threads=len(specs))
            wait_until(cut.is_set, 120, "the victim to start its upload")

            def partial() -> int:
                try:
                    return sum(len(st["parts"]) for (s, _), st in list(reasm._open.items()) if s == victim)
                except RuntimeError:  # resized while we looked
                    return 0
            wait_until(lambda: partial() >= after, 30, "the coordinator to hold the victim's chunks")
            out["open_transfers_before_cut"] = len(reasm._open)
            out["reserved_bytes_before_cut"] = reasm.reserved
            out["chunks_held_before_cut"] = partial()
            t_cut = time.time()
            fleet.devs[victim].kill()  # socket closed without DISCONNECT: the broker publishes the will
            wait_until(lambda: coord.machine.open is not None and victim in coord.machine.open.finished, 30,
                       "the coordinator to see the victim gone")
            out["dropped_after_s"] = time.time() - t_cut
            out["open_transfers_after_cut"] = len(reasm._open)
            out["reserved_bytes_after_cut"] = reasm.reserved
            release.set()
            done = coord.wait(120)
            out["round1_committed_after_cut_s"] = commit_times[0] - t_cut if commit_times else None
            # a straggler of the last round may still be uploading (its report will be acked 'late'): give it
            # time, then see what is left: stale transfers (see the note) must go when they time out
            try:
                wait_until(lambda: not reasm._open, 30, "stragglers' uploads to end")
            except TimeoutError:
                pass
            now = time.time()
            out["open_transfers_at_end"] = [
                {"sender": k[0], "msg_id": k[1], "chunks": len(st["parts"]), "of": st["n"],
                 "idle_s": round(now - st["last"], 1)} for k, st in list(reasm._open.items())]
            out["victim_open_transfers_at_end"] = sum(1 for k in list(reasm._open) if k[0] == victim)
            if reasm._open and not ctx.quick:
                t_stale = time.time()
                try:
                    wait_until(lambda: not reasm._open, reasm.timeout_s + 10, "stale transfers to time out")
                    out["stale_transfers_gone_after_s"] = round(time.time() - t_stale, 1)
                except TimeoutError:
                    out["stale_transfers_gone_after_s"] = None
        finally:
            release.set()
            if fleet is not None:
                fleet.stop()
            coord.stop()
    return out | {
        "victim_chunks_sent": sent["chunks"], "victim_chunks_total": sent["total"],
        "report_bytes": sent["bytes"], "open_transfers": len(reasm._open),
        "reserved_bytes": reasm.reserved, "finished": done, "crashes": int(coord.error is not None),
        "rounds": len(rows), "round1_reports": rows[0]["reports"] if rows else None,
        "round1_victim_accepted": victim in rows[0]["accepted"] if rows else None,
        "final_accuracy": _acc(rows, 1),
        "note": "in-process coordinator (coordinator.simulate.build_coordinator) so its reassembler can be read; "
                "chunk_bytes 4096 for plans and reports; the other devices train only after the cut. "
                "*_after_cut: once the coordinator has the victim's last will, before the round commits. "
                "open_transfers_at_end: after the run, once the last round's stragglers have had 30 s to finish. "
                "A straggler whose round closed mid-upload leaves a stale transfer behind: the close drops its "
                "partial transfer, the rest of its chunks open a new one, its resend completes that one, and the "
                "resend's tail opens another that nothing completes; it holds its reserved bytes and one of the "
                "device's two slots until the reassembler's time-out (60 s). open_transfers / reserved_bytes: "
                "after that time-out (full mode)."}


# ------------------------------------------------------------------ 5. poisoned every round

def _poison_run(ctx: Ctx, url: str, name: str, aggregate: str, attacks: list[str] | None,
                rounds: int) -> dict[str, Any]:
    """8 devices (7 without the hostile one), every one selected every round; quarantine off."""
    from coordinator.faults import HostileDevice
    from edge.protocol.agent import AgentConfig
    from edge.runtime.data import load_npz
    from edge.runtime.mqtt import BrokerAddress
    hostile_id, n = "d0007", 8
    strategy = {"sizes": SMALL, "lr": 0.1, "epochs": 2, "aggregate": aggregate}
    if aggregate == "trimmed_mean":
        strategy["trim"] = 0.2
    run = setup_run(ctx.work / f"poison_{name}", url, fleet=f"p{name.replace('_', '')}", devices=n, seed=ctx.seed,
                    strategy=strategy, extra={"quarantine": {"after": 100000}},
                    rounds={"rounds": rounds, "clients_per_round": n if attacks else n - 1, "over_selection": 1.0,
                            "min_reports": n - 1, "round_timeout_s": 30})
    specs = run.specs if attacks else [s for s in run.specs if s["id"] != hostile_id]
    hostile: list[Any] = []

    def make(spec, url, pool):
        if spec["id"] != hostile_id:
            return honest_device(spec, url, pool)
        x, y = load_npz(spec["data"])
        dev = HostileDevice(AgentConfig(spec["id"], fleet=spec["fleet"], capabilities=spec["caps"]), x, y,
                            spec["state"], BrokerAddress.parse(url), executor=pool, attacks=attacks,
                            trainer_kw={"threads": 1})
        hostile.append(dev)
        return dev
    d = Daemon(run).start()
    fleet = None
    try:
        d.wait_connected()
        fleet = SpyFleet(specs, url, make=make)
        rc = d.finish(300)
    finally:
        if fleet is not None:
            fleet.stop()
        d.kill()
    fin = _finished_state(run.state)
    rows = fin["summaries"]
    return {"aggregate": aggregate, "rounds": len(rows), "exit_code": rc, "crashes": d.crashes,
            "final_accuracy": _acc(rows, 1), "accuracy_last3": _acc(rows, 3),
            "accuracy_at_half": _acc(rows[:len(rows) // 2 + 1], 3),
            "final_weights_finite": _finite(fin["weights"]),
            "abandoned_attempts": len(fin["abandoned"]),
            "hostile_admitted_rounds": sum(1 for r in rows if hostile_id in r["accepted"]),
            "hostile_sent": hostile[0].sent if hostile else [],
            "hostile_rejected": sum(r["count"] for r in fin["rejections"] if r["device_id"] == hostile_id),
            "accuracy_curve": [round(r["accuracy"], 4) for r in rows if r.get("accuracy") is not None]}


def poisoned_every_round(ctx: Ctx) -> dict[str, Any]:
    """One hostile participant in every round: does the model still converge, and with which aggregation?"""
    from coordinator.faults import ATTACKS, POISON
    rounds, tol = (6 if ctx.quick else 20), 0.05
    aggs = ("mean", "median", "trimmed_mean")
    cycle = list(POISON) + [a for a in ATTACKS if a not in POISON]  # the poison first: quick runs meet it too
    variants = {"cycle": cycle} | ({} if ctx.quick else {"sign_flip": list(POISON)})
    res: dict[str, Any] = {"rounds": rounds, "tolerance": tol, "attacks_cycled": cycle, "settings": {}}
    crashes = 0
    with Mosquitto() as b:
        for agg in aggs:
            log.info("poisoned_every_round: %s, clean", agg)
            clean = _poison_run(ctx, b.url, f"{agg}_clean", agg, None, rounds)
            crashes += clean["crashes"]
            for v, attacks in variants.items():
                log.info("poisoned_every_round: %s, hostile (%s)", agg, v)
                hit = _poison_run(ctx, b.url, f"{agg}_{v}", agg, attacks, rounds)
                crashes += hit["crashes"]
                ok = (hit["exit_code"] == 0 and hit["rounds"] == rounds and hit["final_weights_finite"]
                      and clean["accuracy_last3"] is not None and hit["accuracy_last3"] is not None
                      and hit["accuracy_last3"] >= clean["accuracy_last3"] - tol)
                res["settings"][f"{agg}/{v}"] = {
                    "holds": ok, "accuracy": hit["accuracy_last3"], "clean_accuracy": clean["accuracy_last3"],
                    "delta": (hit["accuracy_last3"] - clean["accuracy_last3"]
                              if hit["accuracy_last3"] is not None and clean["accuracy_last3"] is not None else None),
                    "hostile": hit, "clean": clean}
    res["crashes"] = crashes
    res["holds"] = sorted(k for k, v in res["settings"].items() if v["holds"])
    res["fails"] = sorted(k for k, v in res["settings"].items() if not v["holds"])
    res["note"] = ("accuracy = mean of the last 3 rounds' held-out accuracy (accuracy_at_half: of the 3 rounds up to "
                   "half-way, to show the trend); 'holds' = the run finished every round "
                   f"with finite weights and accuracy within {tol} of the same run without the hostile device "
                   "(same aggregation). 8 devices, all selected each round, min_reports 7; quarantine off "
                   "([quarantine] after = 100000). trimmed_mean uses trim = 0.2: the default 0.1 cuts "
                   "int(0.1 * 8) = 0 reports per side. Default defences: norm bound 10x the last median norm, "
                   "max_accuracy_drop 0.25.")
    return res


# ------------------------------------------------------------------ 6. soak

def soak(ctx: Ctx) -> dict[str, Any]:
    """200 devices, 200 rounds over Mosquitto: the coordinator's RSS after every round must stay flat."""
    from coordinator.simulate import DeviceFleet
    n, rounds = (40, 30) if ctx.quick else (200, 200)
    warmup = max(5, rounds // 10)
    with Mosquitto() as b:
        run = setup_run(ctx.work / "soak", b.url, fleet="soak", devices=n, seed=ctx.seed, iid=True,
                        rounds={"rounds": rounds, "clients_per_round": 10, "over_selection": 1.3,
                                "round_timeout_s": 30})
        d = Daemon(run).start()
        fleet = None
        series: list[tuple[int, float]] = []
        t0 = time.time()
        try:
            d.wait_connected()
            fleet = DeviceFleet(run.specs, b.url, 2)
            bar = _bar(rounds, "soak rounds")
            last = 0
            while d.running():
                c = committed_rounds(run.state)
                if c > last:
                    try:
                        series.append((c, rss_mb(d.proc.pid)))
                    except (OSError, ValueError):  # it just exited
                        break
                    bar.update(c - last)
                    last = c
                if time.time() - t0 > 1800:
                    raise TimeoutError("soak did not finish in 30 min")
                time.sleep(0.02)
            bar.close()
            rc = d.finish(60)
        finally:
            if fleet is not None:
                fleet.stop()
            d.kill()
    wall = time.time() - t0
    fin = _finished_state(run.state)
    rows = fin["summaries"]
    warm = [(r, m) for r, m in series if warmup < r < rounds]  # after the last commit it is shutting down
    return {"devices": n, "rounds": len(rows), "rounds_wanted": rounds, "exit_code": rc, "crashes": d.crashes,
            "wall_s": wall, "warmup_rounds": warmup, "rss_samples": len(series),
            "rss_slope_mb_per_round": slope([r for r, _ in warm], [m for _, m in warm]),
            "rss_after_warmup_mb": warm[0][1] if warm else None, "rss_end_mb": series[-1][1] if series else None,
            "rss_max_mb": max((m for _, m in series), default=None),
            "final_accuracy": _acc(rows, 1), "abandoned_attempts": len(fin["abandoned"]),
            "rss_series": [(r, round(m, 2)) for r, m in series],
            "note": f"10 per round (13 selected), model {TINY}, devices in 2 processes; RSS read after each "
                    f"commit seen in the state (polled at 20 ms), slope fitted over rounds {warmup + 1}-{rounds - 1} "
                    "(after the last commit the process is already shutting down)."}


# ------------------------------------------------------------------ main

SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "fuzz": fuzz, "sigkill": sigkill, "broker_restart": broker_restart, "cut_mid_upload": cut_mid_upload,
    "poisoned_every_round": poisoned_every_round, "soak": soak,
}


def headline(res: dict[str, Any]) -> dict[str, Any]:
    """The issue's top-level figures from the scenario sections (None where a scenario did not run)."""
    fz, sk, so = (res.get(k) or {} for k in ("fuzz", "sigkill", "soak"))
    return {"fuzz_messages": fz.get("messages"),
            "crashes": sum(int(res[k].get("crashes", 0) or 0) for k in SCENARIOS if isinstance(res.get(k), dict)),
            "sigkills": sk.get("sigkills"), "sigkills_survived": sk.get("sigkills_survived"),
            "reports_lost": sk.get("reports_lost"), "soak_rss_slope_mb_per_round": so.get("rss_slope_mb_per_round")}


def summary_text(res: dict[str, Any]) -> str:
    def f(v, fmt="{:.3f}"):
        return "-" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))
    lines = [f"faults ({'quick' if res['quick'] else 'full'}): crashes {res['crashes']}, fuzz messages "
             f"{f(res['fuzz_messages'])}, SIGKILLs survived {f(res['sigkills_survived'])}/{f(res['sigkills'])}, "
             f"reports lost {f(res['reports_lost'])}, soak RSS slope "
             f"{f(res['soak_rss_slope_mb_per_round'], '{:+.4f}')} MB/round"]
    s = res.get("fuzz")
    if s and "error" not in s:
        lines.append(f"  fuzz: {s['messages']} messages in {s['fuzz_s']:.0f} s ({s['messages_per_s']:.0f}/s); "
                     f"{s['rounds']}/{s['rounds_wanted']} rounds ({s['rounds_committed_during_fuzz']} during it), "
                     f"exit {s['exit_code']}; RSS {f(s['rss_after_warmup_mb'], '{:.1f}')} -> "
                     f"{f(s['rss_end_mb'], '{:.1f}')} MB (slope {s['rss_slope_mb_per_1e4_messages']:+.3f} MB per 10^4 "
                     f"messages, {s['rss_slope_second_half_mb_per_1e4_messages']:+.3f} over the second half); "
                     f"internal errors {s['internal_errors_logged']}, stray log lines "
                     f"{s['log_lines_not_from_a_log_call']}, honest devices rejected "
                     f"{len(s['honest_devices_rejected'])}, fuzz ids registered {s['fuzz_ids_registered']}")
    s = res.get("sigkill")
    if s and "error" not in s:
        k, r = s["killed"], s["uninterrupted"]
        lines.append(f"  sigkill: {s['sigkills_survived']}/{s['sigkills']} restarts resumed (median "
                     f"{f(k['resume_s_median'], '{:.1f}')} s), {k['kills_mid_round']} kills mid-round, "
                     f"{k['rounds']} rounds, "
                     f"exit {k['exit_code']}, {k['accepted_acks']} accepted acks, {s['reports_lost']} lost, "
                     f"{k['accepted_in_abandoned_tasks']} in abandoned attempts ({k['abandoned_attempts']}); final "
                     f"weights within {CLOSE:g} of the uninterrupted run: {s.get('final_weights_close')} (max |diff| "
                     f"{f(s['max_abs_diff'], '{:.3g}')}, {s['weights_differing']}/{s['weights_total']} differ; "
                     f"accuracy {f(k['final_accuracy'])} vs {f(r['final_accuracy'])})")
    s = res.get("broker_restart")
    if s and "error" not in s:
        lines.append(f"  broker_restart: {s['rounds']}/{s['rounds_wanted']} rounds, exit {s['exit_code']}; down "
                     f"{s['broker_down_s']:.1f} s; after its restart the coordinator reconnected in "
                     f"{f(s['coordinator_reconnected_s'], '{:.2f}')} s, the first report was accepted in "
                     f"{f(s['recover_first_accept_s'], '{:.2f}')} s, the next round committed in "
                     f"{s['recover_commit_s']:.2f} s; {s['abandoned_attempts']} abandoned "
                     f"attempts, {s['reports_lost']} reports lost")
    s = res.get("cut_mid_upload")
    if s and "error" not in s:
        lines.append(f"  cut_mid_upload: {s['victim_chunks_sent']}/{s['victim_chunks_total']} chunks sent, "
                     f"{s['open_transfers_before_cut']} open transfer before the cut, "
                     f"{s['open_transfers_after_cut']} after ({f(s['dropped_after_s'], '{:.2f}')} s), "
                     f"{len(s['open_transfers_at_end'])} when the run ended (the victim's: "
                     f"{s['victim_open_transfers_at_end']}), {s['open_transfers']} after the reassembler's time-out"
                     f" ({f(s.get('stale_transfers_gone_after_s'), '{:.0f}')} s); round 1 committed with "
                     f"{s['round1_reports']} reports {f(s['round1_committed_after_cut_s'], '{:.2f}')} s after the cut, "
                     f"victim accepted: {s['round1_victim_accepted']}; {s['rounds']} rounds")
    s = res.get("poisoned_every_round")
    if s and "error" not in s:
        for k, v in s["settings"].items():
            h = v["hostile"]
            lines.append(f"  poisoned {k:<22} {'holds' if v['holds'] else 'FAILS'}: accuracy {f(v['accuracy'])} "
                         f"({f(h['accuracy_at_half'])} half-way) vs clean {f(v['clean_accuracy'])}; hostile admitted "
                         f"in {h['hostile_admitted_rounds']}/{h['rounds']} rounds, {h['abandoned_attempts']} attempts "
                         f"abandoned")
    s = res.get("soak")
    if s and "error" not in s:
        lines.append(f"  soak: {s['devices']} devices, {s['rounds']}/{s['rounds_wanted']} rounds in {s['wall_s']:.0f}"
                     f" s, exit {s['exit_code']}; RSS {f(s['rss_after_warmup_mb'], '{:.1f}')} -> "
                     f"{f(s['rss_end_mb'], '{:.1f}')} MB, slope {s['rss_slope_mb_per_round']:+.4f} MB/round")
    for k in SCENARIOS:
        if isinstance(res.get(k), dict) and "error" in res[k]:
            lines.append(f"  {k}: ERROR {res[k]['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/faults.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer messages, kills, rounds, devices")
    ap.add_argument("--only", action="append", choices=list(SCENARIOS), metavar="NAME",
                    help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("fedge").setLevel(logging.ERROR)  # the coordinators log to their own files
    logging.getLogger("fedge.device").setLevel(logging.CRITICAL)  # hostile devices complain every round
    ctx = Ctx(a.quick, WORK, a.seed)
    res: dict[str, Any] = {"quick": a.quick, "seed": a.seed, "cpus": os.cpu_count(), "machine": platform.machine(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "loadavg_start": os.getloadavg()}
    if res["loadavg_start"][0] > 1.0:
        log.warning("load average %.1f before starting: timings will be inflated", res["loadavg_start"][0])
    failed = False
    for name in a.only or list(SCENARIOS):
        log.info("scenario %s", name)
        t0 = time.time()
        try:
            res[name] = SCENARIOS[name](ctx)
        except Exception as e:  # keep the other scenarios' figures; the error is part of the result
            log.exception("scenario %s failed", name)
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            failed = True
        res[name]["scenario_s"] = round(time.time() - t0, 1)
        log.info("scenario %s done in %.0f s", name, res[name]["scenario_s"])
    res["loadavg_end"] = os.getloadavg()
    res = headline(res) | res
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(summary_text(res))
    log.info("wrote %s", a.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
