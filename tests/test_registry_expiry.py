"""Registrations expire (issue #30: a check-in flood of ids that never come back held selection for hours and
the registry for ever): a device not heard from for ``stale_after_s`` past its expected check-in leaves
selection, and for ``forget_after_s`` the registry and its durable row; honest devices, heartbeating or paced
up to the longest pace the coordinator sends, never do."""
from __future__ import annotations

import dataclasses

import pytest

from coordinator import rounds as R
from coordinator.daemon import ProgramCatalog
from coordinator.registry import Pacing
from coordinator.rounds import RoundConfig, RoundMachine
from coordinator.store import Store
from coordinator.strategies.fedavg import FedAvg
from edge.protocol import wire

from conftest import SPEC

CAPS = {"runtime": "torch", "charging": True, "network": "wifi", "idle": True}


def _checkin(m, dev: str, now: float, last: str = "") -> list:
    return m.receive(wire.topic("default", "checkin", dev), wire.encode(wire.CheckIn(dev, CAPS, [], 30, last)), now)


def _pace(actions, dev: str) -> float | None:
    for a in actions:
        if isinstance(a, R.Publish) and a.topic == wire.topic("default", "pace", dev):
            return wire.decode(a.payload).after_s
    return None


class Honest:
    """Devices that check in when their heartbeat (15 s) or the pace they were sent says, and refuse every plan
    at once (a check-in naming it), so that rounds come and go while the clock runs."""

    def __init__(self, ids: list[str], heartbeat_s: float = 15.0):
        self.next = {d: 0.0 for d in ids}
        self.heartbeat_s = heartbeat_s
        self.gaps: list[float] = []

    def step(self, m: RoundMachine, now: float) -> list:
        out = []
        for d, t in self.next.items():
            o = m.open
            last = o.task_id if o is not None and d in o.plans else ""
            if now >= t or last:
                acts = _checkin(m, d, now, last)
                after = _pace(acts, d)
                self.next[d] = now + (after if after is not None else self.heartbeat_s)
                self.gaps.append(self.next[d] - now)
                out += acts
        return out


def _machine(**kw) -> RoundMachine:
    strategy = FedAvg(spec=SPEC)
    cfg = RoundConfig(**({"rounds": 10_000, "clients_per_round": 3, "over_selection": 1.0, "round_timeout_s": 20.0,
                         "selection_timeout_s": 1.0} | kw))
    return RoundMachine(cfg, strategy, strategy.init(0), ProgramCatalog(), now=0.0)


def test_a_check_in_flood_leaves_selection_after_the_expiry_and_the_registry_later(tmp_path):
    m = _machine(stale_after_s=60.0, forget_after_s=300.0)
    honest = Honest([f"h{i}" for i in range(8)])
    persisted = []
    fakes = [f"fake{i:05d}" for i in range(5000)]
    for i, f in enumerate(fakes):  # 5,000 ids in 2 s, each checking in once (an anonymous broker)
        persisted += _checkin(m, f, 0.5 + 2.0 * i / len(fakes))
    assert len(m.registry.eligible(m.cfg.eligibility, 3.0)) >= 5000
    clean_at, selected_after = None, []
    now = 3.0
    # (a fake selected before it went stale is expected until its plan's deadline + 30 s, then forgotten)
    while now < 3.0 + 60.0 * 1.5 + 20.0 + 30.0 + 300.0 + 5.0:
        persisted += honest.step(m, now) + m.tick(now)
        elig = set(m.registry.eligible(m.cfg.eligibility, now))
        if clean_at is None and elig and not any(e.startswith("fake") for e in elig):
            clean_at = now
        if m.open is not None and m.open.opened_at == now and now > 2.5 + 1.5 * 60.0:
            selected_after.append(list(m.open.selected))
        now += 1.0
    # a fake's first (and only) check-in was paced at most stale_after_s / 2: out of selection by 1.5 * stale_after_s
    assert clean_at is not None and clean_at <= 2.5 + 1.5 * 60.0 + 1.0, clean_at
    assert selected_after and all(d.startswith("h") for sel in selected_after for d in sel)
    # and out of the registry (and its durable rows) forget_after_s later; the honest devices stay
    assert set(m.registry.devices) == set(honest.next)
    forgotten = [d for a in persisted if isinstance(a, R.Persist) and a.what == "forget" for d in a.data["device_ids"]]
    assert set(forgotten) >= set(fakes) - {d for sel in selected_after for d in sel}
    assert not set(forgotten) & set(honest.next)
    st = Store(tmp_path / "s.sqlite")
    st.apply_batch([(a.what, a.data) for a in persisted if isinstance(a, R.Persist) and a.what in ("device", "forget")])
    assert {d["device_id"] for d in st.devices()} == set(honest.next)
    st.close()


@pytest.mark.parametrize("pace", [Pacing(enabled=False), Pacing(checkins_per_s=1e-6, max_after_s=3600.0),
                                  Pacing(checkins_per_s=1e-6, max_after_s=86400.0)])
def test_honest_devices_heartbeating_or_paced_up_to_the_longest_pace_never_expire(pace):
    m = _machine(pace=pace, stale_after_s=60.0, forget_after_s=300.0, clients_per_round=20)  # no round opens
    honest = Honest([f"h{i}" for i in range(4)])
    now = 0.0
    end = 3 * (pace.max_after_s if pace.enabled else 60.0)
    while now < end:
        honest.step(m, now)
        m.tick(now)
        assert set(m.registry.eligible(m.cfg.eligibility, now)) == set(honest.next), now
        # the clock jumps to just before the next check-in (a long pace leaves nothing to do in between)
        now = max(now + 1.0, min(honest.next.values()) - 0.5)
        m.tick(now)
        assert set(m.registry.eligible(m.cfg.eligibility, now)) == set(honest.next), now
    if pace.enabled:
        assert max(honest.gaps) >= 0.99 * pace.max_after_s  # they were paced as long as the coordinator paces


def test_forget_after_must_not_be_shorter_than_stale_after():
    with pytest.raises(ValueError, match="forget_after_s"):
        RoundConfig(stale_after_s=120.0, forget_after_s=60.0)
    assert dataclasses.replace(RoundConfig(), stale_after_s=10.0).forget_after_s == 3600.0
