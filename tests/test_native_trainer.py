"""The native C++ trainer (clients/native: src/trainer.cpp, algorithms.cpp, npz.cpp) through its test CLI
``fedge-native-train``, against references written here (torch autograd in float64 and numpy), not fedge's
own client code: gradients of ExecuTorch programs (plain and XNNPACK-lowered), FedAvg's SGD with short last
batches, FedProx's proximal term, FedSparse's gated objective with SGD + Adamax and its Bernoulli masks, and
strict hyperparameters.

The CLI is built once into ``build/native`` (incremental afterwards); the programs are exported once per
session (tests/trainer_programs.py; ``FEDGE_TEST_PROGRAMS=DIR`` keeps them). The native generator is not
numpy's, so the CLI writes the draws it used (``--trace``: batch rows, noise, mask uniforms) and the
references replay them.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [12, 9, 7, 5]  # a small MLP: two gated hidden layers for FedSparse

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def cli(native_build) -> str:
    return str(native_build / "fedge-native-train")


def _program(objective: str, **options) -> bytes:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from trainer_programs import program
    from edge.model import mlp
    return program(mlp(SIZES), "executorch", objective, **options)


@pytest.fixture(scope="session")
def programs(tmp_path_factory):
    d = tmp_path_factory.mktemp("native-programs")
    cache = {}

    def get(objective: str = "ce", xnnpack: bool = True) -> str:
        key = (objective, xnnpack)
        if key not in cache:
            p = d / f"{objective}-{'xnn' if xnnpack else 'plain'}.pte"
            p.write_bytes(_program(objective, **({} if xnnpack else {"xnnpack": False})))
            cache[key] = str(p)
        return cache[key]
    return get


def weights(seed: int = 0, gated: bool = False) -> dict[str, np.ndarray]:
    """An MLP's weights with non-unit scales (and FedSparse thresholds: softplus(v) = 0.8 ||w_g||)."""
    rng = np.random.default_rng(seed)
    w = {}
    for i in range(len(SIZES) - 1):
        w[f"fc{i}.weight"] = (rng.normal(size=(SIZES[i + 1], SIZES[i])) * (0.4 + 0.5 * i)).astype(np.float32)
        w[f"fc{i}.bias"] = (rng.normal(size=SIZES[i + 1]) * 0.3).astype(np.float32)
    if gated:
        for i in range(len(SIZES) - 2):
            nrm = np.sqrt((w[f"fc{i}.weight"].astype(np.float64) ** 2).sum(1) + w[f"fc{i}.bias"].astype(np.float64) ** 2)
            w[f"fc{i}.v"] = np.log(np.expm1(0.8 * nrm)).astype(np.float32)
    return w


def data(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, SIZES[0])) * 2).astype(np.float32), rng.integers(0, SIZES[-1], n).astype(np.int64)


def run(cli, tmp_path, program, w, x, y, *args, check=True):
    np.savez(tmp_path / "w.npz", **w)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    cmd = [cli, "--program", program, "--weights", str(tmp_path / "w.npz"), "--data", str(tmp_path / "d.npz"),
           "--out", str(tmp_path / "out.npz"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def train(cli, tmp_path, program, w, x, y, strategy, hp, seed=7):
    r = run(cli, tmp_path, program, w, x, y, "--strategy", strategy, "--hparams", json.dumps(hp), "--seed", str(seed),
            "--trace", str(tmp_path / "trace.npz"))
    out, tr = np.load(tmp_path / "out.npz"), np.load(tmp_path / "trace.npz")
    steps = len([k for k in tr.files if k.startswith("batch.")])
    return json.loads(r.stdout), dict(out), dict(tr), [tr[f"batch.{s}"] for s in range(steps)]


# ------------------------------------------------------------------------------------------ the references
def torch_params(w):
    import torch
    return {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}


def mlp_logits(p, x, gate=None):
    import torch
    h = torch.tensor(x, dtype=torch.float64)
    n = len(SIZES) - 1
    for i in range(n):
        h = h @ p[f"fc{i}.weight"].T + p[f"fc{i}.bias"]
        if i < n - 1:
            h = torch.relu(h)
            if gate is not None:
                h = gate(i, h)
    return h


def ce(logits, y):
    import torch
    return torch.nn.functional.cross_entropy(logits, torch.tensor(y))


def ref_grads(w, x, y, extra=None):
    p = torch_params(w)
    loss = ce(mlp_logits(p, x), y)
    if extra is not None:
        loss = loss + extra(p)
    loss.backward()
    return float(loss.detach()), {k: t.grad.numpy() for k, t in p.items()}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def sgd_ref(w, x, y, order, lr, extra=None):
    w = {k: v.copy() for k, v in w.items()}
    losses = []
    for idx in order:
        loss, g = ref_grads(w, x[idx], y[idx], extra)
        losses.append(loss)
        for k in w:
            w[k] = (w[k] - np.float32(lr) * g[k].astype(np.float32)).astype(np.float32)
    return w, losses


def check_order(order, n, bs, epochs):
    per = math.ceil(n / bs)
    assert len(order) == per * epochs
    for e in range(epochs):
        ep = order[e * per:(e + 1) * per]
        assert [len(b) for b in ep] == [bs] * (per - 1) + [n - bs * (per - 1)]
        assert sorted(np.concatenate(ep).tolist()) == list(range(n))  # a permutation per epoch


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("xnnpack", [True, False], ids=["xnnpack", "portable"])
def test_gradients_match_autograd(cli, programs, tmp_path, xnnpack):
    w = weights(3)
    x, y = data(13)  # 13 rows: not a power of two, the program pads nothing (dynamic batch)
    r = run(cli, tmp_path, programs("ce", xnnpack), w, x, y, "--grads")
    got = np.load(tmp_path / "out.npz")
    loss, g = ref_grads(w, x, y)
    assert abs(float(got["loss"]) - loss) <= 1e-5 * abs(loss)
    assert abs(json.loads(r.stdout)["loss"] - loss) <= 1e-5 * abs(loss)
    for k in w:
        assert got[f"grad.{k}"].shape == w[k].shape
        assert rel(got[f"grad.{k}"], g[k]) < 1e-5, k
    assert got["aux.logits"].shape == (13, SIZES[-1])


def test_fedavg_full_batch(cli, programs, tmp_path):
    w, (x, y) = weights(4), data(17)
    m, out, _tr, order = train(cli, tmp_path, programs("ce"), w, x, y, "fedavg",
                               {"lr": 0.3, "epochs": 3, "batch_size": 64})
    want, losses = sgd_ref(w, x, y, [np.arange(17)] * 3, 0.3)
    assert m["steps"] == 3 and isinstance(m["steps"], int)
    assert abs(m["train_loss"] - np.mean(losses)) < 1e-5 * abs(np.mean(losses))
    for k in w:
        assert rel(out[k], want[k]) < 1e-5, k
    assert not [k for k in out if k.startswith("mask.")]


def test_fedavg_batches_with_a_short_last_one(cli, programs, tmp_path):
    w, (x, y) = weights(5), data(23)
    m, out, _tr, order = train(cli, tmp_path, programs("ce"), w, x, y, "fedavg",
                               {"lr": 0.2, "epochs": 2, "batch_size": 5}, seed=11)
    check_order(order, 23, 5, 2)
    assert not np.array_equal(np.concatenate(order[:5]), np.concatenate(order[5:]))  # fresh permutation
    want, losses = sgd_ref(w, x, y, order, 0.2)
    assert m["steps"] == 10
    assert abs(m["train_loss"] - np.mean(losses)) < 1e-5 * abs(np.mean(losses))
    for k in w:
        assert rel(out[k], want[k]) < 1e-5, k
    # the same seed gives the same batches; another seed others
    _m, _o, _t, again = train(cli, tmp_path, programs("ce"), w, x, y, "fedavg",
                              {"lr": 0.2, "epochs": 2, "batch_size": 5}, seed=11)
    assert all(np.array_equal(a, b) for a, b in zip(order, again))


def test_fedprox(cli, programs, tmp_path):
    import torch
    w, (x, y) = weights(6), data(19)
    mu = 0.7
    m, out, _tr, order = train(cli, tmp_path, programs("fedprox"), w, x, y, "fedprox",
                               {"lr": 0.15, "epochs": 2, "batch_size": 8, "mu": mu})
    check_order(order, 19, 8, 2)
    g0 = {k: torch.tensor(v, dtype=torch.float64) for k, v in w.items()}

    def prox(p):
        return 0.5 * mu * sum(((p[k] - g0[k]) ** 2).sum() for k in p)
    want, losses = sgd_ref(w, x, y, order, 0.15, prox)
    assert m["steps"] == 6
    assert abs(m["train_loss"] - np.mean(losses)) < 1e-5 * abs(np.mean(losses))
    for k in w:
        assert rel(out[k], want[k]) < 1e-5, k
    plain, _ = sgd_ref(w, x, y, order, 0.15)  # and mu made a difference
    assert max(rel(out[k], plain[k]) for k in w) > 1e-3


# FedSparse's objective written out from the paper's formulas (hard-concrete gates, Louizos et al. 2018)
BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1


def softplus64(v):
    return np.logaddexp(0.0, np.asarray(v, np.float64))


def group_norm(w, L, relative):
    n = np.sqrt((w[f"{L}.weight"].astype(np.float64) ** 2).sum(1) + w[f"{L}.bias"].astype(np.float64) ** 2)
    return n / n.mean() if relative else n


def fedsparse_ref(w0, x, y, order, noise, hp):
    import torch
    layers = [f"fc{i}" for i in range(len(SIZES) - 2)]
    lam, ces, T = hp["lambda0"], hp["ce_scale"], hp["T"]
    rel_ = hp.get("relative", False)
    theta = {L: ((group_norm(w0, L, rel_) - softplus64(w0[f"{L}.v"])) / T).astype(np.float32) for L in layers}
    w = {k: v.copy() for k, v in w0.items()}
    m = {L: np.zeros_like(w[f"{L}.v"], np.float64) for L in layers}
    u_ = {L: np.zeros_like(w[f"{L}.v"], np.float64) for L in layers}
    losses = []
    for s, idx in enumerate(order):
        p = torch_params(w)
        norms = {L: torch.tensor(group_norm(w, L, rel_).astype(np.float32), dtype=torch.float64) for L in layers}

        def logit_pi(i):
            L = layers[i]
            return (norms[L] - torch.nn.functional.softplus(p[f"{L}.v"])) / T

        def gate(i, h):
            u = torch.tensor(noise[s][i], dtype=torch.float64)
            la = logit_pi(i) + BETA * math.log(-GAMMA / ZETA)
            z = torch.clamp(torch.sigmoid((torch.log(u) - torch.log(1 - u) + la) / BETA) * (ZETA - GAMMA) + GAMMA, 0, 1)
            return h * z
        loss = ce(mlp_logits(p, x[idx], gate), y[idx])
        for i, L in enumerate(layers):
            pi = torch.sigmoid(logit_pi(i))
            th = torch.tensor(theta[L], dtype=torch.float64)
            h_ce = -(pi * torch.nn.functional.logsigmoid(th) + (1 - pi) * torch.nn.functional.logsigmoid(-th))
            loss = loss + lam * pi.sum() + ces * h_ce.sum()
        loss.backward()
        losses.append(float(loss.detach()))
        t = s + 1
        for k, v in p.items():
            g = v.grad.numpy()
            if k.endswith(".v"):  # Adamax (torch's rule), lr v_lr
                L = k[:-2]
                m[L] = 0.9 * m[L] + 0.1 * g
                u_[L] = np.maximum(0.999 * u_[L], np.abs(g) + 1e-8)
                w[k] = (w[k] - (hp["v_lr"] / (1 - 0.9 ** t) * m[L] / u_[L]).astype(np.float32)).astype(np.float32)
            else:
                w[k] = (w[k] - np.float32(hp["lr"]) * g.astype(np.float32)).astype(np.float32)
    return w, losses


@pytest.mark.parametrize("relative", [False, True])
def test_fedsparse_steps_and_masks(cli, programs, tmp_path, relative):
    w, (x, y) = weights(8, gated=True), data(15)
    hp = {"lr": 0.1, "epochs": 1, "batch_size": 6, "v_lr": 0.02, "lambda0": 0.05, "ce_scale": 0.01, "T": 0.5}
    if relative:
        hp["relative"] = True
    m, out, tr, order = train(cli, tmp_path, programs("fedsparse"), w, x, y, "fedsparse", hp)
    check_order(order, 15, 6, 1)
    layers = [f"fc{i}" for i in range(len(SIZES) - 2)]
    noise = [[tr[f"noise.{s}.u{i}"] for i in range(len(layers))] for s in range(len(order))]
    for s in noise:
        for i, u in enumerate(s):
            assert u.shape == (SIZES[i + 1],) and u.min() > 0 and u.max() < 1
    assert not np.array_equal(noise[0][0], noise[1][0])  # fresh noise per step
    want, losses = fedsparse_ref(w, x, y, order, noise, hp)
    assert m["steps"] == 3
    assert abs(m["train_loss"] - np.mean(losses)) < 1e-5 * abs(np.mean(losses))
    assert sorted(k for k in out if not k.startswith("mask.")) == sorted(k for k in w if not k.endswith(".v"))
    for k in out:
        if not k.startswith("mask."):
            assert rel(out[k], want[k]) < 1e-5, k
    # the masks: z = r < sigmoid(logit pi) at the trained weights and thresholds, on weight and bias rows
    kept = []
    for L in layers:
        logit = (group_norm(want, L, relative) - softplus64(want[f"{L}.v"])) / hp["T"]
        z = tr[f"r.{L}"] < 1.0 / (1.0 + np.exp(-logit))
        kept.append(z.mean())
        for t in (f"{L}.weight", f"{L}.bias"):
            assert out[f"mask.{t}"].dtype == np.int64
            assert out[f"mask.{t}"].tolist() == np.flatnonzero(z).tolist(), t
    assert "mask.fc2.weight" not in out and "mask.fc2.bias" not in out  # the classifier is never gated
    assert abs(m["kept"] - np.mean(kept)) < 1e-12
    assert 0 < m["kept"] < 1  # these thresholds keep some units and drop others


@pytest.mark.parametrize("hp, message", [
    ({"lr": 0.1, "momentum": 0.9}, "unknown hyperparameters"),
    ({"epochs": 2.0}, "expected int"),
    ({"lr": True}, "expected float"),
    ({"batch_size": 0}, "at least"),
    ({"lr": -1}, "at least"),
    ({"mu": 0.1}, "unknown hyperparameters"),  # FedProx's, not FedAvg's
])
def test_bad_plans_are_refused(cli, programs, tmp_path, hp, message):
    w, (x, y) = weights(9), data(5)
    r = run(cli, tmp_path, programs("ce"), w, x, y, "--strategy", "fedavg", "--hparams", json.dumps(hp),
            "--seed", "1", check=False)
    assert r.returncode == 3, r.stderr
    assert message in json.loads(r.stdout)["message"]


def test_strategy_and_program_must_agree(cli, programs, tmp_path):
    w, (x, y) = weights(9), data(5)
    r = run(cli, tmp_path, programs("ce"), w, x, y, "--strategy", "fedprox", "--hparams", "{}", "--seed", "1",
            check=False)
    assert r.returncode == 3 and "'fedprox' program" in json.loads(r.stdout)["message"]
    r = run(cli, tmp_path, programs("ce"), w, x, y, "--strategy", "fedmix", "--hparams", "{}", "--seed", "1",
            check=False)
    assert r.returncode == 3 and "unknown strategy" in json.loads(r.stdout)["message"]
