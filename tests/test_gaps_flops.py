"""FLoPS and FLoPS-PA (paper 002): the client halves against a reference written here (issue 28), and the
message maths at the parameters that hide slips: a rho * n that rounds, ties in the top-k, several epochs with
an uneven last batch, lambda > 0, la_lr != lr, and the server step's every output.

The references use nothing of ``edge`` for the maths: the hard-concrete gate, the network, the Lagrangian and
its gradient (torch autograd in float64), the SGD steps, the batch order and the noise draw are written out
here from docs/flops.md. Tolerances are float32's: the client runs float32 programs and numpy float32 SGD,
the reference float64 (see ``tol``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from coordinator.strategies.base import ServerState
from coordinator.strategies.flops import FLoPS, FLoPSPA
from edge import flops as F
from edge.algorithms.driver import run_plan
from edge.model import mlp
from edge.protocol.wire import Plan, Report
from edge.runtime.program import torch_program
from edge.trainers import make_trainer

BETA, GAMMA, ZETA = 2 / 3, -0.1, 1.1  # Louizos et al. 2018
U_EPS = 1e-6
LOG11 = math.log(11.0)
EPS32 = float(np.finfo(np.float32).eps)
SPEC = mlp([5, 4, 3])  # 20 + 4 + 12 + 3 = 39 gated parameters
N_PARAMS = 39
SHAPES = {"fc0.weight": (4, 5), "fc0.bias": (4,), "fc1.weight": (3, 4), "fc1.bias": (3,)}


def tol(steps: int, scale: float) -> float:
    """float32's error on ``steps`` SGD steps of a 2-layer network: each step's update is a float32 forward and
    backward (sums of <= 5 products, a few ulps each, times lr*|g| <= scale) plus the float32 rounding of
    the parameter itself; 64 ulps of ``scale`` per step bounds both with room."""
    return 64 * EPS32 * steps * max(1.0, scale)


def trainer(objective="flops", layout=None):
    t = make_trainer("torch")
    t.load(torch_program(SPEC, objective, layout or {"loss": "ce", "bias": True}).data)
    return t


# ---------------------------------------------------------------------------------------------- reference
def ref_top_k(score, k):
    """k largest, ties to the lower index, ascending (written with a sort on (-score, index))."""
    order = sorted(range(len(score)), key=lambda i: (-float(score[i]), i))[:k]
    return np.array(sorted(order), np.int64)


def ref_keep(n, rho):
    return max(1, min(n, math.floor(rho * n + 0.5)))


def ref_gate(la, u):
    s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + la) / BETA)
    return torch.clamp(s * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def ref_lagrangian(theta, la, x, y, u, lam, rho):
    """Mean cross-entropy of the gated MLP plus lam (mean P(z != 0) - rho), float64 tensors by name."""
    g = {k: theta[k] * ref_gate(la[k], u[k]) for k in SHAPES}
    h = torch.relu(x @ g["fc0.weight"].T + g["fc0.bias"])
    logits = h @ g["fc1.weight"].T + g["fc1.bias"]
    ce = -torch.log_softmax(logits, 1)[torch.arange(len(y)), y].mean()
    p_open = torch.cat([torch.sigmoid(la[k] - BETA * math.log(-GAMMA / ZETA)).reshape(-1) for k in SHAPES])
    return ce + lam * (p_open.mean() - rho)


def ref_client(theta0, la0, x, y, *, seed, lr, la_lr, lam, rho, epochs, batch_size, steps=0):
    """SGD on theta (lr) and log_alpha (la_lr) over the plan's batches; noise from stream 1 of the seed."""
    def split(flat):
        out, i = {}, 0
        for k, s in SHAPES.items():
            n = math.prod(s)
            out[k] = torch.tensor(np.asarray(flat[i:i + n], np.float64).reshape(s), requires_grad=True)
            i += n
        return out

    th, la = split(theta0), split(la0)
    order = np.random.default_rng(seed)
    noise = np.random.default_rng([seed, 1])
    done = 0
    for _ in range(epochs):
        perm = order.permutation(len(x))
        for i in range(0, len(x), batch_size):
            if steps and done >= steps:
                continue
            b = perm[i:i + batch_size]
            u = {k: torch.tensor(noise.uniform(U_EPS, 1 - U_EPS, s).astype(np.float32).astype(np.float64))
                 for k, s in SHAPES.items()}
            loss = ref_lagrangian(th, la, torch.tensor(x[b], dtype=torch.float64), torch.tensor(y[b]), u, lam, rho)
            gth = torch.autograd.grad(loss, list(th.values()) + list(la.values()))
            with torch.no_grad():
                for j, k in enumerate(SHAPES):
                    th[k] -= lr * gth[j]
                    la[k] -= la_lr * gth[len(SHAPES) + j]
            done += 1
    flat = lambda d: np.concatenate([d[k].detach().numpy().ravel() for k in SHAPES])  # noqa: E731
    return flat(th), flat(la), done


def data(n=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, n)


def plan_of(strategy, weights, hp, seed=7):
    return Plan("r1a0", 1, "d0", 1e18, strategy, "torch", "0" * 64, weights, hp, seed, {"dtype": "f4"})


# ---------------------------------------------------------------------------------------------- client halves
def test_flops_pa_client_against_reference():
    """FLoPS-PA's client: rebuild the message (zeros and the rest's mean beyond the top-k), 2 epochs of
    batches 4, 4, 2 (uneven last batch), lambda = 0.8 > 0, la_lr 0.7 != lr 0.2, then the exact-density step
    and the top-k message with k = round(0.3 * 39) = 12 (11.7 rounds up). Every output is asserted: the
    message's four arrays and the metrics. Kills: la stepped with lr (gates 10x slower), lambda or rho not
    fed, the exact-density step skipped, the rest's mean over every log-alpha."""
    rng = np.random.default_rng(3)
    theta = rng.normal(0, 0.7, N_PARAMS).astype(np.float32)
    la = rng.normal(0.5, 1.2, N_PARAMS).astype(np.float32)
    k = F.n_keep(N_PARAMS, 0.3)
    assert k == ref_keep(N_PARAMS, 0.3) == 12
    idx = ref_top_k(la, k)
    rest = np.setdiff1d(np.arange(N_PARAMS), idx)
    msg = {"idx": idx.astype(np.int32), "theta": theta[idx], "log_alpha": la[idx],
           "log_alpha_rest": np.array([la[rest].astype(np.float64).mean()], np.float32)}
    hp = {"lr": 0.2, "la_lr": 0.7, "lam": 0.8, "rho": 0.3, "prune": True, "epochs": 2, "batch_size": 4}
    x, y = data()
    rep = run_plan(plan_of("flops-pa", msg, hp), trainer(), x, y)
    # the reference: rebuild, train, exact density, compress
    th0 = np.zeros(N_PARAMS)
    th0[idx] = theta[idx]
    la0 = np.full(N_PARAMS, np.float64(msg["log_alpha_rest"][0]))
    la0[idx] = la[idx]
    th, la1, steps = ref_client(th0.astype(np.float32), la0.astype(np.float32), x, y, seed=7, lr=0.2, la_lr=0.7,
                                lam=0.8, rho=0.3, epochs=2, batch_size=4)
    assert steps == 6
    assert rep.metrics["steps"] == 6
    p_open = 1 / (1 + np.exp(-(la1 - BETA * math.log(-GAMMA / ZETA))))
    assert rep.metrics["expected_density"] == pytest.approx(p_open.mean(), abs=tol(6, 1))
    top = ref_top_k(la1, k)
    want_la = np.minimum(la1, -LOG11)
    want_la[top] = np.maximum(la1[top], LOG11)
    others = np.setdiff1d(np.arange(N_PARAMS), top)
    e = rep.extras
    np.testing.assert_array_equal(e["idx"], top)
    np.testing.assert_allclose(e["theta"], th[top], rtol=0, atol=tol(6, np.abs(th).max()))
    np.testing.assert_allclose(e["log_alpha"], want_la[top], rtol=0, atol=tol(6, np.abs(la1).max()))
    np.testing.assert_allclose(e["log_alpha_rest"], [want_la[others].mean()], rtol=0, atol=tol(6, np.abs(la1).max()))
    # the gates did move by la_lr's steps (the reference distinguishes la_lr from lr)
    assert np.abs(la1 - la0).max() > 0.03


def test_flops_client_takes_exactly_one_step_and_returns_dense():
    """FLoPS (FedSGD-like): steps = 1, so only the first batch of the first epoch trains, and the report is the
    dense (theta_hat, log_alpha) with no exact-density step, whatever epochs says. Kills: a second step taken
    (>= steps off by one), the dense report's log-alphas pruned, la_lr for theta."""
    rng = np.random.default_rng(4)
    theta = rng.normal(0, 0.7, N_PARAMS).astype(np.float32)
    la = rng.normal(0.0, 1.5, N_PARAMS).astype(np.float32)
    hp = {"lr": 0.3, "la_lr": 0.9, "lam": 1.3, "rho": 0.2, "prune": False, "epochs": 2, "batch_size": 4,
          "steps": 1}
    x, y = data(11, seed=1)
    rep = run_plan(plan_of("flops", {"theta": theta, "log_alpha": la}, hp), trainer(), x, y)
    th, la1, steps = ref_client(theta, la, x, y, seed=7, lr=0.3, la_lr=0.9, lam=1.3, rho=0.2, epochs=2,
                                batch_size=4, steps=1)
    assert steps == 1 and rep.metrics["steps"] == 1
    np.testing.assert_allclose(rep.tensors["theta"].dense(), th, rtol=0, atol=tol(1, np.abs(th).max()))
    np.testing.assert_allclose(rep.tensors["log_alpha"].dense(), la1, rtol=0, atol=tol(1, np.abs(la1).max()))
    assert not rep.extras


# ---------------------------------------------------------------------------------------------- message maths
def test_top_k_compress_and_exact_density_break_ties_to_the_lower_index():
    """Exact ties across the k-th place: the lower indices win, in top_k, compress (idx, theta, log_alpha and
    the rest's mean over the others only) and exact_density. Kills: ties to the higher index, the mean over
    all log-alphas, the rest's mean at the rebuild."""
    la = np.array([0.5, 2.0, 0.5, -1.0, 0.5, 2.0, 0.5], np.float32)
    theta = np.arange(1, 8, dtype=np.float32)
    for k in (1, 2, 3, 4, 5):
        np.testing.assert_array_equal(F.top_k(la, k), ref_top_k(la, k))
    m = F.compress(theta, la, 3)  # 2.0, 2.0 and the first 0.5 (index 0)
    np.testing.assert_array_equal(m.idx, [0, 1, 5])
    np.testing.assert_array_equal(m.theta, [1, 2, 6])
    np.testing.assert_array_equal(m.log_alpha, [0.5, 2.0, 2.0])
    assert m.log_alpha_rest[0] == pytest.approx((0.5 - 1.0 + 0.5 + 0.5) / 4)
    th, lb = F.rebuild(m, 7)
    np.testing.assert_array_equal(th, [1, 2, 0, 0, 0, 6, 0])
    np.testing.assert_allclose(lb, [0.5, 2.0, 0.125, 0.125, 0.125, 2.0, 0.125])
    out = F.exact_density(la, 4)
    np.testing.assert_allclose(out, [LOG11, LOG11, LOG11, -LOG11, -LOG11, LOG11, -LOG11], rtol=1e-6)
    assert F.density(F.pruned(theta, out)) == 4 / 7
    np.testing.assert_array_equal(F.hard_threshold(np.array([-2, 1, 2, -1, 2], np.float32), 2), [-2, 0, 2, 0, 0])


@pytest.mark.parametrize("n, rho", [(39, 0.3), (10, 0.25), (10, 0.35), (7, 0.5), (1210, 0.1), (3, 0.01)])
def test_keep_count_rounds_to_the_nearest(n, rho):
    """k = round(rho n), at least 1 (11.7 -> 12, 2.5 -> 2 and 3.5 -> 4 as Python rounds halves, 3.5 -> 4).
    Kills: truncation (int(rho n)), a ceiling."""
    want = max(1, min(n, round(rho * n)))
    assert F.n_keep(n, rho) == want
    assert FLoPSPA(spec=mlp([n, 1]), rho=rho, loss="mse", bias=False).k == want


# ---------------------------------------------------------------------------------------------- server step
def test_flops_pa_server_step_every_output_uniform_weighting_and_prune_start():
    """Uniform weighting (every report counts 1, whatever its n_samples), the exact-density step from
    prune_start on (round 3 here, not round 2), and lambda's step at the new phi. Asserts theta, log_alpha,
    lambda, round and the metrics. Kills: samples weighting where uniform is asked, pruning a round early,
    lambda stepped at the previous phi."""
    s = FLoPSPA(spec=mlp([4, 1]), rho=0.5, loss="mse", bias=False, lr=0.1, la_lr=0.2, lam_lr=0.5,
                prune_start=3, weighting="uniform")
    assert s.k == 2

    def rep(idx, th, la, rest, n):
        return Report("t", "d", n, {}, {}, {"idx": np.array(idx, np.int32), "theta": np.array(th, np.float32),
                                            "log_alpha": np.array(la, np.float32),
                                            "log_alpha_rest": np.array([rest], np.float32)})

    reports = [rep([0, 2], [1.0, -1.0], [1.0, 3.0], -4.0, 1), rep([1, 2], [2.0, 4.0], [0.5, 1.0], 2.0, 9)]
    theta = (np.array([1, 0, -1, 0]) + np.array([0, 2, 4, 0])) / 2
    phi = (np.array([1, -4, 3, -4]) + np.array([2, .5, 1, 2])) / 2  # (1.5, -1.75, 2, -1)
    top = [0, 2]
    for rnd, prune in ((1, False), (2, True)):  # state.round 1 -> round 2 (no prune); 2 -> 3 (prune)
        st = ServerState(rnd, {"theta": np.zeros(4, np.float32), "log_alpha": np.zeros(4, np.float32)},
                         {"lambda": np.array([0.4])})
        dp = s.plan(st, "d0", {})
        acc = s.begin(st)
        for r in reports:
            s.accumulate(st, acc, dp, r)
        new = s.finish(st, acc)
        want_phi = np.full(4, (phi[1] + phi[3]) / 2)
        want_phi[top] = phi[top]
        if prune:
            want_phi[top] = np.maximum(want_phi[top], LOG11)
            want_phi[[1, 3]] = np.minimum(want_phi[[1, 3]], -LOG11)
        want_theta = np.zeros(4)
        want_theta[top] = theta[top]
        np.testing.assert_allclose(new.weights["theta"], want_theta, rtol=1e-6)
        np.testing.assert_allclose(new.weights["log_alpha"], want_phi, rtol=1e-6)
        f32 = want_phi.astype(np.float32).astype(np.float64)  # the server keeps phi in float32, steps lambda there
        c = np.mean(1 / (1 + np.exp(-(f32 - BETA * math.log(-GAMMA / ZETA))))) - 0.5
        lam = 0.0 if c <= 0 else max(0.0, 0.4 + 0.5 * c)
        assert float(new.opt["lambda"][0]) == pytest.approx(lam, rel=1e-9, abs=1e-12)
        assert new.round == rnd + 1
        mt = s.metrics(new)
        assert mt["lambda"] == pytest.approx(lam, abs=1e-12)
        assert mt["expected_density"] == pytest.approx(np.mean(1 / (1 + np.exp(-(want_phi - BETA * math.log(
            -GAMMA / ZETA))))), rel=1e-6)
        gates = np.clip(1 / (1 + np.exp(-want_phi)) * (ZETA - GAMMA) + GAMMA, 0, 1)
        assert mt["density"] == np.count_nonzero(want_theta * gates) / 4
        hp = s.hparams(new)  # the plan of round new.round + 1: prunes from round 3 (prune_start) on
        assert hp.prune == (new.round + 1 >= 3) and hp.lam == pytest.approx(lam, abs=1e-12) and hp.steps == 0
        assert (hp.lr, hp.la_lr, hp.rho) == (0.1, 0.2, 0.5)


@pytest.mark.parametrize("spe, prune_start, pruned_rounds", [(5, 2, [6, 7]), (3, 1, [1, 2]), (2, 3, [5, 6])])
def test_flops_prune_start_counts_epochs_of_steps_per_epoch_exchanges(spe, prune_start, pruned_rounds):
    """Exchange r (1-based) is in epoch (r - 1) // steps_per_epoch + 1; pruning from epoch prune_start on.
    Kills: r // steps_per_epoch (off by one at an epoch's last exchange), the epoch compared with >."""
    s = FLoPS(spec=mlp([4, 1]), rho=0.5, loss="mse", bias=False, steps_per_epoch=spe, prune_start=prune_start)
    first = (prune_start - 1) * spe + 1
    got = [r for r in range(1, 12) if s.pruning(r)]
    assert got[:2] == pruned_rounds and got[0] == first and got == list(range(first, 12))
    assert not s.pruning(0)


def test_flops_server_mean_is_weighted_by_samples_and_prunes_dense():
    """FLoPS: dense reports, sample-weighted mean of theta and log_alpha, exact density from prune start, and
    lambda at the new phi; every output, and the next plan's one step. Kills: an unweighted mean, the mean left
    unpruned, a plan that lets the client take every batch (steps 0)."""
    s = FLoPS(spec=mlp([4, 1]), rho=0.25, loss="mse", bias=False, lam_lr=2.0, steps_per_epoch=1, prune_start=1)
    st = ServerState(0, {"theta": np.zeros(4, np.float32), "log_alpha": np.zeros(4, np.float32)},
                     {"lambda": np.array([0.0])})
    from edge.protocol.wire import TensorUpdate
    dp = s.plan(st, "d0", {})
    acc = s.begin(st)
    vals = [(np.array([1, 2, 3, 4.]), np.array([0.3, 0.1, -0.2, 0.0]), 1),
            (np.array([-1, 0, 1, 0.]), np.array([0.1, 0.5, 0.1, 0.3]), 3)]
    for th, la, n in vals:
        s.accumulate(st, acc, dp, Report("t", "d", n, {}, {"theta": TensorUpdate((4,), th.astype(np.float32)),
                                                           "log_alpha": TensorUpdate((4,), la.astype(np.float32))}))
    new = s.finish(st, acc)
    th = (vals[0][0] + 3 * vals[1][0]) / 4
    la = (vals[0][1] + 3 * vals[1][1]) / 4  # (0.15, 0.4, 0.025, 0.225): top-1 is index 1
    want = np.minimum(la, -LOG11)
    want[1] = LOG11
    np.testing.assert_allclose(new.weights["theta"], th, rtol=1e-6)
    np.testing.assert_allclose(new.weights["log_alpha"], want, rtol=1e-6)
    f32 = want.astype(np.float32).astype(np.float64)  # phi as the server keeps it
    c = np.mean(1 / (1 + np.exp(-(f32 - BETA * math.log(-GAMMA / ZETA))))) - 0.25
    assert float(new.opt["lambda"][0]) == pytest.approx(max(0.0, 2.0 * c) if c > 0 else 0.0, abs=1e-12)
    hp = s.hparams(new)  # one step from the same point per exchange, never the client's own pruning
    assert (hp.steps, hp.epochs, hp.prune) == (1, 1, False) and hp.lam == float(new.opt["lambda"][0])


@pytest.mark.parametrize("cls", [FLoPSPA, FLoPS])
@pytest.mark.parametrize("kw, ok", [({"rho": 0.0}, False), ({"rho": 1.0}, True), ({"rho": 1.0001}, False),
                                    ({"rho": -0.1}, False), ({"rho0": 0.0}, False), ({"rho0": 1.0}, False),
                                    ({"rho0": 0.999}, True), ({"rho": 1e-9}, True)])
def test_density_targets_are_checked_at_their_edges(cls, kw, ok):
    """rho in (0, 1]: a density of 0 keeps nothing (n_keep would quietly keep one weight), 1 is a dense run;
    rho0, the initial gate density, in (0, 1): at 0 or 1 its log-odds are infinite."""
    args = dict(spec=mlp([4, 3]), loss="mse", bias=False) | kw
    if ok:
        s = cls(**args)
        assert s.k == max(1, min(s.n, round(s.rho * s.n)))
    else:
        with pytest.raises(ValueError, match="rho"):
            cls(**args)
