"""SFVI and SFVI-Avg (paper 003) at the parameters that hide slips (issue 28): several epochs with an uneven
last batch, N != N_j, priors whose sd is not 1, the diagonal family (the BNN's default) in SFVI-Avg's
barycenter, and every output of a step asserted (SFVI-Avg's theta, the ELBO metric, the local factors).

The references are written here: SFVI-Avg's client loop (its noise streams, N / |B| row weights, N / N_j local
weight, the server term, Adam written out), the diagonal barycenter (sigma* = mean sigma_j), the priors of the
hierarchical BNN (torch.distributions). The device term itself is the torch program's (tests/test_sfvi.py checks
it against an independent ELBO). Tolerances: float32 for what the programs compute, float64 otherwise.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from coordinator.strategies.sfvi import SFVI, SFVIAvg
from edge import randn
from edge.algorithms import sfvi as ES
from edge.algorithms.driver import run_plan
from edge.model import mlp
from edge.protocol.wire import Plan, Report, TensorUpdate
from edge.runtime.program import torch_program
from edge.runtime.state import LocalState
from edge.trainers import make_trainer
from edge.vi import build_model, global_term, init_global, init_local

F64 = torch.float64
EPS32 = float(np.finfo(np.float32).eps)
SPEC = {"arch": "ranef", "p": 2, "groups": 3, "lik": "gaussian", "re_sd": "omega", "beta_sd": 3.0,
        "omega_sd": 2.0, "noise_sd": 0.7}
FULL = {"family": {"G": "full", "L": "full", "C": True}}
B1, B2, AEPS = 0.9, 0.999, 1e-8


def trainer(spec, layout):
    t = make_trainer("torch")
    t.load(torch_program(spec, "sfvi", layout).data)
    return t


def shard(n=7, groups=3, seed=0):
    rng = np.random.default_rng(seed)
    g = np.arange(n) % groups
    X = np.c_[np.ones(n), rng.normal(size=n)]
    y = X @ np.array([0.5, -1.0]) + rng.normal(size=groups)[g] + 0.7 * rng.normal(size=n)
    return np.c_[g, X, y].astype(np.float32), np.zeros(n, np.int64)


def fixed_salt(monkeypatch, salt=5):
    c = itertools.count(salt)
    monkeypatch.setattr(ES.os, "urandom", lambda n: next(c).to_bytes(n, "little"))


class RefAdam:
    """torch's Adam, ascent, written out."""

    def __init__(self, lr):
        self.lr, self.t, self.m, self.v = lr, 0, {}, {}

    def step(self, w, g):
        self.t += 1
        for k, gk in g.items():
            m = self.m[k] = B1 * self.m.get(k, 0.0) + (1 - B1) * gk
            v = self.v[k] = B2 * self.v.get(k, 0.0) + (1 - B2) * gk * gk
            w[k] = w[k] + self.lr * (m / (1 - B1 ** self.t)) / (np.sqrt(v / (1 - B2 ** self.t)) + AEPS)


def sg_inputs(loc, glob):
    """The stop-gradient copies for the full family (L full, coupled)."""
    L = np.eye(len(loc["qL.mu"])) + np.tril(loc["qL.L"], -1)
    return {"sg_muL": loc["qL.mu"], "sg_sL": loc["qL.s"], "sg_muG": glob["qG.mu"], "sg_C": loc["qL.C"],
            "sg_LinvL": np.linalg.inv(L)}


def plan(strategy, weights, hp, seed=3, rnd=2):
    return Plan("r2a0", rnd, "d0", 1e18, strategy, "torch", "0" * 64, weights, hp, seed, {"dtype": "f4"})


# ---------------------------------------------------------------------------------------------- SFVI-Avg client
def test_sfvi_avg_client_against_reference(tmp_path, monkeypatch):
    """m = 2 epochs x 3 batches (3, 3, 1 rows: uneven) of SVI on (theta, eta_G, eta_Lj): per step fresh noise
    from the device's salt (stream round << 32 | step << 1 | which), likelihood rows weighted N / |B|, the
    local term N / N_j, the server term L_0 added to eta_G's gradient, Adam ascent on both copies (lr). Every
    output: the returned (eta_G) and the saved eta_Lj. Kills: N / batch_size for a short batch, klw 1, L_0's
    sign, one noise stream for eps_G and eps_L, the step counter, the lr."""
    fixed_salt(monkeypatch)
    m, f = build_model(SPEC, FULL)
    x, y = shard()
    n, N, lr = len(x), 19, 0.03
    rng = np.random.default_rng(1)
    g0 = {k: (v + rng.normal(size=v.shape) * 0.2).astype(np.float32) for k, v in init_global(m, f, 0).items()}
    hp = {"lr": lr, "epochs": 2, "batch_size": 3, "N": N}
    state = LocalState(tmp_path / "dev")
    rep = run_plan(plan("sfvi_avg", g0, hp), trainer(SPEC, FULL), x, y, state)
    salt = int(state.load(ES.STATE)["salt"][0])
    assert salt == 5

    t = trainer(SPEC, FULL)
    glob = {k: v.astype(np.float64) for k, v in g0.items()}
    loc = init_local(m, f, np.random.default_rng(salt))
    ga, la = RefAdam(lr), RefAdam(lr)
    order = np.random.default_rng(3)
    k, losses = 0, []
    for _ in range(2):
        perm = order.permutation(n)
        for i in range(0, n, 3):
            b = perm[i:i + 3]
            eG = randn.normal(salt, (2 << 32) | (k << 1) | 0, m.n_G)
            eL = randn.normal(salt, (2 << 32) | (k << 1) | 1, m.n_L)
            k += 1
            g32 = {kk: v.astype(np.float32) for kk, v in glob.items()}
            t.set_weights(g32 | {kk: v.astype(np.float32) for kk, v in loc.items()})
            feed = {"x": x[b], "y": y[b], "w": np.full(len(b), N / len(b), np.float32),
                    "eps_G": eG.astype(np.float32), "eps_L": eL.astype(np.float32), "klw": np.float32(N / n),
                    "gmask": np.ones(3, np.float32)}
            feed |= {kk: v.astype(np.float32) for kk, v in sg_inputs(loc, g32).items()}
            lk, g, _ = t.loss_and_grads(feed)
            l0, gl0 = global_term(m, {kk: v.astype(np.float64) for kk, v in g32.items()}, eG)
            losses.append(float(lk) - float(l0))  # the device's loss is -ELBO: its own term less L_0
            ga.step(glob, {kk: -g[kk].astype(np.float64) + gl0[kk] for kk in glob})
            la.step(loc, {kk: -g[kk].astype(np.float64) for kk in loc})
    assert k == 6 and rep.metrics["steps"] == 6
    # the reported train_loss: the mean over steps of the negative ELBO estimate (float32 loss, float64 L_0)
    assert rep.metrics["train_loss"] == pytest.approx(np.mean(losses), rel=1e-5, abs=1e-5)
    # Adam's steps are lr * (a ratio of moments); the inputs match to float32 rounding, so each of the 6 steps
    # agrees to a few float32 ulps of lr (the moments' ratio moves by about as much as its gradient's rounding)
    atol = 6 * 16 * EPS32 * max(1.0, max(np.abs(v).max() for v in glob.values()))
    for kk in glob:
        np.testing.assert_allclose(rep.tensors[kk].dense(), glob[kk], rtol=0, atol=atol, err_msg=kk)
        assert np.abs(glob[kk] - g0[kk]).max() > 0.5 * lr, kk  # every tensor moved
    st = state.load(ES.STATE)
    for kk in loc:
        np.testing.assert_allclose(st[f"eta/{kk}"], loc[kk], rtol=0, atol=atol, err_msg=kk)


# ---------------------------------------------------------------------------------------------- SFVI client
def test_sfvi_client_over_epochs_and_uneven_batches_sends_the_full_data_gradient(tmp_path, monkeypatch):
    """2 epochs x (3, 3, 1) batches: rows weigh 1 / epochs and the local term 1 / batches, so the sum is the
    full-data term once. The report is g / N_j; the ELBO metric is the full-data ELBO (not minus it); the local
    factors take one Adam ascent step of lr (a first Adam step is lr * sign(g)). Kills: klw 1 / batches per
    epoch only, the ELBO's sign, a descent on eta_Lj, the report not divided by N_j."""
    fixed_salt(monkeypatch, 9)
    m, f = build_model(SPEC, FULL)
    x, y = shard()
    n, lr = len(x), 0.02
    rng = np.random.default_rng(2)
    g0 = {k: (v + rng.normal(size=v.shape) * 0.2).astype(np.float32) for k, v in init_global(m, f, 0).items()}
    hp = {"lr": lr, "epochs": 2, "batch_size": 3, "eps_seed": 4, "eps_stream": 6}
    state = LocalState(tmp_path / "dev")
    rep = run_plan(plan("sfvi", g0, hp), trainer(SPEC, FULL), x, y, state)
    salt = int(state.load(ES.STATE)["salt"][0])

    t = trainer(SPEC, FULL)
    loc = init_local(m, f, np.random.default_rng(salt))
    eG = randn.normal(4, 6, m.n_G)
    eL = randn.normal(salt, 2, m.n_L)  # the device's own noise, stream = round
    t.set_weights(g0 | {k: v.astype(np.float32) for k, v in loc.items()})
    feed = {"x": x, "y": y, "w": np.ones(n, np.float32), "eps_G": eG.astype(np.float32),
            "eps_L": eL.astype(np.float32), "klw": np.float32(1.0), "gmask": np.ones(3, np.float32)}
    feed |= {k: v.astype(np.float32) for k, v in sg_inputs(loc, g0).items()}
    loss, g, _ = t.loss_and_grads(feed)
    # float32 sums over 6 batches against one: a few ulps of the largest per-row term, times the 7 rows
    for k in g0:
        want = -g[k].astype(np.float64) / n
        np.testing.assert_allclose(rep.tensors[k].dense(), want, rtol=1e-5, atol=64 * EPS32 * np.abs(want).max(),
                                   err_msg=k)
    assert rep.metrics["elbo"] == pytest.approx(-float(loss), rel=1e-5)
    st = state.load(ES.STATE)
    for k, v in loc.items():
        gk = -g[k].astype(np.float64)
        step = np.where(np.abs(gk) > 1e-4, lr * np.sign(gk), 0.0)
        big = np.abs(gk) > 1e-4
        np.testing.assert_allclose((st[f"eta/{k}"] - v)[big], step[big], rtol=1e-4, err_msg=k)


# ---------------------------------------------------------------------------------------------- servers
def test_sfvi_avg_server_diagonal_barycenter_theta_mean_and_meta():
    """The diagonal family (the BNN's default): sigma* = mean_j sigma_j (not exp of the mean log-sd), mu* the
    mean, theta the unweighted mean; the meta and metrics (participants, 0 iterations), and N = the fleet's
    declared counts over those seen. Kills: the mean of log-sds, theta summed, the seen counts overriding
    the registry's."""
    spec = {"arch": "ranef", "p": 2, "groups": 3, "lik": "gaussian", "re_sd": "theta", "beta_sd": "theta"}
    s = SFVIAvg(spec=spec, layout={"family": {"G": "diag"}})
    st = s.init(0)
    assert set(st.weights) == {"qG.mu", "qG.s", "theta.log_tau", "theta.log_sb"}
    rng = np.random.default_rng(0)
    sent = []
    acc = s.begin(st)
    dp = s.plan(st, "d0", {})
    for i in range(3):
        w = {"qG.mu": rng.normal(size=2), "qG.s": rng.normal(size=2) * 0.8, "theta.log_tau": rng.normal(size=1),
             "theta.log_sb": rng.normal(size=1)}
        w = {k: v.astype(np.float32) for k, v in w.items()}
        sent.append(w)
        s.accumulate(st, acc, dp, Report("t", f"d{i}", 4 + i, {}, {k: TensorUpdate(v.shape, v) for k, v in w.items()}))
    new = s.finish(st, acc)
    W = {k: np.array([w[k] for w in sent], np.float64) for k in sent[0]}
    np.testing.assert_allclose(new.weights["qG.mu"], W["qG.mu"].mean(0), rtol=1e-12)
    np.testing.assert_allclose(new.weights["qG.s"], np.log(np.exp(W["qG.s"]).mean(0)), rtol=1e-12)
    for k in ("theta.log_tau", "theta.log_sb"):
        np.testing.assert_allclose(new.weights[k], W[k].mean(0), rtol=1e-12)
    assert "qG.L" not in new.weights and new.round == 1
    assert s.metrics(new) == {"participants": 3.0, "barycenter_iterations": 0.0}
    assert new.meta["seen"] == {"d0": 4, "d1": 5, "d2": 6}
    s.observe_fleet({"d1": 50, "d9": 7})
    assert s.hparams(new).N == 4 + 50 + 6 + 7
    assert SFVIAvg(spec=spec, total_samples=1000).hparams(new).N == 1000


def test_sfvi_server_elbo_and_silo_weights_scale_by_J_over_S():
    """The round's ELBO estimate is (J / |S|) sum_j elbo_j + L_0, and a report's gradient weighs the N_j the
    device declared (the registry's), not its report's n_samples. Kills: the ELBO unscaled, n_samples as
    the weight."""
    s = SFVI(spec=SPEC, layout=FULL)
    st = s.init(0)
    s.observe_fleet({"a": 10, "b": 30, "c": 5, "e": 8})
    acc = s.begin(st)
    dp = s.plan(st, "a", {})
    rng = np.random.default_rng(0)
    got = {}
    for d, n_rep, elbo in (("a", 3, -4.0), ("b", 7, -9.5)):
        vals = {k: rng.normal(size=sh).astype(np.float32) for k, sh in s.shapes.items()}
        got[d] = vals
        s.accumulate(st, acc, dp, Report("t", d, n_rep, {"elbo": elbo}, {k: TensorUpdate(v.shape, v) for k, v in vals.items()}))
    g, elbo, J = s.gradient(st, acc)
    assert J == 4
    at = {k: np.asarray(v, np.float32).astype(np.float64) for k, v in st.weights.items()}
    l0, gl0 = global_term(s.model, at, s.eps(st))
    assert elbo == pytest.approx(2.0 * (-4.0 - 9.5) + l0, rel=1e-12)
    for k in s.shapes:
        want = 2.0 * (10 * got["a"][k].astype(np.float64) + 30 * got["b"][k].astype(np.float64)) + gl0[k]
        np.testing.assert_allclose(g[k], want, rtol=1e-12, atol=1e-12)
    new = s.finish(st, acc)
    assert s.metrics(new) == {"elbo": pytest.approx(elbo), "J": 4.0, "participants": 2.0}


def test_bnn_priors_with_sds_that_are_not_one():
    """The hierarchical BNN's global prior (mu ~ N(0, mu_sd^2), sigma ~ N+(0, sigma_sd^2) on log sigma with its
    Jacobian) and its local head's prior N(0, head_sd^2), at sds of 0.7, 2.5 and 0.6, against
    torch.distributions. Kills: a missing square or log sd in any of them (hidden at sd 1)."""
    spec = mlp([3, 4, 2])
    lay = {"head": "local", "sigma": "tensor", "mu_sd": 0.7, "sigma_sd": 2.5, "head_sd": 0.6}
    m, f = build_model(spec, lay)
    rng = np.random.default_rng(4)
    eta = {k: rng.normal(size=np.shape(v)) * 0.3 for k, v in init_global(m, f, 0).items()}
    eps = rng.normal(size=m.n_G)
    val, g = global_term(m, eta, eps)
    P = {k: torch.tensor(v, dtype=F64, requires_grad=True) for k, v in eta.items()}
    Z = P["qG.mu"] + torch.exp(P["qG.s"]) * torch.tensor(eps)
    one = torch.ones((), dtype=F64)
    lp = torch.distributions.Normal(0 * one, 0.7 * one).log_prob(Z[:m.n_mu]).sum()
    s_ = Z[m.n_mu:]
    lp = lp + (torch.distributions.HalfNormal(2.5 * one).log_prob(torch.exp(s_)) + s_).sum()
    q = torch.distributions.Normal(torch.tensor(eta["qG.mu"]), torch.exp(torch.tensor(eta["qG.s"])))
    L0 = lp - q.log_prob(Z).sum()
    L0.backward()
    assert val == pytest.approx(L0.item(), rel=1e-12)
    for k in eta:
        np.testing.assert_allclose(g[k], P[k].grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)

    # the device term's head prior: the loss with klw = 1 minus with klw = 0 is -(log p(Z_L) - log q(Z_L | Z_G))
    t = trainer(spec, lay)
    W = {k: (rng.normal(size=v.shape) * 0.3).astype(np.float32) for k, v in t.get_weights().items()}
    t.set_weights(W)
    eG, eL = rng.normal(size=m.n_G).astype(np.float32), rng.normal(size=m.n_L).astype(np.float32)
    feed = {"x": rng.normal(size=(3, 3)).astype(np.float32), "y": np.array([0, 1, 1]), "w": np.ones(3, np.float32),
            "eps_G": eG, "eps_L": eL}
    feed |= ES.stop_grad_inputs(W, W, f)
    l1, _, _ = t.loss_and_grads(feed | {"klw": np.float32(1.0)})
    l0, _, _ = t.loss_and_grads(feed | {"klw": np.float32(0.0)})
    ZL = W["qL.mu"].astype(np.float64) + np.exp(W["qL.s"].astype(np.float64)) * eL
    sd = np.r_[np.ones(m.n_eps), np.full(m.n_L - m.n_eps, 0.6)]
    logp = (-0.5 * (ZL / sd) ** 2 - np.log(sd) - 0.5 * math.log(2 * math.pi)).sum()
    logq = (-0.5 * eL.astype(np.float64) ** 2 - W["qL.s"] - 0.5 * math.log(2 * math.pi)).sum()
    # float32 sums of m.n_L = 42 terms of size <= 10: 64 ulps of the total's magnitude
    assert float(l1) - float(l0) == pytest.approx(-(logp - logq), abs=64 * EPS32 * (abs(logp) + abs(logq) + 10))


@pytest.mark.parametrize("samples", [0, 1, 3])
def test_bnn_predictive_is_the_mean_of_softmaxes_over_the_device_s_draws(tmp_path, samples):
    """predict_proba on the hierarchical BNN: the softmax of each draw's logits, averaged over ``samples`` draws
    of (eps_G, eps_L) from rng(seed) in that order (0: one pass at q's means). The reference draws the noise,
    runs the objective program (checked against a handwritten network in tests/test_sfvi.py) and normalises and
    averages here, in float64: a mean of logits, an unnormalised exp or a sum would each differ."""
    spec, lay = mlp([3, 4, 3]), {"head": "local", "sigma": "weight"}
    m, f = build_model(spec, lay)
    t = trainer(spec, lay)
    state = LocalState(tmp_path / "dev")
    _, _, eta, adam, salt = ES.load_local(state, t)
    rng = np.random.default_rng(8)
    eta = {k: v + rng.normal(size=v.shape) * 0.3 for k, v in eta.items()}  # a posterior that is not q's start
    ES.save_local(state, t, eta, adam, salt)
    glob = {k: (v + rng.normal(size=v.shape) * 0.5).astype(np.float32) for k, v in init_global(m, f, 1).items()}
    x = rng.normal(size=(6, 3)).astype(np.float32) * 2
    got = ES.predict_proba(t, glob, state, x, samples=samples, seed=4)

    draws = np.random.default_rng(4)
    want = np.zeros((6, 3))
    for _ in range(max(samples, 1)):
        eG = draws.standard_normal(m.n_G) if samples else np.zeros(m.n_G)
        eL = draws.standard_normal(m.n_L) if samples else np.zeros(m.n_L)
        t.set_weights({k: v for k, v in glob.items() if k in t.params} | {k: v.astype(np.float32) for k, v in eta.items()})
        feed = {"x": x, "y": np.zeros(6, np.int64), "w": np.zeros(6, np.float32), "klw": np.float32(0),
                "eps_G": eG.astype(np.float32), "eps_L": eL.astype(np.float32)} | ES.stop_grad_inputs(eta, glob, f)
        lg = t.loss_and_grads(feed)[2]["logits"].astype(np.float64)
        want += np.exp(lg - lg.max(1, keepdims=True)) / np.exp(lg - lg.max(1, keepdims=True)).sum(1, keepdims=True)
    want /= max(samples, 1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.sum(1), 1.0, atol=1e-12)
    assert want.max() - want.min() > 0.2  # the classes are told apart: a wrong average moves them
    y = np.r_[want.argmax(1)[:4], want.argmin(1)[4:]]  # evaluate: the share whose most probable class is the label
    acc = ES.evaluate(t, glob, state, x, y, samples=samples, seed=4)
    assert acc == np.mean(want.argmax(1) == y) == 4 / 6


@pytest.mark.parametrize("g, ok", [([0, 1, 2, 2], True), ([0, 3], False), ([-1, 0], False), ([0.5, 1], False),
                                   ([2, 0, 3], False)])
def test_group_ids_outside_the_model_s_groups_are_refused(g, ok):
    """ranef's group column: whole numbers in [0, groups); the mask opens the first max + 1 slots."""
    from edge.algorithms.base import PlanError
    m, _ = build_model(SPEC, FULL)
    x = np.c_[np.array(g, np.float32), np.ones((len(g), 2), np.float32)]
    if ok:
        assert ES.group_mask(m, x)["gmask"].tolist() == [1.0, 1.0, 1.0]
    else:
        with pytest.raises(PlanError, match="group ids"):
            ES.group_mask(m, x)
