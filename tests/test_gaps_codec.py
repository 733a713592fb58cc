"""The codec's edge cases (issue 28): every mask format at its boundaries (empty, all ones, k = n / 2 exactly,
lengths that are not a multiple of 8, index16 at n = 65536, enum at K = 64), the Golomb parameter's integer
estimate against round(n ln 2 / K), and the value formats at their edges (bf16's ties to even and saturation,
q8's largest value on the grid, zero rows, f2's saturation, stochastic rounding's exact expectation).

References are written here from docs/protocol.md (sections 5 and 6), never from the codec's own helpers.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from edge.protocol import codec as C
from edge.protocol import downlink


def ref_bitmask(mask):
    """Section 5: bit i of the bitmask is row i, most significant bit first, zero padding."""
    n = len(mask)
    out = bytearray((n + 7) // 8)
    for i, b in enumerate(mask):
        if b:
            out[i // 8] |= 0x80 >> (i % 8)
    return bytes(out)


def roundtrip(mask, kind):
    mask = np.asarray(mask, bool)
    data = C.encode_mask_as(C.support(mask), kind)
    got = C.decode_mask(kind, data, len(mask), int(mask.sum())).mask()
    return data, got


@pytest.mark.parametrize("n", [1, 7, 9, 13, 16, 17, 64, 65])
def test_every_mask_format_at_empty_full_half_and_odd_lengths(n):
    """Empty, all ones, exactly half (the minority tie goes to the active rows), and alternating, at lengths
    that are not a multiple of 8: each format decodes to the mask, the bitmask's bytes are section 5's.
    Kills: the minority tie sent as the inactive rows, bitmask padding or bit order."""
    rng = np.random.default_rng(n)
    half = np.zeros(n, bool)
    half[rng.permutation(n)[:n // 2]] = True
    masks = [np.zeros(n, bool), np.ones(n, bool), half, np.arange(n) % 2 == 1, np.arange(n) % 3 == 0]
    if n % 2 == 0:
        masks.append(~half)  # k = n / 2 stored the other way round
    for mask in masks:
        k = int(mask.sum())
        for kind in C.mask_sizes(C.support(mask)):
            data, got = roundtrip(mask, kind)
            np.testing.assert_array_equal(got, mask, err_msg=f"{kind} k={k} n={n}")
        assert C.encode_mask_as(C.support(mask), "bitmask") == ref_bitmask(mask)
        code = C.encode_mask(mask)
        np.testing.assert_array_equal(C.decode_mask(code.kind, code.data, n, k).mask(), mask)
        if k == n - k:  # the tie: golomb and enum carry the active rows
            s = C._minority(C.support(mask))
            assert not s.inactive and np.array_equal(s.rows, np.flatnonzero(mask))
            s = C._minority(C.Support(n, np.flatnonzero(~mask), True))
            assert not s.inactive and np.array_equal(s.rows, np.flatnonzero(mask))


def test_index16_up_to_65536_rows_and_enum_up_to_64():
    """index16 codes any n <= 65536 (row 65535 is a uint16); enum any K <= 64. Kills: n < 65536, K < 64."""
    m = np.zeros(65536, bool)
    m[[0, 65535]] = True
    assert "index16" in C.mask_sizes(C.support(m))
    data, got = roundtrip(m, "index16")
    assert data == np.array([0, 65535], "<u2").tobytes() and np.array_equal(got, m)
    assert "index16" not in C.mask_sizes(C.support(np.r_[m, False]))
    with pytest.raises(ValueError):
        C.encode_mask_as(C.support(np.r_[m, False]), "index16")
    for K, has in ((64, True), (65, False)):
        m = np.zeros(300, bool)
        m[np.arange(K) * 4] = True
        sizes = C.mask_sizes(C.support(m))
        assert ("enum" in sizes) == has
        if has:
            assert sizes["enum"] == ((math.comb(300, 64) - 1).bit_length() + 7) // 8
            _, got = roundtrip(m, "enum")
            np.testing.assert_array_equal(got, m)


@pytest.mark.parametrize("n, K", [(100, 3), (1000, 7), (999, 10), (17, 2), (65536, 9), (10, 10), (3, 1)])
def test_golomb_estimate_is_the_nearest_integer_to_n_ln2_over_K(n, K):
    """Section 5: M0 = round(n ln 2 / K) (at least 1), with ln 2 as round(ln 2 * 2^31) / 2^31. Kills: the floor
    (no + K 2^30), ln 2 in another fixed point."""
    ln2 = Fraction(round(math.log(2) * 2 ** 31), 2 ** 31)
    want = max(1, math.floor(Fraction(n) * ln2 / K + Fraction(1, 2)))
    assert C.golomb_estimate(n, K) == want
    assert abs(want - n * math.log(2) / K) <= 0.5 + 1e-9


# ---------------------------------------------------------------------------------------------- values
def bf16_nearest_even(x):
    """Round a float32 to bfloat16, nearest with ties to even, saturating at the largest finite (0x7F7F)."""
    out = []
    for v in np.asarray(x, np.float32).ravel():
        u = int(np.array(v).view(np.uint32))
        sign, mag = u & 0x80000000, u & 0x7FFFFFFF
        hi, lo = mag >> 16, mag & 0xFFFF
        if lo > 0x8000 or (lo == 0x8000 and hi & 1):
            hi += 1
        hi = min(hi, 0x7F7F)
        out.append((sign >> 16) | hi)
    return np.array(out, "<u2").tobytes()


def test_bfloat16_nearest_ties_to_even_and_saturates():
    """Values exactly half-way between two bfloat16s round to the even one (up and down), and the largest
    float32s saturate at bfloat16's largest finite value. Kills: ties away from zero, rounding up to inf."""
    ties = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -120 * (1 + 2 ** -8),
                     3.0 + 2 ** -7, 1 + 2 ** -8 + 2 ** -20], np.float32)
    big = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 3.3e38], np.float32)
    for x in (ties, big, np.zeros(0, np.float32), np.array([0.0, -0.0], np.float32)):
        assert C.encode_values(x, "bf16") == bf16_nearest_even(x)
    got = C.decode_values(C.encode_values(ties, "bf16"), "bf16", ties.shape)
    np.testing.assert_array_equal(got[:3], [1.0, 1 + 4 * 2 ** -8, -1.0])
    assert np.isfinite(C.decode_values(C.encode_values(big, "bf16"), "bf16", big.shape)).all()


@pytest.mark.parametrize("kind", ["q8", "q8r"])
def test_int8_puts_the_largest_value_on_the_grid_and_zero_rows_at_zero(kind):
    """q8 and q8r: the scale is the smallest float32 (17 significant bits) >= max|x| / 127, so the largest
    |x| of a row (or tensor) rounds to +-127 and decodes to within one float32 rounding of itself; rows of
    zeros decode to exact zeros with scale 0; ties of |x| (x and -x) decode symmetrically. Kills: /128 in
    the scale, a scale rounded down, zero rows divided by zero."""
    x = np.array([[0.5, -1.5, 1.5, 0.0], [0.0, 0.0, 0.0, 0.0], [3e-3, -1e-3, 0.0, 2e-3], [7.0, 7.0, -7.0, 1.0]],
                 np.float32)
    data = C.encode_values(x, kind, rounding="nearest")
    rows = 1 if kind == "q8" else 4
    s = np.frombuffer(data, "<f4", count=rows).astype(np.float64)
    q = np.frombuffer(data, np.int8, offset=4 * rows).reshape(rows, -1)
    amax = np.abs(x.astype(np.float64)).reshape(rows, -1).max(1)
    for i in range(rows):
        if amax[i] == 0:
            assert s[i] == 0 and (q[i] == 0).all()
            continue
        assert s[i] >= amax[i] / 127 and s[i] <= amax[i] / 127 * (1 + 2 ** -16)
        m = np.float32(s[i]).view(np.uint32)
        assert (m & 0x7F) == 0  # 17 significant bits: q * s is exact in float32
        assert np.abs(q[i]).max() == 127
    out = C.decode_values(data, kind, x.shape)
    for i in range(4):
        r = 0 if kind == "q8" else i
        assert np.abs(out[i] - x[i]).max() <= s[r] / 2 * (1 + 1e-6)
    assert (out[1] == 0).all()
    if kind == "q8r":
        assert out[3, 0] == out[3, 1] == -out[3, 2] and out[0, 1] == -out[0, 2]


@pytest.mark.parametrize("kind", ["q8", "q8r"])
def test_stochastic_rounding_expectation_is_exactly_x(kind):
    """Stochastic rounding picks floor(t) + 1 with probability t - floor(t): the expectation is x exactly. With
    the generator's uniforms known, each draw's q is floor(t + u); over 20,000 draws the mean of each value is
    within 5 standard errors (sd <= s/2) of x, and a value on the grid never moves. Kills: floor(t + u / 2),
    round(t + u), rounding before the clip."""
    x = np.array([[0.3, -0.71, 1.0, 0.0], [0.05, 0.5, -0.5, 0.25]], np.float32)
    reps = 20000
    acc = np.zeros(x.shape)
    for seed in range(reps):
        acc += C.decode_values(C.encode_values(x, kind, rng=np.random.default_rng(seed)), kind, x.shape)
    mean = acc / reps
    s = (np.abs(x).max() if kind == "q8" else np.abs(x).max(1, keepdims=True)) / 127
    assert (np.abs(mean - x) < 5 * s / 2 / math.sqrt(reps) + 1e-7).all(), (mean - x, s)
    # one draw, from the uniforms the generator gives
    rng = np.random.default_rng(123)
    data = C.encode_values(x, kind, rng=np.random.default_rng(123))
    rows = 1 if kind == "q8" else 2
    sc = np.frombuffer(data, "<f4", count=rows).astype(np.float64)
    q = np.frombuffer(data, np.int8, offset=4 * rows).reshape(x.shape)
    t = x.astype(np.float64).reshape(rows, -1) / sc[:, None]
    want = np.floor(t + rng.random(t.shape)).reshape(x.shape)
    np.testing.assert_array_equal(q, want)


def test_float16_saturates_at_65504_and_f4_is_exact():
    x = np.array([1e6, -1e6, 65504.0, 65520.0, 1.0, 0.0], np.float32)
    out = C.decode_values(C.encode_values(x, "f2"), "f2", x.shape)
    np.testing.assert_array_equal(out, [65504, -65504, 65504, 65504, 1, 0])
    assert C.decode_values(C.encode_values(x, "f4"), "f4", x.shape).tobytes() == x.tobytes()
    assert C.value_nbytes("q8r", (3, 5)) == 12 + 15 and C.value_nbytes("q8", (3, 5)) == 4 + 15


def test_downlink_reconstruction_is_what_the_device_decodes():
    """A difference goes from the held tensor of the same name and shape, rounded to nearest; the server's
    reconstruction equals the device's decode bit for bit; a tensor whose shape changed goes absolute.
    Kills: a held tensor of another shape used as the base, the reconstruction taken from the exact weights."""
    rng = np.random.default_rng(0)
    held = {"a": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
    new = {"a": held["a"] + rng.normal(size=(4, 3)).astype(np.float32) * 0.01,
           "b": rng.normal(size=6).astype(np.float32), "c": rng.normal(size=2).astype(np.float32)}
    for code in ("f4", "f2", "bf16", "q8", "q8r"):
        wire, recon = downlink.encode(new, held, {"a": code, "b": code, "c": code})
        arrays = {k: (v if isinstance(v, np.ndarray) else v.array) for k, v in wire.items()}
        dev = downlink.decode(arrays, held)
        for k in new:
            assert dev[k].tobytes() == recon[k].tobytes(), (code, k)
        assert np.abs(recon["a"] - new["a"]).max() <= 0.01 * 3 / 127 + 1e-6  # the difference's grid
        if code in ("q8", "q8r"):  # absolute: b's grid is its own range, not b - held["b"]'s
            assert np.abs(recon["b"] - new["b"]).max() <= np.abs(new["b"]).max() / 127
        np.testing.assert_allclose(dev["a"] - held["a"], arrays["a"].astype(np.float32), atol=1e-7)


@pytest.mark.parametrize("n, k", [(10, 0), (10, 4), (10, 5), (10, 6), (10, 9), (10, 10), (11, 5), (11, 6), (1, 1)])
def test_a_support_is_kept_by_its_minority_whichever_way_it_is_given(n, k):
    """From rows or from a mask, the support stores the smaller side (ties: the active rows), so its mask code
    costs the minority's bits; both give the same support and the same active rows."""
    rng = np.random.default_rng(n * 100 + k)
    rows = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    mask = np.zeros(n, bool)
    mask[rows] = True
    want_inactive = k > n - k
    want_rows = np.flatnonzero(~mask) if want_inactive else rows
    for s in (C.support_of_rows(n, rows), C.support(mask)):
        assert s.n == n and s.k == k and s.inactive == want_inactive
        assert s.rows.dtype == np.int64 and s.rows.tolist() == want_rows.tolist()
        assert s.active().tolist() == rows.tolist() and s.mask().tolist() == mask.tolist()


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("last, ok", [(18, True), (19, True), (20, False), (21, False)])
def test_golomb_rows_past_n_are_refused_in_either_section_layout(M, last, ok):
    """A stream whose last row is n or beyond (a hostile or corrupt mask) is a CodecError, both where the rows
    are section C's zeros themselves (M = 1) and where they are rebuilt from quotients and remainders; n - 1
    itself decodes."""
    n = 20
    rows = np.array([2, 5, 6, last], np.int64)
    data = C.golomb_encode(C.Support(n, rows, False), M=M)  # the encoder trusts its caller; the decoder may not
    if ok:
        assert C.golomb_decode(data, n, len(rows)).tolist() == rows.tolist()
    else:
        with pytest.raises(C.CodecError, match="past"):
            C.golomb_decode(data, n, len(rows))


@pytest.mark.parametrize("rows", [[1, 1, 3], [3, 2], [-1, 2], [0, 10], [2, 4, 4]])
def test_rows_that_are_not_a_support_are_refused(rows):
    """Repeated, unordered or out-of-range rows (0..n-1, strictly increasing) are not a support: a repeat would
    count a row twice in k and in the code."""
    with pytest.raises(ValueError, match="strictly increasing"):
        C.support_of_rows(10, np.array(rows))


def test_golomb_default_parameter_is_the_cheapest_for_every_small_support():
    """Every support of n <= 9 rows (n = 1 included: M's only value is n itself): the default M's stream decodes to
    the rows and is no longer than the stream of any M in 1..n (the format's choice, which a sender could get
    wrong and still be read)."""
    import itertools
    for n in range(1, 10):
        for k in range(1, n + 1):
            for rows in itertools.combinations(range(n), k):
                s = C.Support(n, np.array(rows, np.int64), False)
                data = C.golomb_encode(s)
                assert C.golomb_decode(data, n, k).tolist() == list(rows)
                assert len(data) == min(len(C.golomb_encode(s, M)) for M in range(1, n + 1)), (n, rows)


@pytest.mark.parametrize("n, K", [(8, 1), (16, 2), (4, 2)])
def test_enum_rank_at_the_count_of_supports_is_refused(n, K):
    """An enum code is a rank in 0..C(n, K) - 1; C(n, K) itself (which fits in the field whenever it is a power
    of two or below one) names no support."""
    total = math.comb(n, K)
    width = ((total - 1).bit_length() + 7) // 8
    last = C.enum_decode((total - 1).to_bytes(width, "big"), n, K)
    assert last.tolist() == list(range(n - K, n))  # the largest rank: the last K rows
    if total < 256 ** width:
        with pytest.raises(C.CodecError, match="out of range"):
            C.enum_decode(total.to_bytes(width, "big"), n, K)


@pytest.mark.parametrize("n, rows, M", [(40, [3, 9, 10, 22, 37], 5), (40, [3, 9, 10, 22, 37], 6),
                                        (30, [0, 1, 2, 29], 3), (12, [4, 11], 1)])
def test_a_cut_or_flipped_golomb_stream_is_a_codec_error_or_a_valid_support(n, rows, M):
    """What comes off the network: every truncation and every single-bit flip of a valid stream decodes to rows
    inside 0..n-1, strictly increasing, or raises CodecError; nothing else escapes (an IndexError or a numpy
    broadcast error would be a traceback in the daemon, not a dropped message)."""
    data = C.golomb_encode(C.Support(n, np.array(rows, np.int64), False), M=M)
    K = len(rows)
    variants = [data[:i] for i in range(len(data))]
    variants += [bytes(b ^ (1 << j) if i == at else b for i, b in enumerate(data)) for at in range(len(data))
                 for j in range(8)]
    for v in variants:
        try:
            got = C.golomb_decode(v, n, K)
        except C.CodecError:
            continue
        assert len(got) == K and (got >= 0).all() and (got < n).all() and (np.diff(got) > 0).all(), v


def test_golomb_stream_that_ends_inside_its_remainder_bits_is_refused():
    """M = 3 (b = 2, u = 1): each row's first remainder bit h says whether a second bit follows. A stream whose h
    bits all say "long" but that ends after K more bits (enough for the K terminators, not for the K extra
    remainder bits) is truncated: a CodecError, not a numpy shape error."""
    n, K, M = 200, 16, 3
    rows = np.arange(0, 10 * K, 10, dtype=np.int64)
    bits = C._bits_of(C.golomb_encode(C.Support(n, rows, False), M=M))
    lz = int(np.flatnonzero(bits)[0])
    pos = 2 * lz + 1  # past the parameter's Elias gamma code
    forged = np.concatenate([bits[:pos], np.ones(K, np.uint8), np.zeros(K, np.uint8)])
    data = C._bytes_of_bits(forged)
    assert 8 * len(data) - len(forged) < K  # the padding cannot supply the missing bits
    with pytest.raises(C.CodecError, match="truncated remainders"):
        C.golomb_decode(data, n, K)


@pytest.mark.parametrize("n", [50, 300, 1000])
def test_golomb_default_parameter_is_the_cheapest_on_larger_masks(n):
    """The candidates (the estimate, Gallager and Van Voorhis' optimum for geometric gaps and its neighbours)
    contain the cheapest M: on random supports from one row to half the mask, no M in 1..n gives fewer bytes."""
    rng = np.random.default_rng(n)
    for k in sorted({1, 2, 3, 5, 10, 30, n // 10, n // 4, n // 2 - 1}):
        rows = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
        s = C.Support(n, rows, False)
        data = C.golomb_encode(s)
        assert C.golomb_decode(data, n, k).tolist() == rows.tolist()
        assert len(data) == min(len(C.golomb_encode(s, M)) for M in range(1, n + 1)), (n, k)
