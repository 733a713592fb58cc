"""The wire protocol: versioned msgpack messages with strict decoding.

The device is the constrained side, so the protocol lives here and imports only numpy and msgpack.
Every message is a msgpack map ``{"v": PROTOCOL_VERSION, "k": kind, ...}``. Arrays travel as raw
little-endian bytes with their dtype and shape. Decoding is strict: anything malformed, oversized, of
another version, with inconsistent shapes or non-finite floats raises :class:`WireError`, which a receiver
logs and drops. Nothing in here touches the network; byte counts are ``len()`` of what these functions
return, which is exactly what goes on the wire.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import msgpack
import numpy as np

from . import codec
from .errors import MAX_ELEMENTS, WireError  # noqa: F401 (wire.WireError, wire.MAX_ELEMENTS: the names callers use)
from .sizes import DEFAULT_CHUNK_BYTES  # noqa: F401 (wire.DEFAULT_CHUNK_BYTES: the name callers use)

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 4096
MAX_NDIM = 8
# At most this many elements in a declared shape, zero dimensions counted as 1: numpy computes an array's
# byte size from its non-zero dimensions even when another is 0, so [0, 2^31-1, 2^31-1] would make
# reshape raise ValueError instead of the wire refusing it. 2^40 elements is far beyond any model a
# device trains and keeps that product times 8 bytes well inside int64.
MAX_STR = 256
# Ids end up in topic names: no '/', '+', '#' or whitespace.
ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}\Z")  # \Z, not $: "$" also matches before a final newline
DTYPES = {"f4": np.float32, "f2": np.float16, "f8": np.float64, "u1": np.uint8, "i4": np.int32, "i8": np.int64}
_DTYPE_CODE = {np.dtype(v).str[1:]: k for k, v in DTYPES.items()}
# Wire arrays are little-endian; on a little-endian host the native dtype is the same and no copy is made.
_LE = {k: np.dtype(v).newbyteorder("<") for k, v in DTYPES.items()}
_NATIVE = {k: _LE[k] == np.dtype(v) for k, v in DTYPES.items()}
_ARRAY_FIELDS = frozenset({"d", "s", "b"})
# Value formats of edge/protocol/codec.py that are not plain dtypes; they decode as float32.
CODED_VALUES = ("bf16", "q8", "q8r")
# Mask formats of edge/protocol/codec.py -> record field (index lists add "w", the width in bytes)
_MASK_FIELD = {"bitmask": "m", "index16": "i", "index32": "i", "golomb": "g", "enum": "e"}


class TooLarge(WireError):
    """A message (or chunked transfer) larger than the receiver allows from this sender."""


class Busy(WireError):
    """The receiver holds as many incomplete transfers as it allows (from this sender, or in all)."""


# ---------------------------------------------------------------- arrays

def pack_array(a: np.ndarray) -> dict:
    a = np.asarray(a)
    code = _DTYPE_CODE.get(a.dtype.str[1:])
    if code is None:
        raise WireError(f"dtype {a.dtype} is not allowed on the wire")
    return {"d": code, "s": list(a.shape), "b": np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()}


def pack_values(a: np.ndarray, code: str, *, rng: np.random.Generator | None = None,
                rounding: str | None = None) -> dict:
    """An array record in a value format of edge/protocol/codec.py (f4, f2, bf16, q8, q8r); ``rng`` supplies the
    stochastic rounding noise. ``unpack_array`` reads it back (bf16, q8 and q8r as float32)."""
    a = np.asarray(a)
    return {"d": code, "s": list(a.shape), "b": codec.encode_values(a, code, rng=rng, rounding=rounding)}


class Coded:
    """An array already put in a value format of edge/protocol/codec.py (``record``, from :func:`pack_values`)
    with ``array``, exactly what the receiver will decode. A plan's weights may hold these instead of plain
    arrays (the downlink in lower precision); the sender keeps the decoded values it must reason with."""

    __slots__ = ("record", "array")

    def __init__(self, record: dict, array: np.ndarray):
        self.record, self.array = record, array

    @classmethod
    def of(cls, a: np.ndarray, code: str, *, rng: np.random.Generator | None = None,
           rounding: str | None = None) -> "Coded":
        rec = pack_values(a, code, rng=rng, rounding=rounding) if code not in ("f4", "f8") else pack_array(
            np.asarray(a, DTYPES[code]))
        return cls(rec, unpack_array(rec, "coded", finite=False))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def nbytes(self) -> int:
        return len(self.record["b"])


def _pack_any(a: "np.ndarray | Coded") -> dict:
    return a.record if isinstance(a, Coded) else pack_array(a)


def _good_shape(shape: Any, min_ndim: int) -> bool:
    """A list of at most MAX_NDIM ints (not bools) in [0, 2^31) whose non-zero product is at most
    MAX_ELEMENTS."""
    if type(shape) is not list or not min_ndim <= len(shape) <= MAX_NDIM:
        return False
    n = 1
    for d in shape:  # a loop, not all(...): every tensor of every report comes here
        if type(d) is not int or not 0 <= d < 2147483648:
            return False
        if d:
            n *= d
    return n <= MAX_ELEMENTS


def unpack_array(obj: Any, what: str, *, finite: bool = True) -> np.ndarray:
    if type(obj) is not dict or obj.keys() != _ARRAY_FIELDS:
        raise WireError(f"{what}: not an array record")
    code, shape, buf = obj["d"], obj["s"], obj["b"]
    if not isinstance(code, str) or (code not in DTYPES and code not in CODED_VALUES):
        raise WireError(f"{what}: dtype {_short(code)} is not allowed")
    if not _good_shape(shape, 0):
        raise WireError(f"{what}: bad shape {_short(shape)}")
    if not isinstance(buf, bytes):
        raise WireError(f"{what}: array data is not bytes")
    if code in CODED_VALUES:  # the codec checks the length against the shape before allocating
        try:
            return codec.decode_values(buf, code, tuple(shape))
        except WireError as e:
            raise WireError(f"{what}: {e}") from None
    dt = _LE[code]
    if math.prod(shape) * dt.itemsize != len(buf):
        raise WireError(f"{what}: shape {shape} and {len(buf)} data bytes disagree")
    a = np.frombuffer(buf, dtype=dt).reshape(shape)
    if not _NATIVE[code]:
        a = a.astype(DTYPES[code])
    if finite and a.dtype.kind == "f" and not np.isfinite(a).all():
        raise WireError(f"{what}: non-finite values")
    return a


# ---------------------------------------------------------------- field checks

def _need(d: Mapping, key: str, types: type | tuple, what: str) -> Any:
    if key not in d:
        raise WireError(f"{what}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise WireError(f"{what}: field {key!r} has type bool")
    if not isinstance(v, types):
        raise WireError(f"{what}: field {key!r} has type {type(v).__name__}")
    if isinstance(v, float) and not math.isfinite(v):
        raise WireError(f"{what}: field {key!r} is not finite")
    if isinstance(v, str) and len(v) > MAX_STR:
        raise WireError(f"{what}: field {key!r} is too long")
    return v


def _id(d: Mapping, key: str, what: str) -> str:
    v = _need(d, key, str, what)
    if not ID_RE.match(v):
        raise WireError(f"{what}: {key} {_short(v)} is not a valid id")
    return v


def _num(d: Mapping, key: str, what: str) -> float:
    return float(_need(d, key, (int, float), what))


def _scalars(obj: Any, what: str) -> dict[str, int | float | str | bool]:
    """A small flat map of scalars (hyperparameters, metrics, capabilities)."""
    if not isinstance(obj, dict) or len(obj) > 256:
        raise WireError(f"{what}: not a small map")
    out = {}
    for k, v in obj.items():
        if not isinstance(k, str) or len(k) > MAX_STR:
            raise WireError(f"{what}: bad key {_short(k)}")
        if isinstance(v, float) and not math.isfinite(v):
            raise WireError(f"{what}: {_short(k)} is not finite")
        if isinstance(v, str) and len(v) > MAX_STR:
            raise WireError(f"{what}: {_short(k)} is too long")
        if v is not None and not isinstance(v, (int, float, str, bool)):
            raise WireError(f"{what}: {_short(k)} is not a scalar")
        out[k] = v
    return out


def _arrays(obj: Any, what: str) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict) or len(obj) > MAX_TENSORS:
        raise WireError(f"{what}: not a map of arrays")
    out = {}
    for k, v in obj.items():
        if not isinstance(k, str) or not k or len(k) > MAX_STR:
            raise WireError(f"{what}: bad tensor name {_short(k)}")
        out[k] = unpack_array(v, f"{what}[{_short(k)}]")
    return out


def _only(d: Mapping, allowed: set[str], what: str) -> None:
    extra = set(d) - allowed
    if extra:
        raise WireError(f"{what}: unknown fields {_short(sorted(map(str, extra)))}")


# ---------------------------------------------------------------- sparse tensor updates

class TensorUpdate:
    """One tensor of an update: a mask over its groups (rows, axis 0) and only the active rows.

    ``mask is None`` means dense: every row is present. The mask travels in the smallest of the formats
    of edge/protocol/codec.py (bitmask, index list, Golomb-coded gaps, enumerative rank), chosen in
    :func:`pack_update`.

    Decoded from anything but a bitmask, the mask is kept as the indices of its active rows (``index``)
    or of its inactive rows (``inactive``) and built only when ``mask`` is first read: a hostile report
    may declare 2**31 rows in a few bytes, and nothing proportional to the *declared* shape may be
    allocated before the receiver has compared it with what it asked for.

    ``encoding`` is the value format the values arrived in (or were quantised to, see :meth:`encoded`);
    None for values built locally as plain arrays.

    A *sampled* update (``sample`` given) carries values for a random subset of its active rows only: the
    ``sample`` is a boolean mask over the active rows (in order), and row ``j`` of ``values`` was sent with
    inclusion probability ``probs[j] = pcodes[j] / 255`` (``pcodes``: uint8 in 1..255, so both ends hold
    the same probability to the bit). :meth:`estimate` is the Horvitz-Thompson estimate of the full update,
    values / probs on the sent rows: unbiased over the device's draw, whatever the probabilities were.
    """

    __slots__ = ("shape", "values", "_mask", "_index", "_inactive", "_coded", "encoding", "_sample", "pcodes")

    def __init__(self, shape: tuple[int, ...], values: np.ndarray, mask: np.ndarray | None = None, *,
                 index: np.ndarray | None = None, inactive: np.ndarray | None = None,
                 sample: "np.ndarray | Any | None" = None, pcodes: np.ndarray | None = None):
        self.shape = tuple(shape)
        self.values = values
        self._mask = None if mask is None else np.asarray(mask, dtype=bool)
        self._index = index
        self._inactive = inactive
        self._coded: dict | None = None
        self.encoding: str | None = None
        if (sample is None) != (pcodes is None):
            raise ValueError("a sampled update needs both the sample and its inclusion probabilities")
        # a boolean mask over the active rows, or (decoded) a codec Support over them
        self._sample = None if sample is None else (
            np.asarray(sample, dtype=bool) if isinstance(sample, np.ndarray) else sample)
        self.pcodes = None if pcodes is None else np.asarray(pcodes, dtype=np.uint8)

    @classmethod
    def encoded(cls, shape: tuple[int, ...], values: np.ndarray, mask: np.ndarray | None = None, *, code: str,
                rng: np.random.Generator | None = None, rounding: str | None = None,
                sample: np.ndarray | None = None, pcodes: np.ndarray | None = None) -> TensorUpdate:
        """Values in a value format of edge/protocol/codec.py, quantised now (stochastic rounding draws from ``rng``,
        a stream of the plan's seed); ``values`` is then exactly what the receiver will decode."""
        if code in ("f4", "f2"):
            rec = pack_array(np.asarray(values, DTYPES[code]))
        else:
            rec = pack_values(values, code, rng=rng, rounding=rounding)
        t = cls(shape, unpack_array(rec, "values", finite=False), mask, sample=sample, pcodes=pcodes)
        t._coded, t.encoding = rec, code
        return t

    @property
    def sampled(self) -> bool:
        return self._sample is not None

    @property
    def sample(self) -> np.ndarray | None:
        """Which active rows carry values (a mask over the active rows), None when every active row does."""
        if self._sample is not None and not isinstance(self._sample, np.ndarray):
            self._sample = self._sample.mask()
        return self._sample

    @property
    def n_sent(self) -> int:
        """Rows of values."""
        if self._sample is None:
            return self.n_active
        if isinstance(self._sample, np.ndarray):
            return int(np.count_nonzero(self._sample))
        return self._sample.k

    @property
    def probs(self) -> np.ndarray:
        """The inclusion probability of each row of values (ones when not sampled)."""
        if self.pcodes is None:
            return np.ones(self.n_active)
        return self.pcodes.astype(np.float64) / 255.0

    def sent_rows(self) -> np.ndarray:
        """The tensor rows the values belong to, in order."""
        m = self.mask
        rows = np.arange(self.shape[0]) if m is None else np.flatnonzero(m)
        return rows if self._sample is None else rows[self.sample]

    def estimate(self) -> np.ndarray:
        """The full-shape update in float64: values / probs on the rows sent, zeros elsewhere (Horvitz-Thompson;
        without sampling, :meth:`dense`)."""
        if self._sample is None:
            return self.dense().astype(np.float64)
        out = np.zeros(self.shape, np.float64)
        p = self.probs.reshape((-1,) + (1,) * (len(self.shape) - 1))
        out[self.sent_rows()] = self.values.astype(np.float64) / p
        return out

    @property
    def mask(self) -> np.ndarray | None:
        if self._mask is None and self._index is not None:
            m = np.zeros(self.shape[0], dtype=bool)
            m[self._index] = True
            self._mask, self._index = m, None
        if self._mask is None and self._inactive is not None:
            m = np.ones(self.shape[0], dtype=bool)
            m[self._inactive] = False
            self._mask, self._inactive = m, None
        return self._mask

    @property
    def plain(self) -> bool:
        """Every row, every row sent: no mask of any kind and no sample (a dense update, the common report)."""
        return self._mask is None and self._index is None and self._inactive is None and self._sample is None

    @property
    def dense_rows(self) -> bool:
        """True when every row is present (no mask, or a mask of all ones), without building the mask."""
        if self._index is not None:
            return len(self._index) == self.shape[0]
        if self._inactive is not None:
            return len(self._inactive) == 0
        return self._mask is None or bool(self._mask.all())

    @property
    def n_active(self) -> int:
        """Rows present, without building the mask."""
        if self._index is not None:
            return len(self._index)
        if self._inactive is not None:
            return self.shape[0] - len(self._inactive)
        return self.shape[0] if self._mask is None else int(np.count_nonzero(self._mask))

    def dense(self) -> np.ndarray:
        """The full-shape tensor with zeros in rows without values (inactive, or not in the sample)."""
        if self._sample is not None:
            out = np.zeros(self.shape, dtype=self.values.dtype)
            out[self.sent_rows()] = self.values
            return out
        if self.mask is None:
            return self.values.reshape(self.shape)
        out = np.zeros(self.shape, dtype=self.values.dtype)
        out[self.mask] = self.values
        return out

    def __repr__(self) -> str:
        extra = f", sent={self.n_sent}" if self.sampled else ""
        return f"TensorUpdate(shape={self.shape}, dtype={self.values.dtype}, active={self.n_active}{extra})"


def _put_mask(rec: dict, code: Any) -> None:
    rec[_MASK_FIELD[code.kind]] = code.data
    if code.kind in ("index16", "index32"):
        rec["w"] = 2 if code.kind == "index16" else 4


def pack_update(t: TensorUpdate) -> dict:
    """The update record. A sampled update adds ``h``: ``{"k": active rows, "p": one uint8 probability code
    per row of values, and the sample as a mask over the active rows in one of the mask fields}``."""
    rec: dict[str, Any] = {"s": list(t.shape), "x": t._coded or pack_array(t.values)}
    rows = np.shape(t.values)[0] if np.ndim(t.values) >= 1 else -1
    if t.sampled:
        sample = t.sample
        h: dict[str, Any] = {"k": t.n_active, "p": np.asarray(t.pcodes, np.uint8).tobytes()}
        ssup = codec.support(sample)
        agree = rows == ssup.k
        _put_mask(h, codec.encode_support(ssup, codec.MASK_KINDS if agree else ("bitmask", "index16", "index32")))
        rec["h"] = h
        rows = t.n_active  # the row mask codes the active rows; "k" says how many
    if t._index is not None:  # as indices: a mask is never built to be sent
        sup = codec.support_of_rows(t.shape[0], t._index)
    elif t._inactive is not None:
        sup = codec.Support(t.shape[0], np.asarray(t._inactive, np.int64), True)
    elif t._mask is not None:
        sup = codec.support(t._mask)
    else:
        return rec
    # Golomb and enum codes take k from the values (or, sampled, from "k"); values that disagree with the mask
    # (a bug, or a test of the receiver) go with a mask that says its own k, so the receiver sees and refuses them.
    agree = rows == sup.k
    _put_mask(rec, codec.encode_support(sup, codec.MASK_KINDS if agree else ("bitmask", "index16", "index32")))
    return rec


_UPDATE_FIELDS = frozenset({"s", "x", "m", "i", "w", "g", "e", "h"})
_MASK_FIELDS = frozenset({"m", "i", "g", "e"})


def _dense_update(obj: dict) -> TensorUpdate | None:
    """``{"s": shape, "x": array}`` with a plain float dtype whose shape is ``s`` (what the general path would
    accept from such a record, and build), or None for anything else, which the general path then handles
    (and refuses with its message)."""
    shape, x = obj.get("s"), obj.get("x")
    if type(x) is not dict or x.keys() != _ARRAY_FIELDS or x["s"] != shape or not _good_shape(shape, 1):
        return None
    code, buf = x["d"], x["b"]
    if type(code) is not str or code not in _FLOAT_CODES or type(buf) is not bytes:
        return None
    dt = _LE[code]
    if math.prod(shape) * dt.itemsize != len(buf):
        return None
    a = np.frombuffer(buf, dtype=dt).reshape(shape)
    t = TensorUpdate(tuple(shape), a if _NATIVE[code] else a.astype(DTYPES[code]))
    t.encoding = code
    return t


_FLOAT_CODES = frozenset(k for k, v in DTYPES.items() if np.dtype(v).kind == "f")


def unpack_update(obj: Any, what: str, *, finite: bool = True) -> TensorUpdate:
    """``finite=False`` leaves the finiteness of the values to the caller (the coordinator's admission does
    it in the same pass as the update's norm)."""
    t = _common_update(obj, finite)
    return t if t is not None else _unpack_update(obj, what, finite)


def _common_update(obj: Any, finite: bool) -> TensorUpdate | None:
    """The common report tensor (dense, plain dtype, every check of the general path inline), or None."""
    return _dense_update(obj) if not finite and type(obj) is dict and len(obj) == 2 else None


def _unpack_update(obj: Any, what: str, finite: bool) -> TensorUpdate:
    if not isinstance(obj, dict):
        raise WireError(f"{what}: not an update record")
    if not obj.keys() <= _UPDATE_FIELDS:
        _only(obj, _UPDATE_FIELDS, what)
    shape = obj.get("s")
    if not _good_shape(shape, 1):
        raise WireError(f"{what}: bad shape {_short(shape)}")
    shape = tuple(shape)
    values = unpack_array(obj.get("x"), f"{what}.values", finite=finite)
    if values.dtype.kind != "f":
        raise WireError(f"{what}: values must be floating point")
    rows = shape[0]
    if len(obj.keys() & _MASK_FIELDS) > 1:
        raise WireError(f"{what}: more than one mask")
    h = obj.get("h")
    k_active = None
    if h is not None:
        if not isinstance(h, dict):
            raise WireError(f"{what}: sample is not a map")
        k_active = h.get("k")
        if type(k_active) is not int or not 0 <= k_active <= rows:
            raise WireError(f"{what}: sample declares {_short(k_active)} active rows of {rows}")
    if "g" in obj or "e" in obj:
        t = _unpack_coded_mask(obj, shape, values, what, k_active)
    elif "m" in obj:
        bits = obj["m"]
        if not isinstance(bits, bytes) or len(bits) != (rows + 7) // 8:
            raise WireError(f"{what}: mask of {len(bits) if isinstance(bits, bytes) else '?'} bytes for {rows} rows")
        # 8 bytes of mask per byte received: proportional to what was sent
        mask = np.unpackbits(np.frombuffer(bits, np.uint8), count=rows).astype(bool)
        t = TensorUpdate(shape, values, mask)
    elif "i" in obj:
        w = obj.get("w")
        if type(w) is not int or w not in (2, 4) or not isinstance(obj["i"], bytes) or len(obj["i"]) % w:
            raise WireError(f"{what}: bad index list")
        idx = np.frombuffer(obj["i"], dtype="<u2" if w == 2 else "<u4").astype(np.int64)
        if len(idx) and (idx.max() >= rows or np.any(np.diff(idx) <= 0)):
            raise WireError(f"{what}: index list out of range or not increasing")
        # kept as indices: the mask is built only after the receiver has checked the declared shape
        t = TensorUpdate(shape, values, index=idx)
    else:
        t = TensorUpdate(shape, values)
    t.encoding = obj["x"]["d"]
    if h is not None:
        _unpack_sample(t, h, k_active, what)
    _check_values(t, what)
    return t


def _unpack_sample(t: TensorUpdate, h: dict, k_active: int, what: str) -> None:
    """The ``h`` field of a sampled update: which active rows carry values, and their inclusion probabilities.
    Work is bounded by what was received: the sample's rows are at most the values' rows."""
    _only(h, {"k", "p", "m", "i", "w", "g", "e"}, f"{what}.sample")
    if t.n_active != k_active:
        raise WireError(f"{what}: sample says {k_active} active rows, the mask {t.n_active}")
    if t.values.ndim < 1:
        raise WireError(f"{what}: sampled values need rows")
    k = t.values.shape[0]
    if k > k_active:
        raise WireError(f"{what}: {k} rows of values for {k_active} active rows")
    p = h.get("p")
    if not isinstance(p, bytes) or len(p) != k:
        raise WireError(f"{what}: {len(p) if isinstance(p, bytes) else '?'} probabilities for {k} rows")
    codes = np.frombuffer(p, np.uint8)
    if k and codes.min() == 0:
        raise WireError(f"{what}: a row sent with probability 0")
    fields = [f for f in ("m", "i", "g", "e") if f in h]
    if len(fields) != 1:
        raise WireError(f"{what}: the sample needs exactly one mask")
    f = fields[0]
    data = h[f]
    if not isinstance(data, bytes):
        raise WireError(f"{what}: sample mask is not bytes")
    kind = {"m": "bitmask", "g": "golomb", "e": "enum"}.get(f)
    if f == "i":
        w = h.get("w")
        if type(w) is not int or w not in (2, 4):
            raise WireError(f"{what}: bad sample index list")
        kind = "index16" if w == 2 else "index32"
    elif "w" in h:
        raise WireError(f"{what}: index width without an index list")
    try:
        sup = codec.decode_mask(kind, data, k_active, k)
    except WireError as e:
        raise WireError(f"{what}: sample: {e}") from None
    t._sample, t.pcodes = sup, codes.copy()


def _unpack_coded_mask(obj: dict, shape: tuple[int, ...], values: np.ndarray, what: str,
                       k_active: int | None = None) -> TensorUpdate:
    """A Golomb ("g") or enumerative ("e") mask of edge/protocol/codec.py. It codes k = the values' rows (a sampled
    update: its declared active rows), and its cost is bounded by k, so rows of no width (no value bytes for any k)
    cannot carry one."""
    key = "g" if "g" in obj else "e"
    data = obj[key]
    if not isinstance(data, bytes):
        raise WireError(f"{what}: mask is not bytes")
    if values.ndim != len(shape) or values.shape[1:] != shape[1:] or math.prod(shape[1:]) == 0:
        raise WireError(f"{what}: values have shape {values.shape}, the tensor {shape}")
    if values.shape[0] > shape[0]:
        raise WireError(f"{what}: {values.shape[0]} rows of values for {shape[0]} rows")
    # decode_mask keeps min(k, n - k) rows, at most 8 bytes' worth of bits or 64: a declared k costs nothing more
    k = values.shape[0] if k_active is None else k_active
    try:
        sup = codec.decode_mask("golomb" if key == "g" else "enum", data, shape[0], k)
    except WireError as e:
        raise WireError(f"{what}: {e}") from None
    if sup.inactive:
        return TensorUpdate(shape, values, inactive=sup.rows)
    return TensorUpdate(shape, values, index=sup.rows)



def _check_values(t: TensorUpdate, what: str) -> None:
    want = (t.n_sent, *t.shape[1:])
    if t.values.shape != want:
        raise WireError(f"{what}: values have shape {t.values.shape}, {'sample' if t.sampled else 'mask'} says {want}")


# ---------------------------------------------------------------- messages

@dataclass
class CheckIn:
    """A device announces itself and whether it may train now (sent on connect, after each plan it ends,
    and as a heartbeat while idle).

    ``last_task`` is the last plan the device received (trained, refused or failed; "" for none). It lets
    the coordinator tell a device that ended this round's plan without a report from a heartbeat that
    was already on its way when the plan went out.
    """

    device_id: str
    capabilities: dict[str, Any]
    programs: list[str] = field(default_factory=list)
    n_samples: int = 0
    last_task: str = ""
    kind = "checkin"


@dataclass
class Plan:
    """One device's work for one round: weights already sliced for it, hyperparameters, a seed."""

    task_id: str
    round: int
    device_id: str
    deadline: float
    strategy: str
    runtime: str
    program_hash: str
    weights: dict[str, np.ndarray]
    hparams: dict[str, Any]
    seed: int
    upload: dict[str, Any] = field(default_factory=dict)
    program: bytes | None = None
    # The downlink (edge/protocol/downlink.py): ``tag`` names the model this plan's weights make, which the
    # device keeps; with ``base`` (the tag of a model the device holds) the weights it shares in name and
    # shape with that model are differences from it. Both empty: every weight is absolute.
    tag: str = ""
    base: str = ""
    kind = "plan"


@dataclass
class Report:
    """A device's update: sample count, metrics, per tensor a group mask and only the active values."""

    task_id: str
    device_id: str
    n_samples: int
    metrics: dict[str, Any]
    tensors: dict[str, TensorUpdate]
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    kind = "report"

    @property
    def report_id(self) -> str:
        return f"{self.task_id}:{self.device_id}"


@dataclass
class Ack:
    """The coordinator's answer to a report, so the device can stop retrying."""

    task_id: str
    device_id: str
    status: str  # accepted | duplicate | late | rejected
    reason: str = ""
    kind = "ack"


@dataclass
class Status:
    """Presence (retained, with an 'offline' last will)."""

    device_id: str
    state: str  # online | offline | training | idle
    ts: float = 0.0
    kind = "status"


@dataclass
class Chunk:
    """One piece of a message too large for one publish; see :class:`Reassembler`."""

    msg_id: str
    index: int
    count: int
    total: int
    data: bytes
    kind = "chunk"


@dataclass
class Pace:
    """When the device should check in next: the coordinator's answer to a check-in it does not act on now.

    Pace steering (Bonawitz et al. 2019, section 2.3): the coordinator spreads the fleet's check-ins over a
    jittered window sized to the rate it wants, so 10,000 idle devices do not heartbeat as a herd.
    ``after_s`` is relative (devices' clocks are not trusted to agree) and at most :data:`MAX_PACE_S`.
    """

    device_id: str
    after_s: float
    kind = "pace"


MAX_PACE_S = 86400.0
ACK_STATUSES = {"accepted", "duplicate", "late", "rejected"}
STATUS_STATES = {"online", "offline", "training", "idle"}
Message = CheckIn | Plan | Report | Ack | Status | Chunk | Pace


def _enc_checkin(m: CheckIn) -> dict:
    out = {"device_id": m.device_id, "caps": m.capabilities, "programs": list(m.programs), "n": m.n_samples}
    if m.last_task:
        out["last"] = m.last_task
    return out


def _dec_checkin(d: dict, w: str) -> CheckIn:
    _only(d, {"v", "k", "device_id", "caps", "programs", "n", "last"}, w)
    progs = _need(d, "programs", list, w)
    if len(progs) > 1024 or not all(isinstance(p, str) and ID_RE.match(p) for p in progs):
        raise WireError(f"{w}: bad program list")
    n = _need(d, "n", int, w)
    if not 0 <= n < 2**63:
        raise WireError(f"{w}: sample count out of range")
    last = _id(d, "last", w) if "last" in d else ""
    return CheckIn(_id(d, "device_id", w), _scalars(d.get("caps"), f"{w}.caps"), progs, n, last)


def _enc_plan(m: Plan, pack: bool = True) -> dict:
    """``pack=False`` leaves the weights map unpacked (for :class:`PlanEncoder`, which packs it once)."""
    out = {
        "task_id": m.task_id, "round": m.round, "device_id": m.device_id, "deadline": float(m.deadline),
        "strategy": m.strategy, "runtime": m.runtime, "program_hash": m.program_hash,
        "weights": {k: _pack_any(v) for k, v in m.weights.items()} if pack else m.weights, "hparams": m.hparams,
        "seed": m.seed, "upload": m.upload, "program": m.program,
    }
    if m.tag:
        out["tag"] = m.tag
    if m.base:
        out["base"] = m.base
    return out


def _dec_plan(d: dict, w: str) -> Plan:
    _only(d, {"v", "k", "task_id", "round", "device_id", "deadline", "strategy", "runtime", "program_hash",
              "weights", "hparams", "seed", "upload", "program", "tag", "base"}, w)
    prog = d.get("program")
    if prog is not None and not isinstance(prog, bytes):
        raise WireError(f"{w}: program is not bytes")
    seed = _need(d, "seed", int, w)
    rnd = _need(d, "round", int, w)
    if not 0 <= seed < 2**63 or rnd < 0:
        raise WireError(f"{w}: seed or round out of range")
    return Plan(
        task_id=_id(d, "task_id", w), round=rnd, device_id=_id(d, "device_id", w),
        deadline=_num(d, "deadline", w), strategy=_need(d, "strategy", str, w),
        runtime=_need(d, "runtime", str, w), program_hash=_id(d, "program_hash", w),
        weights=_arrays(d.get("weights"), f"{w}.weights"), hparams=_scalars(d.get("hparams"), f"{w}.hparams"),
        seed=seed, upload=_scalars(d.get("upload"), f"{w}.upload"), program=prog,
        tag=_id(d, "tag", w) if "tag" in d else "", base=_id(d, "base", w) if "base" in d else "",
    )


def _enc_report(m: Report) -> dict:
    return {
        "task_id": m.task_id, "device_id": m.device_id, "n": m.n_samples, "metrics": m.metrics,
        "tensors": {k: pack_update(t) for k, t in m.tensors.items()},
        "extras": {k: pack_array(v) for k, v in m.extras.items()},
    }


def _dec_report(d: dict, w: str, finite: bool = True) -> Report:
    _only(d, {"v", "k", "task_id", "device_id", "n", "metrics", "tensors", "extras"}, w)
    n = _need(d, "n", int, w)
    if not 0 < n < 2**63:
        raise WireError(f"{w}: sample count must be positive")
    tens = d.get("tensors")
    if not isinstance(tens, dict) or len(tens) > MAX_TENSORS:
        raise WireError(f"{w}: tensors is not a map")
    tensors = {}
    for k, v in tens.items():
        if not isinstance(k, str) or not k or len(k) > MAX_STR:
            raise WireError(f"{w}: bad tensor name {_short(k)}")
        # the common tensor first, before a name for error messages is built (ingest decodes every report)
        t = _common_update(v, finite)
        tensors[k] = t if t is not None else _unpack_update(v, f"{w}.tensors[{_short(k)}]", finite)
    return Report(_id(d, "task_id", w), _id(d, "device_id", w), n, _scalars(d.get("metrics"), f"{w}.metrics"),
                  tensors, _arrays(d.get("extras", {}), f"{w}.extras"))


def _enc_ack(m: Ack) -> dict:
    return {"task_id": m.task_id, "device_id": m.device_id, "status": m.status, "reason": m.reason}


def _dec_ack(d: dict, w: str) -> Ack:
    _only(d, {"v", "k", "task_id", "device_id", "status", "reason"}, w)
    st = _need(d, "status", str, w)
    if st not in ACK_STATUSES:
        raise WireError(f"{w}: unknown ack status {_short(st)}")
    return Ack(_id(d, "task_id", w), _id(d, "device_id", w), st, _need(d, "reason", str, w))


def _enc_status(m: Status) -> dict:
    return {"device_id": m.device_id, "state": m.state, "ts": float(m.ts)}


def _dec_status(d: dict, w: str) -> Status:
    _only(d, {"v", "k", "device_id", "state", "ts"}, w)
    st = _need(d, "state", str, w)
    if st not in STATUS_STATES:
        raise WireError(f"{w}: unknown state {_short(st)}")
    return Status(_id(d, "device_id", w), st, _num(d, "ts", w))


def _enc_pace(m: Pace) -> dict:
    return {"device_id": m.device_id, "after": float(m.after_s)}


def _dec_pace(d: dict, w: str) -> Pace:
    _only(d, {"v", "k", "device_id", "after"}, w)
    after = _num(d, "after", w)
    if not 0.0 <= after <= MAX_PACE_S:
        raise WireError(f"{w}: after {after:g} s is outside 0..{MAX_PACE_S:g}")
    return Pace(_id(d, "device_id", w), after)


def _enc_chunk(m: Chunk) -> dict:
    return {"id": m.msg_id, "i": m.index, "n": m.count, "t": m.total, "b": m.data}


def _dec_chunk(d: dict, w: str) -> Chunk:
    _only(d, {"v", "k", "id", "i", "n", "t", "b"}, w)
    i, n, t = (_need(d, key, int, w) for key in ("i", "n", "t"))
    data = _need(d, "b", bytes, w)
    if not (0 <= i < n <= 1 << 20) or t < 0:
        raise WireError(f"{w}: chunk {i} of {n} is out of range")
    return Chunk(_id(d, "id", w), i, n, t, data)


_CODECS: dict[str, tuple[type, Callable, Callable]] = {
    "checkin": (CheckIn, _enc_checkin, _dec_checkin),
    "plan": (Plan, _enc_plan, _dec_plan),
    "report": (Report, _enc_report, _dec_report),
    "ack": (Ack, _enc_ack, _dec_ack),
    "status": (Status, _enc_status, _dec_status),
    "chunk": (Chunk, _enc_chunk, _dec_chunk),
    "pace": (Pace, _enc_pace, _dec_pace),
}


def encode(msg: Message) -> bytes:
    """Serialise a message; ``len()`` of the result is its exact wire size (before MQTT framing)."""
    body = _CODECS[msg.kind][1](msg)
    return msgpack.packb({"v": PROTOCOL_VERSION, "k": msg.kind, **body}, use_bin_type=True)


class PlanEncoder:
    """Encodes a round's plans with their shared parts packed once.

    A round's devices mostly get the same weights (FedAvg) or one of a few subnetworks, and the same program;
    packing those per device costs a copy of the model each (795 MB for 1,000 devices of a 200k-parameter
    model). Here a plan's msgpack is assembled from its few per-device fields and a cached encoding of its
    weights map and program, byte for byte what :func:`encode` writes. The cache is keyed by object identity
    and holds the objects, so an id is never reused while cached: use one encoder per round.
    """

    def __init__(self) -> None:
        self._packed: dict[Any, tuple[Any, bytes]] = {}  # key -> (the objects, so no id is reused; bytes)

    def _shared(self, key: Any, obj: Any, pack: Callable[[Any], Any]) -> bytes:
        hit = self._packed.get(key)
        if hit is None:
            hit = self._packed[key] = (obj, msgpack.packb(pack(obj), use_bin_type=True))
        return hit[1]

    def encode(self, m: Plan) -> bytes:
        body = {"v": PROTOCOL_VERSION, "k": m.kind, **_enc_plan(m, pack=False)}
        n = len(body)  # msgpack map header: fixmap, else map 16
        parts = [bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")]
        for k, v in body.items():
            parts.append(msgpack.packb(k, use_bin_type=True))
            if k == "weights":
                # keyed by the arrays, not the dict: plans often share arrays in dicts of their own
                key = tuple((n, id(a)) for n, a in v.items())
                parts.append(self._shared(key, v, lambda w: {n: _pack_any(a) for n, a in w.items()}))
            elif k == "program" and v is not None:
                parts.append(self._shared(id(v), v, lambda b: b))
            else:
                parts.append(msgpack.packb(v, use_bin_type=True))
        return b"".join(parts)


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, expect: tuple[str, ...] | None = None,
           finite_updates: bool = True) -> Message:
    """Parse and validate one message, or raise :class:`WireError` saying why it must be dropped.
    ``finite_updates=False``: a report's update values are not scanned for NaN and inf here, because the
    receiver does it in a pass it makes anyway (coordinator/admission.py); every other float still is."""
    return decode_map(unpack(data, max_bytes=max_bytes), expect=expect, finite_updates=finite_updates)


def unpack(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """The first half of :func:`decode`: the size limit and msgpack, nothing validated yet. A receiver with a
    fast path for one common message (coordinator: :func:`plain_report`) unpacks once and hands the result to
    that path, then to :func:`decode_map` if the fast path declines."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("payload is not bytes")
    if len(data) > max_bytes:
        raise TooLarge(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"malformed msgpack: {type(e).__name__}: {e}") from None


def decode_map(d: Any, *, expect: tuple[str, ...] | None = None, finite_updates: bool = True) -> Message:
    """The second half of :func:`decode`: validate what :func:`unpack` returned and build the message."""
    if not isinstance(d, dict):
        raise WireError("message is not a map")
    # Types before values: a field of the wrong type (a map where a string belongs) must not reach a
    # dict lookup or a comparison that raises something other than WireError.
    v = d.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise WireError(f"protocol version {_short(v)}, expected {PROTOCOL_VERSION}")
    kind = d.get("k")
    if not isinstance(kind, str) or kind not in _CODECS:
        raise WireError(f"unknown message kind {_short(kind)}")
    if expect is not None and kind not in expect:
        raise WireError(f"unexpected message kind {kind!r} (expected {', '.join(expect)})")
    try:
        if kind == "report" and not finite_updates:
            return _dec_report(d, kind, finite=False)  # the receiver checks update values itself
        return _CODECS[kind][2](d, kind)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - a decoder bug on hostile input is still a dropped message
        raise WireError(f"{kind}: {type(e).__name__}: {_short(str(e))}") from None


@dataclass
class PlainReport:
    """A report in its most common form, as :func:`plain_report` reads it: every tensor dense float32 values,
    flat, in the order the report sent them; no extras."""

    task_id: str
    device_id: str
    n_samples: int
    metrics: dict[str, int | float | str | bool]
    values: dict[str, np.ndarray]


_REPORT_FIELDS = frozenset({"v", "k", "task_id", "device_id", "n", "metrics", "tensors", "extras"})
_PLAIN_ENTRY = frozenset({"s", "x"})


def plain_report(d: Any, expected: Mapping[str, tuple[list[int], int]]) -> PlainReport | None:
    """The report :func:`unpack` returned, if it is plain for ``expected`` (name -> shape as a list, value
    bytes, as :func:`plain_shapes_ok` allows): exactly those tensors, each ``{"s": shape, "x": float32 array of
    that shape}``, no extras, and every check :func:`decode_map` makes passed. Else None, and the caller decodes
    the map the general way (which accepts more, and says why it refuses the rest). What it returns is what
    :func:`decode_map` builds from the same map (tests/test_plain_ingest.py checks the two on changed maps).
    One function and no object per tensor, because ingest reads every report."""
    if type(d) is not dict or not d.keys() <= _REPORT_FIELDS or not _F4_NATIVE:
        return None
    tens = d.get("tensors")
    if type(tens) is not dict or len(tens) > MAX_TENSORS or tens.keys() != expected.keys():
        return None
    extras = d.get("extras", _NO_EXTRAS)
    if type(extras) is not dict or extras:
        return None
    values = {}
    for k, rec in tens.items():
        shape, nbytes = expected[k]
        if type(rec) is not dict or rec.keys() != _PLAIN_ENTRY:
            return None
        s, x = rec["s"], rec["x"]
        if type(s) is not list or s != shape or type(x) is not dict or x.keys() != _ARRAY_FIELDS:
            return None
        for dim in s:  # == lets True pass for 1 and 4.0 for 4; the general path refuses both
            if type(dim) is not int:
                return None
        b = x["b"]
        if x["d"] != "f4" or x["s"] != s or type(b) is not bytes or len(b) != nbytes:
            return None
        values[k] = np.frombuffer(b, np.float32)
    return _plain_fields(d, values)


def _plain_fields(d: dict, values: dict[str, np.ndarray]) -> PlainReport | None:
    """The report's fields other than its tensors and extras, checked as :func:`decode_map` checks them."""
    if type(d.get("v")) is not int or d["v"] != PROTOCOL_VERSION or d.get("k") != "report":
        return None
    task, dev, n = d.get("task_id"), d.get("device_id"), d.get("n")
    if type(task) is not str or type(dev) is not str or not ID_RE.match(task) or not ID_RE.match(dev):
        return None
    if type(n) is not int or not 0 < n < 2**63:
        return None
    try:
        metrics = _scalars(d.get("metrics"), "report.metrics")
    except WireError:
        return None
    return PlainReport(task, dev, n, metrics, values)


class PlainLayout:
    """Reads a plain report where it lies in the message, with no copy of its values.

    msgpack copies every value buffer out of the message: for a dense model that is a pass over the whole
    report, a third of what ingest does with it after (benchmarks/fedavg_mqtt.py --mode ingest). The bytes
    :func:`encode` writes for a plain report end in the same way for every device of a plan: ``"tensors"``,
    each expected tensor's record in order with its values last, then ``"extras": {}``. Only the values
    differ. :meth:`read` compares those bytes with the expected ones, decodes the few fields before them
    (ids, count, metrics) with msgpack, and views each tensor's values in the message itself (read-only,
    float32, possibly unaligned). Anything else (another encoder's key order, another integer width, a
    missing ``extras``) returns None, and the caller unpacks the message and tries :func:`plain_report`.

    Why it reads exactly what :func:`decode_map` reads: msgpack is a prefix code, so if the head (the bytes
    between the map's header and the expected tail) decodes as exactly its count of pairs less two, with no
    ``tensors`` or ``extras`` among them, the whole message decodes as those pairs plus the two the tail
    spells, byte for byte what msgpack packs for the expected records.
    """

    def __init__(self, expected: Mapping[str, tuple[list[int], int]]):
        packer = msgpack.Packer(use_bin_type=True)
        self.head = msgpack.packb("tensors") + packer.pack_map_header(len(expected))
        # name, the record's bytes before its values, value bytes (None: this encoder's records cannot be read so)
        self.records: list[tuple[str, bytes, int]] | None = []
        for k, (shape, nbytes) in expected.items():
            rec = msgpack.packb(pack_update(TensorUpdate(shape, np.zeros(shape, np.float32))), use_bin_type=True)
            cut = len(rec) - nbytes
            if rec[cut:] != bytes(nbytes):  # the values are not last: no layout (read always declines)
                self.records = None
                break
            self.records.append((k, msgpack.packb(k) + rec[:cut], nbytes))
        self.tail = msgpack.packb("extras") + msgpack.packb({})
        self.size = len(self.head) + len(self.tail) + sum(len(p) + n for _, p, n in self.records or ())

    def read(self, data: Any) -> PlainReport | None:
        """The report in ``data`` (a message as received) if it is laid out as expected, else None."""
        if type(data) is not bytes or self.records is None or not _F4_NATIVE:
            return None
        start = len(data) - self.size
        # a fixmap of the head's pairs and these two (a report has at most eight fields)
        if start < 1 or not 0x82 <= data[0] <= 0x8f or not data.startswith(self.head, start):
            return None
        pos = start + len(self.head)
        where = []
        for k, prefix, nbytes in self.records:
            if not data.startswith(prefix, pos):
                return None
            pos += len(prefix)
            where.append((k, pos, nbytes >> 2))
            pos += nbytes
        if not data.startswith(self.tail, pos):
            return None
        try:
            d = msgpack.unpackb(bytes((data[0] - 2,)) + data[1:start], raw=False, strict_map_key=True,
                                use_list=True)
        except Exception:  # noqa: BLE001 - the general path unpacks it again and says what is wrong
            return None
        if type(d) is not dict or not d.keys() <= _HEAD_FIELDS:
            return None
        return _plain_fields(d, {k: np.frombuffer(data, np.float32, n, at) for k, at, n in where})


_NO_EXTRAS: dict = {}
_HEAD_FIELDS = _REPORT_FIELDS - {"tensors", "extras"}
_F4_NATIVE = _NATIVE["f4"]


def plain_shapes_ok(shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether :func:`plain_report` may be given these tensors: names and shapes the general decoder accepts in
    a report (it would refuse, say, a tensor of no dimensions, and the fast path must never accept more)."""
    return len(shapes) <= MAX_TENSORS and all(
        type(k) is str and 0 < len(k) <= MAX_STR and _good_shape(list(s), 1) for k, s in shapes.items())


def _short(v: Any, n: int = 60) -> str:
    """A value for a log line: repr, cut (hostile input can be megabytes)."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


# ---------------------------------------------------------------- chunking

def split(payload: bytes, msg_id: str, chunk_bytes: int) -> list[bytes]:
    """The payload itself if it fits, else encoded :class:`Chunk` messages of at most ``chunk_bytes`` data."""
    if len(payload) <= chunk_bytes:
        return [payload]
    n = -(-len(payload) // chunk_bytes)
    return [encode(Chunk(msg_id, i, n, len(payload), payload[i * chunk_bytes:(i + 1) * chunk_bytes])) for i in range(n)]


MIN_CHUNK_BYTES = 256  # a chunk smaller than this (but the last) is refused: bounds the parts per transfer


class Reassembler:
    """Collects chunks per (sender, msg id) and yields whole payloads; drops transfers that stall.

    Pure: the caller passes the current time, so tests need no clock. Memory is bounded three ways, so
    that what a sender can make the receiver hold is proportional to what it may send: ``limit`` per
    transfer (the caller passes what this sender's plan allows; default ``max_bytes``),
    ``max_open_per_sender`` transfers per sender, and ``max_total_bytes`` held over all open transfers.
    Capacity follows the bytes that arrived, not the size a first chunk announces: a transfer that announces
    a large message and then trickles holds only what it sent, so a few slow senders cannot keep honest
    uploads out. ``replace``: a sender at its limit that starts another transfer drops its oldest (a device
    sends one report at a time; a resend keeps its id) instead of being refused. ``min_rate`` (bytes/s, 0: off):
    a transfer older than ``rate_grace_s`` whose bytes fall below that average rate is *slow*
    (:meth:`slow` drops it and names it, so the caller can count it against its sender).
    """

    def __init__(self, *, timeout_s: float = 60.0, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_open: int = 1024,
                 max_open_per_sender: int = 2, max_total_bytes: int = 1 << 30, replace: bool = False,
                 min_rate: float = 0.0, rate_grace_s: float = 10.0):
        self.timeout_s, self.max_bytes, self.max_open = timeout_s, max_bytes, max_open
        self.max_open_per_sender, self.max_total_bytes = max_open_per_sender, max_total_bytes
        self.replace, self.min_rate, self.rate_grace_s = replace, min_rate, rate_grace_s
        self._open: dict[tuple[str, str], dict] = {}
        self._per_sender: dict[str, int] = {}
        self.reserved = 0  # bytes held by all open transfers
        self.last_wire_bytes = 0
        self._done: dict[tuple[str, str], float] = {}  # recently completed (sender, msg id) -> when

    def _start(self, key: tuple[str, str], chunk: Chunk, now: float, limit: int) -> dict:
        sender = key[0]
        if chunk.total > limit:
            raise TooLarge(f"chunked message of {chunk.total} bytes exceeds this sender's limit of {limit}")
        if chunk.total <= 0 or chunk.count > max(1, -(-chunk.total // MIN_CHUNK_BYTES)):
            raise WireError(f"chunked message of {chunk.total} bytes in {chunk.count} chunks")
        if self._per_sender.get(sender, 0) >= self.max_open_per_sender:
            if not self.replace:
                raise Busy(f"too many incomplete chunked transfers from {sender}")
            self._end(min((k for k in self._open if k[0] == sender), key=lambda k: self._open[k]["start"]))
        if len(self._open) >= self.max_open:
            raise Busy("too many incomplete chunked transfers")
        self._per_sender[sender] = self._per_sender.get(sender, 0) + 1
        st = self._open[key] = {"n": chunk.count, "t": chunk.total, "parts": {}, "size": 0, "last": now, "wire": 0,
                                "start": now}
        return st

    def _end(self, key: tuple[str, str]) -> dict:
        st = self._open.pop(key)
        self.reserved -= st["size"]
        left = self._per_sender[key[0]] - 1
        if left:
            self._per_sender[key[0]] = left
        else:
            del self._per_sender[key[0]]
        return st

    def feed(self, sender: str, chunk: Chunk, now: float, *, limit: int | None = None, nbytes: int = 0) -> bytes | None:
        """The whole payload once its last chunk arrives (else None). ``nbytes``: the size of the message that
        carried this chunk; a completed transfer leaves the sum over its distinct chunks in
        ``last_wire_bytes`` (what its first complete delivery cost, resent chunks not counted)."""
        if not 0 <= chunk.index < chunk.count:
            raise WireError(f"chunk {chunk.index} of {chunk.count} is out of range")
        key = (sender, chunk.msg_id)
        if key in self._done and now - self._done[key] <= self.timeout_s:
            return None  # the tail of a resend of a message already whole: nothing to reassemble again
        st = self._open.get(key)
        if st is None:
            st = self._start(key, chunk, now, self.max_bytes if limit is None else min(limit, self.max_bytes))
        if chunk.count != st["n"] or chunk.total != st["t"]:
            self._end(key)
            raise WireError(f"chunk {chunk.index} of {chunk.msg_id} disagrees with earlier chunks")
        if chunk.index not in st["parts"]:
            if not chunk.data or (len(chunk.data) < MIN_CHUNK_BYTES and chunk.index != chunk.count - 1):
                self._end(key)
                raise WireError(f"chunk {chunk.index} of {chunk.msg_id} is too small")
            if st["size"] + len(chunk.data) > st["t"]:
                self._end(key)
                raise WireError(f"chunks of {chunk.msg_id} exceed the announced size")
            if self.reserved + len(chunk.data) > self.max_total_bytes:
                self._end(key)
                raise Busy("incomplete chunked transfers hold all the reassembly capacity")
            st["parts"][chunk.index] = chunk.data
            st["size"] += len(chunk.data)
            self.reserved += len(chunk.data)
            st["wire"] += nbytes
        st["last"] = now
        if len(st["parts"]) < st["n"]:
            return None
        self._end(key)
        self._done[key] = now
        while len(self._done) > 4096:  # bounded: the oldest are forgotten first
            del self._done[next(iter(self._done))]
        self.last_wire_bytes = st["wire"]
        payload = b"".join(st["parts"][i] for i in range(st["n"]))
        if len(payload) != st["t"]:
            raise WireError(f"reassembled {len(payload)} bytes, announced {st['t']}")
        return payload

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Forget transfers idle for longer than the timeout; returns their (sender, msg id)."""
        dead = [k for k, st in self._open.items() if now - st["last"] > self.timeout_s]
        for k in dead:
            self._end(k)
        return dead

    def slow(self, now: float) -> list[tuple[str, str]]:
        """Drop transfers that trickle (below ``min_rate`` on average, once older than ``rate_grace_s``); returns
        their (sender, msg id). Capacity follows bytes, so a trickle holds little, but it holds its sender's slot
        and the receiver's attention for as long as it lasts: the caller counts it against the sender."""
        if self.min_rate <= 0:
            return []
        slow = [k for k, st in self._open.items()
                if now - st["start"] > self.rate_grace_s and st["size"] < self.min_rate * (now - st["start"])]
        for k in slow:
            self._end(k)
        return slow

    def drop_sender(self, sender: str) -> None:
        """Forget every open transfer of ``sender`` (it went offline, or its plan ended otherwise)."""
        for k in [k for k in self._open if k[0] == sender]:
            self._end(k)

    @property
    def open_transfers(self) -> int:
        return len(self._open)


def topic(fleet: str, kind: str, ident: str) -> str:
    """``fedge/v1/<fleet>/<kind>/<id>``: the whole topic tree (device -> coordinator: checkin report status;
    coordinator -> device: plan ack pace)."""
    return f"fedge/v1/{fleet}/{kind}/{ident}"


def parse_topic(t: str) -> tuple[str, str, str]:
    """(fleet, kind, id) of a fedge topic, or WireError."""
    parts = t.split("/")
    if len(parts) != 5 or parts[:2] != ["fedge", "v1"]:
        raise WireError(f"not a fedge topic: {_short(t)}")
    return parts[2], parts[3], parts[4]
