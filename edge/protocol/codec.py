"""Update codecs at the information limit: row masks (k of n) and value arrays, numpy only.

Why: a report is a row mask plus the active rows' values. Naming k rows out of n needs log2 C(n, k)
bits; a bitmask spends n and an index list 16 or 32 per row. Golomb-coded gaps come within about 1% of
the bound for random supports, and an enumerative rank is exactly ceil(log2 C(n, k)) bits where k is
small, so the encoder tries every format and keeps the smallest. Values can go at 32, 16 or 8 bits;
int8 uses stochastic rounding so that the server's average stays unbiased.

The byte layouts are specified in docs/protocol.md, which is normative: section 5 (the mask formats:
bitmask, index16/index32, Golomb-coded gaps with the integer estimate of M, enumerative rank) and section 6
(the value formats f4, f2, bf16, q8, q8r, and how each encoder rounds). This module implements them; where
the two disagree, one is a bug. The conformance vectors (firmware_tests/protocol, edge/protocol/vectors.py)
pin each format, and tests/test_protocol_vectors.py reads them with a decoder written from the spec's text.
Nothing here touches the network: the container (``edge/protocol/wire.py``) carries the kind and the sizes.

Not here: arithmetic coding of a mask against per-row keep probabilities. A range coder is sequential
(in numpy, a Python step per row: about a second per 10^6 rows, where the Golomb code runs at 50-2000
MB/s); the probabilities the server knows (the plan's gates) are not the ones a device draws from after
training; and what it saves below log2 C(n, k) is what those probabilities know about the mask, a few
bytes for a group mask of a few hundred rows next to its values. A mask drawn from known probabilities
and a seed is cheaper still sent as the seed.

Terms used below, as in the spec: ``n`` rows (a tensor's ``shape[0]``), ``k`` active rows, ``K = min(k, n - k)``
and the *minority rows* (the active rows if ``k <= n - k``, else the inactive ones), which the golomb and
enum formats carry.
"""
from __future__ import annotations

import logging
import math
from typing import Iterable, NamedTuple

import numpy as np

from .errors import MAX_ELEMENTS, WireError

log = logging.getLogger(__name__)

MAX_ROWS = 2**31 - 1
ENUM_MAX_K = 64
MASK_KINDS = ("bitmask", "index16", "index32", "golomb", "enum")
VALUE_KINDS = ("f4", "f2", "bf16", "q8", "q8r")
_LN2_Q31 = 1488522236  # round(ln 2 * 2**31)
_MAX_GAMMA_ZEROS = 40
_F16_MAX = 65504.0


class CodecError(WireError):
    """Bytes that do not decode under the stated format (a WireError: the message is dropped)."""


# ---------------------------------------------------------------- supports

class Support(NamedTuple):
    """A k-of-n row support: ``rows`` are the active rows, or the inactive ones when ``inactive``.

    Decoding yields this instead of a dense mask so that nothing proportional to a declared ``n`` is
    allocated before the receiver has checked ``n``.
    """

    n: int
    rows: np.ndarray  # int64, strictly increasing
    inactive: bool

    @property
    def k(self) -> int:
        return self.n - len(self.rows) if self.inactive else len(self.rows)

    def mask(self) -> np.ndarray:
        m = np.full(self.n, self.inactive, dtype=bool)
        m[self.rows] = not self.inactive
        return m

    def active(self) -> np.ndarray:
        """The active rows (allocates O(n) when the support is stored by its inactive rows)."""
        if not self.inactive:
            return self.rows
        keep = np.ones(self.n, dtype=bool)
        keep[self.rows] = False
        return np.flatnonzero(keep)


def support(mask: np.ndarray) -> Support:
    """The support of a boolean row mask, by its minority."""
    m = np.asarray(mask, dtype=bool)
    if m.ndim != 1:
        raise ValueError(f"a row mask is one-dimensional, got shape {m.shape}")
    k = int(np.count_nonzero(m))
    if k <= m.size - k:
        return Support(m.size, np.flatnonzero(m), False)
    return Support(m.size, np.flatnonzero(~m), True)


def support_of_rows(n: int, rows: np.ndarray) -> Support:
    """The support given the active rows (strictly increasing), by its minority."""
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) and (rows[0] < 0 or rows[-1] >= n or np.any(np.diff(rows) <= 0)):
        raise ValueError("active rows must be strictly increasing and within 0..n-1")
    if len(rows) <= n - len(rows):
        return Support(n, rows, False)
    return Support(n, Support(n, rows, True).active(), True)  # the complement of rows


def log2_binom(n: int, k: int) -> float:
    """log2 C(n, k): the bits any code needs, on average, for a uniformly random k-of-n support."""
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


# ---------------------------------------------------------------- bit helpers

def _gamma_bits(v: int) -> list[int]:
    nb = v.bit_length()
    return [0] * (nb - 1) + [(v >> (nb - 1 - j)) & 1 for j in range(nb)]


def _zigzag(d: int) -> int:
    return 2 * d if d >= 0 else -2 * d - 1


def _unzigzag(z: int) -> int:
    return z // 2 if z % 2 == 0 else -(z + 1) // 2


def _gaps(rows: np.ndarray) -> np.ndarray:
    if not len(rows):
        return np.zeros(0, np.int64)
    g = np.diff(rows, prepend=-1) - 1
    return g.astype(np.int64, copy=False)


def _bytes_of_bits(bits: np.ndarray) -> bytes:
    return np.packbits(bits).tobytes()


def _bits_of(data: bytes) -> np.ndarray:
    return np.unpackbits(np.frombuffer(data, np.uint8))


def _check_padding(bits: np.ndarray, end: int, nbytes: int, what: str) -> None:
    if (end + 7) // 8 != nbytes or bits[end:].any():
        raise CodecError(f"{what}: {nbytes} bytes for {end} bits of code, or nonzero padding")


# ---------------------------------------------------------------- golomb

def golomb_estimate(n: int, K: int) -> int:
    """M0 = round(n ln2 / K) in integer arithmetic (both ends must agree to the bit)."""
    if K <= 0:
        return 1
    return max(1, (n * _LN2_Q31 + K * 2**30) // (K * 2**31))


def _golomb_body_bits(gaps: np.ndarray, M: int) -> int:
    K = len(gaps)
    if M == 1:
        return int(gaps.sum()) + K
    b = (M - 1).bit_length()
    u = (1 << b) - M
    q, r = np.divmod(gaps, M)
    return int(q.sum()) + K + K * (b - 1) + int(np.count_nonzero(r >= u))


def _golomb_choose(n: int, gaps: np.ndarray) -> tuple[int, int]:
    """(M, total bits): the exact cost of each candidate around the estimates, the cheapest kept."""
    K = len(gaps)
    m0 = golomb_estimate(n, K)
    p = K / n
    gvv = 1 if p >= 0.5 else math.ceil(math.log(2 - p) / -math.log1p(-p))  # Gallager and Van Voorhis
    cands = {m for m in (m0, gvv - 1, gvv, gvv + 1) if 1 <= m <= max(1, n)}
    best = None
    for M in sorted(cands):
        bits = len(_gamma_bits(_zigzag(M - m0) + 1)) + _golomb_body_bits(gaps, M)
        if best is None or bits < best[1]:
            best = (M, bits)
    return best


def golomb_encode(s: Support, M: int | None = None) -> bytes:
    """Golomb-coded gaps of the minority rows (format ``golomb``); ``M`` defaults to the cheapest."""
    K = len(s.rows)
    if K == 0:
        return b""
    gaps = _gaps(s.rows)
    if M is None:
        M, _ = _golomb_choose(s.n, gaps)
    if not 1 <= M <= max(1, s.n):
        raise ValueError(f"Golomb parameter {M} outside 1..{s.n}")
    parts = [np.array(_gamma_bits(_zigzag(M - golomb_estimate(s.n, K)) + 1), np.uint8)]
    if M == 1:  # section C alone: a zero at each row, ones between (the inverted mask up to the last row)
        unary = np.ones(int(s.rows[-1]) + 1, np.uint8)
        unary[s.rows] = 0
        return _bytes_of_bits(np.concatenate([parts[0], unary]))
    q, r = np.divmod(gaps, M)
    b = (M - 1).bit_length()
    if b >= 1:
        u = (1 << b) - M
        long = r >= u
        h = np.where(long, (r + u) >> 1, r)
        if b >= 2:
            sec = np.empty((K, b - 1), np.uint8)
            for j in range(b - 1):  # <= 30 passes over K: no K x width int64 temporary
                np.bitwise_and(h >> (b - 2 - j), 1, out=sec[:, j], casting="unsafe")
            parts.append(sec.ravel())
        parts.append(((r[long] + u) & 1).astype(np.uint8))
    unary = np.ones(int(q.sum()) + K, np.uint8)
    q += 1
    np.cumsum(q, out=q)
    q -= 1
    unary[q] = 0  # the terminators, at sum(q_j + 1) - 1
    parts.append(unary)
    return _bytes_of_bits(np.concatenate(parts))


def golomb_decode(data: bytes, n: int, K: int) -> np.ndarray:
    """The K minority rows of a ``golomb`` stream; CodecError on anything malformed."""
    what = "golomb mask"
    if K == 0:
        if data:
            raise CodecError(f"{what}: {len(data)} bytes for an empty support")
        return np.zeros(0, np.int64)
    nbits = 8 * len(data)
    if K > nbits:  # every row costs at least its terminating zero bit
        raise CodecError(f"{what}: {K} rows cannot fit in {len(data)} bytes")
    bits = _bits_of(data)
    # the parameter: Elias gamma, at most _MAX_GAMMA_ZEROS leading zeros
    head = bits[:_MAX_GAMMA_ZEROS + 1]
    ones = np.flatnonzero(head)
    if not len(ones):
        raise CodecError(f"{what}: bad parameter code")
    lz = int(ones[0])
    if 2 * lz + 1 > nbits:
        raise CodecError(f"{what}: truncated parameter code")
    v = int("".join(map(str, bits[lz:2 * lz + 1])), 2)
    M = golomb_estimate(n, K) + _unzigzag(v - 1)
    if not 1 <= M <= max(1, n):
        raise CodecError(f"{what}: parameter {M} outside 1..{n}")
    pos = 2 * lz + 1
    b = (M - 1).bit_length()
    u = (1 << b) - M
    width = max(0, b - 1)
    if pos + K * width + K > nbits:
        raise CodecError(f"{what}: {K} rows cannot fit in {len(data)} bytes")
    h = np.zeros(K, np.int64)
    if width:
        sec = bits[pos:pos + K * width].reshape(K, width)
        for j in range(width):  # <= 30 passes over K: no K x width temporary
            h <<= 1
            h |= sec[:, j]
        pos += K * width
    if b >= 1:
        long = h >= u
        e = int(np.count_nonzero(long))
        if pos + e + K > nbits:
            raise CodecError(f"{what}: truncated remainders")
        r = h.copy()
        r[long] = 2 * h[long] + bits[pos:pos + e] - u
        pos += e
    else:
        r = h
    tail = bits[pos:]
    zeros = len(tail) - int(np.count_nonzero(tail))
    if not K <= zeros <= K + 7:  # K terminators and at most 7 padding bits
        raise CodecError(f"{what}: {zeros} zero bits where {K} terminators are due")
    z = np.flatnonzero(tail == 0)[:K]
    end = pos + int(z[-1]) + 1
    _check_padding(bits, end, len(data), what)
    if M == 1:  # the zeros of section C are the rows themselves
        if int(z[-1]) > n - 1:
            raise CodecError(f"{what}: rows run past {n}")
        return z
    q = np.diff(z, prepend=-1)
    q -= 1
    last = M * int(q.sum()) + int(r.sum()) + K - 1  # the last row, in Python integers: no overflow
    if last > n - 1:
        raise CodecError(f"{what}: rows run past {n}")
    q *= M
    q += r
    q += 1
    np.cumsum(q, out=q)
    q -= 1
    return q


# ---------------------------------------------------------------- enumerative

def enum_encode(s: Support) -> bytes:
    """The combinatorial rank of the minority rows (format ``enum``, K <= 64)."""
    K = len(s.rows)
    if K > ENUM_MAX_K:
        raise ValueError(f"enum codes at most {ENUM_MAX_K} rows, not {K}")
    rank = sum(math.comb(int(c), j + 1) for j, c in enumerate(s.rows))
    return rank.to_bytes(((math.comb(s.n, K) - 1).bit_length() + 7) // 8, "big")


def enum_decode(data: bytes, n: int, K: int) -> np.ndarray:
    what = "enum mask"
    if K > ENUM_MAX_K:
        raise CodecError(f"{what}: {K} rows, at most {ENUM_MAX_K}")
    total = math.comb(n, K)
    if len(data) != ((total - 1).bit_length() + 7) // 8:
        raise CodecError(f"{what}: {len(data)} bytes for C({n}, {K})")
    rank = int.from_bytes(data, "big")
    if rank >= total:
        raise CodecError(f"{what}: rank out of range")
    rows = np.zeros(K, np.int64)
    hi = n - 1
    for j in range(K, 0, -1):  # K <= 64 searches: bounded work whatever the input
        c = _largest_comb_at_most(rank, j, hi)
        rows[j - 1] = c
        rank -= math.comb(c, j)
        hi = c - 1
    return rows


def _largest_comb_at_most(rank: int, j: int, hi: int) -> int:
    """The largest c in [j - 1, hi] with C(c, j) <= rank: a float estimate, then exact steps.

    C(c, j) ~ (c - (j - 1) / 2)**j / j!, so c ~ (rank j!)**(1/j) + (j - 1) / 2; the estimate is off by
    a few at most, and stepping uses C(c + 1, j) = C(c, j) (c + 1) / (c + 1 - j) exactly.
    """
    lo = j - 1
    if rank <= 0 or hi <= lo:
        return lo
    shift = max(0, rank.bit_length() - 60)  # log of a big integer without converting it to a float
    logr = math.log(rank >> shift) + shift * math.log(2)
    est = math.exp((logr + math.lgamma(j + 1)) / j) + (j - 1) / 2
    c = min(hi, max(lo, int(est)))
    v = math.comb(c, j)
    for _ in range(16):
        if v > rank:
            v, c = v * (c - j) // c, c - 1
        elif c < hi and (up := (v * (c + 1) // (c + 1 - j) if v else 1)) <= rank:
            v, c = up, c + 1
        else:
            return c
    lo_, hi_ = lo, hi  # estimate far off (never seen): plain binary search
    while lo_ < hi_:
        mid = (lo_ + hi_ + 1) // 2
        if math.comb(mid, j) <= rank:
            lo_ = mid
        else:
            hi_ = mid - 1
    return lo_


# ---------------------------------------------------------------- masks: choose, encode, decode

class MaskCode(NamedTuple):
    kind: str
    data: bytes


def mask_bits(s: Support, kinds: Iterable[str] = MASK_KINDS) -> dict[str, int]:
    """Bits of each applicable format before byte padding, computed without encoding."""
    return _mask_bits(_minority(s), kinds)[0]


def _mask_bits(s: Support, kinds: Iterable[str]) -> tuple[dict[str, int], int | None]:
    """(bits per format, the Golomb parameter that gives its bits) for a support stored by its minority."""
    out, M = {}, None
    K = len(s.rows)
    for kind in kinds:
        if kind == "bitmask":
            out[kind] = s.n
        elif kind == "index16" and s.n <= 65536:
            out[kind] = 16 * s.k
        elif kind == "index32":
            out[kind] = 32 * s.k
        elif kind == "golomb":
            M, out[kind] = (None, 0) if K == 0 else _golomb_choose(s.n, _gaps(s.rows))
        elif kind == "enum" and K <= ENUM_MAX_K:
            out[kind] = (math.comb(s.n, K) - 1).bit_length()
    return out, M


def mask_sizes(s: Support, kinds: Iterable[str] = MASK_KINDS) -> dict[str, int]:
    """Payload bytes of each applicable format, computed without encoding."""
    return {kind: (bits + 7) // 8 for kind, bits in mask_bits(s, kinds).items()}


def _minority(s: Support) -> Support:
    """The same support stored by its smaller set (ties: the active rows), as golomb and enum need."""
    K = len(s.rows)
    if K < s.n - K or (K == s.n - K and not s.inactive):
        return s
    return Support(s.n, s.active() if s.inactive else Support(s.n, s.rows, True).active(), not s.inactive)


def encode_mask_as(s: Support, kind: str) -> bytes:
    """``s`` in format ``kind`` (ValueError if that format cannot code it)."""
    if kind in ("golomb", "enum"):
        s = _minority(s)
    if kind == "bitmask":
        return np.packbits(s.mask()).tobytes()
    if kind in ("index16", "index32"):
        if kind == "index16" and s.n > 65536:
            raise ValueError("index16 needs n <= 65536")
        return s.active().astype("<u2" if kind == "index16" else "<u4").tobytes()
    if kind == "golomb":
        return golomb_encode(s)
    if kind == "enum":
        return enum_encode(s)
    raise ValueError(f"unknown mask kind {kind!r}")


def encode_support(s: Support, kinds: Iterable[str] = MASK_KINDS) -> MaskCode:
    """The smallest encoding of a support among ``kinds``; ties go to fewer code bits, then to the earlier
    kind in MASK_KINDS."""
    if not 0 <= s.n <= MAX_ROWS:
        raise ValueError(f"{s.n} rows: at most {MAX_ROWS}")
    s = _minority(s)
    bits, M = _mask_bits(s, kinds)
    if not bits:
        raise ValueError(f"none of {list(kinds)} can code {s.k} of {s.n} rows")
    sizes = {c: (b + 7) // 8 for c, b in bits.items()}
    kind = min(sizes, key=lambda c: (sizes[c], bits[c], MASK_KINDS.index(c)))
    data = golomb_encode(s, M) if kind == "golomb" else encode_mask_as(s, kind)
    assert len(data) == sizes[kind], (kind, len(data), sizes[kind])
    log.debug("mask %d of %d rows: %s, %d bytes (%s)", s.k, s.n, kind, len(data), sizes)
    return MaskCode(kind, data)


def encode_mask(mask: np.ndarray, kinds: Iterable[str] = MASK_KINDS) -> MaskCode:
    """The smallest encoding of a boolean row mask."""
    return encode_support(support(mask), kinds)


def decode_mask(kind: str, data: bytes, n: int, k: int) -> Support:
    """Decode ``data`` as a ``kind`` mask of ``k`` active rows out of ``n``; CodecError if malformed.

    Work and memory are O(len(data) + K), K = min(k, n - k), whatever ``n`` says: a 2**31-row support
    arrives as its few minority rows and stays that way. K itself is at most 8 len(data) for golomb and
    64 for enum; a container should also bound k by what it received (fedge's wire: k rows of values).
    """
    if not isinstance(data, (bytes, bytearray)):
        raise CodecError(f"{kind} mask: not bytes")
    if type(n) is not int or type(k) is not int or not 0 <= n <= MAX_ROWS or not 0 <= k <= n:
        raise CodecError(f"{kind} mask: {k!r} of {n!r} rows")
    data = bytes(data)
    K = min(k, n - k)
    inactive = k > n - k
    if kind == "golomb":
        return Support(n, golomb_decode(data, n, K), inactive)
    if kind == "enum":
        return Support(n, enum_decode(data, n, K), inactive)
    if kind == "bitmask":
        if len(data) != (n + 7) // 8:
            raise CodecError(f"bitmask: {len(data)} bytes for {n} rows")
        bits = _bits_of(data)
        _check_padding(bits, n, len(data), "bitmask")
        m = bits[:n].astype(bool)
        if int(np.count_nonzero(m)) != k:
            raise CodecError(f"bitmask: {int(np.count_nonzero(m))} rows set, {k} expected")
        return support(m)
    if kind in ("index16", "index32"):
        w = 2 if kind == "index16" else 4
        if len(data) != w * k:
            raise CodecError(f"{kind}: {len(data)} bytes for {k} rows")
        rows = np.frombuffer(data, "<u2" if w == 2 else "<u4").astype(np.int64)
        if k and (rows[-1] >= n or np.any(np.diff(rows) <= 0)):
            raise CodecError(f"{kind}: rows out of range or not increasing")
        return Support(n, rows, False)  # as sent: the complement would cost O(n)
    raise CodecError(f"unknown mask kind {str(kind)[:40]!r}")


# ---------------------------------------------------------------- values

def value_nbytes(kind: str, shape: tuple[int, ...]) -> int:
    """Bytes of a ``kind`` value array of ``shape`` (the decoder's expected length)."""
    count = math.prod(shape)
    if kind in ("f4",):
        return 4 * count
    if kind in ("f2", "bf16"):
        return 2 * count
    if kind == "q8":
        return 4 + count
    if kind == "q8r":
        return 4 * (shape[0] if shape else 1) + count
    raise ValueError(f"unknown value kind {kind!r}")


def _scale_up(v: np.ndarray) -> np.ndarray:
    """float32 scales >= v (float64) with at most 17 significant bits, so q * s is exact in float32."""
    s = v.astype(np.float32)
    low = s.astype(np.float64) < v
    s[low] = np.nextafter(s[low], np.float32(np.inf))
    u = s.view(np.uint32)
    need = (u & 0x7F) != 0
    u[need] = (u[need] | 0x7F) + 1  # carries into the exponent if need be: still the next such value
    return u.view(np.float32)


def _need_rng(rounding: str, rng: object) -> None:
    if rounding != "stochastic":
        raise ValueError(f"rounding is 'stochastic' or 'nearest', not {rounding!r}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError("stochastic rounding needs a numpy Generator (a stream of the plan's seed)")


def _round(t: np.ndarray, rounding: str, rng: np.random.Generator | None) -> np.ndarray:
    if rounding == "nearest":
        return np.rint(t)
    _need_rng(rounding, rng)
    return np.floor(t + rng.random(t.shape))


def _q8(x: np.ndarray, rows: int, rounding: str, rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    x2 = x.astype(np.float64).reshape(rows, x.size // rows if rows else 0)
    a = np.abs(x2).max(axis=1, initial=0.0)
    s = _scale_up(a / 127.0)
    if not np.isfinite(s).all():
        raise ValueError("values too large for a float32 scale")
    sd = s.astype(np.float64)[:, None]
    t = np.divide(x2, sd, out=np.zeros_like(x2), where=sd > 0)
    q = np.clip(_round(np.clip(t, -127.0, 127.0), rounding, rng), -127, 127).astype(np.int8)
    return s, q


def encode_values(x: np.ndarray, kind: str, *, rng: np.random.Generator | None = None,
                  rounding: str | None = None) -> bytes:
    """The bytes of ``x`` in value format ``kind``.

    ``rounding`` is "stochastic" (the default for ``q8``/``q8r``) or "nearest" (the default for
    ``bf16``; the only one for ``f2``). Stochastic rounding draws its noise from ``rng`` only, so a
    device reproduces it from the plan's seed; there is no fallback to a global generator.
    """
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise ValueError(f"values must be floating point, not {x.dtype}")
    if kind in ("f4", "bf16"):
        x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("non-finite values (or beyond float32) cannot be encoded")
    if kind == "f4":
        return x.astype("<f4").tobytes()
    if kind == "f2":
        if rounding not in (None, "nearest"):
            raise ValueError("f2 rounds to nearest")
        return np.clip(x, -_F16_MAX, _F16_MAX).astype("<f2").tobytes()
    if kind == "bf16":
        u = x.view(np.uint32).ravel()
        if (rounding or "nearest") == "nearest":
            add = np.uint32(0x7FFF) + ((u >> 16) & 1)
        else:
            _need_rng(rounding, rng)
            add = rng.integers(0, 1 << 16, size=u.shape, dtype=np.uint32)
        # rounding acts on the magnitude bits; 0x7F7FFFFF + 0xFFFF stays below the sign bit
        r = ((u & 0x7FFFFFFF) + add) >> 16
        r = np.minimum(r, 0x7F7F) | ((u >> 16) & 0x8000)  # saturate instead of rounding to inf
        return r.astype("<u2").tobytes()
    if kind in ("q8", "q8r"):
        if kind == "q8r" and x.ndim == 0:
            raise ValueError("q8r needs at least one dimension")
        rows = 1 if kind == "q8" else x.shape[0]
        s, q = _q8(x, rows, rounding or "stochastic", rng)
        return s.astype("<f4").tobytes() + q.tobytes()
    raise ValueError(f"unknown value kind {kind!r}")


def decode_values(data: bytes, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """The array of ``shape`` in ``data``; CodecError if the length or any value is out of format.

    The length is checked against ``shape`` before anything is allocated, so the work is bounded by
    ``len(data)`` (decoding writes 4 bytes per value received).
    """
    if not isinstance(data, (bytes, bytearray)):
        raise CodecError(f"{kind} values: not bytes")
    if kind not in VALUE_KINDS:
        raise CodecError(f"unknown value kind {str(kind)[:40]!r}")
    if (not isinstance(shape, tuple) or not all(type(d) is int and 0 <= d <= MAX_ROWS for d in shape)
            or math.prod(d or 1 for d in shape) > MAX_ELEMENTS):  # see MAX_ELEMENTS: zero dims do not exempt
        raise CodecError(f"{kind} values: bad shape")
    if kind == "q8r" and not shape:
        raise CodecError("q8r values: no rows")
    want = value_nbytes(kind, shape)
    if len(data) != want:
        raise CodecError(f"{kind} values: {len(data)} bytes, shape {shape} needs {want}")
    if kind == "f4":
        out = np.frombuffer(data, "<f4").astype(np.float32)
    elif kind == "f2":
        out = np.frombuffer(data, "<f2").astype(np.float16)
    elif kind == "bf16":
        out = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        rows = 1 if kind == "q8" else shape[0]
        s = np.frombuffer(data, "<f4", count=rows).astype(np.float32)
        if not (np.isfinite(s).all() and (s >= 0).all()):
            raise CodecError(f"{kind} values: scale not finite or negative")
        q = np.frombuffer(data, np.int8, offset=4 * rows)
        if q.size and q.min() == -128:
            raise CodecError(f"{kind} values: int8 -128 is not a value")
        out = q.astype(np.float32).reshape(rows, q.size // rows if rows else 0) * s[:, None]
    if not np.isfinite(out).all():
        raise CodecError(f"{kind} values: not finite")
    return out.reshape(shape)
