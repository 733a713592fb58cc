"""Property-based fuzzing of everything that reads network input, 10^4 cases each.

Hostile input is generated two ways: raw bytes, and valid messages with one part replaced by a value of any
msgpack type (the family that once stopped the coordinator: ``{"v": 1, "k": {}}``). The properties:
decoders raise nothing but WireError; the round machine and the device agent never raise, whatever
arrives; and the coordinator still commits finite state afterwards.
"""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import faults
from coordinator.faults import Fuzzed
from edge.protocol import agent as A
from edge.protocol import wire
from edge.runtime.program import torch_program
from edge.protocol.wire import Ack, CheckIn, Chunk, Plan, Report, Status, TensorUpdate, WireError

from conftest import SPEC, make_bus

pytestmark = pytest.mark.slow  # 10^4 generated cases each: about a minute in all

N = 10_000
FUZZ = settings(max_examples=N, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def _valid_messages() -> list[dict]:
    """One valid message of every kind, as the maps that go on the wire."""
    t = TensorUpdate((16, 64), np.ones((2, 64), np.float32), np.arange(16) < 2)
    prog = torch_program(SPEC)
    msgs = [
        CheckIn("d0", {"runtime": "torch", "charging": True, "battery": 0.5, "memory_mb": 1024}, [prog.hash], 30,
                "r1a1"),
        Report("r1a1", "d0", 30, {"train_loss": 1.0}, {"fc0.weight": t,
                                                       "fc0.bias": TensorUpdate((16,), np.ones(16, np.float32))},
               {"qzs": np.ones(4, np.float32) / 4}),
        Status("d0", "offline", 1.0),
        Chunk("m1", 0, 2, 600, b"x" * 300),
        Plan("r1a1", 1, "d0", 100.0, "fedavg", "torch", prog.hash, {"fc0.bias": np.zeros(16, np.float32)},
             {"lr": 0.1, "epochs": 1, "batch_size": 10}, 3, {"dtype": "f4"}, prog.data),
        Ack("r1a1", "d0", "accepted", ""),
    ]
    return faults.templates(msgs)


VALID = _valid_messages()


def mutate(data: bytes, kinds: tuple[str, ...] | None = None, device: str = "d0") -> bytes:
    return faults.mutate(data, [m for m in VALID if kinds is None or m["k"] in kinds], device)


hostile = st.binary(max_size=400)


@FUZZ
@given(hostile)
def test_decode_raises_only_wire_error(data):
    try:
        wire.decode(mutate(data))
    except WireError:
        pass


@FUZZ
@given(hostile)
def test_array_and_update_records_raise_only_wire_error(data):
    f = Fuzzed(data)
    good = VALID[1]["tensors"]["fc0.weight"]
    update = {k: (f.value() if f.byte() % 3 == 0 else v) for k, v in good.items() if f.byte() % 5}
    array = {k: (f.value() if f.byte() % 3 == 0 else v) for k, v in good["x"].items() if f.byte() % 5}
    for fn, rec in ((wire.unpack_update, update), (wire.unpack_array, array)):
        try:
            fn(rec, "t")
        except WireError:
            pass


@FUZZ
@given(hostile)
def test_reassembler_keeps_its_bounds(data):
    f = Fuzzed(data)
    r = wire.Reassembler(timeout_s=50, max_bytes=4000, max_open_per_sender=1, max_total_bytes=6000)
    for _ in range(f.byte() % 12):
        who, now = f.byte() % 4, float(f.byte() % 100)
        chunk = Chunk(f"m{who // 2}", f.byte() % 10 - 2, f.byte() % 10 - 2, f.int(2) % 5010 - 10,
                      b"x" * (f.int(2) % 700))
        try:
            r.feed("ab"[who % 2], chunk, now, limit=3000)
        except WireError:
            pass
        r.expire(now)
        assert r.reserved <= 6000 and all(v <= 1 for v in r._per_sender.values())
        assert r.reserved == sum(s["size"] for s in r._open.values())


def _coordinator_bus(tmp_path_factory):
    bus = make_bus(tmp_path_factory.mktemp("fuzz"), 4, rounds=3, per_round=4, over=1.0, min_reports=2,
                   timeout=1e9)
    bus.hold_training = {"d0", "d1"}
    bus.connect_all()
    bus.tick(0.1)
    return bus


def test_round_machine_never_raises_and_still_commits_finite_state(tmp_path_factory):
    bus = _coordinator_bus(tmp_path_factory)
    m = bus.m
    # the open round's real task id and plan shapes, so mutated reports get deep into admission
    for v in VALID:
        if v["k"] == "report":
            v["task_id"] = m.open.task_id
    kinds = ("checkin", "report", "status")
    seen = {"n": 0}

    @FUZZ
    @given(hostile)
    def run(data):
        kind, dev = kinds[data[0] % 3 if data else 0], ["d0", "d1", "d9"][data[1] % 3 if len(data) > 1 else 0]
        out = m.receive(wire.topic("default", kind, dev), mutate(data[2:], (kind, "chunk"), dev), bus.now)
        assert isinstance(out, list)
        seen["n"] += 1

    run()
    assert seen["n"] == N
    # the machine is still usable: held devices report and the rounds commit, finite
    bus.hold_training = set()
    for d in ("d0", "d1"):
        ag = bus.agents[d]
        if ag.state == "training":
            from edge.algorithms.driver import run_plan
            from edge.trainers import make_trainer
            t = make_trainer("torch")
            t.load(bus.caches[d].get(ag.task.program_hash))
            bus._device_actions(d, ag.training_done(run_plan(ag.task, t, *bus.data[d]), bus.now))
    bus.pump()
    for _ in range(6):
        bus.tick(30)
    assert m.state.round == 3
    assert all(np.isfinite(w).all() for w in m.state.weights.values())


def test_device_agent_never_raises(tmp_path):
    ag = A.DeviceAgent(A.AgentConfig("d0", capabilities={"runtime": "torch"}), n_samples=10)
    ag.connected(0.0)
    seen = {"n": 0}

    @FUZZ
    @given(hostile)
    def run(data):
        kind = "plan" if data[:1] < b"\x80" else "ack"
        out = ag.received(wire.topic("default", kind, "d0"), mutate(data[1:], ("plan", "ack", "chunk")), 1.0)
        assert isinstance(out, list)
        ag.state, ag.task = "idle", None  # a plan that got through starts training; reset for the next case
        seen["n"] += 1

    run()
    assert seen["n"] == N
