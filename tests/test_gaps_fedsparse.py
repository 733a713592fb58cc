"""FedSparse's client (paper 000, Alg. 2) at what the earlier tests left free (issue 28): the noise of every
step and the final mask come from their own streams of the plan's seed (stream 1, continued across steps and
epochs; stream 2 for z), over 2 epochs with an uneven last batch, and the ``kept`` metric is the mask's mean.
The runtime is tests/test_maths_clients.py's recording stub, so the inputs are checked, not a runtime's
answer; the draws are written here from docs/fedsparse.md (u ~ U(1e-6, 1 - 1e-6) float32, z = U < pi)."""
from __future__ import annotations

import numpy as np
import pytest

from edge.algorithms.driver import run_plan
from edge.model import mlp
from edge.protocol.wire import Plan
from test_maths_clients import Stub, _sparse_plan_weights, plan_of, sigmoid, softplus


def test_fedsparse_client_noise_streams_mask_draw_and_kept_metric():
    """Kills: the noise restarted each step (one u for every batch), the mask drawn from the noise's stream, the
    batch order's stream reused for u, ``kept`` not the mask's mean."""
    T, seed = 0.5, 21
    rng = np.random.default_rng(3)
    w = _sparse_plan_weights(rng, rng.uniform(0.2, 0.8, 7), T)
    hp = {"lr": 0.1, "v_lr": 0.02, "epochs": 2, "batch_size": 4, "T": T}
    stub = Stub(4)
    x, y = rng.normal(size=(10, 2)).astype(np.float32), rng.integers(0, 3, 10)  # batches 4, 4, 2
    rep = run_plan(plan_of("fedsparse", w, hp, seed=seed), stub, x, y)
    assert len(stub.calls) == 6 and [len(c["inputs"]["x"]) for c in stub.calls] == [4, 4, 2] * 2
    noise = np.random.default_rng([seed, 1])
    for c in stub.calls:
        np.testing.assert_array_equal(c["inputs"]["u0"], noise.uniform(1e-6, 1 - 1e-6, 7).astype(np.float32))
    # the final mask: z = U < pi at the trained weights, U from stream 2
    last = stub.calls[-1]
    P = dict(last["weights"])
    g = last["grads"]
    for k in P:  # the last step, applied as the client does: SGD on w (Adamax on v checked elsewhere)
        if k != "fc0.v":
            P[k] = (P[k] - 0.1 * g[k]).astype(np.float32).astype(np.float64)
    norm = np.sqrt((P["fc0.weight"] ** 2).sum(1) + P["fc0.bias"] ** 2)
    u = np.random.default_rng([seed, 2]).random(7)
    z = rep.tensors["fc0.weight"].mask
    assert z is not None and z.dtype == bool
    # v's last Adamax step moves pi by little (v_lr 0.02): every unit whose U is 0.1 or more from pi before that
    # step is decided as U < pi
    pi_before = sigmoid((norm - softplus(P["fc0.v"])) / T)
    sure = np.abs(u - pi_before) > 0.1
    assert sure.sum() >= 4
    np.testing.assert_array_equal(z[sure], (u < pi_before)[sure])
    assert rep.metrics["kept"] == float(z.mean())
    np.testing.assert_array_equal(rep.tensors["fc0.bias"].mask, z)
    assert rep.tensors["fc1.weight"].mask is None


class _SGDStub:
    """A runtime whose cross-entropy step is w - lr * g with g drawn per call (recorded): the FedL1 client's own
    arithmetic is then all that decides the result."""

    def __init__(self, spec, seed=0):
        self.spec, self.rng, self.gs = spec, np.random.default_rng(seed), []

    def set_weights(self, w):
        self.w = {k: np.array(v, np.float32) for k, v in w.items()}

    def get_weights(self):
        return {k: v.copy() for k, v in self.w.items()}

    def step(self, x, y, lr):
        g = {k: (0.1 * self.rng.normal(size=v.shape)).astype(np.float32) for k, v in self.w.items()}
        self.gs.append((len(x), g))
        self.w = {k: (v - np.float32(lr) * g[k]).astype(np.float32) for k, v in self.w.items()}
        return 1.0


@pytest.mark.parametrize("l1, lr", [(0.3, 0.2), (2.5, 0.05)])
def test_fedl1_client_group_lasso_step_threshold_and_mask_against_reference(l1, lr):
    """FedL1 (paper 000, Eq. 24-25) over 2 epochs of uneven batches (7 rows, batch 3): each step is the runtime's
    cross-entropy step plus lr * lambda * w_g / ||w_g|| on every hidden unit's incoming weights and bias (the
    norm taken before the step), and the report sends exactly the units with ||w_g|| > lambda. lambda and lr not 1,
    so lr * lambda, lr / lambda and lambda / lr all differ."""
    from edge.algorithms.driver import batches
    from edge.model import init_weights
    spec = mlp([5, 4, 3])
    w0 = init_weights(spec, 2)
    rows = np.array([0.05, 0.5, 2.0, 8.0])  # hidden units from far under to far over the threshold
    w0["fc0.weight"] = (w0["fc0.weight"] * rows[:, None] * 3).astype(np.float32)
    w0["fc0.bias"] = (np.full(4, 0.2) * rows).astype(np.float32)
    x, y = np.zeros((7, 5), np.float32), np.zeros(7, np.int64)
    hp = {"lr": lr, "epochs": 2, "batch_size": 3, "l1": l1}
    stub = _SGDStub(spec)
    rep = run_plan(Plan("t", 1, "d", 1e12, "fedl1", "torch", "0" * 64, w0, hp, 9, {"dtype": "f4"}), stub, x, y)

    w = {k: v.astype(np.float64) for k, v in w0.items()}
    steps = list(batches(7, 3, 2, 9))
    assert [n for n, _ in stub.gs] == [len(b) for b in steps] == [3, 3, 1, 3, 3, 1]
    for _, g in stub.gs:
        norm = np.sqrt((w["fc0.weight"] ** 2).sum(1) + w["fc0.bias"] ** 2)
        pre = {k: v.copy() for k, v in w.items()}
        w = {k: v - lr * g[k] for k, v in w.items()}
        scale = np.where(norm > 0, lr * l1 / np.maximum(norm, 1e-12), 0.0)
        w["fc0.weight"] -= scale[:, None] * pre["fc0.weight"]
        w["fc0.bias"] -= scale * pre["fc0.bias"]
    keep = np.sqrt((w["fc0.weight"] ** 2).sum(1) + w["fc0.bias"] ** 2) > l1
    assert 0 < keep.sum() < 4, keep  # both branches of the threshold are taken
    t = rep.tensors["fc0.weight"]
    assert t.mask.tolist() == keep.tolist() and rep.tensors["fc0.bias"].mask.tolist() == keep.tolist()
    np.testing.assert_allclose(t.values, w["fc0.weight"][keep], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rep.tensors["fc0.bias"].values, w["fc0.bias"][keep], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rep.tensors["fc1.weight"].dense(), w["fc1.weight"], rtol=1e-5, atol=1e-6)
