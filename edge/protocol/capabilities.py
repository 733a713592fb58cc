"""What a device says about itself in a check-in, as a schema: the known capabilities and their types.

Both ends use it: the coordinator parses every check-in with it (a wrong type is a rejected message, never a
crash in the eligibility rules), and a device checks its own configuration with it before it connects.
Unknown capabilities are allowed and kept as sent (they are flat scalars already; the wire guarantees that).
"""
from __future__ import annotations

import math
from typing import Any

KNOWN_RUNTIMES = ("torch", "ort", "executorch")


class BadCapabilities(ValueError):
    """A check-in whose capabilities cannot be used (wrong type or out of range)."""


# name -> (accepted python types, check, what the error says is allowed)
_CAPS: dict[str, tuple[tuple[type, ...], Any, str]] = {
    "runtime": ((str,), lambda v: 0 < len(v) <= 32, "a runtime name"),
    "charging": ((bool,), None, "true or false"),
    "idle": ((bool,), None, "true or false"),
    "network": ((str,), lambda v: 0 < len(v) <= 32, "a network kind (wifi, ethernet, cellular, ...)"),
    "battery": ((int, float), lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    "memory_mb": ((int,), lambda v: 0 <= v < 2**40, "a whole number of MB >= 0"),
    "link_kbps": ((int, float), lambda v: 0 <= v < 1e9, "a number >= 0"),
    # protocol extensions the device implements (docs/protocol.md 6.1): without them it gets float32 plans
    # without tag/base, and dense uploads
    "sampled_upload": ((bool,), None, "true or false"),
    "coded_downlink": ((bool,), None, "true or false"),
    # pads a plan into a larger program of the same objective (docs/protocol.md 14.2); without it, exact-shape programs
    "padded_programs": ((bool,), None, "true or false"),
}

# the capabilities a device's configuration file may set (the wire keeps unknown ones, for newer devices)
KNOWN_CAPABILITIES = tuple(_CAPS)

# What this package's device (edge/algorithms/driver.py, edge/protocol/downlink.py) implements: a Device
# declares it in every check-in.
EXTENSIONS: dict[str, bool] = {"sampled_upload": True, "coded_downlink": True, "padded_programs": True}


def parse_capabilities(caps: dict[str, Any]) -> dict[str, Any]:
    """The capabilities with every known field type-checked; unknown fields are kept as they came
    (they are flat scalars already, the wire guarantees that). Raises :class:`BadCapabilities`."""
    out = dict(caps)
    for k, (types, ok, allowed) in _CAPS.items():
        if k not in caps:
            continue
        v = caps[k]
        if isinstance(v, bool) and bool not in types:
            raise BadCapabilities(f"capability {k} = {v!r}: expected {allowed}")
        if not isinstance(v, types) or (isinstance(v, float) and not math.isfinite(v)) or (ok and not ok(v)):
            raise BadCapabilities(f"capability {k} = {str(v)[:40]!r}: expected {allowed}")
    return out
