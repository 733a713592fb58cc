"""FedAvg over MQTT: where a round's seconds go, and how fast the coordinator ingests reports.

``python benchmarks/fedavg_mqtt.py [--quick] [--mode all|fleet|ingest] [--profile]``
writes ``runs/bench/fedavg_mqtt.json`` and prints a summary.

**Fleet mode** (the product path): 50 devices (sklearn digits, Dirichlet 0.5), 10 per round (13 selected:
over-selection 1.3), 100 rounds of MLP 64-200-200-10, one local epoch, over a private Mosquitto; devices run
in 2 child processes with one training thread each (exactly ``fedge simulate``'s layout), the coordinator
runs in this process. Devices cannot be changed to report timings, so the split is measured from outside:

- *round time*: time between two commits on the coordinator (round 1: from its opening), evaluation
  included, so rounds x mean = the run's time after round 1 opens.
- *training*: ``edge.client.run_plan`` timed on every device's own shard in a child process before the fleet
  starts (same torch trainer, same hyperparameters, 1 thread; median of 7), plus the one-off costs a
  device pays: its trainer build on its first plan, and torch's lazy import on its process's first plan
  (timed in a fresh interpreter). A device process trains its plans one after another on one thread, so a
  round costs ``max over processes of the sum of its selected devices' trainings``; every selected device
  of every attempt counts (the 3 over-selected ones still occupy their process's trainer).
- *coordinator*: wall time inside the coordinator's handlers on its MQTT thread, as the daemon reports them to
  its observer (coordinator/observe.py): the round machine's ``receive`` / ``tick`` (decode, validate,
  aggregate, encode plans), SQLite writes, hand-offs to paho and the evaluation that vets a commit. The
  handlers' thread CPU time is recorded too: wall minus CPU is time spent waiting for one of the 2 cores.
- *transfer*: round time minus the two above: broker hops, polling latency (paho loops and ticks of 50 ms),
  device-side (de)serialisation (estimated separately as ``device_codec_s``) and CPU contention between the
  coordinator, two device processes and Mosquitto on 2 cores.

The split is an attribution, not a critical path: the coordinator persists one report while other devices
still train, so parts can overlap (in cold rounds one-off costs overlap enough to make transfer come out
negative); training is timed on an idle core, so it is a lower bound. "Warm" rounds
exclude those that paid a torch import (round 1 always does: the evaluator imports torch lazily too). Why
not simply call ``simulate()``: the coordinator must be built here to attach the observer; the layout is the
same (``build_coordinator`` + ``DeviceFleet``). The training timing runs in a child process so this
process's torch stays as ``simulate`` leaves it: ``torch.set_num_threads`` here, with torch imported before
sklearn's own libgomp, intermittently made the evaluator ~100x slower (0.4-0.7 ms -> 68-72 ms, measured).

**Ingest mode** (coordinator alone, no broker): 1,000 checked-in devices, one round selecting all of them;
1,000 pre-encoded dense reports of a ~200k-parameter MLP (256-512-128-10) are fed through
``RoundMachine.receive`` and the returned ``Persist`` actions written to a real on-disk ``Store`` (SQLite WAL):
decode, validate, store, aggregate, commit (``ingest_reports_per_cpu_s``, a fresh process's first pass). The same
reports then go through a fresh round of the same process (``ingest_reports_per_cpu_s_warm``: malloc tuned by the first round),
and through a *bare loop* that only decodes them with msgpack and makes one dot and one saxpy per tensor
(``bare_loop_reports_per_cpu_s``; ``core_over_bare_loop`` is the core's CPU over the loop's, in one run).
These reports are plain (dense float32, exactly the plan's tensors), so the round machine admits and sums
them on its fast path (``plain_path_share``), reading their values in place in the message rather than from
msgpack's copy (``plain_in_place_share``); ``general_path_reports_per_cpu_s_warm`` is a warm pass with
that path off, in the same run, which is what any other report costs.
Then 20 rounds of 200 reports back to back, recording RSS and
the peak RSS (VmHWM, reset each round where the kernel allows) after every round, to show memory does not
grow with rounds. Each ingest phase runs in a fresh process, so its peak is its own. Before them, opening a
round of 100 and of 1,000 devices, each in its own process: the time until the round is open with its first
``plan_window`` plan messages out (``open_round_s``), the time to encode every plan as the daemon streams
them (``all_plans_s``), and the peak RSS above the process's base, which must not grow with the devices.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from coordinator.observe import Observer  # noqa: E402
from benchmarks.common import peak_rss_mb, reset_peak_rss, rss_mb  # noqa: E402

log = logging.getLogger("benchmarks.fedavg_mqtt")
OUT = ROOT / "runs" / "bench" / "fedavg_mqtt.json"
INGEST_SIZES = [256, 512, 128, 10]  # 198,538 parameters


# ------------------------------------------------------------------ fleet mode

def measure_training(cfg, shards: list[tuple[np.ndarray, np.ndarray]], repeats: int) -> dict[str, Any]:
    """Seconds of ``run_plan`` per device shard, with the fleet's trainer and hparams (run in a child process).

    Also the one-off trainer build (``make_trainer`` + ``load``) and the device-side codec work that is
    part of "transfer" (decode the plan, encode the report)."""
    from coordinator.selection import device_seed
    from coordinator.strategies import make_strategy
    from edge.protocol import wire
    from edge.algorithms.driver import run_plan
    from edge.model import mlp
    from edge.runtime.program import torch_program
    from edge.trainers import make_trainer
    from edge.protocol.wire import Plan

    spec = mlp([64, *cfg.hidden, 10])
    strategy = make_strategy(cfg.strategy, spec=spec, lr=cfg.lr, epochs=cfg.epochs, batch_size=cfg.batch_size,
                             **cfg.strategy_kw)
    state = strategy.init(cfg.seed)
    prog = torch_program(spec)
    loads = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tr = make_trainer("torch", threads=1)  # what the fleet's device processes use
        tr.load(prog.data)
        loads.append(time.perf_counter() - t0)
    per_device, codec = {}, {}
    for i, (x, y) in enumerate(shards):
        did = f"d{i:04d}"
        dp = strategy.plan(state, did, {})
        plan = Plan("r1a1", 1, did, time.time() + 60, strategy.name, "torch", prog.hash, dp.weights, dp.hparams,
                    device_seed(cfg.seed, 1, did), dp.upload, None)
        payload = wire.encode(plan)
        run_plan(plan, tr, x, y)  # warm-up
        ts, cs = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            rep = run_plan(plan, tr, x, y)
            t1 = time.perf_counter()
            wire.decode(payload)
            wire.encode(rep)
            cs.append(time.perf_counter() - t1)
            ts.append(t1 - t0)
        per_device[did] = statistics.median(ts)
        codec[did] = statistics.median(cs)
    return {"per_device_s": per_device, "load_s": statistics.median(loads), "codec_s": codec,
            "first_plan_s": first_plan_cost(), "plan_bytes": len(payload), "samples": [len(x) for x, _ in shards]}


FIRST_PLAN = """
import json, time
import numpy as np
import edge.runtime.device  # what a device process has loaded before its first plan (torch is imported lazily)
from edge.model import init_weights, mlp
from edge.runtime.program import torch_program
t0 = time.perf_counter()
from edge.trainers import make_trainer
spec = mlp([64, 200, 200, 10])
t = make_trainer("torch", threads=1)
t.load(torch_program(spec).data)
t.set_weights(init_weights(spec, 0))
t.step(np.zeros((20, 64), np.float32), np.zeros(20, np.int64), 0.05)  # one local step
print(json.dumps(time.perf_counter() - t0))
"""


def first_plan_cost() -> float:
    """Extra seconds of a device process's first plan: torch is imported lazily, then its first ops run.
    Measured in a fresh interpreter (median of 3), since this process has torch loaded already."""
    import subprocess
    times = []
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", FIRST_PLAN], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300, check=True)
        times.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


class RoundTimer(Observer):
    """The coordinator's own stage timings (its observer hook, all on its MQTT thread); a row per commit."""

    PARTS = ("machine", "persist", "publish", "evaluate")

    def __init__(self, processes: int, train: dict[str, Any], clients_per_round: int, bar=None):
        self.processes, self.train, self.k, self.bar = processes, train, clients_per_round, bar
        self.cur = dict.fromkeys(self.PARTS, 0.0)
        self.cpu = 0.0  # thread CPU seconds of the same handlers (wall minus this = waiting for a core)
        self.t_start: float | None = None  # round 1's opening (check-ins before it are no round's cost)
        self.t_open = 0.0  # latest opening (of the latest attempt)
        self.report_times: list[float] = []  # arrivals of report messages since the latest opening
        self.rows: list[dict] = []
        self.summaries: list[dict] = []
        self.opens: list[dict] = []
        self.loaded: set[str] = set()  # devices that built their trainer
        self.started: set[int] = set()  # device processes that imported torch

    # ---- coordinator.observe.Observer: the daemon reports its own stages, nothing is patched
    def message(self, topic: str, nbytes: int, now: float) -> None:
        if "/report/" in topic:
            self.report_times.append(time.perf_counter())

    def stage(self, name: str, wall_s: float, cpu_s: float) -> None:
        if name == "evaluate":  # nested in the receive/tick that commits: keep it out of the machine's share
            self.cur["evaluate"] += wall_s
            self.cur["machine"] -= wall_s
            return
        self.cur["machine" if name in ("receive", "tick") else name] += wall_s
        self.cpu += cpu_s

    def persisted(self, what: str, data: dict) -> None:
        if what == "open":
            t = time.perf_counter()
            if self.t_start is None:
                self.t_start = t
                self.cur = dict.fromkeys(self.PARTS, 0.0)  # drops only the idle ticks and check-ins
                self.cpu = 0.0
            self.t_open, self.report_times = t, []
            self.opens.append({"round": data["round"], "attempt": data["attempt"], "selected": list(data["selected"])})

    def committed(self, summary: dict) -> None:
        self.summaries.append(summary)
        now = time.perf_counter()
        self._close_round(now, now)

    def _training_estimate(self, opens: list[dict]) -> tuple[float, float, int, bool]:
        """(critical-path training s, device codec s, max sequential trainings, cold) for this round's plans."""
        per_proc = [0.0] * self.processes
        codec_proc = [0.0] * self.processes
        count = [0] * self.processes
        cold = False
        for o in opens:
            for d in o["selected"]:
                p = int(d[1:]) % self.processes  # DeviceFleet: specs[i::processes]
                t = self.train["per_device_s"][d]
                if p not in self.started:  # the process's first plan imports torch
                    t += self.train["first_plan_s"]
                    self.started.add(p)
                    cold = True
                if d not in self.loaded:  # each device builds its own trainer once
                    t += self.train["load_s"]
                    self.loaded.add(d)
                per_proc[p] += t
                codec_proc[p] += self.train["codec_s"][d]
                count[p] += 1
        i = int(np.argmax(per_proc))
        return per_proc[i], codec_proc[i], max(count), cold

    def _close_round(self, t_commit: float, now: float) -> None:
        summary = self.summaries[-1] if self.summaries else {}
        opens, self.opens = self.opens, []
        train_s, codec_s, seq, cold = self._training_estimate(opens)
        prev = self.rows[-1]["_t"] if self.rows else (self.t_start or now)
        period = now - prev
        coord_s = sum(self.cur.values())
        rt = [t - self.t_open for t in self.report_times]
        self.rows.append({"_t": now, "round": summary.get("round"), "accuracy": summary.get("accuracy"),
                          "round_s": period, "training_s": train_s, "coordinator_s": coord_s,
                          "transfer_s": period - train_s - coord_s, "coordinator_parts_s": dict(self.cur),
                          "coordinator_cpu_s": self.cpu,
                          "prev_close_to_open_s": self.t_open - prev, "open_to_commit_s": t_commit - self.t_open,
                          "first_report_s": rt[0] if rt else None,
                          "kth_report_s": rt[self.k - 1] if len(rt) >= self.k else None,
                          "sequential_trainings": seq, "attempts": len(opens), "cold": cold or not self.rows,
                          "device_codec_s": codec_s})
        self.cur = dict.fromkeys(self.PARTS, 0.0)
        self.cpu = 0.0
        if self.bar is not None:
            self.bar.update(1)
            if summary:
                self.bar.set_postfix(acc=f"{summary.get('accuracy', float('nan')):.3f}", s=f"{period:.2f}")


def run_fleet(rounds: int, *, devices: int = 50, clients_per_round: int = 10, processes: int = 2,
              train_repeats: int = 7) -> dict[str, Any]:
    """The simulator's layout, built here so the coordinator's handlers can be timed."""
    from tqdm import tqdm

    from coordinator.broker import start_broker
    from coordinator.report import run_report
    from coordinator.simulate import DeviceFleet, SimConfig, build_coordinator, prepare

    cfg = SimConfig(devices=devices, clients_per_round=clients_per_round, rounds=rounds, epochs=1,
                    broker="mosquitto", processes=processes, workdir=str(ROOT / "runs/bench/fedavg_mqtt_fleet"))
    if Path(cfg.workdir).exists():
        shutil.rmtree(cfg.workdir)
    specs, data = prepare(cfg)
    log.info("fleet: timing run_plan on each of %d shards in a child process (1 thread)", devices)
    # Not in this process: the coordinator must run as in `fedge simulate` (see the module docstring).
    train = _in_child(measure_training, cfg, data.shards, train_repeats)
    log.info("fleet: run_plan median %.2f ms per device (load %.1f ms once), plan %d bytes",
             1e3 * statistics.median(train["per_device_s"].values()), 1e3 * train["load_s"], train["plan_bytes"])

    broker = start_broker("mosquitto")
    bar = tqdm(total=rounds, desc="fleet rounds", unit="round")
    timer = RoundTimer(processes, train, clients_per_round, bar)
    t0 = time.time()
    fleet = coord = None
    try:
        coord = build_coordinator(cfg, broker.url, (data.x_test, data.y_test), observer=timer)
        coord.start()
        if not coord.link.connected.wait(30):
            raise TimeoutError(f"coordinator could not connect to {broker.url}")
        fleet = DeviceFleet(specs, broker.url, cfg.processes)
        if not coord.wait(max(600.0, 30.0 * rounds)):
            raise TimeoutError(f"fleet run did not finish; {len(timer.rows)} of {rounds} rounds committed")
        if coord.error:
            raise RuntimeError("coordinator failed") from coord.error
    finally:
        bar.close()
        if coord is not None:
            coord.stop()
        if fleet is not None:
            fleet.stop()
        broker.stop()
    wall = time.time() - t0
    rep = run_report(strategy=cfg.strategy, runtime="torch", devices=devices, clients_per_round=clients_per_round,
                     rounds=timer.summaries, wall_s=wall, seed=cfg.seed)
    rows = [{k: v for k, v in r.items() if k != "_t"} for r in timer.rows]
    warm = [r for r in rows if not r["cold"]] or rows

    def split(rs, f=np.mean):
        keys = {"training": "training_s", "transfer": "transfer_s", "coordinator": "coordinator_s", "total": "round_s"}
        return {k: float(f([r[col] for r in rs])) for k, col in keys.items()}

    def med(key, rs=warm):
        v = [r[key] for r in rs if r[key] is not None]
        return float(np.median(v)) if v else None

    return {
        "config": {"devices": devices, "clients_per_round": clients_per_round,
                   "selected_per_round": math.ceil(clients_per_round * cfg.over_selection), "rounds": rounds,
                   "epochs": cfg.epochs, "batch_size": cfg.batch_size, "lr": cfg.lr, "model": [64, *cfg.hidden, 10],
                   "alpha": cfg.alpha, "processes": processes, "broker": "mosquitto",
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        # mean over all rounds: rounds x total = the run's time from round 1's opening
        "seconds_per_round": split(rows),
        # rounds with no one-off costs (torch imports in the device processes and the evaluator)
        "seconds_per_round_warm": split(warm),
        "seconds_per_round_median": split(rows, np.median),
        "warm_rounds": len(warm),
        "coordinator_parts_s": {p: float(np.mean([r["coordinator_parts_s"][p] for r in rows]))
                                for p in RoundTimer.PARTS},
        "coordinator_parts_s_warm": {p: float(np.mean([r["coordinator_parts_s"][p] for r in warm]))
                                     for p in RoundTimer.PARTS},
        "coordinator_cpu_s_warm": float(np.mean([r["coordinator_cpu_s"] for r in warm])),
        "device_codec_s_per_round": float(np.mean([r["device_codec_s"] for r in warm])),
        "latency_median_s_warm": {"close_to_next_open": med("prev_close_to_open_s"),
                                  "open_to_first_report": med("first_report_s"),
                                  "open_to_kth_report": med("kth_report_s"),
                                  "open_to_commit": med("open_to_commit_s")},
        "training_model": {"run_plan_median_s": statistics.median(train["per_device_s"].values()),
                           "run_plan_max_s": max(train["per_device_s"].values()),
                           "trainer_load_s": train["load_s"], "first_plan_per_process_s": train["first_plan_s"],
                           "device_codec_median_s": statistics.median(train["codec_s"].values()),
                           "plan_bytes": train["plan_bytes"], "shard_sizes": train["samples"]},
        "final_accuracy": rep["final_accuracy"],
        "total_bytes": rep["total_bytes"],
        "bytes_per_round": rep["total_bytes"] / max(1, len(rep["rounds"])),
        "wall_s": wall,
        "coordinator_process_peak_rss_mb": peak_rss_mb(),
        "rounds": [r | {k: s.get(k) for k in ("loss", "bytes_down", "bytes_up", "reports", "dropped")}
                   for r, s in zip(rows, rep["rounds"])],
    }


# ------------------------------------------------------------------ ingest mode

def _ingest_setup(n_devices: int, clients_per_round: int, rounds: int, store_path: Path, *,
                  per_device: bool = False):
    """``per_device``: a difference downlink to devices that declare ``coded_downlink``, so every device gets
    its own plan object over the round's one set of weight arrays (the reports are the same)."""
    from coordinator.blas import one_blas_thread
    from coordinator.daemon import ProgramCatalog
    from coordinator.registry import Registry
    from coordinator.rounds import RoundConfig, RoundMachine
    from coordinator.store import Store
    from coordinator.strategies.fedavg import FedAvg
    from edge.model import mlp

    one_blas_thread()  # as the daemon does
    spec = mlp(INGEST_SIZES)
    strategy = FedAvg(spec=spec, down_deltas=per_device)
    catalog = ProgramCatalog()
    prog = catalog(spec, "torch")
    reg = Registry()
    caps = {"runtime": "torch", "memory_mb": 2048, "battery": 0.9, "charging": True, "network": "wifi", "idle": True,
            **({"coded_downlink": True} if per_device else {})}
    counts = np.random.default_rng(1).integers(20, 200, n_devices)  # what each device declares and reports
    for i in range(n_devices):
        reg.checkin(f"dev{i:05d}", caps, [prog.hash], int(counts[i]), 0.0)  # program cached: plans carry weights only
    for p in store_path.parent.glob(store_path.name + "*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()  # the database and its report files
    store = Store(store_path)
    state = strategy.init(0)
    store.save_initial_state(state)
    rc = RoundConfig(rounds=rounds, clients_per_round=clients_per_round, over_selection=1.0,
                     round_timeout_s=1e9, selection_timeout_s=0.0)
    return RoundMachine(rc, strategy, state, catalog, registry=reg), store, reg


def _open(machine, store, reg, now: float) -> dict[str, float]:
    """Open a round over every device, as the daemon does: persist what must be, send the first window of
    plans, then the rest a window at a time (here into a null sink: no broker). ``open_round_s`` is the
    time to the round being open with its first window out; ``all_plans_s`` to the last plan encoded."""
    from coordinator.rounds import Persist, Publish
    t0 = time.perf_counter()
    acts = machine.open_round(sorted(reg.devices), now)
    plan_bytes = 0
    for a in acts:
        if isinstance(a, Persist):
            store.apply(a.what, a.data)
        elif isinstance(a, Publish):
            plan_bytes += len(a.payload)
    t_open = time.perf_counter() - t0
    while machine.plans_unsent:
        plan_bytes += sum(len(a.payload) for a in machine.next_plans(machine.cfg.plan_window))
    return {"open_round_s": t_open, "all_plans_s": time.perf_counter() - t0, "plan_bytes": plan_bytes}


def _reports(machine, rng: np.random.Generator) -> list[tuple[str, bytes]]:
    """One dense FedAvg report per selected device, encoded as a device would send it."""
    from edge.protocol import wire
    from edge.protocol.wire import Report, TensorUpdate
    o = machine.open
    out = []
    for d in o.selected:
        w = o.plans[d].weights
        tensors = {k: TensorUpdate(v.shape, v + np.float32(0.01) * rng.standard_normal(v.shape, np.float32))
                   for k, v in w.items()}
        r = Report(o.task_id, d, machine.registry.devices[d].n_samples, {"train_loss": float(rng.random()), "steps": 3},
                   tensors)
        out.append((wire.topic(machine.cfg.fleet, "report", d), wire.encode(r)))
    return out


INGEST_BATCH = 64  # messages per pass of the daemon's network loop when reports stream in (its group commit)


def _feed(machine, store, payloads, now: float, bar=None, batch: int = INGEST_BATCH) -> dict[str, Any]:
    """The timed loop, as the daemon runs it: receive ``batch`` messages, write their records in one batch
    (Store.apply_batch), then the acks (counted here, not sent)."""
    from coordinator.rounds import Persist, Publish, RoundCommitted
    committed = acks = 0
    records: list = []
    for i, (topic, payload) in enumerate(payloads):
        for a in machine.receive(topic, payload, now):
            if isinstance(a, Persist):
                records.append((a.what, a.data))
            elif isinstance(a, Publish):
                acks += 1
            elif isinstance(a, RoundCommitted):
                committed += 1
        if (i + 1) % batch == 0 or i + 1 == len(payloads):
            if records:  # the round's partial sums with the batch (durable sums), as the daemon writes them
                records += [(a.what, a.data) for a in machine.checkpoint()]
            store.apply_batch(records)
            records = []
        if bar is not None:
            bar.update(1)
    return {"committed": committed, "acks": acks, "dropped": machine.dropped_messages}


def disk_write_speed(where: Path, mb: int = 256) -> float:
    """MB/s of a synced sequential write where the store lives: the ceiling for a store of whole reports."""
    p = where / "disk_probe.bin"
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(p, "wb") as f:
        for _ in range(mb):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    p.unlink()
    return mb * 2**20 / dt / 1e6


def bare_loop(payloads: list[tuple[str, bytes]], weights: dict[str, np.ndarray]) -> float:
    """CPU seconds of the least any ingest of these reports does, with nothing else: msgpack decodes each (it
    copies the values out), then per tensor one BLAS pass that reads the values with W (the norm's dot) and
    one that adds them into a float32 buffer (the sum's saxpy). No validation, no difference, no durable
    write, no ack. The core's figure over this one, measured in the same run, is what the core costs above
    the machine's memory traffic for decoding and two passes."""
    import msgpack
    from scipy.linalg.blas import saxpy, sdot
    flat = {k: np.ascontiguousarray(w, np.float32).reshape(-1) for k, w in weights.items()}
    bufs = {k: np.zeros_like(w) for k, w in flat.items()}
    c0 = time.process_time()
    for _, payload in payloads:
        for k, t in msgpack.unpackb(payload)["tensors"].items():
            v = np.frombuffer(t["x"]["b"], np.float32)
            sdot(v, flat[k])
            saxpy(v, bufs[k], a=2.0)
    return time.process_time() - c0


def _warm_and_bare(fresh, payloads) -> dict[str, float]:
    """The same reports once more through a fresh round (the first pass paid ~13 page faults per report while
    the sums went into SQLite, ~2.3 since they go to slot files: SQLite's copy of each batch's 1.6 MB snapshot
    was mapped and unmapped until the round's commit raised glibc's mmap threshold, which a long-running
    daemon pays in its first round only), then through another with the plain report's fast path off
    (``plain_path = False``: the general path's figure), then through one with a plan per device (a difference
    downlink: each device its own plan object over the round's arrays), then the bare loop."""
    import resource
    machine, store = fresh()
    weights = machine.open.plans[next(iter(machine.open.plans))].weights  # the round's W, as admission reads it
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0 = time.process_time()
    res = _feed(machine, store, payloads, 2.0)
    cpu = time.process_time() - c0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    if res["committed"] != 1 or res["dropped"]:
        raise RuntimeError(f"ingest did not commit cleanly: {res}")
    plain = machine.plain_reports
    machine, store = fresh()
    machine.cfg.plain_path = False  # every report through the general path (decode, admit, accumulate)
    c0 = time.process_time()
    res = _feed(machine, store, payloads, 2.0)
    general = time.process_time() - c0
    if res["committed"] != 1 or res["dropped"] or machine.plain_reports:
        raise RuntimeError(f"ingest did not commit cleanly on the general path: {res}")
    machine, store = fresh(per_device=True)
    if len({id(p) for p in machine.open.plans.values()}) != len(machine.open.plans):
        raise RuntimeError("per-device plans: the plans are shared")
    c0 = time.process_time()
    res = _feed(machine, store, payloads, 2.0)
    per_device = time.process_time() - c0
    if res["committed"] != 1 or res["dropped"] or machine.plain_reports != len(payloads):
        raise RuntimeError(f"ingest did not commit cleanly with per-device plans: {res}")
    bare = bare_loop(payloads, weights)
    n = len(payloads)
    return {"ingest_reports_per_cpu_s_warm": n / cpu, "page_faults_per_report_warm": faults / n,
            "plain_path_share_warm": plain / n, "general_path_reports_per_cpu_s_warm": n / general,
            "per_device_plans_reports_per_cpu_s_warm": n / per_device,
            "bare_loop_reports_per_cpu_s": n / bare, "core_over_bare_loop": cpu / bare}


def ingest_throughput(n: int, workdir: str, profile: bool) -> dict[str, Any]:
    """Phase 1 (own process): 1,000 reports of one round, timed clean, then once more with a stage split."""
    from tqdm import tqdm

    from edge import model as M
    from edge.protocol import wire

    logging.basicConfig(level=logging.WARNING)
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    store_path = wd / "ingest.sqlite"
    machine, store, reg = _ingest_setup(n, n, 1_000_000, store_path)
    base_rss = rss_mb()
    reset_peak_rss()
    opened = _open(machine, store, reg, 1.0)
    open_peak = peak_rss_mb()
    log.info("ingest: encoding %d reports", n)
    payloads = _reports(machine, np.random.default_rng(0))
    report_bytes = sum(len(p) for _, p in payloads)
    gc.collect()

    def fresh(per_device: bool = False):
        """A new machine and store with the round open (the same reports then go through again)."""
        nonlocal machine, store
        store.close()
        machine, store, _ = _ingest_setup(n, n, 1_000_000, store_path, per_device=per_device)
        _open(machine, store, reg, 1.0)
        return machine, store

    # 1) clean timing
    bar = tqdm(total=n, desc="ingest reports", unit="report")
    c0, t0 = time.process_time(), time.perf_counter()
    res = _feed(machine, store, payloads, 2.0, bar)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    bar.close()
    if res["committed"] != 1 or res["dropped"]:
        raise RuntimeError(f"ingest did not commit cleanly: {res}")
    plain_share, in_place_share = machine.plain_reports / n, machine.plain_in_place / n
    db_mb = sum(p.stat().st_size for p in wd.glob("ingest.sqlite*") if p.is_file()) / 2**20
    warm = _warm_and_bare(fresh, payloads)

    # 2) stage split: the same reports through wrapped stages (wrapping costs microseconds per call)
    fresh()
    stages = dict.fromkeys(("decode", "encode", "admit", "accumulate", "finish", "store"), 0.0)

    def timed(name, fn):
        def w(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                stages[name] += time.perf_counter() - t
        return w

    import coordinator.rounds as rounds_mod
    # (module, attribute, stage): both paths, the plain report's (rounds._take_plain) and the general one
    wrapped = [(wire, "unpack", "decode"), (wire, "plain_report", "decode"), (wire, "decode_map", "decode"),
               (wire, "encode", "encode"), (rounds_mod, "admit", "admit"), (rounds_mod, "admit_plain", "admit")]
    originals = [(mod, name, getattr(mod, name)) for mod, name, _ in wrapped]
    for mod, name, stage in wrapped:
        setattr(mod, name, timed(stage, getattr(mod, name)))
    for name, stage in (("accumulate", "accumulate"), ("accumulate_plain", "accumulate"), ("finish", "finish")):
        setattr(machine.strategy, name, timed(stage, getattr(machine.strategy, name)))
    orig_apply = store.apply_batch
    store.apply_batch = timed("store", orig_apply)
    try:
        t0 = time.perf_counter()
        _feed(machine, store, payloads, 2.0)
        split_wall = time.perf_counter() - t0
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)
    stages["other"] = split_wall - sum(stages.values())

    # 3) cProfile, if asked or below target
    prof_top = None
    rate = n / wall
    if profile or n / cpu < 2000:
        import cProfile
        import io
        import pstats
        fresh()
        pr = cProfile.Profile()
        pr.enable()
        _feed(machine, store, payloads, 2.0)
        pr.disable()
        pr.dump_stats(str(wd / "ingest.prof"))
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
        prof_top = s.getvalue()
    store.close()
    return {"reports": n, "params": sum(math.prod(s) for s in M.param_shapes(M.mlp(INGEST_SIZES)).values()),
            "report_bytes_mean": report_bytes / n, "plan_bytes_total": opened["plan_bytes"],
            "open_round_s": opened["open_round_s"], "all_plans_encoded_s": opened["all_plans_s"],
            "plan_window": machine.cfg.plan_window, "rss_before_open_mb": base_rss,
            "peak_rss_while_opening_mb": open_peak, "disk_fsync_MB_per_s": disk_write_speed(wd),
            "wall_s": wall, "cpu_s": cpu, "ingest_reports_per_s": rate, "ingest_reports_per_cpu_s": n / cpu,
            "plain_path_share": plain_share, "plain_in_place_share": in_place_share, **warm,
            "ingest_MB_per_s": report_bytes / wall / 1e6, "sqlite_files_mb": db_mb,
            "stages_s_per_report": {k: v / n for k, v in stages.items()},
            "peak_rss_mb": peak_rss_mb(), "payload_buffer_mb": report_bytes / 2**20,
            "profile_top": prof_top}


def ingest_rounds(rounds: int, per_round: int, n_devices: int, workdir: str) -> dict[str, Any]:
    """Phase 2 (own process): rounds back to back; RSS and peak RSS after each, payloads released."""
    from tqdm import tqdm

    logging.basicConfig(level=logging.WARNING)
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    machine, store, reg = _ingest_setup(n_devices, per_round, rounds, wd / "rounds.sqlite")
    rng = np.random.default_rng(1)
    base_rss = rss_mb()
    can_reset = reset_peak_rss()
    series = []
    for r in tqdm(range(1, rounds + 1), desc="ingest rounds", unit="round"):
        if can_reset:
            reset_peak_rss()
        _open(machine, store, reg, float(r))
        payloads = _reports(machine, rng)
        t0 = time.perf_counter()
        res = _feed(machine, store, payloads, float(r) + 0.5)
        dt = time.perf_counter() - t0
        if res["committed"] != 1:
            raise RuntimeError(f"round {r} did not commit: {res}")
        del payloads
        gc.collect()
        series.append({"round": r, "reports_per_s": per_round / dt, "rss_mb": rss_mb(), "peak_rss_mb": peak_rss_mb()})
    store.close()
    rss = [s["rss_mb"] for s in series]
    half = len(rss) // 2
    return {"rounds": rounds, "reports_per_round": per_round, "devices": n_devices, "rss_before_mb": base_rss,
            "peak_rss_reset_per_round": can_reset, "series": series,
            "peak_rss_mb": max(s["peak_rss_mb"] for s in series),
            "rss_growth_second_half_mb": rss[-1] - rss[half] if len(rss) > 1 else 0.0,
            # least-squares slope from round 2 on (round 1 sets up the allocator's arenas): ~0 if nothing leaks
            "rss_slope_mb_per_round": float(np.polyfit(np.arange(len(rss) - 1), rss[1:], 1)[0]) if len(rss) > 2
            else 0.0,
            "reports_per_s_median": statistics.median(s["reports_per_s"] for s in series)}


def _in_child(fn, *args):
    """Run ``fn`` in a fresh spawned process so its memory peak is its own."""
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def open_cost(n_devices: int, workdir: str) -> dict[str, Any]:
    """Phase 0 (own process): open one round of ``n_devices`` and stream every plan out, with the peak RSS
    above what the process held before (the model, the registry and the strategy)."""
    logging.basicConfig(level=logging.WARNING)
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    machine, store, reg = _ingest_setup(n_devices, n_devices, 10, wd / f"open{n_devices}.sqlite")
    gc.collect()
    base = rss_mb()
    can_reset = reset_peak_rss()
    res = _open(machine, store, reg, 1.0)
    store.close()
    return {"devices": n_devices, **res, "peak_rss_above_base_mb": peak_rss_mb() - base, "peak_reset": can_reset}


def run_ingest(n: int, rounds: int, per_round: int, profile: bool) -> dict[str, Any]:
    wd = str(ROOT / "runs/bench/fedavg_mqtt_ingest")
    opens = [_in_child(open_cost, k, wd) for k in (max(1, n // 10), n)]
    thr = _in_child(ingest_throughput, n, wd, profile)
    mem = _in_child(ingest_rounds, rounds, per_round, n, wd)
    for f in Path(wd).glob("*.sqlite*"):  # hundreds of MB of reports nobody needs after the run
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    return {"throughput": thr, "rounds": mem, "open": opens}


# ------------------------------------------------------------------ main

def summary_text(res: dict) -> str:
    lines = []
    f = res.get("fleet")
    if f:
        cp = f["coordinator_parts_s_warm"]
        lat = f["latency_median_s_warm"]

        def line(name, s):
            return (f"  {name}: {s['total']:.3f} s/round = training {s['training']:.3f} + transfer "
                    f"{s['transfer']:.3f} + coordinator {s['coordinator']:.3f}")
        lines += [f"fleet: {f['config']['rounds']} rounds, {f['config']['devices']} devices, "
                  f"{f['config']['clients_per_round']}/round over Mosquitto, {f['wall_s']:.0f} s, "
                  f"final accuracy {f['final_accuracy']:.3f}, {f['total_bytes'] / 1e6:.1f} MB on the wire",
                  line("mean, all rounds", f["seconds_per_round"]),
                  line(f"mean, {f['warm_rounds']} warm rounds", f["seconds_per_round_warm"]),
                  line("median", f["seconds_per_round_median"]),
                  f"  warm coordinator parts: machine {cp['machine']:.4f}, sqlite {cp['persist']:.4f}, publish "
                  f"{cp['publish']:.4f}, evaluate {cp['evaluate']:.4f} s (thread CPU {f['coordinator_cpu_s_warm']:.4f}"
                  f" s); device codec ~"
                  f"{f['device_codec_s_per_round']:.4f} s (inside transfer)",
                  "  warm medians (s): " + ", ".join(f"{k} {v:.3f}" for k, v in lat.items() if v is not None)]
    i = res.get("ingest")
    if i:
        t, m = i["throughput"], i["rounds"]
        st = t["stages_s_per_report"]
        lines += [f"ingest: {t['reports']} reports of {t['params']:,} params ({t['report_bytes_mean'] / 1e6:.2f} MB "
                  f"each): {t['ingest_reports_per_s']:.0f} reports/s wall, {t['ingest_reports_per_cpu_s']:.0f}/cpu-s "
                  f"(target >= 2000); {100 * t['plain_path_share']:.0f}% took the plain report's fast path",
                  f"  warm (a second pass, after a commit): {t['ingest_reports_per_cpu_s_warm']:.0f}/cpu-s; the general "
                  f"path alone (plain_path off): {t['general_path_reports_per_cpu_s_warm']:.0f}/cpu-s; with a plan "
                  f"per device (difference downlink): {t['per_device_plans_reports_per_cpu_s_warm']:.0f}/cpu-s; "
                  f"the bare loop (msgpack decode + one dot + one saxpy per tensor, nothing else) on the same reports: "
                  f"{t['bare_loop_reports_per_cpu_s']:.0f}/cpu-s, the core costs {t['core_over_bare_loop']:.2f}x it",
                  "  per report (ms): " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in st.items()),
                  *(f"  open a round of {o['devices']}: {o['open_round_s']:.3f} s to open (first "
                    f"{t['plan_window']} plan messages out), {o['all_plans_s']:.2f} s to encode all "
                    f"{o['plan_bytes'] / 1e6:.0f} MB of plans, peak RSS +{o['peak_rss_above_base_mb']:.0f} MB"
                    for o in i.get("open", [])),
                  f"  synced disk writes {t['disk_fsync_MB_per_s']:.0f} MB/s; phase peak RSS "
                  f"{t['peak_rss_mb']:.0f} MB (incl. {t['payload_buffer_mb']:.0f} MB of pre-encoded reports)",
                  f"  {m['rounds']} rounds x {m['reports_per_round']}: peak RSS {m['peak_rss_mb']:.0f} MB, RSS "
                  f"{m['series'][0]['rss_mb']:.0f} -> {m['series'][-1]['rss_mb']:.0f} MB "
                  f"(slope {m['rss_slope_mb_per_round']:+.2f} MB/round), "
                  f"{m['reports_per_s_median']:.0f} reports/s"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/fedavg_mqtt.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 10 fleet rounds, 5 ingest rounds")
    ap.add_argument("--mode", choices=("all", "fleet", "ingest"), default="all")
    ap.add_argument("--rounds", type=int, help="fleet rounds (default 100, 10 with --quick)")
    ap.add_argument("--ingest-reports", type=int, default=1000)
    ap.add_argument("--ingest-rounds", type=int, help="back-to-back ingest rounds (default 20, 5 with --quick)")
    ap.add_argument("--ingest-per-round", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="always cProfile the ingest (else only below target)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("fedge").setLevel(logging.WARNING)
    rounds = a.rounds or (10 if a.quick else 100)
    ingest_rounds_n = a.ingest_rounds or (5 if a.quick else 20)
    res: dict[str, Any] = {"quick": a.quick, "cpus": os.cpu_count(), "machine": platform.machine(),
                           "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                         time.gmtime())}
    res["loadavg_start"] = os.getloadavg()
    if res["loadavg_start"][0] > 1.0:
        log.warning("load average %.1f before starting: other work on this machine will inflate the figures",
                    res["loadavg_start"][0])
    if a.mode in ("all", "fleet"):
        res["fleet"] = run_fleet(rounds)
        res["seconds_per_round"] = {k: res["fleet"]["seconds_per_round"][k]
                                    for k in ("training", "transfer", "coordinator")}
    if a.mode in ("all", "ingest"):
        res["ingest"] = run_ingest(a.ingest_reports, ingest_rounds_n, a.ingest_per_round, a.profile)
        res["ingest_reports_per_s"] = res["ingest"]["throughput"]["ingest_reports_per_s"]
        res["peak_rss_mb"] = res["ingest"]["rounds"]["peak_rss_mb"]
        res["rss_series_mb"] = [s["rss_mb"] for s in res["ingest"]["rounds"]["series"]]
        res["peak_rss_series_mb"] = [s["peak_rss_mb"] for s in res["ingest"]["rounds"]["series"]]
    res["loadavg_end"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    text = summary_text(res)
    print(text)
    prof = res.get("ingest", {}).get("throughput", {}).get("profile_top")
    if prof:
        print("ingest profile (top by own time):\n" + "\n".join(prof.splitlines()[:40]))
    log.info("wrote %s", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
