"""RoundMachine._first_bound at the number of reports where it starts to act (issue #28).

The rule (its docstring, docs/security.md "a huge update in round 1"): at the commit of a round with no
committed round behind it, every kept report is admitted again against ``norm_factor`` x the round's own
median norm per local step (x the report's own local steps): above that bound it is clipped to it, beyond
``refuse_factor`` x it refused with a strike (left out of the commit), and the round's sums are rebuilt.
A median needs reports to be taken over: the code applies the rule from 3 reports on (``len(used) < 3``:
with one or two the median is one of them, or their mean, which the far report itself sets), so with 2 the
commit is admission's own, the plain weighted mean of the reports as received.

Each expectation below is computed from the reports as the coordinator received them and the rule written out,
never read back from the machine: 2 reports (unchanged), 3 (the boundary: clipped; refused) and 4 (clipped).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator import rounds as R
from coordinator.admission import local_steps
from coordinator.strategies.fedavg import FedAvg
from edge import model as M

from test_poison import _reports, make_poison_bus, run

EPOCHS, BATCH = 2, 16
POISONER = "d1"


def _round_one(tmp_path, devices: int, frac: float, rules: R.AdmissionRules, lr: float = 0.1):
    """One round of ``devices`` devices, POISONER sending its update sign-flipped at ``frac`` of the bound
    admission applies on receipt (norm_factor x the plan's model norm); the screen off, so the bound acts alone."""
    bus = make_poison_bus(tmp_path, poisoners={POISONER}, start=1, frac=frac, rounds=1, devices=devices,
                          admission=rules, strategy=FedAvg(spec=M.mlp([64, 32, 10]), lr=lr, epochs=EPOCHS,
                                                           batch_size=BATCH))
    w0 = {k: v.astype(np.float64) for k, v in bus.m.state.weights.items()}
    plans = {}
    orig = bus.m._first_bound

    def spy(o, used, now):  # the plans and the reports the rule is applied to (what it decides is not read)
        plans.update(o.plans)
        plans["__used__"] = list(used)
        return orig(o, used, now)

    bus.m._first_bound = spy
    run(bus)
    (summary,) = bus.committed
    reps = _reports(bus, summary["task_id"])
    return bus, summary, reps, w0, plans


def _expected(reps, w0, plans, rules: R.AdmissionRules, applies: bool):
    """(state, refused, bound, norm) the documented rule gives for these reports (``applies``: the round's own
    median bound is applied)."""
    cap = math.ceil(rules.max_weight_factor * np.median([r.n_samples for r in reps.values()]))
    n = {d: min(r.n_samples, cap) for d, r in reps.items()}  # what a report weighs, and the steps it counts for
    steps = {d: EPOCHS * -(-n[d] // BATCH) for d in reps}
    assert all(steps[d] == local_steps(plans[d], n[d]) for d in reps)  # the steps the bound counts
    delta = {d: {k: t.values.astype(np.float64) - w0[k] for k, t in r.tensors.items()} for d, r in reps.items()}
    norm = {d: math.sqrt(sum(float((v * v).sum()) for v in dd.values())) for d, dd in delta.items()}
    median = float(np.median([norm[d] / steps[d] for d in reps]))
    bound = {d: rules.norm_factor * median * steps[d] for d in reps}
    refused = {d for d in reps if applies and norm[d] > rules.refuse_factor * bound[d]}
    scale = {d: min(1.0, bound[d] / norm[d]) if applies else 1.0 for d in reps}
    kept = [d for d in reps if d not in refused]
    state = {k: w0[k] + sum(n[d] * scale[d] * delta[d][k] for d in kept) / sum(n[d] for d in kept) for k in w0}
    return state, refused, bound, norm


def _strikes(bus, device: str) -> list[str]:
    return [p.data["reason"] for p in bus.persisted
            if p.what == "rejection" and p.data["device_id"] == device and p.data["strike"]]


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_round_one_median_bound_from_three_reports(tmp_path, devices):
    """POISONER's report is within admission's round-1 bound (0.5 x it) and, at every fleet size, between the
    round-median bound and refuse_factor x it. With 2 reports the commit is the plain weighted mean (it moves
    the model by its full norm); from 3 on it is clipped to norm_factor x the round's median norm per step.

    norm_factor = 1 and small honest steps (lr 0.02): with 2 reports the median per step is their mean, which the
    far report sets itself, so only below norm_factor 2 would the rule, applied there, clip it at all; this
    setup is one where it would (checked below), so the test fails if the rule started at 2 reports."""
    rules = R.AdmissionRules(screen_factor=None, norm_factor=1.0)
    bus, summary, reps, w0, plans = _round_one(tmp_path, devices, 0.5, rules, lr=0.02)
    assert sorted(reps) == sorted(summary["accepted"]) == sorted(plans["__used__"]) == [f"d{i}" for i in range(devices)]
    applies = devices >= 3
    want, refused, bound, norm = _expected(reps, w0, plans, rules, applies)
    # the setup is one where the rule, applied, clips POISONER (so at 2 reports its absence is what is seen)
    assert bound[POISONER] < norm[POISONER] < rules.refuse_factor * bound[POISONER], (bound, norm)
    assert not refused and not summary.get("excluded") and not _strikes(bus, POISONER)
    for k, v in want.items():
        np.testing.assert_allclose(bus.m.state.weights[k], v, rtol=1e-5, atol=1e-6)
    # ... and the other outcome is far from it: the rule makes a difference the comparison above sees
    other, *_ = _expected(reps, w0, plans, rules, not applies)
    assert max(float(np.abs(other[k] - want[k]).max()) for k in want) > 1e-2


def test_round_one_median_bound_refuses_at_three_reports(tmp_path):
    """At the boundary (3 reports), a report beyond refuse_factor x the round-median bound is refused with a strike
    and left out; the state is the weighted mean of the others (each clipped to its bound if above it).
    norm_factor 1, refuse_factor 2, small honest steps: a report admission let in on receipt (0.95 x the model's
    norm) is beyond it."""
    rules = R.AdmissionRules(screen_factor=None, norm_factor=1.0, refuse_factor=2.0)
    bus, summary, reps, w0, plans = _round_one(tmp_path, 3, 0.95, rules, lr=0.02)
    assert sorted(reps) == sorted(plans["__used__"]) == ["d0", "d1", "d2"]
    want, refused, bound, norm = _expected(reps, w0, plans, rules, True)
    assert norm[POISONER] > rules.refuse_factor * bound[POISONER], (bound, norm)  # the setup
    assert all(norm[d] <= rules.refuse_factor * bound[d] for d in reps if d != POISONER), (bound, norm)
    assert refused == {POISONER}
    assert summary.get("excluded") == [POISONER] and sorted(summary["accepted"]) == ["d0", "d2"]
    (why,) = _strikes(bus, POISONER)
    assert "left out of the commit" in why and "round's own median" in why
    for k, v in want.items():
        np.testing.assert_allclose(bus.m.state.weights[k], v, rtol=1e-5, atol=1e-6)
