"""FedMix (paper 004) code paths that no test checked against an independent reference (issue 28, "tests that
catch the bugs nobody listed"):

1. the restart remedy (coordinator/strategies/fedmix.py ``_restart``, docs/fedmix.md "Presets and remedies"),
   decided and carried out by a reference written here, alone and inside ``finish`` (Adam, copied moments,
   the one-off ``pi_init``), and its client half when the gate is reset at the same time;
2. a new device of the clustering variant with no labels yet (``new_device_q`` / ``predict_proba``: the
   uniform mixture over the experts the plan holds), and its first round from the uniform gate and pi;
3. FedMix x FedSparse: the noise of experts that are held but inactive (Alg. 2) in a batch, the mask drawn
   only for the kept experts, and the prediction inputs that switch every surviving unit on;
4. the mixture of a person's torch module (the objective against a float64 numpy forward pass and central
   differences, and the client's stop-gradient copies and gate width);
5. the float32 underflow drop of a kept expert at the end of a round;
6. the gate reset when the gate matrix A changes shape (H or K).

Every reference is numpy float64, written from the paper and docs/fedmix.md; nothing from ``edge`` or
``coordinator`` computes any part of one (only the helpers of tests/test_maths_*.py, themselves references).
The runtime is tests/test_maths_clients.py's recording stub wherever the client half is checked, so what the
client feeds the program and does with its answer is compared, never one runtime with another.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import erf

from coordinator.strategies.fedmix import Accumulator, FedMix
from coordinator.strategies.base import ServerState
from edge.algorithms import fedmix as EF
from edge.algorithms import fedmix_sparse as EFS
from edge.algorithms.driver import run_plan
from edge.model import mlp
from edge.protocol.wire import Report, TensorUpdate
from edge.runtime.program import torch_program
from edge.runtime.state import LocalState
from edge.trainers.torch_backend import TorchTrainer
from edge.trainers.torch_objectives.usermodel import describe
from test_maths_clients import Stub, alg2, eq13, experts, held_step, plan_of, sigmoid, softmax, softplus
from test_maths_server import MNAMES, MSPEC, RefAdam, roundtrip

B1, B2, EPS = 0.9, 0.999, 1e-8  # Adamax's constants (Kingma & Ba), written as numbers
# float32 results against float64 references: a float32 value of O(1) carries a relative error of 6e-8 per
# rounding; the client's few SGD steps and the programs' short dot products (<= 24 terms) and softmaxes add
# up to some hundreds of roundings at most, so 1e-5 relative (plus 1e-6 absolute for values that cross zero)
# is more than 100 times the float32 error and far below every knock-out below (each moves an output by
# 1e-2 or more).
RTOL, ATOL = 1e-5, 1e-6


def close(got, want, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


class RecStub(Stub):
    """The recording stub, with a zero gradient for the tensors in ``frozen`` and an optional ``spec`` (the
    client reads a module's layout from ``trainer.spec``)."""

    def __init__(self, seed, frozen=(), spec=None, aux_scale=1.0):
        super().__init__(seed, aux_scale)
        self.frozen = set(frozen)
        if spec is not None:
            self.spec = spec

    def loss_and_grads(self, inputs):
        loss, g, aux = super().loss_and_grads(inputs)
        for n in self.frozen & set(g):
            g[n] = np.zeros_like(g[n])
            self.calls[-1]["grads"][n] = np.zeros_like(self.calls[-1]["grads"][n])
        return loss, g, aux


def label_replay(calls, E, phi, A, b, held, K, eta, hist, lr, glr, copies=None):
    """Replay the label variant's steps in float64 and check every call's inputs against them: Alg. 2 per batch
    (active slots, Eq. 9 pooling weights q'), the held experts' weights and gate columns, phi's held columns and
    (``copies``: names) the stop-gradient copies of the current hidden weights; then SGD (lr on experts and phi,
    glr on the gate). Mutates and returns (E, phi, A, b) and the active sets seen."""
    seen = []
    for c in calls:
        q = hist @ softmax(phi, 1)
        act, qa = alg2(q, held, eta, K)
        seen.append(act)
        inp, cw, g = c["inputs"], c["weights"], c["grads"]
        np.testing.assert_array_equal(inp["active"], [1.0 if k in act else 0.0 for k in held])
        close(inp["qs"], qa[held])
        for j, k in enumerate(held):
            for n in [m for m in E if m.startswith(f"e{k}.")]:
                close(cw[f"s{j}.{n.split('.', 1)[1]}"], E[n])
            close(cw[f"gate.A{j}"], A[:, held])
            if copies is not None:
                for n in copies:
                    close(inp[f"c{j}_{n.replace('.', '_')}"], E[f"e{k}.{n}"])
        close(cw["gate.b"], b[held])
        close(cw["phi"], phi[:, held])
        held_step(E, A, b, g, held, lr, glr)
        phi[:, held] -= lr * g["phi"]
    return E, phi, A, b, seen


# ================================================================================ 1. the restart remedy
def ref_restart(rnd, every, K, qzs, loss, prev):
    """docs/fedmix.md's remedy, written out. Returns (owners to record or None, the firing or None); a firing is
    (worst, victim, moved devices, reset pis)."""
    if rnd % every != 0 or len(loss) < 2:
        return None, None
    owner = {}
    for d, q in qzs.items():
        top = max(q)
        owner[d] = [k for k in range(K) if q[k] == top][0]  # ties: the lowest expert id
    by = {k: sorted(d for d in owner if owner[d] == k) for k in range(K)}
    mean = {}
    for k in range(K):
        ls = [loss[d] for d in by[k] if d in loss]  # devices absent from this round have no loss
        if ls:
            mean[k] = sum(ls) / len(ls)
    if len(mean) < 2 or prev != owner:
        return (owner if len(mean) >= 2 else None), None
    ms = sorted(mean.values())
    med = ms[len(ms) // 2] if len(ms) % 2 else 0.5 * (ms[len(ms) // 2 - 1] + ms[len(ms) // 2])
    # the most devices (ties: the higher mean loss, then the lower id); the fewest (ties: the higher mean loss;
    # an expert nobody reported on counts as the worst fit, then the lower id)
    worst = sorted(range(K), key=lambda k: (-len(by[k]), -mean.get(k, -np.inf), k))[0]
    victim = sorted(range(K), key=lambda k: (len(by[k]), -mean.get(k, np.inf), k))[0]
    if worst == victim or len(by[worst]) < 2 * max(1, len(by[victim])) or mean.get(worst, 0.0) <= med:
        return owner, None
    ranked = sorted(by[worst], key=lambda d: (-loss.get(d, 0.0), d))  # absent: loss 0; ties by id
    moved = set(ranked[: len(ranked) // 2])
    reset = {}
    for d in by[worst]:
        pi = [0.1 / (K - 1)] * K
        pi[victim if d in moved else worst] = 0.9
        reset[d] = pi
    for d in by[victim]:
        reset[d] = [1.0 / K] * K
    return owner, (worst, victim, moved, reset)


def _q(owner, K, tie=False):
    q = [0.05] * K
    q[owner] = 0.85 - 0.05 * (K - 4)
    if tie:  # argmax tie between the owner and the next expert: the lower id owns
        q[owner], q[(owner + 1) % K] = 0.45, 0.45
    return [float(v) for v in q]


# devices d1 .. d12 (ids whose string order is not their numeric order); each scenario: owners, losses
# (None: absent from this round), and the expected decision is the reference's.
_S_FIRE = {"owners": {"d1": 1, "d10": 1, "d2": 1, "d3": 1, "d4": 1, "d5": 2, "d6": 2, "d7": 2, "d8": 0, "d9": 0,
                      "d11": 3, "d12": 3},
           # expert 1: mean 2.125 over the 4 reporting (2.0, 3.0, 2.0, 1.5; d4 absent); means 0.5, 2.125, 2.0,
           # 2.1: median 2.05, fires. With d4 counted as a loss of 0: 1.7 < the median 1.85, no fire. Victim tie
           # between experts 0 and 3 (2 devices each), broken by the higher mean loss: 3. Moved: d10 (3.0) and
           # d1 (2.0, tied with d2, lower id).
           "loss": {"d1": 2.0, "d10": 3.0, "d2": 2.0, "d3": 1.5, "d4": None, "d5": 1.5, "d6": 2.0, "d7": 2.5,
                    "d8": 0.4, "d9": 0.6, "d11": 1.9, "d12": 2.3}}
_S_AT_MEDIAN = {"owners": {"a": 0, "b": 0, "c": 0, "d": 0, "e": 1, "f": 1, "g": 2, "h": 3},
                # means 2.0, 1.0, 2.0, 3.0: median 2.0 = the crowded expert's mean: no fire (<= median)
                "loss": {"a": 1.0, "b": 3.0, "c": 2.5, "d": 1.5, "e": 1.0, "f": 1.0, "g": 2.0, "h": 3.0}}
_S_TWICE = {"owners": {"a": 2, "b": 2, "c": 2, "d": 2, "e": 0, "f": 0, "g": 1, "h": 1, "i": 3, "j": 3},
            # 4 devices = exactly twice the least used (2): fires; the victim tie (0, 1, 3 with 2 each) goes to
            # the highest mean, expert 0
            "loss": {"a": 4.0, "b": 1.0, "c": 3.0, "d": 2.0, "e": 2.0, "f": 2.2, "g": 0.5, "h": 0.5, "i": 1.0,
                     "j": 1.0}}
_S_ALONE = {"owners": {"a": 0, "b": 1, "c": 2},
            # one device per expert, expert 3 unused: 1 < 2 * max(1, 0): no fire (with 2 * 0 it would)
            "loss": {"a": 1.0, "b": 3.0, "c": 2.0}}


def _scenario_state(s, sc, rnd, K, tie=()):
    st = s.init(0)
    qzs = {d: _q(o, K, tie=d in tie) for d, o in sc["owners"].items()}
    acc = Accumulator({}, np.zeros(K), None, loss={d: v for d, v in sc["loss"].items() if v is not None})
    return ServerState(rnd, st.weights, dict(st.opt), {"qzs": qzs, "restarts": []}), acc


@pytest.mark.parametrize("name,sc,tie", [("fire", _S_FIRE, ("d8",)), ("at_median", _S_AT_MEDIAN, ()),
                                         ("twice", _S_TWICE, ("e",)), ("alone", _S_ALONE, ())])
def test_restart_rule_against_reference(name, sc, tie):
    """The rule at rounds 7 (not a check), 5 then 10 (first look records the owners, the second fires if the
    partition is locked in) and, for a firing, a changed owner (no fire). Every output: the recorded owners,
    the overwritten expert (weights and Adam moments copied from the crowded one), the one-off pi_init of
    each device, the restart log, and nothing else touched."""
    K = 4
    s = FedMix(spec=MSPEC, K=K, variant="cluster", preset="remedy", restart_every=5)
    st, acc = _scenario_state(s, sc, 7, K, tie)
    rng = np.random.default_rng(4)
    for k in range(K):
        for n in MNAMES:
            st.weights[f"e{k}.{n}"] = rng.normal(size=st.weights[f"e{k}.{n}"].shape).astype(np.float32)
            for mv in ("m", "v"):
                st.opt[f"adam/{mv}/e{k}.{n}"] = rng.uniform(0.1, 1, size=st.weights[f"e{k}.{n}"].shape)
    before_w = {k: v.copy() for k, v in st.weights.items()}
    before_o = {k: v.copy() for k, v in st.opt.items()}
    loss = dict(acc.loss)
    s._restart(st, acc)  # round 7: no check at all
    assert "owners" not in st.meta and "reset" not in st.meta
    prev = None
    for rnd in (5, 10):
        st.round = rnd
        owners, fire = ref_restart(rnd, 5, K, st.meta["qzs"], loss, prev)
        s._restart(st, acc)
        assert st.meta.get("owners") == owners
        prev = owners
    if name == "fire" or name == "twice":
        assert fire is not None
    else:
        assert fire is None
    if fire is None:
        assert "reset" not in st.meta and st.meta["restarts"] == []
        for k in before_w:
            np.testing.assert_array_equal(st.weights[k], before_w[k])
        return
    worst, victim, moved, reset = fire
    if name == "fire":
        assert (worst, victim, moved) == (1, 3, {"d10", "d1"})
    assert st.meta["restarts"] == [[10, worst, victim]]
    assert set(st.meta["reset"]) == set(reset)
    for d, pi in reset.items():
        close(st.meta["reset"][d], pi, rtol=0, atol=1e-15)
    for k in range(K):
        src = worst if k == victim else k
        for n in MNAMES:
            np.testing.assert_array_equal(st.weights[f"e{k}.{n}"], before_w[f"e{src}.{n}"])
            for mv in ("m", "v"):
                np.testing.assert_array_equal(st.opt[f"adam/{mv}/e{k}.{n}"], before_o[f"adam/{mv}/e{src}.{n}"])
    # a device of the crowded expert changes owner: not locked in, no second firing, owners re-recorded
    st.meta.pop("reset")
    d0 = sorted(sc["owners"])[0]
    st.meta["qzs"][d0] = _q((sc["owners"][d0] + 1) % K, K)
    st.round = 15
    owners, fire = ref_restart(15, 5, K, st.meta["qzs"], loss, st.meta["owners"])
    s._restart(st, acc)
    assert fire is None and "reset" not in st.meta and st.meta["owners"] == owners


def _report(dev, n, tensors, q, loss):
    return roundtrip(Report("t", dev, n, {"train_loss": loss},
                            {k: TensorUpdate(v.shape, np.asarray(v, np.float32)) for k, v in tensors.items()},
                            {"qzs": np.asarray(q, np.float32)}))


def test_restart_inside_finish_copies_the_stepped_expert_and_its_moments_then_plans_carry_pi_init():
    """Three server steps (Eq. 8, Adam descent on Delta, server lr 0.05) of the clustering variant with the
    remedy, rounds 4 -> 5 (first look), 9 -> 10 (fires), 10 -> 11; the reference steps Adam in float64 and
    applies the restart to the stepped weights and moments. Then the plans carry pi_init once."""
    K, lr = 4, 0.05
    s = FedMix(spec=MSPEC, K=K, variant="cluster", preset="remedy", server_lr=lr)
    st0 = s.init(0)
    st = ServerState(4, st0.weights, st0.opt, st0.meta)
    ref = {k: v.astype(np.float64) for k, v in st.weights.items()}
    adam = RefAdam(lr, maximize=False)
    rng = np.random.default_rng(12)
    owners = {"a": 0, "b": 0, "c": 0, "d": 0, "e": 0, "f": 1, "g": 2, "h": 2, "i": 3, "j": 3}
    loss = {"a": 2.5, "b": 0.9, "c": 2.5, "d": 1.0, "e": 3.0, "f": 0.2, "g": 0.6, "h": 0.8, "i": 0.3, "j": 0.5}
    ns = {d: 5 + 3 * i for i, d in enumerate(sorted(owners))}
    rounds = [sorted(owners), sorted(owners), ["a", "f"]]
    for r, devs in enumerate(rounds):
        acc = s.begin(st)
        sent = {}
        for d in devs:
            ks = EF.expert_ids(s.plan(st, d, {}).weights)
            sent[d] = {f"e{k}.{m}": (ref[f"e{k}.{m}"] + rng.normal(size=ref[f"e{k}.{m}"].shape) * 0.3)
                       .astype(np.float32) for k in ks for m in MNAMES}
            q = np.full(K, 0.05)
            q[owners[d]] = 0.85
            s.accumulate(st, acc, s.plan(st, d, {}), _report(d, ns[d], sent[d], q, loss[d]))
        st = s.finish(st, acc)
        delta = {}
        for k in range(K):
            users = [(ns[d], 0.85 if owners[d] == k else 0.05, d) for d in devs if f"e{k}.fc0.weight" in sent[d]]
            z = sum(n * q for n, q, _ in users)
            for m in MNAMES:
                t = f"e{k}.{m}"
                delta[t] = sum(n * q / z * (ref[t] - sent[d][t].astype(np.float64)) for n, q, d in users)
        adam.step(ref, delta)
        if r == 1:  # the remedy: worst 0 (5 devices, mean 1.98 > median 0.55), victim 1 (1 device)
            for m in MNAMES:
                ref[f"e1.{m}"] = ref[f"e0.{m}"].copy()
                adam.m[f"e1.{m}"], adam.v[f"e1.{m}"] = adam.m[f"e0.{m}"].copy(), adam.v[f"e0.{m}"].copy()
            assert st.meta["restarts"] == [[10, 0, 1]]
            moved = {"e", "a"}  # the highest losses: e (3.0), then a and c tie at 2.5 -> a
            want = {d: ([0.9 if k == (1 if d in moved else 0) else 0.1 / 3 for k in range(K)]) for d in "abcde"}
            want["f"] = [0.25] * 4
            assert set(st.meta["reset"]) == set(want)
            for d, pi in want.items():
                close(st.meta["reset"][d], pi, rtol=0, atol=1e-15)
                p = s.plan(st, d, {}).weights["pi_init"]
                assert p.dtype == np.float64
                close(p, pi, rtol=0, atol=1e-15)
            assert "pi_init" not in s.plan(st, "g", {}).weights
        else:
            assert "reset" not in st.meta
        for k in ref:
            close(st.weights[k], ref[k], rtol=1e-5, atol=2e-6)
        for k in range(K):
            for m in MNAMES:
                close(st.opt[f"adam/m/e{k}.{m}"], adam.m[f"e{k}.{m}"], rtol=1e-5, atol=1e-9)
                close(st.opt[f"adam/v/e{k}.{m}"], adam.v[f"e{k}.{m}"], rtol=1e-5, atol=1e-12)
        st = ServerState(st.round + (4 if r == 0 else 0), st.weights, st.opt, st.meta)
    assert st.round == 11 and "pi_init" not in s.plan(st, "a", {}).weights


def test_a_restarted_device_is_sent_every_expert_even_with_pruning():
    """With Alg. 2 pruning on (eta 1: experts with stored q >= 0.9 / K = 0.225), a device the remedy moves to the
    copy had stored q ~0 on it, so Alg. 2 alone would not send it the copy and its pi_init's 0.9 would sit on an
    expert it does not hold (the client then keeps its old best expert and cannot move). A restarted device is
    sent every expert for that round, as a new device is (docs/fedmix.md: "Eq. 13 then moves every device to
    whichever expert fits it"); the others keep Alg. 2's selection from their stored q, and so does everyone
    once the reset is dropped at the next commit."""
    K = 4
    s = FedMix(spec=MSPEC, K=K, variant="cluster", preset="remedy", eta=1.0)
    st, acc = _scenario_state(s, _S_FIRE, 5, K, ("d8",))
    s._restart(st, acc)
    st.round = 10
    s._restart(st, acc)
    assert st.meta["restarts"] == [[10, 1, 3]]
    for d in sorted(_S_FIRE["owners"]):
        p = s.plan(st, d, {}).weights
        if d in st.meta["reset"]:
            assert EF.expert_ids(p) == list(range(K))
            close(p["pi_init"], st.meta["reset"][d], rtol=0, atol=1e-15)
        else:  # Alg. 2 on the stored q: 0.85 on its owner (the tie 0.45, 0.45 keeps both), 0.05 elsewhere
            q = st.meta["qzs"][d]
            assert EF.expert_ids(p) == [k for k in range(K) if q[k] >= 0.9 * 1.0 / K] and "pi_init" not in p
    st.meta.pop("reset")
    assert EF.expert_ids(s.plan(st, "d10", {}).weights) == [1]


# ================================================================================ 2. a new device, cluster variant
def _mlp_probs(w, k, x):
    """p_wk(y|x) of a ReLU MLP expert ``e{k}.fc{i}`` in float64, and its last hidden features."""
    h = x.astype(np.float64)
    n = len([m for m in w if m.startswith(f"e{k}.fc") and m.endswith(".weight")])
    feat = h
    for i in range(n):
        feat = h
        h = h @ np.asarray(w[f"e{k}.fc{i}.weight"], np.float64).T + np.asarray(w[f"e{k}.fc{i}.bias"], np.float64)
        if i < n - 1:
            h = np.maximum(h, 0)
    return softmax(h, 1), feat


def test_new_cluster_device_without_labels_predicts_with_the_uniform_mixture_of_the_held_experts(tmp_path):
    """docs/fedmix.md "A new device", clustering variant: with no labelled data q(z|s*) is uniform over the
    experts the plan holds (here 0, 1 and 3 of K = 4: no phi, so K is the largest id + 1), and
    p(y|x,s*) = sum_k q_k p_wk(y|x). With labels (a contrast) q is Eq. 13 over those experts."""
    K, C = 4, 4
    held = [0, 1, 3]
    rng = np.random.default_rng(6)
    w = experts(K, [5, 6, C], rng, held)
    for k in held:  # experts that disagree strongly
        w[f"e{k}.fc1.bias"] = (3.0 * rng.normal(size=C)).astype(np.float32)
    local = LocalState(tmp_path)
    q = EF.new_device_q(w, "cluster", K, None)
    np.testing.assert_array_equal(q, [1 / 3, 1 / 3, 0.0, 1 / 3])
    np.testing.assert_array_equal(EF.new_device_q(w, "cluster", K, np.zeros(0, np.int64), np.zeros((0, 3))), q)
    lay = EF.kept_layout(w, local, variant="cluster")
    assert lay["slots"] == [[5, 6, C]] * 3 and lay["variant"] == "cluster"
    tr = TorchTrainer(threads=1)
    tr.load(torch_program(mlp([5, 6, C]), "mixture", lay).data)
    x = rng.normal(size=(9, 5)).astype(np.float32)
    pk = {k: _mlp_probs(w, k, x)[0] for k in held}
    want = sum(pk[k] for k in held) / 3
    for kw in ({}, {"local": (x[:0], np.zeros(0, np.int64))}, {"local": (x, None)}):
        got = EF.predict_proba(tr, w, local, x, variant="cluster", **kw)
        close(got, want)
    # with labels: Eq. 13 at the uniform gate, softmax_k mean_i log p_wk(y_i|x_i), over the held experts
    xl, yl = rng.normal(size=(12, 5)).astype(np.float32), rng.integers(0, C, 12)
    ll = np.stack([np.log(_mlp_probs(w, k, xl)[0][np.arange(12), yl]) for k in held], 1)
    qe = softmax(ll.mean(0))
    got = EF.predict_proba(tr, w, local, x, variant="cluster", local=(xl, yl))
    close(got, sum(qe[i] * pk[k] for i, k in enumerate(held)))
    assert np.abs(qe - 1 / 3).max() > 0.05 and np.abs(got - want).max() > 1e-2  # the two rules differ here
    assert local.load(EF.STATE) is None  # predicting saves nothing


def test_new_cluster_device_first_round_starts_from_the_uniform_gate_and_pi(tmp_path):
    """Its first round (no saved state): A = 0, b = 0 and pi uniform over the K experts (docs/fedmix.md choices 2
    and 9), held experts 0, 2, 3 of K = 4, eta 0, 3 epochs of batches 4, 4, 3; Eq. 13 (with the gate term) and
    damping 0.6 per batch; the report and saved state."""
    K, H, held, lr, glr, damp = 4, 5, [0, 2, 3], 0.07, 0.19, 0.6
    rng = np.random.default_rng(9)
    w = experts(K, [4, H, 3], rng, held)
    x, y = rng.normal(size=(11, 4)).astype(np.float32), rng.integers(0, 3, 11)
    hp = {"lr": lr, "gate_lr": glr, "epochs": 3, "batch_size": 4, "K": K, "eta": 0.0, "variant": "cluster",
          "damping": damp}
    local = LocalState(tmp_path)
    stub = RecStub(3, aux_scale=0.7)
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, local)
    assert [len(c["inputs"]["x"]) for c in stub.calls] == [4, 4, 3] * 3
    E = {k: v.astype(np.float64) for k, v in w.items()}
    A, b, pi = np.zeros((H, K)), np.zeros(K), np.full(K, 1.0 / K)
    for c in stub.calls:
        act, qa = alg2(pi, held, 0.0, K)
        assert act == held
        close(c["inputs"]["pi"], qa[held])
        close(c["inputs"]["qs"], qa[held])
        for j, k in enumerate(held):
            close(c["weights"][f"gate.A{j}"], A[:, held])
            for n in MNAMES:
                close(c["weights"][f"s{j}.{n}"], E[f"e{k}.{n}"])
        close(c["weights"]["gate.b"], b[held])
        held_step(E, A, b, c["grads"], held, lr, glr)
        pi = eq13(pi, c["aux"], held, held, damp)
    keep, qp = alg2(pi, held, 0.0, K)
    close(rep.extras["qzs"], qp)
    assert set(rep.extras) == {"qzs"} and rep.metrics["experts"] == 3 and rep.metrics["steps"] == 9
    for n, t in rep.tensors.items():
        close(t.dense(), E[n])
    assert sorted(rep.tensors) == sorted(E)
    st = local.load(EF.STATE)
    close(st["A"], A)
    close(st["b"], b)
    close(st["pi"], qp, rtol=1e-12, atol=1e-15)
    close(st["qs"], qp, rtol=1e-12, atol=1e-15)
    assert st["active"].tolist() == [1, 0, 1, 1]


# ================================================================================ 3. FedMix x FedSparse, inactive experts
def _sparse_experts(rng, T, layers):
    """Sliced experts with 2 gated hidden layers each ([4, h0, h1, 3]), thresholds v placing theta in (0.2, 0.8),
    and their last hidden units' coordinates in the gate (H = 4)."""
    w = {}
    for k, (h0, h1, units) in layers.items():
        sizes = [4, h0, h1, 3]
        for i in range(3):
            W = rng.normal(size=(sizes[i + 1], sizes[i]))
            bb = rng.normal(size=sizes[i + 1])
            w[f"e{k}.fc{i}.weight"], w[f"e{k}.fc{i}.bias"] = W.astype(np.float32), bb.astype(np.float32)
            if i < 2:
                norm = np.sqrt((W.astype(np.float32).astype(np.float64) ** 2).sum(1)
                               + bb.astype(np.float32).astype(np.float64) ** 2)
                tau = norm - T * np.log(rng.uniform(0.25, 0.75, len(norm)) / 0.5)
                w[f"e{k}.fc{i}.v"] = (tau + np.log(-np.expm1(-tau))).astype(np.float32)
        w[f"e{k}.units"] = np.asarray(units, np.int32)
    return w


def test_fedmix_sparse_inactive_expert_noise_masks_and_report(tmp_path):
    """Label variant, held experts 0, 1, 2 of K = 3 with expert 1 below eta / K (inactive in every batch, phi's
    gradient zero so q stays put), 2 epochs of batches 4, 4, 2. Per call: noise u ~ U(1e-6, 1 - 1e-6) float32
    for every held expert (the inactive one too) and every gated layer, in slot then layer order, from stream 1
    continued across steps; theta's logit from the plan (fixed), the current group norms, lambda0, ce_scale, T.
    SGD on w, Adamax (v_lr) on every held expert's v, the gate's sliced rows. At the end the mask z = U < pi is
    drawn from stream 2 for the kept experts only (0 then 2), and ``kept`` is the mean of the layers' means."""
    K, C, T, seed = 3, 3, 0.4, 13
    lr, glr, v_lr, eta, lam0, ce = 0.08, 0.21, 0.03, 0.6, 0.02, 0.003
    rng = np.random.default_rng(17)
    layers = {0: (5, 4, [0, 1, 2, 3]), 1: (3, 3, [0, 2, 3]), 2: (4, 2, [1, 3])}
    held = [0, 1, 2]
    w = _sparse_experts(rng, T, layers)
    w["phi"] = np.array([[1.0, -2.5, 0.3], [0.2, -1.5, 1.1], [-0.4, 0.0, 0.5]], np.float32)
    y = np.array([0, 0, 1, 1, 1, 2, 0, 1, 1, 0])
    x = rng.normal(size=(10, 4)).astype(np.float32)
    H = 4
    A0, b0 = rng.normal(size=(H, K)).astype(np.float32), rng.normal(size=K).astype(np.float32)
    local = LocalState(tmp_path)
    local.save("fedmix_sparse", {"A": A0, "b": b0, "pi": np.full(K, 1 / K), "qs": np.full(K, 1 / K),
                                 "active": np.ones(K, np.uint8)})
    hp = {"lr": lr, "gate_lr": glr, "v_lr": v_lr, "epochs": 2, "batch_size": 4, "K": K, "eta": eta,
          "variant": "label", "T": T, "H": H, "lambda0": lam0, "ce_scale": ce}
    stub = RecStub(5, frozen={"phi"})
    rep = run_plan(plan_of("fedmix_sparse", w, hp, seed=seed), stub, x, y, local)
    assert [len(c["inputs"]["x"]) for c in stub.calls] == [4, 4, 2] * 2

    hist = np.bincount(y, minlength=C) / len(y)
    q = hist @ softmax(w["phi"].astype(np.float64), 1)
    act, qa = alg2(q, held, eta, K)
    assert act == [0, 2] and q[1] < eta / K  # expert 1 is held and inactive
    P = {n: np.asarray(a, np.float64) for n, a in w.items() if not n.endswith(".units") and n != "phi"}
    A, b = A0.astype(np.float64), b0.astype(np.float64)
    mv = {n: (0.0, 0.0) for n in P if n.endswith(".v")}
    noise = np.random.default_rng([seed, 1])

    def norms(k, i):
        return np.sqrt((P[f"e{k}.fc{i}.weight"] ** 2).sum(1) + P[f"e{k}.fc{i}.bias"] ** 2)

    theta_logit = {(k, i): (norms(k, i) - softplus(P[f"e{k}.fc{i}.v"])) / T for k in held for i in (0, 1)}
    for t, c in enumerate(stub.calls, 1):
        inp, g = c["inputs"], c["grads"]
        np.testing.assert_array_equal(inp["active"], [1.0, 0.0, 1.0])
        close(inp["qs"], qa[held])
        close([inp["lambda0"], inp["ce_scale"], inp["T"]], [lam0, ce, T])
        for j, k in enumerate(held):
            for i in (0, 1):
                n = len(P[f"e{k}.fc{i}.v"])
                np.testing.assert_array_equal(inp[f"u{j}_{i}"], noise.uniform(1e-6, 1 - 1e-6, n).astype(np.float32))
                close(inp[f"theta_logit{j}_{i}"], theta_logit[(k, i)], rtol=1e-5, atol=1e-4)  # /T = 2.5x
                close(inp[f"norm{j}_{i}"], norms(k, i))
                for p_ in ("weight", "bias", "v"):
                    close(inp[f"c{j}_fc{i}_{p_}"], P[f"e{k}.fc{i}.{p_}"])
            close(c["weights"][f"gate.A{j}"], A[np.asarray(layers[k][2])][:, held])
        close(c["weights"]["gate.b"], b[held])
        for j, k in enumerate(held):
            for n in [m for m in P if m.startswith(f"e{k}.")]:
                gk = g[f"s{j}.{n.split('.', 1)[1]}"]
                if n.endswith(".v"):  # Adamax, minimisation, fresh this round
                    m_, u_ = mv[n]
                    m_ = B1 * m_ + (1 - B1) * gk
                    u_ = np.maximum(B2 * u_, np.abs(gk) + EPS)
                    mv[n] = (m_, u_)
                    P[n] = P[n] - v_lr / (1 - B1 ** t) * m_ / u_
                else:
                    P[n] = P[n] - lr * gk
            A[np.ix_(np.asarray(layers[k][2]), held)] -= glr * g[f"gate.A{j}"]
        b[held] -= glr * g["gate.b"]
    # the end: Alg. 2 keeps 0 and 2; z = U < pi from stream 2, expert 0's layers then expert 2's
    zs = np.random.default_rng([seed, 2])
    kept = []
    assert EF.expert_ids({n: 0 for n in rep.tensors}) == [0, 2]
    for k in (0, 2):
        for i in (0, 1):
            pi = sigmoid((norms(k, i) - softplus(P[f"e{k}.fc{i}.v"])) / T)
            u = zs.random(len(pi))
            z = rep.tensors[f"e{k}.fc{i}.weight"].mask
            np.testing.assert_array_equal(rep.tensors[f"e{k}.fc{i}.bias"].mask, z)
            decided = np.abs(u - pi) > 1e-4  # float32 weights move pi by far less than this
            assert decided.sum() >= len(pi) - 1
            np.testing.assert_array_equal(z[decided], (u < pi)[decided])
            kept.append(z.mean())
            close(rep.tensors[f"e{k}.fc{i}.weight"].dense()[z], P[f"e{k}.fc{i}.weight"][z])
            close(rep.tensors[f"e{k}.fc{i}.bias"].dense()[z], P[f"e{k}.fc{i}.bias"][z])
        assert rep.tensors[f"e{k}.fc2.weight"].mask is None
        close(rep.tensors[f"e{k}.fc2.weight"].dense(), P[f"e{k}.fc2.weight"])
    assert not any(n.endswith((".v", ".units")) for n in rep.tensors)
    assert rep.metrics["kept"] == pytest.approx(float(np.mean(kept)), abs=1e-12)
    assert rep.metrics["experts"] == 2
    close(rep.extras["qzs"], qa)
    np.testing.assert_array_equal(rep.extras["phi"], w["phi"])
    st = local.load("fedmix_sparse")
    close(st["A"], A)
    close(st["b"], b)
    close(st["qs"], qa, rtol=1e-12, atol=1e-15)
    assert st["active"].tolist() == [1, 0, 1]


def test_fedmix_sparse_known_device_predicts_with_every_surviving_unit_on(tmp_path):
    """fedmix_sparse.predict_proba for a device that kept experts 0 and 2 of the held 0, 1, 2: the eval inputs
    (noise 0.5, a norm of 1e6) open every hard-concrete gate, so each expert is its plain sliced MLP, and the
    private gate (rows ``e{k}.units`` of A) mixes them with the stored q(z|s) pooling (Eq. 9)."""
    K = 3
    rng = np.random.default_rng(23)
    layers = {0: (5, 4, [0, 1, 2, 3]), 1: (3, 3, [0, 2, 3]), 2: (4, 2, [1, 3])}
    w = _sparse_experts(rng, 0.4, layers)
    w["phi"] = rng.normal(size=(3, K)).astype(np.float32)
    A = (rng.normal(size=(4, K)) * 1.5).astype(np.float32)
    b = np.array([0.3, -1.0, -0.6], np.float32)
    qs = np.array([0.7, 0.0, 0.3])
    local = LocalState(tmp_path)
    local.save("fedmix_sparse", {"A": A, "b": b, "pi": qs, "qs": qs, "active": np.array([1, 0, 1], np.uint8)})
    lay = EF.kept_layout(w, local, state_name="fedmix_sparse", gated=True)
    assert lay["slots"] == [[4, 5, 4, 3], [4, 4, 2, 3]]
    tr = TorchTrainer(threads=1)
    tr.load(torch_program(mlp([4, 5, 4, 3]), "mixture", lay).data)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    got = EFS.predict_proba(tr, w, local, x)
    act = [0, 2]
    pk, feats = zip(*[_mlp_probs(w, k, x) for k in act])
    z = sum(qs[k] * (feats[i] @ A[np.asarray(layers[k][2])][:, act].astype(np.float64)) for i, k in enumerate(act))
    gate = softmax(z + b[act].astype(np.float64), 1)
    want = sum(gate[:, i:i + 1] * pk[i] for i in range(2))
    close(got, want)
    assert np.abs(pk[0] * 0.7 + pk[1] * 0.3 - want).max() > 1e-2  # the gate matters (not the pooling weights)


# ================================================================================ 4. a person's module as experts
def _ln(h, g, b):
    mu = h.mean(1, keepdims=True)
    var = ((h - mu) ** 2).mean(1, keepdims=True)
    return (h - mu) / np.sqrt(var + 1e-5) * g + b  # torch.nn.LayerNorm's default eps


def _gelu_features(P, pre, x):
    """tests/user_models.py's GeluMLP up to its classifier, in float64: GELU (erf) after LayerNorm, then the
    tanh approximation."""
    h = x @ P[pre + "fc1.weight"].T + P[pre + "fc1.bias"]
    h = _ln(h, P[pre + "ln1.weight"], P[pre + "ln1.bias"])
    h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
    h = h @ P[pre + "fc2.weight"].T + P[pre + "fc2.bias"]
    h = _ln(h, P[pre + "ln2.weight"], P[pre + "ln2.bias"])
    return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))


HIDDEN = ["fc1.weight", "fc1.bias", "ln1.weight", "ln1.bias", "fc2.weight", "fc2.bias", "ln2.weight", "ln2.bias"]


def _module_mixture_ref(P, copies, x, y, w, active, qs, variant, pi=None):
    """Paper 004 Eq. 5/6 without H(q) over the active slots, gate Eq. 9 on the classifier's input computed from
    the copies (stop-gradient): loss, and aux ll, lg (active columns), logits."""
    k = len(active)
    act = [j for j in range(k) if active[j] > 0]
    logits = np.stack([_gelu_features(P, f"s{j}.", x) @ P[f"s{j}.head.weight"].T + P[f"s{j}.head.bias"]
                       for j in range(k)], 1)
    lse = np.log(np.exp(logits - logits.max(2, keepdims=True)).sum(2)) + logits.max(2)
    ll = logits[np.arange(len(y)), :, y] - lse
    feats = [_gelu_features(copies, f"s{j}.", x) for j in range(k)]
    z = sum(qs[j] * (feats[j] @ P[f"gate.A{j}"]) for j in range(k)) + P["gate.b"]
    za = z[:, act]
    lg = za - (np.log(np.exp(za - za.max(1, keepdims=True)).sum(1, keepdims=True)) + za.max(1, keepdims=True))
    q = softmax(P["phi"][y][:, act], 1) if variant == "label" else np.tile(pi[act], (len(y), 1))
    loss = -((q * (ll[:, act] + lg)).sum(1) * w).sum()
    return loss, ll, lg, logits


@pytest.mark.parametrize("variant", ["label", "cluster"])
def test_module_mixture_objective_against_numpy(variant):
    """The mixture program of three copies of a person's GeluMLP (LayerNorm, GELU erf and tanh), slot 1 inactive,
    pooling weights qs, non-uniform row weights, (cluster) the restricted pi: the loss, aux ll, lg and logits,
    and every parameter's gradient against central differences of the float64 numpy reference (step 1e-5:
    truncation ~1e-10, rounding ~1e-11). The gate's features come from the copies: no gate gradient reaches
    the hidden weights."""
    spec = describe("tests/user_models.py:gelu_mlp", (20,))
    k, C, B = 3, 3, 7
    rng = np.random.default_rng(31)
    shapes = {n: tuple(s) for n, s in spec["params"]}
    P = {}
    for j in range(k):
        for n, s in shapes.items():
            scale = 1.0 if n.startswith("ln") and n.endswith("weight") else 0.5
            base = 1.0 if n.startswith("ln") and n.endswith("weight") else 0.0
            P[f"s{j}.{n}"] = base + scale * rng.normal(size=s)
        P[f"gate.A{j}"] = rng.normal(size=(16, k)) * 0.8
    P["gate.b"] = np.array([0.4, -0.7, 0.2])
    if variant == "label":
        P["phi"] = rng.normal(size=(C, k)) * 1.5
    P = {n: a.astype(np.float32).astype(np.float64) for n, a in P.items()}
    x = rng.normal(size=(B, 20)).astype(np.float32).astype(np.float64)
    y = np.array([0, 1, 2, 0, 2, 1, 1])
    wr = rng.uniform(0.2, 1.0, B)
    wr = (wr / wr.sum() * 0.8).astype(np.float32).astype(np.float64)
    active = np.array([1.0, 0.0, 1.0])
    qs = np.array([0.6, 0.0, 0.4], np.float32).astype(np.float64)
    pi = np.array([0.35, 0.0, 0.65], np.float32).astype(np.float64)
    copies = {n: P[n].copy() for n in P if n.split(".", 1)[-1] in HIDDEN}
    inputs = {"x": x.astype(np.float32), "y": y, "w": wr.astype(np.float32), "active": active.astype(np.float32),
              "qs": qs.astype(np.float32)}
    if variant == "cluster":
        inputs["pi"] = pi.astype(np.float32)
    for j in range(k):
        for n in HIDDEN:
            inputs[f"c{j}_{n.replace('.', '_')}"] = copies[f"s{j}.{n}"].astype(np.float32)
    tr = TorchTrainer(threads=1)
    tr.load(torch_program(spec, "mixture", {"experts": k, "variant": variant, "gated": False}).data)
    tr.set_weights({n: a.astype(np.float32) for n, a in P.items()})
    loss, grads, aux = tr.loss_and_grads(inputs)

    def f(Q):
        return _module_mixture_ref(Q, copies, x, y, wr, active, qs, variant, pi)

    L, ll, lg, logits = f(P)
    close(loss, L)
    close(aux["logits"], logits)
    close(aux["ll"], ll)
    close(aux["lg"][:, [0, 2]], lg)
    assert (aux["lg"][:, 1] < -1e3).all()  # the inactive slot: probability exactly 0
    h = 1e-5
    assert set(grads) == set(P)
    for n in P:
        want = np.zeros_like(P[n])
        for idx in np.ndindex(P[n].shape):
            keep = P[n][idx]
            P[n][idx] = keep + h
            up = f(P)[0]
            P[n][idx] = keep - h
            down = f(P)[0]
            P[n][idx] = keep
            want[idx] = (up - down) / (2 * h)
        # float32 backward of a few layers: 1e-5 of the tensor's largest gradient (see RTOL)
        np.testing.assert_allclose(grads[n], want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()), err_msg=n)
    assert not np.abs(grads["s1.fc1.weight"]).any()  # the inactive slot's expert gets nothing
    # the knock-out: features from the trained weights (no stop-gradient) would add the gate term's gradient
    # to the hidden weights; it is far above the tolerance here
    gate_only = dict(P)

    def gate_term(Q):
        feats = [_gelu_features(Q, f"s{j}.", x) for j in range(k)]
        z = sum(qs[j] * (feats[j] @ Q[f"gate.A{j}"]) for j in range(k)) + Q["gate.b"]
        za = z[:, [0, 2]]
        lg_ = za - np.log(np.exp(za).sum(1, keepdims=True))
        q = softmax(Q["phi"][y][:, [0, 2]], 1) if variant == "label" else np.tile(pi[[0, 2]], (B, 1))
        return -((q * lg_).sum(1) * wr).sum()

    i0 = (0, 0)
    keep = gate_only["s0.fc1.weight"][i0]
    gate_only["s0.fc1.weight"][i0] = keep + h
    up = gate_term(gate_only)
    gate_only["s0.fc1.weight"][i0] = keep - h
    down = gate_term(gate_only)
    gate_only["s0.fc1.weight"][i0] = keep
    assert abs((up - down) / (2 * h)) > 1e-3


def test_module_mixture_client_feeds_current_copies_and_a_gate_of_the_classifiers_width(tmp_path):
    """The client half with a module spec (label variant, experts 0 and 2 of K = 3 held, a saved gate of the
    classifier's input width 16, 2 epochs of batches 4, 4, 1): every call's stop-gradient copies are the
    current values of every parameter but the classifier's, the sliced gate and phi; SGD on experts and phi,
    gate_lr on the gate; the report and the saved gate."""
    spec = describe("tests/user_models.py:gelu_mlp", (20,))
    K, C, H, held, lr, glr = 3, 3, 16, [0, 2], 0.06, 0.17
    rng = np.random.default_rng(41)
    w = {f"e{k}.{n}": rng.normal(size=s).astype(np.float32) for k in held for n, s in spec["params"]}
    w["phi"] = np.array([[0.8, -0.3, 0.1], [-0.5, 0.9, 0.4], [0.0, 0.2, -0.9]], np.float32)
    A0, b0 = rng.normal(size=(H, K)).astype(np.float32), rng.normal(size=K).astype(np.float32)
    local = LocalState(tmp_path)
    local.save("fedmix", {"A": A0, "b": b0, "pi": np.full(K, 1 / K), "qs": np.full(K, 1 / K),
                          "active": np.ones(K, np.uint8)})
    x, y = rng.normal(size=(9, 20)).astype(np.float32), np.array([0, 0, 1, 2, 0, 1, 0, 0, 2])
    hp = {"lr": lr, "gate_lr": glr, "epochs": 2, "batch_size": 4, "K": K, "eta": 0.3, "variant": "label"}
    stub = RecStub(8, spec=spec)
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, local)
    assert [len(c["inputs"]["x"]) for c in stub.calls] == [4, 4, 1] * 2
    names = {"x", "y", "active", "qs"} | {f"c{j}_{n.replace('.', '_')}" for j in range(2) for n in HIDDEN}
    for c in stub.calls:
        assert set(c["inputs"]) == names
    hist = np.bincount(y, minlength=C) / len(y)
    E = {n: a.astype(np.float64) for n, a in w.items() if n != "phi"}
    E, phi, A, b, _ = label_replay(stub.calls, E, w["phi"].astype(np.float64), A0.astype(np.float64),
                                   b0.astype(np.float64), held, K, 0.3, hist, lr, glr, copies=HIDDEN)
    keep, qp = alg2(hist @ softmax(phi, 1), held, 0.3, K)
    assert keep == held
    close(rep.extras["qzs"], qp)
    close(rep.extras["phi"], phi)
    assert sorted(rep.tensors) == sorted(E)
    for n, t in rep.tensors.items():
        close(t.dense(), E[n])
    st = local.load(EF.STATE)
    assert st["A"].shape == (H, K)
    close(st["A"], A)
    close(st["b"], b)
    np.testing.assert_array_equal(st["A"][:, 1], A0[:, 1])  # the expert it was not sent: untouched


# ================================================================================ 5. the float32 underflow drop
def test_a_kept_expert_whose_weight_underflows_float32_is_not_sent(tmp_path):
    """Label variant, eta 0 (Alg. 2 keeps every held expert), held experts 0, 2, 3 of K = 4, with q(z|s)'s mass
    on expert 1 (not held): q' over the held experts is about [1, -, 1e-50, 1e-30]. Expert 2's q' is 0 in
    float32, so it would carry no weight in Eq. 8 (and the server refuses a returned expert with q = 0): it is
    not sent and q' is renormalised over 0 and 3. Expert 3's q' (1e-30) is a normal float32: it is sent,
    although its unrestricted q (1e-50) underflows. phi's gradient is zero so q is exactly known; the experts
    and the gate still train, over 3 epochs of batches 3, 3, 1."""
    K, C, H, held = 4, 3, 5, [0, 2, 3]
    rng = np.random.default_rng(19)
    w = experts(K, [4, H, C], rng, held)
    # log q per class row: expert 1 at 0, expert 0 at -46 (1e-20), expert 3 at -115 (1e-50), expert 2 at -161
    w["phi"] = np.array([[-46.0, 0.0, -161.0, -115.0], [-45.0, 0.0, -162.0, -116.0], [3.0, 0.0, 1.0, 2.0]],
                        np.float32)
    y = np.array([0, 1, 0, 0, 1, 0, 1])  # class 2 never: its row (which would dominate) has no weight
    x = rng.normal(size=(7, 4)).astype(np.float32)
    A0, b0 = rng.normal(size=(H, K)).astype(np.float32), rng.normal(size=K).astype(np.float32)
    local = LocalState(tmp_path)
    local.save("fedmix", {"A": A0, "b": b0, "pi": np.full(K, 1 / K), "qs": np.full(K, 1 / K),
                          "active": np.ones(K, np.uint8)})
    lr, glr = 0.05, 0.13
    hp = {"lr": lr, "gate_lr": glr, "epochs": 3, "batch_size": 3, "K": K, "eta": 0.0, "variant": "label"}
    stub = RecStub(2, frozen={"phi"})
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, local)
    assert [len(c["inputs"]["x"]) for c in stub.calls] == [3, 3, 1] * 3
    hist = np.bincount(y, minlength=C) / len(y)
    q = hist @ softmax(w["phi"].astype(np.float64), 1)
    E = {n: a.astype(np.float64) for n, a in w.items() if n != "phi"}
    E, phi, A, b, seen = label_replay(stub.calls, E, w["phi"].astype(np.float64), A0.astype(np.float64),
                                      b0.astype(np.float64), held, K, 0.0, hist, lr, glr)
    assert all(s == held for s in seen)  # trained with all three
    qr = np.zeros(K)
    qr[held] = q[held] / q[held].sum()
    assert np.float32(qr[2]) == 0 and 1e-35 < qr[3] < 1e-25 and np.float32(q[3]) == 0  # the case in hand
    want = np.zeros(K)
    want[[0, 3]] = q[[0, 3]] / q[[0, 3]].sum()
    assert EF.expert_ids({n: 0 for n in rep.tensors}) == [0, 3]
    close(rep.extras["qzs"], want, rtol=RTOL, atol=0)
    assert rep.extras["qzs"].dtype == np.float32 and (rep.extras["qzs"][[0, 3]] > 0).all()
    assert rep.metrics["experts"] == 2
    np.testing.assert_array_equal(rep.extras["phi"], w["phi"])
    for n, t in rep.tensors.items():
        close(t.dense(), E[n])
    st = local.load(EF.STATE)
    assert st["active"].tolist() == [1, 0, 0, 1]
    close(st["qs"], want, rtol=1e-12, atol=0)
    close(st["pi"], np.full(K, 0.25), rtol=0, atol=0)  # the label variant's pi is untouched
    close(st["A"], A)
    close(st["b"], b)
    # and the server takes the report: q positive exactly on the returned experts
    FedMix(spec=mlp([4, H, C]), K=K).check_extras(rep, [0, 3])


def test_underflow_in_the_cluster_variant_drops_from_the_saved_pi(tmp_path):
    """Clustering variant, damping 1 (pi is the server's pi_init all round), held 0, 1, 2 of K = 3, eta 0:
    pi_init = [0.7, 1e-50, 0.3] keeps expert 1 in training (q >= 0) but its q' underflows float32: not sent,
    and the pi the device saves is q' over 0 and 2."""
    K, H, held = 3, 4, [0, 1, 2]
    rng = np.random.default_rng(29)
    w = experts(K, [4, H, 3], rng, held)
    w["pi_init"] = np.array([0.7, 1e-50, 0.3])
    x, y = rng.normal(size=(5, 4)).astype(np.float32), rng.integers(0, 3, 5)
    hp = {"lr": 0.05, "gate_lr": 0.1, "epochs": 2, "batch_size": 3, "K": K, "eta": 0.0, "variant": "cluster",
          "damping": 1.0}
    local = LocalState(tmp_path)
    stub = RecStub(4)
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, local)
    for c in stub.calls:
        np.testing.assert_array_equal(c["inputs"]["active"], [1.0, 1.0, 1.0])
        close(c["inputs"]["pi"], [0.7, 0.0, 0.3], rtol=RTOL, atol=0)
    want = np.array([0.7, 0.0, 0.3])
    assert EF.expert_ids({n: 0 for n in rep.tensors}) == [0, 2]
    close(rep.extras["qzs"], want, rtol=RTOL, atol=0)
    st = local.load(EF.STATE)
    close(st["pi"], want, rtol=1e-12, atol=0)
    assert st["active"].tolist() == [1, 0, 1] and rep.metrics["experts"] == 2


# ================================================================================ 6. the gate reset on a shape change
@pytest.mark.parametrize("case", ["H", "K", "same"])
def test_gate_reset_when_the_gate_matrix_changes_shape(tmp_path, case):
    """A saved gate of another shape (the expert's last hidden width H grew from 5 to 8 -> now 5, or K was 4 and
    is now 3) is not reused: the round starts from A = 0, b = 0 and a uniform pi and saves a gate of the new
    shape; a gate of the right shape is reused (the control). Label variant, held 0 and 2 of K = 3, 2 epochs of
    batches 4, 4, 2, eta 0.5; every input and the saved state against the float64 replay."""
    K, H, held, lr, glr, eta = 3, 5, [0, 2], 0.04, 0.27, 0.5
    rng = np.random.default_rng(37)
    w = experts(K, [4, H, 3], rng, held)
    w["phi"] = np.array([[1.2, 0.1, -0.4], [-0.3, 0.5, 0.9], [0.2, -1.1, 0.6]], np.float32)
    shape = {"H": (8, K), "K": (H, K + 1), "same": (H, K)}[case]
    Ks = shape[1]
    A_old = (rng.normal(size=shape) * 2).astype(np.float32)
    b_old = rng.normal(size=Ks).astype(np.float32)
    pi_old = rng.dirichlet(np.ones(Ks))
    local = LocalState(tmp_path)
    local.save("fedmix", {"A": A_old, "b": b_old, "pi": pi_old, "qs": pi_old, "active": np.ones(Ks, np.uint8)})
    x, y = rng.normal(size=(10, 4)).astype(np.float32), np.array([0, 1, 1, 2, 0, 1, 2, 2, 1, 0])
    hp = {"lr": lr, "gate_lr": glr, "epochs": 2, "batch_size": 4, "K": K, "eta": eta, "variant": "label"}
    stub = RecStub(6)
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, local)
    reset = case != "same"
    A = np.zeros((H, K)) if reset else A_old.astype(np.float64)
    b = np.zeros(K) if reset else b_old.astype(np.float64)
    pi = np.full(K, 1 / K) if reset else pi_old
    hist = np.bincount(y, minlength=3) / len(y)
    E = {n: a.astype(np.float64) for n, a in w.items() if n != "phi"}
    E, phi, A, b, _ = label_replay(stub.calls, E, w["phi"].astype(np.float64), A, b, held, K, eta, hist, lr, glr)
    keep, qp = alg2(hist @ softmax(phi, 1), held, eta, K)
    close(rep.extras["qzs"], qp)
    st = local.load(EF.STATE)
    assert st["A"].shape == (H, K) and st["b"].shape == (K,)
    close(st["A"], A)
    close(st["b"], b)
    close(st["pi"], pi, rtol=1e-12, atol=0)
    close(st["qs"], qp)  # from the float32 phi the client trained
    assert st["active"].tolist() == [1 if k in keep else 0 for k in range(K)]
    if reset:  # the untrained column (expert 1, not held) is exactly the uniform gate's 0
        np.testing.assert_array_equal(st["A"][:, 1], 0)
        assert st["b"][1] == 0


def test_gate_reset_with_a_server_restart_keeps_the_pi_init(tmp_path):
    """A device whose saved gate has another K gets, in the same plan, a restart pi_init (docs/fedmix.md): the
    gate restarts at 0 and pi starts at pi_init, not at the uniform pi of a fresh gate. Clustering variant,
    held 0, 1, 2 of K = 3, eta 0.8, 2 epochs of batches 3, 3, 1, damping 0.75."""
    K, H, held, lr, glr, eta = 3, 4, [0, 1, 2], 0.05, 0.2, 0.8
    rng = np.random.default_rng(43)
    w = experts(K, [4, H, 3], rng, held)
    pi_init = np.array([0.1 / 2, 0.9, 0.1 / 2])
    w["pi_init"] = pi_init
    local = LocalState(tmp_path)
    local.save("fedmix", {"A": rng.normal(size=(H, 4)).astype(np.float32), "b": np.ones(4, np.float32),
                          "pi": np.full(4, 0.25), "qs": np.full(4, 0.25), "active": np.ones(4, np.uint8)})
    x, y = rng.normal(size=(7, 4)).astype(np.float32), rng.integers(0, 3, 7)
    hp = {"lr": lr, "gate_lr": glr, "epochs": 2, "batch_size": 3, "K": K, "eta": eta, "variant": "cluster"}
    stub = RecStub(10, aux_scale=0.5)
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, local)
    A, b, pi = np.zeros((H, K)), np.zeros(K), pi_init.copy()
    for c in stub.calls:
        act, qa = alg2(pi, held, eta, K)
        np.testing.assert_array_equal(c["inputs"]["active"], [1.0 if k in act else 0.0 for k in held])
        close(c["inputs"]["pi"], qa[held])
        for j in range(3):
            close(c["weights"][f"gate.A{j}"], A[:, held])
        close(c["weights"]["gate.b"], b[held])
        g = c["grads"]
        for j in range(3):
            A[:, held] -= glr * g[f"gate.A{j}"]
        b[held] -= glr * g["gate.b"]
        pi = eq13(pi, c["aux"], held, act, 0.75)
    keep, qp = alg2(pi, held, eta, K)
    close(rep.extras["qzs"], qp)
    st = local.load(EF.STATE)
    close(st["A"], A)
    close(st["b"], b)
    close(st["pi"], qp, rtol=1e-12, atol=1e-15)
    # pi_init decided the first batch: only expert 1 passes eta / K = 0.267
    np.testing.assert_array_equal(stub.calls[0]["inputs"]["active"], [0.0, 1.0, 0.0])
