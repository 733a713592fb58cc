"""Seeded device selection with over-selection, and per-device seeds, as pure functions.

Both are deterministic in (run seed, round, attempt), so an in-process reference loop can pick the same
devices and the same seeds as the daemon.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np


def _mix(*parts: object) -> int:
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def n_to_select(target: int, over_selection: float, available: int) -> int:
    return min(available, math.ceil(target * over_selection))


def select(eligible: list[str], k: int, seed: int, round_: int, attempt: int) -> list[str]:
    """``k`` devices drawn without replacement from the sorted eligible list."""
    rng = np.random.default_rng(_mix("select", seed, round_, attempt))
    idx = rng.choice(len(eligible), size=min(k, len(eligible)), replace=False)
    return [sorted(eligible)[i] for i in sorted(idx)]


def device_seed(seed: int, round_: int, device_id: str) -> int:
    return _mix("device", seed, round_, device_id)
