"""The fleet registry and the eligibility rules (Bonawitz et al. 2019 section 3: idle, charging, unmetered)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Eligibility:
    """Which devices may be asked to train. Defaults follow Google's production rules."""

    require_charging: bool = True
    require_unmetered: bool = True
    require_idle: bool = True
    min_battery: float = 0.0
    min_memory_mb: int = 0
    runtimes: tuple[str, ...] = ("torch", "ort", "executorch")

    def reason_against(self, caps: dict[str, Any]) -> str | None:
        """None if eligible, else why not (for logs and tests)."""
        if self.require_charging and not caps.get("charging", False):
            return "not charging"
        if self.require_unmetered and caps.get("network", "wifi") not in ("wifi", "ethernet"):
            return "metered network"
        if self.require_idle and not caps.get("idle", True):
            return "not idle"
        if float(caps.get("battery", 1.0)) < self.min_battery:
            return "battery low"
        if int(caps.get("memory_mb", 0)) < self.min_memory_mb:
            return "not enough memory"
        if caps.get("runtime") not in self.runtimes:
            return f"runtime {caps.get('runtime')!r} not served"
        return None


@dataclass
class DeviceRecord:
    device_id: str
    capabilities: dict[str, Any] = field(default_factory=dict)
    programs: set[str] = field(default_factory=set)
    n_samples: int = 0
    online: bool = False
    available: bool = False  # checked in since its last task
    last_seen: float = 0.0


class Registry:
    def __init__(self) -> None:
        self.devices: dict[str, DeviceRecord] = {}

    def checkin(self, device_id: str, caps: dict[str, Any], programs: list[str], n_samples: int, now: float) -> DeviceRecord:
        d = self.devices.setdefault(device_id, DeviceRecord(device_id))
        d.capabilities, d.programs, d.n_samples = dict(caps), set(programs), n_samples
        d.online = d.available = True
        d.last_seen = now
        return d

    def offline(self, device_id: str) -> None:
        d = self.devices.get(device_id)
        if d:
            d.online = d.available = False

    def busy(self, device_id: str) -> None:
        d = self.devices.get(device_id)
        if d:
            d.available = False

    def eligible(self, rules: Eligibility) -> list[str]:
        """Sorted ids of online, available devices that pass the rules (sorted: selection is seeded)."""
        return sorted(d.device_id for d in self.devices.values()
                      if d.online and d.available and rules.reason_against(d.capabilities) is None)
