"""The round state machine: a sans-I/O core fed MQTT messages and clock ticks, returning actions.

It decodes and validates every message itself (decoding is pure), so byte counts are exactly the MQTT
payloads, and tests drive it with no broker. What must survive a crash is returned as ``Persist`` actions
that the daemon writes to SQLite *before* it carries out the publishes that follow them (an ack is only
sent for a report already on disk).

Rules (Bonawitz et al. 2019, section 2): select ``ceil(target * over_selection)`` eligible devices, commit
as soon as ``target`` reports are in, or at the deadline if at least ``min_reports`` are; otherwise abandon
the attempt and retry the round with a fresh selection. Late reports are acked as ``late`` and dropped.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from edge import wire
from edge.program import Program
from edge.wire import Ack, CheckIn, Chunk, Plan, Report, Status, WireError

from .registry import Eligibility, Registry
from .selection import device_seed, n_to_select, select
from .strategies.base import DevicePlan, ReportRejected, ServerState, Strategy

log = logging.getLogger("fedge.coordinator")


@dataclass
class RoundConfig:
    rounds: int = 30
    clients_per_round: int = 10
    over_selection: float = 1.3
    min_reports: int = 0  # 0: ceil(0.8 * clients_per_round)
    round_timeout_s: float = 120.0
    selection_timeout_s: float = 10.0  # then start with fewer than wanted (but >= min_reports)
    seed: int = 0
    fleet: str = "default"
    chunk_bytes: int = 256 * 1024
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    eligibility: Eligibility = field(default_factory=Eligibility)

    @property
    def min_needed(self) -> int:
        return self.min_reports or max(1, math.ceil(0.8 * self.clients_per_round))


# ---- actions

@dataclass
class Publish:
    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False


@dataclass
class Persist:
    """Write to durable state before carrying out any later action. ``what`` names the record."""
    what: str  # device | open | report | commit | abandon
    data: dict[str, Any]


@dataclass
class RoundCommitted:
    summary: dict[str, Any]
    state: ServerState


@dataclass
class Finished:
    pass


Action = Publish | Persist | RoundCommitted | Finished


@dataclass
class OpenRound:
    round: int
    attempt: int
    task_id: str
    selected: list[str]
    deadline: float
    opened_at: float
    plans: dict[str, DevicePlan]
    acc: Any
    accepted: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)  # accepted, rejected or gone offline
    bytes_down: int = 0
    bytes_up: int = 0


class RoundMachine:
    def __init__(self, cfg: RoundConfig, strategy: Strategy, state: ServerState,
                 programs: Callable[[dict, str, str], Program], *, registry: Registry | None = None, now: float = 0.0):
        self.cfg, self.strategy, self.state, self.programs = cfg, strategy, state, programs
        self.registry = registry or Registry()
        self.open: OpenRound | None = None
        self.attempt = 1
        self.idle_since = now
        self.carry_bytes = [0, 0]  # bytes of abandoned attempts, counted into the round that commits
        self.closed_tasks: list[str] = []
        self._reasm = wire.Reassembler(max_bytes=cfg.max_message_bytes)
        self.finished = state.round >= cfg.rounds
        self.dropped_messages = 0

    # ---------------------------------------------------------------- helpers
    def _topic(self, kind: str, ident: str) -> str:
        return wire.topic(self.cfg.fleet, kind, ident)

    def subscriptions(self) -> list[str]:
        return [wire.topic(self.cfg.fleet, k, "+") for k in ("checkin", "report", "status")]

    def _publish(self, kind: str, ident: str, msg, msg_id: str) -> list[Publish]:
        parts = wire.split(wire.encode(msg), msg_id, self.cfg.chunk_bytes)
        return [Publish(self._topic(kind, ident), p) for p in parts]

    def _drop(self, why: str, topic: str) -> list[Action]:
        self.dropped_messages += 1
        log.error("dropped message on %s: %s", topic, why)
        return []

    # ---------------------------------------------------------------- events
    def receive(self, topic: str, payload: bytes, now: float) -> list[Action]:
        try:
            fleet, kind, ident = wire.parse_topic(topic)
        except WireError as e:
            return self._drop(str(e), topic)
        if fleet != self.cfg.fleet or kind not in ("checkin", "report", "status"):
            return self._drop("not a coordinator topic", topic)
        if kind == "report" and self.open is not None:
            self.open.bytes_up += len(payload)
        raw = payload
        try:
            msg = wire.decode(payload, max_bytes=self.cfg.max_message_bytes, expect=(kind, "chunk"))
            if isinstance(msg, Chunk):
                raw = self._reasm.feed(f"{kind}/{ident}", msg, now)
                if raw is None:
                    return []
                msg = wire.decode(raw, max_bytes=self.cfg.max_message_bytes, expect=(kind,))
            if getattr(msg, "device_id", ident) != ident:
                raise WireError(f"device {msg.device_id!r} wrote on the topic of {ident!r}")
        except WireError as e:
            return self._drop(str(e), topic)
        if isinstance(msg, CheckIn):
            return self._on_checkin(msg, now)
        if isinstance(msg, Status):
            return self._on_status(msg, now)
        return self._on_report(msg, raw, now)

    def _on_checkin(self, m: CheckIn, now: float) -> list[Action]:
        rec = self.registry.checkin(m.device_id, m.capabilities, m.programs, m.n_samples, now)
        if self.open and m.device_id in self.open.plans and m.device_id not in self.open.finished:
            # It checked in again without reporting: it lost or refused the plan.
            self._mark_gone(m.device_id, "checked in without reporting")
        why = self.cfg.eligibility.reason_against(rec.capabilities)
        if why:
            log.debug("device %s not eligible: %s", m.device_id, why)
        return [Persist("device", {"device_id": m.device_id, "caps": m.capabilities, "programs": m.programs,
                                   "n": m.n_samples, "online": True})] + self._maybe_close(now)

    def _on_status(self, m: Status, now: float) -> list[Action]:
        if m.state != "offline":
            return []
        log.info("device %s went offline", m.device_id)
        self.registry.offline(m.device_id)
        out: list[Action] = [Persist("device_offline", {"device_id": m.device_id})]
        if self.open and m.device_id in self.open.plans:
            self._mark_gone(m.device_id, "offline")
            out += self._maybe_close(now)
        return out

    def _mark_gone(self, device_id: str, why: str) -> None:
        o = self.open
        if device_id not in o.finished:
            o.finished.add(device_id)
            log.info("round %d: %s dropped out (%s)", o.round, device_id, why)

    def _ack(self, r: Report, status: str, reason: str = "") -> list[Action]:
        return self._publish("ack", r.device_id, Ack(r.task_id, r.device_id, status, reason), f"a-{r.task_id}")

    def _on_report(self, r: Report, raw: bytes, now: float) -> list[Action]:
        o = self.open
        if o is None or r.task_id != o.task_id:
            if r.task_id in self.closed_tasks:
                log.info("late report %s from %s dropped", r.task_id, r.device_id)
                return self._ack(r, "late", "round closed")
            log.error("report for unknown task %s from %s dropped", r.task_id, r.device_id)
            return self._ack(r, "rejected", "unknown task")
        if r.device_id not in o.plans:
            log.error("report from %s, which was not selected for %s, dropped", r.device_id, o.task_id)
            return self._ack(r, "rejected", "not selected")
        if r.device_id in o.accepted:
            log.info("report %s from %s delivered again; counted once", r.task_id, r.device_id)
            return self._ack(r, "duplicate")
        try:
            self.strategy.accumulate(self.state, o.acc, o.plans[r.device_id], r)
        except ReportRejected as e:
            log.error("report %s from %s rejected: %s", r.task_id, r.device_id, e)
            self._mark_gone(r.device_id, "rejected")
            return self._ack(r, "rejected", str(e)[:200]) + self._maybe_close(now)
        o.accepted.add(r.device_id)
        o.finished.add(r.device_id)
        out: list[Action] = [Persist("report", {"task_id": r.task_id, "device_id": r.device_id,
                                                "payload": raw, "n": r.n_samples})]
        out += self._ack(r, "accepted")
        return out + self._maybe_close(now)

    def tick(self, now: float) -> list[Action]:
        for sender, mid in self._reasm.expire(now):
            log.warning("incomplete transfer %s from %s timed out", mid, sender)
        if self.finished:
            return []
        if self.open is None:
            return self._maybe_open(now)
        return self._maybe_close(now)

    # ---------------------------------------------------------------- round lifecycle
    def _maybe_open(self, now: float) -> list[Action]:
        eligible = self.registry.eligible(self.cfg.eligibility)
        want = n_to_select(self.cfg.clients_per_round, self.cfg.over_selection, 1 << 30)
        waited = now - self.idle_since >= self.cfg.selection_timeout_s
        if len(eligible) < want and not (waited and len(eligible) >= self.cfg.min_needed):
            return []
        return self.open_round(eligible, now)

    def open_round(self, eligible: list[str], now: float) -> list[Action]:
        rnd = self.state.round + 1
        k = n_to_select(self.cfg.clients_per_round, self.cfg.over_selection, len(eligible))
        chosen = select(eligible, k, self.cfg.seed, rnd, self.attempt)
        task = f"r{rnd}a{self.attempt}"
        plans = {d: self.strategy.plan(self.state, d, self.registry.devices[d].capabilities) for d in chosen}
        o = OpenRound(rnd, self.attempt, task, chosen, now + self.cfg.round_timeout_s, now, plans,
                      self.strategy.begin(self.state))
        self.open = o
        out: list[Action] = [Persist("open", {"round": rnd, "attempt": self.attempt, "task_id": task,
                                              "selected": chosen, "deadline": o.deadline, "opened_at": now})]
        for d in chosen:
            out += self._send_plan(o, d)
            self.registry.busy(d)
        log.info("round %d attempt %d: %d devices selected from %d eligible", rnd, self.attempt, len(chosen),
                 len(eligible))
        return out

    def _send_plan(self, o: OpenRound, device_id: str) -> list[Publish]:
        dp = o.plans[device_id]
        rec = self.registry.devices[device_id]
        runtime = rec.capabilities.get("runtime", "torch")
        prog = self.programs(dp.spec, runtime, dp.objective)
        plan = Plan(o.task_id, o.round, device_id, o.deadline, self.strategy.name, runtime, prog.hash, dp.weights,
                    dp.hparams, device_seed(self.cfg.seed, o.round, device_id), dp.upload,
                    None if prog.hash in rec.programs else prog.data)
        msgs = self._publish("plan", device_id, plan, f"p-{o.task_id}")
        o.bytes_down += sum(len(m.payload) for m in msgs)
        return msgs

    def _maybe_close(self, now: float) -> list[Action]:
        o = self.open
        if o is None:
            return []
        if len(o.accepted) >= self.cfg.clients_per_round:
            return self._commit(now)
        everyone_done = len(o.finished) >= len(o.selected)  # finished only ever holds selected devices
        if now >= o.deadline or everyone_done:
            if len(o.accepted) >= self.cfg.min_needed:
                return self._commit(now)
            return self._abandon(now, "deadline" if now >= o.deadline else "too many dropped out")
        return []

    def _close(self, now: float) -> OpenRound:
        o = self.open
        self.open = None
        self.idle_since = now
        self.closed_tasks = (self.closed_tasks + [o.task_id])[-256:]
        return o

    def _commit(self, now: float) -> list[Action]:
        o = self._close(now)
        self.state = self.strategy.finish(self.state, o.acc)
        summary = {"round": o.round, "task_id": o.task_id, "attempts": o.attempt, "reports": len(o.accepted),
                   "selected": len(o.selected), "dropped": len(o.selected) - len(o.accepted),
                   "accepted": sorted(o.accepted),
                   "bytes_down": o.bytes_down + self.carry_bytes[0], "bytes_up": o.bytes_up + self.carry_bytes[1],
                   "wall_s": now - o.opened_at}
        metrics = getattr(self.strategy, "metrics", None)
        if metrics is not None:
            summary |= metrics(self.state)
        self.carry_bytes = [0, 0]
        self.attempt = 1
        log.info("round %d committed with %d reports (%d selected)", o.round, len(o.accepted), len(o.selected))
        out: list[Action] = [Persist("commit", {"round": o.round, "task_id": o.task_id, "state": self.state,
                                                "summary": summary}),
                             RoundCommitted(summary, self.state)]
        if self.state.round >= self.cfg.rounds:
            self.finished = True
            out.append(Finished())
        return out

    def _abandon(self, now: float, why: str) -> list[Action]:
        o = self._close(now)
        self.carry_bytes[0] += o.bytes_down
        self.carry_bytes[1] += o.bytes_up
        log.warning("round %d attempt %d abandoned (%s): %d of %d needed reports", o.round, o.attempt, why,
                    len(o.accepted), self.cfg.min_needed)
        self.attempt += 1
        return [Persist("abandon", {"round": o.round, "attempt": o.attempt, "task_id": o.task_id})]

    # ---------------------------------------------------------------- recovery
    def restore_open(self, info: dict[str, Any], reports: list[bytes]) -> None:
        """Re-open the round that was in flight when the coordinator died, with its accepted reports.

        Plans are recomputed (they are a pure function of state and device), not re-sent: the devices
        already have them, and their reports are queued for us at the broker or will be resent.
        """
        self.attempt = info["attempt"]
        plans = {d: self.strategy.plan(self.state, d, self.registry.devices.get(d).capabilities
                                       if d in self.registry.devices else {}) for d in info["selected"]}
        o = OpenRound(info["round"], info["attempt"], info["task_id"], list(info["selected"]), info["deadline"],
                      info["opened_at"], plans, self.strategy.begin(self.state))
        for payload in reports:
            r = wire.decode(payload, max_bytes=self.cfg.max_message_bytes, expect=("report",))
            self.strategy.accumulate(self.state, o.acc, plans[r.device_id], r)
            o.accepted.add(r.device_id)
            o.finished.add(r.device_id)
        for d in o.selected:
            self.registry.busy(d)
        self.open = o
