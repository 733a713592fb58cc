"""FedMix on a device that has no gate yet (docs/fedmix.md, "A new device"): it predicts before its first round
with q(z|s) in place of the gate, p(y|x,s) = sum_k q(z=k|s) p_wk(y|x,z=k), equal to a numpy reference written
here (the experts' forward pass and q from the label histogram, the global mixture, or Eq. 13), and it trains
in its first round through the client half, with a fleet that trained without it."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.inprocess import Loop
from coordinator.strategies.fedmix import FedMix
from edge.algorithms import fedmix as EF
from edge.model import mlp
from edge.runtime.state import LocalState

SMALL = mlp([64, 8, 10])
K = 3


def ref_experts(w: dict, x: np.ndarray) -> np.ndarray:
    """p_wk(y|x, z=k) [B, K, C] of the one-hidden-layer ReLU experts, in float64."""
    out = []
    for k in range(K):
        h = np.maximum(x @ w[f"e{k}.fc0.weight"].T.astype(np.float64) + w[f"e{k}.fc0.bias"], 0)
        lg = h @ w[f"e{k}.fc1.weight"].T.astype(np.float64) + w[f"e{k}.fc1.bias"]
        p = np.exp(lg - lg.max(1, keepdims=True))
        out.append(p / p.sum(1, keepdims=True))
    return np.stack(out, 1)


def ref_softmax_rows(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def fleet(seed: int = 0, n: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """Devices with skewed labels (each mostly two digits) and digit-like random inputs."""
    rng = np.random.default_rng(seed)
    shards = []
    for d in range(n):
        y = rng.choice([2 * d % 10, (2 * d + 1) % 10, int(rng.integers(0, 10))], size=40, p=[0.6, 0.3, 0.1])
        x = (rng.normal(size=(40, 64)) + y[:, None] * 0.1).astype(np.float32)
        shards.append((x, y.astype(np.int64)))
    return shards


def spread(state, rng) -> None:
    """Give phi and the experts' output biases a spread, so that q(z|s) and every expert matter."""
    if "phi" in state.weights:
        state.weights["phi"] = (2.0 * rng.normal(size=state.weights["phi"].shape)).astype(np.float32)
    for k in range(K):
        state.weights[f"e{k}.fc1.bias"] = (2.0 * rng.normal(size=10)).astype(np.float32)


def test_label_variant_new_device_predicts_with_its_label_marginal_then_trains(tmp_path):
    s = FedMix(spec=SMALL, K=K, variant="label", lr=0.05, batch_size=10)
    shards = fleet()
    loop = Loop(s, shards, seed=0, workdir=str(tmp_path), threads=1)
    loop.round([0, 1, 2])  # the fleet trains; d3 is new
    spread(loop.state, np.random.default_rng(1))
    new = loop.local["d3"]
    assert new.load(EF.STATE) is None
    w = s.plan(loop.state, "d3", {}).weights
    assert EF.expert_ids(w) == list(range(K))  # a device seen for the first time gets every expert
    tr = loop.trainer(SMALL, "mixture", EF.kept_layout(w, new))
    x3, y3 = shards[3]
    x = np.random.default_rng(2).normal(size=(25, 64)).astype(np.float32)

    experts = ref_experts(w, x)
    qzy = ref_softmax_rows(np.asarray(w["phi"], np.float64))
    q_own = (np.bincount(y3, minlength=10) / len(y3)) @ qzy  # E_{y ~ D_s}[q_phi(z|y)]
    q_global = qzy.mean(0)  # a uniform p(y)
    want_own = (experts * q_own[None, :, None]).sum(1)
    want_global = (experts * q_global[None, :, None]).sum(1)
    got_own = EF.predict_proba(tr, w, new, x, local=(x3, y3))
    got_global = EF.predict_proba(tr, w, new, x)
    np.testing.assert_allclose(got_own, want_own, rtol=0, atol=2e-6)
    np.testing.assert_allclose(got_global, want_global, rtol=0, atol=2e-6)
    # every term matters: q is far from uniform and from the global mixture, and the rules disagree
    assert np.abs(q_own - 1 / K).max() > 0.1 and np.abs(q_own - q_global).max() > 0.05
    uniform = experts.mean(1)
    assert np.abs(want_own - uniform).max() > 0.05 and np.abs(want_own - want_global).max() > 0.05

    before = {k: v.copy() for k, v in loop.state.weights.items()}
    row = loop.round([1, 3])  # its first round, through the client half, aggregated with another device
    assert row["reports"] == 2 and "d3" in loop.state.meta["qzs"]
    st = new.load(EF.STATE)
    assert st is not None and np.abs(st["A"]).max() > 0  # its gate trained
    assert max(float(np.abs(loop.state.weights[k] - before[k]).max()) for k in before) > 1e-4
    w = s.plan(loop.state, "d3", {}).weights
    p = EF.predict_proba(loop.trainer(SMALL, "mixture", EF.kept_layout(w, new)), w, new, x)  # now its own gate
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-6)
    loop.close()


def test_cluster_variant_new_device_predicts_with_eq13_on_its_data_then_trains(tmp_path):
    s = FedMix(spec=SMALL, K=K, variant="cluster", lr=0.05, batch_size=10)
    shards = fleet(3)
    loop = Loop(s, shards, seed=0, workdir=str(tmp_path), threads=1)
    loop.round([0, 1, 2])
    spread(loop.state, np.random.default_rng(4))
    new = loop.local["d3"]
    w = s.plan(loop.state, "d3", {}).weights
    tr = loop.trainer(SMALL, "mixture", EF.kept_layout(w, new, variant="cluster"))
    x3, y3 = shards[3]
    x = np.random.default_rng(5).normal(size=(25, 64)).astype(np.float32)

    own = ref_experts(w, x3)
    ll = np.log(own[np.arange(len(y3)), :, y3])  # log p_wk(y_i|x_i) [N, K]
    q = np.exp(ll.mean(0) - ll.mean(0).max())
    q /= q.sum()  # Eq. 13 (beta = 1) at a uniform gate
    experts = ref_experts(w, x)
    want = (experts * q[None, :, None]).sum(1)
    got = EF.predict_proba(tr, w, new, x, variant="cluster", local=(x3, y3))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    assert np.abs(q - 1 / K).max() > 0.1 and np.abs(want - experts.mean(1)).max() > 0.05
    # without labelled data: the uniform mixture
    np.testing.assert_allclose(EF.predict_proba(tr, w, new, x, variant="cluster"), experts.mean(1), atol=2e-6)

    row = loop.round([3])
    assert row["reports"] == 1 and "d3" in loop.state.meta["qzs"]
    assert new.load(EF.STATE) is not None
    loop.close()


def test_a_new_device_with_no_experts_in_its_plan_is_refused(tmp_path):
    with pytest.raises(ValueError, match="without experts"):
        EF.new_device_q({"phi": np.zeros((10, K), np.float32)}, "label", K, None)
    with pytest.raises(ValueError, match="without experts"):
        EF.predict_proba(None, {}, LocalState(tmp_path / "d"), np.zeros((1, 64), np.float32), variant="cluster")
