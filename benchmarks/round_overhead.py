"""Rounds near the floor: fedge's FedAvg round over Mosquitto against a plain in-process loop doing the same
computation, in one run, and where every millisecond of a fedge round goes.

``python benchmarks/round_overhead.py [--rounds 100] [--mode reproducible|production] [--quick]``
writes ``runs/bench/round_overhead.json`` and prints the stage table.

**The workload** (issue #26): FedAvg, 50 devices, 10 a round (10 selected: ``--over-selection 1.0``, the floor's
computation; fedge's default 1.3 trains 13 and is measured with ``--over-selection 1.3``), 100 rounds, an
MLP 784-200-200-10 (199,210 parameters) on data of that shape: 7,500 synthetic examples (10 Gaussian classes in
784 dimensions), 1,500 held out for the test, the rest split over the devices by Dirichlet(0.5) labels; one
local epoch, batch 20, lr 0.05. fedge runs as ``fedge simulate`` lays it out (a private Mosquitto, the
coordinator in this process, the devices in 2 child processes of one training thread each).

**The floor**: the same computation in one process with nothing else: each round the devices reproducible mode
commits (the first 10 of the seeded draw), each trained by the devices' own ``run_plan`` with one torch thread
(the same trainer, batches and seeds), their weights averaged by sample count, the average evaluated on the
test split with the coordinator's ``Evaluator``. No encoding, no broker, no durable state. It runs in a child
process before and after the fedge run (so both see the same machine), and its median round is over both.
Its per-round accuracies are compared with fedge's (``floor_accuracy_max_abs_diff``): in reproducible mode the
two compute the same models.

**fedge's round** is the time from one round's opening to the next one's (the last: to its commit), so 100
rounds sum to the run. **Stages** split each round along its critical path, the chain of events that
decided when the round ended: the report whose arrival committed it (its device ``d*``), back to the round's
opening. Every timestamp is ``time.time()`` on this machine (the devices' processes record theirs; the
coordinator's come from its observer hook, coordinator/observe.py, and from timers on its strategy's
``accumulate``/``finish``):

- ``encode``: the opening handler (selection, every plan encoded, the ``open`` record written) until d*'s plan
  is handed to the MQTT client; plus d*'s report encoding on the device (training done to report published);
- ``wait``: d*'s plan held back after the opening because d* was not free yet (reproducible mode sends a busy
  device its plan when it checks in);
- ``transfer``: d*'s plan from the coordinator's MQTT client to the device (the broker, both network loops),
  and its report back, less the time the coordinator was busy with other messages meanwhile;
- ``train``: d*'s plan decoded on the device until its training ended, queueing behind the other devices its
  process trains on its one thread included;
- ``decode_admit``: the coordinator's handler of d*'s report (decode, checks, admission) less the parts below,
  plus the coordinator's time on other messages while d*'s report waited;
- ``aggregate``: d*'s report summed into the round (``accumulate``/``accumulate_plain``) and the server step
  (``finish``);
- ``evaluate``: the test evaluation that vets the commit;
- ``commit``: the rest of the committing handler, the commit's durable write, the acks handed to MQTT;
- ``select``: from the commit to the next round's opening.

Stages sum to the round, each round. ``stages`` holds their medians over rounds (the median round's split is
``stages_of_median_round``) and ``stages_mean`` their means. Work off the critical path (reports decoded while
other devices still train) shows in ``coordinator_busy_s`` but not in the stages.

**CPU per round** (``cpu_s_per_round``): the CPU seconds the coordinator's process, the broker and the device
processes used over the rounds, divided by the rounds, and ``cores_busy``, their sum over the rounds' wall time.
It says how close to the machine's limit a round is: on 2 cores a round cannot take less wall time than half
its CPU, whatever the overlap, while the floor spends about its round time on one core.
``page_faults_per_round``: the minor page faults of the same processes, per round (large buffers mapped afresh
show there: edge/runtime/allocator.py). ``coordinator_cpu_s_per_round`` splits the coordinator's CPU by thread
(its network thread, the evaluator's pool, the rest) and, on the network thread, by the daemon's timed stages
(``receive``, ``persist``, ``publish``, ``evaluate``, ...; each timed with ``thread_time``), the remainder being
the MQTT client's socket reads and writes and the link's loop (``mqtt_and_loop``; ``config.mqtt_client`` says
which client: libmosquitto where installed, paho with ``FEDGE_MQTT_CLIENT=paho``).
"""
from __future__ import annotations

import argparse
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
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from coordinator.observe import Observer  # noqa: E402
from edge.protocol import wire  # noqa: E402

log = logging.getLogger("benchmarks.round_overhead")
OUT = ROOT / "runs" / "bench" / "round_overhead.json"
WORK = ROOT / "runs" / "bench" / "round_overhead_work"
STAGES = ("encode", "wait", "transfer", "train", "decode_admit", "aggregate", "evaluate", "commit", "select")
FEATURES, CLASSES, EXAMPLES = 784, 10, 7500


def make_data(path: Path, seed: int = 0) -> Path:
    """7,500 examples of 784 features in 10 Gaussian classes (MNIST's shape; separable, not trivially)."""
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((CLASSES, FEATURES)).astype(np.float32) * 0.15
    y = rng.integers(0, CLASSES, EXAMPLES)
    x = (means[y] + rng.standard_normal((EXAMPLES, FEATURES)).astype(np.float32)).astype(np.float32)
    np.savez(path, x=x, y=y)
    return path


def sim_config(args, workdir: Path, data: Path):
    from coordinator.simulate import SimConfig
    return SimConfig(devices=args.devices, clients_per_round=args.clients, rounds=args.rounds, epochs=1,
                     broker="mosquitto", processes=2, workdir=str(workdir), data=str(data), model="mlp",
                     mode=args.mode, seed=0, over_selection=args.over_selection,
                     chunk_bytes=args.chunk_kb * 1024)


# ------------------------------------------------------------------ the floor (child process)

def floor_loop(specs: list[dict], cfg, test: tuple[np.ndarray, np.ndarray], conn) -> None:
    """The plain loop, in a child process; sends back per-round seconds and accuracies."""
    from coordinator.daemon import Evaluator
    from coordinator.selection import device_seed, n_to_select, select_ordered
    from coordinator.strategies import make_strategy
    from edge.algorithms.driver import run_plan
    from edge.protocol.wire import Plan
    from edge.runtime.data import load_npz
    from edge.runtime.program import torch_program
    from edge.trainers import make_trainer

    strategy = make_strategy("fedavg", spec=cfg.spec, lr=cfg.lr, epochs=cfg.epochs, batch_size=cfg.batch_size)
    state = strategy.init(cfg.seed)
    dp = strategy.plan(state, "d0000", {})
    weights = {k: np.array(v, np.float32) for k, v in dp.weights.items()}
    data = {s["id"]: load_npz(s["data"]) for s in specs}
    ids = sorted(data)
    prog = torch_program(cfg.spec)
    trainer = make_trainer("torch", threads=1)  # what each simulated device trains with
    trainer.load(prog.data)
    evaluator = Evaluator(*test)
    evaluator(cfg.spec, weights)  # its trainer built once, as the coordinator does at start
    times, accs = [], []
    for rnd in range(1, cfg.rounds + 1):
        t0 = time.perf_counter()
        k = n_to_select(cfg.clients_per_round, cfg.over_selection, len(ids))
        chosen = select_ordered(ids, k, cfg.seed, rnd, 1)[:cfg.clients_per_round]
        sums = {name: np.zeros(v.shape, np.float64) for name, v in weights.items()}
        total = 0
        for d in chosen:
            x, y = data[d]
            plan = Plan(f"r{rnd}", rnd, d, math.inf, "fedavg", "torch", prog.hash, weights, dp.hparams,
                        device_seed(cfg.seed, rnd, d), dp.upload)
            rep = run_plan(plan, trainer, x, y)
            for name, t in rep.tensors.items():
                sums[name] += rep.n_samples * t.values
            total += rep.n_samples
        weights = {name: (s / total).astype(np.float32) for name, s in sums.items()}
        _loss, acc = evaluator(cfg.spec, weights)
        times.append(time.perf_counter() - t0)
        accs.append(acc)
    conn.send({"round_s": times, "accuracy": accs})
    conn.close()


def run_floor(specs, cfg, test) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe(duplex=False)
    p = ctx.Process(target=floor_loop, args=(specs, cfg, test, b), name="floor")
    p.start()
    b.close()
    res = a.recv()
    p.join(30)
    return res


# ------------------------------------------------------------------ devices that time themselves (child processes)

def timed_worker(specs: list[dict], broker_url: str, stop: Any, ready: Any, out_dir: str) -> None:
    """``coordinator.simulate._device_worker`` with each device recording, per task: its plan's first and last
    message, the plan decoded (training queued), training start and end, and its report published."""
    logging.basicConfig(level=os.environ.get("FEDGE_LOG", "WARNING"))
    from edge.algorithms.driver import run_plan
    from edge.protocol.agent import Publish, StartTraining
    from coordinator.simulate import _device_worker
    from edge.runtime.device import Device

    events: list[tuple] = []  # (device, event, task or "", time)

    class TimedDevice(Device):
        def on_message(self, link, topic, payload, now):
            if "/plan/" in topic:
                events.append((self.agent.cfg.device_id, "plan_msg", "", now))
            super().on_message(link, topic, payload, now)

        def _do(self, actions):
            now = time.time()
            for a in actions:
                if isinstance(a, StartTraining):
                    events.append((self.agent.cfg.device_id, "plan_ready", a.plan.task_id, now))
                elif isinstance(a, Publish) and "/report/" in a.topic and self.agent.task is not None:
                    events.append((self.agent.cfg.device_id, "report_sent", self.agent.task.task_id, now))
            super()._do(actions)

        def _train(self, plan):  # Device._train, timed
            me = self.agent.cfg.device_id
            events.append((me, "train_start", plan.task_id, time.time()))
            c0 = time.thread_time()
            try:
                report = run_plan(plan, self._trainer_for(plan), self.x, self.y, self.local)
                err = ""
            except Exception as e:
                report, err = None, f"{type(e).__name__}: {e}"
            events.append((me, "train_end", plan.task_id, time.time()))
            events.append((me, "train_cpu", plan.task_id, time.thread_time() - c0))
            self.link.call_soon(lambda: self._do(self.agent.training_done(report, time.time(), err)))

    _device_worker(specs, broker_url, stop, ready, device_class=TimedDevice)
    Path(out_dir, f"devices-{os.getpid()}.json").write_text(json.dumps(events))


# ------------------------------------------------------------------ the coordinator's side

class Timeline(Observer):
    """Everything the coordinator's observer hook says, stamped with time.time()."""

    def __init__(self):
        self.stage_log: list[tuple[float, float, str]] = []  # (start, end, name)
        self.stage_cpu: list[tuple[float, float, str, float]] = []  # (start, end, name, CPU s of its thread)
        self.message_log: list[tuple[float, str]] = []  # (arrival, topic)
        self.publish_log: list[tuple[float, str]] = []  # (handed to paho, topic)
        self.persist_log: list[tuple[float, str, dict]] = []
        self.commit_log: list[tuple[float, dict]] = []
        self.timed: list[tuple[float, float, str]] = []  # strategy calls: (start, end, what)
        self.opened: list[tuple[float, float, str, int]] = []  # (start, end, task id, round) of each opening

    def message(self, topic, nbytes, now):
        self.message_log.append((now, topic))

    def stage(self, name, wall_s, cpu_s):
        t = time.time()
        self.stage_log.append((t - wall_s, t, name))
        self.stage_cpu.append((t - wall_s, t, name, cpu_s))

    def persisted(self, what, data):
        if what in ("open", "commit", "abandon"):
            self.persist_log.append((time.time(), what, {k: data.get(k) for k in ("round", "attempt", "task_id",
                                                                                 "selected")}))

    def published(self, topic, payload):
        if "/plan/" in topic or "/ack/" in topic:
            self.publish_log.append((time.time(), topic))

    def committed(self, summary):
        self.commit_log.append((time.time(), summary))

    def time_strategy(self, strategy) -> None:
        """Time the strategy's summing and server step (instance attributes: the class is untouched, so the
        round machine's checks of what a strategy overrides see FedAvg's own)."""
        for name in ("accumulate", "accumulate_plain", "finish"):
            fn = getattr(strategy, name)

            def timed(*a, _fn=fn, _name=name, **kw):
                t0 = time.time()
                try:
                    return _fn(*a, **kw)
                finally:
                    self.timed.append((t0, time.time(), _name))
            setattr(strategy, name, timed)


    def time_openings(self, machine) -> None:
        """Time the round machine's ``_open_round`` (an instance attribute over the method, which tick's table
        lookup and ``_maybe_open`` both reach through ``self``): when each opening started and ended."""
        fn = machine._open_round

        def timed(*a, **kw):
            t0 = time.time()
            out = fn(*a, **kw)
            if machine.open is not None and any(getattr(x, "what", None) == "open" for x in out):
                self.opened.append((t0, time.time(), machine.open.task_id, machine.open.round))
            return out
        machine._open_round = timed


def _overlap(spans, a: float, b: float) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in spans)


def critical_paths(tl: Timeline, dev_events: list[tuple]) -> list[dict[str, Any]]:
    """Each committed round split into STAGES along its critical path (module docstring). A round runs from the
    start of the call that opened its first attempt to the start of the one that opened the next round."""
    dev = defaultdict(dict)  # (device, task) -> {event: time}
    plan_msgs = defaultdict(list)  # device -> arrival times of plan messages
    for d, ev, task, t in dev_events:
        if ev == "plan_msg":
            plan_msgs[d].append(t)
        else:
            dev[(d, task)].setdefault(ev, t)
    handlers = sorted((s, e, n) for s, e, n in tl.stage_log if n in ("receive", "tick"))
    busy = sorted((s, e) for s, e, n in tl.stage_log if n != "evaluate")  # evaluate is inside receive or tick
    persists = sorted((s, e) for s, e, n in tl.stage_log if n == "persist")
    # the persist stages that wrote a commit: the last one to end before each commit record was seen
    commit_writes = [max((w for w in persists if w[1] <= t), key=lambda w: w[1])
                     for t, what, _ in tl.persist_log if what == "commit"]
    opens = {task: (s, e, rnd) for s, e, task, rnd in tl.opened}
    first_open = {}
    for s, _e, _task, rnd in sorted(tl.opened):
        first_open.setdefault(rnd, s)
    checkins = defaultdict(list)
    for t, tp in tl.message_log:
        if "/checkin/" in tp:
            checkins[tp.rsplit("/", 1)[-1]].append(t)
    rows = []
    commits = [(t, info) for t, what, info in tl.persist_log if what == "commit"]
    for t_rec, info in commits:
        task, rnd = info["task_id"], info["round"]
        a, b, _ = opens[task]
        start = first_open[rnd]
        end = first_open.get(rnd + 1)
        # the handler that committed (the last to end before the commit was written) and the report it took
        h0, h1, _ = max((h for h in handlers if h[1] <= t_rec), key=lambda h: h[1])
        arrived = [(t, tp) for t, tp in tl.message_log if t <= h0 + 1e-6 and "/report/" in tp]
        t_arrive, topic = arrived[-1]
        d = topic.rsplit("/", 1)[-1]
        ev = dev.get((d, task), {})
        t_ready = ev.get("plan_ready", b)
        pubs = [t for t, tp in tl.publish_log if tp.endswith(f"/plan/{d}") and a <= t <= t_ready + 0.01]
        t_pub = pubs[-1] if pubs else b
        got = [t for t in plan_msgs[d] if t_pub - 0.01 <= t <= t_ready]
        t_msg = got[-1] if got else t_ready
        t_trained = ev.get("train_end", t_ready)
        t_sent = ev.get("report_sent", t_trained)
        ci = [t for t in checkins[d] if b <= t <= t_pub]  # its plan waited for this check-in
        t_free = ci[-1] if ci else b
        cw_open = _overlap(commit_writes, b, t_pub)  # the last round's commit written before these plans went out
        t_committed = next(t for t, s in tl.commit_log if s["task_id"] == task)
        if end is None:
            end = t_committed
        # the handler started as the report arrived (a stage's start, its end less its wall time, reads late by up
        # to half a millisecond)
        h0 = max([h[1] for h in handlers if h[1] <= h0] + [min(h0, t_arrive)])
        inner = [(s, e, n) for s, e, n in tl.timed if h0 <= s and e <= h1]
        fin = [s for s, e, n in inner if n == "finish"]
        t_admitted = min(fin) if fin else h1
        summed = sum(e - s for s, e, n in inner if n != "finish" and e <= t_admitted)
        server = sum(e - s for s, e, n in inner if e > t_admitted or n == "finish")
        evaluate = sum(e - s for s, e, n in tl.stage_log if n == "evaluate" and h0 <= s and e <= h1)
        h_end = min(h1, end)  # the next round may open inside the committing handler
        up_busy = _overlap(busy, t_sent, t_arrive)
        after = _overlap(persists, h_end, end) if end > h_end else 0.0  # the commit's write, when no round opened
        st = {
            "encode": (b - a) + (t_pub - t_free) - cw_open + (t_sent - t_trained),
            "wait": (a - start) + (t_free - b),  # earlier attempts, and d*'s plan waiting for its check-in
            "transfer": (t_msg - t_pub) + (t_arrive - t_sent - up_busy),
            "train": t_trained - t_ready,
            "decode_admit": (t_ready - t_msg) + up_busy + (h0 - t_arrive) + (t_admitted - h0 - summed),
            "aggregate": summed + server,
            "evaluate": evaluate,
            "commit": (h_end - t_admitted) - server - evaluate + cw_open + after,
            "select": max(0.0, end - h_end) - after,
        }
        total = end - start
        rows.append({"round": rnd, "round_s": total, "stages": st, "device": d,
                     "attempts": sum(1 for *_x, r in tl.opened if r == rnd),
                     "open_to_commit_s": t_committed - start, "coordinator_busy_s": _overlap(busy, start, end),
                     "unaccounted_s": total - sum(st.values())})
    return rows


def _minflt(pid: int) -> int:
    """Minor page faults of a process so far (/proc/PID/stat's 10th field; 0 where there is no /proc)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process (the coordinator and the benchmark's timers), by
    the broker and by the device processes: the CPU a round costs, beside the time it takes."""
    import psutil
    me = psutil.Process()
    out = {"coordinator": 0.0, "broker": 0.0, "devices": 0.0}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            role = "coordinator" if p.pid == me.pid else "broker" if p.name() == "mosquitto" else "devices"
            out[role] += t.user + t.system
            out[f"{role}_faults"] = out.get(f"{role}_faults", 0.0) + _minflt(p.pid)
        except psutil.Error:  # a process that ended between the listing and the read
            pass
    return out


def coordinator_threads() -> dict[str, float]:
    """CPU seconds so far of this process's threads, by role: the coordinator's network thread (its MQTT link:
    paho, the round machine's handlers, the durable writes), the evaluator's pool, and the rest (this
    benchmark's main thread waiting, the catalog's workers)."""
    import threading
    import psutil
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {"network": 0.0, "evaluator": 0.0, "other": 0.0}
    for t in psutil.Process().threads():
        name = names.get(t.id, "")
        role = ("network" if name.startswith("mqtt-fedge-coordinator") else
                "evaluator" if name.startswith("fedge-evaluate") else "other")
        out[role] += t.user_time + t.system_time
    return out


def coordinator_split(tl: Timeline, threads0: dict[str, float], threads1: dict[str, float], w0: float, w1: float,
                      rounds: int) -> dict[str, float]:
    """The coordinator's CPU per round, by thread and, on its network thread, by handler stage (the observer's
    ``stage`` hook times each with ``thread_time``): ``receive`` (decoding, admitting and summing reports; the
    commit's own work), ``persist`` (the durable writes), ``publish`` (plans and acks handed to the MQTT client),
    ``plans``, ``tick``, ``evaluate`` (the network thread's share of the vetting evaluation); ``mqtt_and_loop`` is
    the rest of the network thread: the MQTT client reading and writing the sockets, and the link's loop."""
    n = max(1, rounds)
    spans = [x for x in tl.stage_cpu if w0 <= x[1] <= w1]
    by_stage: dict[str, float] = defaultdict(float)
    for _s, _e, name, cpu in spans:
        by_stage[name] += cpu
    # "evaluate" runs inside a "receive" or "tick" handler, whose CPU counts it too: taken out of that one
    for s0, e0, name, cpu in spans:
        if name == "evaluate":
            host = next((h for s1, e1, h, _c in spans if h in ("receive", "tick") and s1 <= s0 and e0 <= e1 + 1e-3),
                        None)
            if host is not None:
                by_stage[host] -= cpu
    out = {f"network_{k}": v / n for k, v in sorted(by_stage.items())}
    network = threads1["network"] - threads0["network"]
    out["network_mqtt_and_loop"] = max(0.0, network - sum(by_stage.values())) / n
    out["network_total"] = network / n
    out["evaluator_threads"] = (threads1["evaluator"] - threads0["evaluator"]) / n
    out["other_threads"] = (threads1["other"] - threads0["other"]) / n
    return out


def run_fedge(cfg, specs, data, work: Path) -> dict[str, Any]:
    from coordinator.broker import start_broker
    from coordinator.report import run_report
    from coordinator.simulate import DeviceFleet, build_coordinator

    tl = Timeline()
    ev_dir = work / "device-events"
    shutil.rmtree(ev_dir, ignore_errors=True)
    ev_dir.mkdir(parents=True)
    broker = start_broker("mosquitto")
    fleet = coord = None
    t0 = time.time()
    try:
        coord = build_coordinator(cfg, broker.url, (data.x_test, data.y_test), observer=tl)
        tl.time_strategy(coord.strategy)
        tl.time_openings(coord.machine)
        coord.start()
        if not coord.link.connected.wait(30):
            raise TimeoutError(f"coordinator could not connect to {broker.url}")
        fleet = DeviceFleet(specs, broker.url, cfg.processes, worker=timed_worker, worker_args=(str(ev_dir),))
        cpu0, th0, w0 = cpu_seconds(), coordinator_threads(), time.time()  # devices started, warmed up, checked in
        if not coord.wait(max(600.0, 30.0 * cfg.rounds)):
            raise TimeoutError(f"fleet run did not finish; {len(tl.commit_log)} of {cfg.rounds} rounds committed")
        cpu1, th1, w1 = cpu_seconds(), coordinator_threads(), time.time()
        if coord.error:
            raise RuntimeError("coordinator failed") from coord.error
    finally:
        if coord is not None:
            coord.stop()
        if fleet is not None:
            fleet.stop()
        broker.stop()
    wall = time.time() - t0
    events = [tuple(e) for f in sorted(ev_dir.glob("devices-*.json")) for e in json.loads(f.read_text())]
    rows = critical_paths(tl, events)
    summaries = [s for _, s in tl.commit_log]
    rep = run_report(strategy=cfg.strategy, runtime="torch", devices=cfg.devices, clients_per_round=cfg.clients_per_round,
                     rounds=summaries, wall_s=wall, seed=cfg.seed)
    per = {k: (cpu1[k] - cpu0[k]) / max(1, len(summaries)) for k in cpu0}
    cpu = {k: v for k, v in per.items() if not k.endswith("_faults")}
    faults = {k.removesuffix("_faults"): round(v) for k, v in per.items() if k.endswith("_faults")}
    return {"rows": rows, "summaries": summaries, "report": rep, "wall_s": wall, "timeline": tl, "events": events,
            "cpu_s_per_round": cpu, "page_faults_per_round": faults,
            "coordinator_cpu_s_per_round": coordinator_split(tl, th0, th1, w0, w1, len(summaries)),
            "mqtt_client": coord.link.backend,
            "cores_busy": sum(cpu.values()) * max(1, len(summaries)) / max(1e-9, w1 - w0)}


def summarise(fedge: dict, floors: list[dict], cfg) -> dict[str, Any]:
    rows = fedge["rows"]
    rs = [r["round_s"] for r in rows]
    floor_rs = [t for f in floors for t in f["round_s"]]
    med = statistics.median(rs)
    stages = {k: statistics.median([r["stages"][k] for r in rows]) for k in STAGES}
    mean = {k: statistics.fmean([r["stages"][k] for r in rows]) for k in STAGES}
    median_row = sorted(rows, key=lambda r: r["round_s"])[len(rows) // 2]
    accs = [s.get("accuracy") for s in fedge["summaries"]]
    diffs = [abs(a - b) for f in floors for a, b in zip(accs, f["accuracy"]) if a is not None]
    floor_med = statistics.median(floor_rs)
    slow = sorted(rows, key=lambda r: -r["round_s"])[:5]
    return {
        "fedge_median_round_s": med,
        "fedge_max_round_s": max(rs),
        "fedge_mean_round_s": statistics.fmean(rs),
        "floor_median_round_s": floor_med,
        "floor_median_round_s_each": [statistics.median(f["round_s"]) for f in floors],
        "floor_max_round_s": max(floor_rs),
        "ratio_median_to_floor": med / floor_med,
        "ratio_max_to_median": max(rs) / med,
        "stages": stages,
        "stages_mean": mean,
        "stages_of_median_round": median_row["stages"] | {"round": median_row["round"], "round_s": median_row["round_s"]},
        "slowest_rounds": [{"round": r["round"], "round_s": r["round_s"], "device": r["device"],
                            "attempts": r["attempts"], "stages": r["stages"]} for r in slow],
        "export_s": sum(s.get("export_s", 0.0) for s in fedge["summaries"]),
        "coordinator_busy_s_median": statistics.median([r["coordinator_busy_s"] for r in rows]),
        # CPU a round costs, by process (mean over the run): the floor spends about its round time on one core
        "cpu_s_per_round": fedge["cpu_s_per_round"],
        "coordinator_cpu_s_per_round": fedge["coordinator_cpu_s_per_round"],
        "page_faults_per_round": fedge["page_faults_per_round"],
        "cores_busy": fedge["cores_busy"],
        "unaccounted_s_max": max(abs(r["unaccounted_s"]) for r in rows),
        "run_report_wall_s_median": statistics.median([s["wall_s"] for s in fedge["summaries"]]),
        "fedge_wall_s": fedge["wall_s"],
        "final_accuracy": accs[-1] if accs else None,
        "floor_final_accuracy": floors[0]["accuracy"][-1],
        "floor_accuracy_max_abs_diff": max(diffs) if diffs else None,
        "rounds": [{"round": r["round"], "round_s": r["round_s"], "device": r["device"], "attempts": r["attempts"],
                    "accuracy": a, "floor_accuracy": floors[0]["accuracy"][i] if i < len(floors[0]["accuracy"]) else None,
                    "floor_round_s": [f["round_s"][i] for f in floors if i < len(f["round_s"])]}
                   | {k: r["stages"][k] for k in STAGES} for i, (r, a) in enumerate(zip(rows, accs))],
        "first_round_accuracies_differ": next((i + 1 for i, (a, b) in enumerate(zip(accs, floors[0]["accuracy"]))
                                               if a is not None and abs(a - b) > 1e-9), None),
    }


def table(res: dict) -> str:
    med = res["fedge_median_round_s"]
    lines = [f"fedge median round {1e3 * med:.1f} ms, slowest {1e3 * res['fedge_max_round_s']:.1f} ms "
             f"({res['ratio_max_to_median']:.2f}x the median); floor median {1e3 * res['floor_median_round_s']:.1f} ms "
             f"(runs {', '.join(f'{1e3 * x:.1f}' for x in res['floor_median_round_s_each'])}): fedge "
             f"{res['ratio_median_to_floor']:.2f}x the floor",
             f"{'stage':<14}{'median ms':>10}{'mean ms':>10}{'median round ms':>17}"]
    for k in STAGES:
        lines.append(f"{k:<14}{1e3 * res['stages'][k]:>10.1f}{1e3 * res['stages_mean'][k]:>10.1f}"
                     f"{1e3 * res['stages_of_median_round'][k]:>17.1f}")
    lines.append(f"{'sum':<14}{1e3 * sum(res['stages'].values()):>10.1f}{1e3 * sum(res['stages_mean'].values()):>10.1f}"
                 f"{1e3 * sum(res['stages_of_median_round'][k] for k in STAGES):>17.1f}")
    cpu = res["cpu_s_per_round"]
    lines.append(f"CPU per round: {1e3 * sum(cpu.values()):.0f} ms (" + ", ".join(
        f"{k} {1e3 * v:.0f}" for k, v in cpu.items()) + f"), {res['cores_busy']:.2f} of {res['cpus']} cores busy; "
        f"the floor: about {1e3 * res['floor_median_round_s']:.0f} ms on one core")
    co = res["coordinator_cpu_s_per_round"]
    lines.append(f"coordinator CPU per round ({res['config'].get('mqtt_client', '?')}): network thread "
                 f"{1e3 * co['network_total']:.0f} ms (" + ", ".join(
        f"{k.removeprefix('network_')} {1e3 * v:.1f}" for k, v in co.items()
        if k.startswith("network_") and k != "network_total") + f"), evaluator threads "
        f"{1e3 * co['evaluator_threads']:.1f}, other {1e3 * co['other_threads']:.1f}")
    lines.append("page faults per round: " + ", ".join(f"{k} {v}" for k, v in res["page_faults_per_round"].items()))
    lines.append("slowest rounds: " + "; ".join(
        f"{r['round']}: {1e3 * r['round_s']:.0f} ms ({max(STAGES, key=lambda k: r['stages'][k])} "
        f"{1e3 * max(r['stages'].values()):.0f} ms)" for r in res["slowest_rounds"]))
    lines.append(f"accuracy: fedge {res['final_accuracy']}, floor {res['floor_final_accuracy']} (max abs diff per round "
                 f"{res['floor_accuracy_max_abs_diff']}); program exports {res['export_s']:.2f} s (not in rounds)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/round_overhead.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--devices", type=int, default=50)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--mode", choices=("reproducible", "production"), default="reproducible")
    ap.add_argument("--over-selection", type=float, default=1.0,
                    help="1.0 (default): the floor's computation, 10 trainings a round; fedge's own default 1.3 "
                         "trains 13, of which reproducible mode commits the first 10")
    ap.add_argument("--quick", action="store_true", help="20 rounds")
    ap.add_argument("--chunk-kb", type=int, default=wire.DEFAULT_CHUNK_BYTES // 1024,
                    help="messages above this many KiB go as chunks (fedge's default; 256 was the default before)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds = 20
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("fedge").setLevel(logging.WARNING)
    from dataclasses import replace
    from coordinator.simulate import model_spec, prepare
    WORK.mkdir(parents=True, exist_ok=True)
    data_path = make_data(WORK / "data.npz")
    cfg = sim_config(a, WORK / "fleet", data_path)
    if Path(cfg.workdir).exists():
        shutil.rmtree(cfg.workdir)
    specs, data = prepare(cfg)
    cfg = replace(cfg, spec=model_spec(cfg, data), fleet=f"ro-{os.getpid()}")
    for s in specs:
        s["fleet"] = cfg.fleet
    res: dict[str, Any] = {"config": {"devices": a.devices, "clients_per_round": a.clients, "rounds": a.rounds,
                                      "mode": a.mode, "model": [FEATURES, 200, 200, CLASSES],
                                      "examples": EXAMPLES, "over_selection": cfg.over_selection,
                                      "processes": cfg.processes, "broker": "mosquitto", "chunk_bytes": cfg.chunk_bytes},
                           "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "loadavg_start": os.getloadavg()}
    test = (data.x_test, data.y_test)
    log.info("floor (before)")
    floors = [run_floor(specs, cfg, test)]
    log.info("fedge: %d rounds over Mosquitto (%s mode)", a.rounds, a.mode)
    fedge = run_fedge(cfg, specs, data, WORK)
    log.info("floor (after)")
    floors.append(run_floor(specs, cfg, test))
    res |= summarise(fedge, floors, cfg)
    res["config"]["mqtt_client"] = fedge["mqtt_client"]
    res["loadavg_end"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    log.info("wrote %s", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
