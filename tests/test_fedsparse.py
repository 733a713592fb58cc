"""FedSparse numerics against small numpy references (paper 000, Eq. 23, 41, Alg. 1-2)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from coordinator.strategies.base import ServerState
from coordinator.strategies.fedsparse import FedSparse
from edge import gates
from edge.algorithms.driver import run_plan
from edge.model import mlp
from edge.optim import Adam, Adamax
from edge.runtime.program import torch_program
from edge.trainers import make_trainer
from edge.protocol.wire import Plan, Report, TensorUpdate

from conftest import make_bus

SPEC = mlp([6, 5, 4, 3])


def sig(a):
    return 1 / (1 + np.exp(-a))


def logsig(a):
    return -np.logaddexp(0, -a)


def test_torch_optimisers_match_numpy():
    rng = np.random.default_rng(0)
    for cls, tcls in ((Adam, torch.optim.Adam), (Adamax, torch.optim.Adamax)):
        p = {"a": rng.normal(size=5).astype(np.float32)}
        t = torch.nn.Parameter(torch.from_numpy(p["a"].copy()))
        opt_n, opt_t = cls(lr=0.01), tcls([t], lr=0.01)
        for _ in range(5):
            g = rng.normal(size=5).astype(np.float32)
            opt_n.step(p, {"a": g})
            t.grad = torch.from_numpy(g.copy())
            opt_t.step()
        np.testing.assert_allclose(p["a"], t.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_gate_probability_and_initial_thresholds():
    rng = np.random.default_rng(1)
    w, b = rng.normal(size=(7, 3)).astype(np.float32), rng.normal(size=7).astype(np.float32)
    T = 1e-3
    v = gates.v_for_theta(w, b, 0.99, T)
    norm = np.sqrt((w.astype(np.float64) ** 2).sum(1) + b.astype(np.float64) ** 2)
    tau = np.log1p(np.exp(v.astype(np.float64)))
    np.testing.assert_allclose(sig((norm - tau) / T), 0.99, atol=2e-3)  # float32 v: ~1e-7 in tau
    np.testing.assert_allclose(gates.softplus(np.array([-30.0, 0.0, 30.0])), np.log1p(np.exp([-30.0, 0.0, 30.0])))


def test_client_objective_and_v_gradient_match_numpy():
    """One hidden layer, T large enough that nothing saturates: value and dL/dv against hand-derived numpy."""
    spec = mlp([4, 3, 2])
    rng = np.random.default_rng(2)
    W1, b1 = rng.normal(size=(3, 4)), rng.normal(size=3)
    W2, b2 = rng.normal(size=(2, 3)), rng.normal(size=2)
    v = rng.normal(size=3)
    x, y = rng.normal(size=(5, 4)), rng.integers(0, 2, 5)
    u = rng.uniform(0.05, 0.95, 3)
    th = rng.normal(size=3)
    lam0, ce, T = 0.3, 0.2, 1.5
    tr = make_trainer("torch")
    tr.load(torch_program(spec, "fedsparse").data)
    f32 = lambda a: np.asarray(a, np.float32)
    tr.set_weights({"fc0.weight": f32(W1), "fc0.bias": f32(b1), "fc1.weight": f32(W2), "fc1.bias": f32(b2),
                    "fc0.v": f32(v)})
    norm_in = np.sqrt((W1 ** 2).sum(1) + b1 ** 2)  # the detached group norms come in as an input
    loss, g, _ = tr.loss_and_grads({"x": f32(x), "y": y.astype(np.int64), "u0": f32(u), "theta_logit0": f32(th),
                                    "norm0": f32(norm_in), "lambda0": f32(lam0), "ce_scale": f32(ce), "T": f32(T)})
    # numpy forward; Louizos et al.'s hard-concrete constants written out, not imported from the code under test
    BETA, GAMMA, ZETA = 2 / 3, -0.1, 1.1
    a = x @ W1.T + b1
    r = np.maximum(a, 0)
    norm = np.sqrt((W1 ** 2).sum(1) + b1 ** 2)
    tau = np.log1p(np.exp(v))
    lp = (norm - tau) / T
    la = lp + BETA * math.log(-GAMMA / ZETA)
    s = sig((np.log(u) - np.log(1 - u) + la) / BETA)
    zr = s * (ZETA - GAMMA) + GAMMA
    z = np.clip(zr, 0, 1)
    logits = (r * z) @ W2.T + b2
    p = np.exp(logits - logits.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
    data = -np.log(p[np.arange(5), y]).mean()
    pi = sig(lp)
    pen = lam0 * pi.sum() + ce * (-(pi * logsig(th) + (1 - pi) * logsig(-th))).sum()
    assert loss == pytest.approx(data + pen, rel=1e-5)
    # dL/dv: through the gates z (data term) and through pi (penalties); d(logit)/dv = -sigmoid(v)/T
    dlogits = p.copy(); dlogits[np.arange(5), y] -= 1; dlogits /= 5
    dz = ((dlogits @ W2) * r).sum(0)
    dz_dla = np.where((zr > 0) & (zr < 1), (ZETA - GAMMA) * s * (1 - s) / BETA, 0.0)
    dpen_dpi = lam0 - ce * (logsig(th) - logsig(-th))
    dv = (dz * dz_dla + dpen_dpi * pi * (1 - pi)) * (-sig(v) / T)
    np.testing.assert_allclose(g["fc0.v"], dv, rtol=1e-4, atol=1e-6)
    assert np.abs(dv).min() > 1e-4  # the check is not vacuous


def test_sampled_mask_is_unbiased():
    pi = np.array([0.05, 0.3, 0.5, 0.9, 0.99])
    rng = np.random.default_rng(3)
    z = np.stack([gates.sample_mask(pi, rng) for _ in range(20000)])
    np.testing.assert_allclose(z.mean(0), pi, atol=4 * np.sqrt(pi * (1 - pi) / 20000).max())


def _state(fs: FedSparse, seed=0) -> ServerState:
    return fs.init(seed)


def _report(dp, device, zs, delta, n=10):
    """A report whose active weights are the plan's plus ``delta``; gated layers masked by zs."""
    tens = {}
    for k, w in dp.weights.items():
        if k.endswith(".v"):
            continue
        new = (w + delta).astype(np.float32)
        i = int(k[2])
        if i in zs:
            tens[k] = TensorUpdate(new.shape, new[zs[i]], zs[i])
        else:
            tens[k] = TensorUpdate(new.shape, new)
    return Report("r1a1", device, n, {}, tens)


def test_server_threshold_step_follows_the_annealed_temperature():
    """Mid-anneal (round 5 of T 0.1 -> 0.01 over rounds 3-6), with ``v_lr_follows_T``: line 8's gradient uses
    this round's T_r, and Adamax's rate is server_v_lr * T_r / T (the same logit step at every T). At T_r / T =
    3.16 a rate that ignored, inverted or mis-timed the scale moves v by a different amount."""
    fs = FedSparse(spec=SPEC, preset="mid", prune_below=0.0, T_start=0.1, T=0.01, anneal_from=2, anneal_rounds=4,
                   v_lr_follows_T=True)
    st0 = _state(fs)
    st = ServerState(4, st0.weights, st0.opt, st0.meta)  # committed round 4: this is round 5
    T_r = math.exp(0.5 * math.log(0.1) + 0.5 * math.log(0.01))  # f = (5 - 1 - 2) / 4
    dp = fs.plan(st, "a", {})
    z1 = {0: np.array([1, 0, 1, 1, 0], bool), 1: np.array([1, 1, 0, 1], bool)}
    z2 = {0: np.array([1, 1, 1, 0, 0], bool), 1: np.array([0, 1, 1, 1], bool)}
    acc = fs.begin(st)
    fs.accumulate(st, acc, dp, _report(dp, "a", z1, 0.01))
    fs.accumulate(st, acc, dp, _report(dp, "b", z2, -0.03, n=7))
    new = fs.finish(st, acc)
    assert new.round == 5
    for i in (0, 1):
        k = f"fc{i}.weight"
        v = st.opt[f"v/fc{i}"].astype(np.float64)
        theta = sig((gates.group_norms(st.weights[k], st.weights[f"fc{i}.bias"]) - np.log1p(np.exp(v))) / T_r)
        gv = -((z1[i] - theta) + (z2[i] - theta)) * sig(v) / T_r
        np.testing.assert_allclose(acc.grad_v[f"fc{i}"], gv, rtol=1e-5, atol=1e-8)  # line 8 at T_r, summed
        # first Adamax step: m_hat = g, u = |g| + eps: a step of the rate times g / (|g| + eps), ascent
        want = v + 0.01 * (T_r / 0.01) * gv / (np.abs(gv) + 1e-8)
        np.testing.assert_allclose(new.opt[f"v/fc{i}"], want, rtol=0, atol=1e-6)
        assert np.abs(want - v).max() > 0.03  # the scale is visible: 3.16x the unscaled 0.01


def test_server_step_matches_numpy_reference():
    """Alg. 1 lines 7-9 on two reports: Adam on the masked differences, Adamax on the thresholds."""
    fs = FedSparse(spec=SPEC, preset="mid", prune_below=0.0)  # no pruning here: tested separately
    st = _state(fs)
    dp = fs.plan(st, "a", {})
    z1 = {0: np.array([1, 0, 1, 1, 0], bool), 1: np.array([1, 1, 0, 1], bool)}
    z2 = {0: np.array([1, 1, 1, 0, 0], bool), 1: np.array([0, 1, 1, 1], bool)}
    acc = fs.begin(st)
    fs.accumulate(st, acc, dp, _report(dp, "a", z1, 0.01))
    fs.accumulate(st, acc, dp, _report(dp, "b", z2, -0.03))
    new = fs.finish(st, acc)
    lr, T = fs.server_lr, fs.T
    for i, rows in ((0, 5), (1, 4)):
        k = f"fc{i}.weight"
        mask1, mask2 = z1[i][:, None], z2[i][:, None]
        w = st.weights[k].astype(np.float64)
        new_a = (w + 0.01).astype(np.float32).astype(np.float64)
        new_b = (w - 0.03).astype(np.float32).astype(np.float64)
        g = mask1 * (new_a - w) + mask2 * (new_b - w)
        # first Adam step: m_hat = g, v_hat = g^2 -> step = lr * g / (|g| + eps), ascent
        ref = w + lr * g / (np.abs(g) + 1e-8)
        np.testing.assert_allclose(new.weights[k], ref, atol=1e-6)
        v = st.opt[f"v/fc{i}"].astype(np.float64)
        theta = sig((gates.group_norms(st.weights[k], st.weights[f"fc{i}.bias"]) - np.log1p(np.exp(v))) / T)
        gv = -((z1[i] - theta) + (z2[i] - theta)) * sig(v) / T
        # first Adamax step: m_hat = g, u = |g| + eps -> step = lr * g / (|g| + eps), ascent
        np.testing.assert_allclose(new.opt[f"v/fc{i}"], v + fs.server_v_lr * gv / (np.abs(gv) + 1e-8), atol=1e-6)
    # groups kept by both clients get their threshold lowered (theta up): the sign the paper intends
    both = z1[0] & z2[0]
    assert (new.opt["v/fc0"][both] < st.opt["v/fc0"][both]).all()
    # the output layer is never masked: its difference is the plain sum
    w = st.weights["fc2.bias"].astype(np.float64)
    g = ((w + 0.01).astype(np.float32) - w) + ((w - 0.03).astype(np.float32) - w)
    np.testing.assert_allclose(new.weights["fc2.bias"], w + lr * g / (np.abs(g) + 1e-8), atol=1e-6)


def test_pruning_removes_groups_and_does_not_cascade():
    fs = FedSparse(spec=SPEC, preset="mid")
    st = _state(fs)
    dp = fs.plan(st, "a", {})
    # every client drops fc0 groups 1 and 3; everything else kept
    z = {0: np.array([1, 0, 1, 0, 1], bool), 1: np.ones(4, bool)}
    new = st
    for _ in range(3):
        dp = fs.plan(new, "a", {})
        zz = {0: z[0][: len(dp.weights["fc0.bias"])] if len(dp.weights["fc0.bias"]) == 5 else np.ones(3, bool),
              1: z[1]}
        acc = fs.begin(new)
        fs.accumulate(new, acc, dp, _report(dp, "a", zz, 0.0))
        new = fs.finish(new, acc)
    assert list(new.opt["alive/fc0"]) == [1, 0, 1, 0, 1]
    assert list(new.opt["alive/fc1"]) == [1, 1, 1, 1]  # the next layer lost two input columns, not its units
    assert (new.weights["fc0.weight"][[1, 3]] == 0).all() and (new.weights["fc1.weight"][:, [1, 3]] == 0).all()
    dp = fs.plan(new, "a", {})
    assert dp.spec["sizes"] == [6, 3, 4, 3]
    assert dp.weights["fc1.weight"].shape == (4, 3) and dp.weights["fc0.v"].shape == (3,)
    # theta of the next layer was not moved by the pruning itself
    th = sig(fs._theta_logits(new, 1))
    assert (th > 0.1).all()


def test_cascade_guard_keeps_next_layer_theta():
    fs = FedSparse(spec=SPEC, preset="mid")
    st = _state(fs)
    before = fs._theta_logits(st, 1)
    # make fc0 group 2 die by raising its threshold, then finish a round with no gradient signal
    st.opt["v/fc0"] = st.opt["v/fc0"].copy()
    st.opt["v/fc0"][2] = 50.0
    acc = fs.begin(st)
    acc.count = 1
    new = fs.finish(st, acc)
    assert new.opt["alive/fc0"][2] == 0
    after = fs._theta_logits(new, 1)
    # with zero gradients Adam/Adamax do not move anything; the only change is the removed column,
    # which the threshold shift compensates exactly
    np.testing.assert_allclose(after, before, atol=1e-2 * np.abs(before).max() + 1e-3)


def test_client_sends_only_active_groups():
    fs = FedSparse(spec=SPEC, preset="mid")
    st = _state(fs)
    dp = fs.plan(st, "a", {})
    tr = make_trainer("torch")
    tr.load(torch_program(dp.spec, "fedsparse").data)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 6)).astype(np.float32), rng.integers(0, 3, 30)
    plan = Plan("r1a1", 1, "a", 1e12, "fedsparse", "torch", "0" * 64, dp.weights, dp.hparams, 5, dp.upload)
    rep = run_plan(plan, tr, x, y)
    for i in (0, 1):
        t = rep.tensors[f"fc{i}.weight"]
        assert t.mask is not None and t.values.shape[0] == t.mask.sum()
        assert np.array_equal(t.mask, rep.tensors[f"fc{i}.bias"].mask)
    assert rep.tensors["fc2.weight"].mask is None
    assert "fc0.v" not in rep.tensors
    # deterministic in the plan's seed
    rep2 = run_plan(plan, tr, x, y)
    assert np.array_equal(rep2.tensors["fc0.weight"].values, rep.tensors["fc0.weight"].values)


def test_fedsparse_rounds_prune_and_bytes_fall(tmp_path):
    fs = FedSparse(spec=mlp([64, 16, 16, 10]), preset="high", lr=0.1, batch_size=10)
    bus = make_bus(tmp_path, 6, rounds=6, per_round=4, strategy=fs)
    bus.connect_all()
    for _ in range(8):
        bus.tick(0.1)
    rows = bus.committed
    assert len(rows) == 6
    assert rows[-1]["density"] < 1.0
    # plans shrink with the surviving groups (the first round also carries the programs)
    assert rows[-1]["bytes_down"] < rows[1]["bytes_down"] or rows[1]["density"] == rows[-1]["density"] < 1.0


def test_fedl1_client_thresholds_and_server_prunes(tmp_path):
    from coordinator.strategies.fedl1 import FedL1
    s = FedL1(spec=mlp([64, 16, 10]), l1=0.6, lr=0.1, batch_size=10, server_opt="adam", server_lr=1e-2)
    bus = make_bus(tmp_path, 4, rounds=3, per_round=4, strategy=s)
    bus.connect_all()
    for _ in range(4):
        bus.tick(0.1)
    assert len(bus.committed) == 3
    reps = [wire_decode(p) for t, p in bus.log if "/report/" in t]
    masks = [r.tensors["fc0.weight"].mask for r in reps]
    assert all(m is not None for m in masks) and any(not m.all() for m in masks)
    for r in reps:  # what is sent is exactly the groups above the threshold
        t = r.tensors["fc0.weight"]
        b = r.tensors["fc0.bias"].values
        assert (gates.group_norms(t.values, b) > 0.6).all()
    assert bus.committed[-1]["density"] < 1.0


def wire_decode(p):
    from edge.protocol import wire
    return wire.decode(p)


def test_float16_uploads_travel_as_differences_and_keep_small_changes():
    from coordinator.strategies.base import DevicePlan, received_weights, upload_spec
    from edge.algorithms.driver import encode_update
    rng = np.random.default_rng(4)
    w0 = {"fc0.weight": rng.normal(size=(8, 5)).astype(np.float32)}
    new = {"fc0.weight": (w0["fc0.weight"] + 1e-4 * rng.normal(size=(8, 5))).astype(np.float32)}
    mask = np.array([1, 1, 0, 1, 0, 1, 1, 1], bool)
    up = upload_spec("f2")
    plan = Plan("r1a1", 1, "a", 1e12, "fedsparse", "torch", "0" * 64, w0, {}, 1, up)
    tens = encode_update(new, plan, {"fc0.weight": mask})
    assert tens["fc0.weight"].values.dtype == np.float16 and tens["fc0.weight"].values.shape == (6, 5)
    back = received_weights(DevicePlan(w0, {}, up, SPEC), Report("r1a1", "a", 1, {}, tens), "fc0.weight")
    change = new["fc0.weight"][mask] - w0["fc0.weight"][mask]
    err = np.abs(back[mask] - new["fc0.weight"][mask])
    assert err.max() < 1e-3 * np.abs(change).max() + 1e-7  # the change survives
    naive = np.abs(new["fc0.weight"].astype(np.float16).astype(np.float32) - new["fc0.weight"]).max()
    assert naive > 10 * err.max()  # sending float16 weights would have lost it
    assert (back[~mask] == 0).all()
