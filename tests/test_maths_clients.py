"""The numpy parts of the client halves against independent references (issue 9, "tests that catch wrong maths").

The objectives are checked in test_maths_objectives.py; here the runtime is a recording stub (it returns
gradients and aux tables of our choosing and records what the client fed it), so each client step is checked
on its own: what it feeds the program and what it does with the answer.

- FedMix (paper 004): q_phi(z|s) = E_{y ~ D_s}[q_phi(z|y)] from the label histogram (Sec. 3); the Eq. 9 pooling
  weights; Alg. 2's threshold eta / K and renormalisation (per batch and before sending); App. B's Eq. 13
  (beta = 1) with damping a = 0.75; SGD on experts and phi (lr) and on the private gate (gate_lr).
- FedMix x FedSparse: the gate's coordinates of a sliced expert (``e{k}.units``), Adamax on the thresholds.
- FedSparse (paper 000, Alg. 2): the inputs of the relaxed objective, SGD on w and Adamax on v, and
  z ~ Bern(pi) exactly, tested statistically with tolerances from the binomial variance.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from edge.algorithms.base import Context
from edge.algorithms.driver import run_plan
from edge.algorithms.fedmix import FedMixClient
from edge.algorithms.fedmix_sparse import FedMixSparseClient
from edge.algorithms.fedsparse import FedSparseClient
from edge.runtime.state import LocalState
from edge.protocol.wire import Plan

DAMPING = 0.75  # paper 004 App. B: "our initial pick of alpha = 0.75"
B1, B2, EPS = 0.9, 0.999, 1e-8


def softmax(a, axis=-1):
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def softplus(a):
    return np.logaddexp(0.0, a)


class Stub:
    """A runtime that answers with seeded random gradients and aux tables and records every call."""

    def __init__(self, seed=0, aux_scale=1.0):
        self.rng = np.random.default_rng(seed)
        self.calls: list[dict] = []
        self.aux_scale = aux_scale

    def set_weights(self, w):
        self.weights = {k: np.array(v, np.float64) for k, v in w.items()}

    def loss_and_grads(self, inputs):
        grads = {k: self.rng.normal(size=v.shape) * 0.3 for k, v in self.weights.items()}
        aux = {}
        if "active" in inputs:
            B, k = len(inputs["x"]), len(inputs["active"])
            aux = {"ll": -np.abs(self.rng.normal(size=(B, k))) * 2 * self.aux_scale,
                   "lg": np.log(softmax(self.rng.normal(size=(B, k)) * 2 * self.aux_scale, 1)),
                   "logits": np.zeros((B, k, 3))}
        self.calls.append({"inputs": {k: np.array(v) for k, v in inputs.items()}, "weights": self.weights,
                           "grads": grads, "aux": aux})
        return 0.0, {k: g.astype(np.float32) for k, g in grads.items()}, {k: v.astype(np.float32) for k, v in aux.items()}


def experts(K, sizes, rng, held):
    w = {}
    for k in held:
        for i in range(len(sizes) - 1):
            w[f"e{k}.fc{i}.weight"] = rng.normal(size=(sizes[i + 1], sizes[i])).astype(np.float32)
            w[f"e{k}.fc{i}.bias"] = rng.normal(size=sizes[i + 1]).astype(np.float32)
    return w


def plan_of(strategy, weights, hparams, seed=7):
    return Plan("t", 1, "d", 1e12, strategy, "torch", "0" * 64, weights, hparams, seed, {"dtype": "f4"})


def eq13(pi, aux, held, act, damp):
    """Eq. 13 from one recorded call: the active slots' joint log-likelihood (float32, as the runtime returns it)
    averaged over the batch and softmaxed, damped into pi (``damp`` of the old pi kept)."""
    joint = aux["ll"].astype(np.float32).astype(np.float64) + aux["lg"].astype(np.float32)
    new = np.zeros(len(pi))
    new[act] = softmax(joint[:, [held.index(k) for k in act]].mean(0))
    return damp * pi + (1 - damp) * new


def held_step(E, A, b, g, held, lr, glr):
    """One plain SGD step of a FedMix client replay, from one recorded call's gradients: slot j's copy of expert
    ``held[j]`` at rate ``lr``, and the gate's columns and biases of the held experts at rate ``glr``."""
    for j, k in enumerate(held):
        for n in [m for m in E if m.startswith(f"e{k}.")]:
            E[n] = E[n] - lr * g[f"s{j}.{n.split('.', 1)[1]}"]
        A[:, held] -= glr * g[f"gate.A{j}"]
    b[held] -= glr * g["gate.b"]


def alg2(q, held, eta, K):
    """Alg. 2: the held experts with q >= eta / K (else the best held one), q' zero elsewhere, renormalised."""
    keep = [k for k in held if q[k] >= eta / K] or [max(held, key=lambda k: q[k])]
    qp = np.zeros(K)
    qp[keep] = q[keep]
    return keep, qp / qp.sum()


# ------------------------------------------------------------------------------------------------ FedMix, label
def test_fedmix_label_client_against_reference(tmp_path):
    """q(z|s) = hist(y) @ softmax(phi) (Sec. 3), Alg. 2 per batch (active slots, renormalised pooling weights of
    Eq. 9) and before sending, SGD on experts and phi (lr) and on the gate (gate_lr), over six batches; the
    device holds experts 0, 1 and 3 of K = 4 (the server sent it those)."""
    K, C, H, held = 4, 3, 5, [0, 1, 3]
    sizes = [4, H, C]
    lr, gate_lr, eta = 0.1, 0.37, 0.8  # threshold eta / K = 0.2
    rng = np.random.default_rng(0)
    w = experts(K, sizes, rng, held)
    phi0 = np.array([[2.0, 0.5, 0.0, -1.0], [-1.0, 1.5, 0.5, 0.0], [0.0, -0.5, 1.0, 1.2]], np.float32)
    w["phi"] = phi0
    y = np.array([0] * 18 + [1] * 8 + [2] * 4)  # a skewed label histogram
    x = rng.normal(size=(len(y), 4)).astype(np.float32)
    local = LocalState(tmp_path)
    A0, b0 = rng.normal(size=(H, K)).astype(np.float32), rng.normal(size=K).astype(np.float32)
    local.save("fedmix", {"A": A0, "b": b0, "pi": np.full(K, 0.25), "qs": np.full(K, 0.25), "active": np.ones(K, np.uint8)})
    hp = {"lr": lr, "gate_lr": gate_lr, "epochs": 2, "batch_size": 10, "K": K, "eta": eta, "variant": "label"}
    stub = Stub(1)
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, local)

    hist = np.bincount(y, minlength=C) / len(y)
    E = {k: v.astype(np.float64) for k, v in w.items() if k != "phi"}
    phi, A, b = phi0.astype(np.float64), A0.astype(np.float64), b0.astype(np.float64)
    saw_pruned = False
    for call in stub.calls:
        q = hist @ softmax(phi, 1)
        act, qa = alg2(q, held, eta, K)
        saw_pruned |= len(act) < len(held)
        np.testing.assert_allclose(call["inputs"]["qs"], qa[held], atol=1e-6)
        np.testing.assert_array_equal(call["inputs"]["active"], [1.0 if k in act else 0.0 for k in held])
        cw = call["weights"]
        for j, k in enumerate(held):
            for n in ("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"):
                np.testing.assert_allclose(cw[f"s{j}.{n}"], E[f"e{k}.{n}"], atol=1e-5)
            np.testing.assert_allclose(cw[f"gate.A{j}"], A[:, held], atol=1e-5)
        np.testing.assert_allclose(cw["gate.b"], b[held], atol=1e-5)
        np.testing.assert_allclose(cw["phi"], phi[:, held], atol=1e-5)
        g = call["grads"]
        for j, k in enumerate(held):
            for n in ("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"):
                E[f"e{k}.{n}"] -= lr * g[f"s{j}.{n}"]
            A[:, held] -= gate_lr * g[f"gate.A{j}"]
        b[held] -= gate_lr * g["gate.b"]
        phi[:, held] -= lr * g["phi"]
    assert saw_pruned  # Alg. 2 switched an expert off for some batch
    q = hist @ softmax(phi, 1)
    keep, qp = alg2(q, held, eta, K)
    assert 0 < len(keep) < len(held)
    # the knock-outs: each would give another q(z|s) here, far outside the tolerance below
    assert np.abs(np.full(C, 1 / C) @ softmax(phi, 1) - q).max() > 1e-2  # a uniform label histogram
    assert np.abs(np.full(K, 1 / K) - q).max() > 1e-2  # q_phi(z|y) made uniform
    assert np.abs(qp[held] - np.full(len(held), 1 / len(held))).max() > 1e-2  # uniform pooling weights
    np.testing.assert_allclose(rep.extras["qzs"], qp, atol=1e-6)
    np.testing.assert_allclose(rep.extras["phi"], phi, atol=1e-5)
    assert sorted({n.split(".")[0] for n in rep.tensors}) == [f"e{k}" for k in keep]
    for n, t in rep.tensors.items():
        np.testing.assert_allclose(t.dense(), E[n], atol=1e-5)
    st = local.load("fedmix")
    np.testing.assert_allclose(st["A"], A, atol=1e-5)
    np.testing.assert_allclose(st["b"], b, atol=1e-5)
    np.testing.assert_allclose(st["qs"], qp, atol=1e-9)
    assert st["active"].tolist() == [1 if k in keep else 0 for k in range(K)]


def test_fedmix_threshold_falls_back_to_the_best_held_expert(tmp_path):
    """No held expert reaches eta / K (q's mass is on expert 2, which the device was not sent): keep the held
    expert with the largest q (docs/fedmix.md, choice 5), renormalised to 1."""
    K, C, held = 4, 3, [0, 1, 3]
    rng = np.random.default_rng(1)
    w = experts(K, [4, 5, C], rng, held)
    w["phi"] = np.array([[0.0, 0.3, 4.0, 0.1]] * C, np.float32)
    y = np.array([0, 1, 2] * 4)
    x = rng.normal(size=(12, 4)).astype(np.float32)
    hp = {"lr": 0.0, "gate_lr": 0.0, "epochs": 1, "batch_size": 12, "K": K, "eta": 1.0, "variant": "label"}
    stub = Stub(2)
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, LocalState(tmp_path))
    assert stub.calls[0]["inputs"]["active"].tolist() == [0.0, 1.0, 0.0]
    np.testing.assert_allclose(stub.calls[0]["inputs"]["qs"], [0.0, 1.0, 0.0])
    np.testing.assert_allclose(rep.extras["qzs"], [0.0, 1.0, 0.0, 0.0])


# ------------------------------------------------------------------------------------------------ FedMix, cluster
@pytest.mark.parametrize("damping", [None, 0.6])
def test_fedmix_cluster_eq13_with_damping(tmp_path, damping):
    """App. B: after every batch log pi_new = mean_i log p(y_i, z=k | x_i) - logsumexp_k(...) over the active
    experts, log p(y, z|x) = log p_wk(y|x) + log p_theta(z=k|x, s) (the ``ll`` and ``lg`` tables), then
    pi <- a pi + (1 - a) pi_new with a = 0.75 by default. Alg. 2 on pi: active experts, the pi and the
    pooling weights fed to the program; q'(z|s) reported and kept."""
    K, held, eta = 3, [0, 1, 2], 0.6  # threshold 0.2
    rng = np.random.default_rng(3)
    w = experts(K, [4, 5, 3], rng, held)
    y = rng.integers(0, 3, 40)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    local = LocalState(tmp_path)
    pi0 = np.array([0.5, 0.31, 0.19])  # expert 2 under eta / K = 0.2 (and over the server's 0.9 eta / K)
    local.save("fedmix", {"A": np.zeros((5, K), np.float32), "b": np.zeros(K, np.float32), "pi": pi0,
                          "qs": pi0, "active": np.ones(K, np.uint8)})
    hp = {"lr": 0.05, "epochs": 2, "batch_size": 8, "K": K, "eta": eta, "variant": "cluster"}
    if damping is not None:
        hp["damping"] = damping
    a = DAMPING if damping is None else damping
    stub = Stub(4)
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, local)

    pi = pi0.copy()
    alt = {"no gate term": pi0.copy(), "other damping": pi0.copy(), "batch sum": pi0.copy()}
    for call in stub.calls:
        act, qa = alg2(pi, held, eta, K)
        np.testing.assert_array_equal(call["inputs"]["active"], [1.0 if k in act else 0.0 for k in held])
        np.testing.assert_allclose(call["inputs"]["pi"], qa, atol=1e-6)
        np.testing.assert_allclose(call["inputs"]["qs"], qa, atol=1e-6)
        ll, lg = call["aux"]["ll"].astype(np.float32), call["aux"]["lg"].astype(np.float32)
        joint = ll.astype(np.float64) + lg
        new = np.zeros(K)
        new[act] = softmax(joint[:, act].mean(0))  # Eq. 13, beta = 1
        pi = a * pi + (1 - a) * new
        for name, p in alt.items():  # the same recursion with one piece changed
            j = ll.astype(np.float64) + (0 if name == "no gate term" else lg)
            ak, _ = alg2(p, held, eta, K)
            nn = np.zeros(K)
            nn[ak] = softmax(j[:, ak].sum(0) if name == "batch sum" else j[:, ak].mean(0))
            aa = (0.5 if a != 0.5 else 0.9) if name == "other damping" else a
            alt[name] = aa * p + (1 - aa) * nn
    keep, qp = alg2(pi, held, eta, K)
    assert len(keep) < K  # Alg. 2 pruned on the way
    np.testing.assert_allclose(rep.extras["qzs"], qp, atol=1e-6)
    assert set(rep.extras) == {"qzs"}  # no phi in this variant
    st = local.load("fedmix")
    np.testing.assert_allclose(st["pi"], qp, atol=1e-12)  # the device drops the pruned experts for good
    for name, p in alt.items():
        assert np.abs(alg2(p, held, eta, K)[1] - qp).max() > 1e-3, name


# ------------------------------------------------------------------------------------------------ FedMix x FedSparse
def test_fedmix_sparse_client_gate_coordinates_and_thresholds(tmp_path):
    """Sliced experts keep fixed gate coordinates: slot j's A rows are the units ``e{k}.units`` of the
    unpruned H; its gradient is scattered back to exactly those rows (other rows keep their value). The
    thresholds v get Adamax (v_lr), minimisation, from the plan's values; the program gets theta's logit from
    the plan (fixed for the round), the current group norms and fresh noise in (0, 1)."""
    K, H, C, held = 3, 6, 3, [0, 2]
    T, lr, gate_lr, v_lr = 0.5, 0.1, 0.3, 0.05
    rng = np.random.default_rng(5)
    units = {0: np.array([0, 2, 3, 5]), 2: np.array([1, 2, 4])}
    w = {}
    for k in held:
        h = len(units[k])
        w |= {f"e{k}.fc0.weight": rng.normal(size=(h, 4)), f"e{k}.fc0.bias": rng.normal(size=h),
              f"e{k}.fc0.v": rng.normal(size=h), f"e{k}.fc1.weight": rng.normal(size=(C, h)),
              f"e{k}.fc1.bias": rng.normal(size=C), f"e{k}.units": units[k].astype(np.int32)}
    w = {n: a.astype(np.float32) if a.dtype != np.int32 else a for n, a in w.items()}
    w["phi"] = rng.normal(size=(C, K)).astype(np.float32)
    local = LocalState(tmp_path)
    A0 = rng.normal(size=(H, K)).astype(np.float32)
    local.save("fedmix_sparse", {"A": A0, "b": np.zeros(K, np.float32), "pi": np.full(K, 1 / K),
                                 "qs": np.full(K, 1 / K), "active": np.ones(K, np.uint8)})
    hp = {"lr": lr, "gate_lr": gate_lr, "v_lr": v_lr, "epochs": 1, "batch_size": 10, "K": K, "eta": 0.0,
          "variant": "label", "T": T, "H": H}
    stub = Stub(6)
    x, y = rng.normal(size=(30, 4)).astype(np.float32), rng.integers(0, C, 30)
    rep = run_plan(plan_of("fedmix_sparse", w, hp), stub, x, y, local)

    A = A0.astype(np.float64)
    V = {k: w[f"e{k}.fc0.v"].astype(np.float64) for k in held}
    W = {k: (w[f"e{k}.fc0.weight"].astype(np.float64), w[f"e{k}.fc0.bias"].astype(np.float64)) for k in held}
    m = {k: 0.0 for k in held}
    u_ = {k: 0.0 for k in held}
    theta_logit = {k: (np.sqrt((W[k][0] ** 2).sum(1) + W[k][1] ** 2) - softplus(V[k])) / T for k in held}
    for t, call in enumerate(stub.calls, 1):
        g, inp = call["grads"], call["inputs"]
        for j, k in enumerate(held):
            np.testing.assert_allclose(call["weights"][f"gate.A{j}"], A[units[k]][:, held], atol=1e-5)
        for j, k in enumerate(held):
            np.testing.assert_allclose(inp[f"theta_logit{j}_0"], theta_logit[k], rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(inp[f"norm{j}_0"], np.sqrt((W[k][0] ** 2).sum(1) + W[k][1] ** 2), rtol=1e-5)
            assert ((inp[f"u{j}_0"] > 0) & (inp[f"u{j}_0"] < 1)).all()
            np.testing.assert_allclose(call["weights"][f"s{j}.fc0.v"], V[k], atol=1e-5)
            A[np.ix_(units[k], held)] -= gate_lr * g[f"gate.A{j}"]
            W[k] = (W[k][0] - lr * g[f"s{j}.fc0.weight"], W[k][1] - lr * g[f"s{j}.fc0.bias"])
            gv = g[f"s{j}.fc0.v"]  # Adamax, minimisation (torch's rule, written out)
            m[k] = B1 * m[k] + (1 - B1) * gv
            u_[k] = np.maximum(B2 * u_[k], np.abs(gv) + EPS)
            V[k] = V[k] - v_lr / (1 - B1 ** t) * m[k] / u_[k]
        if t > 1:
            assert not np.array_equal(inp["u0_0"], stub.calls[t - 2]["inputs"]["u0_0"])
    st = local.load("fedmix_sparse")
    np.testing.assert_allclose(st["A"], A, atol=1e-5)
    untouched = np.setdiff1d(np.arange(H), np.concatenate(list(units.values())))
    np.testing.assert_array_equal(st["A"][untouched], A0[untouched])
    assert not any(n.endswith((".v", ".units")) for n in rep.tensors)  # thresholds stay on the device
    for k in held:  # the rows sent are exactly the sampled mask's, with the trained values
        t = rep.tensors[f"e{k}.fc0.weight"]
        assert t.mask is not None and np.array_equal(t.mask, rep.tensors[f"e{k}.fc0.bias"].mask)
        np.testing.assert_allclose(t.dense()[t.mask], W[k][0][t.mask], atol=1e-5)


# ------------------------------------------------------------------------------------------------ FedSparse
def test_fedprox_client_feeds_the_global_weights_and_takes_sgd_steps():
    """Li et al. 2020: every batch's proximal term is to the plan's weights w^t (fixed for the round, not the
    moving local ones), with the plan's mu; SGD (lr) on the local weights; the trained weights sent whole."""
    rng = np.random.default_rng(11)
    w = {"fc0.weight": rng.normal(size=(4, 3)).astype(np.float32), "fc0.bias": rng.normal(size=4).astype(np.float32),
         "fc1.weight": rng.normal(size=(2, 4)).astype(np.float32), "fc1.bias": rng.normal(size=2).astype(np.float32)}
    stub = Stub(12)
    x, y = rng.normal(size=(20, 3)).astype(np.float32), rng.integers(0, 2, 20)
    rep = run_plan(plan_of("fedprox", w, {"lr": 0.3, "mu": 0.45, "epochs": 2, "batch_size": 10}), stub, x, y)
    P = {k: v.astype(np.float64) for k, v in w.items()}
    for call in stub.calls:
        assert float(call["inputs"]["mu"]) == pytest.approx(0.45)
        for k in w:
            np.testing.assert_array_equal(call["inputs"][f"g.{k}"], w[k])
            np.testing.assert_allclose(call["weights"][k], P[k], atol=1e-5)
        P = {k: P[k] - 0.3 * call["grads"][k] for k in P}
    assert len(stub.calls) == 4
    for k, t in rep.tensors.items():
        assert t.mask is None
        np.testing.assert_allclose(t.dense(), P[k], atol=1e-5)


def _sparse_plan_weights(rng, pis, T, n_in=2, n_out=3):
    """One hidden layer whose units have server probability ``pis`` at threshold temperature T."""
    W = (rng.normal(size=(len(pis), n_in)) + 3.0).astype(np.float32)  # norms > T logit(pi): softplus(v) > 0
    b = rng.normal(size=len(pis)).astype(np.float32)
    norm = np.sqrt((W.astype(np.float64) ** 2).sum(1) + b.astype(np.float64) ** 2)
    tau = norm - T * np.log(pis / (1 - pis))
    assert (tau > 0).all()
    v = (tau + np.log(-np.expm1(-tau))).astype(np.float32)
    return {"fc0.weight": W, "fc0.bias": b, "fc0.v": v,
            "fc1.weight": rng.normal(size=(n_out, len(pis))).astype(np.float32),
            "fc1.bias": rng.normal(size=n_out).astype(np.float32)}


def test_fedsparse_client_step_against_reference():
    """Alg. 2 of paper 000: each batch feeds theta's logit (from the plan, fixed for the round), the current
    group norms and fresh noise; SGD (lr) on w, Adamax (v_lr, minimisation) on v."""
    T, lr, v_lr = 0.5, 0.2, 0.03
    rng = np.random.default_rng(7)
    w = _sparse_plan_weights(rng, rng.uniform(0.2, 0.8, 6), T)
    hp = {"lr": lr, "v_lr": v_lr, "epochs": 2, "batch_size": 10, "lambda0": 0.3, "ce_scale": 0.2, "T": T}
    stub = Stub(8)
    x, y = rng.normal(size=(30, 2)).astype(np.float32), rng.integers(0, 3, 30)
    rep = run_plan(plan_of("fedsparse", w, hp), stub, x, y)
    P = {k: v.astype(np.float64) for k, v in w.items()}
    norm = lambda: np.sqrt((P["fc0.weight"] ** 2).sum(1) + P["fc0.bias"] ** 2)
    theta_logit = (norm() - softplus(P["fc0.v"])) / T
    m = u = 0.0
    for t, call in enumerate(stub.calls, 1):
        inp = call["inputs"]
        assert float(inp["lambda0"]) == pytest.approx(0.3) and float(inp["ce_scale"]) == pytest.approx(0.2)
        assert float(inp["T"]) == pytest.approx(T)
        np.testing.assert_allclose(inp["theta_logit0"], theta_logit, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(inp["norm0"], norm(), rtol=1e-5)
        for k in P:
            np.testing.assert_allclose(call["weights"][k], P[k], atol=1e-5)
        g = call["grads"]
        for k in P:
            if k != "fc0.v":
                P[k] = P[k] - lr * g[k]
        m = B1 * m + (1 - B1) * g["fc0.v"]
        u = np.maximum(B2 * u, np.abs(g["fc0.v"]) + EPS)
        P["fc0.v"] = P["fc0.v"] - v_lr / (1 - B1 ** t) * m / u
    assert np.abs(norm() - np.sqrt((w["fc0.weight"].astype(np.float64) ** 2).sum(1) + w["fc0.bias"] ** 2)).max() > 1e-2
    for k in ("fc0.weight", "fc1.weight", "fc1.bias"):
        t = rep.tensors[k]
        np.testing.assert_allclose(t.dense()[t.mask] if t.mask is not None else t.dense(),
                                   P[k][t.mask] if t.mask is not None else P[k], atol=1e-5)


def test_fedsparse_client_mask_is_bernoulli_pi():
    """z ~ Bern(pi) exactly (Alg. 2's last step), pi = sigmoid((||w_g|| - softplus(v_g)) / T) of the trained
    weights. 400 units in four groups of known pi, 60 plan seeds: 6000 draws per group. The frequency of
    z = 1 must be within 5 binomial standard deviations sqrt(pi (1 - pi) / n) of pi (a false alarm has
    probability < 1e-5 per group), and the draws independent across units: per seed, the count of a group's
    100 units has variance 100 pi (1 - pi); we require the observed variance over the 60 seeds below 2.5x
    that (a shared draw per layer would give ~100x)."""
    T, seeds, per = 0.3, 60, 100
    groups = np.array([0.1, 0.35, 0.6, 0.9])
    pis = np.repeat(groups, per)
    rng = np.random.default_rng(9)
    w = _sparse_plan_weights(rng, pis, T)
    hp = FedSparseClient.Hparams.from_wire({"T": T})
    counts = np.zeros((seeds, len(groups)))
    masks = []
    for seed in range(seeds):
        c = FedSparseClient(Context(plan_of("fedsparse", w, {"T": T}, seed=seed), hp, None, None, None, None))
        c.begin()
        z = c.end().masks["fc0.weight"]
        masks.append(z)
        counts[seed] = z.reshape(len(groups), per).sum(1)
    n = seeds * per
    freq = counts.sum(0) / n
    tol = 5 * np.sqrt(groups * (1 - groups) / n)
    assert (np.abs(freq - groups) <= tol).all(), (freq, groups, tol)
    var = counts.var(0, ddof=1)
    assert (var < 2.5 * per * groups * (1 - groups)).all(), var
    assert len({m.tobytes() for m in masks}) == seeds  # each seed its own draw


def test_fedmix_sparse_client_mask_is_bernoulli_pi(tmp_path):
    """The same exact draw per unit of every expert FedMix x FedSparse keeps (FedSparse Alg. 2 in each)."""
    K, C, T, seeds, per = 2, 3, 0.3, 40, 100
    groups = np.array([0.15, 0.5, 0.85])
    rng = np.random.default_rng(10)
    w = {}
    for k in range(K):
        w |= {f"e{k}.{n}": a for n, a in _sparse_plan_weights(rng, np.repeat(groups, per), T, n_out=C).items()}
        w[f"e{k}.units"] = np.arange(len(groups) * per, dtype=np.int32)
    w["phi"] = np.zeros((C, K), np.float32)
    hp = FedMixSparseClient.Hparams.from_wire({"T": T, "K": K, "H": len(groups) * per})
    counts = np.zeros((seeds, K, len(groups)))
    for seed in range(seeds):
        ctx = Context(plan_of("fedmix_sparse", w, {}, seed=seed), hp, None, None, np.array([0, 1, 2]),
                      LocalState(tmp_path / str(seed)))
        c = FedMixSparseClient(ctx)
        c.begin()
        masks, _ = c.masks([0, 1])
        for k in range(K):
            counts[seed, k] = masks[f"e{k}.fc0.weight"].reshape(len(groups), per).sum(1)
    n = seeds * per
    freq = counts.sum(0) / n
    assert (np.abs(freq - groups) <= 5 * np.sqrt(groups * (1 - groups) / n)).all(), freq
    assert not np.array_equal(counts[:, 0], counts[:, 1])  # experts draw independently

