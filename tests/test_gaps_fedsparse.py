"""FedSparse's client (paper 000, Alg. 2) at what the earlier tests left free (issue 28): the noise of every
step and the final mask come from their own streams of the plan's seed (stream 1, continued across steps and
epochs; stream 2 for z), over 2 epochs with an uneven last batch, and the ``kept`` metric is the mask's mean.
The runtime is tests/test_maths_clients.py's recording stub, so the inputs are checked, not a runtime's
answer; the draws are written here from docs/fedsparse.md (u ~ U(1e-6, 1 - 1e-6) float32, z = U < pi)."""
from __future__ import annotations

import numpy as np

from edge.algorithms.driver import run_plan
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
