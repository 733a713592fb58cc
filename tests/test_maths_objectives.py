"""Every client objective against an independent reference (issue 9, "tests that catch wrong maths").

Each reference is the objective's formula written out again here in float64 torch, differentiated by autograd;
nothing from ``edge`` computes any of it (the hard-concrete constants are written as numbers, not imported).
The code runs through the torch trainer exactly as a device does (``torch_program`` -> ``loss_and_grads``).

Every test is taken at a point where every term contributes: for each term (and each constant) we also
compute the reference with that term removed or changed, and require the result to move some output (the
loss, a gradient or an aux output) by at least ``SENSITIVE`` times the tolerance of the comparison. So the
comparison could not pass with that term missing.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from edge.model import cnn, mlp, param_shapes
from edge.runtime.program import torch_program
from edge.trainers.torch_backend import TorchTrainer

# Louizos et al. 2018's hard-concrete constants (the values docs/fedsparse.md and paper 000's notes name).
BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1
RTOL, ATOL = 1e-4, 1e-6  # float32 code against a float64 reference
SENSITIVE = 30.0  # a removed term must move some output by this many tolerances


# ------------------------------------------------------------------------------------------------ machinery
def ratio(got, want) -> float:
    """Max abs error over the tolerance atol + rtol * max |want| (<= 1: agrees)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / (ATOL + RTOL * np.abs(want).max())) if want.size else 0.0


def flat(out) -> dict[str, np.ndarray]:
    loss, grads, aux = out
    return {"loss": np.float64(loss)} | {f"d/{k}": v for k, v in grads.items()} | {f"aux/{k}": v for k, v in aux.items()}


def agree(code, ref) -> None:
    c, r = flat(code), flat(ref)
    assert set(c) == set(r), sorted(set(c) ^ set(r))
    bad = {k: ratio(c[k], r[k]) for k in r if ratio(c[k], r[k]) > 1}
    assert not bad, bad


def every_term_matters(ref_fn, full, knockouts) -> None:
    """Each knockout (a term removed, a sign, weight or constant changed) moves the reference far outside the
    tolerance of :func:`agree`, so the comparison is sensitive to that term."""
    r = flat(full)
    for name in knockouts:
        k = flat(ref_fn(**{name: True}))
        moved = max(ratio(k[n], r[n]) for n in r)
        assert moved >= SENSITIVE, f"term {name!r} moves the outputs by only {moved:.1f} tolerances"


def autograd(params: dict[str, np.ndarray], fn):
    """(loss, d loss / d every param, aux) of ``fn(P)`` in float64, P the params as leaf tensors."""
    P = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in params.items()}
    loss, aux = fn(P)
    gs = torch.autograd.grad(loss, list(P.values()), allow_unused=True)
    grads = {k: (np.zeros(P[k].shape) if g is None else g.numpy()) for k, g in zip(P, gs)}
    return float(loss), grads, {k: v.detach().numpy() for k, v in aux.items()}


def run_code(objective: str, spec, layout, weights, inputs):
    t = TorchTrainer()
    t.load(torch_program(spec, objective, layout).data)
    t.set_weights({k: np.asarray(v, np.float32) for k, v in weights.items()})
    return t.loss_and_grads(inputs)


def f32(a):
    return np.asarray(a, np.float32)


def T64(a):
    return torch.tensor(np.asarray(a, np.float64))


def row_weights(n: int, rng) -> np.ndarray:
    """Per-row weights that are not 1/N (padding rows weigh 0 on a device; here all differ)."""
    w = rng.uniform(0.2, 1.0, n)
    return w / w.sum() * 0.8


def ll_ref(logits, y, *, no_normaliser=False):
    """log p(y_i | x_i) per row: the logit of y minus the log-sum-exp of the row."""
    picked = logits[torch.arange(len(y)), torch.as_tensor(y)]
    return picked if no_normaliser else picked - torch.logsumexp(logits, 1)


def log_sigmoid(a):
    return -torch.log1p(torch.exp(-a))


def hard_concrete_ref(log_alpha, u, beta=BETA, gamma=GAMMA, zeta=ZETA):
    s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + log_alpha) / beta)
    return torch.clamp(s * (zeta - gamma) + gamma, 0.0, 1.0)


def thresholds_for(norm: np.ndarray, logit_pi: np.ndarray, T: float) -> np.ndarray:
    """v with (norm - softplus(v)) / T = logit_pi: a point where the gates are neither 0 nor 1."""
    tau = norm - T * logit_pi
    assert (tau > 0).all()
    return tau + np.log(-np.expm1(-tau))


# ------------------------------------------------------------------------------------------------ ce
def _ce_ref(P, x, y, w, spec, *, row_weights_off=False, no_normaliser=False):
    h = T64(x)
    if spec["arch"] == "cnn":
        h = h.reshape(len(x), *spec["input"])
        for i, (_o, _k, stride, pad) in enumerate(spec["convs"]):
            h = torch.relu(F.conv2d(h, P[f"conv{i}.weight"], P[f"conv{i}.bias"], stride=stride, padding=pad))
        h = h.flatten(1)
    n = len(spec["sizes"]) - 1
    for i in range(n):
        h = h @ P[f"fc{i}.weight"].T + P[f"fc{i}.bias"]
        if i < n - 1:
            h = torch.relu(h)
    ww = torch.full((len(x),), 1.0 / len(x), dtype=torch.float64) if row_weights_off else T64(w)
    return -(ww * ll_ref(h, y, no_normaliser=no_normaliser)).sum(), {"logits": h}


@pytest.mark.parametrize("spec", [mlp([5, 4, 3, 3]), cnn((2, 5, 5), [(3, 3, 1, 1), (4, 3, 2, 1)], [4], 3)],
                         ids=["mlp", "cnn"])
def test_ce_objective(spec):
    """loss = sum_i w_i CE(f(x_i), y_i), aux the logits: FedAvg's, FedAdam's and FedL1's clients."""
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=s) * 0.7 for k, s in param_shapes(spec).items()}
    B = 7
    x = rng.normal(size=(B, int(np.prod(spec.get("input", [spec["sizes"][0]])))))
    y = rng.integers(0, 3, B)
    w = row_weights(B, rng)
    code = run_code("ce", spec, None, params, {"x": f32(x), "y": y, "w": f32(w)})

    def ref(**off):
        return autograd(params, lambda P: _ce_ref(P, x, y, w, spec, **off))

    full = ref()
    agree(code, full)
    every_term_matters(ref, full, ["row_weights_off", "no_normaliser"])


def test_conv_as_gemm_is_conv2d():
    """The ExecuTorch exporter's convolution (k*k strided slices and one GEMM) against F.conv2d."""
    from edge.trainers.torch_objectives.nets import conv2d_gemm
    rng = np.random.default_rng(1)
    for (c, o, k, stride, pad, hw) in [(2, 3, 3, 1, 1, 5), (3, 4, 3, 2, 1, 6), (1, 2, 2, 2, 0, 5)]:
        x, W, b = rng.normal(size=(2, c, hw, hw)), rng.normal(size=(o, c, k, k)), rng.normal(size=o)
        got = conv2d_gemm(T64(x), T64(W), T64(b), stride, pad).numpy()
        want = F.conv2d(T64(x), T64(W), T64(b), stride=stride, padding=pad).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------ gates
def _gate_layer(h, v, norm, u, th, lam0, ce, T, *, gates_off=False, shift_off=False, lambda0_off=False,
                h_pos_off=False, h_neg_off=False, temperature_off=False, beta=BETA, gamma=GAMMA, zeta=ZETA):
    """One gated hidden layer of paper 000 (Eq. 23, the relaxed gate, Eq. 41 penalties with lambda = 0)."""
    T = 1.0 if temperature_off else T
    logit_pi = (T64(norm) - F.softplus(v)) / T
    shift = 0.0 if shift_off else beta * math.log(-gamma / zeta)  # so that P(z > 0) = pi
    z = hard_concrete_ref(logit_pi + shift, T64(u), beta, gamma, zeta)
    pi = torch.sigmoid(logit_pi)
    th = T64(th)
    cross = -((0 if h_pos_off else pi * log_sigmoid(th)) + (0 if h_neg_off else (1 - pi) * log_sigmoid(-th)))
    pen = (0 if lambda0_off else lam0 * pi.sum()) + ce * cross.sum()
    return (h if gates_off else h * z), pen


GATE_KNOCKOUTS = ["gates_off", "shift_off", "lambda0_off", "h_pos_off", "h_neg_off", "temperature_off",
                  "beta", "gamma", "zeta"]
CHANGED_CONSTANT = {"beta": 0.5, "gamma": -0.2, "zeta": 1.2}


def _gate_kw(off: dict) -> dict:
    return {k: (CHANGED_CONSTANT[k] if k in CHANGED_CONSTANT else v) for k, v in off.items()}


def _gated_setup(sizes, rng, T, prefix=""):
    """Weights, thresholds v (logit pi spread over [-1.5, 1.5]), group norms, noise and server logits."""
    params, gin = {}, {}
    for i in range(len(sizes) - 1):
        W, b = rng.normal(size=(sizes[i + 1], sizes[i])) * 0.8, rng.normal(size=sizes[i + 1]) * 0.5
        params[f"{prefix}fc{i}.weight"], params[f"{prefix}fc{i}.bias"] = W, b
        if i < len(sizes) - 2:
            norm = np.sqrt((W ** 2).sum(1) + b ** 2)
            logit_pi = np.minimum(rng.uniform(-1.5, 1.5, len(b)), 0.8 * norm / T)  # softplus(v) > 0
            params[f"{prefix}fc{i}.v"] = thresholds_for(norm, logit_pi, T)
            gin[i] = {"norm": norm, "u": rng.uniform(0.05, 0.95, len(b)), "theta_logit": rng.normal(size=len(b))}
    return params, gin


def _fedsparse_ref(P, x, y, w, gin, lam0, ce, T, sizes, *, data_off=False, row_weights_off=False,
                   penalty_sign=False, **off):
    h = T64(x)
    pens = []
    n = len(sizes) - 1
    for i in range(n):
        h = h @ P[f"fc{i}.weight"].T + P[f"fc{i}.bias"]
        if i < n - 1:
            g = gin[i]
            lam = lam0[i] if isinstance(lam0, (list, tuple)) else lam0  # per layer: the per-weight L0 reading
            h, pen = _gate_layer(torch.relu(h), P[f"fc{i}.v"], g["norm"], g["u"], g["theta_logit"], lam, ce, T,
                                 **_gate_kw(off))
            pens.append(pen)
    ww = torch.full((len(x),), 1.0 / len(x), dtype=torch.float64) if row_weights_off else T64(w)
    data = 0.0 if data_off else -(ww * ll_ref(h, y)).sum()
    return data + (-1 if penalty_sign else 1) * sum(pens), {}


def test_fedsparse_objective():
    """Paper 000 Eq. 41 (lambda = 0) with hard-concrete gates on both hidden layers of a 5-4-3-3 MLP."""
    sizes, T, lam0, ce = [5, 4, 3, 3], 1.3, 0.3, 0.25
    rng = np.random.default_rng(2)
    params, gin = _gated_setup(sizes, rng, T)
    B = 6
    x, y, w = rng.normal(size=(B, 5)), rng.integers(0, 3, B), row_weights(B, rng)
    inputs = {"x": f32(x), "y": y, "w": f32(w), "lambda0": f32(lam0), "ce_scale": f32(ce), "T": f32(T)}
    for i, g in gin.items():
        inputs |= {f"u{i}": f32(g["u"]), f"theta_logit{i}": f32(g["theta_logit"]), f"norm{i}": f32(g["norm"])}
    code = run_code("fedsparse", mlp(sizes), None, params, inputs)

    def ref(**off):
        return autograd(params, lambda P: _fedsparse_ref(P, x, y, w, gin, lam0, ce, T, sizes, **off))

    full = ref()
    agree(code, full)
    every_term_matters(ref, full, GATE_KNOCKOUTS + ["data_off", "row_weights_off", "penalty_sign"])
    # the point exercises the gate's three regimes: some units closed, some open, some in between
    z = [hard_concrete_ref((T64(g["norm"]) - F.softplus(T64(params[f"fc{i}.v"]))) / T
                           + BETA * math.log(-GAMMA / ZETA), T64(g["u"])).numpy() for i, g in gin.items()]
    z = np.concatenate(z)
    assert ((z > 0) & (z < 1)).any() and (z == 0).any()


def test_fedsparse_l0_per_weight():
    """App. G charges L0 per parameter: a group of |g| weights costs lambda0 |g| pi_g (layout l0 = "weight").
    The 5-4-3-3 MLP's gated layers have groups of different sizes: a row of 5 weights and its bias (6), then 4
    and a bias (5). Without the layout the same objective charges lambda0 once per group."""
    sizes, T, lam0, ce = [5, 4, 3, 3], 1.3, 0.1, 0.25
    rng = np.random.default_rng(7)
    params, gin = _gated_setup(sizes, rng, T)
    B = 6
    x, y, w = rng.normal(size=(B, 5)), rng.integers(0, 3, B), row_weights(B, rng)
    inputs = {"x": f32(x), "y": y, "w": f32(w), "lambda0": f32(lam0), "ce_scale": f32(ce), "T": f32(T)}
    for i, g in gin.items():
        inputs |= {f"u{i}": f32(g["u"]), f"theta_logit{i}": f32(g["theta_logit"]), f"norm{i}": f32(g["norm"])}

    def ref(per_group=False, one_size=False, **off):
        lams = [lam0, lam0] if per_group else [lam0 * 6, lam0 * (6 if one_size else 5)]
        return autograd(params, lambda P: _fedsparse_ref(P, x, y, w, gin, lams, ce, T, sizes, **off))

    full = ref()
    agree(run_code("fedsparse", mlp(sizes), {"l0": "weight"}, params, inputs), full)
    every_term_matters(ref, full, ["per_group", "one_size", "lambda0_off"])
    agree(run_code("fedsparse", mlp(sizes), None, params, inputs), ref(per_group=True))


def test_fedsparse_l0_per_weight_on_a_module():
    """A person's CNN (the issue's: 5x5 convs of 1 -> 8 and 8 -> 16 channels, Linear 256-64-10): its groups hold
    1*5*5 + 1 = 26, 8*5*5 + 1 = 201 and 256 + 1 = 257 weights. With the same noise the per-weight loss exceeds
    the per-group loss by exactly lambda0 sum_layers (|g| - 1) sum_g pi_g, pi = sigmoid((norm - softplus(v)) / T)
    computed here in float64 from the inputs."""
    from export.modelref import resolve
    spec = resolve("benchmarks/unseen_zoo.py:cnn", (1, 28, 28), 10)
    from edge.model import init_weights
    rng = np.random.default_rng(3)
    weights = {k: np.asarray(v, np.float64) for k, v in init_weights(spec, 0).items()}
    T, lam0, ce = 0.5, 1e-3, 0.1
    layers, sizes = ["0", "3", "7"], [26, 201, 257]
    B = 4
    inputs = {"x": f32(rng.normal(size=(B, 1, 28, 28))), "y": rng.integers(0, 10, B), "w": f32(np.full(B, 1 / B)),
              "lambda0": f32(lam0), "ce_scale": f32(ce), "T": f32(T)}
    extra = 0.0
    for i, (L, n) in enumerate(zip(layers, [8, 16, 64])):
        norm = rng.uniform(1.5, 3.0, n)
        logit_pi = rng.uniform(-2, 2, n)
        weights[f"{L}.v"] = thresholds_for(norm, logit_pi, T)
        pi = 1 / (1 + np.exp(-(norm - np.log1p(np.exp(weights[f"{L}.v"].astype(np.float32).astype(np.float64)))) / T))
        extra += lam0 * (sizes[i] - 1) * pi.sum()
        inputs |= {f"u{i}": f32(rng.uniform(0.05, 0.95, n)), f"theta_logit{i}": f32(rng.normal(size=n)),
                   f"norm{i}": f32(norm)}
    per_w = run_code("fedsparse", spec, {"l0": "weight"}, weights, inputs)
    per_g = run_code("fedsparse", spec, None, weights, inputs)
    got = float(per_w[0]) - float(per_g[0])
    assert extra > 0.05  # far above float32 error of a loss of ~2.5 (~1e-6)
    assert abs(got - extra) <= 1e-5 + 1e-5 * abs(extra), (got, extra)


def test_hard_concrete_is_placed_so_that_p_open_is_pi():
    """P(z > 0) = pi (paper 000 App. H's placement, log_alpha = logit pi + beta log(-gamma/zeta)).

    z > 0 exactly when u > 1 - pi, so the gate opens on a fraction pi of the noise: checked on both sides
    of that point for several pi, through the torch gate every objective uses and the numpy shift the
    client shares with it."""
    from edge.trainers.torch_objectives.gates import relaxed
    pi = np.array([0.05, 0.2, 0.5, 0.7, 0.95])
    T = 1.0
    norm = np.full(len(pi), 3.0)
    v = thresholds_for(norm, np.log(pi / (1 - pi)), T)
    h = torch.ones(1, len(pi))
    for side, eps in (("open", 2e-3), ("closed", -2e-3)):
        u = np.clip(1 - pi + eps, 1e-6, 1 - 1e-6)
        z = relaxed(h, torch.tensor(f32(v)), torch.tensor(f32(norm)), torch.tensor(f32(u)), torch.tensor(f32(T)))
        z = z.numpy()[0]
        assert ((z > 0) if side == "open" else (z == 0)).all(), (side, z)
    # and the noise the client draws is uniform on (0, 1): the fraction open is pi
    from edge import gates
    u = gates.noise(np.random.default_rng(0), 200_000)
    n = len(u)
    for p in pi:
        frac = float((u > 1 - p).mean())
        assert abs(frac - p) <= 5 * math.sqrt(p * (1 - p) / n), (p, frac)


# ------------------------------------------------------------------------------------------------ mixture
MIX_SLOTS = [[5, 4, 3, 3], [5, 3, 2, 3], [5, 4, 3, 3]]  # expert 1 is pruned to fewer units (FedSparse slices)
ACTIVE = np.array([1.0, 1.0, 0.0])  # slot 2 is pruned for this batch (Alg. 2)


def _mixture_ref(P, x, y, w, inp, gins, variant, gated, lam0, ce, T, *, ll_off=False, lg_off=False,
                 gate_sign=False, q_uniform=False, pool_uniform=False, not_detached=False, mask_off=False,
                 pen_off=False, pen_mask_off=False, feat_gates_off=False, row_weights_off=False, gate_b_off=False,
                 q_is_qs=False, **off):
    """Paper 004 Eq. 5/6 without H(q), gate Eq. 9, and with ``gated`` paper 000's gates in every expert.

    loss = -sum_i w_i sum_{j active} q_ij [log p_wj(y_i|x_i) + log p_theta(z=j|x_i,s)] + sum_{j active} pen_j
    """
    k = len(MIX_SLOTS)
    act = [j for j in range(k) if inp["active"][j] > 0]
    lls, feats, logits, pens = [], [], [], []
    for j, s in enumerate(MIX_SLOTS):
        n = len(s) - 1
        h = T64(x)
        f = T64(x)
        pen_j = 0.0
        for i in range(n):
            W, b = P[f"s{j}.fc{i}.weight"], P[f"s{j}.fc{i}.bias"]
            Wd, bd = (W, b) if not_detached else (W.detach(), b.detach())
            if i == n - 1:
                feats.append(f)
            h = h @ W.T + b
            if i < n - 1:
                f = torch.relu(f @ Wd.T + bd)
                h = torch.relu(h)
                if gated:
                    g = gins[j][i]
                    v = P[f"s{j}.fc{i}.v"]
                    h, pen = _gate_layer(h, v, g["norm"], g["u"], g["theta_logit"], lam0, ce, T, **_gate_kw(off))
                    if not feat_gates_off:
                        f, _ = _gate_layer(f, v if not_detached else v.detach(), g["norm"], g["u"],
                                           g["theta_logit"], lam0, ce, T, **_gate_kw(off))
                    pen_j = pen_j + pen
        logits.append(h)
        lls.append(ll_ref(h, y))
        pens.append(pen_j)
    qs = np.full(k, 1.0 / k) if pool_uniform else inp["qs"]
    z = sum(float(qs[j]) * (feats[j] @ P[f"gate.A{j}"]) for j in range(k))
    if not gate_b_off:
        z = z + P["gate.b"]
    cols = list(range(k)) if mask_off else act
    lg = torch.log_softmax(z[:, cols], 1)
    if q_uniform:
        q = torch.full((len(x), len(cols)), 1.0 / len(cols), dtype=torch.float64)
    elif q_is_qs:
        q = T64(inp["qs"])[cols].expand(len(x), len(cols))
    elif variant == "label":
        q = torch.softmax(P["phi"][torch.as_tensor(y)][:, cols], 1)
    else:
        q = T64(inp["pi"])[cols].expand(len(x), len(cols))
    ll = torch.stack(lls, 1)
    term = (0 if ll_off else ll[:, cols]) + (0 if lg_off else (-1 if gate_sign else 1) * lg)
    ww = torch.full((len(x),), 1.0 / len(x), dtype=torch.float64) if row_weights_off else T64(w)
    loss = -((q * term).sum(1) * ww).sum()
    if gated and not pen_off:
        loss = loss + sum(pens[j] * (1.0 if pen_mask_off else float(inp["active"][j])) for j in range(k))
    lg_full = torch.zeros(len(x), k, dtype=torch.float64)
    lg_full[:, cols] = lg
    return loss, {"ll": ll, "lg": lg_full, "logits": torch.stack(logits, 1)}


@pytest.mark.parametrize("gated", [False, True], ids=["fedmix", "fedmix_sparse"])
@pytest.mark.parametrize("variant", ["label", "cluster"])
def test_mixture_objective(variant, gated):
    """The mixture objective, three expert slots of two sizes, one slot inactive, non-uniform row weights,
    q(z|s) pooling weights and (cluster) pi: value, every parameter's gradient and the aux tables."""
    T, lam0, ce = 1.3, 0.3, 0.25
    rng = np.random.default_rng(3)
    k, C, B = len(MIX_SLOTS), 3, 6
    params, gins = {}, {}
    for j, s in enumerate(MIX_SLOTS):
        p, g = _gated_setup(s, rng, T, prefix=f"s{j}.")
        params |= {n: a for n, a in p.items() if gated or not n.endswith(".v")}
        gins[j] = g
        params[f"gate.A{j}"] = rng.normal(size=(s[-2], k))
    params["gate.b"] = rng.normal(size=k)
    if variant == "label":
        params["phi"] = rng.normal(size=(C, k)) * 1.5
    x, y, w = rng.normal(size=(B, 5)), np.array([0, 1, 2, 0, 1, 1]), row_weights(B, rng)
    inp = {"active": ACTIVE, "qs": np.array([0.6, 0.3, 0.1])}
    if variant == "cluster":
        inp["pi"] = np.array([0.7, 0.3, 0.0])  # the client's restricted pi: zero off the active slots
    inputs = {"x": f32(x), "y": y, "w": f32(w)} | {n: f32(a) for n, a in inp.items()}
    for j, s in enumerate(MIX_SLOTS):  # the stop-gradient copies: the current hidden weights, as the client feeds
        for i in range(len(s) - 2):
            names = ["weight", "bias"] + (["v"] if gated else [])
            inputs |= {f"c{j}_fc{i}_{n}": f32(params[f"s{j}.fc{i}.{n}"]) for n in names}
            if gated:
                g = gins[j][i]
                inputs |= {f"u{j}_{i}": f32(g["u"]), f"theta_logit{j}_{i}": f32(g["theta_logit"]),
                           f"norm{j}_{i}": f32(g["norm"])}
    if gated:
        inputs |= {"lambda0": f32(lam0), "ce_scale": f32(ce), "T": f32(T)}
    layout = {"slots": MIX_SLOTS, "variant": variant, "gated": gated}
    loss, grads, aux = run_code("mixture", mlp(MIX_SLOTS[0]), layout, params, inputs)
    inactive = ACTIVE == 0
    assert (aux["lg"][:, inactive] < -1e3).all()  # an inactive slot has probability exactly 0
    aux["lg"] = np.where(inactive[None, :], 0.0, aux["lg"])

    def ref(**off):
        return autograd(params, lambda P: _mixture_ref(P, x, y, w, inp, gins, variant, gated, lam0, ce, T, **off))

    full = ref()
    agree((loss, grads, aux), full)
    knock = ["ll_off", "lg_off", "gate_sign", "q_uniform", "pool_uniform", "not_detached", "mask_off",
             "row_weights_off", "gate_b_off"]
    knock += ["q_is_qs"] if variant == "cluster" else []
    knock += ["pen_off", "pen_mask_off", "feat_gates_off"] + GATE_KNOCKOUTS if gated else []
    every_term_matters(ref, full, knock)


# ------------------------------------------------------------------------------------------------ prox
def _prox_ref(P, x, y, w, g, mu, sizes, *, prox_off=False, half_off=False, data_off=False, row_weights_off=False):
    h = T64(x)
    n = len(sizes) - 1
    for i in range(n):
        h = h @ P[f"fc{i}.weight"].T + P[f"fc{i}.bias"]
        if i < n - 1:
            h = torch.relu(h)
    ww = torch.full((len(x),), 1.0 / len(x), dtype=torch.float64) if row_weights_off else T64(w)
    data = 0.0 if data_off else -(ww * ll_ref(h, y)).sum()
    sq = sum(((P[k] - T64(g[k])) ** 2).sum() for k in P)
    prox = 0.0 if prox_off else (1.0 if half_off else 0.5) * mu * sq
    return data + prox, {"logits": h}


def test_prox_objective():
    """FedProx (Li et al. 2020, Eq. 2): sum_i w_i CE + (mu / 2) ||w - w_global||^2."""
    sizes, mu = [5, 4, 3, 3], 0.7
    rng = np.random.default_rng(4)
    params = {k: rng.normal(size=s) * 0.7 for k, s in param_shapes(mlp(sizes)).items()}
    glob = {k: v + rng.normal(size=v.shape) * 0.5 for k, v in params.items()}
    B = 6
    x, y, w = rng.normal(size=(B, 5)), rng.integers(0, 3, B), row_weights(B, rng)
    inputs = {"x": f32(x), "y": y, "w": f32(w), "mu": f32(mu)} | {f"g.{k}": f32(v) for k, v in glob.items()}
    code = run_code("fedprox", mlp(sizes), None, params, inputs)

    def ref(**off):
        return autograd(params, lambda P: _prox_ref(P, x, y, w, glob, mu, sizes, **off))

    full = ref()
    agree(code, full)
    every_term_matters(ref, full, ["prox_off", "half_off", "data_off", "row_weights_off"])
