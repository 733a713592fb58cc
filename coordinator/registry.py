"""The fleet registry, the eligibility rules (Bonawitz et al. 2019 section 3: idle, charging, unmetered),
and the quarantine of devices that keep sending what the coordinator must reject.

Capabilities come from the network, so they are parsed into a typed record at check-in
(:func:`edge.protocol.capabilities.parse_capabilities`); a check-in whose known fields have the wrong type is
rejected there, and the eligibility rules only ever see well-typed values.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from edge.protocol.capabilities import KNOWN_RUNTIMES, BadCapabilities

@dataclass
class Eligibility:
    """Which devices may be asked to train (``[eligibility]``). Defaults follow Google's production rules."""

    require_charging: bool = True
    require_unmetered: bool = True
    require_idle: bool = True
    min_battery: float = field(default=0.0, metadata={"min": 0.0, "max": 1.0})
    min_memory_mb: int = field(default=0, metadata={"min": 0})
    runtimes: tuple[str, ...] = KNOWN_RUNTIMES

    def __post_init__(self) -> None:
        bad = [r for r in self.runtimes if r not in KNOWN_RUNTIMES]
        if bad or not self.runtimes:
            raise ValueError(f"runtimes {list(self.runtimes)}: each must be one of {', '.join(KNOWN_RUNTIMES)}")

    def reason_against(self, caps: dict[str, Any]) -> str | None:
        """None if eligible, else why not (for logs and tests). ``caps`` went through
        :func:`parse_capabilities`; absent fields take the permissive value, except the runtime."""
        if self.require_charging and caps.get("charging") is not True:
            return "not charging"
        if self.require_unmetered and caps.get("network", "wifi") not in ("wifi", "ethernet"):
            return "metered network"
        if self.require_idle and caps.get("idle", True) is not True:
            return "not idle"
        if caps.get("battery", 1.0) < self.min_battery:
            return "battery low"
        if caps.get("memory_mb", 0) < self.min_memory_mb:
            return "not enough memory"
        if caps.get("runtime") not in self.runtimes:
            return f"runtime {str(caps.get('runtime'))[:32]!r} not served"
        return None


@dataclass
class Quarantine:
    """A device that had ``after`` messages rejected within ``window_s`` is not selected for ``first_s``
    seconds; each further quarantine doubles that, up to ``max_s``. A quiet ``window_s`` resets the
    count, not the doubling (a device that relapses gets the longer time)."""

    after: int = field(default=3, metadata={"min": 1})
    window_s: float = field(default=600.0, metadata={"min": 0.0})
    first_s: float = field(default=300.0, metadata={"min": 0.0})
    max_s: float = field(default=3600.0, metadata={"min": 0.0})


@dataclass
class DeviceRecord:
    device_id: str
    capabilities: dict[str, Any] = field(default_factory=dict)
    programs: set[str] = field(default_factory=set)
    n_samples: int = 0
    online: bool = False
    available: bool = False  # checked in since its last task
    last_seen: float = 0.0
    # when the coordinator expects to hear from it next: its last check-in, the time a pace message named, or the
    # end of a plan's deadline and grace. Not heard from for the registry's stale_after_s past this, it leaves
    # selection; for forget_after_s, the registry.
    expect: float = 0.0
    checkins: int = 0
    rejected: int = 0  # messages rejected, ever
    recent: deque = field(default_factory=deque)  # times of rejections within the quarantine window
    quarantines: int = 0
    quarantined_until: float = 0.0
    last_reason: str = ""

    def quarantined(self, now: float) -> bool:
        return now < self.quarantined_until


class Registry:
    def __init__(self, quarantine: Quarantine | None = None, *, max_devices: int = 1_000_000,
                 stale_after_s: float = math.inf, forget_after_s: float = math.inf) -> None:
        self.devices: dict[str, DeviceRecord] = {}
        # registrations expire ([rounds] stale_after_s, forget_after_s; RoundMachine sets them): a check-in
        # flood of ids that never come back holds selection and memory for that long, not for ever
        self.stale_after_s, self.forget_after_s = stale_after_s, forget_after_s
        self.quarantine = quarantine or Quarantine()
        self.max_devices = max_devices
        # rejections of ids that never checked in (a forged topic, say): bounded, oldest forgotten first
        self.strangers: dict[str, DeviceRecord] = {}

    def checkin(self, device_id: str, caps: dict[str, Any], programs: list[str], n_samples: int, now: float,
                *, available: bool = True) -> DeviceRecord:
        d = self.devices.get(device_id)
        if d is None:
            if len(self.devices) >= self.max_devices:
                raise BadCapabilities(f"the registry is full ({self.max_devices} devices)")
            d = self.devices[device_id] = self.strangers.pop(device_id, None) or DeviceRecord(device_id)
        d.capabilities, d.programs, d.n_samples = dict(caps), set(programs), n_samples
        d.online = True
        d.available = available
        d.last_seen = d.expect = now
        d.checkins += 1
        return d

    def stale(self, d: DeviceRecord, now: float) -> bool:
        """Not heard from for ``stale_after_s`` past when it was expected: out of selection until it checks in."""
        return now > d.expect + self.stale_after_s

    def expire(self, now: float, keep=()) -> list[str]:
        """Forget the devices not heard from for ``forget_after_s`` past when they were expected (not those in
        ``keep``, the open round's, nor a quarantined one before its quarantine ends); returns their ids."""
        cut = now - self.forget_after_s
        gone = [i for i, d in self.devices.items()
                if d.expect < cut and i not in keep and not d.quarantined(now)]
        for i in gone:
            del self.devices[i]
        return gone

    def offline(self, device_id: str) -> None:
        d = self.devices.get(device_id)
        if d:
            d.online = d.available = False

    def busy(self, device_id: str) -> None:
        d = self.devices.get(device_id)
        if d:
            d.available = False

    def reject(self, device_id: str, now: float, reason: str, *, strike: bool = True) -> tuple[DeviceRecord, bool]:
        """Record one rejected message. With ``strike`` (the message shows a broken or hostile device, not
        merely a late one) it counts towards quarantine. Returns the record and whether this call
        quarantined the device."""
        d = self.devices.get(device_id)
        if d is None:
            d = self.strangers.pop(device_id, None) or DeviceRecord(device_id)
            self.strangers[device_id] = d
            while len(self.strangers) > 10_000:
                del self.strangers[next(iter(self.strangers))]
        q = self.quarantine
        d.rejected += 1
        d.last_reason = reason[:200]
        if not strike:
            return d, False
        d.recent.append(now)
        # only the newest `after` strikes in the window decide: keeping more (a device that goes on sending
        # while quarantined) would hold one timestamp per message for window_s, memory in proportion to its rate
        while d.recent and (d.recent[0] < now - q.window_s or len(d.recent) > q.after):
            d.recent.popleft()
        if len(d.recent) >= q.after and not d.quarantined(now):
            d.quarantined_until = now + min(q.max_s, q.first_s * 2 ** d.quarantines)
            d.quarantines += 1
            d.recent.clear()
            return d, True
        return d, False

    def eligible(self, rules: Eligibility, now: float = 0.0) -> list[str]:
        """Sorted ids of online, available, unquarantined, not stale devices that pass the rules (sorted: selection
        is seeded)."""
        return sorted(d.device_id for d in self.devices.values()
                      if d.online and d.available and not d.quarantined(now) and not self.stale(d, now)
                      and rules.reason_against(d.capabilities) is None)

    def registered_eligible(self, rules: Eligibility, now: float = 0.0) -> list[str]:
        """Sorted ids of every online, unquarantined, not stale device that passes the rules, busy or not: what a
        reproducible round selects from (its plan waits until the device is free). A device whose last will
        said it went offline is left out: it would never be reachable."""
        return sorted(d.device_id for d in self.devices.values()
                      if d.online and not d.quarantined(now) and not self.stale(d, now)
                      and rules.reason_against(d.capabilities) is None)

    def quarantined(self, now: float) -> list[str]:
        return sorted(d.device_id for d in self.devices.values() if d.quarantined(now))


@dataclass
class Pacing:
    """Pace steering (``[pace]``; Bonawitz et al. 2019, section 2.3): a check-in the coordinator does not act on
    now is answered with when to check in next, uniform over a window whose mean makes the fleet's heartbeats
    arrive at about ``checkins_per_s``, starting when the next selection is expected (the open round's estimated
    end). Production mode only: a reproducible round waits for its busy devices' check-ins."""

    enabled: bool = True
    checkins_per_s: float = field(default=50.0, metadata={"min": 0.01})
    min_window_s: float = field(default=15.0, metadata={"min": 0.0})
    max_after_s: float = field(default=3600.0, metadata={"min": 1.0, "max": 86400.0})
