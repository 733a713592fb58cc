"""The round state machine: a sans-I/O core fed MQTT messages and clock ticks, returning actions.

It decodes and validates every message itself (decoding is pure), so byte counts are exactly the MQTT
payloads, and tests drive it with no broker. What must survive a crash is returned as ``Persist`` actions
that the daemon writes to SQLite *before* it carries out the publishes that follow them (an ack is only
sent for a report already on disk).

Rules (Bonawitz et al. 2019, section 2): select ``ceil(target * over_selection)`` eligible devices, commit
as soon as ``target`` reports are in, or at the deadline if at least ``min_reports`` are; otherwise abandon
the attempt and retry the round with a fresh selection. Late reports are acked as ``late`` and dropped.

Devices are untrusted. Everything that arrives from the network goes through :meth:`RoundMachine.receive`,
which never raises: a message that cannot be used is logged in one line (what, from which device, why),
recorded against the device, acknowledged to the broker like any other (so it is never redelivered into
the same failure) and dropped. A device that keeps sending such messages is quarantined
(:class:`coordinator.registry.Quarantine`). A report is admitted only if it is what its plan asked for
(:mod:`coordinator.admission`), and a round commits only a finite state whose evaluation did not collapse.

The whole machine is :data:`TRANSITIONS` below, in h11's style: phases ``no round`` (between rounds),
``round open`` and ``finished``, and for each (phase, event) the method that handles it and the phases it may
lead to. The phase is not stored: it is read off :attr:`RoundMachine.open` and :attr:`RoundMachine.finished`,
which the handlers set. An event from the daemon (``tick``, ``open_round``, ``restore``, ``restore_open``)
that its phase does not allow raises :class:`~edge.protocol.machine.IllegalEvent` and changes nothing;
network input has a cell in every phase.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from edge.protocol import wire
from edge.protocol.machine import IllegalEvent, Move, Publish, Table, lookup  # noqa: F401 (IllegalEvent, for callers)
from edge.runtime.program import Program
from edge.protocol.wire import Ack, CheckIn, Chunk, Plan, PlainReport, Report, Status, WireError

from .admission import (AdmissionRules, admit, admit_plain, capped, check_key, local_steps, next_history,
                        per_checks, plain_expected, share_memo, weight_cap)
from edge.protocol.capabilities import BadCapabilities, parse_capabilities

from .registry import Eligibility, Pacing, Quarantine, Registry
from .selection import Reservoir, device_seed, n_to_select, select_ordered, window_seed
from .strategies.base import DevicePlan, ReportRejected, ServerState, Strategy, drop_differences

SIDE_BY_SIDE = 2  # candidate states evaluated at once (vet_all): the daemon's evaluator threads
MAX_SUSPECTS = 16  # a refused commit leaves out at most this many candidates, one at a time (the heaviest movers)
# once the rest passes, a further report is left out only if that raises test accuracy by this much (a colluder
# the guard alone would let through: measured, 1 of 3 sign-flippers at the bound otherwise stayed in)
CULPRIT_MARGIN = 0.1
# a commit the guard passed leaves out reports that move far more than the round's others only if the state
# without them scores this much higher test accuracy (RoundMachine._screened); half of it decides who comes back
SCREEN_MARGIN = 0.05
SCREEN_LOSS = 0.5  # ... or about as accurate, with the test loss falling at least twice as far without them
SCREEN_BACK = 0.0  # once they are out, a suspect comes back only if the loss falls no less (this share) with it
# ... and a loss-based verdict needs the step without the suspects to cut the test loss by at least this share of
# the run's first loss (the initial model's). Near convergence a round moves the loss by thousandths, and the
# ratio of two such steps is noise: `make demo` left an honest device out of round 30 on 0.2340 against 0.2294
# from 0.2356 (a step of 0.27% of the first loss, 2.30). Where the step with them goes back, the distance between
# the two steps must be that share instead: FedSparse's first steps are small (its gates start nearly open), and
# the rule on the step alone kept three sign-flippers in its round 1 over Mosquitto, whose loss rose while the step
# without them fell by less than 1% (benchmarks/attacks.py: 0.111 at round 40)
SCREEN_MIN_GAIN = 0.01


def clearly_better(a: dict[str, float], b: dict[str, float], before: float | None, share: float = SCREEN_LOSS,
                   first: float | None = None) -> bool:
    """Whether the state evaluated as ``a`` clearly beats ``b`` (RoundMachine._screened), both one round's step
    from a state whose test loss was ``before``: SCREEN_MARGIN more test accuracy; or a step whose test loss falls
    where ``b``'s rises; or, about as accurate (within that margin), a step whose test loss falls and ``b``'s
    falls at most (1 - share) as far; these two only when material: ``a``'s loss falls at least SCREEN_MIN_GAIN of
    ``first`` (the run's first loss; ``before`` when not given), or, where ``b``'s rises, the two are that far apart.
    The loss is read as progress made, not as a level: early rounds sit at chance
    accuracy, where accuracy is noise (measured: a poisoned round-1 state at 0.18 against 0.09 without the
    poisoner, whose test loss rose from 2.31 to 2.49 where without it it fell to 2.20), and a poisoned step differs
    only in going less far, or back."""
    acc_a, acc_b = a.get("accuracy"), b.get("accuracy")
    if acc_a is None or acc_b is None:
        return False
    if acc_a >= acc_b + SCREEN_MARGIN:
        return True
    loss_a, loss_b = a.get("loss"), b.get("loss")
    if loss_a is None or loss_b is None or not math.isfinite(loss_a):
        return False
    if not math.isfinite(loss_b):
        return True
    if before is None or not math.isfinite(before):
        return False
    gain_a, gain_b = before - loss_a, before - loss_b
    material = SCREEN_MIN_GAIN * (before if first is None else first)
    if gain_a <= 0:
        return False
    if gain_b < 0:  # b's step went back: the two steps' distance is what must be material, not a's own size
        return gain_a - gain_b >= material
    if gain_a < material:
        return False
    return acc_a >= acc_b - SCREEN_MARGIN and gain_b <= (1 - share) * gain_a


log = logging.getLogger("fedge.coordinator")

CHECKIN_MAX_BYTES = 256 * 1024  # a check-in or status is a few hundred bytes; nothing from a device is unbounded
REPORT_OVERHEAD_BYTES = 64 * 1024  # metrics, names and msgpack framing on top of the arrays a plan allows
# Production mode, while some programs a round needs are exporting: the most other eligible devices planned to
# top the round up with devices whose programs are built, and how often a waiting round looks again
REPLACEMENTS_PLANNED = 64
RECHECK_S = 0.5
ADMISSION_KEY = "_admission"  # the machine's own entry in ServerState.meta (norm history, last accuracy)

NO_ROUND, ROUND_OPEN, FINISHED = "no round", "round open", "finished"
PHASES = (NO_ROUND, ROUND_OPEN, FINISHED)
EVENTS = ("checkin", "report", "status", "tick", "open_round", "next_plans", "checkpoint", "restore",
          "restore_open")
NETWORK = frozenset({"checkin", "report", "status"})  # a message that decoded, from the device on its topic
# An open round closes when it is due: it commits once `clients_per_round` reports are accepted, or at the
# deadline (or when every selected device is done) with at least `min_reports`; otherwise, or if the state it
# would commit is refused, it is abandoned and retried as the next attempt. The last commit finishes the run.
_ANY = (ROUND_OPEN, NO_ROUND, FINISHED)

# (phase, event) -> Move(handler, next phases, what it does). Before the handler, ``tick`` expires stale
# chunked transfers. No cell: IllegalEvent.
TRANSITIONS: Table = {
    (NO_ROUND, "checkin"): Move("_on_checkin", (NO_ROUND,), "register the device"),
    (ROUND_OPEN, "checkin"): Move("_on_checkin", _ANY, "register the device; a selected one that ended its "
                                  "plan unreported drops out (the round may close, and the next open)"),
    (FINISHED, "checkin"): Move("_on_checkin", (FINISHED,), "register the device"),

    (NO_ROUND, "report"): Move("_on_stray_report", (NO_ROUND,), "ack `late` if its round closed, else reject"),
    (ROUND_OPEN, "report"): Move("_on_report", _ANY, "admit and ack `accepted`, or reject (the round may "
                                 "close, and the next open)"),
    (FINISHED, "report"): Move("_on_stray_report", (FINISHED,), "ack `late` if its round closed, else reject"),

    (NO_ROUND, "status"): Move("_on_status", (NO_ROUND,), "an `offline` one: mark the device offline"),
    (ROUND_OPEN, "status"): Move("_on_status", _ANY, "an `offline` one: mark the device offline; a selected "
                                 "one drops out (the round may close, and the next open)"),
    (FINISHED, "status"): Move("_on_status", (FINISHED,), "an `offline` one: mark the device offline"),

    (NO_ROUND, "tick"): Move("_maybe_open", (NO_ROUND, ROUND_OPEN), "open a round once enough devices are "
                             "eligible"),
    (ROUND_OPEN, "tick"): Move("_maybe_close", _ANY, "close the round if it is due, then open the next at "
                               "once if enough devices are eligible"),
    (FINISHED, "tick"): Move("_nothing", (FINISHED,)),

    (NO_ROUND, "open_round"): Move("_open_round", (ROUND_OPEN, NO_ROUND), "select devices, send the first "
                                   "plans (or wait for their programs)"),

    (NO_ROUND, "next_plans"): Move("_no_plans", (NO_ROUND,)),
    (ROUND_OPEN, "next_plans"): Move("_next_plans", (ROUND_OPEN,), "the next plans of the open round"),
    (FINISHED, "next_plans"): Move("_no_plans", (FINISHED,)),

    (NO_ROUND, "checkpoint"): Move("_no_sums", (NO_ROUND,)),
    (ROUND_OPEN, "checkpoint"): Move("_checkpoint", (ROUND_OPEN,), "the round's partial sums, if reports were "
                                     "summed since the last checkpoint (durable sums)"),
    (FINISHED, "checkpoint"): Move("_no_sums", (FINISHED,)),

    (NO_ROUND, "restore"): Move("_restore", (NO_ROUND,), "learn the closed task ids"),
    (FINISHED, "restore"): Move("_restore", (FINISHED,), "learn the closed task ids"),

    (NO_ROUND, "restore_open"): Move("_restore_open", (ROUND_OPEN,), "re-open the round, with its partial sums "
                                     "or by re-admitting its reports"),
}


@dataclass
class RoundConfig:
    """The ``[rounds]`` section of fleet.toml (``metadata`` holds the ranges the config loader enforces)."""

    rounds: int = field(default=30, metadata={"min": 1})
    clients_per_round: int = field(default=10, metadata={"min": 1})
    over_selection: float = field(default=1.3, metadata={"min": 1.0, "max": 100.0})
    min_reports: int = field(default=0, metadata={"min": 0})  # 0: ceil(0.8 * clients_per_round)
    round_timeout_s: float = field(default=120.0, metadata={"min": 0.1})
    selection_timeout_s: float = field(default=10.0, metadata={"min": 0.0})  # then start with fewer (>= min)
    seed: int = field(default=0, metadata={"min": 0})
    fleet: str = "default"
    run_id: str = ""  # part of every task id, so a new run is never confused with an old one's messages
    chunk_bytes: int = field(default=wire.DEFAULT_CHUNK_BYTES, metadata={"min": 4096})
    max_message_bytes: int = field(default=wire.DEFAULT_MAX_MESSAGE_BYTES, metadata={"min": 65536})
    # a chunked report that arrives slower than this on average (after 10 s) is dropped and counted against its
    # device: a trickle holds a device's transfer slot (docs/security.md); 0: never
    min_upload_kbps: float = field(default=16.0, metadata={"min": 0.0})
    eligibility: Eligibility = field(default_factory=Eligibility)
    admission: AdmissionRules = field(default_factory=AdmissionRules)
    quarantine: Quarantine = field(default_factory=Quarantine)
    pace: Pacing = field(default_factory=Pacing)
    # Reproducible mode (simulations, test fleets): selection, the committed reports and the aggregate are
    # pure functions of the seed and the data, not of who checked in first or whose report arrived first.
    reproducible: bool = False
    expected_devices: int = field(default=0, metadata={"min": 0})  # reproducible: first wait until this many register
    # Plans go out as the link drains (RoundMachine.next_plans): opening a round returns the first
    # `plan_window` messages, so a 1,000-device round neither stalls the loop nor holds every plan in memory.
    # 0: every plan at once.
    plan_window: int = field(default=64, metadata={"min": 0})
    # Durable sums (production mode, a strategy that can snapshot its accumulator: FedAvg's weighted mean):
    # an accepted report is made durable by the round's partial sums, written once per batch of reports
    # (RoundMachine.checkpoint) with a small record per report, instead of by its payload. Ingest then writes
    # megabytes per batch, not per report. False: every payload is written (and replayed after a restart).
    durable_sums: bool = True
    # The plain report (RoundMachine._take_plain): a dense float32 report of exactly its plan's tensors is
    # admitted and summed in one pass, with the same result as the general path, which takes every other
    # report. False: every report goes through the general path (a comparison, or a suspicion).
    plain_path: bool = True
    # Registrations expire (docs/operations.md, "Registrations expire"). A device is expected back at its next
    # heartbeat (devices: every 15 s while idle), when the pace message it was sent said, or after its plan's
    # deadline; not heard from for `stale_after_s` past that, it leaves selection until it checks in again, and
    # for `forget_after_s` past that, the registry and its durable row (a check-in registers it again). A
    # device's first check-in is answered with a pace of at most stale_after_s / 2, so ids that check in once
    # and never again (a check-in flood) hold selection for at most 1.5 * stale_after_s.
    stale_after_s: float = field(default=60.0, metadata={"min": 1.0})
    forget_after_s: float = field(default=3600.0, metadata={"min": 1.0})

    def __post_init__(self) -> None:
        if self.forget_after_s < self.stale_after_s:
            raise ValueError(f"forget_after_s = {self.forget_after_s:g} is less than stale_after_s = "
                             f"{self.stale_after_s:g} (a device leaves selection first, then the registry)")
        if not wire.ID_RE.match(self.fleet) or not all(c not in self.fleet for c in "+#/"):
            raise ValueError(f"fleet {self.fleet!r} is not a valid topic level ([A-Za-z0-9_.:-], at most 128)")
        if self.min_reports > self.clients_per_round:
            raise ValueError(f"min_reports = {self.min_reports} is more than clients_per_round = "
                             f"{self.clients_per_round}")

    @property
    def min_needed(self) -> int:
        return self.min_reports or max(1, math.ceil(0.8 * self.clients_per_round))


# ---- actions

@dataclass
class Persist:
    """Write to durable state before carrying out any later action. ``what`` names the record."""
    what: str  # device | device_offline | forget | open | report | sums | commit | abandon | rejection
    data: dict[str, Any]


@dataclass
class RoundCommitted:
    summary: dict[str, Any]
    state: ServerState


@dataclass
class Finished:
    pass


Action = Publish | Persist | RoundCommitted | Finished

# A commit is vetted before it is persisted: metrics of the candidate state (accuracy, loss) from the
# daemon's evaluator. The machine refuses a non-finite loss or an accuracy collapse.
Vet = Callable[[ServerState], dict[str, float]]
# Several candidates vetted at once (the commit's state and the screen's state without its suspects): the daemon
# evaluates them side by side. Default: one after another through ``vet``.
VetAll = Callable[[list[ServerState]], list[dict[str, float]]]


@dataclass
class OpenRound:
    round: int
    attempt: int
    task_id: str
    selected: list[str]  # in the seeded draw order (reproducible mode commits the first ones that report)
    deadline: float
    opened_at: float
    plans: dict[str, DevicePlan]
    acc: Any
    accepted: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)  # accepted, rejected or gone offline
    norms: dict[str, float] = field(default_factory=dict)
    bytes_down: int = 0
    bytes_up: int = 0
    # reproducible mode only
    waiting: set[str] = field(default_factory=set)  # selected, plan not sent yet: busy when the round opened
    pending: dict[str, tuple] = field(default_factory=dict)  # accepted, not yet summed (sums go in order)
    summed: list[str] = field(default_factory=list)  # accepted and summed, in the seeded order
    held: dict[str, tuple] = field(default_factory=dict)  # admitted reports beyond the committing set, unacked
    up: dict[str, int] = field(default_factory=dict)  # bytes of each accepted report's first delivery
    unsent: deque = field(default_factory=deque)  # selected, free, plan not sent yet (next_plans sends them)
    encoder: wire.PlanEncoder = field(default_factory=wire.PlanEncoder)  # packs shared weights once a round
    plain: dict[tuple, tuple] = field(default_factory=dict)  # check_key(plan) -> (plan, plain shapes or None, layout)
    n_cap: int | None = None  # the most samples a report weighs (admission.weight_cap), from the selected's counts
    # each summed report's contribution, for a refused commit's search for its culprits (None: not kept, over
    # AdmissionRules.guard_memory_mb or restored from partial sums): device -> (plan, report) or (plan, n, diffs)
    kept: dict[str, tuple] | None = field(default_factory=dict)
    kept_bytes: int = 0
    first_loss: float | None = None  # round 1's screen: the initial model's test loss, if it measured it
    passed_over: int = 0  # selected devices left out because their programs were still exporting (production)
    unbuilt: set[str] = field(default_factory=set)  # checked in free, plan held until its program is built


def task_id(run_id: str, round_: int, attempt: int) -> str:
    return f"{run_id}-r{round_}a{attempt}" if run_id else f"r{round_}a{attempt}"


def max_report_bytes(plan: DevicePlan) -> int:
    """The largest report this plan lets a device send: every returnable tensor dense at its upload dtype,
    a mask for each, the extras, and framing. Once for the plans of a round that share what may come back."""
    return per_checks(plan, "max_report_bytes", _max_report_bytes)


def _max_report_bytes(plan: DevicePlan) -> int:
    item = 2 if plan.upload.get("dtype") == "f2" else 4
    n = 0
    for shape in plan.returned().values():
        n += item * math.prod(shape) + 4 * shape[0] + 64
    n += sum(np.dtype(wire.DTYPES.get(plan.extra_dtypes.get(k, "f4"), np.float32)).itemsize * math.prod(s) + 64
             for k, s in plan.extras.items())
    return n + REPORT_OVERHEAD_BYTES


class RoundMachine:
    def __init__(self, cfg: RoundConfig, strategy: Strategy, state: ServerState,
                 programs: Callable[[dict, str, str, dict], Program], *, registry: Registry | None = None, now: float = 0.0,
                 vet: Vet | None = None, vet_all: VetAll | None = None):
        self.cfg, self.strategy, self.state, self.programs = cfg, strategy, state, programs
        self.registry = registry or Registry(cfg.quarantine)
        self.registry.stale_after_s, self.registry.forget_after_s = cfg.stale_after_s, cfg.forget_after_s
        self._swept = now  # the last sweep for registrations to forget (tick)
        self.vet = vet
        self.vet_all = vet_all
        self.open: OpenRound | None = None
        self.attempt = 1
        self.idle_since = now
        self.carry_bytes = [0, 0]  # bytes of abandoned attempts, counted into the round that commits
        self.closed_tasks: list[str] = []
        # one transfer per device (its plan's report; a newer one replaces it), capacity by the bytes that
        # arrived, and a transfer slower than min_upload_kbps dropped with a strike (tick)
        self._reasm = wire.Reassembler(max_bytes=cfg.max_message_bytes, max_open_per_sender=1, replace=True,
                                       max_total_bytes=4 * cfg.max_message_bytes,
                                       min_rate=cfg.min_upload_kbps * 1000 / 8)
        self.finished = state.round >= cfg.rounds
        self.dropped_messages = 0
        self.plain_reports = 0  # reports accepted by the fast path (_take_plain), of all accepted
        self.plain_in_place = 0  # of those, the ones read in place (wire.PlainLayout), not from msgpack's map
        self.last_metrics: dict[str, float] = {}
        self._delivery = 0  # bytes of the report being handled (its first complete delivery)
        self._unsaved: str | None = None  # the task whose sums changed since the last checkpoint
        # report size limits of the devices in the last few closed rounds: a straggler's late report must
        # still be read (to ack it 'late'), within what its old plan allowed
        self._recent_limits: list[dict[str, int]] = []
        self._awaiting: list[tuple] = []  # (spec, runtime, objective, layout) of programs a round waits for
        self._exporting_since: float | None = None  # when the next round began waiting for its programs
        self._recheck_at = 0.0  # production: when a round waiting for its programs looks again for built ones
        self._export_s = 0.0  # seconds the round in progress (its attempts so far) waited for program exports
        self._window: Reservoir | None = None  # production selection: the sample of eligible devices so far
        self._round_s = cfg.round_timeout_s / 2  # estimated open-to-close time of a round (pace steering)
        self._pace_rng = np.random.default_rng(window_seed(cfg.seed, -1, 0))

    # ---------------------------------------------------------------- helpers
    def _topic(self, kind: str, ident: str) -> str:
        return wire.topic(self.cfg.fleet, kind, ident)

    def subscriptions(self) -> list[str]:
        return [wire.topic(self.cfg.fleet, k, "+") for k in ("checkin", "report", "status")]

    def _publish(self, kind: str, ident: str, msg, msg_id: str) -> list[Publish]:
        parts = wire.split(wire.encode(msg), msg_id, self.cfg.chunk_bytes)
        return [Publish(self._topic(kind, ident), p) for p in parts]

    def _reject(self, device: str, what: str, why: str, now: float, *, strike: bool = True) -> list[Action]:
        """One line in the log and one record against the device. ``strike``: the message shows a broken or
        hostile device (malformed, not what its plan asked for), and enough of those quarantine it; a
        report that is merely late or for a task this coordinator does not know is no strike."""
        self.dropped_messages += 1
        log.log(logging.ERROR if strike else logging.WARNING, "dropped %s from %s: %s", what, device, why)
        rec, newly = self.registry.reject(device, now, f"{what}: {why}", strike=strike)
        if newly:
            log.warning("device %s quarantined for %.0f s (%d rejected messages, quarantine #%d)", device,
                        rec.quarantined_until - now, rec.rejected, rec.quarantines)
        return [Persist("rejection", {"device_id": device, "what": what, "reason": why[:200], "ts": now,
                                      "strike": strike, "quarantined_until": rec.quarantined_until,
                                      "quarantines": rec.quarantines})]

    def refused(self, device: str, what: str, why: str, now: float, *, strike: bool = True) -> list[Action]:
        """A message an ingest worker refused (coordinator/ingest.py), recorded as if refused here."""
        return self._reject(device, what, why, now, strike=strike)

    def report_limits(self) -> dict[str, int]:
        """The largest report each device of the open round may send (what ingest workers check against)."""
        o = self.open
        return {} if o is None else {d: max_report_bytes(p) for d, p in o.plans.items()}

    @property
    def history(self) -> dict[str, Any]:
        return self.state.meta.get(ADMISSION_KEY, {})

    # ---------------------------------------------------------------- dispatch
    @property
    def phase(self) -> str:
        return FINISHED if self.finished else ROUND_OPEN if self.open is not None else NO_ROUND

    def _move(self, event: str) -> Move:
        """The cell for a daemon's event; IllegalEvent (nothing changed) if this phase has none."""
        return lookup(TRANSITIONS, "RoundMachine", self.phase, event)

    # ---------------------------------------------------------------- events
    def receive(self, topic: str, payload: bytes, now: float) -> list[Action]:
        """A message from the network. Never raises: what cannot be used is logged, recorded, dropped."""
        try:
            fleet, kind, ident = wire.parse_topic(topic)
        except WireError as e:
            self.dropped_messages += 1
            log.error("dropped message on %r: %s", topic[:200], e)
            return []
        if fleet != self.cfg.fleet or kind not in ("checkin", "report", "status") or not wire.ID_RE.match(ident):
            self.dropped_messages += 1
            log.error("dropped message on %r: not a coordinator topic", topic[:200])
            return []
        try:
            return self._receive(kind, ident, payload, now)
        except Exception as e:  # noqa: BLE001 - a bug met by hostile input must not stop the coordinator
            log.exception("internal error on a %s from %s; message dropped", kind, ident)
            return self._reject(ident, kind, f"internal error: {type(e).__name__}: {str(e)[:120]}", now)

    def _receive(self, kind: str, ident: str, payload: bytes, now: float) -> list[Action]:
        o = self.open
        selected = o is not None and ident in o.plans
        if kind == "report" and selected:
            o.bytes_up += len(payload)
        limit = CHECKIN_MAX_BYTES
        if kind == "report":
            # what this device's plan lets it send (or its plan in a recently closed round: a late report)
            limit = max_report_bytes(o.plans[ident]) if selected else self._recent_limit(ident)
        raw = payload
        try:
            if kind == "report" and selected:
                taken, d = self._fast(ident, payload, limit, now)
                if taken is not None:
                    return taken
            else:
                d = wire.unpack(payload, max_bytes=limit or CHECKIN_MAX_BYTES)
            # report values are checked for NaN and inf by admission, in the pass that takes the update's norm
            msg = wire.decode_map(d, expect=(kind, "chunk"), finite_updates=False)
            if isinstance(msg, Chunk):
                if kind != "report" or not limit:
                    return self._reject(ident, kind, "a chunked message from a device with no plan", now,
                                        strike=False)
                raw = self._reasm.feed(ident, msg, now, limit=limit, nbytes=len(payload))
                if raw is None:
                    return []
                delivery = self._reasm.last_wire_bytes  # all the chunks of this message, each once
                if selected:  # (a chunk is a report's: checked above)
                    taken, d = self._fast(ident, raw, limit, now)
                    if taken is not None:
                        return taken
                else:
                    d = wire.unpack(raw, max_bytes=limit)
                msg = wire.decode_map(d, expect=(kind,), finite_updates=False)
            else:
                delivery = len(payload)
            if msg.device_id != ident:
                raise WireError(f"device {msg.device_id!r} wrote on the topic of {ident!r}")
        except WireError as e:
            # too large for a device with no plan (a straggler from before a restart, say), or our reassembly
            # capacity full (a stale partial upload can hold it): not the device's fault, so no strike
            honest = (isinstance(e, wire.TooLarge) and kind == "report" and not limit) or isinstance(e, wire.Busy)
            return self._reject(ident, kind, str(e), now, strike=not honest)
        move = TRANSITIONS.get((self.phase, kind))
        if move is None:  # every phase has a cell for network input (tests/test_rounds.py); this is a guard
            return self._reject(ident, kind, f"no transition in phase {self.phase}", now, strike=False)
        args = (msg, raw, now) if kind == "report" else (msg, now)
        if kind == "report":
            self._delivery = delivery
        return getattr(self, move.handler)(*args)

    def _on_checkin(self, m: CheckIn, now: float) -> list[Action]:
        try:
            caps = parse_capabilities(m.capabilities)
            if m.n_samples > self.cfg.admission.max_samples:
                raise BadCapabilities(f"{m.n_samples} samples is more than max_samples = "
                                      f"{self.cfg.admission.max_samples}")
        except BadCapabilities as e:
            return self._reject(m.device_id, "checkin", str(e), now)
        o = self.open
        busy = False
        send: list[Action] = []
        free_now = o is not None and m.device_id in o.waiting
        if free_now:  # reproducible mode: selected while busy; free now, so its plan goes out
            o.waiting.discard(m.device_id)
            busy = True
        elif o and m.device_id in o.plans and m.device_id not in o.finished:
            if m.last_task == o.task_id:
                # It ended this round's plan without a report: it refused it, or its training failed.
                self._mark_gone(m.device_id, "checked in without reporting")
            else:
                busy = True  # a heartbeat sent before our plan reached it: it is training for us
        prev = self.registry.devices.get(m.device_id)
        before = None if prev is None else (prev.capabilities, prev.programs, prev.n_samples, prev.online,
                                            prev.available)
        try:
            rec = self.registry.checkin(m.device_id, caps, m.programs, m.n_samples, now, available=not busy)
        except BadCapabilities as e:
            return self._reject(m.device_id, "checkin", str(e), now)
        if free_now:
            send = self._send_when_built(o, m.device_id)
        why = self.cfg.eligibility.reason_against(rec.capabilities)
        if why:
            log.debug("device %s not eligible: %s", m.device_id, why)
        elif self._window is not None and rec.available and not rec.quarantined(now):
            self._window.offer(m.device_id)
        out: list[Action] = []
        if before != (rec.capabilities, rec.programs, rec.n_samples, rec.online, rec.available):
            out.append(Persist("device", {"device_id": m.device_id, "caps": caps, "programs": m.programs,
                                          "n": m.n_samples, "online": True, "available": rec.available}))
        if rec.available and not self.cfg.reproducible and self.cfg.pace.enabled:
            out += self._pace(m.device_id, now)
        return out + send + self._settle(now)

    def _pace(self, device_id: str, now: float) -> list[Action]:
        """When this device should check in next, from the expected end of the open round (the next selection):
        uniform over [W/2, 3W/2] with W = registered devices / ``pace.checkins_per_s``. A paced device is paced
        again at its next check-in, so its mean period W is what sets the fleet's steady rate to the target
        (a draw over [0, W] would halve the period and double the rate); the spread of W breaks up herds."""
        p = self.cfg.pace
        window = max(p.min_window_s, len(self.registry.devices) / p.checkins_per_s)
        eta = max(0.0, self.open.opened_at + self._round_s - now) if self.open is not None else 0.0
        after = min(p.max_after_s, eta + float(self._pace_rng.uniform(0.5 * window, 1.5 * window)))
        rec = self.registry.devices[device_id]
        if rec.checkins < 2:  # a new device proves it is there by coming back soon; an id sent once goes stale
            after = min(after, 0.5 * self.cfg.stale_after_s)
        rec.expect = max(rec.expect, now + after)
        return self._publish("pace", device_id, wire.Pace(device_id, after), "pace")

    def _on_status(self, m: Status, now: float) -> list[Action]:
        if m.state != "offline":
            return []
        if m.device_id not in self.registry.devices:
            return []
        log.info("device %s went offline", m.device_id)
        self.registry.offline(m.device_id)
        self._reasm.drop_sender(m.device_id)
        out: list[Action] = [Persist("device_offline", {"device_id": m.device_id})]
        if self.open and m.device_id in self.open.plans:
            self._mark_gone(m.device_id, "offline")
            self.open.waiting.discard(m.device_id)
            out += self._settle(now)
        return out

    def _mark_gone(self, device_id: str, why: str) -> None:
        o = self.open
        if device_id not in o.finished:
            o.finished.add(device_id)
            self._reasm.drop_sender(device_id)
            log.info("round %d: %s dropped out (%s)", o.round, device_id, why)

    def _ack(self, r: Report | PlainReport, status: str, reason: str = "") -> list[Action]:
        return self._publish("ack", r.device_id, Ack(r.task_id, r.device_id, status, reason[:200]), f"a-{r.task_id}")

    def _on_stray_report(self, r: Report, raw: bytes, now: float) -> list[Action]:
        """A report for a task that is not open: late if its round closed, else unknown."""
        if r.task_id in self.closed_tasks:
            log.info("late report %s from %s dropped", r.task_id, r.device_id)
            return self._ack(r, "late", "round closed")
        return self._reject(r.device_id, "report", f"unknown task {r.task_id}", now, strike=False) + \
            self._ack(r, "rejected", "unknown task")

    def _on_report(self, r: Report, raw: bytes, now: float) -> list[Action]:
        o = self.open
        if r.task_id != o.task_id:
            return self._on_stray_report(r, raw, now)
        if r.device_id not in o.plans:
            return self._reject(r.device_id, "report", f"not selected for {o.task_id}", now, strike=False) + \
                self._ack(r, "rejected", "not selected")
        if r.device_id in o.accepted:
            log.info("report %s from %s delivered again; counted once", r.task_id, r.device_id)
            return self._ack(r, "duplicate")
        if r.device_id in o.held:  # delivered again while its turn has not come: it will be answered then
            return []
        if r.device_id in o.finished:  # rejected before, or declared gone: one answer per plan
            return self._ack(r, "rejected", "this plan has ended")
        plan = o.plans[r.device_id]
        try:
            declared = self.registry.devices[r.device_id].n_samples
            if r.n_samples != declared:  # the sample count weighs the report: it must be the one we selected on
                raise ReportRejected(f"sample count {r.n_samples} differs from the {declared} it declared")
            # a count above the round's cap weighs (and is bounded) as the cap: its record keeps the declared one
            admitted, norm = admit(plan, capped(r, o.n_cap), self.cfg.admission, self.history)
            if self.cfg.reproducible:
                drop_differences(admitted)  # it waits for its turn; the sum recomputes w_s - w then
                o.held[r.device_id] = (r, raw, admitted, norm, self._delivery)
                return self._settle(now)
            self.strategy.accumulate(self.state, o.acc, plan, admitted)
            self._keep(o, r.device_id, (plan, admitted))
        except ReportRejected as e:
            self._mark_gone(r.device_id, "rejected")
            return (self._reject(r.device_id, "report", f"{r.task_id}: {e}", now)
                    + self._ack(r, "rejected", str(e)) + self._settle(now))
        return self._accepted(o, r, norm, raw, now)

    def _accepted(self, o: OpenRound, r: Report | PlainReport, norm: float, raw: bytes, now: float) -> list[Action]:
        """A report summed: its record, its ack; the round may close."""
        o.accepted.add(r.device_id)
        o.finished.add(r.device_id)
        o.norms[r.device_id] = norm
        sums = self.sums_durable
        if sums:
            self._unsaved = o.task_id
        out: list[Action] = [Persist("report", {"task_id": r.task_id, "device_id": r.device_id, "n": r.n_samples,
                                                "norm": norm, "nbytes": len(raw), "payload": None if sums else raw})]
        out += self._ack(r, "accepted")
        return out + self._maybe_close(now)

    def _plain_spec(self, ident: str) -> tuple[DevicePlan, dict, wire.PlainLayout] | None:
        """What a plain report of ``ident``'s plan looks like (its plan, :func:`plain_expected`'s tensors, their
        :class:`wire.PlainLayout`), or None when ingest's fast path cannot take this device's report now."""
        o = self.open
        if (getattr(self.strategy, "accumulate_plain", None) is None or not self.cfg.plain_path
                or self.cfg.reproducible or ident in o.finished or ident in o.held
                or TRANSITIONS[(self.phase, "report")].handler != "_on_report"):
            return None
        plan = o.plans[ident]
        key = check_key(plan)  # per-device plans of a downlink share it: this is once per round, not per device
        known = o.plain.get(key)
        if known is None:
            expected = plain_expected(plan) if self.strategy.takes_plain(self.state, plan) else None
            # (the plan is kept so that the ids in the key stay its fields')
            known = o.plain[key] = (plan, expected, None if expected is None else wire.PlainLayout(expected))
        return None if known[1] is None else (plan, known[1], known[2])

    def _fast(self, ident: str, raw: bytes, limit: int, now: float) -> tuple[list[Action] | None, Any]:
        """A message on a selected device's report topic (a whole report, or one chunk of one, which the layout
        and plain_report decline at once) through ingest's fast path: read in place
        (:class:`wire.PlainLayout`) if it is laid out as :func:`wire.encode` writes it, else from msgpack's map
        (:func:`wire.plain_report`). Returns the actions if the fast path took it, else None and msgpack's map
        of the message for the general path (unpacking raises WireError for what cannot be unpacked)."""
        spec = self._plain_spec(ident)
        if spec is not None and len(raw) <= limit:
            r = spec[2].read(raw)  # the values in place, no copy
            if r is not None:
                taken = self._take_plain(ident, spec[0], r, raw, now)
                if taken is not None:
                    self.plain_in_place += 1
                    return taken, None
                spec = None  # the map's fast path would read the same report and decline it too
        d = wire.unpack(raw, max_bytes=limit or CHECKIN_MAX_BYTES)
        if spec is not None:
            return self._take_plain(ident, spec[0], wire.plain_report(d, spec[1]), raw, now), d
        return None, d

    def _take_plain(self, ident: str, plan: DevicePlan, r: PlainReport | None, raw: bytes,
                    now: float) -> list[Action] | None:
        """Ingest's fast path: a plain report (dense float32 weights of exactly the plan's tensors, the common
        report, read by :class:`wire.PlainLayout` or :func:`wire.plain_report`) that :meth:`_on_report` would
        accept as it is, summed in one pass with no object per tensor (admission.admit_plain, the strategy's
        ``accumulate_plain``). None for anything else, before anything has changed: the general path then
        decodes the same message and decides. It only ever accepts, and only what the general path accepts,
        with the same norm, sums, records and ack (tests/test_plain_ingest.py drives both paths on the same
        reports)."""
        o = self.open
        if (r is None or r.device_id != ident or r.task_id != o.task_id
                or r.n_samples != self.registry.devices[ident].n_samples
                or (o.n_cap is not None and r.n_samples > o.n_cap)):  # the general path caps its weight
            return None
        admitted = admit_plain(plan, r, self.cfg.admission, self.history)
        if admitted is None:
            return None
        self.strategy.accumulate_plain(self.state, o.acc, plan, ident, r.n_samples, admitted[0])
        self._keep(o, ident, (plan, r.n_samples, admitted[0]))
        self.plain_reports += 1
        return self._accepted(o, r, admitted[1], raw, now)

    def tick(self, now: float) -> list[Action]:
        move = self._move("tick")
        for sender, mid in self._reasm.expire(now):
            log.warning("incomplete transfer %s from %s timed out", mid, sender)
        out: list[Action] = []
        for sender, mid in self._reasm.slow(now):
            out += self._reject(sender, "report", f"chunked transfer {mid} trickled below "
                                f"{self.cfg.min_upload_kbps:g} kbit/s", now)
        if now - self._swept >= 1.0:
            self._swept = now
            out += self._forget(now)
        if self.open is not None and self.open.unbuilt:
            out += self._send_built()
        return out + getattr(self, move.handler)(now)

    def _forget(self, now: float) -> list[Action]:
        """Registrations not heard from for ``forget_after_s`` past when they were expected leave the registry."""
        gone = self.registry.expire(now, keep=self.open.plans if self.open is not None else ())
        if not gone:
            return []
        log.info("forgot %d device(s) not heard from for %.0f s past their expected check-in (%s%s)", len(gone),
                 self.cfg.forget_after_s, ", ".join(gone[:5]), ", ..." if len(gone) > 5 else "")
        return [Persist("forget", {"device_ids": gone})]

    def open_round(self, eligible: list[str], now: float) -> list[Action]:
        """Open the next round over ``eligible`` now (``tick`` does this by itself when enough are eligible)."""
        return getattr(self, self._move("open_round").handler)(eligible, now)

    def _samples(self, device_id: str) -> int:
        rec = self.registry.devices.get(device_id)
        return rec.n_samples if rec is not None else 0

    @property
    def sums_durable(self) -> bool:
        """Accepted reports are made durable by the round's partial sums (RoundConfig.durable_sums), not their
        payloads: production mode, and a strategy that can snapshot its accumulator (``can_snapshot``,
        ``snapshot``, ``restore_snapshot``: FedAvg's mean)."""
        can = getattr(self.strategy, "can_snapshot", None)
        return self.cfg.durable_sums and not self.cfg.reproducible and can is not None and can()

    def checkpoint(self) -> list[Action]:
        """The open round's partial sums if reports were summed since the last call, as a record to write in
        the same batch as those reports' records and before their acks. The daemon calls it before each write."""
        return getattr(self, self._move("checkpoint").handler)()

    def _checkpoint(self) -> list[Action]:
        o, task, self._unsaved = self.open, self._unsaved, None
        if task is None or o is None or o.task_id != task:
            return []
        return [Persist("sums", {"task_id": task, "blob": self.strategy.snapshot(o.acc)})]

    def _no_sums(self) -> list[Action]:
        self._unsaved = None
        return []

    def restore(self, closed_tasks: list[str]) -> None:
        """Closed task ids from durable state, so a report for a round closed before a restart is 'late'."""
        getattr(self, self._move("restore").handler)(closed_tasks)

    def restore_open(self, info: dict[str, Any], reports: list[bytes]) -> None:
        """Re-open the round that was in flight when the coordinator died, with its accepted reports.

        Plans are recomputed (they are a pure function of state and device), not re-sent: the devices
        already have them, and their reports are queued for us at the broker or will be resent. Reports are
        admitted again by the same rules, which gives the same (clipped) values as before the crash. With
        durable sums, ``info["sums"]`` is the accumulator's last snapshot and ``info["accepted"]`` the
        (device, n, norm) of every report it holds.
        """
        getattr(self, self._move("restore_open").handler)(info, reports)

    def _nothing(self, *_) -> list[Action]:
        return []

    # ---------------------------------------------------------------- reproducible mode
    def _committing(self, o: OpenRound) -> list[str]:
        """The devices whose reports a reproducible round commits: the first ``clients_per_round`` of the seeded
        order that have not dropped out (a drop lets the next over-selected device in)."""
        gone = o.finished - o.accepted  # rejected, offline, or ended the plan unreported
        return [d for d in o.selected if d not in gone][:self.cfg.clients_per_round]

    def _settle(self, now: float) -> list[Action]:
        """After a report or a drop: in reproducible mode accept and sum what the seeded order allows now; then
        close the round if it is due."""
        o = self.open
        if o is None:
            return []
        out = self._accept_in_order(o) if self.cfg.reproducible else []
        return out + self._maybe_close(now)

    def _accept_in_order(self, o: OpenRound) -> list[Action]:
        """Accept the held reports of the committing set (persist, ack), and sum accepted reports in the seeded
        order as far as it is complete: the aggregate is the same whatever order the reports arrived in.
        (Production mode accepts on arrival and sums as it goes.)"""
        out: list[Action] = []
        committing = self._committing(o)
        for d in committing:
            if d in o.held:
                r, raw, admitted, norm, nbytes = o.held.pop(d)
                o.accepted.add(d)
                o.finished.add(d)
                o.norms[d], o.up[d] = norm, nbytes
                o.pending[d] = (o.plans[d], admitted)
                out += [Persist("report", {"task_id": r.task_id, "device_id": d, "payload": raw, "n": r.n_samples})]
                out += self._ack(r, "accepted")
        for d in committing:
            if d in o.summed:
                continue
            if d not in o.pending:
                break  # an earlier device's report has not come: later ones wait in order
            plan, admitted = o.pending.pop(d)
            self.strategy.accumulate(self.state, o.acc, plan, admitted)
            self._keep(o, d, (plan, admitted))
            o.summed.append(d)
        return out

    def _release(self, o: OpenRound) -> list[Action]:
        """Answer the held reports a closing round did not need, so those devices stop resending."""
        out: list[Action] = []
        for d, (r, *_rest) in sorted(o.held.items()):
            out += self._ack(r, "late", "not needed: the round committed without it")
        o.held.clear()
        return out

    def _maybe_close_reproducible(self, o: OpenRound, now: float) -> list[Action]:
        target = self.cfg.clients_per_round
        if now >= o.deadline:  # whoever has not reported is out; the next ones in order take their places
            for d in [d for d in self._committing(o) if d not in o.accepted and d not in o.held]:
                self._mark_gone(d, "deadline")
            acks = self._accept_in_order(o)
            if len(o.summed) >= self.cfg.min_needed:
                return acks + self._commit(now)
            return acks + self._abandon(now, "deadline")
        committing = self._committing(o)
        if len(o.summed) >= target:
            return self._commit(now)
        if len(committing) < target and set(committing) <= set(o.summed):  # nobody left who could join
            if len(o.summed) >= self.cfg.min_needed:
                return self._commit(now)
            return self._abandon(now, "too many dropped out")
        return []

    # ---------------------------------------------------------------- round lifecycle
    def _maybe_open(self, now: float) -> list[Action]:
        if self.cfg.reproducible:
            # from every registered eligible device, busy or not, once the whole fleet has registered: who
            # checked in first decides nothing (a busy device's plan waits until it is free)
            # (once the whole fleet has registered; a device that died since is not waited for)
            want = n_to_select(self.cfg.clients_per_round, self.cfg.over_selection, 1 << 30)
            candidates = self.registry.registered_eligible(self.cfg.eligibility, now)
            if len(self.registry.devices) < (self.cfg.expected_devices or want) or len(candidates) < self.cfg.min_needed:
                return []
            return self._open_round(candidates, now)
        want = n_to_select(self.cfg.clients_per_round, self.cfg.over_selection, 1 << 30)
        w = self._selection_window(want, now)
        waited = now - self.idle_since >= self.cfg.selection_timeout_s
        if len(w) < want and not (waited and len(w) >= self.cfg.min_needed):
            return []
        candidates = [d for d in w.items if self._eligible_now(d, now)]
        if len(candidates) < min(want, len(w)) and len(candidates) < self.cfg.min_needed:
            self._window = None  # too many of the sample went away since: sample afresh
            return []
        return self._open_round(candidates, now, offered=len(w))

    def _selection_window(self, want: int, now: float) -> Reservoir:
        """The production selection's sample: opened over the devices eligible now (one pass over the registry
        per attempt), then every eligible check-in is offered to it as it arrives."""
        if self._window is None:
            self._window = Reservoir(want, window_seed(self.cfg.seed, self.state.round + 1, self.attempt))
            for d in self.registry.eligible(self.cfg.eligibility, now):
                self._window.offer(d)
        return self._window

    def _eligible_now(self, device_id: str, now: float) -> bool:
        rec = self.registry.devices.get(device_id)
        return (rec is not None and rec.online and rec.available and not rec.quarantined(now)
                and not self.registry.stale(rec, now) and self.cfg.eligibility.reason_against(rec.capabilities) is None)

    def _programs_missing(self, plans: dict[str, DevicePlan] | None) -> bool:
        """Whether a program these plans need is still being built (in the background, off the network thread;
        see coordinator.daemon.ProgramCatalog). Asks for what is missing. With ``plans`` None, checks what
        was missing at the last ask, without recomputing plans while the export runs."""
        ready = getattr(self.programs, "ready", None)
        if ready is None:  # a plain callable builds on demand
            return False
        ahead: dict[str, tuple] = {}
        if plans is not None:
            want = {}
            for d, dp in plans.items():
                args = self._program_args(dp, d)
                want[repr(args)] = args
                if self._pads(dp, d):  # a bucket: its family, built ahead (the plan's own bucket among them)
                    for spec, layout in dp.padded.family:
                        a = (spec, args[1], dp.objective, layout)
                        if repr(a) not in want:
                            ahead[repr(a)] = a
            self._awaiting = list(want.values())
        missing = [a for a in self._awaiting if not ready(*a)]
        for a in missing:
            self.programs.request(*a)
        for a in ahead.values():  # after what this round needs (the catalog builds in order); no round waits
            if not ready(*a):
                self.programs.request(*a)
        if not missing:
            self._awaiting = []
        return bool(missing)

    def _built(self, dp: DevicePlan, device_id: str) -> bool:
        """Whether the program ``device_id`` runs for ``dp`` can be taken now."""
        ready = getattr(self.programs, "ready", None)
        return ready is None or ready(*self._program_args(dp, device_id))

    def _pads(self, dp: DevicePlan, device_id: str) -> bool:
        """Whether ``device_id`` runs ``dp`` on a bucket's program: the plan has one, the device's runtime exports
        programs and it declares the padded_programs extension (docs/protocol.md 14.2)."""
        caps = self.registry.devices[device_id].capabilities if device_id in self.registry.devices else {}
        return dp.padded is not None and caps.get("runtime", "torch") != "torch" and caps.get("padded_programs") is True

    def _program_args(self, dp: DevicePlan, device_id: str) -> tuple:
        """(spec, runtime, objective, layout) of the program ``device_id`` runs for ``dp``: its bucket's
        (coordinator/buckets.py) if it pads (:meth:`_pads`), else the plan's own shape. In production mode, while
        the bucket's program is still exporting, the smallest larger bucket of its family that is built: the
        device pads into any bucket that holds its plan, so a round does not wait for the exact one."""
        runtime = (self.registry.devices[device_id].capabilities.get("runtime", "torch")
                   if device_id in self.registry.devices else "torch")
        if not self._pads(dp, device_id):
            return (dp.spec, runtime, dp.objective, dp.layout)
        p = dp.padded
        own = (p.spec, runtime, dp.objective, p.layout)
        ready = getattr(self.programs, "ready", None)
        if self.cfg.reproducible or ready is None or ready(*own):
            return own
        family = list(p.family)  # largest first: those before the plan's bucket hold it too
        i = family.index((p.spec, p.layout)) if (p.spec, p.layout) in family else 0
        for spec, layout in reversed(family[:i]):
            if ready(spec, runtime, dp.objective, layout):
                return (spec, runtime, dp.objective, layout)
        return own

    def _open_round(self, eligible: list[str], now: float, offered: int | None = None) -> list[Action]:
        if self._awaiting and (self.cfg.reproducible or now < self._recheck_at) and self._programs_missing(None):
            # reproducible: the round opens once its programs are built (plans and selection are the same then);
            # production: it looks again at most every RECHECK_S, for devices whose programs are built
            return []
        rnd = self.state.round + 1
        k = n_to_select(self.cfg.clients_per_round, self.cfg.over_selection, len(eligible))
        chosen = select_ordered(eligible, k, self.cfg.seed, rnd, self.attempt)
        task = task_id(self.cfg.run_id, rnd, self.attempt)
        plans = self._plans(chosen)
        passed: list[str] = []
        if self._programs_missing(plans) and not self.cfg.reproducible:
            chosen, plans, passed = self._with_built_programs(chosen, plans, k, rnd, now)
            if len(chosen) >= self.cfg.min_needed:
                self._awaiting = []  # still asked for, and built in the background; this round does without them
        if self._awaiting:
            if self._exporting_since is None:
                log.info("round %d waits for %d program export(s)", rnd, len(self._awaiting))
                self._exporting_since = now
            self._recheck_at = now + RECHECK_S
            return []
        if self._exporting_since is not None:  # export seconds are kept apart from the round's (its summary's export_s)
            self._export_s += now - self._exporting_since
            self._exporting_since = None
        o = OpenRound(rnd, self.attempt, task, chosen, now + self.cfg.round_timeout_s, now, plans,
                      self.strategy.begin(self.state))
        o.n_cap = weight_cap(self.cfg.admission, [self._samples(d) for d in chosen])
        o.passed_over = len(passed)
        self.open = o
        out: list[Action] = [Persist("open", {"round": rnd, "attempt": self.attempt, "task_id": task,
                                              "selected": chosen, "deadline": o.deadline, "opened_at": now})]
        for d in chosen:
            rec = self.registry.devices[d]
            if rec.online and rec.available:
                o.unsent.append(d)
            else:  # reproducible mode selects busy devices too: the plan goes out when it checks in free
                o.waiting.add(d)
            self.registry.busy(d)
            # it checks in when its plan ends: at the latest when it gives up resending (edge/protocol/agent.py,
            # report_grace_s = 30 s past the deadline)
            rec.expect = max(rec.expect, o.deadline + 30.0)
        log.info("round %d attempt %d: %d devices selected from %d eligible%s", rnd, self.attempt, len(chosen),
                 offered if offered is not None else len(eligible),
                 f" ({len(passed)} passed over: their programs are exporting)" if passed else "")
        self._window = None
        return out + self._next_plans(self.cfg.plan_window)

    def _with_built_programs(self, chosen: list[str], plans: dict[str, DevicePlan], k: int, rnd: int,
                             now: float) -> tuple[list[str], dict[str, DevicePlan], list[str]]:
        """Production mode, some selected devices' programs still exporting: the selected devices whose programs
        are built, topped up towards ``k`` from the other eligible devices whose programs are (drawn in the seeded
        order; at most ``REPLACEMENTS_PLANNED`` of them planned, so a fleet whose programs are all exporting costs a
        bounded pass). Returns (devices, their plans, the selected devices passed over). No round waits for an
        export while enough devices can train without it (issue #26); the exports go on in the background, and
        the devices passed over stay eligible for the next rounds."""
        keep = [d for d in chosen if self._built(plans[d], d)]
        passed = [d for d in chosen if d not in keep]
        out = {d: plans[d] for d in keep}
        if len(keep) < k:
            taken = set(chosen)
            rest = [d for d in self.registry.eligible(self.cfg.eligibility, now)
                    if d not in taken and self._eligible_now(d, now)]
            rest = select_ordered(rest, REPLACEMENTS_PLANNED, self.cfg.seed, rnd, self.attempt)
            more = self._plans(rest)
            for d in rest:
                if len(keep) >= k:
                    break
                if self._built(more[d], d):
                    keep.append(d)
                    out[d] = more[d]
            share_memo(out.values())
        return keep, out, passed

    def _send_when_built(self, o: OpenRound, device_id: str) -> list[Action]:
        """A device that checked in free gets its plan if its program is built; else the program is asked for,
        and the plan goes out at the first tick after it is built (:meth:`_send_built`). A restarted
        coordinator re-opens its round (reproducible mode) before any program is built, and taking one here
        would export it on the network thread, holding every ack and check-in for the export's seconds."""
        dp = o.plans[device_id]
        if self._built(dp, device_id):
            return self._send_plan(o, device_id)
        self.programs.request(*self._program_args(dp, device_id))
        o.unbuilt.add(device_id)
        return []

    def _send_built(self) -> list[Action]:
        o, out = self.open, []
        for d in sorted(o.unbuilt):
            if d in o.finished:  # gone offline, or ended the plan, meanwhile
                o.unbuilt.discard(d)
            elif self._built(o.plans[d], d):
                o.unbuilt.discard(d)
                out += self._send_plan(o, d)
        return out

    def next_plans(self, max_messages: int = 0) -> list[Action]:
        """Publishes of the open round's plans not sent yet, about ``max_messages`` of them (whole plans; 0: all).
        The daemon calls this whenever its link has room, so plans stream out at the broker's pace."""
        return getattr(self, self._move("next_plans").handler)(max_messages)

    @property
    def plans_unsent(self) -> int:
        return len(self.open.unsent) if self.open is not None else 0

    def _no_plans(self, _max_messages: int = 0) -> list[Action]:
        return []

    def _next_plans(self, max_messages: int = 0) -> list[Action]:
        o = self.open
        out: list[Action] = []
        while o.unsent and (max_messages <= 0 or len(out) < max_messages):
            d = o.unsent.popleft()
            if d not in o.finished:  # gone offline (or ended) before its turn: nothing to send
                out += self._send_plan(o, d)
        return out

    def _plans(self, chosen: list[str]) -> dict[str, DevicePlan]:
        """The strategy's plans for ``chosen``; a strategy that scales by the fleet learns it first."""
        observe = getattr(self.strategy, "observe_fleet", None)
        if observe is not None:
            observe({d: rec.n_samples for d, rec in self.registry.devices.items()})
        plans = {d: self.strategy.plan(self.state, d, self.registry.devices[d].capabilities
                                       if d in self.registry.devices else {}) for d in chosen}
        share_memo(plans.values())  # per-device plans of one round hold the same arrays: check against them once
        return plans

    def _send_plan(self, o: OpenRound, device_id: str) -> list[Publish]:
        dp = o.plans[device_id]
        rec = self.registry.devices[device_id]
        runtime = rec.capabilities.get("runtime", "torch")
        prog = self.programs(*self._program_args(dp, device_id))
        plan = Plan(o.task_id, o.round, device_id, o.deadline, self.strategy.name, runtime, prog.hash,
                    dp.weights if dp.wire is None else dp.wire, dp.hparams,
                    device_seed(self.cfg.seed, o.round, device_id), dp.upload,
                    None if prog.hash in rec.programs else prog.data, tag=dp.tag, base=dp.base)
        parts = wire.split(o.encoder.encode(plan), f"p-{o.task_id}", self.cfg.chunk_bytes)
        msgs = [Publish(self._topic("plan", device_id), p) for p in parts]
        o.bytes_down += sum(len(m.payload) for m in msgs)
        return msgs

    def _maybe_close(self, now: float) -> list[Action]:
        """Close the open round if it is due, and once it has closed, open the next one in the same event if
        enough devices are eligible: waiting for the next tick cost a round up to ``tick_s`` (50 ms) of idling."""
        out = self._close_if_due(now)
        if self.open is None and out:
            for a in out:
                if isinstance(a, RoundCommitted):  # the summary its commit record holds too (the same dict)
                    a.summary["export_s"] = self._export_s
                    self._export_s = 0.0
            if not self.finished:
                out += self._maybe_open(now)
        return out

    def _close_if_due(self, now: float) -> list[Action]:
        o = self.open
        if o is None:
            return []
        if self.cfg.reproducible:
            return self._maybe_close_reproducible(o, now)
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
        self._window = None
        self._round_s = 0.7 * self._round_s + 0.3 * (now - o.opened_at)  # for pace steering
        self.closed_tasks = (self.closed_tasks + [o.task_id])[-256:]
        # A chunked report still arriving is left to finish (within its plan's limit, _recent_limit) and is
        # acked `late`: dropped here, its last chunks started a transfer that never completed, so the device
        # heard nothing and resent only after ack_timeout_s (5 s), and a round that selected it waited for it.
        for d in o.unsent:  # selected, but the round closed before its plan went out: free again
            rec = self.registry.devices.get(d)
            if rec is not None and rec.online:
                rec.available = True
        self._recent_limits = ([{d: max_report_bytes(p) for d, p in o.plans.items()}] + self._recent_limits)[:4]
        return o

    def _recent_limit(self, device: str) -> int:
        return max((lim.get(device, 0) for lim in self._recent_limits), default=0)

    def _candidate(self, o: OpenRound, acc: Any = None) -> tuple[ServerState | None, dict[str, float], str]:
        """The state this round would commit (from ``acc``, default the round's sums), its metrics, and why it
        must not commit ("" if it may)."""
        return self._candidates(o, [acc])[0]

    def _candidates(self, o: OpenRound, accs: list[Any]) -> list[tuple[ServerState | None, dict[str, float], str]]:
        """:meth:`_candidate` of each of ``accs``, their evaluations asked for at once (``vet_all``)."""
        steps = [self._server_step(o, acc) for acc in accs]
        if self.vet is None:
            return [(new, {}, why) for new, why in steps]
        todo = [new for new, why in steps if not why]
        try:
            together = self.vet_all is not None and len(todo) > 1
            got = list(self.vet_all(todo)) if together else [self.vet(s) for s in todo]
        except Exception:  # noqa: BLE001 - one at a time, so that the failure is the one state's
            log.exception("round %d: evaluating %d candidate states together failed", o.round, len(todo))
            got = [None] * len(todo)
        out, it = [], iter(got)
        for new, why in steps:
            out.append((new, {}, why) if why else self._judged(o, new, next(it)))
        return out

    def _server_step(self, o: OpenRound, acc: Any) -> tuple[ServerState | None, str]:
        try:
            new = self.strategy.finish(self.state, o.acc if acc is None else acc)
        except Exception as e:  # noqa: BLE001 - reports were admitted; a failure here still must not stop us
            log.exception("round %d: the server step failed", o.round)
            return None, f"server step failed: {type(e).__name__}: {e}"
        bad = [k for k, v in list(new.weights.items()) + list(new.opt.items())
               if v.dtype.kind == "f" and not np.isfinite(v).all()]
        if bad:
            return None, f"new state is not finite ({', '.join(bad[:3])})"
        return new, ""

    def _judged(self, o: OpenRound, new: ServerState, metrics: dict[str, float] | None
                ) -> tuple[ServerState | None, dict[str, float], str]:
        """A finite candidate and its evaluation (None: evaluate it now) against the accuracy guard."""
        if metrics is None:
            try:
                metrics = self.vet(new)
            except Exception as e:  # noqa: BLE001 - an evaluation that fails vets nothing
                log.exception("round %d: evaluating the new state failed", o.round)
                return None, {}, f"evaluation failed: {type(e).__name__}: {e}"
        metrics = dict(metrics)
        loss, acc = metrics.get("loss"), metrics.get("accuracy")
        if loss is not None and not math.isfinite(loss):
            return None, metrics, f"evaluation loss is {loss}"
        prev = self.history.get("accuracy")
        drop = self.cfg.admission.max_accuracy_drop
        if drop is not None and acc is not None and prev is not None and acc < prev - drop:
            return None, metrics, f"test accuracy would fall from {prev:.4f} to {acc:.4f}"
        return new, metrics, ""

    def _keep(self, o: OpenRound, device: str, item: tuple) -> None:
        """Keep a summed report's contribution for :meth:`_without_culprits`, within guard_memory_mb."""
        if o.kept is None:
            return
        arrays = item[-1].values() if len(item) == 3 else item[1].tensors.values()
        o.kept_bytes += sum(getattr(a, "values", a).nbytes for a in arrays)
        if o.kept_bytes > self.cfg.admission.guard_memory_mb * 1e6:
            log.info("round %d: reports kept for the commit's guard exceed %.0f MB; not kept", o.round,
                     self.cfg.admission.guard_memory_mb)
            o.kept = None
            return
        if len(item) == 2:
            drop_differences(item[1])  # the sum is done; a rebuild computes w_s - w again
        o.kept[device] = item

    def _rebuild(self, devices: list[str]) -> Any:
        """The open round's sums over ``devices``' kept reports only (in that order)."""
        o = self.open
        acc = self.strategy.begin(self.state)
        for d in devices:
            item = o.kept[d]
            if len(item) == 3:
                self.strategy.accumulate_plain(self.state, acc, item[0], d, item[1], item[2])
            else:
                self.strategy.accumulate(self.state, acc, item[0], item[1])
                drop_differences(item[1])
        return acc

    def _without_culprits(self, o: OpenRound, used: list[str]) -> tuple[ServerState, dict[str, float], list[str]] | None:
        """A refused commit (accuracy guard, a non-finite state): the reports that caused it, found by leaving
        reports out one at a time (greedily: each step leaves out the one whose absence gives the best state:
        finite, passing the guard, then the highest accuracy and the lowest loss), until the rest passes. At most
        a minority goes, and only among the MAX_SUSPECTS heaviest movers (weight x norm). Returns the state, its
        metrics and the culprits, or None (their contributions not kept, or no minority's absence helps)."""
        if o.kept is None or not set(used) <= set(o.kept) or len(used) < 2:
            return None
        weight = {d: min(self._samples(d), o.n_cap or math.inf) * o.norms.get(d, 0.0) for d in used}
        suspects = sorted(used, key=lambda d: -weight[d])[:MAX_SUSPECTS]
        out: list[str] = []
        passed = None  # (state, metrics, culprits) of the first set that passes
        for _ in range((len(used) - 1) // 2):
            best = None
            left = [d for d in suspects if d not in out]
            found = []
            for i in range(0, len(left), SIDE_BY_SIDE):  # a few sums in memory at a time, not MAX_SUSPECTS
                found += self._candidates(o, [self._rebuild([x for x in used if x not in out and x != d])
                                              for d in left[i:i + SIDE_BY_SIDE]])
            for d, (new, metrics, why) in zip(left, found):
                acc, loss = metrics.get("accuracy"), metrics.get("loss")
                score = (new is not None, not why, -math.inf if acc is None else acc,
                         -loss if loss is not None and math.isfinite(loss) else -math.inf)
                if best is None or score > best[0]:
                    best = (score, d, new, metrics, why)
            if best is None:
                break
            if passed is not None:  # the rest passed: one more only if its absence clearly helps
                before, after = passed[1].get("accuracy"), best[3].get("accuracy")
                if best[4] or before is None or after is None or after < before + CULPRIT_MARGIN:
                    break
            out.append(best[1])
            if not best[4]:
                passed = (best[2], best[3], list(out))
        return passed

    def _suspects(self, o: OpenRound, used: list[str]) -> list[str]:
        """The reports :meth:`_screened` would leave out first (largest mover first), whatever the commit's
        metrics: known before its evaluation, so that the state without them is evaluated beside it."""
        f = self.cfg.admission.screen_factor
        if (f is None or self.vet is None or o.kept is None or len(used) < 3 or not set(used) <= set(o.kept)
                or any(o.plans[d].update == "gradient" for d in used)):  # SFVI's sum is exact or nothing
            return []
        per = {d: self._per_step(o, d) for d in used}
        med = float(np.median(list(per.values())))
        return sorted((d for d in used if per[d] > f * med), key=lambda d: -per[d])[:(len(used) - 1) // 2]

    def _screened(self, o: OpenRound, used: list[str], metrics: dict[str, float],
                  known: dict[tuple[str, ...], tuple] | None = None
                  ) -> tuple[ServerState, dict[str, float], list[str], str] | None:
        """A commit the guard passed, screened for reports that move far more than this round's others: those
        moving more than ``screen_factor`` times the round's median norm per local step (the round's own median,
        so it works in round 1, before the guard has an accuracy to keep). They are left out together, and stay
        out only if the state without them is :func:`clearly_better` (more accurate, or its test loss falls at
        least twice as far); then each is offered back alone, smallest mover first, and comes back only if the
        loss falls no less with it. At most a minority goes. An honest fleet's outlier costs an evaluation (beside
        the commit's own: :meth:`_suspects`) and stays; a poisoner has to stay under ``screen_factor``
        (docs/security.md measures what that buys it). Off for gradients (SFVI), whose sum is exact or nothing.
        ``known``: candidates already evaluated, by the devices they sum. Returns the state, its metrics, the
        culprits and why, or None."""
        f = self.cfg.admission.screen_factor
        acc0 = metrics.get("accuracy")
        suspects = self._suspects(o, used)
        if acc0 is None or not suspects:
            return None

        def without(out: list[str]) -> tuple[ServerState | None, dict[str, float]]:
            keep = tuple(d for d in used if d not in out)
            new, m, why = (known or {}).get(keep) or self._candidate(o, self._rebuild(list(keep)))
            return (None, m) if why or m.get("accuracy") is None else (new, m)

        before = self.history.get("loss")
        if before is None and self.vet is not None:  # round 1: the loss of the model it starts from
            before = o.first_loss = self._loss_of(self.state)
        first = self.history.get("first_loss", before)
        out = list(suspects)
        new, m = without(out)
        if new is None or not clearly_better(m, metrics, before, first=first):
            return None
        for d in reversed(suspects):
            back, mb = without([x for x in out if x != d])
            if back is not None and not clearly_better(m, mb, before, SCREEN_BACK, first=first):
                out.remove(d)
                new, m = back, mb
        why = (f"moving more than {f:g}x the round's median norm per step; test accuracy {acc0:.4f} and loss "
               f"{metrics.get('loss', math.nan):.4g} with them, {m['accuracy']:.4f} and {m.get('loss', math.nan):.4g} "
               f"without")
        return new, m, out, why

    def _per_step(self, o: OpenRound, d: str) -> float:
        """A report's update norm per local step, at the steps of the samples it weighs (a capped count: the cap's)."""
        return o.norms.get(d, 0.0) / local_steps(o.plans[d], min(self._samples(d), o.n_cap or math.inf))

    def _first_bound(self, o: OpenRound, used: list[str], now: float) -> tuple[list[str], list[Action]]:
        """The norm bound of a round with no committed round behind it, applied at its commit. Admission's bound
        is then ``norm_factor`` times the whole model's norm (there is no median update yet), which let one report
        of ten throw the model away in round 1, before the guard has an accuracy to keep. At the commit the
        round's own reports give the median: each kept report is admitted again against ``norm_factor`` times
        the round's median norm per step, as every later round's are against the last rounds' (clipped above it,
        refused with a strike beyond ``refuse_factor`` times it), and the sums are rebuilt. Returns the refused
        devices and their strikes. Needs 3 reports: the median of two is their mean, which a far one sets itself,
        so a round 1 of one or two reports keeps admission's bound (docs/security.md)."""
        rules = self.cfg.admission
        if (rules.norm_bound != "auto" or self.history.get("median_norm_per_step") or self.history.get("median_norm")
                or o.kept is None or len(used) < 3 or not set(used) <= set(o.kept)
                or any(o.plans[d].update == "gradient" for d in used)):
            return [], []
        hist = {"median_norm_per_step": float(np.median([self._per_step(o, d) for d in used]))}
        refused, strikes, changed = [], [], False
        for d in used:
            item = o.kept[d]
            bound = rules.bound(hist, o.plans[d], min(self._samples(d), o.n_cap or math.inf))
            if not bound or o.norms[d] <= bound:
                continue
            changed = True
            try:
                if len(item) == 3:  # a plain report's differences: admitted as they came, so its norm is o.norms
                    if not rules.clip and o.norms[d] > rules.refuse_factor * bound:
                        raise ReportRejected(f"update norm {o.norms[d]:.4g} is above the bound {bound:.4g} by more "
                                             f"than {rules.refuse_factor:g}x")
                    c = np.float32(bound / o.norms[d])
                    o.kept[d] = (item[0], item[1], {k: v * c for k, v in item[2].items()})
                else:
                    o.kept[d] = (item[0], admit(item[0], item[1], rules, hist)[0])
            except ReportRejected as e:
                refused.append(d)
                strikes += self._reject(d, "report", f"{o.task_id}: left out of the commit: {e} (the round's own "
                                        f"median, round {o.round} having no committed round behind it)", now)
        if changed:
            log.info("round %d: reports above %g x the round's median norm per step clipped%s", o.round,
                     rules.norm_factor, f", {', '.join(refused)} refused" if refused else "")
            o.acc = self._rebuild([d for d in used if d not in refused])
        return refused, strikes

    def _loss_of(self, state: ServerState) -> float | None:
        try:
            loss = dict(self.vet(state)).get("loss")
        except Exception:  # noqa: BLE001 - an evaluation that fails vets nothing
            log.exception("evaluating the current state failed")
            return None
        return None if loss is None else float(loss)

    def _commit(self, now: float) -> list[Action]:
        o = self.open
        used = list(o.summed if self.cfg.reproducible else sorted(o.accepted))
        excluded, strikes = self._first_bound(o, used, now)
        # the screen's first question (the state without its suspects) is evaluated beside the commit's own
        rest = [d for d in used if d not in excluded]
        suspects = self._suspects(o, rest)
        keep = tuple(d for d in rest if d not in suspects)
        cands = self._candidates(o, [None] + ([self._rebuild(list(keep))] if suspects else []))
        new, metrics, why = cands[0]
        known = {keep: cands[1]} if suspects else {}
        if why:
            found = self._without_culprits(o, [d for d in used if d not in excluded])
            if found is None:
                return strikes + self._abandon(now, f"commit refused: {why}")
            new, metrics, culprits = found
            excluded += culprits
            log.warning("round %d: commit refused (%s); committing without %s, whose reports caused it", o.round,
                        why, ", ".join(culprits))
            for d in culprits:  # strikes: enough of them quarantine the device
                strikes += self._reject(d, "report", f"{o.task_id}: left out of the commit, which with it was "
                                        f"refused ({why})", now)
        rest = [d for d in used if d not in excluded]
        if (screened := self._screened(o, rest, metrics, known)) is not None:  # those the guard let through, too
            new, metrics, out, why = screened
            log.warning("round %d: committing without %s (%s)", o.round, ", ".join(out), why)
            for d in out:
                strikes += self._reject(d, "report", f"{o.task_id}: left out of the commit: {why}", now)
            excluded += out
        self._close(now)
        # the norm bound's reference: this round's update norms per local step (admission.next_history), of the
        # reports it commits, each at the steps of the samples it weighs (a capped count: the cap's)
        hist = next_history(self.history, [self._per_step(o, d) for d in sorted(o.norms) if d not in excluded])
        for k in ("accuracy", "loss"):
            if k in metrics:
                hist[k] = float(metrics[k])
        if "first_loss" not in hist:  # the screen's scale (SCREEN_MIN_GAIN): the initial model's loss if round 1
            first = o.first_loss if o.first_loss is not None else metrics.get("loss")  # measured it, else this one
            if first is not None and math.isfinite(first):
                hist["first_loss"] = float(first)
        new.meta = dict(new.meta) | {ADMISSION_KEY: hist}
        self.state = new
        self.last_metrics = metrics
        used = [d for d in used if d not in excluded]
        # reproducible mode counts the first complete delivery of each committed report (a resend, or the
        # timing of over-selected reports, must not change the figures); production counts every delivery
        up = sum(o.up[d] for d in o.summed) if self.cfg.reproducible else o.bytes_up
        summary = {"round": o.round, "task_id": o.task_id, "attempts": o.attempt, "reports": len(used),
                   "selected": len(o.selected), "dropped": len(o.selected) - len(used), "accepted": sorted(used),
                   "bytes_down": o.bytes_down + self.carry_bytes[0], "bytes_up": up + self.carry_bytes[1],
                   "wall_s": now - o.opened_at} | ({"excluded": sorted(excluded)} if excluded else {}) \
            | ({"passed_over": o.passed_over} if o.passed_over else {}) | metrics
        strategy_metrics = getattr(self.strategy, "metrics", None)
        if strategy_metrics is not None:
            summary |= strategy_metrics(self.state)
        self.carry_bytes = [0, 0]
        self.attempt = 1
        log.info("round %d committed with %d reports (%d selected)", o.round, len(used), len(o.selected))
        out: list[Action] = strikes + [Persist("commit", {"round": o.round, "task_id": o.task_id, "state": self.state,
                                                "summary": summary}),
                             RoundCommitted(summary, self.state)] + self._release(o)
        if self.state.round >= self.cfg.rounds:
            self.finished = True
            out.append(Finished())
        return out

    def _abandon(self, now: float, why: str) -> list[Action]:
        o = self._close(now)
        self.carry_bytes[0] += o.bytes_down
        self.carry_bytes[1] += o.bytes_up
        log.warning("round %d attempt %d abandoned (%s): %d accepted reports, %d needed", o.round, o.attempt, why,
                    len(o.accepted), self.cfg.min_needed)
        self.attempt += 1
        return [Persist("abandon", {"round": o.round, "attempt": o.attempt, "task_id": o.task_id})] + self._release(o)

    # ---------------------------------------------------------------- recovery
    def _restore(self, closed_tasks: list[str]) -> None:
        self.closed_tasks = list(closed_tasks)[-256:]

    def _restore_open(self, info: dict[str, Any], reports: list[bytes]) -> None:
        self.attempt = info["attempt"]
        plans = self._plans(info["selected"])
        o = OpenRound(info["round"], info["attempt"], info["task_id"], list(info["selected"]), info["deadline"],
                      info["opened_at"], plans, self.strategy.begin(self.state))
        o.n_cap = weight_cap(self.cfg.admission, [self._samples(d) for d in o.selected])
        summed = info.get("accepted") or []
        if summed:
            o.kept = None  # their contributions are in the sums only: a refused commit cannot leave one out
            if info.get("sums") is None:  # the records and the sums are written in one transaction
                raise ValueError(f"{info['task_id']}: {len(summed)} accepted reports without their sums")
            o.acc = self.strategy.restore_snapshot(self.state, info["sums"], {d: plans[d] for d, _, _ in summed})
            for d, _n, norm in summed:
                o.accepted.add(d)
                o.finished.add(d)
                o.norms[d] = norm
        for payload in reports:
            r = wire.decode(payload, max_bytes=self.cfg.max_message_bytes, expect=("report",), finite_updates=False)
            try:
                admitted, norm = admit(plans[r.device_id], capped(r, o.n_cap), self.cfg.admission, self.history)
            except ReportRejected as e:  # only if the operator tightened the rules across the restart
                log.error("report %s from %s, accepted before the restart, fails today's rules: %s",
                          r.task_id, r.device_id, e)
                o.finished.add(r.device_id)
                continue
            o.accepted.add(r.device_id)
            o.finished.add(r.device_id)
            o.norms[r.device_id] = norm
            if self.cfg.reproducible:  # summed below, in the seeded order
                o.pending[r.device_id] = (plans[r.device_id], admitted)
                o.up[r.device_id] = len(payload)
            else:
                self.strategy.accumulate(self.state, o.acc, plans[r.device_id], admitted)
                self._keep(o, r.device_id, (plans[r.device_id], admitted))
        if self.cfg.reproducible:
            self._accept_in_order(o)
            # which plans went out before the crash is not known: a device that checks in free gets its plan
            # (one that has it already ignores the copy; one that ended it unreported says so and drops out)
            o.waiting = set(o.selected) - o.accepted
        for d in o.selected:
            self.registry.busy(d)
        self.open = o
