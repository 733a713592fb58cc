"""The coordinator daemon: the round machine wired to MQTT, SQLite and an evaluator.

Actions are carried out in order on the MQTT network thread: ``Persist`` goes to SQLite before any later
publish, so an ack always follows a durable write. A write that fails stops the daemon where it stands: the
publishes that waited for it (acks among them) are dropped, and nothing more is received, written or published
until :meth:`Coordinator.stop` (fail-stop). The round machine has already counted what the failed batch held,
so going on would ack, as accepted or duplicate, reports that are not on disk; stopped, a device that got no ack
resends, and the restarted coordinator (or a replay of the ingest inbox) takes the report again.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edge.protocol import wire
from edge.runtime.mqtt import BrokerAddress, MqttLink
from edge.runtime.program import Program, torch_program

from .blas import one_blas_thread
from .ingest import Inbox, inbox_path
from .observe import Observer
from .registry import Registry
from .rounds import Finished, Persist, Publish, RoundCommitted, RoundConfig, RoundMachine
from .store import Store
from .strategies.base import ServerState, Strategy

log = logging.getLogger("fedge.coordinator")


def _build(spec: dict, runtime: str, objective: str, layout: dict | None, cache_dir) -> Program:
    from export.store import cached_program  # export tooling is only needed for runtimes other than torch
    return cached_program(spec, runtime, cache_dir, objective=objective, layout=layout)


def _exit_on_sigterm() -> None:
    """The exporter process ends on SIGTERM (ProgramCatalog.close) as on an exception, so that what it holds is
    released (the semaphores multiprocessing registered, which a killed process would leave to the resource
    tracker's warning at exit)."""
    import signal
    import sys
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


class ProgramCatalog:
    """One program per (model shape, runtime, objective, layout), built once and kept (content-addressed).

    Exports go to ``cache_dir`` (an :class:`export.store.ProgramStore`), or else to ``$FEDGE_PROGRAM_CACHE``
    if set, so coordinators started by a simulation or a test reuse earlier exports; with neither, every new
    coordinator exports afresh.

    ``background=True`` (the daemon): an ONNX Runtime or ExecuTorch export (seconds; ExecuTorch 10-45 s) runs
    in a separate process, never on the network thread. The round machine asks :meth:`ready` before it
    opens a round and :meth:`request`s what is missing; it opens with the devices whose programs are built, or
    once they are (coordinator/rounds.py: ``_with_built_programs``); meanwhile acks, check-ins and heartbeats
    flow. Without it (tests, benchmarks) a program is built when first asked for.
    """

    def __init__(self, cache_dir: str | Path | None = None, *, background: bool = False,
                 on_ready: Callable[[], None] | None = None):
        import os
        self.cache_dir = cache_dir if cache_dir is not None else (os.environ.get("FEDGE_PROGRAM_CACHE") or None)
        self._cache: dict[tuple[str, str, str, str], Program] = {}
        self._building: dict[tuple[str, str, str, str], Any] = {}  # key -> Future
        self._pool = None
        self.background = background
        self.on_ready = on_ready  # called (on the builder's thread) when a background build ends
        self.export_s = 0.0  # seconds the caller's thread spent exporting (or waiting for an export) since taken

    @staticmethod
    def _key(spec: dict, runtime: str, objective: str, layout: dict | None) -> tuple[str, str, str, str]:
        import json
        return (json.dumps(spec, sort_keys=True), runtime, objective, json.dumps(layout or {}, sort_keys=True))

    def __call__(self, spec: dict, runtime: str, objective: str = "ce", layout: dict | None = None) -> Program:
        key = self._key(spec, runtime, objective, layout)
        p = self._cache.get(key)
        if p is None:
            fut = self._building.pop(key, None)
            t0 = time.perf_counter()
            if fut is not None:
                p = fut.result()  # re-raises a failed export: the daemon stops and says why
            elif runtime == "torch":
                p = torch_program(spec, objective, layout)
            else:
                p = _build(spec, runtime, objective, layout, self.cache_dir)
            if runtime != "torch":  # (the torch program is its spec as JSON: no export)
                self.export_s += time.perf_counter() - t0
            self._cache[key] = p
        return p

    def take_export_s(self) -> float:
        """The seconds counted in :attr:`export_s` since the last call (the daemon moves them out of the round
        that paid them into its ``export_s``)."""
        s, self.export_s = self.export_s, 0.0
        return s

    def ready(self, spec: dict, runtime: str, objective: str = "ce", layout: dict | None = None) -> bool:
        """Whether asking for this program now returns at once (a failed build counts: asking re-raises)."""
        key = self._key(spec, runtime, objective, layout)
        if key in self._cache or runtime == "torch" or not self.background:
            return True
        fut = self._building.get(key)
        return fut is not None and fut.done()

    def request(self, spec: dict, runtime: str, objective: str = "ce", layout: dict | None = None) -> None:
        """Start building the program in the background (no-op if built or under way)."""
        key = self._key(spec, runtime, objective, layout)
        if key in self._cache or key in self._building or runtime == "torch" or not self.background:
            return
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor
            # spawn: a fork of a process with a running paho thread could inherit a held lock
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_exit_on_sigterm)
        log.info("exporting a %s program in the background (objective %s)", runtime, objective)
        fut = self._pool.submit(_build, spec, runtime, objective, layout, self.cache_dir)
        if self.on_ready is not None:
            fut.add_done_callback(lambda _f: self.on_ready())
        self._building[key] = fut

    def close(self, wait: bool = False) -> None:
        """Stop the background exports: those not started are dropped; the one under way is finished (and stored)
        first with ``wait``, else dropped with its process, so that a run that ends while a program it asked for
        ahead is still exporting exits at once (the store writes whole files only: export/store.py)."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        # ProcessPoolExecutor has no public way to stop a running task before Python 3.14's terminate_workers
        workers = [] if wait else list((getattr(pool, "_processes", None) or {}).values())
        manager = getattr(pool, "_executor_manager_thread", None)  # (shutdown forgets it)
        pool.shutdown(wait=wait, cancel_futures=True)
        if not workers:
            return
        for w in workers:
            w.terminate()  # SIGTERM: the exporter exits cleanly (_exit_on_sigterm) ...
        if not _ended(workers, 5):  # ... unless it is stuck in native code
            for w in workers:
                w.kill()
            _ended(workers, 5)
        if manager is not None:
            # The pool's own thread reaps the workers (it joins them as it shuts down). Joining them here as well
            # would race it for each exit status: the loser's waitpid fails, and its Process reads as alive.
            manager.join(5)


def _ended(workers: list, timeout: float) -> bool:
    """Whether every worker process has exited within ``timeout`` seconds. Read from each process's sentinel (a
    pipe the kernel closes at its exit), not from waitpid, which is the pool's to call."""
    from multiprocessing.connection import wait
    end = time.monotonic() + timeout
    left = [w.sentinel for w in workers]
    while left and time.monotonic() < end:
        done = wait(left, max(0.0, end - time.monotonic()))
        left = [s for s in left if s not in done]
    return not left


class Evaluator:
    """Accuracy of the global model on a held-out split the devices never train on (torch reference).

    A spec's network scores the split as ``SHARDS`` contiguous shards whose losses and hits are summed, one after
    another in :meth:`__call__` and side by side in :meth:`many`: the same numbers either way, on any number of
    cores (the rows of a shard go through the same kernels as the whole split's; only the loss's sum is in a fixed
    other order). The vetting evaluation runs when every report of the round is in, so the devices' core is free:
    on two threads it takes about two thirds of the time, and it sits on the round's critical path. A person's
    module scores the split whole, one model at a time."""

    SHARDS = 2

    def __init__(self, x: np.ndarray, y: np.ndarray, *, workers: int | None = None):
        """``workers``: threads for :meth:`many` (default: 2, or 1 on a single core)."""
        self.x, self.y = x, y
        self._trainers: dict[tuple[str, int], Any] = {}  # one per program and thread: set_weights is the trainer's
        self.workers = workers if workers is not None else min(2, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        n = len(y)
        k = max(1, min(self.SHARDS, n))
        self.shards = [(n * i // k, n * (i + 1) // k) for i in range(k)]

    def many(self, models: list[tuple[dict, dict[str, np.ndarray]]]) -> list[tuple[float, float]]:
        """(loss, accuracy) of several models, their shards side by side: the commit's candidate, and the screen's
        state without its suspects, are evaluated when every report is in, so the devices' cores are free, and
        torch runs its kernels without the GIL. A person's module goes one at a time (its code may not be
        thread-safe)."""
        from edge.model import is_module
        if self.workers < 2 or any(is_module(spec) for spec, _ in models):
            return [self(spec, w) for spec, w in models]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="fedge-evaluate")
        jobs = [(torch_program(spec), w, lo, hi) for spec, w in models for lo, hi in self.shards]
        parts = list(self._pool.map(lambda j: self._shard(*j, slot=threading.get_ident()), jobs))
        k = len(self.shards)
        return [self._total(parts[i * k:(i + 1) * k]) for i in range(len(models))]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __call__(self, spec: dict, weights: dict[str, np.ndarray], *, slot: int = 0) -> tuple[float, float]:
        """(loss, accuracy); ``slot``: whose trainer (each thread of :meth:`many` has its own)."""
        from edge.model import is_module
        if is_module(spec):  # a person's module: eval mode (BatchNorm running statistics, no dropout)
            from edge.trainers.torch_objectives.usermodel import evaluate
            return evaluate(spec, weights, self.x, self.y)
        prog = torch_program(spec)
        return self._total([self._shard(prog, weights, lo, hi, slot=slot) for lo, hi in self.shards])

    def _shard(self, prog: Program, weights: dict[str, np.ndarray], lo: int, hi: int, *,
               slot: int) -> tuple[float, int, int]:
        """(the loss summed over rows lo:hi of ``prog``'s network with ``weights``, their hits, their count)."""
        from edge.trainers import make_trainer
        key = (prog.hash, slot)
        t = self._trainers.get(key)
        if t is None:
            # one thread: evaluating a small model on more threads is slower and far noisier (measured)
            t = self._trainers[key] = make_trainer("torch", threads=1)
            t.load(prog.data)
        t.set_weights(weights)
        loss, acc = t.evaluate(self.x[lo:hi], self.y[lo:hi])
        n = hi - lo
        return loss * n, round(acc * n), n

    @staticmethod
    def _total(parts: list[tuple[float, int, int]]) -> tuple[float, float]:
        n = sum(p[2] for p in parts)
        return sum(p[0] for p in parts) / n, sum(p[1] for p in parts) / n


@dataclass
class CoordinatorConfig:
    rounds: RoundConfig
    broker: BrokerAddress = field(default_factory=BrokerAddress)
    state_path: str = "runs/coordinator/state.sqlite"
    # default: fedge-coordinator-<fleet>-<run id>-<secret> (a new run gets a new MQTT session; the secret, kept in
    # the state, stops a device from guessing it from its task ids and taking it over: docs/security.md)
    client_id: str = ""
    # "shared": reports come from ingest workers through the inbox (coordinator/ingest.py), not the broker
    ingest: str = "direct"

    def __post_init__(self) -> None:
        if self.ingest not in ("direct", "shared"):
            raise ValueError(f"ingest = {self.ingest!r}: expected 'direct' or 'shared'")


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig, strategy: Strategy, *, evaluator: Evaluator | None = None,
                 programs: ProgramCatalog | None = None, on_round: Callable[[dict], None] | None = None,
                 run: dict | None = None, observer: Observer | None = None):
        """``run``: what defines this run (strategy, model, data, seed); a state file that holds another run
        is refused. ``observer`` (coordinator/observe.py) sees the daemon's work as it happens. Raises
        :class:`coordinator.store.StateInUse` if another coordinator holds the state."""
        one_blas_thread()  # ingest runs BLAS on the network thread: one thread each (coordinator/blas.py)
        self.cfg, self.strategy, self.evaluator = cfg, strategy, evaluator
        self.on_round = on_round
        self.observer = observer or Observer()
        self.store = Store(cfg.state_path, lock=True)
        try:
            self._restore(cfg, strategy, programs, run)
        except BaseException:
            self.store.close()
            raise
        self.done = threading.Event()
        self._records: list[tuple[str, dict]] = []  # durable records of this pass, written at its end
        self._held: list[Publish] = []  # publishes that must follow those records
        self._halted = False  # a write failed (or the machine raised): nothing more is acked, written or received
        if self.machine.finished:
            self.done.set()
        # Exports run off the network thread (ProgramCatalog(background=True)); what still runs on it is the
        # commit's server step and evaluation, seconds at most for a large model: 60 s keeps well clear.
        subs = self.machine.subscriptions()
        self.inbox: Inbox | None = None
        self._inbox_last = self._inbox_done = 0
        if cfg.ingest == "shared":  # reports arrive through the workers' inbox, never straight from the broker
            self.inbox = Inbox(inbox_path(cfg.state_path))
            self.inbox.set_limits(self.machine.report_limits())  # a round re-opened after a restart
            report_topic = wire.topic(self.machine.cfg.fleet, "report", "+")
            subs = [t for t in subs if t != report_topic]
        self.link = MqttLink(cfg.broker, self.client_id, self, subscriptions=subs,
                             clean_session=False, keepalive=60, tick_s=0.05, max_inflight=1000,
                             new_id_on_takeover=True)
        if getattr(self.programs, "background", False):
            self.programs.on_ready = lambda: self.link.call_soon(lambda: None)  # wake the loop to open the round
        self.error: BaseException | None = None

    def _restore(self, cfg: CoordinatorConfig, strategy: Strategy, programs, run: dict | None) -> None:
        if run is not None:
            self.store.check_run(run)
        run_id = self.store.run_id()
        rc = replace(cfg.rounds, run_id=cfg.rounds.run_id or run_id)
        self.client_id = cfg.client_id or f"fedge-coordinator-{rc.fleet}-{rc.run_id}-{self.store.secret('client_id')}"
        state = self.store.latest_state()
        if state is None:
            state = strategy.init(rc.seed)
            self.store.save_initial_state(state)
        else:
            log.info("resuming from committed round %d", state.round)
        now = time.time()
        registry = Registry(rc.quarantine)
        for d in self.store.devices():
            rec = registry.checkin(d["device_id"], d["caps"], d["programs"], d["n"], now)
            rec.online = d["online"]
            rec.available = d["online"] and d["available"]  # a device busy when we died is busy still
            rec.quarantined_until, rec.quarantines = d["quarantined_until"], d["quarantines"]
        self.programs = programs or ProgramCatalog(background=True)
        self.machine = RoundMachine(rc, strategy, state, self.programs, registry=registry, now=now,
                                    vet=self._vet if self.evaluator is not None else None,
                                    vet_all=self._vet_all if hasattr(self.evaluator, "many") else None)
        self.machine.restore(self.store.closed_tasks())
        take = getattr(self.programs, "take_export_s", None)
        if take is not None:
            take()  # exports before the run (a preflight's) are no round's
        if self.evaluator is not None:
            # now, before the network loop runs: the first evaluation imports torch (seconds), which would
            # otherwise stall the loop with a round's last ack waiting behind it
            spec, weights = self.strategy.global_model(state)
            loss, acc = self.evaluator(spec, weights)
            log.info("global model at round %d: accuracy %.4f, loss %.4f", state.round, acc, loss)
        opened = self.store.open_round()
        if opened and opened[0]["round"] == state.round + 1:
            info, reports = opened
            if self.machine.finished:  # the round count was lowered across the restart: the run is done
                log.warning("run finished at round %d; round %d (%s), open when the coordinator stopped, is "
                            "not re-opened", state.round, info["round"], info["task_id"])
            else:
                self.machine.restore_open(info, reports)
                log.info("re-opened round %d (%s) with %d accepted reports", info["round"], info["task_id"],
                         len(reports) + len(info["accepted"]))

    def _vet(self, state: ServerState) -> dict[str, float]:
        """Test metrics of a candidate state, before it may commit (the round machine refuses a collapse)."""
        if hasattr(self.evaluator, "many"):  # its shards side by side: the same numbers, sooner
            return self._vet_all([state])[0]
        with self._timed("evaluate"):
            loss, acc = self.evaluator(*self.strategy.global_model(state))
        return {"accuracy": acc, "loss": loss}

    def _vet_all(self, states: list[ServerState]) -> list[dict[str, float]]:
        """:meth:`_vet` of several candidates, evaluated side by side (Evaluator.many)."""
        with self._timed("evaluate"):
            got = self.evaluator.many([self.strategy.global_model(s) for s in states])
        return [{"accuracy": acc, "loss": loss} for loss, acc in got]

    @contextmanager
    def _timed(self, stage: str):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.observer.stage(stage, time.perf_counter() - t0, time.thread_time() - c0)

    # ---- LinkHandler
    def on_connected(self, link, now):
        log.info("coordinator connected to %s", self.cfg.broker.url())

    def on_disconnected(self, link, now):
        pass

    def on_message(self, link, topic, payload, now):
        # The machine never raises on network input (it logs, records and drops); returning normally is
        # what lets paho acknowledge the message, so a bad one is never redelivered into a crash loop
        # (libmosquitto acknowledges before the handler runs; a report lost to a crash is resent by its device,
        # which resends until the coordinator's own ack).
        self.observer.message(topic, len(payload), now)
        self._guard("receive", lambda: self.machine.receive(topic, payload, now))

    def on_tick(self, link, now):
        self._guard("tick", lambda: self.machine.tick(now))
        self._say_selection_wait(now)

    def _say_selection_wait(self, now: float) -> None:
        """A production round waiting for over-selection says so, and how to change it: the first time at WARNING
        (one line: the fleet is smaller than the over-selected target), then at INFO (-v) once per round."""
        from .selection import over_selection_wait
        m = self.machine
        w = getattr(m, "_window", None)  # the production selection's sample (rounds.py); None in reproducible mode
        if m.open is not None or m.finished or m.cfg.reproducible or w is None or now - m.idle_since < 1.0:
            return
        key = (m.state.round + 1, m.attempt)
        if key == getattr(self, "_wait_said", None):
            return
        note = over_selection_wait(len(w), m.cfg.clients_per_round, m.cfg.over_selection, m.cfg.min_needed,
                                   m.cfg.selection_timeout_s)
        if note is not None:
            self._wait_said = key
            (log.info if getattr(self, "_wait_warned", False) else log.warning)("round %d: %s", key[0], note)
            self._wait_warned = True

    def _guard(self, stage: str, fn) -> None:
        if self._halted:
            return  # unanswered: the device resends to the coordinator that replaces this one
        try:
            with self._timed(stage):
                actions = fn()
            self._do(actions)
        except Exception as e:  # our own bug (a disk error, say): stop loudly rather than wedge silently
            self._halt(e, "coordinator failed")

    def _halt(self, e: BaseException, what: str) -> None:
        """Fail-stop: the records not yet written and the publishes waiting for them are dropped (no ack for a
        report whose write failed or never ran), and from now on the daemon receives, writes and publishes
        nothing; the devices resend what went unacked, to the restarted coordinator."""
        log.exception(what)
        self._halted = True
        dropped = sum(1 for a in self._held if "/ack/" in a.topic)
        self._records, self._held = [], []
        if dropped:
            log.error("%d acks not sent: their records may not be on disk", dropped)
        if self.error is None:
            self.error = e
        self.done.set()

    def _do(self, actions) -> None:
        """Durable records are written in batches (group commit): they wait for the end of the network loop's
        pass, and so does every publish after one of them, so an ack never precedes its report's write."""
        for a in actions:
            if isinstance(a, Persist):
                self._records.append((a.what, a.data))
            elif isinstance(a, Publish):
                if self._records or self._held:
                    self._held.append(a)
                else:
                    self._publish(a)
            elif isinstance(a, RoundCommitted):
                self._export_apart(a.summary)
                self._flush()  # the commit is on disk before anyone hears of it
                self._committed(a.summary, a.state)
            elif isinstance(a, Finished):
                self._flush()
                self.done.set()

    def _export_apart(self, summary: dict) -> None:
        """Exports the catalog ran on this thread during the round (``background=False``: tests, simulations)
        delayed it inside its handlers: their seconds move from its ``wall_s`` to its ``export_s`` (the round
        machine counts the seconds a round waited for a background export there already). Before the commit
        record is written: the summary is the record's."""
        take = getattr(self.programs, "take_export_s", None)
        x = take() if take is not None else 0.0
        if x > 0.0:
            summary["export_s"] = summary.get("export_s", 0.0) + x
            summary["wall_s"] = max(0.0, summary.get("wall_s", 0.0) - x)

    def _take_inbox(self, now: float) -> None:
        """Feed the machine what the ingest workers spooled, in order; rows are deleted once written (_flush)."""
        rows = self.inbox.take(self._inbox_last, 256)
        for r in rows:
            if self._halted:
                return  # this row and later ones stay in the inbox: a restarted coordinator replays them
            self._inbox_last = r.id
            if r.payload is None:
                ident = r.topic.rsplit("/", 1)[-1]
                self._guard("receive", lambda: self.machine.refused(ident, "report", r.reason or "", now,
                                                                    strike=r.strike))
            else:
                self.observer.message(r.topic, len(r.payload), now)
                self._guard("receive", lambda: self.machine.receive(r.topic, r.payload, now))

    def on_pass_end(self, link, now) -> None:
        if self._halted:
            return
        try:
            if self.inbox is not None:
                self._take_inbox(now)
                if self._halted:
                    return
            self._flush()
            if self.inbox is not None and self._inbox_done < self._inbox_last:
                self.inbox.delete_through(self._inbox_last)  # their effects are on disk now
                self._inbox_done = self._inbox_last
            self._pump()
        except Exception as e:  # a disk error: stop loudly, acking nothing that waited for the write
            self._halt(e, "coordinator failed to write its state")

    def _pump(self) -> None:
        """Plans of the open round, as many as keep ``plan_window`` messages unconfirmed by the broker: a round of
        1,000 devices streams out at the broker's pace, with a bounded amount of it in memory."""
        window = self.machine.cfg.plan_window
        if window <= 0 or not self.machine.plans_unsent:
            return
        room = window - self.link.in_flight()
        if room > 0:
            with self._timed("plans"):
                actions = self.machine.next_plans(room)
            self._do(actions)

    def _batch(self) -> list[tuple[str, dict]]:
        """The records waiting, and the open round's partial sums if this batch accepted reports (durable sums:
        they go in the same transaction as the reports' rows, before the acks)."""
        records, self._records = self._records, []
        return records + [(a.what, a.data) for a in self.machine.checkpoint()] if records else records

    def _flush(self) -> None:
        """Write the waiting records, then send the publishes that waited for them. If the write raises, they
        are not sent (the caller halts: :meth:`_halt` drops them)."""
        records = self._batch()
        if records:
            with self._timed("persist"):
                self.store.apply_batch(records)
                if self.inbox is not None and any(what == "open" for what, _ in records):
                    self.inbox.set_limits(self.machine.report_limits())  # before any plan goes out
            for what, data in records:
                self.observer.persisted(what, data)
        held, self._held = self._held, []
        for a in held:
            self._publish(a)

    def _publish(self, a: Publish) -> None:
        with self._timed("publish"):
            self.link.publish(a.topic, a.payload, a.qos, a.retain)
        self.observer.published(a.topic, a.payload)  # the metrics count bytes down and late answers here

    def _committed(self, summary: dict, state: ServerState) -> None:
        if "accuracy" in summary:  # evaluated when the commit was vetted
            with self._timed("persist"):
                self.store.save_metrics(summary["round"], {"accuracy": summary["accuracy"], "loss": summary["loss"]})
        self.observer.committed(summary)
        if self.on_round:
            self.on_round(summary)

    def prefetch(self, runtimes: tuple[str, ...]) -> int:
        """Ask the catalog now, in the background, for the programs the next round's plans need on devices of
        ``runtimes`` (the bucket family, for a strategy whose plans have buckets: coordinator/buckets.py), so
        that the exports run while the fleet starts and checks in, not after. Returns how many were asked for.
        The plan comes from a copy of the strategy (a plan may memoise per device)."""
        import copy
        request = getattr(self.programs, "request", None)
        if request is None or not getattr(self.programs, "background", False):
            return 0
        dp = copy.deepcopy(self.strategy).plan(self.machine.state, "prefetch", {})
        first = (dp.padded.spec, dp.padded.layout) if dp.padded is not None else (dp.spec, dp.layout)
        family = [f for f in (dp.padded.family if dp.padded is not None else ()) if f != first]
        wanted = [(first, rt) for rt in runtimes if rt != "torch"]  # what the first round needs, first
        wanted += [(f, rt) for f in family for rt in runtimes if rt != "torch"]
        for (spec, layout), rt in wanted:
            request(spec, rt, dp.objective, layout)
        return len(wanted)

    # ---- lifecycle
    def start(self) -> "Coordinator":
        self.link.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def stop(self) -> None:
        self.link.stop()
        if self._records and not self._halted:  # written, though their acks can no longer go out: devices resend
            self.store.apply_batch(self._batch())
        self.store.close()
        if self.inbox is not None:
            self.inbox.close()
        if hasattr(self.programs, "close"):
            self.programs.close()
        if hasattr(self.evaluator, "close"):
            self.evaluator.close()

    @property
    def state(self) -> ServerState:
        return self.machine.state
