"""FLoPS and FLoPS-PA (paper 002): the gate maths against independent references (a sampling estimate, hand
computations of the Lagrangian step and the dual restart, a numpy gradient of the objective), the top-k
message round trip bit for bit (through the wire), the exact-density step, the baselines' thresholding, the
synthetic generators and metrics, and end to end over the round machine. The objectives and the client halves on
ORT and ExecuTorch are tests/test_runtimes.py's (and the firmware suite's golden vectors)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.admission import AdmissionRules, check_structure
from coordinator.inprocess import Loop
from coordinator.strategies import make_strategy
from coordinator.strategies.base import DevicePlan, ReportRejected, ServerState
from coordinator.strategies.fediter_ht import FedAvgPrune, FedIterHT
from coordinator.strategies.flops import FLoPS, FLoPSPA
from coordinator.synthetic import make_problem, quality, quantity_skew, support_metrics, toeplitz, toeplitz_features
from edge import flops as F
from edge.algorithms.driver import run_plan
from edge.model import mlp
from edge.protocol import wire
from edge.protocol.wire import Plan, Report, TensorUpdate
from edge.runtime.program import torch_program
from edge.trainers import make_trainer

from conftest import SPEC, make_bus

BETA, GAMMA, ZETA = 2 / 3, -0.1, 1.1  # Louizos et al. 2018, written out here independently of edge/gates.py


def _sig(a):
    return 1 / (1 + np.exp(-np.asarray(a, np.float64)))


# ---------------------------------------------------------------- gates

def test_p_open_matches_a_sampling_estimate():
    """P(z != 0) = sigmoid(log_alpha - beta log(-gamma/zeta)) against the fraction of non-zero hard-concrete
    samples, at log-alphas from mostly closed to mostly open (200k draws each: standard error <= 0.0012)."""
    rng = np.random.default_rng(0)
    la = np.array([-4.0, -2.0, -1.0, 0.0, 0.7, 2.0])
    u = rng.uniform(1e-9, 1 - 1e-9, (200_000, 1))
    s = _sig((np.log(u) - np.log(1 - u) + la) / BETA)
    z = np.minimum(1, np.maximum(0, s * (ZETA - GAMMA) + GAMMA))
    est = (z > 0).mean(0)
    formula = _sig(la - BETA * math.log(-GAMMA / ZETA))
    np.testing.assert_allclose(F.p_open(la), formula, rtol=1e-12)
    np.testing.assert_allclose(est, formula, atol=0.006)
    assert 0.05 < formula[1] < 0.9  # the points span closed-ish to open-ish gates
    np.testing.assert_allclose(F.hard_concrete(la, u[:100]), z[:100], rtol=1e-12)
    # the noise-free gate: 0 at and below -log 11, 1 at and above +log 11, sigmoid(la) stretched between
    g = F.noise_free_gates(np.array([-2.4, -2.39, 0.0, 2.39, 2.4]))
    assert g[0] == 0 and g[-1] == 1 and 0 < g[1] < g[2] < g[3] < 1 and g[2] == pytest.approx(0.5)


def test_dual_step_ascends_and_restarts_at_zero():
    """lambda <- max(0, lambda + lr c) while the constraint is violated; lambda <- 0 as soon as it holds."""
    assert F.dual_step(0.3, 0.2, 1.5) == pytest.approx(0.6)
    assert F.dual_step(0.0, 0.05, 2.0) == pytest.approx(0.1)
    assert F.dual_step(7.0, -1e-9, 1.0) == 0.0  # restart, however large lambda was
    assert F.dual_step(7.0, 0.0, 1.0) == 0.0


def _tiny(**kw) -> FLoPSPA:
    # 4 gated parameters (one linear output, no bias), k = 1: every term of the server step is visible
    return FLoPSPA(**(dict(spec=mlp([4, 1]), rho=0.25, loss="mse", bias=False, lr=0.1, la_lr=0.2, lam_lr=0.5,
                           prune_start=99) | kw))


def _report(msg: F.Message, n_samples: int, device="d0") -> Report:
    return Report("t", device, n_samples, {}, {}, msg.arrays())


def test_server_step_matches_a_hand_computation():
    """Two reports, sample-weighted 1:3: the weighted mean of the rebuilt (theta_hat, phi), the compression
    to the top-1, lambda's ascent at the new phi (constraint violated), then its restart (constraint holds)."""
    s = _tiny()
    st = ServerState(4, {"theta": np.zeros(4, np.float32), "log_alpha": np.zeros(4, np.float32)},
                     {"lambda": np.array([0.8])})
    dp = s.plan(st, "d0", {})
    a = F.Message(np.array([2], np.int32), np.array([1.5], np.float32), np.array([1.0], np.float32),
                  np.array([-0.5], np.float32))
    b = F.Message(np.array([1], np.int32), np.array([-2.0], np.float32), np.array([2.0], np.float32),
                  np.array([0.25], np.float32))
    acc = s.begin(st)
    s.accumulate(st, acc, dp, _report(a, 10))
    s.accumulate(st, acc, dp, _report(b, 30, "d1"))
    new = s.finish(st, acc)
    # by hand: a = theta (0, 0, 1.5, 0), phi (-.5, -.5, 1, -.5); b = theta (0, -2, 0, 0), phi (.25, 2, .25, .25)
    theta = (np.array([0, 0, 1.5, 0]) * 10 + np.array([0, -2, 0, 0]) * 30) / 40
    phi = (np.array([-.5, -.5, 1, -.5]) * 10 + np.array([.25, 2, .25, .25]) * 30) / 40  # (.0625, 1.375, .4375, .0625)
    top = 1  # the largest phi
    rest = (phi.sum() - phi[top]) / 3
    want_phi = np.full(4, rest)
    want_phi[top] = phi[top]
    want_theta = np.zeros(4)
    want_theta[top] = theta[top]
    np.testing.assert_allclose(new.weights["theta"], want_theta, rtol=1e-6)
    np.testing.assert_allclose(new.weights["log_alpha"], want_phi, rtol=1e-6)
    c = np.mean(_sig(want_phi - BETA * math.log(-GAMMA / ZETA))) - 0.25
    assert c > 0.2  # violated: lambda ascends by lam_lr * c
    assert float(new.opt["lambda"][0]) == pytest.approx(0.8 + 0.5 * c, rel=1e-9)
    assert new.round == 5 and s.metrics(new)["lambda"] == pytest.approx(0.8 + 0.5 * c)
    # a round whose phi meets the constraint: lambda restarts at 0
    low = F.Message(np.array([0], np.int32), np.array([1.0], np.float32), np.array([-3.0], np.float32),
                    np.array([-6.0], np.float32))
    acc = s.begin(new)
    s.accumulate(new, acc, s.plan(new, "d0", {}), _report(low, 5))
    assert F.constraint(np.array([-3, -6, -6, -6]), 0.25) < 0
    assert float(s.finish(new, acc).opt["lambda"][0]) == 0.0


def test_objective_matches_a_numpy_lagrangian_and_its_gradient():
    """MSE of a linear model with gated weights, plus lam (mean P(z != 0) - rho): value and both gradients
    against numpy at a point where the data term, the gates' slopes and the constraint term all contribute
    (one gate clamped at 1 and one at 0: their log-alpha gets no data gradient, only the constraint's)."""
    d, n = 6, 5
    rng = np.random.default_rng(3)
    x, y, w = rng.normal(size=(n, d)), rng.normal(size=n), np.full(n, 1 / n)
    th = rng.normal(size=d)
    la = np.array([0.3, -0.4, 1.0, 0.0, 4.0, -4.0])
    u = np.array([0.4, 0.6, 0.3, 0.55, 0.9, 0.1])
    lam, rho = 10.0, 0.2
    t = make_trainer("torch")
    t.load(torch_program(mlp([d, 1]), "flops", {"loss": "mse", "bias": False}).data)
    t.set_weights({"fc0.weight": th[None].astype(np.float32), "la.fc0.weight": la[None].astype(np.float32)})
    loss, g, aux = t.loss_and_grads({"x": x.astype(np.float32), "y": y.astype(np.float32),
                                     "u.fc0.weight": u[None].astype(np.float32), "lam": np.float32(lam),
                                     "rho": np.float32(rho)})
    s = _sig((np.log(u) - np.log(1 - u) + la) / BETA)
    zs = s * (ZETA - GAMMA) + GAMMA
    z = np.clip(zs, 0, 1)
    assert z[4] == 1 and z[5] == 0 and ((z[:4] > 0) & (z[:4] < 1)).all()
    r = x @ (th * z) - y
    p = _sig(la - BETA * math.log(-GAMMA / ZETA))
    data, cons = (w * r ** 2).sum(), lam * (p.mean() - rho)
    assert loss == pytest.approx(data + cons, rel=1e-5) and cons > 0.2 * data
    np.testing.assert_allclose(aux["logits"][:, 0], r + y, rtol=1e-5)
    dth = (2 * w * r) @ x * z
    dz = (2 * w * r) @ x * th
    dz_dla = np.where((zs > 0) & (zs < 1), (ZETA - GAMMA) * s * (1 - s) / BETA, 0.0)
    dla = dz * dz_dla + lam * p * (1 - p) / d
    np.testing.assert_allclose(g["fc0.weight"][0], dth, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g["la.fc0.weight"][0], dla, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- messages and exact density

def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes() + str(a.dtype).encode() + str(a.shape).encode()


def test_top_k_message_round_trip_is_bit_exact_through_the_wire():
    """compress -> plan on the wire -> rebuild -> compress gives the same bytes; so does a report; and a
    compressed state survives the trip unchanged."""
    rng = np.random.default_rng(1)
    n, k = 1000, 37
    theta, la = rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(np.float32)
    msg = F.compress(theta, la, k)
    assert msg.idx.dtype == np.int32 and (np.diff(msg.idx) > 0).all() and msg.log_alpha_rest.dtype == np.float32
    plan = Plan("t", 1, "d0", 1e18, "flops-pa", "torch", "0" * 64, msg.arrays(), {}, 1)
    got = F.Message.from_arrays(wire.decode(wire.encode(plan)).weights)
    for k_ in F.MESSAGE:
        assert _bits(getattr(got, k_)) == _bits(getattr(msg, k_))
    th2, la2 = F.rebuild(got, n)
    assert np.count_nonzero(th2) == k and _bits(th2[msg.idx]) == _bits(theta[msg.idx])
    again = F.compress(th2, la2, k)
    for k_ in F.MESSAGE:
        assert _bits(getattr(again, k_)) == _bits(getattr(msg, k_))
    rep = wire.decode(wire.encode(_report(msg, 7)))
    back = F.Message.from_arrays(rep.extras)
    for k_ in F.MESSAGE:
        assert _bits(getattr(back, k_)) == _bits(getattr(msg, k_))
    # what the server keeps is compressed, so its plan rebuilds to the state exactly
    s = FLoPSPA(spec=SPEC, rho=0.1)
    st = s.init(0)
    p = wire.decode(wire.encode(Plan("t", 1, "d0", 1e18, s.name, "torch", "0" * 64, s.plan(st, "d0", {}).weights,
                                     {}, 1)))
    th3, la3 = F.rebuild(F.Message.from_arrays(p.weights), s.n)
    assert _bits(th3) == _bits(st.weights["theta"]) and _bits(la3) == _bits(st.weights["log_alpha"])


def test_rebuild_refuses_malformed_messages():
    ok = F.compress(np.ones(10, np.float32), np.arange(10, dtype=np.float32), 3)
    bad = [F.Message(ok.idx.astype(np.int64), ok.theta, ok.log_alpha, ok.log_alpha_rest),
           F.Message(ok.idx[::-1].copy(), ok.theta, ok.log_alpha, ok.log_alpha_rest),
           F.Message(np.array([1, 1, 2], np.int32), ok.theta, ok.log_alpha, ok.log_alpha_rest),
           F.Message(np.array([1, 2, 10], np.int32), ok.theta, ok.log_alpha, ok.log_alpha_rest),
           F.Message(ok.idx, ok.theta[:2], ok.log_alpha, ok.log_alpha_rest)]
    for m in bad:
        with pytest.raises(ValueError):
            F.rebuild(m, 10)
    with pytest.raises(ValueError):
        F.check_message(ok, 10, k=4)


def test_exact_density_step():
    """Top-k log-alphas to >= +log 11 (gate 1), the rest to <= -log 11 (gate 0): exactly k non-zero
    noise-free gates, the ranking and values already beyond the bounds unchanged, idempotent."""
    rng = np.random.default_rng(2)
    la = rng.normal(0, 3, 500).astype(np.float32)
    k = 25
    out = F.exact_density(la, k)
    gates = F.noise_free_gates(out)
    top = np.sort(np.argsort(-la)[:k])
    assert np.count_nonzero(gates) == k and (gates[top] == 1).all()
    assert (out[top] >= math.log(11) - 1e-6).all() and (np.delete(out, top) <= -math.log(11) + 1e-6).all()
    keep = (la >= math.log(11)) & np.isin(np.arange(500), top) | (la <= -math.log(11)) & ~np.isin(np.arange(500), top)
    assert (out[keep] == la[keep]).all()
    np.testing.assert_array_equal(F.top_k(out, k), top)
    np.testing.assert_array_equal(F.exact_density(out, k), out)
    theta = rng.normal(size=500).astype(np.float32)
    assert F.density(F.pruned(theta, out)) == k / 500


def test_strategy_density_is_exactly_rho_from_prune_start():
    s = FLoPSPA(spec=SPEC, rho=0.1, prune_start=0)
    st = s.init(0)
    assert s.k == round(0.1 * s.n) and s.metrics(st)["density"] == s.k / s.n
    spec, w = s.global_model(st)
    assert sum(np.count_nonzero(v) for v in w.values()) == s.k and set(w) == set(spec_params(spec))


def spec_params(spec):
    from edge.model import param_shapes
    return param_shapes(spec)


# ---------------------------------------------------------------- admission of int32 extras

def test_admission_takes_the_extra_dtype_the_plan_declares():
    dp = DevicePlan({"theta": np.zeros(3, np.float32)}, {}, {"dtype": "f4"}, SPEC, extras={"idx": (3,), "m": (1,)},
                    extra_dtypes={"idx": "i4"})
    rep = lambda idx, m: Report("t", "d0", 5, {}, {"theta": TensorUpdate((3,), np.ones(3, np.float32))},  # noqa: E731
                                {"idx": idx, "m": m})
    rules = AdmissionRules()
    check_structure(dp, rep(np.array([1, 5, 2_000_000], np.int32), np.zeros(1, np.float32)), rules)  # no value bound
    for idx, m in [(np.zeros(3, np.float32), np.zeros(1, np.float32)), (np.zeros(3, np.int64), np.zeros(1, np.float32)),
                   (np.zeros(3, np.int32), np.zeros(1, np.int32))]:
        with pytest.raises(ReportRejected):
            check_structure(dp, rep(idx, m), rules)


# ---------------------------------------------------------------- baselines

def test_hard_threshold_and_the_baselines_servers():
    th = np.array([0.5, -3.0, 0.1, 2.0, -2.0], np.float32)
    np.testing.assert_array_equal(F.hard_threshold(th, 2), [0, -3, 0, 2, 0])
    np.testing.assert_array_equal(F.hard_threshold(np.array([1, -1, 1], np.float32), 2), [1, -1, 0])  # ties: lower index
    s = FedIterHT(spec=mlp([5, 1]), rho=0.4, loss="mse", bias=False)
    st = ServerState(0, {"theta": np.zeros(5, np.float32)})
    dp = s.plan(st, "d0", {})
    acc = s.begin(st)
    for idx, v, n in [([0, 3], [1.0, 4.0], 1), ([1, 3], [-6.0, 2.0], 3)]:
        s.accumulate(st, acc, dp, Report("t", "d", n, {}, {}, {"idx": np.array(idx, np.int32),
                                                               "theta": np.array(v, np.float32)}))
    # mean (0.25, -4.5, 0, 2.5, 0) -> H_2
    np.testing.assert_allclose(s.finish(st, acc).weights["theta"], [0, -4.5, 0, 2.5, 0])
    p = FedAvgPrune(spec=mlp([5, 1]), rho=0.4, loss="mse", bias=False)
    st = ServerState(0, {"theta": th})
    assert p.metrics(st)["density"] == 0.4 and np.count_nonzero(p.global_model(st)[1]["fc0.weight"]) == 2


# ---------------------------------------------------------------- data and metrics

def test_generators_and_metrics():
    rng = np.random.default_rng(0)
    x = toeplitz_features(40_000, 6, 0.7, rng)
    np.testing.assert_allclose(np.cov(x.T), toeplitz(6, 0.7), atol=0.03)
    c = quantity_skew(1000, 20, 0.5, 10, rng)
    assert c.sum() == 1000 and c.min() >= 10 and c.max() > 3 * np.median(c)
    p = make_problem("LR", d=50, n_clients=10, n_train=2000, snr=20, seed=1)
    assert p.support.sum() == round(0.05 * 50) and set(np.unique(p.truth[p.truth != 0])) <= {-1.0, 1.0}
    assert sum(len(x) for x, _ in p.shards) == 2000
    best = quality("LR", p.truth, p.x_test, p.y_test)["r2"]
    assert best == pytest.approx(20 / 21, abs=0.03)  # SNR 20: R2 of the truth is about SNR / (1 + SNR)
    sm = support_metrics(np.array([1, 0, 2, 0, 3.0]), np.array([1, 1, 0, 0, 1], bool))
    assert sm == {"tdr": 2 / 3, "recall": 2 / 3, "density": 0.6}
    assert support_metrics(np.zeros(5), np.array([1, 0, 0, 0, 0], bool))["tdr"] == 0.0
    q = make_problem("MC", d=20, classes=3, n_clients=5, n_train=500, seed=2, alpha=0.5, shift=0.5)
    assert q.truth.shape == (3, 20) and quality("MC", q.truth, q.x_test, q.y_test)["accuracy"] > 0.8


# ---------------------------------------------------------------- end to end

def test_flops_pa_over_the_round_machine_reaches_the_exact_density(tmp_path):
    s = make_strategy("flops-pa", spec=SPEC, rho=0.1, prune_start=2, lr=0.1, la_lr=1.0, epochs=1, batch_size=10)
    bus = make_bus(tmp_path, 5, rounds=2, per_round=5, over=1.0, strategy=s)
    bus.connect_all()
    for _ in range(2):
        bus.tick(0.1)
    assert len(bus.committed) == 2
    st = bus.m.state
    assert s.metrics(st)["density"] == s.k / s.n and s.k == round(0.1 * s.n)
    down = [r["bytes_down"] for r in bus.committed]
    assert max(down) < 5 * 4 * 4 * s.k + 200_000  # top-k messages (and the programs, sent once)


def test_flops_step_is_the_averaged_gradient_step(tmp_path):
    """FLoPS: one exchange = every selected client takes one step from the same point; the server's mean is
    theta - lr * mean(g) (checked against the clients' gradients computed here with the same noise)."""
    prob = make_problem("LR", d=20, n_clients=3, n_train=90, seed=0)
    s = FLoPS(spec=mlp([20, 1]), rho=0.1, loss="mse", bias=False, lr=0.01, la_lr=0.3, lam_lr=0.5, batch_size=10,
              prune_start=99, weighting="uniform")
    loop = Loop(s, prob.shards, seed=0, threads=1)
    st0 = loop.state
    st0.opt["lambda"][:] = 0.7
    dp = s.plan(st0, "d0", {})
    outs = []
    for i, d in enumerate(loop.ids):  # each client's one step, run directly
        from coordinator.selection import device_seed
        plan = Plan("r1", 1, d, 1e18, s.name, "torch", "0" * 64, dp.weights, dp.hparams, device_seed(0, 1, d),
                    dp.upload)
        rep = run_plan(plan, loop.trainer(dp.spec, dp.objective, dp.layout), *prob.shards[i])
        outs.append({k: t.dense() for k, t in rep.tensors.items()})
    loop.round([0, 1, 2])
    new = loop.state
    for k in ("theta", "log_alpha"):
        np.testing.assert_allclose(new.weights[k], np.mean([o[k] for o in outs], 0), rtol=1e-6, atol=1e-7)
    assert not np.allclose(new.weights["log_alpha"], st0.weights["log_alpha"])
    loop.close()


# ---------------------------------------------------------------- over MQTT, every runtime

@pytest.mark.slow
@pytest.mark.mosquitto
@pytest.mark.timeout(1800)  # two ExecuTorch exports (the training program, then the pruned model)
def test_flops_pa_over_mqtt_on_every_runtime_exports_the_exact_density(tmp_path, monkeypatch):
    """fedge simulate --strategy flops-pa -S rho=0.1 with torch, ORT and ExecuTorch devices (round-robin): every
    round commits every device's report, the density is exactly 0.1 from prune start on, and the exported
    inference model (ONNX, read back from the file) has exactly k = 0.1 |theta| non-zero weights."""
    import os
    from pathlib import Path

    from benchmarks.flops_zoo import onnx_density
    from coordinator.broker import Mosquitto, mosquitto_binary
    from coordinator.simulate import SimConfig, simulate
    from export.final import export_final
    if mosquitto_binary() is None and not os.environ.get("CI"):
        pytest.skip("mosquitto not installed")
    monkeypatch.setenv("FEDGE_PROGRAM_CACHE", str(Path(__file__).resolve().parent.parent / "runs" / "programs"))
    kw = {"rho": 0.1, "prune_start": 2, "la_lr": 2.0}
    with Mosquitto() as broker:
        cfg = SimConfig(strategy="flops-pa", devices=6, clients_per_round=6, over_selection=1.0, rounds=3, epochs=1,
                        lr=0.1, hidden=(32,), seed=1, processes=2, runtimes=("torch", "ort", "executorch"),
                        round_timeout_s=600,  # a loaded machine: device processes took minutes to start, rounds timed out
                        broker=broker.url, workdir=str(tmp_path / "sim"), strategy_kw=kw)
        rep = simulate(cfg, progress=False)
    rows = rep["rounds"]
    assert [r["reports"] for r in rows] == [6, 6, 6]
    s = make_strategy("flops-pa", spec=mlp([64, 32, 10]), **kw)
    assert s.n == 2410 and s.k == 241  # 0.1 |theta| is a whole number: the density is 0.1 exactly
    assert [r["density"] for r in rows[1:]] == [0.1, 0.1]
    spec, w = s.global_model(rep["_state"])
    export_final(spec, w, tmp_path / "final", "flops-pa")
    assert onnx_density(tmp_path / "final" / "flops-pa.onnx") == (241, 2410)


# ---------------------------------------------------------------- the multiplier (issue #27)

def _flops_run(lam_lr, exchanges, method="flops", **kw):
    p = make_problem("LR", d=100, n_clients=10, n_train=1000, snr=20, seed=3)
    extra = {"steps_per_epoch": 1} if method == "flops" else {}
    s = make_strategy(method, spec=mlp([100, 1]), rho=0.05, loss="mse", bias=False, lr=0.03, la_lr=10.0,
                      lam_lr=lam_lr, batch_size=20, **extra, **kw)
    loop = Loop(s, p.shards, seed=0, threads=1)
    try:
        trace = []
        for _ in range(exchanges):
            loop.round(list(range(10)))
            trace.append(s.metrics(loop.state) | {"theta_nnz": int(np.count_nonzero(loop.state.weights["theta"]))})
        return s, p, s.pruned(loop.state), trace
    finally:
        loop.close()


def test_flops_multiplier_closes_the_gates_before_any_pruning_step():
    """Dense FLoPS with no exact-density step (prune start beyond the run): the multiplier alone takes the
    test-time density from 1 towards rho = 0.05 (the paper's Fig. 1) and keeps the true support; with
    lam_lr = 0 the same run keeps every gate open. lambda follows its ascent, lam_lr c(phi) per exchange."""
    s, p, theta, tr = _flops_run(0.1, 80, prune_start=10**6)
    _, _, theta0, tr0 = _flops_run(0.0, 80, prune_start=10**6)
    assert tr[0]["density"] == 1.0 and tr0[-1]["density"] == 1.0 and tr0[-1]["expected_density"] > 0.8
    assert tr[-1]["density"] < 0.15 and tr[-1]["expected_density"] < 0.35  # from 1.0 and 0.83
    assert (theta[p.support] != 0).all() and F.density(theta) == tr[-1]["density"]
    lam = [0.0] + [t["lambda"] for t in tr]
    for i in range(1, len(lam)):  # the server's ascent at the committed phi (c > 0 throughout: no restart)
        assert tr[i - 1]["expected_density"] > 0.05
        assert lam[i] == pytest.approx(lam[i - 1] + 0.1 * (tr[i - 1]["expected_density"] - 0.05), rel=1e-9, abs=1e-12)
    assert all(t["lambda"] == 0.0 for t in tr0)


def test_flops_pa_model_is_k_sparse_from_round_0_whatever_the_multiplier():
    """Why the multiplier cannot change FLoPS-PA in fedge's reading (docs/flops.md): the top-k message zeroes
    theta_hat beyond the k kept entries from round 0, so the model has at most k non-zero weights before
    prune start while the relaxed constraint c(phi) stays violated; lambda's gradient then falls on the
    log-alphas of zero weights (the rest, one mean), which only the rest's mean carries."""
    s, p, theta, tr = _flops_run(0.1, 12, method="flops-pa", prune_start=10**6)
    _, _, theta0, tr0 = _flops_run(0.0, 12, method="flops-pa", prune_start=10**6)
    for t in tr + tr0:
        assert t["theta_nnz"] <= s.k and t["density"] <= s.k / s.n and t["expected_density"] > 0.05 + 0.5
    assert tr[-1]["lambda"] > 0.5 and tr0[-1]["lambda"] == 0.0
    # the same weights survive with and without the multiplier, and the kept values barely move
    np.testing.assert_array_equal(theta != 0, theta0 != 0)
    assert np.abs(theta - theta0).max() < 0.02 * np.abs(theta0).max()


def test_benchmark_paired_interval_against_a_hand_computation():
    """The synthetic benchmark's comparison: the paired difference over seeds, its 95% t-interval
    (t_{0.975, n-1} s_d / sqrt(n)) and whether it excludes 0; the spread is the sample standard deviation."""
    from benchmarks.flops_synthetic import paired, spread
    a, b = [0.9, 0.8, 0.85, 0.95, 0.7], [0.8, 0.8, 0.8, 0.8, 0.8]
    d = [0.1, 0.0, 0.05, 0.15, -0.1]  # mean 0.04; squared deviations sum to 0.037: sample variance 0.00925
    half = 2.776 * math.sqrt(0.00925) / math.sqrt(5)
    got = paired(a, b)
    assert got["diff"] == pytest.approx(0.04) and got["ci95"] == pytest.approx(half, rel=1e-9)
    assert not got["exceeds_noise"]  # 0.04 < 0.119
    got = paired([x + 0.2 for x in b[:3]], b[:3])  # constant difference: zero spread, the interval is 0
    assert got["diff"] == pytest.approx(0.2) and got["ci95"] == pytest.approx(0, abs=1e-12) and got["exceeds_noise"]
    assert paired([0.5, None, 0.7], [0.4, 0.4, 0.4])["exceeds_noise"] is False  # a diverged seed: not a finding
    sp = spread(a)
    assert sp["mean"] == pytest.approx(0.84) and sp["sd"] == pytest.approx(math.sqrt(0.00925))  # a - 0.84 = d - 0.04
