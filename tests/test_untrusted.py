"""Untrusted devices against the round machine, with no broker: every attack the issue names, and the
bookkeeping that must hold across restarts. Each message must be dropped with a log line and a record
against its device, and the coordinator must go on and commit only finite, sane state."""
from __future__ import annotations

import math
import tracemalloc

import msgpack
import numpy as np
import pytest

from coordinator.daemon import ProgramCatalog
from coordinator.registry import Quarantine, Registry
from coordinator.rounds import RoundConfig, RoundMachine, task_id
from coordinator.store import StateInUse, Store
from coordinator.strategies.fedavg import FedAvg
from edge.protocol import wire
from edge.algorithms.driver import run_plan
from edge.trainers import make_trainer
from edge.protocol.wire import CheckIn, Chunk, Report, TensorUpdate

from conftest import SPEC, make_bus


def topic(kind: str, dev: str) -> str:
    return wire.topic("default", kind, dev)


def rejections(bus, dev: str | None = None) -> list[dict]:
    return [p.data for p in bus.persisted if p.what == "rejection" and (dev is None or p.data["device_id"] == dev)]


def open_round(tmp_path, n=4, per_round=4, hold=("d0", "d1"), **kw):
    """A round in flight: d0 and d1 are training (held), the others have reported; 3 reports are needed."""
    bus = make_bus(tmp_path, n, rounds=kw.pop("rounds", 2), per_round=per_round, over=1.0,
                   min_reports=kw.pop("min_reports", 3), timeout=kw.pop("timeout", 100), **kw)
    bus.hold_training = set(hold)
    bus.connect_all()
    bus.tick(0.1)
    assert bus.m.open is not None
    return bus


def valid_report(bus, dev: str) -> Report:
    ag = bus.agents[dev]
    t = make_trainer("torch")
    t.load(bus.caches[dev].get(ag.task.program_hash))
    return run_plan(ag.task, t, *bus.data[dev])


def send(bus, kind: str, dev: str, payload: bytes) -> list:
    out = bus.m.receive(topic(kind, dev), payload, bus.now)
    bus._machine_actions(out)
    bus.pump()
    return out


def finish(bus):
    """Release the held devices (they report), then let the remaining rounds run."""
    bus.hold_training = set()
    for d, ag in bus.agents.items():
        if ag.state == "training":
            bus._device_actions(d, ag.training_done(valid_report(bus, d), bus.now))
    bus.pump()
    for _ in range(4):
        bus.tick(6)


# ------------------------------------------------------------------ messages that used to stop it

@pytest.mark.parametrize("payload", [
    msgpack.packb({"v": 1, "k": {}}), msgpack.packb({"v": 1, "k": []}), msgpack.packb({"v": [1], "k": "report"}),
    msgpack.packb({"v": 1, "k": "report", "task_id": {}, "device_id": "d0", "n": 1, "metrics": {}, "tensors": {}}),
    msgpack.packb({"v": 1, "k": "report", "task_id": "x", "device_id": "d0", "n": 2**64 - 1, "metrics": [],
                   "tensors": {"a": {"s": [1], "x": {"d": "f4", "s": [1], "b": b"\0\0\0\0"}, "w": 3, "i": b""}}}),
    msgpack.packb([1, 2, 3]), b"\xc1", b"\x92" * 200 + b"\xc0" * 200,
])
def test_hostile_bytes_are_dropped_recorded_and_the_round_goes_on(tmp_path, caplog, payload):
    bus = open_round(tmp_path)
    out = bus.m.receive(topic("report", "d0"), payload, bus.now)
    assert [a.what for a in out] == ["rejection"]
    assert "dropped report from d0" in caplog.text
    finish(bus)
    assert [s["round"] for s in bus.committed] == [1, 2]


def test_float64_report_of_1e300_is_refused_and_the_model_stays_finite(tmp_path, caplog):
    bus = open_round(tmp_path, rounds=1)
    r = valid_report(bus, "d0")
    r.tensors = {k: TensorUpdate(t.shape, np.full(t.values.shape, 1e300, np.float64)) for k, t in r.tensors.items()}
    send(bus, "report", "d0", wire.encode(r))
    assert "values are float64, the plan asked for float32" in caplog.text
    acks = [wire.decode(p) for t, p in bus.log if t == topic("ack", "d0")]
    assert acks[-1].status == "rejected"
    finish(bus)
    assert bus.committed and all(np.isfinite(w).all() for w in bus.m.state.weights.values())


def test_large_but_finite_float32_update_is_refused_by_the_norm_bound(tmp_path, caplog):
    bus = open_round(tmp_path, rounds=1)
    r = valid_report(bus, "d0")
    for t in r.tensors.values():
        t.values[...] = 9e5  # under max_abs_value, far over 10x the model's norm
    send(bus, "report", "d0", wire.encode(r))
    assert "above the bound" in caplog.text and "d0" not in bus.m.open.accepted
    finish(bus)
    assert max(float(np.abs(w).max()) for w in bus.m.state.weights.values()) < 10


def test_clip_scales_an_oversized_update_to_the_bound_instead(tmp_path):
    bus = open_round(tmp_path, rounds=1)
    bus.m.cfg.admission.clip = True
    plan = bus.m.open.plans["d0"]
    r = valid_report(bus, "d0")
    for k, t in r.tensors.items():
        t.values[...] = plan.weights[k] + 1.0  # an update of 1 in every coordinate: norm sqrt(#params)
    before = bus.m.open.acc.sums["fc1.bias"].copy()
    send(bus, "report", "d0", wire.encode(r))
    assert "d0" in bus.m.open.accepted
    from coordinator.admission import plan_norm
    norm, bound = bus.m.open.norms["d0"], 10.0 * plan_norm(plan)
    assert norm == pytest.approx(np.sqrt(sum(w.size for w in plan.weights.values()))) and norm > bound
    # aggregated as clipped: n * (w + bound / norm) in every coordinate
    got = bus.m.open.acc.sums["fc1.bias"] - before
    np.testing.assert_allclose(got, r.n_samples * (plan.weights["fc1.bias"] + bound / norm), rtol=1e-5)


def test_wrong_capability_types_are_rejected_at_check_in(tmp_path, caplog):
    bus = make_bus(tmp_path, 4, rounds=1, per_round=3, over=1.0)
    bus.connect_all()
    for caps in ({"battery": "full"}, {"memory_mb": "4096"}, {"memory_mb": None}, {"charging": "yes"},
                 {"battery": 7.5}):
        c = CheckIn("d9", {"runtime": "torch", "charging": True} | caps, [], 10)
        out = bus.m.receive(topic("checkin", "d9"), wire.encode(c), bus.now)
        assert [a.what for a in out] == ["rejection"]
    assert "d9" not in bus.m.registry.devices
    assert "capability battery = 'full'" in caplog.text
    for _ in range(3):
        bus.tick(0.1)  # eligibility never meets a badly typed value
    assert bus.committed


def test_a_735_byte_report_declaring_2_31_rows_allocates_nothing_big(tmp_path, caplog):
    bus = open_round(tmp_path, rounds=1)
    r = valid_report(bus, "d0")
    rows = 2**31 - 1
    t = TensorUpdate((rows, 16), np.zeros((1, 16), np.float32), index=np.array([rows - 1]))
    payload = wire.encode(Report(r.task_id, "d0", r.n_samples, {}, {"fc1.weight": t}))  # so the shape check runs
    assert len(payload) < 1000
    tracemalloc.start()
    bus.m.receive(topic("report", "d0"), payload, bus.now)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 5e6, peak  # not 2 GiB: the declared shape was compared with the plan before any mask
    assert "the plan sent" in caplog.text


def test_chunked_uploads_are_bounded_by_what_the_plan_allows(tmp_path, caplog):
    bus = open_round(tmp_path, n=5, per_round=4)
    outsider = next(d for d in bus.agents if d not in bus.m.open.plans)
    huge = wire.encode(Chunk("m1", 0, 4000, 10**9, b"x" * 1024))
    send(bus, "report", outsider, huge)  # no plan: no transfer is opened at all
    assert bus.m._reasm.open_transfers == 0
    send(bus, "report", "d0", huge)  # a plan, but 1 GB is far more than it allows
    assert bus.m._reasm.open_transfers == 0 and "exceeds this sender's limit" in caplog.text
    for i in range(4):  # one open transfer per device (its plan's report): a newer one replaces the older
        send(bus, "report", "d0", wire.encode(Chunk(f"t{i}", 0, 2, 2048, b"x" * 1024)))
    assert bus.m._reasm.open_transfers == 1 and [k[1] for k in bus.m._reasm._open] == ["t3"]
    finish(bus)
    assert bus.m._reasm.open_transfers == 0  # a closed round forgets its senders' transfers


def test_reassembly_capacity_follows_the_bytes_that_arrived():
    """Issue 30: slow senders announcing large messages held the whole capacity by their announcements, and honest
    uploads were refused as Busy. Now what is held is what arrived."""
    r = wire.Reassembler(max_bytes=10_000, max_open_per_sender=1, replace=True, max_total_bytes=8_000)
    for s in range(6):  # six transfers announcing 10,000 bytes each (60,000 > 8,000), 300 bytes in
        assert r.feed(f"slow{s}", Chunk("m", 0, 10, 10_000, b"x" * 300), 0.0, limit=10_000) is None
    assert r.reserved == 1800
    honest = b"y" * 3000  # an honest 3,000-byte report in two chunks still fits
    assert r.feed("h", Chunk("r", 0, 2, 3000, honest[:1500]), 1.0) is None
    assert r.feed("h", Chunk("r", 1, 2, 3000, honest[1500:]), 1.0) == honest
    assert r.reserved == 1800
    for s in range(6):  # past the capacity the transfer that would overflow it is dropped, not the others
        r.feed(f"slow{s}", Chunk("m", 1, 10, 10_000, b"x" * 1000), 2.0)
    with pytest.raises(wire.Busy):
        r.feed("slow5", Chunk("m", 2, 10, 10_000, b"x" * 1000), 2.0)
    assert r.reserved <= 8_000 and r.open_transfers == 5


def test_a_trickling_upload_is_dropped_and_counted_against_its_device(tmp_path, caplog):
    bus = open_round(tmp_path, n=5, per_round=4)
    bus.m.cfg.min_upload_kbps = 16.0  # 2,000 bytes/s on average, after 10 s
    now = bus.now
    send(bus, "report", "d0", wire.encode(Chunk("r-slow", 0, 4, 4 * 1024, b"x" * 1024)))
    send(bus, "report", "d1", wire.encode(Chunk("r-fast", 0, 2, 64 * 1024, b"x" * 32 * 1024)))
    before = bus.m.registry.devices["d0"].rejected if "d0" in bus.m.registry.devices else 0
    bus.m.tick(now + 5.0)  # within the grace: both stay
    assert bus.m._reasm.open_transfers == 2
    bus.m.tick(now + 12.0)  # 1,024 bytes in 12 s: a trickle; 32 KiB in 12 s is not
    assert [k[0] for k in bus.m._reasm._open] == ["d1"]
    assert "trickled below 16 kbit/s" in caplog.text
    assert bus.m.registry.devices["d0"].rejected == before + 1


# ------------------------------------------------------------------ quarantine

def test_a_device_that_keeps_sending_garbage_is_quarantined_and_not_selected(tmp_path, caplog):
    bus = make_bus(tmp_path, 5, rounds=3, per_round=4, over=1.0)
    bus.m.registry.quarantine = Quarantine(after=3, window_s=60, first_s=100, max_s=400)
    bus.connect_all()
    for _ in range(3):
        bus.m.receive(topic("checkin", "d2"), b"\x00junk", bus.now)
    assert "device d2 quarantined for 100 s" in caplog.text
    assert "d2" not in bus.m.registry.eligible(bus.m.cfg.eligibility, bus.now)
    bus.hold_training = set(bus.agents)
    bus.tick(0.1)
    assert sorted(bus.m.open.selected) == ["d0", "d1", "d3", "d4"]
    later = bus.now + 101
    for a in bus.agents["d2"]._checkin(later):  # its heartbeat (a device silent this long would be stale)
        bus.m.receive(a.topic, a.payload, later)
    assert "d2" in bus.m.registry.eligible(bus.m.cfg.eligibility, later)
    for _ in range(3):  # relapse: twice as long
        bus.m.receive(topic("checkin", "d2"), b"\x00junk", later)
    assert bus.m.registry.devices["d2"].quarantined_until == pytest.approx(later + 200)


def test_strikes_kept_per_device_are_bounded_by_the_quarantine_threshold():
    reg = Registry(Quarantine(after=3, window_s=600, first_s=100))
    for i in range(10_000):  # a device that goes on sending garbage, mostly while quarantined
        reg.reject("d0", 1.0 + i * 0.01, "garbage")
    rec = reg.strangers["d0"]
    assert len(rec.recent) <= 3 and rec.rejected == 10_000 and rec.quarantines == 1
    # what it sent while quarantined still counts: its next strike after the quarantine starts the next one
    later = rec.quarantined_until + 1
    assert reg.reject("d0", later, "garbage")[1] and rec.quarantined_until == pytest.approx(later + 200)


def test_late_and_unknown_reports_are_not_strikes(tmp_path):
    reg = Registry(Quarantine(after=2))
    for _ in range(5):
        _, newly = reg.reject("d0", 1.0, "report: unknown task", strike=False)
        assert not newly
    assert reg.devices == {} and reg.strangers["d0"].rejected == 5 and not reg.strangers["d0"].quarantined(1.0)


# ------------------------------------------------------------------ commits that must not happen

class _Poisoned(FedAvg):
    def finish(self, state, acc):
        new = super().finish(state, acc)
        new.weights["fc0.bias"][0] = np.nan
        return new


def test_a_non_finite_state_is_never_committed(tmp_path, caplog):
    s = _Poisoned(spec=SPEC, lr=0.1, epochs=1, batch_size=10)
    bus = make_bus(tmp_path, 4, rounds=1, per_round=4, over=1.0, strategy=s)
    bus.connect_all()
    bus.tick(0.1)
    assert not bus.committed and bus.m.state.round == 0
    assert "commit refused: new state is not finite (fc0.bias)" in caplog.text
    assert any(p.what == "abandon" for p in bus.persisted)


def test_a_collapse_in_test_accuracy_refuses_the_commit(tmp_path, caplog):
    bus = make_bus(tmp_path, 4, rounds=3, per_round=4, over=1.0)
    # round 2's first attempt collapses whichever reports are left out (no culprit to find: abandoned)
    accs = {(1, 1): 0.8, (2, 1): 0.3, (2, 2): 0.75, (3, 1): 0.76}
    bus.m.vet = lambda st: {"accuracy": accs[(st.round, bus.m.attempt)], "loss": 1.0}
    bus.connect_all()
    for _ in range(8):
        bus.tick(0.1)
    assert "test accuracy would fall from 0.8000 to 0.3000" in caplog.text
    assert [s["accuracy"] for s in bus.committed] == [0.8, 0.75, 0.76]


# ------------------------------------------------------------------ round bookkeeping

def test_a_heartbeat_sent_before_the_plan_does_not_drop_a_selected_device(tmp_path):
    bus = open_round(tmp_path, rounds=1)
    stale = CheckIn("d0", {"runtime": "torch", "charging": True}, [], 30, last_task="")
    send(bus, "checkin", "d0", wire.encode(stale))
    assert "d0" not in bus.m.open.finished and not bus.m.registry.devices["d0"].available
    refused = CheckIn("d0", {"runtime": "torch", "charging": True}, [], 30, last_task=bus.m.open.task_id)
    send(bus, "checkin", "d0", wire.encode(refused))  # it ended our plan without a report
    assert "d0" in bus.m.open.finished


def test_agent_tells_the_coordinator_which_plan_it_last_saw(tmp_path):
    bus = open_round(tmp_path, rounds=1)
    ag = bus.agents["d0"]
    out = ag.tick(bus.now + 100)  # training: no heartbeat
    assert out == []
    out = ag.training_done(None, bus.now, "boom")  # training failed: it checks in
    last = [wire.decode(a.payload) for a in out if a.topic == topic("checkin", "d0")][-1]
    assert last.last_task == bus.m.open.task_id


def test_task_ids_carry_the_run_id_and_a_new_run_ignores_nothing_of_its_own(tmp_path):
    assert task_id("ab12cd34", 3, 2) == "ab12cd34-r3a2" and task_id("", 3, 2) == "r3a2"
    s1, s2 = Store(tmp_path / "a.sqlite"), Store(tmp_path / "b.sqlite")
    assert s1.run_id() != s2.run_id() and s1.run_id() == Store(tmp_path / "a.sqlite").run_id()


def _persist_all(bus, store, since=0):
    for p in bus.persisted[since:]:
        store.apply(p.what, p.data)
    return len(bus.persisted)


def _restart(bus, store):
    """A machine built from the store alone, as the daemon does on start."""
    m2 = RoundMachine(bus.m.cfg, bus.m.strategy, store.latest_state(), ProgramCatalog(), now=bus.now)
    for d in store.devices():
        rec = m2.registry.checkin(d["device_id"], d["caps"], d["programs"], d["n"], bus.now)
        rec.online, rec.available = d["online"], d["online"] and d["available"]
        rec.quarantined_until, rec.quarantines = d["quarantined_until"], d["quarantines"]
    m2.restore(store.closed_tasks())
    return m2


def test_busy_devices_stay_busy_and_closed_rounds_stay_closed_across_a_restart(tmp_path):
    bus = make_bus(tmp_path, 6, rounds=3, per_round=4, over=1.5, min_reports=2, timeout=100)
    store = Store(tmp_path / "s.sqlite")
    store.save_initial_state(bus.m.state)
    bus.hold_training = {"d0", "d1", "d2", "d3", "d4", "d5"}
    bus.connect_all()
    bus.tick(0.1)
    selected = list(bus.m.open.selected)
    task1 = bus.m.open.task_id
    stuck = selected[0]
    for d in selected[1:]:  # everyone but one reports; round 1 commits
        bus._device_actions(d, bus.agents[d].training_done(valid_report(bus, d), bus.now))
    bus.pump()
    assert bus.committed and bus.committed[0]["round"] == 1
    _persist_all(bus, store)
    store.close()
    store = Store(tmp_path / "s.sqlite")
    m2 = _restart(bus, store)
    assert task1 in m2.closed_tasks
    assert stuck not in m2.registry.eligible(m2.cfg.eligibility, bus.now)  # still training for round 1
    bus.m = m2
    r = valid_report(bus, stuck)
    out = m2.receive(topic("report", stuck), wire.encode(r), bus.now)
    acks = [wire.decode(a.payload) for a in out if getattr(a, "topic", "").endswith(f"/ack/{stuck}")]
    assert acks[0].status == "late"


def test_quarantine_survives_a_restart(tmp_path):
    bus = make_bus(tmp_path, 4, rounds=1, per_round=3, over=1.0)
    store = Store(tmp_path / "s.sqlite")
    store.save_initial_state(bus.m.state)
    bus.connect_all()
    for _ in range(3):
        bus._machine_actions(bus.m.receive(topic("checkin", "d1"), b"\x00junk", bus.now))
    _persist_all(bus, store)
    m2 = _restart(bus, store)
    assert m2.registry.devices["d1"].quarantined(bus.now + 1)
    assert [r["strikes"] for r in store.rejections()] == [3]


def test_a_second_coordinator_on_the_same_state_is_refused(tmp_path):
    a = Store(tmp_path / "s.sqlite", lock=True)
    with pytest.raises(StateInUse, match="in use by another coordinator"):
        Store(tmp_path / "s.sqlite", lock=True)
    a.close()
    Store(tmp_path / "s.sqlite", lock=True).close()  # free again once the first is gone


def test_robust_aggregation_ignores_a_poisoned_minority():
    base = FedAvg(spec=SPEC)
    st = base.init(0)
    honest = {k: v + 0.01 for k, v in st.weights.items()}
    results = {}
    for agg in ("mean", "median", "trimmed_mean"):
        s = FedAvg(spec=SPEC, aggregate=agg, trim=0.2)
        acc = s.begin(st)
        plan = s.plan(st, "d0", {})
        for i in range(5):
            w = {k: v + (50.0 if i == 0 else 0.0) for k, v in honest.items()}  # one poisoner of five
            tens = {k: TensorUpdate(v.shape, v.astype(np.float32)) for k, v in w.items()}
            s.accumulate(st, acc, plan, Report("t", f"d{i}", 10, {}, tens))
        results[agg] = s.finish(st, acc).weights
    for agg in ("median", "trimmed_mean"):
        for k, v in results[agg].items():
            np.testing.assert_allclose(v, honest[k], atol=1e-5)
    assert np.abs(results["mean"]["fc0.bias"] - honest["fc0.bias"]).min() > 9  # the mean is dragged by 50/5


def test_a_sign_flipped_update_passes_admission_so_only_the_aggregation_can_resist_it(tmp_path):
    from coordinator.admission import update_norm
    from coordinator.faults import ATTACKS
    bus = open_round(tmp_path, rounds=1)
    plan = bus.m.open.plans["d0"]
    honest = valid_report(bus, "d0")
    payload = ATTACKS["sign_flip_x5"](honest, bus.agents["d0"].task)
    poisoned = wire.decode(payload)
    for k, t in poisoned.tensors.items():
        np.testing.assert_allclose(t.values - plan.weights[k], -5 * (honest.tensors[k].values - plan.weights[k]),
                                   atol=1e-5)
    send(bus, "report", "d0", payload)
    assert "d0" in bus.m.open.accepted  # well-formed, and 5x an honest norm is inside the 10x bound
    assert bus.m.open.norms["d0"] == pytest.approx(5 * update_norm(plan, honest), rel=1e-4)


def test_the_norm_bounds_median_pools_small_rounds(tmp_path):
    """Rounds of two reports: the bound's reference is the median of the last rounds' norms pooled (up to
    NORM_WINDOW), not of two reports, where one honest device with much more data would be 'ten times the
    median' of a round with a small one."""
    from coordinator.admission import NORM_WINDOW
    bus = make_bus(tmp_path, 4, rounds=3, per_round=2, over=1.0)
    bus.connect_all()
    for _ in range(3):
        bus.tick(0.1)
    assert bus.m.state.round == 3
    reports = [p.data for p in bus.persisted if p.what == "report"]  # each carries its norm (durable sums)
    s = bus.m.strategy
    steps = lambda n: s.epochs * math.ceil(n / s.batch_size)  # noqa: E731 (the driver's batches, written out)
    seen = [r["norm"] / steps(r["n"]) for task in dict.fromkeys(r["task_id"] for r in reports)
            for r in sorted((r for r in reports if r["task_id"] == task), key=lambda r: r["device_id"])]
    h = bus.m.history
    assert len(seen) == 6 and h["recent_norms"] == pytest.approx(seen)
    assert h["median_norm_per_step"] == pytest.approx(float(np.median(seen)))
    assert NORM_WINDOW >= 16


def test_the_norm_bound_grows_with_a_devices_local_steps():
    """An update grows with the steps taken: the bound is norm_factor x the median norm per step x this
    device's steps, so a device with ten times the data (ten times the steps) may move ten times as far, and
    one beyond its own bound is still refused."""
    from coordinator.admission import AdmissionRules, local_steps
    from coordinator.strategies.base import DevicePlan
    plan = DevicePlan({"w": np.zeros((2, 2), np.float32)}, {"epochs": 2, "batch_size": 10}, {}, {})
    assert [local_steps(plan, n) for n in (1, 10, 11, 95)] == [2, 2, 4, 20]
    rules = AdmissionRules(norm_factor=10.0)
    hist = {"median_norm_per_step": 0.01}
    assert rules.bound(hist, plan, 10) == pytest.approx(10 * 0.01 * 2)
    assert rules.bound(hist, plan, 100) == pytest.approx(10 * 0.01 * 20)
    assert rules.bound({"median_norm": 0.3}, plan, 100) == pytest.approx(3.0)  # a state from before
    assert local_steps(DevicePlan({"w": np.zeros(2, np.float32)}, {}, {}, {}), 50) == 1
