"""FedSparse with sparsity earned over rounds (issue 13): relative gates, the T and lambda0 schedules, the pruning
guard for relative norms, and the thresholds a coded downlink needs, each against a reference written here."""
from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.strategies.fedsparse import FedSparse, prune, threshold_grad
from edge import gates
from edge.algorithms.driver import value_format
from edge.algorithms.fedsparse import gate_inputs
from edge.model import mlp
from edge.protocol import downlink, wire
from edge.protocol.wire import Report, TensorUpdate
from edge.protocol.capabilities import EXTENSIONS as EXT

SPEC = mlp([6, 5, 4, 3])


def sig(a):
    return 1 / (1 + np.exp(-a))


def softplus(v):
    return np.log1p(np.exp(v))


def rel(w, b, alive=None):
    n = np.sqrt((w.astype(np.float64) ** 2).sum(1) + b.astype(np.float64) ** 2)
    a = np.ones(len(n), bool) if alive is None else alive
    return n / n[a].mean()


def test_schedules_follow_their_formulas():
    fs = FedSparse(spec=SPEC, preset="earned")
    assert fs.relative and fs.T_start == 0.1 and fs.T == 0.01
    for r in (1, 30, 61, 62, 90, 121, 200):
        f = min(1.0, max(0.0, (r - 1 - 60) / 60))
        assert fs.T_at(r) == pytest.approx(0.1 ** (1 - f) * 0.01 ** f, rel=1e-12)
        assert fs.lambda0_at(r) == pytest.approx(1e-3 * min(1.0, r / 50), rel=1e-12)
    st = fs.init(0)
    for rnd in (1, 100, 150):
        st.round = rnd - 1
        hp = fs.hparams(st)
        assert hp.T == fs.T_at(rnd) and hp.relative is True
        assert hp.v_lr == pytest.approx(0.01 * fs.T_at(rnd) / 0.01) and hp.lambda0 == fs.lambda0_at(rnd)
    plain = FedSparse(spec=SPEC, preset="mid")
    assert plain.T_at(1) == plain.T_at(500) == 1e-3 and plain.lambda0_at(1) == 1e-2 and not plain.relative


def test_relative_theta_and_its_threshold_gradient_match_the_reference():
    fs = FedSparse(spec=SPEC, preset="earned")
    st = fs.init(3)
    rng = np.random.default_rng(0)
    st.opt["alive/fc0"] = np.array([1, 0, 1, 1, 1], np.uint8)  # a dead unit is not in the layer's mean
    st.weights["fc0.weight"][1] = 0.0
    st.weights["fc0.bias"][1] = 0.0
    st.opt["v/fc0"] = (st.opt["v/fc0"] + rng.normal(0, 0.05, 5)).astype(np.float32)
    alive = st.opt["alive/fc0"].astype(bool)
    T = fs.T_at(1)
    ref = (rel(st.weights["fc0.weight"], st.weights["fc0.bias"], alive)
           - softplus(st.opt["v/fc0"].astype(np.float64))) / T
    np.testing.assert_allclose(fs._theta_logits(st, 0)[alive], ref[alive], rtol=1e-12)
    # the client's theta from the sliced network (only alive units) is the same
    w = {"fc0.weight": st.weights["fc0.weight"][alive], "fc0.bias": st.weights["fc0.bias"][alive],
         "fc0.v": st.opt["v/fc0"][alive]}
    np.testing.assert_allclose(gate_inputs(w, ["fc0"], T, relative=True)["fc0"], ref[alive], rtol=1e-12)
    # Alg. 1 line 8 with relative norms: -(z - theta) sigmoid(v) / T
    z = np.array([1, 0, 1, 0], bool)
    theta = sig(ref[alive])
    v = st.opt["v/fc0"][alive].astype(np.float64)
    np.testing.assert_allclose(threshold_grad(w["fc0.weight"], w["fc0.bias"], w["fc0.v"], z, T, relative=True),
                               -(z - theta) * sig(v) / T, rtol=1e-10)
    # the thresholds start where theta0 says
    fresh = fs.init(3)
    np.testing.assert_allclose(sig(fs._theta_logits(fresh, 1)), 0.9, atol=1e-4)


def test_relative_pruning_keeps_every_survivor_theta():
    """Pruning unit 2 of fc0 moves fc0's mean norm and removes a column of fc1: the guard shifts the survivors'
    thresholds of both layers so that their theta is what it was (reference: the logits before)."""
    fs = FedSparse(spec=SPEC, preset="earned")
    st = fs.init(1)
    T = 0.05
    w = {k: v.copy() for k, v in st.weights.items()}
    v = {f"fc{i}": st.opt[f"v/fc{i}"].astype(np.float32).copy() for i in (0, 1)}
    v["fc0"][2] = 50.0  # theta ~ 0: pruned
    alive = {i: np.ones(n, bool) for i, n in ((0, 5), (1, 4))}
    before = {i: (rel(w[f"fc{i}.weight"], w[f"fc{i}.bias"]) - softplus(v[f"fc{i}"].astype(np.float64))) / T
              for i in (0, 1)}
    prune(w, v, alive, [0, 1], T, 0.1, relative=True)
    assert alive[0].tolist() == [True, True, False, True, True] and alive[1].all()
    assert not w["fc0.weight"][2].any() and not w["fc1.weight"][:, 2].any()
    for i in (0, 1):
        after = (rel(w[f"fc{i}.weight"], w[f"fc{i}.bias"], alive[i]) - softplus(v[f"fc{i}"].astype(np.float64))) / T
        np.testing.assert_allclose(after[alive[i]], before[i][alive[i]], atol=2e-3)  # float32 thresholds
    # without the guard the survivors' logits would have moved by whole units
    unguarded = (rel(w["fc0.weight"], w["fc0.bias"], alive[0]) - softplus(st.opt["v/fc0"].astype(np.float64))) / T
    assert np.abs(unguarded[alive[0]] - before[0][alive[0]]).max() > 0.5


@pytest.mark.parametrize("preset", ["max", "mid"])
def test_a_coded_downlink_gives_the_device_the_servers_theta(preset):
    """The device computes theta from the weights it holds (int8 per row, or as differences): the thresholds the
    plan carries are moved by what coding did to each group's norm, so the device's theta logits are the server's
    (reference: the server's logits from its exact weights)."""
    kw = {"down_dtype": "q8r", "down_dtype_1d": "q8", "down_deltas": True, "prune_below": 0.0} if preset == "mid" else {}
    fs = FedSparse(spec=mlp([6, 40, 30, 3]), preset=preset, **kw)
    st = fs.init(2)
    rng = np.random.default_rng(4)
    for rnd in range(2):  # the second plan is a difference from the confirmed first
        dp = fs.plan(st, "d0", EXT)  # a device that implements the coded downlink
        assert bool(dp.base) == (rnd == 1)
        plan = wire.decode(wire.encode(wire.Plan("r", 1, "d0", 1e18, "fedsparse", "torch", "0" * 64, dp.wire,
                                                 dp.hparams, 1, dp.upload, tag=dp.tag, base=dp.base)))
        held = downlink.held(_State.of(fs, "d0"))[1] if plan.base else None
        got = downlink.decode(plan.weights, held)
        _State.keep(fs, "d0", got)
        T = fs.T_at(st.round + 1)
        for i in (0, 1):
            server = fs._theta_logits(st, i)[st.opt[f"alive/fc{i}"].astype(bool)]
            device = gate_inputs(got, [f"fc{i}"], T, relative=fs.relative)[f"fc{i}"]
            assert np.abs(device - server).max() < 0.05, (rnd, i, np.abs(device - server).max())
            raw = dict(got, **{f"fc{i}.v": dp.weights[f"fc{i}.v"]})  # the server's thresholds, unmoved
            off = np.abs(gate_inputs(raw, [f"fc{i}"], T, relative=fs.relative)[f"fc{i}"] - server).max()
            assert off > 5 * np.abs(device - server).max()
        # the device reports (all units kept): the server confirms the model and moves on
        new = {k: (got[k] + rng.normal(0, 0.01, got[k].shape)).astype(np.float32) for k in dp.returned()}
        tens = {k: TensorUpdate.encoded(new[k].shape, new[k] - got[k], np.ones(new[k].shape[0], bool)
                                        if k.split(".")[0] in ("fc0", "fc1") else None,
                                        code=value_format(dp.upload, new[k].ndim),
                                        rng=rng) for k in new}
        acc = fs.begin(st)
        fs.accumulate(st, acc, dp, wire.decode(wire.encode(Report("r", "d0", 5, {}, tens))))
        st = fs.finish(st, acc)


class _State:
    """A device's LocalState stand-in for the test above (held models in memory)."""

    _all: dict = {}

    def __init__(self):
        self.d = None

    def load(self, name):
        return None if self.d is None else dict(self.d)

    def save(self, name, arrays):
        self.d = dict(arrays)

    @classmethod
    def of(cls, fs, dev):
        return cls._all.setdefault((id(fs), dev), cls())

    @classmethod
    def keep(cls, fs, dev, weights):
        downlink.store(cls.of(fs, dev), fs._down.held[dev].tag, weights)
