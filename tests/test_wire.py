"""Wire protocol: round trips, strict rejection, chunking, mask encoding."""
from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from edge.protocol import wire
from edge.protocol.wire import Ack, CheckIn, Chunk, Plan, Report, Status, TensorUpdate, WireError

ids = st.from_regex(wire.ID_RE, fullmatch=True)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
scalars = st.dictionaries(st.text(max_size=20), st.one_of(st.integers(-2**40, 2**40), finite, st.text(max_size=30),
                                                           st.booleans()), max_size=6)


@st.composite
def arrays(draw, dtype=np.float32, max_rows=6):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    n = math.prod(shape)
    vals = draw(st.lists(finite, min_size=n, max_size=n))
    return np.array(vals, dtype=dtype).reshape(shape)


@st.composite
def updates(draw):
    rows = draw(st.integers(1, 40))
    cols = draw(st.integers(1, 4))
    mask = None if draw(st.booleans()) else np.array(draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    n = rows if mask is None else int(mask.sum())
    vals = np.array(draw(st.lists(finite, min_size=n * cols, max_size=n * cols)), np.float32).reshape(n, cols)
    return TensorUpdate((rows, cols), vals, mask)


messages = st.one_of(
    st.builds(CheckIn, ids, scalars, st.lists(st.from_regex(r"^[0-9a-f]{64}$", fullmatch=True), max_size=3),
              st.integers(0, 10**6)),
    st.builds(Plan, ids, st.integers(0, 10**6), ids, finite, st.text(max_size=10), st.sampled_from(["torch", "ort"]),
              st.from_regex(r"^[0-9a-f]{64}$", fullmatch=True), st.dictionaries(st.text(min_size=1, max_size=8), arrays(), max_size=3),
              scalars, st.integers(0, 2**63 - 1), scalars, st.one_of(st.none(), st.binary(max_size=50))),
    st.builds(Report, ids, ids, st.integers(1, 10**6), scalars,
              st.dictionaries(st.text(min_size=1, max_size=8), updates(), max_size=3),
              st.dictionaries(st.text(min_size=1, max_size=8), arrays(), max_size=2)),
    st.builds(Ack, ids, ids, st.sampled_from(sorted(wire.ACK_STATUSES)), st.text(max_size=40)),
    st.builds(Status, ids, st.sampled_from(sorted(wire.STATUS_STATES)), finite),
    st.builds(wire.Pace, ids, st.floats(0.0, wire.MAX_PACE_S)),
)


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, TensorUpdate):
        return a.shape == b.shape and same(a.values, b.values) and (
            (a.mask is None and b.mask is None) or (a.mask is not None and b.mask is not None and np.array_equal(a.mask, b.mask)))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_round_trip(msg):
    assert same(msg, wire.decode(wire.encode(msg)))


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages, st.data())
def test_mutated_bytes_raise_only_wire_error(msg, data):
    """Flip, cut or extend the bytes anywhere: decoding either fails with WireError or yields a valid message."""
    buf = bytearray(wire.encode(msg))
    op = data.draw(st.sampled_from(["flip", "cut", "extend"]))
    if op == "flip" and buf:
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    elif op == "cut":
        buf = buf[: data.draw(st.integers(0, max(0, len(buf) - 1)))]
    else:
        buf += data.draw(st.binary(min_size=1, max_size=8))
    try:
        out = wire.decode(bytes(buf))
    except WireError:
        return
    assert type(out).__name__ in {"CheckIn", "Plan", "Report", "Ack", "Status", "Chunk", "Pace"}


def _report(**kw):
    r = Report("r1a1", "d0", 10, {"loss": 1.0}, {"w": TensorUpdate((3, 2), np.ones((3, 2), np.float32))})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def _raw(d):
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("payload, match", [
    (lambda: _raw({"v": 2, "k": "ack"}), "protocol version"),
    (lambda: _raw({"v": 1, "k": "nope"}), "unknown message kind"),
    (lambda: _raw([1, 2]), "not a map"),
    (lambda: b"\xc1", "malformed"),
    (lambda: wire.encode(_report(device_id="a/b")), "not a valid id"),
    (lambda: wire.encode(_report(device_id="+")), "not a valid id"),
    (lambda: wire.encode(_report(n_samples=0)), "sample count"),
    (lambda: wire.encode(_report(metrics={"loss": float("nan")})), "not finite"),
    (lambda: wire.encode(_report(tensors={"w": TensorUpdate((3, 2), np.full((3, 2), np.inf, np.float32))})), "non-finite"),
    (lambda: wire.encode(_report(tensors={"w": TensorUpdate((4, 2), np.ones((3, 2), np.float32))})), "mask says"),
    (lambda: wire.encode(_report(tensors={"w": TensorUpdate((3, 2), np.ones((1, 2), np.float32),
                                                            np.array([1, 1, 0], bool))})), "mask says"),
    (lambda: _raw({"v": 1, "k": "ack", "task_id": "t", "device_id": "d", "status": "accepted", "reason": "",
                   "extra": 1}), "unknown fields"),
    (lambda: _raw({"v": 1, "k": "status", "device_id": "d", "state": "online", "ts": 0.0}) + b"", None),
    (lambda: _raw({"v": 1, "k": "pace", "device_id": "d", "after": -1.0}), "outside"),
    (lambda: _raw({"v": 1, "k": "pace", "device_id": "d", "after": 1e9}), "outside"),
    (lambda: _raw({"v": 1, "k": "pace", "device_id": "d", "after": float("nan")}), "not finite"),
])
def test_specific_rejections(payload, match):
    data = payload()
    if match is None:
        wire.decode(data)  # the control case decodes
        return
    with pytest.raises(WireError, match=match):
        wire.decode(data)


@pytest.mark.parametrize("payload", [
    lambda: _raw({"v": 1, "k": "checkin", "device_id": "d", "caps": {"a\nfake line": [1]}, "programs": [], "n": 1}),
    lambda: _raw({"v": 1, "k": "checkin", "device_id": "d", "caps": {"a\r\nb": "x" * 300}, "programs": [], "n": 1}),
    lambda: _raw({"v": 1, "k": "report", "task_id": "t", "device_id": "d", "n": 1, "metrics": {"m\n": float("nan")},
                  "tensors": {}}),
    lambda: _raw({"v": 1, "k": "report", "task_id": "t", "device_id": "d", "n": 1, "metrics": {},
                  "tensors": {"w\nx": {"s": [1]}}}),
    lambda: _raw({"v": 1, "k": "report", "task_id": "t", "device_id": "d", "n": 1, "metrics": {}, "tensors": {},
                  "extras": {"e\n": 5}}),
])
def test_a_device_cannot_write_lines_into_the_log(payload):
    """Names a device chose reach the coordinator's log line only as repr: no line breaks of its own."""
    with pytest.raises(WireError) as e:
        wire.decode(payload())
    assert "\n" not in str(e.value) and "\r" not in str(e.value), str(e.value)


def test_array_shape_and_bytes_must_agree():
    rec = wire.pack_array(np.ones((2, 3), np.float32))
    rec["s"] = [3, 3]
    with pytest.raises(WireError, match="disagree"):
        wire.unpack_array(rec, "x")
    rec["s"] = [-1, 6]
    with pytest.raises(WireError, match="bad shape"):
        wire.unpack_array(rec, "x")


@pytest.mark.parametrize("code", ["f4", "f8", "u1", "q8"])
@pytest.mark.parametrize("shape", [[0, 2**31 - 1, 2**31 - 1], [2**31 - 1, 0, 2**31 - 1, 1], [2**21, 0, 2**20]])
def test_empty_shape_too_big_for_numpy_is_refused_as_bad_shape(code, shape):
    """A zero dimension does not make the others harmless: numpy sizes an array from its non-zero dims, so
    reshape would raise ValueError (found by the hypothesis codec test, CI 2026-11-23)."""
    rec = {"d": code, "s": shape, "b": b""}
    with pytest.raises(WireError, match="bad shape"):
        wire.unpack_array(rec, "x")
    with pytest.raises(WireError, match="bad shape"):  # the report tensor's fast path and its general path
        wire.unpack_update({"s": shape, "x": rec}, "t", finite=False)
    with pytest.raises(WireError, match="bad shape"):
        wire.unpack_update({"s": shape, "x": rec}, "t")
    ok = [2**20, 0, 2**20]  # exactly MAX_ELEMENTS: still a shape
    assert wire.unpack_array({"d": "f4", "s": ok, "b": b""}, "x").shape == tuple(ok)


def test_oversized_message_is_refused_before_parsing():
    big = wire.encode(_report(tensors={"w": TensorUpdate((1000, 10), np.ones((1000, 10), np.float32))}))
    with pytest.raises(WireError, match="exceeds"):
        wire.decode(big, max_bytes=len(big) - 1)


def test_mask_goes_in_the_smallest_format_and_the_old_fields_still_decode():
    rows = 1000
    sparse = np.zeros(rows, bool); sparse[[3, 500]] = True
    dense = np.ones(rows, bool); dense[7] = False
    for mask, size in ((sparse, 3), (dense, 2)):  # log2 C(1000, 2) = 18.9 bits, log2 C(1000, 1) = 10.0
        t = TensorUpdate((rows, 2), np.ones((int(mask.sum()), 2), np.float32), mask)
        rec = wire.pack_update(t)
        assert len(rec) == 3 and len(rec[{"m", "i", "g", "e"}.intersection(rec).pop()]) == size
        assert np.array_equal(wire.unpack_update(rec, "t").mask, mask)
        old = {"s": [rows, 2], "x": rec["x"]}  # what the previous encoder sent
        assert np.array_equal(wire.unpack_update(old | {"m": np.packbits(mask).tobytes()}, "t").mask, mask)
        idx = np.flatnonzero(mask).astype("<u2").tobytes()
        assert np.array_equal(wire.unpack_update(old | {"i": idx, "w": 2}, "t").mask, mask)


def test_chunking_reassembles_in_any_order_and_counts_bytes():
    payload = bytes(range(256)) * 100
    parts = wire.split(payload, "m1", 1000)
    assert len(parts) == 26
    r = wire.Reassembler()
    got = None
    for p in reversed(parts):
        got = r.feed("dev", wire.decode(p), now=0.0) or got
    assert got == payload and r.open_transfers == 0
    assert wire.split(b"small", "m2", 1000) == [b"small"]


def test_a_default_chunk_fits_a_1_mib_mqtt_packet_with_the_longest_ids():
    """Every fedge client chunks at DEFAULT_CHUNK_BYTES so that each message fits EMQX's default max_packet_size,
    1 MiB (docs/operations.md): the chunk's msgpack with the longest transfer id the wire allows, its topic with
    the longest fleet and device ids, and MQTT 5's PUBLISH framing (packet id, a properties length)."""
    longest = "x" * 128
    assert wire.ID_RE.match(longest) and not wire.ID_RE.match(longest + "x")
    payload = bytes(range(256)) * (2 * wire.DEFAULT_CHUNK_BYTES // 256 + 1)
    parts = wire.split(payload, longest, wire.DEFAULT_CHUNK_BYTES)
    assert len(parts) == 3
    topic = wire.topic(longest, "report", longest).encode()
    for p in parts:
        remaining = 2 + len(topic) + 2 + 1 + len(p)  # topic length, topic, packet id, properties length, payload
        length_bytes = 1 + (remaining >= 1 << 7) + (remaining >= 1 << 14) + (remaining >= 1 << 21)
        assert 1 + length_bytes + remaining <= 1 << 20
    # and not far below it: every message costs a fixed share (docs/operations.md, "Fewer, larger messages")
    assert len(parts[0]) > (1 << 20) - 8192


def test_incomplete_transfer_times_out_and_oversize_is_refused():
    parts = wire.split(b"x" * 5000, "m1", 1000)
    r = wire.Reassembler(timeout_s=10, max_bytes=10_000)
    r.feed("dev", wire.decode(parts[0]), now=0.0)
    assert r.expire(5.0) == [] and r.open_transfers == 1
    assert r.expire(11.0) == [("dev", "m1")] and r.open_transfers == 0
    with pytest.raises(WireError, match="exceeds"):
        wire.Reassembler(max_bytes=4000).feed("dev", wire.decode(parts[0]), 0.0)
    bad = Chunk("m1", 1, 5, 9999, b"y")
    r.feed("dev", wire.decode(parts[0]), now=20.0)
    with pytest.raises(WireError, match="disagrees"):
        r.feed("dev", bad, now=20.0)


def test_plan_encoder_writes_exactly_what_encode_writes_and_packs_shared_weights_once():
    rng = np.random.default_rng(0)
    shared = {"fc0.weight": rng.normal(size=(16, 64)).astype(np.float32), "fc0.bias": np.zeros(16, np.float32)}
    other = {"fc0.weight": rng.normal(size=(4, 64)).astype(np.float32)}
    enc = wire.PlanEncoder()
    plans = [Plan("t-r1a1", 1, f"d{i}", 12.5 + i, "fedavg", "torch", "h1",
                  dict(shared) if i % 3 else other,  # a dict of its own around the same arrays
                  {"lr": 0.1, "epochs": 1 + i}, 2**40 + i, {"dtype": "f4"}, None if i % 2 else b"program-bytes")
             for i in range(7)]
    for p in plans:
        data = enc.encode(p)
        assert data == wire.encode(p)
        back = wire.decode(data)
        assert back.device_id == p.device_id and back.hparams == p.hparams
        assert all(np.array_equal(back.weights[k], v) for k, v in p.weights.items())
    # two weight sets and one program packed, whatever the number of plans
    assert len(enc._packed) == 3


def test_the_dense_fast_path_decodes_exactly_what_the_general_path_does():
    """unpack_update's shortcut for {"s", "x"} records (the coordinator's hot path) builds the same update as
    the general path, and hands everything else (hostile variants included) to it, which refuses it."""
    from edge.protocol.wire import _dense_update, unpack_update
    rng = np.random.default_rng(0)
    good = []
    for code, dt in (("f4", np.float32), ("f2", np.float16), ("f8", np.float64)):
        for shape in ([5], [3, 4], [2, 3, 4]):
            a = rng.standard_normal(shape).astype(dt)
            data = a.astype(np.dtype(dt).newbyteorder("<")).tobytes()
            good.append({"s": list(shape), "x": {"d": code, "s": list(shape), "b": data}})
    for rec in good:
        fast = _dense_update(rec)
        slow = unpack_update(rec, "t", finite=True)  # the general path (the shortcut is for finite=False)
        assert fast is not None and fast.shape == slow.shape and fast.encoding == slow.encoding
        assert fast.values.dtype == slow.values.dtype and np.array_equal(fast.values, slow.values)
        assert fast.mask is None and not fast.sampled
    base = good[1]
    bad = [
        {"s": [3, 4], "x": {**base["x"], "s": [4, 3]}},              # values' shape is not the tensor's
        {"s": [3, 4], "x": {**base["x"], "d": ["f4"]}},              # unhashable dtype
        {"s": [3, 4], "x": {**base["x"], "d": "i4"}},                # not floating point
        {"s": [3, 4], "x": {**base["x"], "b": base["x"]["b"][:-1]}},  # short data
        {"s": [True, 4], "x": {**base["x"], "s": [True, 4]}},       # a bool dimension
        {"s": [], "x": {**base["x"], "s": []}},                      # a scalar is not an update
        {"s": [3, 4], "m": b"\xff"},                                 # a mask without values
        {"s": [3, 4], "x": {**base["x"], "extra": 1}},              # an unknown array field
    ]
    for rec in bad:
        assert _dense_update(rec) is None
        with pytest.raises(wire.WireError):
            unpack_update(rec, "t", finite=False)


def test_an_id_with_a_trailing_newline_is_refused():
    """``$`` in a Python regex also matches before a final newline: "dev-1\\n" was a valid id (and topic level)."""
    assert wire.ID_RE.match("dev-1") and not wire.ID_RE.match("dev-1\n")
    payload = wire.encode(wire.Ack("r1a1", "dev-1", "accepted", ""))
    bad = payload.replace(b"\xa5dev-1", b"\xa6dev-1\n")
    with pytest.raises(wire.WireError):
        wire.decode(bad)
