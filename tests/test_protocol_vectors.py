"""The protocol's conformance vectors (firmware_tests/protocol, docs/protocol.md section 12): they are what the
generator writes, byte for byte; they decode to their JSON; the Python device agent does with each what the
spec says; and their bytes read as docs/protocol.md describes them, by a reader written here from the text."""
from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest

from edge.algorithms import client_class
from edge.algorithms.base import PlanError
from edge.algorithms.driver import encode_update
from edge.protocol import agent as A
from edge.protocol import vectors as V
from edge.protocol import wire
from edge.protocol.machine import markdown
from firmware_tests.protocol import VECTORS, check

ROOT = Path(__file__).resolve().parents[1]
SPEC_DOC = (ROOT / "docs" / "protocol.md").read_text()
AGENT_LABELS = {"plan": "`received` plan", "ack": "`received` ack", "pace": "`received` pace"}


def meta(name: str) -> dict:
    return json.loads((VECTORS / f"{name}.json").read_text())


def payload(name: str) -> bytes:
    return (VECTORS / f"{name}.msgpack").read_bytes()


def names(valid: bool | None = None, kind: str | None = None) -> list[str]:
    out = []
    for p in sorted(VECTORS.glob("*.json")):
        m = json.loads(p.read_text())
        if (valid is None or m["valid"] == valid) and (kind is None or m["kind"] == kind):
            out.append(m["name"])
    return out


def test_shipped_vectors_are_what_the_generator_writes(tmp_path):
    V.write(tmp_path)
    assert V.compare(tmp_path, VECTORS) == []


def test_every_vector_passes_the_firmware_check():
    verdicts = check()
    assert len(verdicts) >= 40
    assert {k: v for k, v in verdicts.items() if v != "pass"} == {}


def test_the_check_catches_a_changed_byte_and_a_changed_json(tmp_path):
    d = tmp_path / "v"
    shutil.copytree(VECTORS, d)
    b = bytearray((d / "report_bitmask.msgpack").read_bytes())
    b[-1] ^= 0x01  # the last byte is in the last value of the tensor
    (d / "report_bitmask.msgpack").write_bytes(bytes(b))
    m = json.loads((d / "ack_late.json").read_text())
    m["decoded"]["status"] = "accepted"
    (d / "ack_late.json").write_text(json.dumps(m))
    m = json.loads((d / "bad_version.json").read_text())
    m["error"] = "some other reason"
    (d / "bad_version.json").write_text(json.dumps(m))
    bad = {k for k, v in check(d).items() if v != "pass"}
    assert bad == {"report_bitmask", "ack_late", "bad_version"}


def test_coverage_every_kind_mask_and_value_format():
    kinds = {meta(n)["kind"] for n in names(True)} | {"chunk"} if meta("plan_chunked").get("chunks") else set()
    assert kinds >= {"checkin", "plan", "report", "ack", "status", "pace", "chunk"}
    masks, values = set(), set()
    for n in names(True, "report"):
        for t in meta(n)["decoded"]["tensors"].values():
            masks.add(t["mask"]["format"] if t["mask"] else "dense")
            values.add(t["values"]["dtype"])
    assert masks == {"dense", "bitmask", "index16", "index32", "golomb", "enum"}
    assert values == {"f4", "f2", "bf16", "q8", "q8r"}
    assert "sample" in meta("report_sampled")["decoded"]["tensors"]["fc.weight"]
    coded = meta("plan_coded_downlink")["decoded"]
    assert coded["tag"] and coded["base"] and {w["dtype"] for w in coded["weights"].values()} == {"q8r", "q8", "bf16"}
    assert {n for n in names() if meta(n).get("requires")} == {"report_sampled", "plan_coded_downlink"}


# ---------------------------------------------------------------- the bytes, read from the spec's text

def _bits(data: bytes) -> list[int]:
    return [(data[j >> 3] >> (7 - (j & 7))) & 1 for j in range(8 * len(data))]


def golomb_rows(data: bytes, n: int, K: int) -> list[int]:
    """docs/protocol.md section 5, "Golomb": the K minority rows, written from the text."""
    return golomb_parse(data, n, K)[0]


def golomb_parse(data: bytes, n: int, K: int) -> tuple[list[int], int, tuple[int, int, int]]:
    """(the K minority rows, M, the bit lengths of sections A, B and C)."""
    bits = _bits(data)
    lz = bits.index(1)
    v = int("".join(map(str, bits[lz:2 * lz + 1])), 2)
    z = v - 1
    d = z // 2 if z % 2 == 0 else -(z + 1) // 2
    m0 = max(1, (n * 1488522236 + K * 2**30) // (K * 2**31))
    M = m0 + d
    pos = 2 * lz + 1
    b = math.ceil(math.log2(M)) if M > 1 else 0
    u = 2**b - M
    h = []
    for _ in range(K):
        w = max(0, b - 1)
        h.append(int("".join(map(str, bits[pos:pos + w])) or "0", 2))
        pos += w
    r = []
    for hi in h:
        if b == 0:
            r.append(0)
        elif hi < u:
            r.append(hi)
        else:
            r.append(2 * hi + bits[pos] - u)
            pos += 1
    rows, prev = [], -1
    len_a, len_b, start_c = K * max(0, b - 1), sum(hi >= u for hi in h) if b else 0, pos
    for ri in r:
        q = 0
        while bits[pos] == 1:
            q, pos = q + 1, pos + 1
        pos += 1
        prev = prev + 1 + q * M + ri
        rows.append(prev)
    assert not any(bits[pos:]), "nonzero padding"
    return rows, M, (len_a, len_b, pos - start_c)


def enum_rows(data: bytes, n: int, K: int) -> list[int]:
    R = int.from_bytes(data, "big")
    rows = []
    for j in range(K, 0, -1):
        c = j - 1
        while math.comb(c + 1, j) <= R:
            c += 1
        rows.append(c)
        R -= math.comb(c, j)
    return sorted(rows)


def test_mask_bytes_read_as_the_spec_says():
    def rec(name):
        return msgpack.unpackb(payload(name), raw=False)["tensors"]["fc.weight"]

    # bitmask of rows 0 2 3 7 9 of 10: 1011 0001 | 01 + six zero bits
    assert rec("report_bitmask")["m"] == bytes([0b10110001, 0b01000000])
    assert rec("report_index16")["i"] == struct.pack("<2H", 1, 4) and rec("report_index16")["w"] == 2
    assert rec("report_index32")["i"] == struct.pack("<2I", 1, 4) and rec("report_index32")["w"] == 4
    assert golomb_rows(rec("report_golomb")["g"], 10, 3) == [2, 5, 6]
    assert golomb_rows(rec("report_golomb_inactive")["g"], 10, 1) == [5]  # the minority: the inactive row
    rows, M, sections = golomb_parse(rec("report_golomb_sections")["g"], 64, 3)
    assert rows == [5, 30, 50] and M == 12 and sections == (9, 2, 6)  # A, B and C all present; d = -3
    assert meta("report_golomb_sections")["decoded"]["tensors"]["fc.weight"]["mask"]["active"] == [5, 30, 50]
    assert enum_rows(rec("report_enum")["e"], 10, 2) == [3, 8]
    assert len(rec("report_enum")["e"]) == math.ceil((math.comb(10, 2) - 1).bit_length() / 8)


def test_value_bytes_read_as_the_spec_says():
    rows = np.arange(40, dtype=np.float64).reshape(10, 4) / 16 - 1.0
    x = {n: msgpack.unpackb(payload(f"report_{n}"), raw=False)["tensors"]["fc.weight"]["x"]
         for n in ("bf16", "q8", "q8r")}
    bf = struct.unpack("<40H", x["bf16"]["b"])
    for h, v in zip(bf, rows.ravel()):  # to nearest even, as section 6 writes it
        u = struct.unpack("<I", struct.pack("<f", v))[0]
        assert h == min(((u & 0x7FFFFFFF) + 0x7FFF + ((u >> 16) & 1)) >> 16, 0x7F7F) | ((u >> 16) & 0x8000)
    assert [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in bf] == pytest.approx(rows.ravel(), abs=1 / 64)
    s, = struct.unpack("<f", x["q8"]["b"][:4])
    q = struct.unpack("<40b", x["q8"]["b"][4:])
    assert s >= np.abs(rows).max() / 127 and -128 not in q
    assert np.abs(np.array(q) * s - rows.ravel()).max() <= s  # stochastic rounding: within one step
    sr = struct.unpack("<10f", x["q8r"]["b"][:40])
    qr = np.array(struct.unpack("<40b", x["q8r"]["b"][40:])).reshape(10, 4)
    assert np.abs(qr * np.array(sr)[:, None] - rows).max() <= max(sr)
    assert meta("report_q8")["decoded"]["tensors"]["fc.weight"]["values"]["values"] == \
        (np.array(q, np.float32) * np.float32(s)).reshape(10, 4).tolist()
    f2 = msgpack.unpackb(payload("report_f2_delta"), raw=False)["tensors"]["fc0.bias"]["x"]
    assert f2["d"] == "f2" and f2["b"] == struct.pack("<3e", *[1 / 256] * 3)


def test_sampled_update_read_as_the_spec_says():
    r = msgpack.unpackb(payload("report_sampled"), raw=False)["tensors"]["fc.weight"]
    h = r["h"]
    sent = r["x"]["s"][0]
    active = enum_rows(r["e"], 10, min(h["k"], 10 - h["k"]))  # the row mask codes the k = h.k active rows
    assert h["k"] == len(active) == 5 and active == [0, 2, 3, 7, 9]
    picks = enum_rows(h["e"], h["k"], min(sent, h["k"] - sent))  # a mask over the k active rows (n = k)
    assert [active[j] for j in picks] == [2, 7] and sent == len(picks) == len(h["p"])
    d = meta("report_sampled")["decoded"]["tensors"]["fc.weight"]
    assert d["mask"] == {"format": "enum", "active": active}
    assert d["sample"] == {"k": 5, "format": "enum", "active": [1, 3], "rows": [2, 7], "p": [128, 255]}
    # the coordinator reads a sent row as value / p
    t = wire.decode(payload("report_sampled")).tensors["fc.weight"]
    est = t.estimate()
    assert np.allclose(est[2], np.asarray(d["values"]["values"][0]) * 255 / 128) and not est[0].any()


def test_coded_plan_read_as_the_spec_says():
    p = msgpack.unpackb(payload("plan_coded_downlink"), raw=False)
    assert p["tag"] == "run1-r3a1" and p["base"] == "run1-r2a1"
    want = meta("plan_coded_downlink")["decoded"]["weights"]
    for name, rec in p["weights"].items():
        count = math.prod(rec["s"])
        if rec["d"] in ("q8", "q8r"):
            rows = rec["s"][0] if rec["d"] == "q8r" else 1
            scales = struct.unpack(f"<{rows}f", rec["b"][:4 * rows])
            q = np.array(struct.unpack(f"<{count}b", rec["b"][4 * rows:]), np.float32).reshape(rows, -1)
            got = q * np.array(scales, np.float32)[:, None]
            assert -128 not in q and all(np.abs(q[i]).max() == 127 for i in range(rows) if scales[i] > 0)
            for s in scales:  # at most 17 significant bits: the low 7 bits of the binary32 pattern are zero
                assert struct.unpack("<I", struct.pack("<f", s))[0] & 0x7F == 0
        else:
            assert rec["d"] == "bf16"
            got = np.array([struct.unpack("<f", struct.pack("<I", u << 16))[0]
                            for u in struct.unpack(f"<{count}H", rec["b"])], np.float32)
        assert got.reshape(rec["s"]).tolist() == want[name]["values"]


def test_plan_bytes_read_as_the_spec_says():
    d = msgpack.unpackb(payload("plan_fedavg"), raw=False)
    assert list(d)[:2] == ["v", "k"] and d["v"] == 1 and d["k"] == "plan"
    w = d["weights"]["fc0.weight"]
    assert w["d"] == "f4" and w["s"] == [3, 4]
    assert list(struct.unpack("<12f", w["b"])) == np.asarray(
        meta("plan_fedavg")["decoded"]["weights"]["fc0.weight"]["values"]).ravel().tolist()
    import hashlib
    p = msgpack.unpackb(payload("plan_with_program"), raw=False)
    assert hashlib.sha256(p["program"]).hexdigest() == p["program_hash"] == d["program_hash"]
    # chunks: the concatenation of the b fields, in order, is the whole payload
    chunks = [msgpack.unpackb((VECTORS / f"plan_chunked.{i}.msgpack").read_bytes(), raw=False)
              for i in range(meta("plan_chunked")["chunks"])]
    assert b"".join(c["b"] for c in chunks) == payload("plan_chunked")
    assert all(c["t"] == len(payload("plan_chunked")) and c["n"] == len(chunks) for c in chunks)
    assert all(len(c["b"]) == V.CHUNK_BYTES for c in chunks[:-1])


# ---------------------------------------------------------------- the Python device, fed the vectors

def agent(state: str = "idle", programs=True) -> A.DeviceAgent:
    ag = A.DeviceAgent(A.AgentConfig(V.DEVICE, fleet=V.FLEET), n_samples=60,
                       programs=[V._sha(V.torch_program(V.SPEC).data)] if programs else [])
    ag.connected(1.0)
    if state == "reporting":
        ag.received(wire.topic(V.FLEET, "plan", V.DEVICE), payload("plan_fedavg"), 2.0)
        rep = wire.decode(payload("report_dense_f4"))
        ag.training_done(rep, 3.0)
    assert ag.state == state
    return ag


@pytest.mark.parametrize("name", names(True, "plan"))
def test_device_trains_every_valid_plan(name):
    ag = agent(programs=meta(name)["decoded"]["program"] is None)
    t = wire.topic(V.FLEET, "plan", V.DEVICE)
    out = []
    m = meta(name)
    for i in range(m.get("chunks", 0)):
        out = ag.received(t, (VECTORS / f"{name}.{i}.msgpack").read_bytes(), 2.0)
        if i < m["chunks"] - 1:
            assert out == []
    if not m.get("chunks"):
        out = ag.received(t, payload(name), 2.0)
    assert [type(a).__name__ for a in out if not isinstance(a, A.Publish)][-1] == "StartTraining"
    assert ag.state == "training" and ag.task.task_id == V.TASK


@pytest.mark.parametrize("name", [n for n in names(False) if meta(n)["kind"] in ("plan", "ack", "pace")])
@pytest.mark.parametrize("state", ["idle", "reporting"])
def test_device_drops_every_invalid_vector(name, state):
    ag = agent(state)
    t = wire.topic(V.FLEET, meta(name)["kind"], V.DEVICE)
    parts = [(VECTORS / f"{name}.{i}.msgpack").read_bytes() for i in range(meta(name).get("chunks", 0))]
    for p in parts or [payload(name)]:
        assert ag.received(t, p, 4.0) == []
    assert ag.state == state and ag._last_task == ("" if state == "idle" else V.TASK)


CHUNK_RULES = {  # docs/protocol.md section 8: each refusal rule, the vector series that breaks it
    "chunks disagree on n": "bad_chunk_n_disagree", "chunks disagree on t": "bad_chunk_t_disagree",
    "data exceed t": "bad_chunk_exceeds_t", "an empty chunk": "bad_chunk_empty",
    "a chunk other than the last shorter than 256 bytes": "bad_chunk_short",
    "n > max(1, ceil(t / 256))": "bad_chunk_too_many", "the payload is itself a chunk": "bad_chunk_nested"}


def test_a_chunk_series_for_every_refusal_rule():
    refused = {n for n in names(False) if meta(n).get("chunks")}
    assert refused == set(CHUNK_RULES.values())
    section8 = SPEC_DOC[SPEC_DOC.index("## 8. Chunking"):SPEC_DOC.index("## 9. Device behaviour")]
    for name in CHUNK_RULES.values():
        assert f"`{name}`" in section8
    for n in refused:
        assert not (VECTORS / f"{n}.msgpack").exists() and meta(n)["chunks"] >= 2


@pytest.mark.parametrize("name", sorted(CHUNK_RULES.values()) + ["plan_chunked"])
def test_python_reassembler_on_every_chunk_series(name):
    """The reassembler (wire.Reassembler, then the decoder that refuses a chunk inside a chunk) refuses each
    refused series, for the reason its JSON names, and assembles the valid one; so does a lax reading of the
    refused ones, which shows each breaks its rule and nothing else a receiver would trip on first."""
    m = meta(name)
    chunks = [wire.decode((VECTORS / f"{name}.{i}.msgpack").read_bytes(), expect=("chunk",))
              for i in range(m["chunks"])]
    r, whole, errors = wire.Reassembler(), None, []
    for c in chunks:
        try:
            got = r.feed("plan", c, 0.0)
            if got is not None:
                wire.decode(got, expect=("plan",))
                whole = got
        except wire.WireError as e:
            errors.append(str(e))
    if m["valid"]:
        assert errors == [] and whole == payload(name)
        return
    assert whole is None and any(m["error"] in e for e in errors), errors
    lax = b"".join(c.data for c in sorted(chunks, key=lambda c: c.index))
    if name == "bad_chunk_nested":  # read once more as a chunk, it is the plan
        lax = wire.decode(lax, expect=("chunk",)).data
    assert wire.decode(lax).kind == "plan"


def test_a_float_is_never_an_int():
    """docs/protocol.md section 3: a float where an integer belongs is refused, even 3.0 (the wire drops the
    message); in hparams, which the wire reads as scalars, the algorithm refuses it (training fails)."""
    with pytest.raises(wire.WireError, match="has type float"):
        wire.decode(payload("bad_round_float"))
    base = msgpack.unpackb(payload("plan_fedavg"), raw=False)
    for key in ("round", "seed"):
        with pytest.raises(wire.WireError, match="has type float"):
            wire.decode(msgpack.packb({**base, key: 3.0}, use_bin_type=True))
    for kind, body in (("checkin", msgpack.unpackb(payload("checkin_minimal"), raw=False)),
                       ("report", msgpack.unpackb(payload("report_dense_f4"), raw=False))):
        with pytest.raises(wire.WireError, match="has type float"):
            wire.decode(msgpack.packb({**body, "n": 60.0}, use_bin_type=True))
    Hp = client_class("fedavg").Hparams
    for bad in ({"epochs": 1.0}, {"batch_size": 20.0}):
        with pytest.raises(PlanError, match="expected an integer"):
            Hp.from_wire({"lr": 0.05, "epochs": 1, "batch_size": 20, **bad})
    assert Hp.from_wire({"lr": 1, "epochs": 1, "batch_size": 20}).lr == 1.0  # an int is a number


@pytest.mark.parametrize("name", names(True, "ack"))
def test_every_ack_status_ends_the_report(name):
    ag = agent("reporting")
    out = ag.received(wire.topic(V.FLEET, "ack", V.DEVICE), payload(name), 4.0)
    assert ag.state == "idle"
    assert [p.topic.split("/")[3] for p in out] == ["status", "checkin"]


def test_a_message_on_the_wrong_topic_is_dropped():
    ag = agent("reporting")
    assert ag.received(wire.topic(V.FLEET, "plan", V.DEVICE), payload("ack_accepted"), 4.0) == []
    assert ag.state == "reporting"
    ag = agent()
    assert ag.received(wire.topic(V.FLEET, "ack", V.DEVICE), payload("plan_fedavg"), 2.0) == []
    assert ag.state == "idle"


def test_pace_vector_moves_the_next_heartbeat():
    ag = agent()
    assert ag.received(wire.topic(V.FLEET, "pace", V.DEVICE), payload("pace"), 2.0) == []
    assert ag.tick(2.0 + 42.0) == []
    assert [p.topic.split("/")[3] for p in ag.tick(2.0 + 42.6)] == ["checkin"]


def test_coordinator_reads_every_device_vector():
    """What a device sends (checkin, report, status) decodes on the coordinator's side too (finite_updates off)."""
    for n in names(True):
        if meta(n)["kind"] in ("checkin", "report", "status"):
            assert wire.decode(payload(n), finite_updates=False).kind == meta(n)["kind"]


# ---------------------------------------------------------------- versioning (docs/protocol.md section 11)

def test_versioning_rules_are_what_the_code_does():
    plan = wire.decode(payload("plan_f2_upload"))
    assert plan.upload["x_future"] == 1  # the wire keeps unknown upload keys ...
    w = {k: v + np.float32(1 / 128) for k, v in plan.weights.items()}
    up = encode_update(w, plan)  # ... and the device ignores them
    assert all(t.values.dtype == np.float16 for t in up.values())
    assert np.allclose(up["fc0.bias"].values, 1 / 128)  # a delta, as upload.delta asks
    Hp = client_class("fedavg").Hparams
    with pytest.raises(PlanError, match="unknown hyperparameters"):
        Hp.from_wire({**plan.hparams, "momentum": 0.9})  # a plan with an unknown hparam is refused
    for n, why in (("bad_version", "protocol version"), ("bad_unknown_field", "unknown fields"),
                   ("bad_unknown_kind", "unknown message kind"), ("bad_ack_status", "unknown ack status")):
        with pytest.raises(wire.WireError, match=why):
            wire.decode(payload(n))
    caps = wire.decode(payload("checkin_full")).capabilities
    assert caps["x_vendor"] == "acme"  # unknown capabilities travel (the coordinator keeps them)


def test_protocol_doc_shows_the_agents_table():
    table = markdown(A.TRANSITIONS, A.STATES, A.EVENTS, AGENT_LABELS)
    assert table in SPEC_DOC, "docs/protocol.md's device table differs from the code; it should read:\n" + table


def test_protocol_doc_lists_the_conformance_steps():
    from coordinator.conformance import STEPS
    rows = "\n".join(f"| `{k}` | {v} |" for k, v in STEPS.items())
    assert rows in SPEC_DOC, "docs/protocol.md section 13 differs from coordinator/conformance.py's STEPS:\n" + rows


def test_vector_check_runs_on_a_torch_free_device():
    import subprocess
    import sys
    code = ("import sys, firmware_tests.protocol as p; assert all(v == 'pass' for v in p.check().values()); "
            "assert 'torch' not in sys.modules; "
            "assert not any(m.split('.')[0] in ('coordinator', 'export') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("state", ["idle", "training", "reporting"])
def test_connecting_says_online_and_checks_in_only_when_free(state):
    """docs/protocol.md 9.1, 9.2 and 9.5: every connection publishes the retained `online` (replacing a retained
    `training`); only an idle (or offline) device then checks in, a reporting one resends at the next tick."""
    ag = agent("reporting" if state == "reporting" else "idle")
    if state == "training":
        ag.received(wire.topic(V.FLEET, "plan", V.DEVICE), payload("plan_fedavg"), 2.0)
    assert ag.state == state
    ag.disconnected(5.0)
    out = ag.connected(6.0)
    kinds = [(p.topic.split("/")[3], p.retain) for p in out]
    assert kinds[0] == ("status", True) and wire.decode(out[0].payload).state == "online"
    assert kinds[1:] == ([("checkin", False)] if state == "idle" else [])
    if state == "reporting":
        assert [p.topic.split("/")[3] for p in ag.tick(6.0)] == ["report"]
