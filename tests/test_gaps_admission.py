"""Admission (coordinator/admission.py) and the commit screen (coordinator/rounds.py ``clearly_better``), each
branch at its boundary (issue 28): a norm exactly at the bound and at refuse_factor times it, the clip bound
once a median exists, the weight cap's ceiling, a capped count at the cap, the norm history at exactly
NORM_WINDOW norms, local steps with an uneven last batch, and every branch of ``clearly_better`` at equality.

The expected values are computed here from the rules as docs/security.md states them; boundaries are built
from binary fractions so that equality is exact in float64.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator import admission as AD
from coordinator.admission import AdmissionRules
from coordinator.rounds import SCREEN_LOSS, SCREEN_MARGIN, SCREEN_MIN_GAIN, clearly_better
from coordinator.strategies.base import DevicePlan, ReportRejected
from edge.model import mlp
from edge.protocol.wire import Report, TensorUpdate

SPEC = mlp([2, 2])


def plan(epochs=2, batch_size=4, w=None):
    w = {"a": np.zeros(4, np.float32)} if w is None else w
    return DevicePlan(w, {"epochs": epochs, "batch_size": batch_size}, {"dtype": "f4"}, SPEC)


def report(v, n=10):
    v = np.asarray(v, np.float32)
    return Report("t", "d", n, {}, {"a": TensorUpdate(v.shape, v)})


# ---------------------------------------------------------------------------------------------- the norm bound
@pytest.mark.parametrize("n, steps", [(8, 4), (9, 6), (1, 2), (4, 2), (5, 4)])
def test_local_steps_count_the_short_last_batch(n, steps):
    """epochs x ceil(n / batch_size): 9 rows in batches of 4 are 3 steps an epoch. Kills: floor division."""
    assert AD.local_steps(plan(2, 4), n) == steps
    assert AD.local_steps(plan(2, 4), 0) == 1 and AD.local_steps(DevicePlan({}, {}, {}, SPEC), 5) == 1


def test_bound_is_norm_factor_times_median_per_step_times_steps():
    """auto: norm_factor x the median norm per step x this device's steps; a number as given; before any
    history, norm_factor x the plan's norm (none for a gradient plan). Kills: the steps left out, the plan's
    norm where the median exists."""
    r = AdmissionRules(norm_factor=3.0)
    p = plan(2, 4, {"a": np.array([3, 4, 0, 0], np.float32)})
    assert r.bound({"median_norm_per_step": 0.5}, p, 9) == 3.0 * 0.5 * 6
    assert r.bound({"median_norm": 2.0}, p, 9) == 6.0
    assert r.bound({}, p, 9) == 3.0 * 5.0
    assert r.bound({}, DevicePlan(p.weights, p.hparams, p.upload, SPEC, update="gradient"), 9) is None
    assert AdmissionRules(norm_bound=7.5).bound({"median_norm_per_step": 0.5}, p, 9) == 7.5
    assert AdmissionRules(norm_bound=None).bound({"median_norm_per_step": 0.5}, p, 9) is None


def test_admit_at_the_bound_and_at_refuse_factor_times_it():
    """Norm == bound: taken as sent. Bound < norm <= refuse_factor x bound: clipped to the bound (direction
    kept). Beyond: refused, unless clip is on (then clipped however far). Kills: >= for > at either edge,
    clipping to the wrong length."""
    p = plan(1, 100)  # one step
    hist = {"median_norm_per_step": 0.25}
    r = AdmissionRules(norm_factor=4.0, refuse_factor=2.0, clip_factor=None)  # bound = 1.0
    at = report([0.6, 0.8, 0, 0])  # norm 1.0 exactly
    got, norm = AD.admit(p, at, r, hist)
    assert norm == 1.0 and got is at
    edge = report([1.2, 1.6, 0, 0])  # norm 2.0 = refuse_factor x bound: clipped, not refused
    got, norm = AD.admit(p, edge, r, hist)
    assert norm == pytest.approx(2.0)
    np.testing.assert_allclose(got.tensors["a"].values, [0.6, 0.8, 0, 0], rtol=1e-6)
    beyond = report([1.2, 1.6, 0.1, 0])
    with pytest.raises(ReportRejected):
        AD.admit(p, beyond, r, hist)
    got, norm = AD.admit(p, beyond, AdmissionRules(norm_factor=4.0, refuse_factor=2.0, clip=True, clip_factor=None),
                         hist)
    v = np.array([1.2, 1.6, 0.1, 0])
    np.testing.assert_allclose(got.tensors["a"].values, v / np.linalg.norm(v), rtol=1e-6)


def test_clip_factor_applies_only_once_a_median_exists_and_for_auto():
    """clip_factor / norm_factor of the bound, for 'auto' with a median per step; otherwise the bound itself.
    Kills: clip_factor x the bound, the clip bound before the first median."""
    r = AdmissionRules(norm_factor=8.0, clip_factor=2.0)
    assert AD.clip_bound(r, 4.0, {"median_norm_per_step": 0.5}) == 1.0
    assert AD.clip_bound(r, 4.0, {}) == 4.0
    assert AD.clip_bound(r, None, {"median_norm_per_step": 0.5}) is None
    assert AD.clip_bound(AdmissionRules(norm_bound=4.0, clip_factor=2.0), 4.0, {"median_norm_per_step": 1}) == 4.0
    got, norm = AD.admit(plan(1, 100), report([1.5, 2.0, 0, 0]), r, {"median_norm_per_step": 0.5})  # bound 4
    assert norm == pytest.approx(2.5)
    np.testing.assert_allclose(got.tensors["a"].values, [0.6, 0.8, 0, 0], rtol=1e-6)  # clipped to 1.0


# ---------------------------------------------------------------------------------------------- weights
def test_weight_cap_is_the_ceiling_of_factor_times_the_median():
    """max(1, ceil(factor x median declared)), zeros ignored; a report at the cap keeps its object. Kills: a
    floor, zeros counted in the median, a report at the cap replaced."""
    r = AdmissionRules(max_weight_factor=1.25)
    assert AD.weight_cap(r, [3, 4, 0, 0]) == math.ceil(1.25 * 3.5) == 5
    assert AD.weight_cap(r, [0]) is None
    assert AD.weight_cap(AdmissionRules(max_weight_factor=None), [3]) is None
    assert AD.weight_cap(AdmissionRules(max_weight_factor=1.0), [1, 1, 1]) == 1
    rep = report([0, 0, 0, 0], n=5)
    assert AD.capped(rep, 5) is rep
    assert AD.capped(rep, 4).n_samples == 4 and AD.capped(rep, None) is rep


def test_norm_history_tops_up_below_the_window_only():
    """A round of fewer than NORM_WINDOW norms is pooled with the last ones (the last NORM_WINDOW kept); a
    round of exactly NORM_WINDOW stands alone. Kills: <= for <, the pool's tail cut from the wrong end."""
    W = AD.NORM_WINDOW
    hist = {"recent_norms": [100.0] * 10, "median_norm": 3.0}
    full = list(np.linspace(1, 2, W))
    out = AD.next_history(hist, full)
    assert out["median_norm_per_step"] == float(np.median(full)) and "median_norm" not in out
    assert out["recent_norms"] == full
    small = [1.0, 2.0, 3.0]
    out = AD.next_history({"recent_norms": [float(i) for i in range(40)]}, small)
    pool = ([float(i) for i in range(40)] + small)[-W:]
    assert out["median_norm_per_step"] == float(np.median(pool)) and out["recent_norms"] == pool
    assert AD.next_history(hist, []) == hist


# ---------------------------------------------------------------------------------------------- the screen
def test_clearly_better_every_branch_at_its_boundary():
    """rounds.clearly_better: (1) accuracy ahead by exactly SCREEN_MARGIN wins; (2) no accuracy or a
    non-finite own loss loses, the other's non-finite loss wins; (3) no 'before' loses; (4) a gain of exactly
    0 loses even against a rising other, and a gain of exactly SCREEN_MIN_GAIN of the first loss counts; (5) the other's gain exactly 0 is not 'rising'; (6) about as
    accurate (exactly SCREEN_MARGIN behind) with the other's gain exactly (1 - share) of ours wins.
    Kills: > for >= or < for <= at each comparison, the margin's sign."""
    b = 0.25
    a_up = b + SCREEN_MARGIN
    assert clearly_better({"accuracy": a_up}, {"accuracy": b}, None)
    assert not clearly_better({"accuracy": np.nextafter(a_up, 0)}, {"accuracy": b}, None)
    assert not clearly_better({"accuracy": 0.9}, {}, 1.0) and not clearly_better({}, {"accuracy": 0.1}, 1.0)
    A = lambda acc, loss: {"accuracy": acc, "loss": loss}  # noqa: E731
    assert not clearly_better(A(0.5, math.inf), A(0.5, 1.0), 2.0)
    assert clearly_better(A(0.5, 1.0), A(0.5, math.nan), 2.0)
    assert not clearly_better(A(0.5, 1.0), A(0.5, 3.0), None)
    assert not clearly_better(A(0.5, 2.0), A(0.5, 2.5), 2.0)  # (4) our gain 0
    # (4') a gain of exactly SCREEN_MIN_GAIN of the first loss may decide (0.01 x 100 = 1.0 exactly), less may not;
    # against a rising other, the distance between the two steps counts instead of our step alone
    assert SCREEN_MIN_GAIN * 100.0 == 1.0
    assert clearly_better(A(0.5, 1.0), A(0.5, 2.0), 2.0, first=100.0)
    assert not clearly_better(A(0.5, 1.0), A(0.5, 2.0), 2.0, first=100.0 + 2 ** -40)
    assert clearly_better(A(0.5, 1.5), A(0.5, 2.5), 2.0, first=100.0)  # 0.5 down against 0.5 up: 1.0 apart
    assert not clearly_better(A(0.5, 1.5), A(0.5, 2.25), 2.0, first=100.0)  # 0.75 apart
    assert clearly_better(A(0.1, 1.5), A(0.5, 2.5), 2.0)  # the other's loss rises: ours wins at any accuracy
    assert not clearly_better(A(0.125, 1.5), A(0.5, 2.0), 2.0)  # (5) its gain 0, we are far less accurate
    assert SCREEN_LOSS == 0.5
    behind = 0.5 - SCREEN_MARGIN
    assert clearly_better(A(behind, 1.0), A(0.5, 1.5), 2.0)  # (6) gain 1 vs 0.5 = (1 - share) x 1
    assert not clearly_better(A(behind, 1.0), A(0.5, 1.5 - 2 ** -20), 2.0)
    assert not clearly_better(A(np.nextafter(behind, 0), 1.0), A(0.5, 1.5), 2.0)
    assert clearly_better(A(0.5, 1.0), A(0.5, 1.25), 2.0, share=0.25)  # 0.75 = (1 - 0.25) x 1
    assert not clearly_better(A(0.5, 1.0), A(0.5, 1.25), 2.0, share=0.5)


@pytest.mark.parametrize("bound", [1e6, 4.0, 0.5])
def test_values_at_the_range_bound_pass_and_beyond_it_are_refused(bound):
    """max_abs_value is inclusive on both sides: -bound and +bound pass, the next float32 beyond either is
    refused, and so is a NaN (it fails both comparisons)."""
    from coordinator.admission import _check_range
    edge = np.array([-bound, 0.0, bound], np.float32)
    _check_range("w", edge, bound)
    _check_range("w", np.array([], np.float32), bound)
    for bad in (np.nextafter(np.float32(-bound), np.float32(-np.inf)), np.nextafter(np.float32(bound), np.float32(np.inf)),
                np.float32(np.nan)):
        with pytest.raises(ReportRejected, match="magnitude above"):
            _check_range("w", np.array([0.0, bad], np.float32), bound)


@pytest.mark.parametrize("hp, n, steps", [({"epochs": 3, "batch_size": 4}, 9, 9), ({"epochs": 1, "batch_size": 4}, 8, 2),
                                          ({"epochs": 0, "batch_size": 4}, 9, 1), ({"epochs": 2, "batch_size": 0}, 9, 1),
                                          ({"epochs": 2, "batch_size": 4}, 0, 1), ({"epochs": 2.0, "batch_size": 4}, 9, 1),
                                          ({}, 9, 1)])
def test_local_steps_count_batches_and_a_plan_that_steps_nowhere_counts_one(hp, n, steps):
    """epochs x ceil(n / batch_size) (an uneven last batch is a step); a plan without whole positive epochs and
    batch size, or a device without samples, counts one step, never zero (a norm bound of zero would refuse
    every report)."""
    from types import SimpleNamespace
    assert AD.local_steps(SimpleNamespace(hparams=hp), n) == steps


def test_update_norm_of_a_row_masked_report_is_over_its_rows_differences():
    """A report of some rows (a mask) is not a plain tensor, so its norm is ||v - w[mask]|| computed here, not the
    shared difference: against numpy, with weights that are not zero (a sum v + w would differ)."""
    w = {"a": np.array([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25]], np.float32)}
    mask = np.array([True, False, True])
    v = np.array([[1.5, -1.0], [-1.0, 0.0]], np.float32)
    rep = Report("t", "d", 10, {}, {"a": TensorUpdate((3, 2), v, mask)})
    want = math.sqrt(float(((v.astype(np.float64) - w["a"][mask]) ** 2).sum()))
    assert AD.update_norm(plan(w=w), rep) == pytest.approx(want, rel=1e-6)
