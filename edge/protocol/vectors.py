"""Conformance vectors of the wire protocol: golden payloads beside their decoded form (docs/protocol.md, s. 12).

Why: a device written in Kotlin, Swift or C cannot import ``wire.py``; it can read bytes and compare JSON.
Each vector is ``<name>.msgpack`` (the exact payload) and ``<name>.json`` (``valid``, the topic, and the
``decoded`` fields, or ``error`` for a payload a receiver must drop). A chunked message is a series
``<name>.<i>.msgpack`` (``"chunks": N`` in the JSON), fed in file order: a valid series beside its whole
``<name>.msgpack``, a refused series (``"valid": false``) alone, with no ``<name>.msgpack``. A vector of an
extension (docs/protocol.md section 6.1) names the capability in ``"requires"``.

``python -m edge.protocol.vectors [--out DIR] [--check]`` writes them (default ``firmware_tests/protocol``) or
compares a fresh build with what is there. Everything is deterministic: fixed values, a fixed seed for the
stochastic rounding, msgpack's deterministic encoding. Imports only edge (the device side may run it).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np

from . import codec, downlink, wire
from .wire import Ack, CheckIn, Plan, Report, Status, TensorUpdate
from ..model import init_weights, mlp
from ..runtime.program import torch_program

FLEET, DEVICE, TASK = "conf", "dev-1", "run1-r3a1"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "firmware_tests" / "protocol"
SPEC = mlp([4, 3, 2])  # fc0 [3, 4], fc1 [2, 3]: small enough to read in the JSON
DEADLINE = 1_900_000_000.0
CHUNK_BYTES = 256  # the smallest chunk a receiver accepts


@dataclass(frozen=True)
class Vector:
    name: str
    topic_kind: str
    about: str
    payload: bytes
    error: str = ""  # non-empty: a receiver must drop it (a substring of wire.py's reason)
    chunks: tuple[bytes, ...] = ()  # a chunk series, in the order a receiver is fed them
    requires: tuple[str, ...] = ()  # the capabilities (extensions, section 6.1) a device needs to accept it


# ---------------------------------------------------------------- the decoded form

def _hex(b: bytes) -> dict[str, str]:
    return {"hex": bytes(b).hex()}


def array_json(a: np.ndarray, code: str) -> dict[str, Any]:
    return {"dtype": code, "shape": list(a.shape), "values": np.asarray(a, np.float64).tolist()
            if a.dtype.kind == "f" else a.tolist()}


def update_json(rec: dict, t: TensorUpdate) -> dict[str, Any]:
    fmt = next((f for f, key in (("bitmask", "m"), ("golomb", "g"), ("enum", "e")) if key in rec), None)
    if "i" in rec:
        fmt = "index16" if rec["w"] == 2 else "index32"
    mask = None if fmt is None else {"format": fmt, "active": np.flatnonzero(t.mask).tolist()}
    out = {"shape": list(t.shape), "mask": mask, "values": array_json(t.values, rec["x"]["d"])}
    if "h" in rec:  # a sampled update: which of the active rows carry values, and with what probability
        h = rec["h"]
        sfmt = next(f for f, key in (("bitmask", "m"), ("golomb", "g"), ("enum", "e"), ("index", "i")) if key in h)
        if sfmt == "index":
            sfmt = "index16" if h["w"] == 2 else "index32"
        out["sample"] = {"k": h["k"], "format": sfmt, "active": np.flatnonzero(t.sample).tolist(),
                         "rows": t.sent_rows().tolist(), "p": list(h["p"])}
    return out


def decoded_json(payload: bytes) -> dict[str, Any]:
    """What a conforming decoder makes of ``payload``: the wire fields (not ``v``), byte strings as hex,
    arrays and updates with their decoded values (docs/protocol.md, section 12). Raises WireError."""
    msg = wire.decode(payload)
    raw = msgpack.unpackb(payload, raw=False)
    out: dict[str, Any] = {"kind": raw["k"]}
    for key, val in raw.items():
        if key in ("v", "k"):
            continue
        if key in ("weights", "extras"):
            arrs = msg.weights if key == "weights" else msg.extras
            out[key] = {n: array_json(arrs[n], rec["d"]) for n, rec in val.items()}
        elif key == "tensors":
            out[key] = {n: update_json(rec, msg.tensors[n]) for n, rec in val.items()}
        elif isinstance(val, bytes):
            out[key] = _hex(val)
        else:
            out[key] = val
    return out


# ---------------------------------------------------------------- the vectors

def _weights() -> dict[str, np.ndarray]:
    # multiples of 1/64: exact in binary32 and binary16, and short in JSON
    w = init_weights(SPEC, 0)
    return {k: (np.round(v * 64) / 64).astype(np.float32) for k, v in w.items()}


def _plan(program: bytes | None = None, **kw) -> Plan:
    prog = program if program is not None else torch_program(SPEC).data
    args = dict(task_id=TASK, round=3, device_id=DEVICE, deadline=DEADLINE, strategy="fedavg", runtime="torch",
                program_hash=_sha(prog),
                weights=_weights(), hparams={"lr": 0.05, "epochs": 1, "batch_size": 20}, seed=12345,
                upload={"dtype": "f4", "delta": False}, program=program)
    args.update(kw)
    return Plan(**args)


def _sha(b: bytes) -> str:
    from ..runtime.program import program_hash
    return program_hash(b)


def _report(tensors: dict[str, dict], extras: dict | None = None) -> bytes:
    """A report whose tensor records are given as wire maps (so each vector pins one mask or value format)."""
    body = {"v": wire.PROTOCOL_VERSION, "k": "report", "task_id": TASK, "device_id": DEVICE, "n": 60,
            "metrics": {"train_loss": 0.6875, "steps": 3}, "tensors": tensors,
            "extras": {k: wire.pack_array(v) for k, v in (extras or {}).items()}}
    return msgpack.packb(body, use_bin_type=True)


def _masked(values: np.ndarray, rows: int, active: list[int], fmt: str, code: str = "f4",
            rng: np.random.Generator | None = None, M: int | None = None) -> dict:
    """An update record of ``values`` (the active rows only) with its mask in format ``fmt``."""
    shape = [rows, *values.shape[1:]]
    rec: dict[str, Any] = {"s": shape}
    rec["x"] = wire.pack_values(values, code, rng=rng) if code not in ("f2",) else wire.pack_array(
        values.astype(np.float16))
    sup = codec.support_of_rows(rows, np.array(active, np.int64))
    data = codec.golomb_encode(sup, M) if M is not None else codec.encode_mask_as(sup, fmt)
    rec[{"bitmask": "m", "index16": "i", "index32": "i", "golomb": "g", "enum": "e"}[fmt]] = data
    if fmt.startswith("index"):
        rec["w"] = 2 if fmt == "index16" else 4
    return rec


def _raw(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def build() -> list[Vector]:
    """Every vector, in a fixed order."""
    w = _weights()
    rng = np.random.default_rng(7)  # the stochastic rounding of the q8 / bf16 vectors
    rows = np.arange(40, dtype=np.float32).reshape(10, 4) / 16 - 1.0  # a [10, 4] tensor
    vs: list[Vector] = []

    def add(name, kind, about, payload, error=""):
        vs.append(Vector(name, kind, about, payload, error))

    add("checkin_minimal", "checkin", "a first check-in: no programs, no last task",
        wire.encode(CheckIn(DEVICE, {"runtime": "torch"}, [], 60)))
    add("checkin_full", "checkin", "every known capability, a held program, the last task, an unknown capability",
        wire.encode(CheckIn(DEVICE, {"runtime": "torch", "charging": True, "idle": True, "network": "wifi",
                                     "battery": 0.75, "memory_mb": 2048, "link_kbps": 5000.5, "x_vendor": "acme"},
                            [_sha(torch_program(SPEC).data)], 60, "run1-r2a1")))
    add("plan_fedavg", "plan", "FedAvg plan for a 4-3-2 MLP, f4 weights, program by hash only",
        wire.encode(_plan()))
    prog = torch_program(SPEC).data
    add("plan_with_program", "plan", "the same plan carrying its (torch JSON) program; program_hash = sha256",
        wire.encode(_plan(program=prog)))
    add("plan_f2_upload", "plan", "a plan asking for float16 deltas (upload dtype f2, delta true) and an "
        "upload key a v1 device must ignore", wire.encode(_plan(upload={"dtype": "f2", "delta": True,
                                                                          "x_future": 1})))
    whole = wire.encode(_plan(program=prog))
    chunks = wire.split(whole, f"p-{TASK}", CHUNK_BYTES)
    assert len(chunks) > 2
    vs.append(Vector("plan_chunked", "plan", f"plan_with_program split into {len(chunks)} chunks of "
                     f"{CHUNK_BYTES} bytes (the last shorter); reassembled it is plan_chunked.msgpack", whole,
                     chunks=tuple(chunks)))

    # a coded-downlink plan (section 6.1): differences from the held model "run1-r2a1", nearest rounding
    held = {k: (v - ((np.arange(v.size) * 5 % 11 - 5) / 40).reshape(v.shape)).astype(np.float32)
            for k, v in w.items()}
    coded, _ = downlink.encode(w, held, {"fc0.weight": "q8r", "fc1.weight": "q8r", "fc0.bias": "q8",
                                         "fc1.bias": "bf16"})
    vs.append(Vector("plan_coded_downlink", "plan", "a coded-downlink plan (needs coded_downlink): tag and base, "
                     "weights as differences from the held model of tag run1-r2a1 (between -1/8 and 1/8), "
                     "rounded to nearest: q8r for the matrices, q8 and bf16 for the biases",
                     wire.encode(_plan(weights=coded, tag="run1-r3a1", base="run1-r2a1")),
                     requires=("coded_downlink",)))

    dense = {k: wire.pack_update(TensorUpdate(v.shape, v)) for k, v in w.items()}
    add("report_dense_f4", "report", "FedAvg report: every tensor dense, f4 values", _report(dense))
    delta = {k: {"s": list(v.shape), "x": wire.pack_array((v * 0 + 1 / 256).astype(np.float16))}
             for k, v in w.items()}
    add("report_f2_delta", "report", "float16 deltas (w_new - w_plan, here 1/256 everywhere), dense", _report(delta))
    for fmt, active in (("bitmask", [0, 2, 3, 7, 9]), ("index16", [1, 4]), ("index32", [1, 4]),
                        ("golomb", [2, 5, 6]), ("enum", [3, 8])):
        add(f"report_{fmt}", "report", f"a [10, 4] tensor with rows {active} active, mask as {fmt}",
            _report({"fc.weight": _masked(rows[active], 10, active, fmt)}))
    wide = np.arange(6, dtype=np.float32).reshape(3, 2) / 8  # the 3 active rows of a [64, 2] tensor
    add("report_golomb_sections", "report", "a [64, 2] tensor with rows [5, 30, 50] active, Golomb with M = 12 "
        "given explicitly (M0 = 15, d = -3: gamma 00110); b = 4, u = 4: sections A (3 bits a row) 100 000 101, "
        "B 1 1, C 0 110 10", _report({"fc.weight": _masked(wide, 64, [5, 30, 50], "golomb", M=12)}))
    many = [0, 1, 2, 3, 4, 6, 7, 8, 9]
    add("report_golomb_inactive", "report", "9 of 10 rows active: the Golomb code carries the inactive row (5)",
        _report({"fc.weight": _masked(rows[many], 10, many, "golomb")}))
    add("report_empty_mask", "report", "a tensor with no active rows (bitmask of zeros, values of shape [0, 4])",
        _report({"fc.weight": _masked(rows[[]], 10, [], "bitmask")}))
    for code in ("bf16", "q8", "q8r"):
        how = "rounded to nearest even" if code == "bf16" else "stochastic rounding, seed 7"
        add(f"report_{code}", "report", f"dense values in the {code} value format ({how})",
            _report({"fc.weight": {"s": [10, 4], "x": wire.pack_values(rows, code, rng=rng)}}))
    # a sampled update (section 5, needs sampled_upload): 5 active rows, 2 of them sent; the masks are the ones
    # the encoder picks (so a device that re-encodes the decoded update gets these bytes)
    active = np.isin(np.arange(10), [0, 2, 3, 7, 9])
    samp = wire.pack_update(TensorUpdate((10, 4), rows[[2, 7]] / 8, active, sample=np.array([0, 1, 0, 1, 0], bool),
                                         pcodes=np.array([128, 255], np.uint8)))
    assert "e" in samp and "e" in samp["h"]
    vs.append(Vector("report_sampled", "report", "a sampled update (needs sampled_upload): rows [0, 2, 3, 7, 9] "
                     "active (enum, K = 5 of 10: R = 163), of which the 2nd and 4th (rows 2 and 7) are sent, with "
                     "probability codes 128 and 255 (p = 128/255 and 1), the sample as enum over the 5 active rows "
                     "(n = 5, K = 2: R = C(1, 1) + C(3, 2) = 4)", _report({"fc.weight": samp}),
                     requires=("sampled_upload",)))
    add("report_extras", "report", "a report with an extra f4 array (FedMix's qs)",
        _report(dense, {"qs": np.array([0.25, 0.75], np.float32)}))
    for st, reason in (("accepted", ""), ("duplicate", ""), ("late", "round closed"),
                       ("rejected", "fc0.weight: values are float16, the plan asked for float32")):
        add(f"ack_{st}", "ack", f"an ack {st}", wire.encode(Ack(TASK, DEVICE, st, reason)))
    add("status_online", "status", "retained presence on connecting", wire.encode(Status(DEVICE, "online", 1.9e9)))
    add("status_offline_will", "status", "the last will: retained offline, ts 0", wire.encode(Status(DEVICE, "offline")))
    add("pace", "pace", "next heartbeat in 42.5 s", wire.encode(wire.Pace(DEVICE, 42.5)))

    # ---- payloads a receiver must drop
    base = msgpack.unpackb(wire.encode(_plan()), raw=False)
    add("bad_version", "plan", "v = 2: a later protocol version", _raw({**base, "v": 2}), "protocol version")
    add("bad_unknown_field", "plan", "a field v1 does not define", _raw({**base, "priority": 1}), "unknown fields")
    add("bad_unknown_kind", "plan", "a kind v1 does not define", _raw({"v": 1, "k": "cancel", "task_id": TASK}),
        "unknown message kind")
    add("bad_device_id", "plan", "an id that cannot be a topic level", _raw({**base, "device_id": "dev/1"}),
        "not a valid id")
    add("bad_bool_as_int", "plan", "true where an integer belongs", _raw({**base, "seed": True}), "type bool")
    add("bad_round_float", "plan", "round as the float 3.0: a float where an integer belongs",
        _raw({**base, "round": 3.0}), "has type float")
    nan_w = dict(base["weights"], **{"fc0.bias": wire.pack_array(np.array([0, np.nan, 0], np.float32))})
    add("bad_nan_weight", "plan", "a NaN in the weights", _raw({**base, "weights": nan_w}), "non-finite")
    add("bad_array_length", "plan", "shape and data length disagree",
        _raw({**base, "weights": dict(base["weights"], **{"fc0.bias": {"d": "f4", "s": [3], "b": b"\0" * 8}})}),
        "disagree")
    add("bad_trailing_bytes", "ack", "a valid ack followed by one more byte",
        wire.encode(Ack(TASK, DEVICE, "accepted")) + b"\x00", "malformed msgpack")
    add("bad_ack_status", "ack", "an ack status v1 does not define",
        _raw({"v": 1, "k": "ack", "task_id": TASK, "device_id": DEVICE, "status": "deferred", "reason": ""}),
        "unknown ack status")
    add("bad_pace_range", "pace", "pace after more than 86400 s",
        _raw({"v": 1, "k": "pace", "device_id": DEVICE, "after": 1e6}), "outside")
    add("bad_shape_too_big", "report", "a tensor of shape [0, 2^31-1, 2^31-1]: no values, but its non-zero "
        "dimensions multiply past 2^40", _report({"fc.weight": {"s": [0, 2**31 - 1, 2**31 - 1],
                                                                "x": {"d": "f4", "s": [0, 2**31 - 1, 2**31 - 1],
                                                                      "b": b""}}}), "bad shape")
    bad_idx = _masked(rows[[1, 4]], 10, [1, 4], "index16")
    bad_idx["i"] = np.array([4, 1], "<u2").tobytes()
    add("bad_index_order", "report", "an index list that is not increasing", _report({"fc.weight": bad_idx}),
        "not increasing")
    bad_bits = _masked(rows[[0, 2]], 10, [0, 2], "bitmask")
    bad_bits["m"] = bad_bits["m"][:1]
    add("bad_bitmask_length", "report", "a bitmask one byte short", _report({"fc.weight": bad_bits}), "mask of")
    miscount = _masked(rows[[0, 2, 3]], 10, [0, 2], "bitmask")  # 3 rows of values, 2 bits set
    add("bad_mask_count", "report", "values for 3 rows, a mask of 2", _report({"fc.weight": miscount}),
        "mask says")
    q = bytearray(wire.pack_values(rows, "q8", rng=np.random.default_rng(1))["b"])
    q[4] = 0x80
    add("bad_q8_minus128", "report", "an int8 of -128 in q8 values",
        _report({"fc.weight": {"s": [10, 4], "x": {"d": "q8", "s": [10, 4], "b": bytes(q)}}}), "-128")
    add("bad_two_masks", "report", "a bitmask and an index list on one tensor",
        _report({"fc.weight": {**_masked(rows[[1, 4]], 10, [1, 4], "index16"),
                               "m": _masked(rows[[1, 4]], 10, [1, 4], "bitmask")["m"]}}), "more than one mask")
    vs += chunk_refusals(whole, wire.encode(_plan()))
    return vs


def _chunk(mid: str, i: int, n: int, t: int, data: bytes) -> bytes:
    return wire.encode(wire.Chunk(mid, i, n, t, data))


def chunk_refusals(whole: bytes, small: bytes) -> list[Vector]:
    """One chunk series per refusal rule of section 8, each breaking that rule alone where it can, so that a
    receiver that skips the rule would reassemble a valid plan. The offending chunk comes last where the order
    matters. ``whole``: plan_with_program (3 chunks of 256); ``small``: plan_fedavg (2)."""
    T, mid = len(whole), f"p-{TASK}"
    assert 512 < T - 1 and T + 1 <= 768 and 256 < len(small) <= 512
    part = [whole[:256], whole[256:512], whole[512:]]
    vs = []

    def series(name, about, chunks, error):
        vs.append(Vector(name, "plan", about, b"", error, chunks=tuple(chunks)))

    series("bad_chunk_n_disagree", f"plan_with_program's 3 chunks, the last fed (index 1) saying n = 2",
           [_chunk(mid, 0, 3, T, part[0]), _chunk(mid, 2, 3, T, part[2]), _chunk(mid, 1, 2, T, part[1])],
           "disagrees with earlier chunks")
    series("bad_chunk_t_disagree", f"plan_with_program's 3 chunks, the last saying t = {T + 1} (the others {T})",
           [_chunk(mid, 0, 3, T, part[0]), _chunk(mid, 1, 3, T, part[1]), _chunk(mid, 2, 3, T + 1, part[2])],
           "disagrees with earlier chunks")
    series("bad_chunk_exceeds_t", f"plan_with_program's 3 chunks ({T} bytes), every one announcing t = {T - 1}",
           [_chunk(mid, i, 3, T - 1, part[i]) for i in range(3)], "exceed the announced size")
    series("bad_chunk_empty", f"3 chunks: bytes 0..256, 256..{T} ({T - 256} bytes; a chunk longer than 256 is "
           "allowed), and an empty last chunk", [_chunk(mid, 0, 3, T, whole[:256]), _chunk(mid, 1, 3, T, whole[256:]),
                                                 _chunk(mid, 2, 3, T, b"")], "is too small")
    series("bad_chunk_short", f"3 chunks of bytes 0..255, 255..511, 511..{T}, fed as index 1, 2, 0: chunk 0 (not "
           "the last) has 255 bytes", [_chunk(mid, 1, 3, T, whole[255:511]), _chunk(mid, 2, 3, T, whole[511:]),
                                       _chunk(mid, 0, 3, T, whole[:255])], "is too small")
    ts = len(small)
    series("bad_chunk_too_many", f"plan_fedavg ({ts} bytes) in n = 3 > max(1, ceil({ts} / 256)) = 2 chunks: each "
           "is refused by the bound as the first of a transfer, before any data is kept (a transfer that broke "
           "only this rule would need more data than t)",
           [_chunk(mid, 0, 3, ts, small[:200]), _chunk(mid, 1, 3, ts, small[200:400]),
            _chunk(mid, 2, 3, ts, small[400:])], "in 3 chunks")
    inner = _chunk(f"p-{TASK}-inner", 0, 1, ts, small)  # a valid chunk: all of plan_fedavg in one
    series("bad_chunk_nested", f"a chunk (all of plan_fedavg as chunk 0 of 1, {len(inner)} bytes) sent in 2 chunks: "
           "the reassembled payload is itself a chunk", [_chunk(f"p-{TASK}-outer", i, 2, len(inner),
                                                               inner[256 * i:256 * (i + 1)]) for i in range(2)],
           "unexpected message kind 'chunk'")
    return vs


def write(out: Path, vectors: list[Vector] | None = None) -> list[Path]:
    """Write every vector under ``out`` (which it empties of old vectors first); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    for p in list(out.glob("*.msgpack")) + list(out.glob("*.json")):
        p.unlink()
    files = []
    for v in vectors or build():
        meta: dict[str, Any] = {"name": v.name, "kind": v.topic_kind, "topic": wire.topic(FLEET, v.topic_kind, DEVICE),
                                "valid": not v.error, "about": v.about}
        if v.error:
            meta["error"] = v.error
        else:
            meta["decoded"] = decoded_json(v.payload)
        if v.requires:
            meta["requires"] = list(v.requires)
        if v.chunks:
            meta["chunks"] = len(v.chunks)
            for i, c in enumerate(v.chunks):
                files.append(out / f"{v.name}.{i}.msgpack")
                files[-1].write_bytes(c)
        if not (v.chunks and v.error):  # a refused series has no whole
            files.append(out / f"{v.name}.msgpack")
            files[-1].write_bytes(v.payload)
        files.append(out / f"{v.name}.json")
        files[-1].write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return files


def compare(a: Path, b: Path) -> list[str]:
    """Files that differ between two vector directories (by name and bytes)."""
    names = {p.name for p in a.iterdir()} | {p.name for p in b.iterdir()}
    return sorted(n for n in names if not ((a / n).exists() and (b / n).exists()
                                          and (a / n).read_bytes() == (b / n).read_bytes()))


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m edge.protocol.vectors", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--check", action="store_true", help="compare a fresh build with --out instead of writing")
    a = ap.parse_args(argv)
    if not a.check:
        n = len(write(a.out))
        print(f"wrote {n} files to {a.out}")
        return 0
    with tempfile.TemporaryDirectory() as d:
        write(Path(d))
        diff = compare(Path(d), a.out)
    print("vectors up to date" if not diff else "differ: " + " ".join(diff))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
