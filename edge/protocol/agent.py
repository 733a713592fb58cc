"""The device agent's sans-I/O core: fed events (connected, message, training done, tick), returns actions.

It never touches a socket, a clock or a thread: the MQTT adapter (:mod:`edge.runtime.device`) feeds it and
carries out what it returns. That keeps every protocol decision testable without a broker.

The whole machine is :data:`TRANSITIONS` below. States: ``offline`` -> ``idle`` (checked in, waiting for a
plan) -> ``training`` -> ``reporting`` (report sent, waiting for the coordinator's ack, resending with
backoff) -> ``idle``. Events come from the adapter (``connected``, ``disconnected``, ``tick``,
``update_capabilities``, ``training_done``) or from the network (a ``plan`` or an ``ack``, once decoded). An
adapter event with no cell raises :class:`~edge.protocol.machine.IllegalEvent` and changes nothing. Network
input never raises: it has a cell in every state, and what a state cannot use is logged and dropped there
(as is anything that does not decode).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from . import wire
from ..runtime.program import program_hash
from .machine import IllegalEvent, Move, Publish, Table, lookup  # noqa: F401 (IllegalEvent, for callers)
from .wire import Ack, CheckIn, Chunk, Plan, Report, Status, WireError

log = logging.getLogger("fedge.device")

OFFLINE, IDLE, TRAINING, REPORTING = "offline", "idle", "training", "reporting"
STATES = (OFFLINE, IDLE, TRAINING, REPORTING)
EVENTS = ("connected", "disconnected", "tick", "update_capabilities", "training_done", "plan", "ack", "pace")
NETWORK = frozenset({"plan", "ack", "pace"})  # a message that decoded, on this device's own topic of its kind

# (state, event) -> Move(handler, next states, what it does). Before the handler: ``connected`` publishes
# the retained ``online`` status, ``tick`` expires stale chunked transfers, ``update_capabilities`` records
# the new capabilities. No cell: IllegalEvent.
TRANSITIONS: Table = {
    (OFFLINE, "connected"): Move("_checkin", (IDLE,), "check in"),
    (IDLE, "connected"): Move("_checkin", (IDLE,), "check in"),
    (TRAINING, "connected"): Move("_nothing", (TRAINING,)),
    (REPORTING, "connected"): Move("_resend_now", (REPORTING,), "resend the report at the next tick"),

    (OFFLINE, "disconnected"): Move("_nothing", (OFFLINE,)),
    (IDLE, "disconnected"): Move("_nothing", (OFFLINE,)),
    (TRAINING, "disconnected"): Move("_nothing", (TRAINING,)),
    (REPORTING, "disconnected"): Move("_nothing", (REPORTING,)),

    (OFFLINE, "tick"): Move("_nothing", (OFFLINE,)),
    (IDLE, "tick"): Move("_heartbeat", (IDLE,), "check in every `heartbeat_s`"),
    (TRAINING, "tick"): Move("_nothing", (TRAINING,)),
    (REPORTING, "tick"): Move("_retry", (REPORTING, IDLE),
                              "resend with backoff; give up at deadline + `report_grace_s` (check in)"),

    (OFFLINE, "update_capabilities"): Move("_nothing", (OFFLINE,)),
    (IDLE, "update_capabilities"): Move("_checkin", (IDLE,), "check in"),
    (TRAINING, "update_capabilities"): Move("_nothing", (TRAINING,)),
    (REPORTING, "update_capabilities"): Move("_nothing", (REPORTING,)),

    (TRAINING, "training_done"): Move("_trained", (REPORTING, IDLE),
                                      "send the report; if training failed, check in instead"),

    (OFFLINE, "plan"): Move("_on_plan", (TRAINING, OFFLINE), "train it if new and in time; else drop"),
    (IDLE, "plan"): Move("_on_plan", (TRAINING, IDLE), "train it if new and in time; else drop"),
    (TRAINING, "plan"): Move("_on_plan_busy", (TRAINING,), "drop (busy)"),
    (REPORTING, "plan"): Move("_on_plan_busy", (REPORTING,), "drop (busy)"),

    (OFFLINE, "ack"): Move("_stale_ack", (OFFLINE,), "drop"),
    (IDLE, "ack"): Move("_stale_ack", (IDLE,), "drop"),
    (TRAINING, "ack"): Move("_stale_ack", (TRAINING,), "drop"),
    (REPORTING, "ack"): Move("_on_ack", (IDLE, REPORTING), "this report's ack: check in; another: drop"),

    (OFFLINE, "pace"): Move("_on_pace", (OFFLINE,), "next heartbeat after the time it says"),
    (IDLE, "pace"): Move("_on_pace", (IDLE,), "next heartbeat after the time it says"),
    (TRAINING, "pace"): Move("_on_pace", (TRAINING,), "next heartbeat after the time it says"),
    (REPORTING, "pace"): Move("_on_pace", (REPORTING,), "next heartbeat after the time it says"),
}


# ---- actions the adapter carries out

@dataclass
class StartTraining:
    """Run the plan (off the network thread) and feed back :meth:`DeviceAgent.training_done`."""
    plan: Plan


@dataclass
class StoreProgram:
    data: bytes


Action = Publish | StartTraining | StoreProgram


@dataclass
class AgentConfig:
    device_id: str
    fleet: str = "default"
    capabilities: dict[str, Any] = field(default_factory=dict)
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    ack_timeout_s: float = 5.0
    report_grace_s: float = 30.0  # keep resending this long past the plan's deadline, then give up
    heartbeat_s: float = 15.0  # an idle device checks in again this often (a restarted coordinator re-learns it)
    max_pace_s: float = 3600.0  # a coordinator's pace message cannot hold the next heartbeat back longer


class DeviceAgent:
    def __init__(self, cfg: AgentConfig, *, n_samples: int, programs: list[str] | None = None):
        if not wire.ID_RE.match(cfg.device_id):
            raise ValueError(f"device id {cfg.device_id!r} is not valid in a topic")
        self.cfg = cfg
        self.n_samples = n_samples
        self.programs: set[str] = set(programs or [])
        self.state = OFFLINE
        self.task: Plan | None = None
        self._report_msgs: list[bytes] = []
        self._retry_at = 0.0
        self._retry_n = 0
        self._give_up_at = 0.0
        self._last_checkin = 0.0
        self._next_checkin = 0.0  # the next heartbeat: heartbeat_s after a check-in, or when a pace message says
        self._last_task = ""  # the last plan received, trained or refused (told to the coordinator in check-ins)
        self._done_tasks: list[str] = []  # recent task ids, so a redelivered plan is not trained twice
        self._reasm = wire.Reassembler(max_bytes=cfg.max_message_bytes)
        self.bytes_sent = 0
        self.bytes_received = 0

    # ---- helpers
    def _t(self, kind: str, ident: str | None = None) -> str:
        return wire.topic(self.cfg.fleet, kind, ident or self.cfg.device_id)

    def _pub(self, kind: str, msg, *, retain: bool = False, msg_id: str | None = None) -> list[Action]:
        payload = wire.encode(msg)
        # a chunked message's id names its content, so a receiver can tell a resend from a new message
        parts = wire.split(payload, msg_id or f"{kind}-{hashlib.sha1(payload).hexdigest()[:16]}", self.cfg.chunk_bytes)
        out = [Publish(self._t(kind), p, 1, retain) for p in parts]
        self.bytes_sent += sum(len(p.payload) for p in out)
        return out

    def status_message(self, state: str, now: float = 0.0) -> bytes:
        return wire.encode(Status(self.cfg.device_id, state, now))

    def last_will(self) -> tuple[str, bytes]:
        """Topic and payload the adapter registers as MQTT last will (retained 'offline')."""
        return self._t("status"), self.status_message("offline")

    def _checkin(self, now: float | None = None) -> list[Action]:
        if now is not None:
            self._last_checkin = now
            self._next_checkin = now + self.cfg.heartbeat_s
        msg = CheckIn(self.cfg.device_id, dict(self.cfg.capabilities), sorted(self.programs), self.n_samples,
                      self._last_task)
        return self._pub("checkin", msg)

    def subscriptions(self) -> list[str]:
        return [self._t("plan"), self._t("ack"), self._t("pace")]

    # ---- dispatch
    def _move(self, event: str) -> Move:
        """The cell for an adapter event; IllegalEvent (nothing changed) if this state has none."""
        return lookup(TRANSITIONS, "DeviceAgent", self.state, event)

    def _run(self, move: Move, *args) -> list[Action]:
        out = getattr(self, move.handler)(*args)
        if len(move.to) == 1:
            self.state = move.to[0]
        return out

    # ---- events from the adapter
    def connected(self, now: float) -> list[Action]:
        move = self._move("connected")
        out = self._pub("status", Status(self.cfg.device_id, "online", now), retain=True)
        return out + self._run(move, now)

    def disconnected(self, now: float) -> list[Action]:
        return self._run(self._move("disconnected"), now)

    def update_capabilities(self, caps: dict[str, Any]) -> list[Action]:
        """Eligibility changed (charger unplugged, Wi-Fi lost): tell the coordinator."""
        move = self._move("update_capabilities")
        self.cfg.capabilities.update(caps)
        return self._run(move)

    def training_done(self, report: Report | None, now: float, error: str = "") -> list[Action]:
        """The adapter's worker finished the plan (``report`` None on failure: nothing is sent)."""
        return self._run(self._move("training_done"), report, now, error)

    def tick(self, now: float) -> list[Action]:
        move = self._move("tick")
        for sender, mid in self._reasm.expire(now):
            log.warning("%s: incomplete transfer %s timed out", self.cfg.device_id, mid)
        return self._run(move, now)

    # ---- events from the network (never raise)
    def received(self, topic: str, payload: bytes, now: float) -> list[Action]:
        self.bytes_received += len(payload)
        try:
            _, kind, ident = wire.parse_topic(topic)
            if ident != self.cfg.device_id:
                raise WireError(f"message for {ident!r} on a topic of this device")
            msg = wire.decode(payload, max_bytes=self.cfg.max_message_bytes, expect=("plan", "ack", "pace", "chunk"))
            if isinstance(msg, Chunk):
                whole = self._reasm.feed(kind, msg, now)
                if whole is None:
                    return []
                msg = wire.decode(whole, max_bytes=self.cfg.max_message_bytes, expect=("plan", "ack"))
            if msg.kind != kind:  # docs/protocol.md section 2: a message's kind matches its topic
                raise WireError(f"a {msg.kind} on the {kind} topic")
        except WireError as e:
            log.error("%s: dropped message on %s: %s", self.cfg.device_id, topic, e)
            return []
        event = msg.kind
        move = TRANSITIONS.get((self.state, event))
        if move is None:  # every state has a cell for network input (tests/test_agent.py); this is a guard
            log.error("%s: dropped %s in state %s", self.cfg.device_id, event, self.state)
            return []
        return self._run(move, msg, now)

    # ---- handlers (named in TRANSITIONS)
    def _nothing(self, *_) -> list[Action]:
        return []

    def _resend_now(self, now: float) -> list[Action]:
        self._retry_at = now  # the old connection may have lost the report
        return []

    def _heartbeat(self, now: float) -> list[Action]:
        return self._checkin(now) if now >= self._next_checkin else []

    def _on_pace(self, pace: wire.Pace, now: float) -> list[Action]:
        """The coordinator spreads the fleet's check-ins (pace steering): the next heartbeat comes when it
        says, within ``max_pace_s``. A check-in the protocol needs (after a plan ends, on reconnecting, when
        eligibility changes) still goes out at once."""
        if pace.device_id != self.cfg.device_id:
            log.error("%s: dropped pace addressed to %s", self.cfg.device_id, pace.device_id)
            return []
        self._next_checkin = now + min(pace.after_s, self.cfg.max_pace_s)
        return []

    def _retry(self, now: float) -> list[Action]:
        if now < self._retry_at:
            return []
        if now >= self._give_up_at:
            log.warning("%s: no ack for %s; giving up", self.cfg.device_id, self.task.task_id)
            return self._finish(now)
        return self._send_report(now)

    def _new_plan(self, plan: Plan) -> bool:
        """Whether ``plan`` is for this device and not one it has had already (then it is trained or refused)."""
        me = self.cfg.device_id
        if plan.device_id != me:
            log.error("%s: dropped plan addressed to %s", me, plan.device_id)
            return False
        if plan.task_id in self._done_tasks or (self.task and self.task.task_id == plan.task_id):
            log.info("%s: plan %s delivered again; ignored", me, plan.task_id)
            return False
        self._last_task = plan.task_id  # from here on the plan is either trained or refused
        return True

    def _on_plan_busy(self, plan: Plan, now: float) -> list[Action]:
        if self._new_plan(plan):
            log.warning("%s: plan %s arrived while busy with %s; ignored", self.cfg.device_id, plan.task_id,
                        self.task.task_id)
        return []

    def _on_plan(self, plan: Plan, now: float) -> list[Action]:
        me = self.cfg.device_id
        if not self._new_plan(plan):
            return []
        if plan.deadline <= now:
            log.warning("%s: plan %s arrived after its deadline; ignored", me, plan.task_id)
            return []
        out: list[Action] = []
        if plan.program is not None:
            if program_hash(plan.program) != plan.program_hash:
                log.error("%s: program in plan %s does not match its hash; ignored", me, plan.task_id)
                return []
            self.programs.add(plan.program_hash)
            out.append(StoreProgram(plan.program))
        elif plan.program_hash not in self.programs:
            log.error("%s: plan %s needs program %s which this device lacks", me, plan.task_id, plan.program_hash[:12])
            return self._checkin()
        self.state, self.task = TRAINING, plan
        out += self._pub("status", Status(me, "training", now), retain=True)
        out.append(StartTraining(plan))
        return out

    def _trained(self, report: Report | None, now: float, error: str) -> list[Action]:
        plan = self.task
        if report is None:
            log.error("%s: training for %s failed: %s", self.cfg.device_id, plan.task_id, error)
            return self._finish(now)
        payload = wire.encode(report)
        self._report_msgs = wire.split(payload, f"r-{plan.task_id}", self.cfg.chunk_bytes)
        self.state = REPORTING
        self._retry_n = 0
        self._give_up_at = plan.deadline + self.cfg.report_grace_s
        return self._send_report(now)

    def _send_report(self, now: float) -> list[Action]:
        self._retry_at = now + self.cfg.ack_timeout_s * (2 ** min(self._retry_n, 5))
        self._retry_n += 1
        out = [Publish(self._t("report"), p, 1, False) for p in self._report_msgs]
        self.bytes_sent += sum(len(p) for p in self._report_msgs)
        return out

    def _stale_ack(self, ack: Ack, now: float) -> list[Action]:
        log.debug("%s: stale ack for %s", self.cfg.device_id, ack.task_id)
        return []

    def _on_ack(self, ack: Ack, now: float) -> list[Action]:
        if ack.task_id != self.task.task_id:
            return self._stale_ack(ack, now)
        level = logging.INFO if ack.status in ("accepted", "duplicate", "late") else logging.WARNING
        log.log(level, "%s: report %s %s %s", self.cfg.device_id, ack.task_id, ack.status, ack.reason)
        return self._finish(now)

    def _finish(self, now: float) -> list[Action]:
        if self.task is not None:
            self._done_tasks = (self._done_tasks + [self.task.task_id])[-64:]
        self.task, self._report_msgs, self.state = None, [], IDLE
        return self._pub("status", Status(self.cfg.device_id, "idle", now), retain=True) + self._checkin(now)
