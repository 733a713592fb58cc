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


def over_selection_wait(eligible: int, target: int, over_selection: float, min_needed: int,
                        timeout_s: float) -> str | None:
    """What a production round that waits for over-selection says: ``eligible`` devices would do (at least
    ``min_needed``) but are fewer than ``ceil(target * over_selection)``, so the round waits ``timeout_s`` for more
    before it opens with them, and how to make it open at once. None when the round is not waiting for that."""
    want = math.ceil(target * over_selection)
    if eligible >= want or eligible < min_needed or timeout_s <= 0:
        return None
    fits = math.floor(100 * eligible / target) / 100
    fix = (f"set [rounds] over_selection = {fits:g}{'' if fits % 1 else '.0'}" if eligible >= target else
           f"set [rounds] clients_per_round = {eligible} and over_selection = 1.0")
    return (f"{eligible} devices eligible, fewer than the {want} that over-selection asks for ({target} reports x "
            f"over_selection {over_selection:g}): the round waits up to {timeout_s:g} s (selection_timeout_s) for "
            f"more, then opens with {eligible}; for a fleet this small, {fix} to open at once")


def select_ordered(eligible: list[str], k: int, seed: int, round_: int, attempt: int) -> list[str]:
    """``k`` devices drawn without replacement from the sorted eligible list, in the order they were drawn:
    a seeded priority, which fixes which reports a reproducible round commits (the first ``target`` of it)."""
    rng = np.random.default_rng(_mix("select", seed, round_, attempt))
    pool = sorted(eligible)
    idx = rng.choice(len(pool), size=min(k, len(pool)), replace=False)
    return [pool[i] for i in idx]


def select(eligible: list[str], k: int, seed: int, round_: int, attempt: int) -> list[str]:
    """The same draw as :func:`select_ordered`, sorted by id."""
    return sorted(select_ordered(eligible, k, seed, round_, attempt))


def device_seed(seed: int, round_: int, device_id: str) -> int:
    return _mix("device", seed, round_, device_id)


class Reservoir:
    """A uniform sample of ``k`` from a stream of unknown length, in O(k) memory (Vitter's Algorithm R).

    Production selection (Bonawitz et al. 2019, section 2.2): the devices that are eligible when a selection
    window opens, then each eligible check-in during it, are offered once; the round opens over the sample.
    Every device offered has the same chance to be in it, whenever it checked in, and each offer is O(1): a
    fleet of 10,000 is not sorted and filtered on every tick.
    """

    def __init__(self, k: int, seed: int):
        self.k = k
        self.items: list[str] = []
        self.seen: set[str] = set()
        self._rng = np.random.default_rng(seed)

    def offer(self, item: str) -> None:
        if item in self.seen:
            return
        self.seen.add(item)
        if len(self.items) < self.k:
            self.items.append(item)
        else:
            j = int(self._rng.integers(len(self.seen)))
            if j < self.k:
                self.items[j] = item

    def __len__(self) -> int:
        return len(self.seen)


def window_seed(seed: int, round_: int, attempt: int) -> int:
    return _mix("window", seed, round_, attempt)
