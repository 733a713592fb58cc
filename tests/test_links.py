"""Every byte at its bound (issue 13): sampled uploads with Horvitz-Thompson reweighting, value formats chosen per
plan and checked exactly by admission, the downlink in lower precision and as differences from the model a
device holds, per-device link budgets, and the random-pruning control on a schedule.

Each estimator and server step is checked against a reference written here, at a point where every term
contributes."""
from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.admission import AdmissionRules, admit, check_structure
from coordinator.strategies.base import DevicePlan, ReportRejected, ServerState, received_weights, upload_spec
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.links import Downlink, dense_report_bytes, upload_for
from edge.algorithms.base import PlanError
from edge.algorithms.driver import (encode_update, inclusion_probabilities, prepare, systematic_sample,
                                    value_format)
from edge.model import mlp
from edge.protocol import downlink, wire
from edge.protocol.wire import Plan, Report, TensorUpdate
from edge.runtime.state import LocalState
from edge.protocol.capabilities import EXTENSIONS as EXT, BadCapabilities, parse_capabilities

SPEC = mlp([6, 5, 4, 3])


def _plan(weights, upload, seed=0, **kw):
    return Plan("r1", 1, "d0", 1e18, "fedavg", "torch", "0" * 64, weights, {}, seed, upload, **kw)


def _through_wire(tensors):
    return wire.decode(wire.encode(Report("r1", "d0", 7, {}, tensors))).tensors


def _weights(rng, rows=12, cols=5):
    return {"a.weight": rng.standard_normal((rows, cols)).astype(np.float32),
            "a.bias": rng.standard_normal(rows).astype(np.float32),
            "b.weight": rng.standard_normal((4, rows)).astype(np.float32)}


# ---------------------------------------------------------------- sampling


def test_systematic_sample_has_exact_marginals_and_a_size_within_one():
    rng = np.random.default_rng(0)
    p = np.array([1.0, 0.9, 0.5, 0.5, 0.25, 0.2, 0.1, 0.05, 0.5, 1 / 255])
    n = 40_000
    hits = np.zeros(len(p))
    sizes = set()
    for _ in range(n):
        s = systematic_sample(p, rng)
        hits += s
        sizes.add(int(s.sum()))
    se = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(hits / n - p) <= 4.5 * se + 1e-12), (hits / n, p)
    assert sizes <= {math.floor(p.sum()), math.ceil(p.sum())}


def _reference_probabilities(norms, row_bytes, keep, p_min):
    """Water-filling written out: p = clip(c ||row|| / sqrt(bytes), p_min, 1) with the expected bytes equal to
    keep * total, c found by scanning the breakpoints (no bisection), then the wire's grid of 1/255 (up)."""
    score = np.concatenate([n / math.sqrt(b) for n, b in zip(norms, row_bytes)])
    byt = np.concatenate([np.full(len(n), float(b)) for n, b in zip(norms, row_bytes)])
    target = keep * byt.sum()

    def spent(c):
        return float((np.clip(c * score, p_min, 1.0) * byt).sum())
    if spent(0.0) >= target:
        c = 0.0
    else:  # spent is piecewise linear in c, with kinks at p_min / score and 1 / score
        kinks = np.sort(np.concatenate([p_min / score[score > 0], 1.0 / score[score > 0]]))
        lo = 0.0
        for k in kinks:
            if spent(k) >= target:
                break
            lo = k
        hi = k
        slope = (spent(hi) - spent(lo)) / (hi - lo)
        c = lo + (target - spent(lo)) / slope
    p = np.clip(c * score, p_min, 1.0)
    return np.clip(np.ceil(p * 255 - 1e-9), 1, 255) / 255


def test_inclusion_probabilities_match_the_water_filling_reference():
    rng = np.random.default_rng(3)
    norms = [np.abs(rng.standard_normal(30)) * rng.uniform(0.1, 3.0, 30), np.abs(rng.standard_normal(7))]
    norms[0][4] = 0.0  # a row with no change: p_min
    norms[1][2] = 50.0  # a row so large it is always sent
    nb = [20.0, 84.0]
    for keep, p_min in ((0.5, 0.05), (0.2, 0.0), (0.9, 0.1), (0.01, 0.05)):
        got = np.concatenate(inclusion_probabilities(norms, nb, keep, p_min, "norm"))
        want = _reference_probabilities(norms, nb, keep, p_min)
        np.testing.assert_allclose(got, want, atol=1.01 / 255)  # bisection vs exact c: at most one grid step
        assert got.min() >= min(max(p_min, 1 / 255), 1.0) - 1e-12 and got.max() <= 1.0
        if keep * 1 >= p_min:  # the budget is met in expectation (up to the grid)
            spent = sum(float((p * b).sum()) for p, b in zip(inclusion_probabilities(norms, nb, keep, p_min, "norm"),
                                                              nb))
            total = sum(len(n) * b for n, b in zip(norms, nb))
            assert keep * total - 1e-6 <= spent <= keep * total + sum(len(n) * b for n, b in zip(norms, nb)) / 255
    uni = inclusion_probabilities(norms, nb, 0.3, 0.0, "uniform")
    assert all(np.allclose(p, math.ceil(0.3 * 255) / 255) for p in uni)


@pytest.mark.slow
@pytest.mark.parametrize("code", ["f4", "q8r"])
def test_sampled_uploads_are_unbiased_over_many_draws(code):
    """The issue's test: through the driver, the wire and the server's reading (received_weights), the mean of the
    Horvitz-Thompson estimate over many draws equals the dense update (z-scores against the empirical standard
    error), and every active row has its stated inclusion frequency. A gate mask removes rows as well."""
    rng = np.random.default_rng(1)
    w0 = _weights(rng)
    new = {k: (v + rng.standard_normal(v.shape) * rng.uniform(0.01, 1.0, (v.shape[0],) + (1,) * (v.ndim - 1))
               ).astype(np.float32) for k, v in w0.items()}
    gate = np.ones(12, bool)
    gate[[2, 7]] = False
    masks = {"a.weight": gate, "a.bias": gate}
    up = upload_spec(code, dtype_1d="f4", sample="norm", keep=0.4, p_min=0.05)
    dp = DevicePlan(w0, {}, up, SPEC, maskable=frozenset(masks))
    truth = {k: new[k].astype(np.float64) for k in new}
    for k, m in masks.items():
        truth[k][~m] = 0.0
    n = 3000
    s1 = {k: np.zeros(v.shape) for k, v in w0.items()}
    s2 = {k: np.zeros(v.shape) for k, v in w0.items()}
    sent = np.zeros(12)
    probs = None
    for seed in range(n):
        t = _through_wire(encode_update(new, _plan(w0, up, seed), masks))
        assert t["a.weight"].sampled and not t["a.bias"].sampled and t["b.weight"].sampled
        rep = Report("r1", "d0", 7, {}, t)
        for k in w0:
            e = received_weights(dp, rep, k)
            s1[k] += e
            s2[k] += e * e
        rows = t["a.weight"].sent_rows()
        sent[rows] += 1
        p = np.zeros(12)
        p[rows] = t["a.weight"].probs
        probs = p if probs is None else np.maximum(probs, p)
    for k in w0:
        mean = s1[k] / n
        se = np.sqrt(np.maximum(s2[k] / n - mean ** 2, 0) / n)
        varies = se > 1e-6 * (np.abs(truth[k]) + 1)  # else a row always sent (p = 1) or never active
        z = np.abs(mean - truth[k])[varies] / se[varies]
        assert varies.any() == (k != "a.bias")  # float32 biases go whole: no draw at all
        assert np.all(z < 5.0), (k, float(z.max(initial=0)))
        np.testing.assert_allclose(mean[~varies], truth[k][~varies], rtol=1e-6, atol=1e-6)
    act = np.flatnonzero(gate)
    assert sent[~gate].sum() == 0
    freq = sent[act] / n
    assert np.all(np.abs(freq - probs[act]) <= 5 * np.sqrt(probs[act] * (1 - probs[act]) / n) + 1e-9)


def test_the_sample_keeps_within_the_byte_budget_and_the_estimate_is_values_over_p():
    rng = np.random.default_rng(2)
    w0 = {"w": rng.standard_normal((400, 50)).astype(np.float32)}
    new = {"w": (w0["w"] + 0.1 * rng.standard_normal((400, 50))).astype(np.float32)}
    dense = len(wire.encode(Report("r1", "d0", 7, {}, encode_update(new, _plan(w0, upload_spec("q8r")), {}))))
    up = upload_spec("q8r", sample="norm", keep=0.25, p_min=0.02)
    t = encode_update(new, _plan(w0, up, 5), {})["w"]
    size = len(wire.encode(Report("r1", "d0", 7, {}, {"w": t})))
    # keep bounds the whole update (values, probability codes, the sample mask) to one row (50 + 4 + 1 bytes);
    # the message's own fields go in both (head), and the sample's record adds its keys (16 bytes)
    head = dense - 400 * 54
    assert 0.25 * dense - 2 * 55 <= size <= 0.25 * (dense - head) + head + 55 + 16, (size, dense)
    got = _through_wire({"w": t})["w"]
    ref = np.zeros((400, 50))
    ref[np.flatnonzero(t.sample)] = t.values.astype(np.float64) / (t.pcodes[:, None] / 255.0)  # written out
    np.testing.assert_array_equal(got.estimate(), ref)


def test_fedavg_aggregates_sampled_reports_as_the_reference_does():
    """FedAdam's server on sampled, int8-coded reports: the weighted mean of w + values / p (reference below)."""
    rng = np.random.default_rng(4)
    s = FedAvg(spec=SPEC, server_opt="sgd", server_lr=1.0, upload_dtype="q8r", upload_dtype_1d="f4",
               upload_sample="norm", upload_keep=0.5, upload_p_min=0.1)
    st = s.init(0)
    acc = s.begin(st)
    ref = {k: np.zeros(v.shape) for k, v in st.weights.items()}
    total = 0.0
    for d, nsamp in (("d0", 5), ("d1", 11), ("d2", 3)):
        dp = s.plan(st, d, EXT)
        new = {k: (v + rng.standard_normal(v.shape) * 0.1).astype(np.float32) for k, v in dp.weights.items()}
        rep = wire.decode(wire.encode(Report("r1", d, nsamp, {}, encode_update(new, _plan(dp.weights, dp.upload,
                                                                                           rng.integers(1 << 30)), {}))))
        check_structure(dp, rep, AdmissionRules())
        s.accumulate(st, acc, dp, rep)
        for k, t in rep.tensors.items():
            est = np.zeros(t.shape)
            if t.sampled:
                est[t.sent_rows()] = t.values.astype(np.float64) / t.probs.reshape(-1, *([1] * (t.values.ndim - 1)))
            else:
                est = t.values.astype(np.float64).reshape(t.shape)
            ref[k] += nsamp * (dp.weights[k] + est)
        total += nsamp
    new = s.finish(st, acc)
    for k in ref:
        np.testing.assert_allclose(new.weights[k], (ref[k] / total).astype(np.float32), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- formats and admission


def test_admission_checks_the_value_format_exactly():
    rng = np.random.default_rng(5)
    w0 = _weights(rng)
    new = {k: v + np.float32(0.01) for k, v in w0.items()}
    rules = AdmissionRules()

    def report(upload, seed=0):
        return wire.decode(wire.encode(Report("r1", "d0", 7, {}, encode_update(new, _plan(w0, upload, seed), {}))))

    f4, q8r = upload_spec("f4"), upload_spec("q8r", dtype_1d="q8")
    sampled = upload_spec("q8r", dtype_1d="q8", sample="norm", keep=0.5, p_min=0.2)
    for up in (f4, q8r, sampled):
        check_structure(DevicePlan(w0, {}, up, SPEC), report(up), rules)  # each accepts its own
    with pytest.raises(ReportRejected, match="values are q8r, the plan asked for float32"):
        check_structure(DevicePlan(w0, {}, f4, SPEC), report(q8r), rules)
    with pytest.raises(ReportRejected, match="values are float32, the plan asked for q8r"):
        check_structure(DevicePlan(w0, {}, q8r, SPEC), report(f4), rules)
    with pytest.raises(ReportRejected, match="values are q8r, the plan asked for q8"):  # vectors: dtype_1d
        check_structure(DevicePlan(w0, {}, q8r | {"dtype_1d": "q8"}, SPEC),
                        report(q8r | {"dtype_1d": "q8r"}), rules)
    with pytest.raises(ReportRejected, match="sampled where the plan asks for every row"):
        check_structure(DevicePlan(w0, {}, q8r, SPEC), report(sampled), rules)
    low = report(sampled | {"p_min": 0.0, "keep": 0.3})
    with pytest.raises(ReportRejected, match="below the plan's p_min"):
        check_structure(DevicePlan(w0, {}, sampled, SPEC), low, rules)
    assert value_format(q8r, 1) == "q8" and value_format(q8r, 2) == "q8r" and value_format({}, 2) == "f4"


def test_the_norm_bound_and_clipping_read_a_sampled_update_as_the_strategy_does():
    rng = np.random.default_rng(6)
    w0 = _weights(rng)
    new = {k: v + np.float32(0.5) for k, v in w0.items()}
    up = upload_spec("f4", sample="uniform", keep=0.5)
    dp = DevicePlan(w0, {}, up, SPEC)
    rep = wire.decode(wire.encode(Report("r1", "d0", 7, {}, encode_update(new, _plan(w0, up, 3), {}))))
    # sampled tensors: the Horvitz-Thompson estimate of the squared norm, sum over sent rows of ||v||^2 / p
    # (written out); vectors go whole
    want = 0.0
    for k, t in rep.tensors.items():
        if t.sampled:
            want += sum(float(np.square(t.values[j].astype(np.float64)).sum()) / (t.pcodes[j] / 255.0)
                        for j in range(len(t.values)))
        else:
            want += float(np.square(received_weights(dp, rep, k) - w0[k]).sum())
    want = math.sqrt(want)
    assert any(t.sampled for t in rep.tensors.values())
    got, norm = admit(dp, rep, AdmissionRules(norm_bound=1e9), {})
    assert norm == pytest.approx(want, rel=1e-6)  # admission sums in float32 (a bound check)
    clipped, _ = admit(dp, rep, AdmissionRules(norm_bound=want / 4, clip=True), {})
    for k in w0:  # the clipped report reads as a quarter of the update, samples and probabilities kept
        np.testing.assert_allclose(received_weights(dp, clipped, k) - w0[k], (received_weights(dp, rep, k) - w0[k]) / 4,
                                   rtol=1e-6, atol=1e-6)
        assert clipped.tensors[k].sampled == rep.tensors[k].sampled


def test_malformed_samples_are_refused_on_the_wire():
    t = TensorUpdate((6, 2), np.ones((2, 2), np.float32), sample=np.array([1, 0, 0, 1, 0, 0], bool),
                     pcodes=np.array([10, 20], np.uint8))
    rec = wire.pack_update(t)
    assert wire.unpack_update(rec, "t").sent_rows().tolist() == [0, 3]
    bad = [
        rec | {"h": rec["h"] | {"p": b"\x00\x14"}},  # probability 0
        rec | {"h": rec["h"] | {"p": b"\x10"}},  # one probability for two rows
        rec | {"h": rec["h"] | {"k": 5}},  # disagrees with the (absent) row mask: 6 active rows
        rec | {"h": rec["h"] | {"k": 7}},  # more active rows than rows
        rec | {"h": {"k": 6, "p": b"\x01\x01"}},  # no sample mask
        rec | {"h": rec["h"] | {"z": 1}},  # unknown field
        rec | {"h": [1, 2]},
    ]
    for b in bad:
        with pytest.raises(wire.WireError):
            wire.unpack_update(b, "t")


# ---------------------------------------------------------------- the downlink


def test_downlink_both_ends_agree_to_the_bit_and_differences_shrink_the_error(tmp_path):
    rng = np.random.default_rng(7)
    w1 = _weights(rng)
    w2 = {k: v + np.float32(0.01) * rng.standard_normal(v.shape).astype(np.float32) for k, v in w1.items()}
    fm = {"a.weight": "q8r", "b.weight": "q8r", "a.bias": "f4"}
    state = LocalState(tmp_path)
    wire1, model1 = downlink.encode(w1, None, fm)
    p1 = prepare(wire.decode(wire.encode(_plan(wire1, {}, tag="m1"))), state)
    for k in w1:
        assert np.array_equal(p1.weights[k], model1[k]), k
    wire2, model2 = downlink.encode(w2, model1, fm)
    p2 = prepare(wire.decode(wire.encode(_plan(wire2, {}, tag="m2", base="m1"))), state)
    for k in w1:
        assert np.array_equal(p2.weights[k], model2[k]), k
    err_abs = np.abs(downlink.encode(w2, None, fm)[1]["a.weight"] - w2["a.weight"]).max()
    err_delta = np.abs(model2["a.weight"] - w2["a.weight"]).max()
    assert err_delta < err_abs / 20
    assert downlink.held(state)[0] == "m2"
    with pytest.raises(PlanError, match="does not hold"):
        prepare(_plan(wire2, {}, tag="m3", base="m1"), state)


def test_a_base_is_only_a_model_the_device_confirmed(tmp_path):
    """Over rounds through the in-process loop: every plan's base is the model the device holds, so the device's
    model equals the server's record to the bit; over-selected devices (no confirmation) get absolute weights."""
    from coordinator.inprocess import Loop
    rng = np.random.default_rng(8)
    shards = [(rng.standard_normal((12, 6)).astype(np.float32), rng.integers(0, 3, 12)) for _ in range(6)]
    s = FedAvg(spec=SPEC, server_opt="adam", server_lr=0.01, down_dtype="q8r", down_deltas=True,
               upload_dtype="q8r", upload_dtype_1d="f4")
    loop = Loop(s, shards, seed=0, workdir=str(tmp_path), threads=1)
    seen_bases = 0
    for _ in range(6):
        loop.round_as_coordinator(3, 1.5)
        for d, rec in s._down.held.items():
            tag, held = downlink.held(loop.local[d])
            assert tag == rec.tag
            for k in held:
                assert np.array_equal(held[k], rec.model[k]), (d, k)
        seen_bases += sum(1 for r in s._down.held.values() if r.confirmed)
    assert seen_bases > 0
    loop.close()


def test_plan_bytes_fall_with_the_downlink_formats():
    s0, s1 = FedAvg(spec=mlp([64, 50, 10])), FedAvg(spec=mlp([64, 50, 10]), down_dtype="q8r", down_dtype_1d="f4")
    b = []
    for s in (s0, s1):
        dp = s.plan(s.init(0), "d0", EXT)
        b.append(len(wire.encode(_plan(dp.weights if dp.wire is None else dp.wire, {}, tag=dp.tag, base=dp.base))))
    assert b[1] < 0.3 * b[0]


# ---------------------------------------------------------------- link budgets, schedules


def test_a_devices_link_sets_its_upload_budget():
    s = FedAvg(spec=mlp([64, 50, 10]), upload_dtype="q8r", upload_dtype_1d="f4", upload_s=1.0)
    st = s.init(0)
    full = s.plan(st, "d0", EXT)
    assert "sample" not in full.upload
    dense = dense_report_bytes(full)
    slow = s.plan(st, "d1", EXT | {"link_kbps": 8 * dense / 1000 / 4})  # a quarter of a dense report per second
    assert slow.upload["sample"] == "norm" and slow.upload["keep"] == pytest.approx(1 / 4)
    fast = upload_for(full, EXT | {"link_kbps": 1e6}, 1.0)
    assert fast is full
    rng = np.random.default_rng(9)
    new = {k: v + np.float32(0.1) * rng.standard_normal(v.shape).astype(np.float32) for k, v in full.weights.items()}
    sent = encode_update(new, _plan(full.weights, slow.upload, 1), {}).values()
    # values, probability codes and sample masks; systematic sampling: one row (64 + 4 + 1 bytes) over, per matrix
    update_bytes = sum(len(wire.pack_update(t)["x"]["b"]) + (0 if t.pcodes is None else len(t.pcodes))
                       + (0 if t.sample is None else (len(t.sample) + 7) // 8) for t in sent)
    assert dense / 4 - 2 * 69 <= update_bytes <= dense / 4 + 2 * 69


def test_random_control_follows_a_schedule_of_unit_counts():
    sched = [[5, 4], [3, 4], [3, 2], [1, 1]]
    s = FedAvg(spec=SPEC, prune_schedule=sched)
    st = s.init(3)
    for r in range(5):
        with np.errstate(invalid="ignore"):  # a round without reports (the round machine never closes one): 0/0
            st = s.finish(st, s.begin(st))
        want = sched[min(r, len(sched) - 1)]
        alive = [int(st.opt[f"alive/fc{i}"].sum()) for i in (0, 1)]
        assert alive == want
        for i in (0, 1):
            dead = ~st.opt[f"alive/fc{i}"].astype(bool)
            assert not st.weights[f"fc{i}.weight"][dead].any() and not st.weights[f"fc{i + 1}.weight"][:, dead].any()
    assert s.plan(st, "d0", {}).weights["fc0.weight"].shape == (1, 6)


def test_only_a_device_that_declares_the_extensions_gets_them():
    """Coded and differenced plans (tag, base) and sampled uploads are protocol extensions (docs/protocol.md
    6.1): a device whose check-in does not declare ``coded_downlink`` / ``sampled_upload`` (a v1 device that
    does not implement them) gets float32 weights and is asked for every row, in the plan's value format."""
    s = FedAvg(spec=mlp([64, 50, 10]), upload_dtype="q8r", upload_dtype_1d="f4", upload_sample="norm",
               upload_keep=0.5, upload_p_min=0.1, down_dtype="q8r", down_deltas=True)
    st = s.init(0)
    plain = s.plan(st, "old", {"runtime": "torch"})
    assert plain.wire is None and not plain.tag and not plain.base
    assert "sample" not in plain.upload and plain.upload["dtype"] == "q8r"
    assert "old" not in s._down.held
    full = s.plan(st, "new", EXT)
    assert full.wire is not None and full.tag and full.upload["sample"] == "norm"
    only_up = s.plan(st, "up", {"sampled_upload": True})
    assert only_up.wire is None and only_up.upload["sample"] == "norm"
    only_down = s.plan(st, "down", {"coded_downlink": True, "sampled_upload": False})
    assert only_down.wire is not None and "sample" not in only_down.upload
    with pytest.raises(BadCapabilities, match="sampled_upload"):
        parse_capabilities({"sampled_upload": "yes"})


@pytest.mark.parametrize("upload, why", [
    ({"dtype": "f4", "delta": "false"}, "delta must be true or false"),  # a string is not a bool ("false" is truthy)
    ({"dtype": "f4", "delta": 1}, "delta must be true or false"),
    ({"dtype": "q8", "delta": True, "sample": "norm", "keep": "0.5", "p_min": 0.0}, "must be numbers"),
    ({"dtype": "q8", "delta": True, "sample": "norm", "keep": 0.5, "p_min": True}, "must be numbers"),
])
def test_upload_options_are_typed_strictly(upload, why):
    w0 = {"w": np.ones((4, 3), np.float32)}
    with pytest.raises(PlanError, match=why):
        encode_update({"w": w0["w"] * 2}, _plan(w0, upload), {})


def test_float16_uploads_saturate_instead_of_overflowing():
    """Section 6: binary16 saturates at +-65504; a plain cast gave infinity, which admission refuses."""
    w0 = {"w": np.zeros((2, 3), np.float32)}
    new = {"w": np.array([[1e5, -7e4, 1.0], [65504.0, 65520.0, -2.0]], np.float32)}
    t = encode_update(new, _plan(w0, upload_spec("f2")), {})["w"]
    got = np.asarray(t.values, np.float64)
    assert np.isfinite(got).all()
    assert got.tolist() == [[65504.0, -65504.0, 1.0], [65504.0, 65504.0, -2.0]]
