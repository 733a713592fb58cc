"""Server steps and the baselines' client halves at the parameters that hide slips (issue 28): FedAvg's robust
centres with an even number of reports (a median between two) and a trim that rounds, FedIter-HT's and
FedAvg-prune's weighting and thresholds (with ties), FedL1's server prune at a norm exactly lambda and its
"a layer keeps its strongest unit", and the FedIter-HT and FedL1 clients over 2 epochs with an uneven last
batch, each against a reference written here (numpy, or torch float64 autograd for the networks).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from coordinator.strategies.base import ServerState
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.fediter_ht import FedAvgPrune, FedIterHT
from coordinator.strategies.fedl1 import FedL1
from edge.algorithms import fediter_ht as HT
from edge.algorithms.driver import run_plan
from edge.model import mlp
from edge.protocol import wire
from edge.protocol.wire import Plan, Report, TensorUpdate
from edge.runtime.program import torch_program
from edge.trainers import make_trainer

EPS32 = float(np.finfo(np.float32).eps)
SPEC = mlp([5, 4, 3])
SHAPES = {"fc0.weight": (4, 5), "fc0.bias": (4,), "fc1.weight": (3, 4), "fc1.bias": (3,)}


def dense(dev, n, values):
    return wire.decode(wire.encode(Report("t", dev, n, {"train_loss": 1.0},
                                          {k: TensorUpdate(v.shape, np.asarray(v, np.float32)) for k, v in values.items()})))


def ref_threshold(flat, counts):
    """Per tensor: its count of largest |theta|, ties to the lower index; zero elsewhere."""
    out = np.zeros_like(flat)
    i = 0
    for (k, s), c in zip(SHAPES.items(), counts):
        n = math.prod(s)
        seg = flat[i:i + n]
        keep = sorted(range(n), key=lambda j: (-abs(float(seg[j])), j))[:int(c)]
        out[i + np.array(keep, int)] = seg[keep]
        i += n
    return out


# ---------------------------------------------------------------------------------------------- FedAvg's centres
def test_fedavg_median_of_an_even_count_and_a_trimmed_mean_whose_trim_rounds_down():
    """4 reports: the coordinate-wise median is the mean of the middle two (unweighted, whatever N_s);
    trim 0.3 of 5 reports cuts int(1.5) = 1 from each end. Server lr 0.5: w + 0.5 (centre - w). Kills: the
    upper or lower middle as the median, a trim rounded to nearest, the weighted mean."""
    spec = mlp([3, 2])
    vals = [np.array([[1., 5, -2], [0, 0, 1]]), np.array([[3., 1, -2], [2, 0, 1]]),
            np.array([[7., 2, 4], [4, 8, 1]]), np.array([[-5., 9, 0], [6, 0, 1]]), np.array([[10., -3, 6], [1, 1, 1]])]
    for agg, kept, kw in (("median", 4, {}), ("trimmed_mean", 5, {"trim": 0.3})):
        s = FedAvg(spec=spec, aggregate=agg, server_lr=0.5, **kw)
        st = s.init(0)
        acc = s.begin(st)
        dp = s.plan(st, "d0", {})
        for i, v in enumerate(vals[:kept]):
            s.accumulate(st, acc, dp, dense(f"d{i}", 1 + 10 * i, {"fc0.weight": v, "fc0.bias": v[:, 0]}))
        new = s.finish(st, acc)
        stack = np.stack(vals[:kept])
        if agg == "median":
            srt = np.sort(stack, 0)
            centre = (srt[1] + srt[2]) / 2
        else:
            centre = np.sort(stack, 0)[1:4].mean(0)
        w0 = st.weights["fc0.weight"].astype(np.float64)
        np.testing.assert_allclose(new.weights["fc0.weight"], w0 + 0.5 * (centre - w0), rtol=1e-6, atol=1e-6)
        b0 = st.weights["fc0.bias"].astype(np.float64)
        np.testing.assert_allclose(new.weights["fc0.bias"], b0 + 0.5 * (centre[:, 0] - b0), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- FLoPS's baselines
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_fediter_ht_server_weighted_mean_then_per_tensor_threshold(weighting):
    """FedIter-HT: the (sample- or uniformly) weighted mean of the rebuilt messages, then per-tensor H_k with
    ties to the lower index; FedAvg-prune: the dense weighted mean, pruned (globally) only in the model it
    reports. Kills: n_samples under uniform weighting, the threshold skipped, the mean over the count."""
    s = FedIterHT(spec=SPEC, rho=0.5, weighting=weighting)
    n = 39
    assert s.k == round(0.5 * 39) == 20
    st = s.init(0)
    dp = s.plan(st, "d0", {})
    idx = dp.weights["idx"]
    rng = np.random.default_rng(0)
    acc = s.begin(st)
    rebuilt = []
    for i, ns in enumerate((2, 7, 3)):
        vals = np.round(rng.normal(size=len(idx)) * 4) / 4  # quarters: ties in |theta|
        full = np.zeros(n)
        full[idx] = vals
        rebuilt.append((ns, full))
        s.accumulate(st, acc, dp, Report("t", f"d{i}", ns, {}, {}, {"idx": idx, "theta": vals.astype(np.float32)}))
    new = s.finish(st, acc)
    w = [ns if weighting == "samples" else 1.0 for ns, _ in rebuilt]
    mean = sum(wi * f for wi, (_, f) in zip(w, rebuilt)) / sum(w)
    want = ref_threshold(mean, HT.keep_counts(s.shapes, s.k))
    np.testing.assert_allclose(new.weights["theta"], want, rtol=1e-6, atol=1e-7)
    assert np.count_nonzero(new.weights["theta"]) <= s.k and new.round == 1

    p = FedAvgPrune(spec=SPEC, rho=0.5, weighting=weighting)
    st = p.init(0)
    dp = p.plan(st, "d0", {})
    acc = p.begin(st)
    for i, (ns, f) in enumerate(rebuilt):
        p.accumulate(st, acc, dp, Report("t", f"d{i}", ns, {"train_loss": 1.0},
                                         {"theta": TensorUpdate((n,), f.astype(np.float32))}))
    new = p.finish(st, acc)
    np.testing.assert_allclose(new.weights["theta"], mean, rtol=1e-6, atol=1e-7)
    keep = sorted(range(n), key=lambda j: (-abs(float(np.float32(mean[j]))), j))[:20]
    g = np.zeros(n)
    g[keep] = mean[keep]
    got = np.concatenate([p.global_model(new)[1][k].ravel() for k in SHAPES])
    np.testing.assert_allclose(got, g, rtol=1e-6, atol=1e-7)
    assert p.metrics(new)["density"] == np.count_nonzero(g) / n


def torch_net(P, x):
    h = torch.relu(x @ P["fc0.weight"].T + P["fc0.bias"])
    return h @ P["fc1.weight"].T + P["fc1.bias"]


def ref_sgd(P, x, y, *, seed, lr, epochs, batch_size, after=None):
    """Mean cross-entropy SGD over the plan's batches (a fresh permutation per epoch from the seed), float64;
    ``after(P, pre)`` runs after each step (the baselines' own operators)."""
    P = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in P.items()}
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        perm = rng.permutation(len(x))
        for i in range(0, len(x), batch_size):
            b = perm[i:i + batch_size]
            loss = torch.nn.functional.cross_entropy(torch_net(P, torch.tensor(x[b], dtype=torch.float64)),
                                                     torch.tensor(y[b]))
            g = torch.autograd.grad(loss, list(P.values()))
            pre = {k: v.detach().numpy().copy() for k, v in P.items()}
            with torch.no_grad():
                for (k, v), gk in zip(P.items(), g):
                    v -= lr * gk
            if after:
                new = after({k: v.detach().numpy().copy() for k, v in P.items()}, pre)
                with torch.no_grad():
                    for k, v in P.items():
                        v.copy_(torch.tensor(new[k]))
    return {k: v.detach().numpy() for k, v in P.items()}


def tol(steps, scale):
    """float32 SGD against float64: 64 ulps of the values' scale per step (a 2-layer forward and backward and
    the parameter's own rounding, a few ulps each)."""
    return 64 * EPS32 * steps * max(1.0, scale)


def test_fediter_ht_client_thresholds_after_every_step_against_reference():
    """FedIter-HT's client: per step an SGD step then per-tensor H_k with the plan's counts; 2 epochs of
    batches 4, 4, 2; the report is the top-k message (indices ascending, values there). Kills: the
    threshold only at the end, the counts of another tensor, the message's values off their indices."""
    s = FedIterHT(spec=SPEC, rho=0.5)
    st = s.init(1)
    dp = s.plan(st, "d0", {})
    counts = HT.keep_counts(s.shapes, s.k)
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(10, 5)).astype(np.float32), rng.integers(0, 3, 10)
    hp = {"lr": 0.4, "epochs": 2, "batch_size": 4}
    plan = Plan("r1a0", 1, "d0", 1e18, "fediter-ht", "torch", "0" * 64, dp.weights, hp, 11, {"dtype": "f4"})
    t = make_trainer("torch")
    t.load(torch_program(SPEC, "flops_dense", {"loss": "ce", "bias": True}).data)
    rep = run_plan(plan, t, x, y)
    theta0 = np.zeros(39)
    theta0[dp.weights["idx"]] = dp.weights["theta"]
    split = lambda f: {k: f[a:b].reshape(sh) for (k, sh), (a, b) in zip(SHAPES.items(), HT.spans(SHAPES))}  # noqa
    flat = lambda P: np.concatenate([P[k].ravel() for k in SHAPES])  # noqa: E731
    P = ref_sgd(split(theta0), x, y, seed=11, lr=0.4, epochs=2, batch_size=4,
                after=lambda P, pre: split(ref_threshold(flat(P), counts)))
    want = flat(P)
    idx = np.flatnonzero(np.isin(np.arange(39), np.asarray(rep.extras["idx"])))
    np.testing.assert_array_equal(rep.extras["idx"], idx)
    full = np.zeros(39)
    full[rep.extras["idx"]] = rep.extras["theta"]
    np.testing.assert_allclose(full, want, rtol=0, atol=tol(6, np.abs(want).max()))
    assert HT.counts_of(rep.extras["idx"], SHAPES).tolist() == counts.tolist()


def test_fedl1_client_group_lasso_step_and_threshold_against_reference():
    """FedL1's client: per step SGD on the mean cross-entropy plus lambda sum_g ||w_g|| (the group gradient at
    the pre-step weights), 2 epochs of 4, 4, 2 rows; at the end groups with ||w_g|| <= lambda are masked out
    of fc0's weight and bias. Kills: lambda's gradient at the post-step weights, lr left out of it, the
    threshold's side."""
    lam, lr = 0.12, 0.3
    rng = np.random.default_rng(6)
    w0 = {k: (rng.normal(size=s) * 0.5).astype(np.float32) for k, s in SHAPES.items()}
    w0["fc0.weight"][1] *= 0.05  # a weak group: it ends below lambda
    w0["fc0.bias"][1] = 0.0
    x, y = rng.normal(size=(10, 5)).astype(np.float32), rng.integers(0, 3, 10)
    hp = {"lr": lr, "epochs": 2, "batch_size": 4, "l1": lam}
    plan = Plan("r1a0", 1, "d0", 1e18, "fedl1", "torch", "0" * 64, w0, hp, 13, {"dtype": "f4"})
    t = make_trainer("torch")
    t.load(torch_program(SPEC, "ce", {}).data)
    rep = run_plan(plan, t, x, y)

    def lasso(P, pre):
        n = np.sqrt((pre["fc0.weight"] ** 2).sum(1) + pre["fc0.bias"] ** 2)
        sc = np.where(n > 0, lr * lam / np.maximum(n, 1e-12), 0.0)
        P["fc0.weight"] = P["fc0.weight"] - sc[:, None] * pre["fc0.weight"]
        P["fc0.bias"] = P["fc0.bias"] - sc * pre["fc0.bias"]
        return P

    P = ref_sgd(w0, x, y, seed=13, lr=lr, epochs=2, batch_size=4, after=lasso)
    norms = np.sqrt((P["fc0.weight"] ** 2).sum(1) + P["fc0.bias"] ** 2)
    keep = norms > lam
    assert 0 < keep.sum() < 4 and np.abs(norms - lam).min() > 1e-3, norms  # both sides, none at the edge
    for k in SHAPES:
        tu = rep.tensors[k]
        if k.startswith("fc0"):
            np.testing.assert_array_equal(tu.mask, keep)
            got, want = tu.values, P[k][keep]
        else:
            assert tu.mask is None
            got, want = tu.dense(), P[k]
        np.testing.assert_allclose(got, want, rtol=0, atol=tol(6, np.abs(want).max()), err_msg=k)


def test_fedl1_server_prunes_at_norm_exactly_lambda_and_keeps_a_layers_strongest_unit():
    """FedL1's server: after the FedAvg step, a group whose norm is <= lambda (exactly lambda here) dies; a
    layer with every group at or below lambda keeps its strongest; dead groups' rows, biases and the next
    layer's columns are zero. Kills: < for <= at the threshold, the weakest unit kept, dead columns left."""
    spec = mlp([2, 3, 3, 2])
    s = FedL1(spec=spec, l1=0.625, server_lr=1.0)
    init = s.init(0)  # from zeros, so that the mean lands exactly (w + (mean - w) in float32)
    st = ServerState(0, {k: np.zeros_like(v) for k, v in init.weights.items()}, init.opt)
    dp = s.plan(st, "d0", {})
    W = {k: np.ones(v.shape, np.float32) for k, v in dp.weights.items()}
    # norms 0.625 (exactly 0.375^2 + 0.5^2 = 0.390625), 0.5 and 2 (bias 0); lambda = 0.625
    W["fc0.weight"] = np.array([[0.375, 0.5], [0.5, 0.0], [2.0, 0.0]], np.float32)
    W["fc0.bias"] = np.zeros(3, np.float32)
    W["fc1.weight"] = np.array([[0.1, 0.0, 0.0], [0.0, 0.2, 0.0], [0.0, 0.0, 0.3]], np.float32)
    W["fc1.bias"] = np.zeros(3, np.float32)  # fc1's norms 0.1, 0.2, 0.3: all below lambda
    new = s.finish(st, _acc(s, st, dp, W))
    assert new.opt["alive/fc0"].tolist() == [0, 0, 1]
    assert new.opt["alive/fc1"].tolist() == [0, 0, 1]  # the strongest of an all-weak layer
    assert not new.weights["fc0.weight"][:2].any() and not new.weights["fc1.weight"][:, :2].any()
    assert not new.weights["fc1.weight"][:2].any() and not new.weights["fc2.weight"][:, :2].any()
    np.testing.assert_array_equal(new.weights["fc0.weight"][2], [2.0, 0.0])
    assert new.weights["fc2.weight"][:, 2].tolist() == [1.0, 1.0]


def _acc(s, st, dp, W):
    acc = s.begin(st)
    s.accumulate(st, acc, dp, dense("d0", 3, W))
    return acc


def test_an_upload_that_keeps_every_row_is_not_sampled():
    """upload_spec: keep = 1 with a sampling rule is the plain upload (float32 weights, no probabilities on the
    wire, no forced differences); keep below 1 turns sampling on and makes the upload differences."""
    from coordinator.strategies.base import upload_spec
    assert upload_spec("f4", sample="norm", keep=1.0, p_min=0.1) == {"dtype": "f4", "delta": False}
    assert upload_spec("q8", sample="norm", keep=1.0) == {"dtype": "q8", "delta": True}
    assert upload_spec("f4", sample="uniform", keep=0.5, p_min=0.1) == {
        "dtype": "f4", "delta": True, "sample": "uniform", "keep": 0.5, "p_min": 0.1}
