"""One program serves every subnetwork (issue #26): a program exported at a bucket's shape, padded on the device
(edge/trainers/padded.py), computes the smaller network's loss, gradients and auxiliary outputs, on every
runtime; the coordinator serves buckets (coordinator/buckets.py) only to devices that declare the extension.

The reference is the smaller network's own program (exact shapes, no padding). The test points are ones where
padding would matter: FedSparse at T = 0.1 with lambda0 and the pi-theta cross-entropy weighted so that a padded
unit fed zeros would add to the loss (checked: zero padding changes it), FedMix with experts not held.
"""
from __future__ import annotations

import numpy as np
import pytest

from edge.model import mlp
from edge.trainers.padded import PaddedTrainer, active_spec
from tests.trainer_programs import trainer

BIG, SMALL = mlp([64, 32, 16, 10]), mlp([64, 20, 7, 10])
EXPERT = mlp([64, 24, 10])


def _lay(k: int, variant: str) -> dict:
    return {"slots": [[64, 24, 10]] * k, "variant": variant, "gated": False}


def _close(a: np.ndarray, b: np.ndarray, tol: float) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(1e-12, float(np.abs(b).max())))


def _fedsparse_point(exact, seed: int = 0, B: int = 12):
    rng = np.random.default_rng(seed)
    w = {k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in exact.shapes.items()}
    inp = {"x": rng.normal(size=(B, 64)).astype(np.float32), "y": rng.integers(0, 10, B),
           "lambda0": np.float32(0.05), "ce_scale": np.float32(0.1), "T": np.float32(0.1)}
    for i, n in enumerate(SMALL["sizes"][1:-1]):
        inp[f"u{i}"] = rng.uniform(0.05, 0.95, n).astype(np.float32)
        inp[f"theta_logit{i}"] = rng.normal(0, 2, n).astype(np.float32)
        inp[f"norm{i}"] = rng.uniform(0.5, 2, n).astype(np.float32)
    return w, inp


def _mixture_point(exact, variant: str, seed: int = 0, B: int = 12):
    rng = np.random.default_rng(seed)
    w = {k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in exact.shapes.items()}
    inp = {"x": rng.normal(size=(B, 64)).astype(np.float32), "y": rng.integers(0, 10, B),
           "active": np.array([1, 0, 1], np.float32), "qs": np.array([0.3, 0.0, 0.7], np.float32)}
    if variant == "cluster":
        inp["pi"] = np.array([0.6, 0.0, 0.4], np.float32)
    for j in range(3):
        inp[f"c{j}_fc0_weight"] = w[f"s{j}.fc0.weight"]
        inp[f"c{j}_fc0_bias"] = w[f"s{j}.fc0.bias"]
    return w, inp


def _compare(exact, padded, w, inp, tol):
    exact.set_weights(w)
    padded.set_weights(w)
    l1, g1, a1 = exact.loss_and_grads(inp)
    l2, g2, a2 = padded.loss_and_grads(inp)
    assert set(g2) == set(g1)
    assert abs(l2 - l1) <= tol * max(1.0, abs(l1)), (l1, l2)
    for k in g1:
        assert g2[k].shape == g1[k].shape
        assert _close(g2[k], g1[k], tol) <= tol, k
    assert set(a2) == set(a1)
    for k in a1:
        assert a2[k].shape == a1[k].shape, k
        assert _close(a2[k], a1[k], tol) <= tol, k
    return l1


RUNTIMES = ["torch", "ort", pytest.param("executorch", marks=pytest.mark.slow)]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_fedsparse_bucket_program_computes_the_subnetwork(runtime):
    exact = trainer("torch", SMALL, "fedsparse")
    padded = PaddedTrainer(trainer(runtime, BIG, "fedsparse"), {})
    tol = 1e-4 if runtime == "executorch" else 1e-5  # ExecuTorch's exp/log rounding (docs/trainers.md, trap 10)
    for seed in (0, 1):
        w, inp = _fedsparse_point(exact, seed)
        _compare(exact, padded, w, inp, tol)
    assert padded.padded


def test_padding_matters_at_the_fedsparse_point():
    """The point is one where a padded unit fed zeros (not the declared values) changes the loss: without the
    objective's padding values the test above would fail."""
    exact = trainer("torch", SMALL, "fedsparse")
    padded = PaddedTrainer(trainer("torch", BIG, "fedsparse"), {})
    w, inp = _fedsparse_point(exact)
    exact.set_weights(w)
    padded.set_weights(w)
    padded._in_pad = {}
    l1, _g, _a = exact.loss_and_grads(inp)
    l2, _g, _a = padded.loss_and_grads(inp)
    assert abs(l2 - l1) > 0.1


@pytest.mark.parametrize("variant", ["label", "cluster"])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_mixture_bucket_program_computes_the_held_experts(runtime, variant):
    """A device holding 3 of 4 experts runs the 4-slot program; slot 1 is switched off for the batch (Alg. 2)."""
    exact = trainer("torch", EXPERT, "mixture", _lay(3, variant))
    padded = PaddedTrainer(trainer(runtime, EXPERT, "mixture", _lay(4, variant)), {})
    for seed in (0, 1):
        w, inp = _mixture_point(exact, variant, seed)
        _compare(exact, padded, w, inp, 1e-5)


def test_padded_weights_stay_zero_between_shapes():
    """Weights set at a larger subnetwork, then at a smaller one: the entries the smaller one leaves are zero
    again (a shrinking network never leaves stale weights in the padding)."""
    big = PaddedTrainer(trainer("torch", BIG, "fedsparse"), {})
    rng = np.random.default_rng(3)
    mid = trainer("torch", mlp([64, 30, 12, 10]), "fedsparse")
    big.set_weights({k: rng.normal(size=s).astype(np.float32) for k, s in mid.shapes.items()})
    exact = trainer("torch", SMALL, "fedsparse")
    w, inp = _fedsparse_point(exact)
    _compare(exact, big, w, inp, 1e-5)
    got = big.inner.get_weights()
    assert not got["fc0.weight"][20:].any() and not got["fc1.weight"][:, 20:].any()
    assert not got["fc1.weight"][7:].any() and not got["fc2.weight"][:, 7:].any()


def test_shapes_that_do_not_fit_are_refused():
    padded = PaddedTrainer(trainer("torch", SMALL, "fedsparse"), {})
    with pytest.raises(ValueError, match="does not fit"):
        padded.set_weights({"fc0.weight": np.zeros((21, 64), np.float32)})
    with pytest.raises(ValueError, match="not parameters"):
        padded.set_weights({"fc9.weight": np.zeros((2, 2), np.float32)})


def test_active_spec_follows_the_plan():
    w = {"fc0.weight": np.zeros((20, 64)), "fc1.weight": np.zeros((7, 20)), "fc2.weight": np.zeros((10, 7))}
    assert active_spec(BIG, w) == SMALL
    assert active_spec(BIG, {"e0.fc0.weight": np.zeros((3, 64))}) == BIG


def test_programs_without_a_padding_are_not_wrapped():
    from edge.trainers import padded as P
    assert not P.applies(trainer("torch", SMALL, "ce"))
    assert not P.applies(trainer("torch", SMALL, "fedsparse", {"l0": "weight"}))  # per-weight L0: not exact
    assert P.applies(trainer("torch", SMALL, "fedsparse"))


# ---------------------------------------------------------------- the server's side: buckets and who gets them

def test_buckets_of_a_pruning_run_are_at_most_three():
    from coordinator import buckets
    full = mlp([64, 200, 200, 10])
    seen = set()
    rng = np.random.default_rng(0)
    a, b = 200, 200
    while a > 1 or b > 1:
        p = buckets.fedsparse(full, mlp([64, a, b, 10]), {})
        assert all(s <= w for s, w in zip([a, b], p.spec["sizes"][1:-1]))
        seen.add(tuple(p.spec["sizes"]))
        assert len(p.family) == 3 and (p.spec, p.layout) in p.family
        a, b = max(1, a - int(rng.integers(0, 15))), max(1, b - int(rng.integers(0, 15)))
    assert seen == {(64, 200, 200, 10), (64, 100, 100, 10), (64, 50, 50, 10)}
    assert buckets.fedsparse(full, mlp([64, 101, 3, 10]), {}).spec == full  # the widest layer decides
    assert buckets.fedsparse(full, mlp([64, 50, 50, 10]), {"l0": "weight"}) is None
    assert buckets.fedsparse(full, mlp([32, 50, 50, 10]), {}) is None  # not a subnetwork of full
    lay = {"slots": [[64, 200, 10]] * 3, "variant": "label", "gated": False}
    m = buckets.mixture(full, lay, 4)
    assert len(m.layout["slots"]) == 4 and [len(l["slots"]) for _s, l in m.family] == [4, 2, 1]
    assert len(buckets.mixture(full, lay | {"slots": [[64, 200, 10]]}, 4).layout["slots"]) == 1
    assert buckets.mixture(full, lay | {"gated": True}, 4) is None


def test_round_machine_serves_buckets_only_to_devices_that_pad():
    """FedSparse after pruning: a padding ORT device gets the bucket's program, an ORT device without the
    extension (the native device, say) the exact one, a torch device its exact program; the bucket's family is
    asked for ahead of time, after what the round needs."""
    from coordinator.rounds import RoundConfig, RoundMachine
    from coordinator.strategies.fedsparse import FedSparse
    from coordinator.registry import Eligibility
    from edge.protocol import wire

    s = FedSparse(spec=mlp([64, 40, 40, 10]), preset="mid")
    st = s.init(0)
    st.opt["alive/fc0"][15:] = 0  # 15 of 40 and 30 of 40 units alive: the 1/2 bucket (20) fails fc1, full serves
    st.opt["alive/fc1"][30:] = 0
    st2 = type(st)(st.round, st.weights, dict(st.opt), st.meta)
    st2.opt["alive/fc1"] = st.opt["alive/fc1"].copy()
    st2.opt["alive/fc1"][9:] = 0  # 15 and 9: the 1/2 bucket

    class Catalog:
        def __init__(self):
            self.asked, self.requested = [], []

        def ready(self, spec, runtime, objective, layout):
            return runtime == "torch"

        def request(self, spec, runtime, objective, layout):
            self.requested.append((tuple(spec["sizes"]), runtime))

        def __call__(self, spec, runtime, objective="ce", layout=None):
            raise AssertionError("no program is taken before it is ready")

    cat = Catalog()
    m = RoundMachine(RoundConfig(rounds=1, clients_per_round=3, over_selection=1.0,
                                 eligibility=Eligibility(runtimes=("torch", "ort"))), s, st2, cat)
    caps = {"ort-pad": {"runtime": "ort", "padded_programs": True}, "ort-exact": {"runtime": "ort"},
            "torch": {"runtime": "torch", "padded_programs": True}}
    base = {"charging": True, "network": "wifi", "idle": True, "memory_mb": 4096}
    for d, c in caps.items():
        m.receive(wire.topic(m.cfg.fleet, "checkin", d),
                  wire.encode(wire.CheckIn(d, base | c, [], 100)), 0.0)
    plans = m._plans(list(caps))
    args = {d: m._program_args(dp, d) for d, dp in plans.items()}
    assert args["ort-pad"][0]["sizes"] == [64, 20, 20, 10]
    assert args["ort-exact"][0]["sizes"] == [64, 15, 9, 10] and args["torch"][0]["sizes"] == [64, 15, 9, 10]
    assert m._programs_missing(plans)
    need = [(64, 20, 20, 10), (64, 15, 9, 10)]
    assert [r for r in cat.requested[:2]] == [(n, "ort") for n in need]  # what the round needs comes first
    assert sorted(cat.requested[2:]) == [((64, 10, 10, 10), "ort"), ((64, 40, 40, 10), "ort")]



@pytest.mark.parametrize("built, reproducible, want", [
    ({(64, 40, 40, 10)}, False, (64, 40, 40, 10)),  # its bucket exporting: the full one, built, holds it
    ({(64, 40, 40, 10), (64, 20, 20, 10)}, False, (64, 20, 20, 10)),  # its own, once built
    ({(64, 10, 10, 10)}, False, None),  # only a smaller one built: it waits for its own
    ({(64, 40, 40, 10)}, True, None),  # reproducible mode runs its own bucket only: no export timing in the run
])
def test_a_padding_device_runs_a_larger_built_bucket_while_its_own_exports(built, reproducible, want):
    """Production mode: a padding device whose bucket program is still exporting is served the smallest larger
    bucket of the family that is built (it pads into any bucket that holds its plan), so its round does not wait;
    its own bucket is still asked for, and serves it once built."""
    from coordinator.rounds import RoundConfig, RoundMachine
    from coordinator.strategies.fedsparse import FedSparse
    from coordinator.registry import Eligibility
    from edge.protocol import wire

    s = FedSparse(spec=mlp([64, 40, 40, 10]), preset="mid")
    st = s.init(0)
    st.opt["alive/fc0"][15:] = 0  # 15 and 9 of 40 units: the 1/2 bucket (20, 20)
    st.opt["alive/fc1"][9:] = 0

    class Catalog:
        def __init__(self):
            self.requested = []

        def ready(self, spec, runtime, objective, layout):
            return tuple(spec["sizes"]) in built

        def request(self, spec, runtime, objective, layout):
            self.requested.append(tuple(spec["sizes"]))

    cat = Catalog()
    m = RoundMachine(RoundConfig(rounds=1, clients_per_round=1, over_selection=1.0, reproducible=reproducible,
                                 eligibility=Eligibility(runtimes=("ort",))), s, st, cat)
    caps = {"runtime": "ort", "padded_programs": True, "charging": True, "network": "wifi", "idle": True,
            "memory_mb": 4096}
    m.receive(wire.topic(m.cfg.fleet, "checkin", "pad"), wire.encode(wire.CheckIn("pad", caps, [], 100)), 0.0)
    plans = m._plans(["pad"])
    args = m._program_args(plans["pad"], "pad")
    assert tuple(args[0]["sizes"]) == (want or (64, 20, 20, 10)) and args[1:3] == ("ort", "fedsparse")
    assert m._programs_missing(plans) == (want is None)
    assert (64, 20, 20, 10) in cat.requested or (64, 20, 20, 10) in built


# ---------------------------------------------------------------- a whole plan, through the driver

def _plan(dp, device: str = "dev", seed: int = 5):
    from edge.protocol.wire import Plan
    return Plan("r1a1", 1, device, 1e12, dp.hparams.get("strategy", ""), "torch", "h", dp.weights, dp.hparams, seed,
                dp.upload)


@pytest.mark.parametrize("runtime, bucket", [("torch", "own"), ("ort", "own"), ("ort", "full")])
def test_pruned_fedsparse_plan_gives_the_same_report_on_its_bucket(runtime, bucket, tmp_path):
    """A FedSparse plan of a pruned network (15 and 9 of 40 units), run by run_plan on the exact program and on
    its bucket's (20 and 20, padded), or on the full bucket (40 and 40: what a device runs while its own is
    exporting): the same masks, weights and metrics."""
    import dataclasses
    from coordinator.strategies.fedsparse import FedSparse
    from edge.algorithms.driver import run_plan
    s = FedSparse(spec=mlp([64, 40, 40, 10]), preset="earned")
    st = s.init(0)
    st.opt["alive/fc0"][15:] = 0
    st.opt["alive/fc1"][9:] = 0
    dp = s.plan(st, "dev", {})
    assert dp.spec["sizes"] == [64, 15, 9, 10] and dp.padded.spec["sizes"] == [64, 20, 20, 10]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 64)).astype(np.float32), rng.integers(0, 10, 60)
    plan = dataclasses.replace(_plan(dp), strategy="fedsparse")
    ref = run_plan(plan, trainer("torch", dp.spec, "fedsparse", dp.layout), x, y)
    spec = dp.padded.spec if bucket == "own" else dp.padded.family[0][0]
    assert bucket == "own" or spec["sizes"] == [64, 40, 40, 10]
    got = run_plan(plan, trainer(runtime, spec, "fedsparse", dp.padded.layout), x, y)
    assert ref.metrics["steps"] == got.metrics["steps"] == 3
    assert got.metrics["train_loss"] == pytest.approx(ref.metrics["train_loss"], rel=1e-5)
    assert set(got.tensors) == set(ref.tensors)
    for k, want in ref.tensors.items():
        g = got.tensors[k]
        assert g.shape == want.shape == tuple(dp.weights[k].shape)
        assert (g.mask is None) == (want.mask is None) and (g.mask is None or np.array_equal(g.mask, want.mask))
        assert _close(g.values, want.values, 1e-5) <= 1e-5, k


def test_fedmix_plan_with_fewer_experts_gives_the_same_report_on_its_bucket(tmp_path):
    """FedMix, a device holding 3 of the 4 experts (Alg. 2), two rounds: the 4-slot bucket program gives the
    3-slot program's report, and the same private state."""
    import dataclasses
    from coordinator.strategies.fedmix import FedMix
    from edge.algorithms.driver import run_plan
    from edge.runtime.state import LocalState
    s = FedMix(spec=EXPERT, K=4, variant="cluster", lr=0.05, epochs=1, batch_size=20, eta=0.5, prune_after=0)
    st = s.init(0)
    st.meta["qzs"]["dev"] = np.array([0.5, 0.3, 0.001, 0.199])
    st = dataclasses.replace(st, round=5)
    dp = s.plan(st, "dev", {})
    assert len(dp.layout["slots"]) == 3 and len(dp.padded.layout["slots"]) == 4
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(50, 64)).astype(np.float32), rng.integers(0, 10, 50)
    plan = dataclasses.replace(_plan(dp), strategy="fedmix")
    states = {n: LocalState(tmp_path / n) for n in ("exact", "padded")}
    progs = {"exact": trainer("torch", EXPERT, "mixture", dp.layout),
             "padded": trainer("torch", EXPERT, "mixture", dp.padded.layout)}
    for _round in range(2):
        reps = {n: run_plan(plan, progs[n], x, y, states[n]) for n in states}
        ref, got = reps["exact"], reps["padded"]
        assert got.metrics["train_loss"] == pytest.approx(ref.metrics["train_loss"], rel=1e-5)
        assert set(got.tensors) == set(ref.tensors) and set(got.extras) == set(ref.extras)
        for k, want in ref.tensors.items():
            assert _close(got.tensors[k].values, want.values, 1e-5) <= 1e-5, k
        for k, want in ref.extras.items():
            assert _close(got.extras[k], want, 1e-5) <= 1e-5, k
    a, b = states["exact"].load("fedmix"), states["padded"].load("fedmix")
    for k in a:
        assert np.allclose(a[k], b[k], rtol=1e-5, atol=1e-7), k
