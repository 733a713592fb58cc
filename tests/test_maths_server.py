"""Every server step against an independent numpy reference (issue 9, "tests that catch wrong maths").

The references below are the papers' update rules written out again, with their own Adam and Adamax (torch's
update rules, Kingma & Ba's default constants written as numbers), over two or three rounds so that the
optimisers' moments and bias corrections matter (a first Adam step is lr * sign(g) whatever b1 and b2 are).
Nothing from ``edge`` or ``coordinator`` computes any part of a reference.

- FedAvg / FedAdam (McMahan et al. 2017; Reddi et al. 2020): the sample-weighted mean, a server lr step or
  Adam ascent on mean - w. FedProx (Li et al. 2020) aggregates exactly as FedAvg.
- FedSparse (paper 000, Alg. 1): line 7 Adam ascent on sum_s z_s (w_s - w), line 8 Adamax ascent (lr 1e-2)
  on sum_s -(z_s - theta) sigmoid(v) / T, line 3 the prune rule theta < 0.1 with the cascade guard and the
  "a layer keeps its best unit" rule (docs/fedsparse.md).
- FedMix (paper 004): Eq. 8 weights, Alg. 1 line 8 (phi, marginal-entropy regulariser), Adam descent on Delta,
  Alg. 2's server-side selection (0.9 eta / K).
- FedMix x FedSparse (docs/fedmix_sparse.md, choices 1-3): Eq. 8 weights on z-masked differences, one Adam over
  experts and phi, per-expert Adamax on thresholds, per-expert pruning.
"""
from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.fedmix import FedMix
from coordinator.strategies.fedmix_sparse import FedMixSparse
from coordinator.strategies.fedprox import FedProx
from coordinator.strategies.fedsparse import FedSparse
from edge.model import mlp
from edge.protocol import wire
from edge.protocol.wire import Report, TensorUpdate

B1, B2, EPS = 0.9, 0.999, 1e-8  # Kingma & Ba's defaults (paper 000 App. A: "default hyperparameters")


# ------------------------------------------------------------------------------------------------ references
class RefAdam:
    """torch.optim.Adam's rule, written out: m_hat / (sqrt(v_hat) + eps); ascent when maximize."""

    def __init__(self, lr, maximize):
        self.lr, self.sign, self.t, self.m, self.v = lr, (1.0 if maximize else -1.0), 0, {}, {}

    def step(self, w, g):
        self.t += 1
        for k, gk in g.items():
            m = self.m[k] = B1 * self.m.get(k, 0.0) + (1 - B1) * gk
            v = self.v[k] = B2 * self.v.get(k, 0.0) + (1 - B2) * gk * gk
            w[k] = w[k] + self.sign * self.lr * (m / (1 - B1 ** self.t)) / (np.sqrt(v / (1 - B2 ** self.t)) + EPS)


class RefAdamax:
    """torch.optim.Adamax's rule, written out: u = max(b2 u, |g| + eps), step lr / (1 - b1^t) * m / u."""

    def __init__(self, lr, maximize):
        self.lr, self.sign, self.t, self.m, self.u = lr, (1.0 if maximize else -1.0), 0, {}, {}

    def step(self, w, g):
        self.t += 1
        for k, gk in g.items():
            m = self.m[k] = B1 * self.m.get(k, 0.0) + (1 - B1) * gk
            u = self.u[k] = np.maximum(B2 * self.u.get(k, 0.0), np.abs(gk) + EPS)
            w[k] = w[k] + self.sign * self.lr / (1 - B1 ** self.t) * m / u


def sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def softplus(a):
    return np.logaddexp(0.0, a)


def theta_of(W, b, v, T):
    """Paper 000 Eq. 23 on the server's weights: theta = sigmoid((||w_g|| - softplus(v)) / T)."""
    norm = np.sqrt((np.asarray(W, np.float64) ** 2).sum(1) + np.asarray(b, np.float64) ** 2)
    return sigmoid((norm - softplus(np.asarray(v, np.float64))) / T)


def v_giving(W, b, theta, T):
    """Thresholds that give server probability ``theta`` per unit."""
    norm = np.sqrt((W.astype(np.float64) ** 2).sum(1) + b.astype(np.float64) ** 2)
    tau = norm - T * np.log(theta / (1 - theta))
    return (tau + np.log(-np.expm1(-tau))).astype(np.float32)


def close(got, want, atol=1e-6, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=rtol)


def moved(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def roundtrip(rep: Report) -> Report:
    return wire.decode(wire.encode(rep))


def dense(dev, n, values: dict[str, np.ndarray], extras=None) -> Report:
    return roundtrip(Report("t", dev, n, {"train_loss": 1.0},
                            {k: TensorUpdate(v.shape, np.asarray(v, np.float32)) for k, v in values.items()},
                            extras or {}))


# ------------------------------------------------------------------------------------------------ FedAvg family
SPEC = mlp([6, 5, 3])
NS = (3, 11, 6)


def _avg_round(s, st, rng):
    """Three reports of random weights; returns (new state, the float32 weights each device sent)."""
    acc = s.begin(st)
    dp = s.plan(st, "d", {})
    sent = []
    for i, n in enumerate(NS):
        ws = {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in dp.weights.items()}
        sent.append(ws)
        s.accumulate(st, acc, dp, dense(f"d{i}", n, ws))
    return s.finish(st, acc), sent


def _mean(sent):
    return {k: sum(n * w[k].astype(np.float64) for n, w in zip(NS, sent)) / sum(NS) for k in sent[0]}


@pytest.mark.parametrize("cls", [FedAvg, FedProx])
def test_fedavg_and_fedprox_step_to_the_sample_weighted_mean(cls):
    """w <- w + server_lr (sum_s N_s w_s / sum_s N_s - w) (FedAvg, Eq. 10-11 of paper 000); FedProx's server
    is the same aggregation (Li et al. 2020, Alg. 2), with server_lr 1 and sgd by default (plain averaging)."""
    rng = np.random.default_rng(0)
    s = cls(spec=SPEC, server_lr=0.4)
    st = s.init(0)
    new, sent = _avg_round(s, st, rng)
    mean = _mean(sent)
    for k, w in st.weights.items():
        close(new.weights[k], w + 0.4 * (mean[k] - w), atol=1e-5)
        unweighted = np.mean([x[k] for x in sent], 0)
        assert moved(mean[k], unweighted) > 0.05  # the sample counts matter at this point
    plain = cls(spec=SPEC) if cls is FedProx else None
    if plain is not None:  # the paper's server: plain averaging
        st = plain.init(0)
        new, sent = _avg_round(plain, st, rng)
        for k, m in _mean(sent).items():
            close(new.weights[k], m, atol=1e-5)


def test_the_float32_buffer_takes_an_empty_tensor():
    """A tensor pruned to no rows goes through the buffer's path like any other (BLAS refuses empty arrays)."""
    from coordinator.strategies.fedavg import FOLD, Accumulator
    w, e = np.ones(3, np.float32), np.zeros((0, 4), np.float32)
    acc = Accumulator({"w": np.zeros(3), "e": np.zeros((0, 4))})
    for _ in range(FOLD + 2):
        acc.add_update("w", w, np.full(3, 0.5, np.float32), 2.0)
        acc.add_update("e", e, e, 2.0)
    assert acc.sums["e"].shape == (0, 4)
    assert np.array_equal(acc.sums["w"], np.full(3, (FOLD + 2) * 2.0 * 1.5))


@pytest.mark.parametrize("blas", [True, False])
def test_fedavg_sums_many_reports_to_float64_precision_through_its_float32_buffer(blas, monkeypatch):
    """The weighted sum over more reports than the float32 buffer holds (Accumulator.FOLD), reports on the
    round's weights (buffered) mixed with reports on a copy of them (summed in float64 directly), against
    sum_s n_s w_s written out in float64. The buffer sums updates, not weights, so its error sits far below
    a float32 weight's resolution; a buffer of weights (or any float32 sum of them) misses by ~1e-6 here.
    With and without scipy's BLAS (numpy does the same sums in more passes)."""
    from coordinator.strategies import fedavg as F
    if not blas:
        monkeypatch.setattr(F, "_saxpy", None)
        monkeypatch.setattr(F, "_daxpy", None)
    rng = np.random.default_rng(7)
    s = FedAvg(spec=mlp([40, 30, 3]))
    st = s.init(0)
    dp = s.plan(st, "d", {})
    other = dataclasses.replace(dp, weights={k: v.copy() for k, v in dp.weights.items()})  # not W: general path
    acc = s.begin(st)
    ref = {k: np.zeros(v.shape) for k, v in dp.weights.items()}
    total = 0.0
    count = 2 * F.FOLD + 7
    for i in range(count):
        n = int(rng.integers(1, 300))
        plan = other if i % 5 == 0 else dp
        ws = {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in plan.weights.items()}
        s.accumulate(st, acc, plan, dense(f"d{i}", n, ws))
        for k in ref:
            ref[k] += n * ws[k].astype(np.float64)
        total += n
    assert acc.count == count and acc.total_n == total
    for k, want in ref.items():
        err = np.abs(acc.sums[k] / total - want / total).max()
        assert err < 1e-9, (k, err)  # float32 weights resolve ~6e-8 here
    f32 = {k: np.zeros(v.shape, np.float32) for k, v in ref.items()}
    rng = np.random.default_rng(7)  # the same draws, summed as float32 weights: what the test would miss
    for i in range(count):
        n = int(rng.integers(1, 300))
        plan = other if i % 5 == 0 else dp
        for k, v in plan.weights.items():
            f32[k] += np.float32(n) * (v + rng.normal(0, 0.01, v.shape)).astype(np.float32)
    assert max(np.abs(f32[k] / total - ref[k] / total).max() for k in ref) > 1e-8


def test_plan_difference_once_per_report_never_shared_and_dropped_while_a_report_waits():
    """w_s - w is computed once per (report, plan) for admission and the sum, never aliased with another report's
    (a later report does not overwrite it), recomputed against another plan, and forgotten by drop_differences
    (reproducible mode holds reports until their turn)."""
    from coordinator.strategies.base import drop_differences, plan_difference
    rng = np.random.default_rng(5)
    s = FedAvg(spec=SPEC)
    st = s.init(0)
    dp = s.plan(st, "d", {})
    k = "fc0.weight"
    sent = [{n: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for n, v in dp.weights.items()} for _ in range(2)]
    r1, r2 = dense("d1", 3, sent[0]), dense("d2", 4, sent[1])
    d1 = plan_difference(dp, r1, k)
    assert plan_difference(dp, r1, k) is d1
    d2 = plan_difference(dp, r2, k)
    assert not np.shares_memory(d1, d2)
    np.testing.assert_array_equal(d1, sent[0][k] - dp.weights[k])  # still r1's after r2's was computed
    np.testing.assert_array_equal(d2, sent[1][k] - dp.weights[k])
    other = dataclasses.replace(dp, weights={n: v + np.float32(1) for n, v in dp.weights.items()})
    np.testing.assert_array_equal(plan_difference(other, r1, k), sent[0][k] - other.weights[k])
    drop_differences(r1)
    assert "_differences" not in r1.__dict__
    again = plan_difference(dp, r1, k)
    assert again is not d1 and np.array_equal(again, d1)


def test_fedavg_snapshot_restores_the_sums_exactly_and_refuses_another_models():
    """Durable sums: a snapshot taken mid-buffer (reports pending in float32) restores to the same float64 sums,
    sample total and count, bit for bit; a snapshot of another model, or cut short, is refused."""
    from coordinator.strategies import fedavg as F
    rng = np.random.default_rng(3)
    s = FedAvg(spec=SPEC)
    st = s.init(0)
    dp = s.plan(st, "d", {})
    acc = s.begin(st)
    for i in range(F.FOLD + 5):
        ws = {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in dp.weights.items()}
        s.accumulate(st, acc, dp, dense(f"d{i}", int(rng.integers(1, 50)), ws))
    blob = s.snapshot(acc)
    back = s.restore_snapshot(st, blob, {})
    assert back.total_n == acc.total_n and back.count == acc.count == F.FOLD + 5
    for k, v in acc.sums.items():
        assert back.sums[k].dtype == np.float64 and np.array_equal(back.sums[k], v)
    assert np.abs(acc.sums["fc0.weight"]).max() > 1  # not the zeros of a fresh accumulator
    other = FedAvg(spec=mlp([6, 4, 3]))
    with pytest.raises(ValueError, match="the model has"):
        other.restore_snapshot(other.init(0), blob, {})
    with pytest.raises(ValueError):
        s.restore_snapshot(st, blob[:-8], {})
    with pytest.raises(ValueError, match="not a fedge sums snapshot"):
        s.restore_snapshot(st, b"PK" + blob[2:], {})
    m = len(F.SUMS_MAGIC)
    for head in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"tensors": 3})):  # garbage, not a map, wrong
        with pytest.raises(ValueError, match="snapshot"):
            s.restore_snapshot(st, F.SUMS_MAGIC + len(head).to_bytes(4, "little") + head + blob[m + 4:], {})


def test_fedprox_sends_mu_and_names_its_objective():
    s = FedProx(spec=SPEC, mu=0.3)
    dp = s.plan(s.init(0), "d", {})
    assert dp.objective == "fedprox" and dp.hparams["mu"] == 0.3


def test_fedadam_is_adam_ascent_on_the_mean_difference_over_three_rounds():
    """Reddi et al.'s FedAdam (paper 000 App. F): Adam ascent on mean - w, moments carried in the state."""
    rng = np.random.default_rng(1)
    s = FedAvg(spec=SPEC, server_opt="adam", server_lr=0.05)
    st = s.init(0)
    ref = {k: v.astype(np.float64) for k, v in st.weights.items()}
    adam = RefAdam(0.05, maximize=True)
    for _ in range(3):
        st, sent = _avg_round(s, st, rng)
        mean = _mean(sent)
        adam.step(ref, {k: mean[k] - ref[k] for k in ref})
        for k in ref:
            close(st.weights[k], ref[k], atol=2e-6)
    # the moments matter here: with b1 = 0.8 (or b2 = 0.99) the same rounds end far outside the tolerance
    # (a first Adam step is lr * sign(g) whatever b1 and b2 are, so one round could not tell)
    for b1, b2 in ((0.8, B2), (B1, 0.99)):
        other = {k: v.astype(np.float64) for k, v in s.init(0).weights.items()}
        m, v = {}, {}
        rng = np.random.default_rng(1)
        for t in range(1, 4):
            means = _mean([{k: (w + rng.normal(size=w.shape)).astype(np.float32) for k, w in other.items()} for _ in NS])
            for k in other:  # one Adam step with these constants, written out
                g = means[k] - other[k]
                m[k] = b1 * m.get(k, 0.0) + (1 - b1) * g
                v[k] = b2 * v.get(k, 0.0) + (1 - b2) * g * g
                other[k] = other[k] + 0.05 * (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + EPS)
        assert max(moved(other[k], ref[k]) for k in ref) > 50 * 2e-6, (b1, b2)  # 50x the tolerance above


def test_adam_and_adamax_constants_against_torch():
    """The numpy optimisers against torch.optim over steps whose gradients change (so b1, b2 and eps matter)."""
    from edge.optim import Adam, Adamax
    rng = np.random.default_rng(2)
    for cls, tcls in ((Adam, torch.optim.Adam), (Adamax, torch.optim.Adamax)):
        for maximize in (False, True):
            p = {"a": rng.normal(size=50)}
            t = torch.nn.Parameter(torch.tensor(p["a"].copy()))
            ours, theirs = cls(lr=0.01, maximize=maximize), tcls([t], lr=0.01, maximize=maximize)
            for step in range(6):
                g = rng.normal(size=50) * (10.0 ** -step)  # shrinking gradients: Adamax's max(b2 u, |g|) matters
                ours.step(p, {"a": g})
                t.grad = torch.tensor(g)
                theirs.step()
            np.testing.assert_allclose(p["a"], t.detach().numpy(), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------ FedSparse
SSPEC = mlp([6, 5, 4, 3])


def _sparse_report(dp, dev, rng, p_keep=0.6, n=10):
    """Random trained weights; every hidden layer's rows masked by a random z (the same on weight and bias)."""
    ws, zs, tens = {}, {}, {}
    for i in range(len(SSPEC["sizes"]) - 1):
        W, b = dp.weights[f"fc{i}.weight"], dp.weights[f"fc{i}.bias"]
        ws[i] = ((W + rng.normal(size=W.shape) * 0.1).astype(np.float32), (b + rng.normal(size=b.shape) * 0.1).astype(np.float32))
        if i < len(SSPEC["sizes"]) - 2:
            z = rng.random(len(b)) < p_keep
            z[0], z[1] = True, False  # both values occur in every layer
            zs[i] = z
            tens[f"fc{i}.weight"] = TensorUpdate(W.shape, ws[i][0][z], z)
            tens[f"fc{i}.bias"] = TensorUpdate(b.shape, ws[i][1][z], z)
        else:
            tens[f"fc{i}.weight"] = TensorUpdate(W.shape, ws[i][0])
            tens[f"fc{i}.bias"] = TensorUpdate(b.shape, ws[i][1])
    return roundtrip(Report("t", dev, n, {}, tens)), ws, zs


def test_fedsparse_server_step_over_two_rounds():
    """Alg. 1 lines 7 and 8 with Adam (lr server_lr) and Adamax (lr 1e-2, the paper's), both ascents,
    checked on the accumulated gradients and on the new state over two rounds (no pruning here)."""
    T = 0.05  # theta strictly inside (0, 1) for every unit, so both (z - theta) signs occur
    fs = FedSparse(spec=SSPEC, preset="mid", prune_below=0.0, T=T, theta0=0.6)
    st = fs.init(0)
    rng = np.random.default_rng(3)
    w_ref = {k: v.astype(np.float64) for k, v in st.weights.items()}
    v_ref = {i: st.opt[f"v/fc{i}"].astype(np.float64) for i in (0, 1)}
    adam, adamax = RefAdam(fs.server_lr, maximize=True), RefAdamax(1e-2, maximize=True)
    for _round in range(2):
        dp = fs.plan(st, "a", {})
        acc = fs.begin(st)
        gw = {k: np.zeros(v.shape) for k, v in w_ref.items()}
        gv = {i: np.zeros(len(v_ref[i])) for i in (0, 1)}
        for dev in ("a", "b", "c"):
            rep, ws, zs = _sparse_report(dp, dev, rng)
            fs.accumulate(st, acc, dp, rep)
            for i, (W, b) in ws.items():
                zW = zs[i][:, None] if i in zs else 1.0
                zb = zs[i] if i in zs else 1.0
                gw[f"fc{i}.weight"] += zW * (W.astype(np.float64) - w_ref[f"fc{i}.weight"])  # line 7
                gw[f"fc{i}.bias"] += zb * (b.astype(np.float64) - w_ref[f"fc{i}.bias"])
            for i in (0, 1):  # line 8: -(z (1 - theta) - (1 - z) theta) sigmoid(v) / T
                th = theta_of(w_ref[f"fc{i}.weight"], w_ref[f"fc{i}.bias"], v_ref[i], T)
                z = zs[i].astype(np.float64)
                gv[i] += -(z * (1 - th) - (1 - z) * th) * sigmoid(v_ref[i]) / T
        for k in gw:
            close(acc.grad_w[k], gw[k], atol=1e-6)
        for i in (0, 1):
            close(acc.grad_v[f"fc{i}"], gv[i], rtol=1e-5, atol=1e-6)
        st = fs.finish(st, acc)
        adam.step(w_ref, gw)
        adamax.step(v_ref, {i: gv[i] for i in (0, 1)})
        for k in w_ref:
            close(st.weights[k], w_ref[k], atol=2e-6)
        for i in (0, 1):
            close(st.opt[f"v/fc{i}"], v_ref[i], atol=2e-6)
    assert all(st.opt[f"alive/fc{i}"].all() for i in (0, 1))


def _prune_state(fs, thetas: dict[int, np.ndarray], dead0=()):
    """A server state whose units have the given theta (at the state's weights); ``dead0``: fc0 units
    already pruned in an earlier round, with Adam moments left in the state as a restart would find them."""
    st = fs.init(0)
    for u in dead0:
        st.opt["alive/fc0"][u] = 0
        st.weights["fc0.weight"][u] = 0
        st.weights["fc0.bias"][u] = 0
        st.weights["fc1.weight"][:, u] = 0
    for i, th in thetas.items():
        st.opt[f"v/fc{i}"] = v_giving(st.weights[f"fc{i}.weight"], st.weights[f"fc{i}.bias"], th, fs.T)
    return st


def test_fedsparse_prune_rule_and_cascade_guard():
    """Alg. 1 line 3 (prune theta < epsilon = 0.1, the paper's example and the default), a pruned unit's
    column removed from the next layer with that layer's theta unchanged (the cascade guard), already dead
    units kept at zero whatever the optimiser's moments say."""
    T = 0.05
    fs = FedSparse(spec=SSPEC, preset="mid", T=T)
    th0 = np.array([0.5, 0.08, 0.12, 0.02, 0.9])  # units 1 and 3 fall under 0.1; unit 2 (0.12) stays
    th1 = np.array([0.3, 0.6, 0.11, 0.95])
    st = _prune_state(fs, {0: th0, 1: th1})
    st.opt["adam/t"] = np.array(1)
    st.opt["adam/m/fc0.weight"] = np.ones((5, 6))  # moments that would move every row on the next step
    st.opt["adam/v/fc0.weight"] = np.ones((5, 6))
    before = {k: v.copy() for k, v in st.weights.items()}
    new = fs.finish(st, fs.begin(st))  # no reports: only the optimisers' momentum and the prune rule
    assert new.opt["alive/fc0"].tolist() == [1, 0, 1, 0, 1]
    assert new.opt["alive/fc1"].tolist() == [1, 1, 1, 1]
    W0, W1 = new.weights["fc0.weight"], new.weights["fc1.weight"]
    assert not W0[[1, 3]].any() and not new.weights["fc0.bias"][[1, 3]].any() and not W1[:, [1, 3]].any()
    assert moved(W0[[0, 2, 4]], before["fc0.weight"][[0, 2, 4]]) > 1e-4  # the moments did move the others
    # cascade guard: fc1's thresholds drop by exactly the norm each unit lost with the pruned columns, so
    # Eq. 23 gives the theta it had before pruning
    n_before = np.sqrt((before["fc1.weight"].astype(np.float64) ** 2).sum(1) + before["fc1.bias"].astype(np.float64) ** 2)
    n_after = np.sqrt((W1.astype(np.float64) ** 2).sum(1) + new.weights["fc1.bias"].astype(np.float64) ** 2)
    assert (theta_of(W1, new.weights["fc1.bias"], st.opt["v/fc1"], T) < 0.1).any()  # without the guard: pruned
    tau_ref = softplus(st.opt["v/fc1"].astype(np.float64)) - (n_before - n_after)
    close(softplus(new.opt["v/fc1"].astype(np.float64)), tau_ref, atol=1e-5)
    close(theta_of(W1, new.weights["fc1.bias"], new.opt["v/fc1"], T), th1, atol=1e-3)

    # a layer whose every unit falls under epsilon keeps its most probable unit (paper silent: docs/fedsparse.md)
    st = _prune_state(fs, {0: np.array([0.05, 0.07, 0.02, 0.09, 0.01]), 1: th1})
    new = fs.finish(st, fs.begin(st))
    assert new.opt["alive/fc0"].tolist() == [0, 0, 0, 1, 0]

    # a unit pruned earlier stays dead and zero, though its Adam moments would revive it
    st = _prune_state(fs, {0: np.array([0.5, 0.6, 0.7, 0.8, 0.9]), 1: th1}, dead0=(2,))
    st.opt["adam/t"] = np.array(1)
    st.opt["adam/m/fc0.weight"] = np.ones((5, 6))
    st.opt["adam/v/fc0.weight"] = np.ones((5, 6))
    new = fs.finish(st, fs.begin(st))
    assert new.opt["alive/fc0"].tolist() == [1, 1, 0, 1, 1] and new.opt["alive/fc1"].all()  # nothing newly pruned
    assert not new.weights["fc0.weight"][2].any() and not new.weights["fc1.weight"][:, 2].any()
    assert moved(new.weights["fc0.weight"][[0, 1, 3, 4]], st.weights["fc0.weight"][[0, 1, 3, 4]]) > 1e-4


# ------------------------------------------------------------------------------------------------ FedMix
MSPEC = mlp([6, 4, 3])
MNAMES = ["fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"]


def marginal_entropy_grad(phi):
    """d/dphi H(sum_c p(y=c) softmax(phi_c)) with p(y) uniform, by autograd on the formula."""
    t = torch.tensor(np.asarray(phi, np.float64), requires_grad=True)
    m = torch.softmax(t, 1).mean(0)
    (-(m * torch.log(m)).sum()).backward()
    return t.grad.numpy()


ROUNDS = [  # per round: (device, N_s, experts returned, q'(z|s))
    [("a", 10, [0, 1], [0.7, 0.3, 0.0]), ("b", 30, [0], [1.0, 0.0, 0.0]), ("c", 20, [1], [0.0, 1.0, 0.0])],
    [("a", 10, [0, 1, 2], [0.2, 0.5, 0.3]), ("b", 30, [1, 2], [0.0, 0.4, 0.6]), ("c", 20, [1], [0.0, 1.0, 0.0])],
]


@pytest.mark.parametrize("variant", ["label", "cluster"])
def test_fedmix_server_step_over_two_rounds(variant):
    """Alg. 1 lines 6-9 with Eq. 8 and Adam (descent on Delta, the server default), two rounds; expert 2 is
    first used in round 2 (no step in round 1: weights and moments untouched; the step count is shared)."""
    lam, lr = 0.7, 0.02
    s = FedMix(spec=MSPEC, K=3, variant=variant, entropy_weight=lam, server_lr=lr)
    st = s.init(0)
    rng = np.random.default_rng(4)
    if variant == "label":
        st.weights["phi"] = (rng.normal(size=(3, 3)) * 2).astype(np.float32)
    ref = {k: v.astype(np.float64) for k, v in st.weights.items()}
    adam = RefAdam(lr, maximize=False)
    for reps in ROUNDS:
        acc = s.begin(st)
        sent, phis = {}, {}
        for dev, n, ks, q in reps:
            dp = s.plan(st, dev, {})
            sent[dev] = {f"e{k}.{m}": (ref[f"e{k}.{m}"] + rng.normal(size=ref[f"e{k}.{m}"].shape)).astype(np.float32)
                         for k in ks for m in MNAMES}
            extras = {"qzs": np.asarray(q, np.float32)}
            if variant == "label":  # near the server's phi: the regulariser is of the same order as the mean
                phis[dev] = (ref["phi"] + rng.normal(size=(3, 3)) * 0.01).astype(np.float32)
                extras["phi"] = phis[dev]
            s.accumulate(st, acc, dp, dense(dev, n, sent[dev], extras))
        st = s.finish(st, acc)
        delta = {}
        for k in range(3):
            users = [(n, q[k], dev) for dev, n, ks, q in reps if k in ks]
            if not users:
                continue
            z = sum(n * qk for n, qk, _ in users)
            for m in MNAMES:  # Eq. 8: p(s|z=k) = q(z=k|s) N_s / sum_s' q(z=k|s') N_s'
                t = f"e{k}.{m}"
                delta[t] = sum(n * qk / z * (ref[t] - sent[dev][t].astype(np.float64)) for n, qk, dev in users)
        if variant == "label":  # line 8, with the marginal-entropy regulariser (p(y) uniform)
            N = sum(n for _, n, _, _ in reps)
            delta["phi"] = sum(n / N * (ref["phi"] - phis[dev].astype(np.float64)) for dev, n, _, _ in reps)
            reg = lam * marginal_entropy_grad(ref["phi"])
            assert np.abs(reg).max() > 0.3 * np.abs(delta["phi"]).max()  # not negligible at this point
            delta["phi"] = delta["phi"] - reg
        adam.step(ref, delta)
        for k in ref:
            close(st.weights[k], ref[k], atol=2e-6)
    assert ("phi" in st.weights) == (variant == "label")
    assert st.meta["qzs"]["b"] == pytest.approx([0.0, 0.4, 0.6])


def test_fedmix_eq8_weights_use_q_and_sample_counts():
    """Eq. 8 at sgd, server_lr 1: w_k <- sum_s p(s|z=k) w_sk; checked against both ways of getting it wrong."""
    s = FedMix(spec=MSPEC, K=3, server_opt="sgd", server_lr=1.0)
    st = s.init(0)
    rng = np.random.default_rng(5)
    acc = s.begin(st)
    sent = {}
    reps = ROUNDS[1]
    for dev, n, ks, q in reps:
        sent[dev] = {f"e{k}.{m}": rng.normal(size=st.weights[f"e{k}.{m}"].shape).astype(np.float32)
                     for k in ks for m in MNAMES}
        s.accumulate(st, acc, s.plan(st, dev, {}), dense(dev, n, sent[dev], {"qzs": np.asarray(q, np.float32),
                                                                           "phi": np.zeros((3, 3), np.float32)}))
    new = s.finish(st, acc)
    for k in (1, 2):
        t = f"e{k}.fc0.weight"
        users = [(n, q[k], dev) for dev, n, ks, q in reps if k in ks]
        want = sum(n * qk * sent[d][t] for n, qk, d in users) / sum(n * qk for n, qk, _ in users)
        close(new.weights[t], want, atol=1e-5)
        by_n = sum(n * sent[d][t] for n, _, d in users) / sum(n for n, _, _ in users)
        by_q = sum(qk * sent[d][t] for _, qk, d in users) / sum(qk for _, qk, _ in users)
        assert moved(want, by_n) > 0.05 and moved(want, by_q) > 0.05


def test_fedmix_alg2_server_selection():
    """Alg. 2 (App. E): the server sends expert k only if the device's last q(z=k|s) >= 0.9 eta / K; a device
    seen for the first time gets all K; if none passes, its most probable expert; eta is 0 before
    ``prune_after`` rounds have committed."""
    s = FedMix(spec=MSPEC, K=4, eta=1.0)
    st = s.init(0)
    assert s.experts_for(st, "new") == [0, 1, 2, 3]
    st.meta["qzs"] = {"a": [0.23, 0.226, 0.224, 0.32]}  # 0.9 eta / K = 0.225 (eta / K = 0.25 would drop 0, 1)
    assert s.experts_for(st, "a") == [0, 1, 3]
    s2 = FedMix(spec=MSPEC, K=4, eta=1.5)  # 0.9 eta / K = 0.3375: nothing passes
    st.meta["qzs"]["b"] = [0.3, 0.2, 0.33, 0.17]
    assert s2.experts_for(st, "b") == [2]
    late = FedMix(spec=MSPEC, K=4, eta=1.0, prune_after=2)
    st.round = 1
    assert late.experts_for(st, "a") == [0, 1, 2, 3] and late.hparams(st).eta == 0.0
    st.round = 2
    assert late.experts_for(st, "a") == [0, 1, 3] and late.hparams(st).eta == 1.0


def test_fedmix_damping_default_is_the_papers():
    """App. B: pi <- a pi + (1 - a) pi_new with a = 0.75, sent to the device with the plan."""
    s = FedMix(spec=MSPEC, K=2, variant="cluster")
    assert s.plan(s.init(0), "d", {}).hparams["damping"] == 0.75


# ------------------------------------------------------------------------------------------------ FedMix x FedSparse
XSPEC = mlp([6, 5, 4, 3])
XNAMES = ["fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_fedmix_sparse_server_step_over_two_rounds():
    """Round 1 and 2 of FedMix x FedSparse without pruning (docs/fedmix_sparse.md, choices 1 and 2): Adam ascent
    on g_k = sum_s p(s|z=k) z_sk (w_sk - w_k) and descent on FedMix's Delta_phi, one Adam for all; Adamax ascent
    (lr 1e-2) on sum_{s returned k} -(z_sk - theta_k) sigmoid(v_k) / T per expert, unweighted."""
    T, lam, lr = 0.05, 0.7, 0.02
    s = FedMixSparse(spec=XSPEC, K=3, T=T, theta0=0.6, prune_below=0.0, server_lr=lr, entropy_weight=lam)
    st = s.init(0)
    rng = np.random.default_rng(6)
    st.weights["phi"] = (rng.normal(size=(3, 3)) * 2).astype(np.float32)
    ref = {k: v.astype(np.float64) for k, v in st.weights.items()}
    vref = {n[2:]: v.astype(np.float64) for n, v in st.opt.items() if n.startswith("v/")}
    adam, adamax = RefAdam(lr, maximize=False), RefAdamax(1e-2, maximize=True)
    for reps in ROUNDS:
        acc = s.begin(st)
        step, gv = {}, {}
        den = np.zeros(3)
        phis = {}
        for dev, n, ks, q in reps:
            dp = s.plan(st, dev, {})
            tens = {}
            for k in ks:
                for m in XNAMES:
                    t = f"e{k}.{m}"
                    wnew = (ref[t] + rng.normal(size=ref[t].shape) * 0.1).astype(np.float32)
                    i = int(m[2])
                    if i < 2:
                        if m.endswith("weight"):
                            z = rng.random(len(wnew)) < 0.6
                            z[0], z[1] = True, False
                            zk = z
                        tens[t] = TensorUpdate(wnew.shape, wnew[zk], zk)
                        d = np.where((zk[:, None] if wnew.ndim == 2 else zk), wnew.astype(np.float64) - ref[t], 0.0)
                        if m.endswith("bias"):  # line 8 on the mask of this unit's rows
                            key = f"e{k}.fc{i}"
                            th = theta_of(ref[f"{key}.weight"], ref[f"{key}.bias"], vref[key], T)
                            gv[key] = gv.get(key, 0.0) - (zk - th) * sigmoid(vref[key]) / T
                    else:
                        tens[t] = TensorUpdate(wnew.shape, wnew)
                        d = wnew.astype(np.float64) - ref[t]
                    step[t] = step.get(t, 0.0) + n * q[k] * d
                den[k] += n * q[k]
            phis[dev] = (ref["phi"] + rng.normal(size=(3, 3)) * 0.01).astype(np.float32)
            s.accumulate(st, acc, dp, roundtrip(Report("t", dev, n, {"train_loss": 1.0}, tens,
                                                       {"qzs": np.asarray(q, np.float32), "phi": phis[dev]})))
        st = s.finish(st, acc)
        g = {t: -step[t] / den[int(t[1])] for t in step}  # Adam descends on -g_k
        N = sum(n for _, n, _, _ in reps)
        g["phi"] = sum(n / N * (ref["phi"] - phis[dev].astype(np.float64)) for dev, n, _, _ in reps)
        reg = lam * marginal_entropy_grad(ref["phi"])
        assert np.abs(reg).max() > 0.3 * np.abs(g["phi"]).max()  # the regulariser is not negligible here
        g["phi"] = g["phi"] - reg
        adam.step(ref, g)
        adamax.step(vref, gv)
        for k in ref:
            close(st.weights[k], ref[k], atol=2e-6)
        for key, v in vref.items():
            close(st.opt[f"v/{key}"], v, atol=2e-6)
    assert all(st.opt[n].all() for n in st.opt if n.startswith("alive/"))


def test_fedmix_sparse_prunes_each_stepped_expert_by_the_fedsparse_rule():
    """Per expert that some device returned: FedSparse's line 3 (theta < 0.1, best unit survives, cascade
    guard); an expert no device returned is not touched even when its theta is under 0.1."""
    T = 0.05
    s = FedMixSparse(spec=XSPEC, K=2, T=T)
    st = s.init(0)
    th = {0: np.array([0.5, 0.08, 0.12, 0.02, 0.9]), 1: np.array([0.3, 0.6, 0.11, 0.95])}
    for k in (0, 1):
        for i, t in th.items():
            st.opt[f"v/e{k}.fc{i}"] = v_giving(st.weights[f"e{k}.fc{i}.weight"], st.weights[f"e{k}.fc{i}.bias"], t, T)
    acc = s.begin(st)
    dp = s.plan(st, "a", {})
    tens = {}
    for m in XNAMES:  # expert 0 comes back unchanged, every unit active
        w = dp.weights[f"e0.{m}"]
        tens[f"e0.{m}"] = TensorUpdate(w.shape, w, np.ones(len(w), bool) if int(m[2]) < 2 else None)
    s.accumulate(st, acc, dp, roundtrip(Report("t", "a", 5, {}, tens, {"qzs": np.array([1.0, 0.0], np.float32),
                                                                      "phi": np.zeros((3, 2), np.float32)})))
    new = s.finish(st, acc)
    assert new.opt["alive/e0.fc0"].tolist() == [1, 0, 1, 0, 1] and new.opt["alive/e0.fc1"].all()
    assert not new.weights["e0.fc1.weight"][:, [1, 3]].any()
    W1, b1 = new.weights["e0.fc1.weight"], new.weights["e0.fc1.bias"]
    # Adamax moved v by at most its lr (1e-2) before the prune: theta of fc1 stays near th[1], not collapsed
    assert (theta_of(W1, b1, new.opt["v/e0.fc1"], T) > 0.1).all()
    assert new.opt["alive/e1.fc0"].all()  # not returned, not stepped, not pruned
    assert np.array_equal(new.opt["v/e1.fc0"], st.opt["v/e1.fc0"])


def test_fedmix_float16_uploads_travel_as_differences():
    """A FedMix device's float16 upload travels as w_s - w like every other algorithm's (a float16 weight keeps
    ~3 digits of |w|, which swallows a round's small change); Eq. 8 then sees the device's weights."""
    from edge.algorithms.driver import encode_update
    from edge.protocol.wire import Plan
    s = FedMix(spec=MSPEC, K=2, server_opt="sgd", server_lr=1.0, upload_dtype="f2", entropy_weight=0.0)
    st = s.init(0)
    dp = s.plan(st, "a", {})
    rng = np.random.default_rng(7)
    new = {k: (v + 1e-4 * rng.normal(size=v.shape)).astype(np.float32) for k, v in dp.weights.items()
           if k.startswith("e")}
    plan = Plan("t", 1, "a", 1e12, "fedmix", "torch", "0" * 64, dp.weights, dp.hparams, 0, dp.upload)
    rep = Report("t", "a", 10, {}, encode_update(new, plan), {"qzs": np.array([0.6, 0.4], np.float32),
                                                            "phi": st.weights["phi"]})
    acc = s.begin(st)
    s.accumulate(st, acc, dp, roundtrip(rep))
    out = s.finish(st, acc)
    for k, w in new.items():  # sgd at server_lr 1 with one device: the new expert is the device's
        change = np.abs(w.astype(np.float64) - st.weights[k]).max()
        assert np.abs(out.weights[k] - w.astype(np.float64)).max() < 2e-3 * change, k
