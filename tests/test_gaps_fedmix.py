"""FedMix (paper 004) at what the earlier tests left free (issue 28): a device absent from a round keeps its stored
q(z|s) (Alg. 2 selection, metrics, global model), an expert no device used keeps its weights and Adam moments,
the server's metrics and hparams, a cluster-variant client restarted by ``pi_init`` over 3 epochs with an uneven
last batch, its report metrics, and a known device's prediction through its private gate (Eq. 9 pooling with its
stored q(z|s)). References are written here in float64; tolerances come from float32 rounding of O(1) values."""
from __future__ import annotations

import numpy as np

from coordinator.strategies.fedmix import FedMix
from edge.algorithms import fedmix as EF
from edge.algorithms.driver import run_plan
from edge.model import mlp
from edge.runtime.program import torch_program
from edge.runtime.state import LocalState
from edge.trainers.torch_backend import TorchTrainer
from test_maths_clients import Stub, eq13, experts, held_step, plan_of, softmax
from test_maths_server import MNAMES, MSPEC, RefAdam, close, dense


def _entropy_rows(p):
    return -(p * np.log(np.maximum(p, 1e-300))).sum(1)


def test_fedmix_server_absent_devices_untouched_experts_metrics_and_global_model():
    """Two rounds of Eq. 8 + line 8 + Adam against a float64 reference; round 2 has only device a, on expert 1.
    Kills: meta["qzs"] replaced by this round's reports (b's and c's stored q lost: Alg. 2 selection, metrics
    and the global model change), an unused expert stepped or its moments touched, experts_per_device not the
    mean count, qzy_entropy not the mean row entropy, marginal_entropy not H(mean_c q_phi(z|c)), the global
    model not the most used expert, the server's gate_lr not sent."""
    lam, lr, K = 0.3, 0.05, 3
    s = FedMix(spec=MSPEC, K=K, variant="label", entropy_weight=lam, server_lr=lr, eta=1.0)
    st = s.init(0)
    rng = np.random.default_rng(11)
    st.weights["phi"] = (rng.normal(size=(3, K)) * 1.5).astype(np.float32)
    ref = {k: v.astype(np.float64) for k, v in st.weights.items()}
    adam = RefAdam(lr, maximize=False)
    rounds = [[("a", 10, [0, 1], [0.7, 0.3, 0.0]), ("b", 30, [0], [1.0, 0.0, 0.0]),
               ("c", 20, [1, 2], [0.0, 0.45, 0.55])],
              [("a", 25, [1], [0.0, 1.0, 0.0])]]
    stored = {}
    for r, reps in enumerate(rounds):
        acc = s.begin(st)
        sent, phis = {}, {}
        for dev, n, ks, q in reps:
            sent[dev] = {f"e{k}.{m}": (ref[f"e{k}.{m}"] + rng.normal(size=ref[f"e{k}.{m}"].shape)).astype(np.float32)
                         for k in ks for m in MNAMES}
            phis[dev] = (ref["phi"] + rng.normal(size=(3, K)) * 0.05).astype(np.float32)
            s.accumulate(st, acc, s.plan(st, dev, {}),
                         dense(dev, n, sent[dev], {"qzs": np.asarray(q, np.float32), "phi": phis[dev]}))
        before = {k: v.copy() for k, v in st.opt.items()}
        st = s.finish(st, acc)
        delta = {}
        for k in range(K):
            users = [(n, q[k], dev) for dev, n, ks, q in reps if k in ks]
            if not users:
                continue
            z = sum(n * qk for n, qk, _ in users)
            for m in MNAMES:
                t = f"e{k}.{m}"
                delta[t] = sum(n * qk / z * (ref[t] - sent[d][t].astype(np.float64)) for n, qk, d in users)
        N = sum(n for _, n, _, _ in reps)
        qzy = softmax(ref["phi"], 1)
        mm = qzy.mean(0)
        gH = -(1 / 3) * qzy * (np.log(mm)[None, :] - (qzy * np.log(mm)[None, :]).sum(1, keepdims=True))
        delta["phi"] = sum(n / N * (ref["phi"] - phis[d].astype(np.float64)) for d, n, _, _ in reps) - lam * gH
        adam.step(ref, delta)
        for k in ref:
            close(st.weights[k], ref[k], atol=2e-6)
        for dev, _n, _ks, q in reps:
            stored[dev] = q
        if r == 1:  # experts 0 and 2: no step, moments exactly as after round 1; the step count is shared
            for k in (0, 2):
                for m in MNAMES:
                    for mv in ("m", "v"):
                        np.testing.assert_array_equal(st.opt[f"adam/{mv}/e{k}.{m}"], before[f"adam/{mv}/e{k}.{m}"])
            assert int(st.opt["adam/t"]) == 2
    assert {d: list(np.round(v, 6)) for d, v in st.meta["qzs"].items()} == stored
    # Alg. 2 from the stored q of devices absent from round 2: 0.9 eta / K = 0.3
    assert s.experts_for(st, "b") == [0] and s.experts_for(st, "c") == [1, 2] and s.experts_for(st, "a") == [1]
    assert EF.expert_ids(s.plan(st, "c", {}).weights) == [1, 2]
    q = np.array([stored[d] for d in ("a", "b", "c")])
    met = s.metrics(st)
    assert abs(met["experts_per_device"] - 4 / 3) < 1e-12
    assert abs(met["qzs_entropy"] - _entropy_rows(q).mean()) < 1e-9
    qzy = softmax(ref["phi"], 1)
    assert abs(met["qzy_entropy"] - _entropy_rows(qzy).mean()) < 1e-5
    mm = qzy.mean(0)
    assert abs(met["marginal_entropy"] - float(-(mm * np.log(mm)).sum())) < 1e-5
    assert met["restarts"] == 0.0
    spec, gw = s.global_model(st)  # use = [1, 1.45, 0.55]: expert 1
    assert spec == MSPEC
    for m in MNAMES:
        np.testing.assert_array_equal(gw[m], st.weights[f"e1.{m}"])
    # hparams: a server-set gate_lr travels; unset, the client lr (Alg. 1's single alpha)
    assert FedMix(spec=MSPEC, K=K, lr=0.05, gate_lr=0.3).hparams(st).gate_lr == 0.3
    assert FedMix(spec=MSPEC, K=K, lr=0.05).hparams(st).gate_lr == 0.05


def test_fedmix_cluster_client_pi_init_uneven_batches_and_report(tmp_path):
    """Cluster variant, experts 0 and 2 of K = 3 held, a stored gate and pi, and a server restart ``pi_init`` in
    the plan; 3 epochs of batches 4, 4, 2. Every call's inputs (pi, qs, active, the sliced weights and gate),
    SGD at lr / gate_lr, Eq. 13 with damping, and the report (tensors, q', metrics) and saved state.
    Kills: pi_init ignored (the stored pi used), the ``experts`` metric counting the held not the kept experts."""
    K, H, held, eta, lr, glr = 3, 5, [0, 2], 0.9, 0.07, 0.23  # threshold eta / K = 0.3
    rng = np.random.default_rng(8)
    w = experts(K, [4, H, 3], rng, held)
    pi_init = np.array([0.62, 0.08, 0.30000001])
    w["pi_init"] = pi_init
    A0, b0 = rng.normal(size=(H, K)).astype(np.float32), rng.normal(size=K).astype(np.float32)
    local = LocalState(tmp_path)
    pi_stored = np.array([0.2, 0.3, 0.5])
    local.save("fedmix", {"A": A0, "b": b0, "pi": pi_stored, "qs": pi_stored, "active": np.ones(K, np.uint8)})
    x, y = rng.normal(size=(10, 4)).astype(np.float32), rng.integers(0, 3, 10)
    hp = {"lr": lr, "gate_lr": glr, "epochs": 3, "batch_size": 4, "K": K, "eta": eta, "variant": "cluster"}
    stub = Stub(9, aux_scale=0.4)
    rep = run_plan(plan_of("fedmix", w, hp), stub, x, y, local)
    assert [len(c["inputs"]["x"]) for c in stub.calls] == [4, 4, 2] * 3

    def alg2(q):
        keep = [k for k in held if q[k] >= eta / K] or [max(held, key=lambda k: q[k])]
        qp = np.zeros(K)
        qp[keep] = q[keep]
        return keep, qp / qp.sum()

    E = {k: v.astype(np.float64) for k, v in w.items() if k != "pi_init"}
    A, b, pi = A0.astype(np.float64), b0.astype(np.float64), pi_init.copy()
    for c in stub.calls:
        act, qa = alg2(pi)
        np.testing.assert_array_equal(c["inputs"]["active"], [1.0 if k in act else 0.0 for k in held])
        np.testing.assert_allclose(c["inputs"]["pi"], qa[held], atol=1e-6)
        np.testing.assert_allclose(c["inputs"]["qs"], qa[held], atol=1e-6)
        cw = c["weights"]
        for j, k in enumerate(held):
            for n in MNAMES:
                np.testing.assert_allclose(cw[f"s{j}.{n}"], E[f"e{k}.{n}"], atol=1e-5)
            np.testing.assert_allclose(cw[f"gate.A{j}"], A[:, held], atol=1e-5)
        np.testing.assert_allclose(cw["gate.b"], b[held], atol=1e-5)
        held_step(E, A, b, c["grads"], held, lr, glr)
        pi = eq13(pi, c["aux"], held, act, 0.75)
    keep, qp = alg2(pi)
    assert keep == held or len(keep) == 1
    np.testing.assert_allclose(rep.extras["qzs"], qp, atol=1e-6)
    assert set(rep.extras) == {"qzs"}
    assert sorted({n.split(".")[0] for n in rep.tensors}) == [f"e{k}" for k in keep]
    for n, t in rep.tensors.items():
        np.testing.assert_allclose(t.dense(), E[n], atol=1e-5)
    assert rep.metrics["experts"] == len(keep) and rep.metrics["steps"] == 9
    assert rep.metrics["train_loss"] == 0.0  # the stub's loss, averaged
    st = local.load("fedmix")
    np.testing.assert_allclose(st["A"], A, atol=1e-5)
    np.testing.assert_allclose(st["b"], b, atol=1e-5)
    np.testing.assert_allclose(st["pi"], qp, atol=1e-12)
    np.testing.assert_allclose(st["qs"], qp, atol=1e-12)
    assert st["active"].tolist() == [1 if k in keep else 0 for k in range(K)]
    # the stored pi would have given another first call
    assert np.abs(alg2(pi_stored)[1][held] - stub.calls[0]["inputs"]["pi"]).max() > 0.1


def test_fedmix_cluster_client_experts_metric_counts_kept(tmp_path):
    """Alg. 2 at the end of the round drops a held expert: ``experts`` is the number kept (1), not held (2).
    Kills: the experts metric counting the held experts."""
    K, held = 3, [0, 2]
    rng = np.random.default_rng(2)
    w = experts(K, [4, 5, 3], rng, held)
    w["pi_init"] = np.array([0.85, 0.05, 0.10])
    x, y = rng.normal(size=(6, 4)).astype(np.float32), rng.integers(0, 3, 6)
    hp = {"lr": 0.0, "gate_lr": 0.0, "epochs": 1, "batch_size": 6, "K": K, "eta": 0.9, "variant": "cluster",
          "damping": 1.0}
    rep = run_plan(plan_of("fedmix", w, hp), Stub(1), x, y, LocalState(tmp_path))
    np.testing.assert_allclose(rep.extras["qzs"], [1.0, 0.0, 0.0])
    assert rep.metrics["experts"] == 1
    assert EF.expert_ids({n: None for n in rep.tensors}) == [0]


def test_fedmix_known_device_predicts_through_its_gate_with_its_stored_q(tmp_path):
    """Sec. 3 inference for a known client: p(y|x,s) = sum_k p_theta(z=k|x,s) p_wk(y|x), the gate Eq. 9
    softmax over the kept experts of sum_j q(z=j|s) h_j(x) A_j + b, with the q(z|s) and active set the device
    saved, against numpy in float64. Kills: the pooling weights uniform (not the stored q), the gate replaced
    by a uniform ensemble."""
    K, C, H = 3, 4, 6
    spec = mlp([5, H, C])
    rng = np.random.default_rng(5)
    w = experts(K, [5, H, C], rng, [0, 1, 2])
    for k in range(K):
        w[f"e{k}.fc1.weight"] = (w[f"e{k}.fc1.weight"] * 1.5).astype(np.float32)
    w["phi"] = rng.normal(size=(C, K)).astype(np.float32)
    A = (rng.normal(size=(H, K)) * 1.2).astype(np.float32)
    b = np.array([0.4, -2.0, -0.3], np.float32)
    qs = np.array([0.15, 0.0, 0.85])
    local = LocalState(tmp_path)
    local.save("fedmix", {"A": A, "b": b, "pi": qs, "qs": qs, "active": np.array([1, 0, 1], np.uint8)})
    lay = EF.kept_layout(w, local)
    assert lay["slots"] == [[5, H, C]] * 2
    tr = TorchTrainer(threads=1)
    tr.load(torch_program(spec, "mixture", lay).data)
    x = rng.normal(size=(9, 5)).astype(np.float32)
    got = EF.predict_proba(tr, w, local, x)

    act = [0, 2]
    hs = {k: np.maximum(x.astype(np.float64) @ w[f"e{k}.fc0.weight"].T.astype(np.float64) + w[f"e{k}.fc0.bias"], 0)
          for k in act}
    pk = np.stack([softmax(hs[k] @ w[f"e{k}.fc1.weight"].T.astype(np.float64) + w[f"e{k}.fc1.bias"], 1)
                   for k in act], 1)

    def mix(pool):
        z = sum(pool[i] * (hs[k] @ A[:, act].astype(np.float64)) for i, k in enumerate(act)) + b[act]
        return (softmax(z, 1)[:, :, None] * pk).sum(1)

    want = mix(qs[act])
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-6)
    assert np.abs(mix([0.5, 0.5]) - want).max() > 1e-2  # uniform pooling weights
    assert np.abs(pk.mean(1) - want).max() > 1e-2  # a uniform gate
