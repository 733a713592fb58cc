"""Ingest's fast path for the plain report (RoundMachine._take_plain) against the general path, report by report.

Two machines, identical but for ``plain_path``, get the same messages: a plain report, then the same report
changed in one way (a field's type or value, a missing or extra part, values out of range, a norm above the
bound, a replay, another device's topic, chunks), then the rest of the round. After every message both must
have returned the same actions (records, acks, the commit), and at the end hold the same sums, norms, counts,
strikes and committed weights, to the bit. The fast path must also have taken every plain report, so a path
that silently declined everything would fail here too."""
from __future__ import annotations

import copy
import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from coordinator.admission import (AdmissionRules, _expected, _flat_weights, _max_abs, _sq, check_key, per_checks,
                                   plain_expected, plan_norm, share_memo)
from coordinator.daemon import ProgramCatalog
from coordinator.registry import Registry
from coordinator.rounds import (ADMISSION_KEY, Persist, Publish, RoundCommitted, RoundConfig, RoundMachine,
                                max_report_bytes)
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.fedl1 import FedL1
from edge.model import mlp
from edge.protocol import wire
from edge.protocol.wire import Report, TensorUpdate

SPEC = mlp([6, 5, 1, 3])  # a tensor with a dimension of 1 (fc1.weight: 1 x 5): True == 1 must not pass for it
N_DEVICES = 4
CAPS = {"runtime": "torch", "memory_mb": 2048, "battery": 0.9, "charging": True, "network": "wifi", "idle": True}


@pytest.fixture(scope="module")
def catalog():
    return ProgramCatalog()


def _machine(catalog, plain: bool, *, strategy=None, history=None, caps=None, **rules) -> RoundMachine:
    """``strategy``: a callable that makes one (each machine needs its own)."""
    strategy = strategy() if strategy else FedAvg(spec=SPEC)
    reg = Registry()
    prog = catalog(SPEC, "torch")
    for i in range(N_DEVICES):
        reg.checkin(f"d{i}", {**CAPS, **(caps or {})}, [prog.hash], 10 + 7 * i, 0.0)
    state = strategy.init(0)
    if history:
        state.meta[ADMISSION_KEY] = dict(history)
    rc = RoundConfig(rounds=2, clients_per_round=N_DEVICES, over_selection=1.0, round_timeout_s=1e9,
                     selection_timeout_s=0.0, plain_path=plain, chunk_bytes=4096,
                     admission=AdmissionRules(**rules))
    m = RoundMachine(rc, strategy, state, catalog, registry=reg)
    m.open_round(sorted(reg.devices), 1.0)
    while m.plans_unsent:
        m.next_plans(64)
    return m


def _report_map(m: RoundMachine, dev: str, scale: float = 0.01, seed: int = 0) -> dict:
    """The map of the report a device sends for its plan (dense float32 weights), before msgpack."""
    o = m.open
    rng = np.random.default_rng([seed, int(dev[1:])])
    w = o.plans[dev].weights
    tensors = {k: TensorUpdate(v.shape, v + np.float32(scale) * rng.standard_normal(v.shape, np.float32))
               for k, v in w.items()}
    r = Report(o.task_id, dev, m.registry.devices[dev].n_samples, {"train_loss": 0.5, "steps": 3}, tensors)
    return msgpack.unpackb(wire.encode(r), raw=False)


def _pack(d) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


def _canon(actions: list) -> list:
    """Actions as comparable values (arrays by their bytes)."""
    def val(x):
        if isinstance(x, np.ndarray):
            return ("array", x.dtype.str, x.shape, x.tobytes())
        if dataclasses.is_dataclass(x):
            return (type(x).__name__, val(vars(x)))
        if isinstance(x, dict):
            return {k: val(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [val(v) for v in x]
        return x
    out = []
    for a in actions:
        if isinstance(a, Publish):
            out.append(("publish", a.topic, a.payload))
        elif isinstance(a, Persist):
            out.append(("persist", a.what, val(a.data)))
        elif isinstance(a, RoundCommitted):
            out.append(("commit", val(a.summary), val(a.state.weights), val(a.state.meta)))
        else:
            out.append((type(a).__name__,))
    return out


def _state(m: RoundMachine) -> dict:
    o = m.open
    regs = {d: (r.rejected, r.quarantined_until) for d, r in m.registry.devices.items()}
    held = getattr(m.strategy, "_down", None)
    out = {"dropped": m.dropped_messages, "registry": regs, "round": m.state.round,
           "weights": {k: v.tobytes() for k, v in m.state.weights.items()},
           "downlink": {d: (r.tag, r.confirmed) for d, r in held.held.items()} if held is not None else None}
    if o is not None:
        out |= {"accepted": sorted(o.accepted), "finished": sorted(o.finished), "norms": dict(o.norms),
                "sums": {k: v.tobytes() for k, v in o.acc.sums.items()}, "n": o.acc.total_n,
                "count": o.acc.count, "bytes_up": o.bytes_up}
    return out


def _accepted(actions: list) -> bool:
    return any(isinstance(a, Publish) and "/ack/" in a.topic and wire.decode(a.payload).status == "accepted"
               for a in actions)


def _both(catalog, messages, fast_path: bool = True, **kw) -> tuple[RoundMachine, RoundMachine, list[bool]]:
    """Feed ``messages`` (callables of the machine giving (device, payload); each machine builds its own, the
    two are identical) to the fast-path machine and the general one; every answer must match. Every plain
    message (built by :func:`_plain`) that the general path accepts must be the fast path's (``fast_path``: the
    strategy and rules allow it). Returns the
    machines and, per message, whether the fast path took it."""
    fast, general = _machine(catalog, True, **kw), _machine(catalog, False, **kw)
    took = []
    for i, msg in enumerate(messages):
        now = 2.0 + i
        dev, payload = msg(fast)
        dev_g, payload_g = msg(general)
        assert (dev, payload) == (dev_g, payload_g)
        topic = wire.topic(fast.cfg.fleet, "report", dev)
        before = fast.plain_reports
        acts_fast, acts_general = fast.receive(topic, payload, now), general.receive(topic, payload, now)
        assert _canon(acts_fast) == _canon(acts_general), f"message {i}: the two paths answered differently"
        assert _state(fast) == _state(general), f"message {i}: the two paths differ after it"
        took.append(fast.plain_reports == before + 1)
        if fast_path and getattr(msg, "plain", False) and _accepted(acts_general):
            assert took[-1], f"message {i}: a plain report the general path accepted was not the fast path's"
        assert not took[-1] or _accepted(acts_fast)
    assert general.plain_reports == 0
    return fast, general, took


def _plain(dev: str, **kw):
    def msg(m):
        return dev, _pack(_report_map(m, dev, **kw))
    msg.plain = True
    return msg


def _changed(dev: str, change, topic_dev: str | None = None, **kw):
    def msg(m):
        d = _report_map(m, dev, **kw)
        change(d, m)
        return topic_dev or dev, _pack(d)
    return msg


def _set(path, value):
    """A change: set d[path[0]][path[1]]... to value."""
    def change(d, m):
        x = d
        for p in path[:-1]:
            x = x[p]
        x[path[-1]] = value
    return change


def _del(*path):
    def change(d, m):
        x = d
        for p in path[:-1]:
            x = x[p]
        del x[path[-1]]
    return change


def _values(name: str, f):
    """A change of one tensor's float32 values (f: array -> array, same dtype and size)."""
    def change(d, m):
        x = d["tensors"][name]["x"]
        a = np.frombuffer(x["b"], np.float32).copy()
        x["b"] = f(a).astype(np.float32).tobytes()
    return change


def _as_f8(name: str):
    def change(d, m):
        x = d["tensors"][name]["x"]
        x["d"], x["b"] = "f8", np.frombuffer(x["b"], np.float32).astype(np.float64).tobytes()
    return change


def _fc1_dims(value):
    """fc1.weight is 1 x 5: its dimension 1 written as ``value`` (True, 1.0)."""
    def change(d, m):
        rec = d["tensors"]["fc1.weight"]
        rec["s"] = [value, 5]
        rec["x"]["s"] = [value, 5]
    return change


def _reorder(d, m):  # another encoder's key order: still plain
    items = list(d.items())[::-1]
    d.clear()
    d.update(items)
    t = d["tensors"]
    d["tensors"] = dict(reversed(list(t.items())))


def _other_task(d, m):
    d["task_id"] = m.open.task_id + "x"


def _wrong_n(d, m):
    d["n"] += 1


def test_the_plain_report_spec_is_what_the_plan_sent(catalog):
    m = _machine(catalog, True)
    plan = m.open.plans["d0"]
    e = plain_expected(plan)
    assert e is not None and e.keys() == plan.weights.keys()
    assert all(e[k] == (list(w.shape), 4 * w.size) for k, w in plan.weights.items())


CHANGES = {
    "unchanged": None,
    "key order": _reorder,
    "extras empty": _set(["extras"], {}),
    "no extras field": _del("extras"),
    "metrics empty": _set(["metrics"], {}),
    # refused by both, or by the general path after the fast path declined
    "n is True": _set(["n"], True),
    "n is a float": _set(["n"], 10.0),
    "n is 0": _set(["n"], 0),
    "n is not the declared count": _wrong_n,
    "task of another round": _other_task,
    "task id not an id": _set(["task_id"], "a/b"),
    "device id an int": _set(["device_id"], 3),
    "version 2": _set(["v"], 2),
    "kind checkin": _set(["k"], "checkin"),
    "unknown field": _set(["zz"], 1),
    "metrics missing": _del("metrics"),
    "metrics not finite": _set(["metrics", "train_loss"], float("nan")),
    "metrics nested": _set(["metrics", "x"], [1]),
    "an extra array": _set(["extras"], {"e": wire.pack_array(np.zeros(2, np.float32))}),
    "tensor missing": _del("tensors", "fc0.bias"),
    "tensor not asked for": _set(["tensors", "zz"], {"s": [1], "x": wire.pack_array(np.zeros(1, np.float32))}),
    "a dimension True": _fc1_dims(True),
    "a dimension 1.0": _fc1_dims(1.0),
    "float64 values": _as_f8("fc0.weight"),
    "float16 dtype code": _set(["tensors", "fc0.bias", "x", "d"], "f2"),
    "bytes short": lambda d, m: d["tensors"]["fc0.bias"]["x"].__setitem__("b", d["tensors"]["fc0.bias"]["x"]["b"][:-4]),
    "values as a string": _set(["tensors", "fc0.bias", "x", "b"], "abcd"),
    "record with a mask": _set(["tensors", "fc0.weight", "m"], b"\xff"),
    "record with a sample": _set(["tensors", "fc0.weight", "h"], {"k": 6}),
    "shape of the values differs": _set(["tensors", "fc0.bias", "x", "s"], [1, 5]),
    "a NaN": _values("fc0.weight", lambda a: np.where(np.arange(a.size) == 3, np.nan, a)),
    "an inf": _values("fc2.bias", lambda a: np.full_like(a, np.inf)),
    "a value out of range": _values("fc0.bias", lambda a: a + np.float32(2e6)),
    "a norm above the bound (clipped)": _values("fc0.weight", lambda a: a * np.float32(30.0)),
    "a norm far above the bound (refused)": _values("fc0.weight", lambda a: a * np.float32(1e4)),
}


STILL_PLAIN = {"unchanged", "key order", "extras empty", "no extras field", "metrics empty"}


@pytest.mark.parametrize("name", list(CHANGES))
def test_the_fast_path_answers_as_the_general_path(catalog, name):
    change = CHANGES[name]
    first = _plain("d0") if change is None else _changed("d0", change)
    fast, _, took = _both(catalog, [_plain("d1"), first, _plain("d0", seed=1), _plain("d2"), _plain("d3")])
    assert took[1] == (name in STILL_PLAIN)
    if name in STILL_PLAIN:
        assert fast.plain_reports == N_DEVICES and fast.state.round == 1  # committed, on the fast path alone


def test_declined_reports_are_answered_by_the_general_path(catalog, caplog):
    """The fast path refuses nothing itself: a report it declines is refused (or clipped) with the general
    path's reason, and counted as the general path's."""
    fast, _, _ = _both(catalog, [_changed("d0", _values("fc0.weight", lambda a: a * np.float32(1e4))), _plain("d1")])
    assert fast.plain_reports == 1
    assert "above the bound" in caplog.text
    assert fast.registry.devices["d0"].rejected == 1


def test_clipping_and_the_per_step_bound_go_through_the_general_path(catalog):
    hist = {"median_norm_per_step": 0.02, "recent_norms": [0.02] * 4}
    kw = {"history": hist, "clip": True}
    as_is = lambda d, m: None  # noqa: E731 - d1's report is plain, but above the bound: clipped
    msgs = [_plain("d0"), _changed("d1", as_is, scale=0.5), _plain("d2"), _plain("d3", scale=0.0001)]
    fast, _, took = _both(catalog, msgs, **kw)
    assert fast.state.round == 1
    # the tiny update was under the bound (the fast path's), the large one clipped (the general path's)
    assert took[3] and not took[1]


def test_without_a_norm_bound_the_value_range_still_holds(catalog):
    """With no norm bound, only the range check stands between a huge value and the sum."""
    big = _changed("d0", _values("fc0.bias", lambda a: a + np.float32(2e6)))
    fast, _, took = _both(catalog, [big, _plain("d1"), _plain("d0", seed=1)], norm_bound=None)
    assert not took[0] and took[1] and fast.registry.devices["d0"].rejected == 1


def test_the_downlink_learns_what_each_device_holds_on_both_paths(catalog):
    """Difference downlink: a report confirms the model its device holds (the next plan is relative to it)."""
    kw = {"strategy": lambda: FedAvg(spec=SPEC, down_deltas=True), "caps": {"coded_downlink": True}}
    fast, _, took = _both(catalog, [_plain(f"d{i}") for i in range(N_DEVICES)], **kw)
    assert all(took) and fast.state.round == 1


def test_per_device_plans_of_a_round_compute_the_checks_on_their_shared_weights_once(catalog):
    """A difference downlink gives every device its own plan object over the round's one set of arrays: max |w|
    per tensor (the range check of every report) and the plan's norm (the first round's bound) are computed once
    per array for the round, not once per report (a pass over the model each)."""
    m = _machine(catalog, True, strategy=lambda: FedAvg(spec=SPEC, down_deltas=True),
                 caps={"coded_downlink": True})
    o = m.open
    plans = list(o.plans.values())
    assert len({id(p) for p in plans}) == N_DEVICES and len({id(p.weights) for p in plans}) == 1
    for i in range(N_DEVICES):
        m.receive(wire.topic(m.cfg.fleet, "report", f"d{i}"), _pack(_report_map(m, f"d{i}")), 2.0)
    assert m.plain_reports == N_DEVICES and m.state.round == 1
    memo = plans[0].__dict__["_admission_memo"]
    assert all(p.__dict__["_admission_memo"] is memo for p in plans)
    w = plans[0].weights
    assert sorted(k[0] for k in memo) == ["flat", "max_abs", "max_report_bytes", "norm"]  # once, not per device
    assert len(o.plain) == 1  # the fast path's decision and shapes
    for k, a in w.items():
        assert _max_abs(plans[-1])[k] == float(np.abs(a).max())
    ref = np.sqrt(sum(float(np.vdot(a, a)) for a in (a.astype(np.float64) for a in w.values())))
    assert plan_norm(plans[-1]) == pytest.approx(ref, rel=1e-6)  # (summed in float32)


def _shared_plan():
    """The round's shared plan of a fresh FedAvg on SPEC."""
    s = FedAvg(spec=SPEC)
    return s.plan(s.init(0), "d0", {})


def test_plans_sharing_a_memo_with_other_fields_get_their_own_checks():
    """Plans that share a round's memo but not what a device may send back (another upload format) get their
    own expected tensors and size limit."""
    a = _shared_plan()
    b = dataclasses.replace(a, upload={**a.upload, "dtype": "f2"})
    share_memo([a, b])
    assert plain_expected(a) is not None and plain_expected(b) is None
    assert {v[1] for v in _expected(a).values()} == {"f4"} and {v[1] for v in _expected(b).values()} == {"f2"}
    assert max_report_bytes(b) < max_report_bytes(a)
    assert check_key(dataclasses.replace(a, tag="m2", wire={})) == check_key(a) != check_key(b)


def test_plans_sharing_a_memo_with_other_arrays_get_their_own_values():
    """A plan with other arrays under the same names (another subnetwork) reads its own max |w| and norm from a
    memo it shares."""
    a = _shared_plan()
    b = dataclasses.replace(a, weights={k: v * np.float32(3.0) for k, v in a.weights.items()})
    share_memo([a, b])
    for k in a.weights:
        assert _max_abs(a)[k] * 3 == pytest.approx(_max_abs(b)[k], rel=1e-6)
    assert plan_norm(a) * 3 == pytest.approx(plan_norm(b), rel=1e-6)
    assert _max_abs(a)["fc0.weight"] == float(np.abs(a.weights["fc0.weight"]).max())
    for p in (a, b):  # the flat views admit_plain subtracts are of the plan's own arrays
        assert all(np.shares_memory(v, p.weights[k]) for k, v in per_checks(p, "flat", _flat_weights).items())


def test_sampled_uploads_of_differences_take_the_general_path(catalog):
    """A plan that asks for differences (here: sampled rows, sent as differences) never meets the fast path,
    even with a report that would pass its checks: its values are differences, not weights."""
    kw = {"strategy": lambda: FedAvg(spec=SPEC, upload_sample="norm", upload_s=1.0),
          "caps": {"sampled_upload": True, "link_kbps": 1}}
    assert _machine(catalog, True, **kw).open.plans["d0"].upload.get("delta")
    fast, _, took = _both(catalog, [_plain(f"d{i}", scale=0.0) for i in range(N_DEVICES)], fast_path=False, **kw)
    assert not any(took) and fast.state.round == 1


def test_replays_other_topics_and_chunks(catalog):
    def chunked(dev):
        def msg(m):
            payload = _pack(_report_map(m, dev))
            parts = wire.split(payload, "r1", 256)
            assert len(parts) > 1
            return dev, parts
        return msg

    fast, general = _machine(catalog, True), _machine(catalog, False)
    steps = [("d0", _plain("d0")), ("d0", _plain("d0")),  # a replay: duplicate
             ("d2", _plain("d1")),  # d1's report on d2's topic
             ("d2", _changed("d1", lambda d, m: d.__setitem__("n", m.registry.devices["d2"].n_samples))),  # and d2's n
             ("d1", _plain("d1", seed=2)), ("d2", chunked("d2")), ("d3", _plain("d3"))]
    for i, (topic_dev, msg) in enumerate(steps):
        _, payload = msg(fast)
        assert msg(general)[1] == payload
        parts = payload if isinstance(payload, list) else [payload]
        topic = wire.topic(fast.cfg.fleet, "report", topic_dev)
        for j, p in enumerate(parts):
            assert _canon(fast.receive(topic, p, 2.0 + i)) == _canon(general.receive(topic, p, 2.0 + i))
        assert _state(fast) == _state(general)
    assert fast.plain_reports == N_DEVICES and fast.state.round == 1
    assert fast.plain_in_place == N_DEVICES  # the reassembled report too: read in place, not from msgpack's copy


def test_a_strategy_without_the_fast_path_or_that_changes_the_check_gets_the_general_path(catalog):
    plain = [_plain(f"d{i}") for i in range(N_DEVICES)]
    fast, _, _ = _both(catalog, plain, fast_path=False, strategy=lambda: FedL1(spec=SPEC))
    assert fast.plain_reports == 0 and fast.state.round == 1
    fast, _, _ = _both(catalog, plain, fast_path=False, strategy=lambda: FedAvg(spec=SPEC, aggregate="median"))
    assert fast.plain_reports == 0 and fast.state.round == 1


def _mutations():
    """A random change somewhere in the report's map: a value replaced by another msgpack value, a key dropped
    or added."""
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                       st.text(max_size=8), st.binary(max_size=8))
    value = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                                       max_size=3), max_leaves=6)
    return st.tuples(st.integers(0, 10**6), st.sampled_from(["set", "drop", "add"]), value)


def _mutate(d: dict, pick: int, op: str, value) -> None:
    """Apply one random change at the pick-th map or list (in a walk of the map) of ``d``."""
    nodes = []

    def walk(x):
        if isinstance(x, dict):
            nodes.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            nodes.append(x)
            for v in x:
                walk(v)
    walk(d)
    node = nodes[pick % len(nodes)]
    keys = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
    if op == "add" or not keys:
        if isinstance(node, dict):
            node[f"z{pick % 7}"] = value
        else:
            node.append(value)
    else:
        key = keys[pick // len(nodes) % len(keys)]
        if op == "drop":
            del node[key]
        else:
            node[key] = value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_mutations())
def test_random_changes_get_the_same_answer_on_both_paths(catalog, mutation):
    pick, op, value = mutation

    def msg(m):
        d = _report_map(m, "d0")
        _mutate(d, pick, op, copy.deepcopy(value))
        try:
            return "d0", _pack(d)
        except (OverflowError, ValueError, TypeError):  # not representable in msgpack: send the plain one
            return "d0", _pack(_report_map(m, "d0"))
    _both(catalog, [msg, _plain("d1"), _plain("d0", seed=1)])


def test_plain_report_reads_what_decode_reads(catalog):
    """wire.plain_report returns the fields and values decode_map builds from the same map, or None."""
    m = _machine(catalog, True)
    e = plain_expected(m.open.plans["d0"])
    d = _report_map(m, "d0")
    p = wire.plain_report(d, e)
    r = wire.decode_map(d, expect=("report",), finite_updates=False)
    assert (p.task_id, p.device_id, p.n_samples, p.metrics) == (r.task_id, r.device_id, r.n_samples, r.metrics)
    assert list(p.values) == list(r.tensors)
    for k, t in r.tensors.items():
        assert t.plain and t.encoding == "f4" and np.array_equal(p.values[k], t.values.reshape(-1))
    assert r.extras == {}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_mutations())
def test_the_plain_readers_never_read_what_decode_refuses(catalog, mutation):
    """On a changed report map, plain_report (of the map) and the layout (of its bytes) return None, or exactly
    what decode builds from it."""
    m = _plain_machine(catalog)
    e = plain_expected(m.open.plans["d0"])
    d = _report_map(m, "d0")
    _mutate(d, *mutation)
    p = wire.plain_report(d, e)
    if p is not None:  # decode_map raises if plain_report read too much
        _same_report(p, wire.decode_map(d, expect=("report",), finite_updates=False), e)
    try:
        payload = _pack(d)
    except (OverflowError, ValueError, TypeError):
        return
    p = wire.PlainLayout(e).read(payload)
    if p is not None:
        _same_report(p, _decode(payload), e)


_PLAIN_MACHINE: list = []


def _plain_machine(catalog) -> RoundMachine:
    if not _PLAIN_MACHINE:
        _PLAIN_MACHINE.append(_machine(catalog, True))
    return _PLAIN_MACHINE[0]


@pytest.mark.parametrize("change, plain", [
    ({}, True),
    ({"upload": {"dtype": "f4", "delta": True}}, False),
    ({"upload": {"dtype": "f4", "sample": "norm", "keep": 0.5, "delta": True}}, False),
    ({"upload": {"dtype": "f4", "dtype_1d": "f2"}}, False),
    ({"upload": {"dtype": "q8", "delta": True}}, False),
    ({"extras": {"e": (2,)}}, False),
    ({"update": "gradient"}, False),
])
def test_plain_expected_is_none_for_every_plan_that_is_not_float32_weights(catalog, change, plain):
    plan = dataclasses.replace(_plain_machine(catalog).open.plans["d0"], **change)
    assert (plain_expected(plan) is not None) == plain


def test_plain_expected_is_none_for_tensors_the_general_decoder_refuses(catalog):
    plan = _plain_machine(catalog).open.plans["d0"]
    for weights in ({**plan.weights, "s": np.zeros((), np.float32)},  # no dimensions
                    {**plan.weights, "x" * 300: np.zeros(2, np.float32)},  # a name too long
                    {**plan.weights, "d": np.zeros(2, np.float64)}):  # not float32
        assert plain_expected(dataclasses.replace(plan, weights=weights)) is None


@pytest.mark.parametrize("field", ["task_id", "device_id"])
@pytest.mark.parametrize("value", ["a/b", "", "x" * 129, "é", 7, None])
def test_plain_report_refuses_ids_that_decode_refuses(catalog, field, value):
    m = _plain_machine(catalog)
    d = _report_map(m, "d0")
    d[field] = value
    assert wire.plain_report(d, plain_expected(m.open.plans["d0"])) is None
    with pytest.raises(wire.WireError):
        wire.decode_map(d, expect=("report",), finite_updates=False)


# ---------------------------------------------------------------- reading in place (wire.PlainLayout)

def _message_and_its_values(catalog) -> tuple[dict, bytes, set[int]]:
    """d0's plain report as expected, as bytes, and the positions of its values in them."""
    m = _plain_machine(catalog)
    d = _report_map(m, "d0")
    payload = _pack(d)
    values = set()
    for rec in d["tensors"].values():
        at = payload.find(rec["x"]["b"])
        values.update(range(at, at + len(rec["x"]["b"])))
    return plain_expected(m.open.plans["d0"]), payload, values


def _decode(payload: bytes) -> Report:
    return wire.decode(payload, expect=("report",), finite_updates=False)  # raises if the reader read too much


def _same_report(p: wire.PlainReport, r: Report, e: dict) -> None:
    """``p`` holds what decode built (``r``)."""
    assert (p.task_id, p.device_id, p.n_samples, p.metrics) == (r.task_id, r.device_id, r.n_samples, r.metrics)
    assert list(p.values) == list(r.tensors) == list(e) and r.extras == {}
    for k, t in r.tensors.items():
        assert t.plain and t.encoding == "f4" and t.shape == tuple(e[k][0])
        assert np.array_equal(p.values[k], t.values.reshape(-1))


def test_the_layout_reads_what_the_encoder_writes_in_place(catalog):
    m = _plain_machine(catalog)
    e = plain_expected(m.open.plans["d0"])
    payload = _pack(_report_map(m, "d0"))
    p = wire.PlainLayout(e).read(payload)
    _same_report(p, _decode(payload), e)
    assert all(v.base is payload for v in p.values.values())  # views of the message: no copy
    # a tensor with no values, and one name that needs more than a fixstr
    e2 = {"w" * 40: ([2, 3], 24), "empty": ([0, 4], 0), "b": ([3], 12)}
    tensors = {k: TensorUpdate(tuple(s), np.arange(n // 4, dtype=np.float32).reshape(s)) for k, (s, n) in e2.items()}
    payload = wire.encode(Report("t1", "d9", 5, {"loss": 0.5}, tensors))
    _same_report(wire.PlainLayout(e2).read(payload), _decode(payload), e2)


@pytest.mark.parametrize("change", ["key order", "no extras field"])
def test_the_layout_leaves_other_encoders_to_the_map(catalog, change):
    """Another key order or no extras is still a plain report, read from the unpacked map."""
    m = _plain_machine(catalog)
    e = plain_expected(m.open.plans["d0"])
    d = _report_map(m, "d0")
    CHANGES[change](d, m)
    payload = _pack(d)
    assert wire.PlainLayout(e).read(payload) is None
    assert wire.plain_report(wire.unpack(payload), e) is not None
    assert wire.PlainLayout(e).read(bytearray(_pack(_report_map(m, "d0")))) is None  # bytes only


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_the_layout_never_reads_what_decode_refuses_in_changed_bytes(catalog, data):
    """A byte of the message's structure (anything but the values) set, inserted or deleted: the layout
    declines, or reads exactly what decode reads."""
    e, payload, values = _message_and_its_values(catalog)
    structure = [i for i in range(len(payload)) if i not in values]
    changed = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        i = min(data.draw(st.sampled_from(structure)), len(changed) - 1)  # (an earlier delete shortened it)
        op = data.draw(st.sampled_from(["set", "insert", "delete"]))
        if op == "set":
            changed[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            changed.insert(i, data.draw(st.integers(0, 255)))
        else:
            del changed[i]
    changed = bytes(changed)
    p = wire.PlainLayout(e).read(changed)
    if p is not None:
        _same_report(p, _decode(changed), e)


@pytest.mark.parametrize("head", [{"zz": 1}, {"n": True}, {"v": 2}, {"metrics": {"x": [1]}}, {"device_id": "a/b"}])
def test_the_layout_checks_the_fields_before_the_tensors(catalog, head):
    """A field the general path refuses, written before the tensors (so the tensors and extras still end the
    message as the layout expects): the layout declines."""
    m = _plain_machine(catalog)
    e = plain_expected(m.open.plans["d0"])
    d = _report_map(m, "d0")
    payload = _pack({**head, **d} | head)  # the changed field first
    tail = _pack(d)
    assert payload.endswith(tail[tail.index(b"\xa7tensors"):])
    assert wire.PlainLayout(e).read(payload) is None
    with pytest.raises(wire.WireError):
        wire.decode(payload, expect=("report",), finite_updates=False)


def test_the_sum_of_squares_takes_any_array_a_report_can_hold():
    """Empty (a pruned tensor), 2-d, strided and float64 arrays: each tensor's norm goes through _sq."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4) - np.float32(5.5)
    for x in (np.zeros(0, np.float32), np.zeros((0, 3), np.float32), a, a[:, ::2], a.T, a.astype(np.float64)):
        assert _sq(x) == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-6, abs=0.0)


def test_the_layout_declines_every_single_byte_changed_after_the_head(catalog):
    """Each byte from ``tensors`` to the end of the message (but the values), changed on its own: the layout
    declines, or reads exactly what decode reads (deterministic, where the hypothesis test above samples)."""
    e, payload, values = _message_and_its_values(catalog)
    layout = wire.PlainLayout(e)
    read = 0
    for i in range(payload.index(b"\xa7tensors"), len(payload)):
        if i in values:
            continue
        for b in (payload[i] ^ 1, payload[i] ^ 0x80):
            changed = payload[:i] + bytes((b,)) + payload[i + 1:]
            p = layout.read(changed)
            if p is not None:
                read += 1
                _same_report(p, _decode(changed), e)
    assert read == 0  # every such byte is part of what the layout compares
