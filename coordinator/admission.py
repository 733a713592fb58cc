"""Admission of a report: is it what its plan asked for, and is it small enough to trust?

Devices are untrusted. Before a strategy sees a report, it is checked against the device's own plan:
tensor names and shapes (so nothing proportional to a *declared* shape is allocated before it has been
compared with the plan), the upload dtype, where masks may appear, the extra arrays, a bound on every
value, and a bound on the update's norm. Each check raises :class:`ReportRejected` with a reason that
the round machine logs, acks and records against the device.

The norm bound (``norm_bound = "auto"``): ``norm_factor`` times the median update norm of the last
committed round, which a minority of poisoners cannot move; before any round has committed, ``norm_factor``
times the norm of the model the plan sent (an update ten times larger than the whole model is not
training). ``clip = true`` scales a report down to the bound instead of rejecting it (the clipping of
DP-FedAvg, McMahan et al. 2018).

A plan whose ``update`` is ``"gradient"`` (SFVI) gets gradients back, not weights: the norm is the gradient's
own, clipping scales it, and before any round has committed there is no bound (a gradient has no scale to
compare with in the model the plan sent; the value range still applies).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import numpy as np

from edge.algorithms.driver import value_format
from edge.protocol import wire
from edge.protocol.wire import DTYPES, PlainReport, Report, TensorUpdate

from .strategies.base import DevicePlan, ReportRejected, plan_difference

# values built in this process as plain arrays (no wire encoding to read): their format is their dtype
_PLAIN_FORMATS = {np.dtype(np.float32): "f4", np.dtype(np.float16): "f2"}
_NAMES = {"f4": "float32", "f2": "float16", "f8": "float64"}  # plain dtypes by name; codec formats by code


@dataclass
class AdmissionRules:
    """The ``[admission]`` section of fleet.toml."""

    norm_bound: float | str | None = "auto"  # "auto", a number, or None (no bound)
    norm_factor: float = field(default=10.0, metadata={"min": 1.0})
    clip: bool = False  # true: clip every update above the bound, however far (never refuse for the norm)
    # above the bound but within refuse_factor times it: clipped to the bound, no strike (an honest outlier,
    # a device with hard or unusual data late in training); beyond: refused with a strike. 1: refuse all.
    refuse_factor: float = field(default=10.0, metadata={"min": 1.0})
    max_abs_value: float = field(default=1e6, metadata={"min": 0.0})
    # refuse a commit whose test accuracy falls more than this below the last commit's (none: never)
    max_accuracy_drop: float | None = field(default=0.25, metadata={"min": 0.0, "max": 1.0})
    # a device's sample count weighs its report (FedAvg's N_s): a check-in may not claim more than this,
    # and a report must carry the count its device declared at check-in
    max_samples: int = field(default=1_000_000, metadata={"min": 1})
    # ... but the count is only the device's word: no report weighs more than this many times the median count
    # the round's selected devices declared (:func:`weight_cap`), and its norm bound, which grows with its local
    # steps, grows no further. One device of ten declaring 10^6 samples otherwise owned the mean. None: no cap.
    max_weight_factor: float | None = field(default=2.0, metadata={"min": 1.0})
    # clip every update above clip_factor x the median norm per step (x its steps) to that, with no strike; the
    # refusal stays at refuse_factor x the norm bound. None: clip at the norm bound (norm_factor). A poisoner's
    # weight in the mean is then at most clip_factor x a median report's, however far it is sent.
    clip_factor: float | None = field(default=None, metadata={"min": 0.1})
    # a commit refused (accuracy guard, a non-finite state) looks for the reports that caused it by leaving them
    # out (rounds.RoundMachine._without_culprits) and commits without them; for that the round keeps each
    # accepted report's contribution, up to this many MB (beyond: a refused commit is abandoned, as before)
    guard_memory_mb: float = field(default=32.0, metadata={"min": 0.0})
    # a commit the guard passed is screened for reports moving more than screen_factor x the round's own median
    # norm per local step; they are left out (with a strike) only if test accuracy is clearly higher without them
    # (rounds.RoundMachine._screened). It needs test data and the kept reports (guard_memory_mb). None: off.
    screen_factor: float | None = field(default=2.0, metadata={"min": 1.0})

    def __post_init__(self) -> None:
        if isinstance(self.norm_bound, str) and self.norm_bound != "auto":
            raise ValueError(f"norm_bound must be 'auto', a number or none, not {self.norm_bound!r}")
        if isinstance(self.norm_bound, (int, float)) and not self.norm_bound > 0:
            raise ValueError(f"norm_bound must be positive, not {self.norm_bound}")

    def bound(self, history: dict[str, Any], plan: DevicePlan, n: int = 0) -> float | None:
        """The norm bound for a report of ``plan`` from a device with ``n`` samples, given the last rounds' norms
        (``history``): ``norm_factor`` times their median per local step, times this device's local steps. An
        update grows with the steps taken, so a device with ten times the data of the median one takes ten
        times the steps and may move ten times as far; a bound on the norm alone rejected such honest devices
        (and quarantined them) in non-IID fleets."""
        if self.norm_bound is None:
            return None
        if self.norm_bound != "auto":
            return float(self.norm_bound)
        per_step = history.get("median_norm_per_step")
        if per_step:
            return self.norm_factor * float(per_step) * local_steps(plan, n)
        med = history.get("median_norm")  # a state written before the per-step history
        if med:
            return self.norm_factor * float(med)
        if plan.update == "gradient":
            return None
        return self.norm_factor * plan_norm(plan)


def weight_cap(rules: AdmissionRules, declared: Iterable[int]) -> int | None:
    """The most samples a report of a round may weigh: ``max_weight_factor`` times the median count its selected
    devices declared at check-in (known when the round opens, so streaming aggregation can apply it as reports
    arrive). None: no cap (no factor, or no counts)."""
    ns = [int(n) for n in declared if n and n > 0]
    if rules.max_weight_factor is None or not ns:
        return None
    return max(1, math.ceil(rules.max_weight_factor * float(np.median(ns))))


def capped(report: Report, cap: int | None) -> Report:
    """The report weighing at most ``cap`` samples (the same tensors; a new object only when it is capped)."""
    if cap is None or report.n_samples <= cap:
        return report
    return replace(report, n_samples=int(cap))


NORM_WINDOW = 32  # update norms behind the norm bound's median, across the last rounds when they are small


def next_history(history: dict[str, Any], per_step: list[float]) -> dict[str, Any]:
    """The admission history after a round whose committed reports had these update norms per local step (in
    device-id order): their median, topped up with the last rounds' to NORM_WINDOW norms when the round is
    small (the median of two or three reports is noise)."""
    out = dict(history)
    if per_step:
        pool = per_step
        if len(pool) < NORM_WINDOW:
            pool = (list(history.get("recent_norms", [])) + per_step)[-NORM_WINDOW:]
        out["median_norm_per_step"] = float(np.median(pool))
        out["recent_norms"] = [float(x) for x in pool[-NORM_WINDOW:]]
        out.pop("median_norm", None)
    return out


def local_steps(plan: DevicePlan, n: int) -> int:
    """The optimiser steps a device with ``n`` samples takes on ``plan``: epochs x ceil(n / batch_size), as the
    driver batches (edge/algorithms/driver.py); 1 for a plan without both (a gradient, a closed-form step)."""
    e, b = plan.hparams.get("epochs"), plan.hparams.get("batch_size")
    if not isinstance(e, int) or not isinstance(b, int) or b <= 0 or e <= 0 or n <= 0:
        return 1
    return e * -(-n // b)


def plan_norm(plan: DevicePlan) -> float:
    """Norm of the returnable tensors the plan sent (the first round's reference scale), once per round
    (:func:`per_checks`)."""
    return per_checks(plan, "norm", lambda p: math.sqrt(sum(_sq(p.weights[k]) for k in p.returned())))


def share_memo(plans: Iterable[DevicePlan]) -> None:
    """Give a round's plans one memo of what admission computes from what a report is checked against (max |w|
    per tensor, the plan's norm, the expected tensors: :func:`per_checks`). Per-device plans (a coded or
    difference downlink, an upload budget per device's link) are made from the round's shared plan and hold
    the same fields; each computed them again, a pass over the model for every report (0.4 ms a report of a
    200k-parameter model, or about 80% more ingest CPU)."""
    memo: dict = {}
    for p in plans:
        object.__setattr__(p, "_admission_memo", memo)


def check_key(plan: DevicePlan) -> tuple[int, ...]:
    """What the checks of a report read from its plan (the tensors, shapes and formats a device may send back),
    by identity. The per-device plans of a round that differ only in what went down the wire (a coded or
    difference downlink: ``dataclasses.replace`` of the round's plan, its other fields the same objects) have
    one key. Identity, not equality: a key is only used while its plan is held, so the ids stay unique."""
    key = plan.__dict__.get("_check_key")
    if key is None:
        key = (id(plan.weights), id(plan.upload), id(plan.extras), id(plan.extra_dtypes), id(plan.maskable),
               id(plan.returns), id(plan.update))
        object.__setattr__(plan, "_check_key", key)  # asked for every report
    return key


def per_checks(plan: DevicePlan, name: str, fn: Callable[[DevicePlan], Any]) -> Any:
    """``fn(plan)``, for a function of the fields :func:`check_key` covers: once for all the plans of a round
    that share them (:func:`share_memo`), where it was once per device with a downlink that gives each device
    its own plan object."""
    own = plan.__dict__.get("_checks")  # this plan's answers: asked for every report
    if own is None:
        own = {}
        object.__setattr__(plan, "_checks", own)
    if name in own:
        return own[name]
    memo = _memo(plan)
    key = (name, *check_key(plan))
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = (plan, fn(plan))  # the plan held, so the key's ids stay unique
    own[name] = hit[1]
    return hit[1]


def _memo(plan: DevicePlan) -> dict:
    m = plan.__dict__.get("_admission_memo")
    if m is None:
        m = {}
        object.__setattr__(plan, "_admission_memo", m)
    return m


def _sq(a: np.ndarray) -> float:
    """sum of squares, as one BLAS dot (float32 accumulation is ample for a bound). scipy's sdot where it can:
    np.vdot costs four times as much per call (1.7 against 0.4 us), and ingest calls this for every tensor of
    every report. Both paths of ingest (update_norm, admit_plain) call this one function, so they agree to the
    bit whichever it uses."""
    if _sdot is None or a.dtype != np.float32 or not a.size:  # (sdot refuses an empty array: a pruned tensor)
        return float(np.vdot(a, a))  # flattens a contiguous array without a copy
    x = a if a.ndim == 1 else a.reshape(-1)
    return _sdot(x, x)


try:  # scipy comes with scikit-learn, which the coordinator needs
    from scipy.linalg.blas import sdot as _sdot
except ImportError:  # pragma: no cover
    _sdot = None


def _expected(plan: DevicePlan) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """Per tensor the plan lets a device send: its shape, its value format, whether it may carry a row mask.
    Once per round for the plans that share what may come back (:func:`per_checks`): asked for every report."""
    return per_checks(plan, "expected", lambda p: {k: (s, value_format(p.upload, len(s)), k in p.maskable)
                                                   for k, s in p.returned().items()})


def check_structure(plan: DevicePlan, report: Report, rules: AdmissionRules) -> None:
    """Names, shapes, value format, masks, row samples, extras and value range, against the plan. Cheap: nothing
    is built from the report's declared shapes before they are compared with the plan's.

    The value format must be exactly the one the plan's upload spec gives for the tensor (dtype, or dtype_1d for
    vectors): q8-coded values where the plan asked for f4 are refused, as are f4 values where it asked for q8.
    A sampled update (rows sent with inclusion probabilities) only where the plan asks for one, as differences,
    with every probability at least the plan's p_min."""
    expected = _expected(plan)
    up = plan.upload
    for k, t in report.tensors.items():
        e = expected.get(k)
        if e is None:
            raise ReportRejected(f"tensor {k[:64]!r} was not asked for")
        shape, want, maskable = e
        if t.shape != shape:
            raise ReportRejected(f"{k}: shape {t.shape[:8]}, the plan sent {shape}")
        got = t.encoding if t.encoding is not None else _PLAIN_FORMATS.get(t.values.dtype, str(t.values.dtype))
        if got != want:
            raise ReportRejected(f"{k}: values are {_NAMES.get(got, got)}, the plan asked for {_NAMES.get(want, want)}")
        if not maskable and not t.dense_rows:
            raise ReportRejected(f"{k}: a row mask where the plan allows none")
        if t.sampled:
            if not up.get("sample") or not up.get("delta"):
                raise ReportRejected(f"{k}: rows sampled where the plan asks for every row")
            if t.pcodes.size and float(t.pcodes.min()) / 255.0 < float(up.get("p_min", 0.0)) - 1.0 / 255.0:
                raise ReportRejected(f"{k}: a row sent with probability below the plan's p_min")
    for k, a in report.extras.items():
        shape = plan.extras.get(k)
        if shape is None:
            raise ReportRejected(f"extra {k[:64]!r} was not asked for")
        if tuple(a.shape) != tuple(shape):
            raise ReportRejected(f"extra {k}: shape {tuple(a.shape)[:8]}, expected {tuple(shape)}")
        want = np.dtype(DTYPES.get(plan.extra_dtypes.get(k, "f4"), np.float32))
        if a.dtype != want:
            raise ReportRejected(f"extra {k}: {a.dtype}, expected {want}")
        if a.dtype.kind == "f":  # integer extras (indices) are range-checked by their strategy
            _check_range(k, a, rules.max_abs_value)
    if set(plan.extras) - set(report.extras):
        raise ReportRejected(f"missing extras {sorted(set(plan.extras) - set(report.extras))}")


def _check_range(name: str, a: np.ndarray, bound: float) -> None:
    """Every value finite and within +-bound: two reductions and no temporary (NaN fails both comparisons,
    so this is also the finiteness check for reports, which the coordinator decodes without one)."""
    if a.size and not (-bound <= float(a.min()) and float(a.max()) <= bound):
        raise ReportRejected(f"{name}: a value of magnitude above {bound:g}, or not finite")


def _delta_rows(plan: DevicePlan, name: str, t: TensorUpdate) -> np.ndarray:
    """w_s - w over the rows the device sent (a gradient or a difference as it is), in float64. Not for
    sampled rows: :func:`clip_report` scales those as they came, keeping their probabilities."""
    v = t.values.astype(np.float64)
    if plan.upload.get("delta") or plan.update == "gradient":
        return v
    w = plan.weights[name]
    return v - (w if t.mask is None else w[t.mask])


def update_norm(plan: DevicePlan, report: Report, max_abs_value: float = math.inf) -> float:
    """||w_s - w|| over everything the device sent (call after :func:`check_structure`), in float32: it only
    has to be compared with a bound ten times larger than typical. The same pass is the finiteness check (a
    NaN or inf value makes its tensor's norm NaN or inf) and, through max|v| <= max|w| + ||v - w||, the value
    range check; only when that bound is above ``max_abs_value`` are the values themselves scanned. A delta
    upload or a gradient (``update = "gradient"``) is its own update (w_max = 0)."""
    total = 0.0
    delta = plan.upload.get("delta") or plan.update == "gradient"
    for k, t in report.tensors.items():
        v = t.values
        w_max = 0.0
        if t.sampled:
            # differences (check_structure): the Horvitz-Thompson estimate of the whole update's squared norm,
            # sum over the sent rows of ||v_j||^2 / p_j, which is unbiased for it. The estimate's own norm,
            # ||v_j / p_j||, swings with which rows were drawn (a row sent at p_min counts 1 / p_min^2) and
            # got honest reports refused late in training; how far a report can move the sum stays bounded,
            # by this norm over sqrt(p_min).
            v32 = v.astype(np.float32, copy=False).reshape(len(v), -1)
            sq = float(np.dot(np.einsum("ij,ij->i", v32, v32), 1.0 / t.probs))
            if not math.isfinite(sq):
                raise ReportRejected(f"{k}: values that are not finite")
            if math.sqrt(sq) > max_abs_value:
                _check_range(k, t.values, max_abs_value)
            total += sq
            continue
        if not delta:
            d = plan_difference(plan, report, k)  # computed once for admission and the strategy's sum
            if d is not None:
                v = d
            else:
                w = plan.weights[k]
                w = w if t.mask is None else w[t.mask]
                v = v - w.astype(v.dtype, copy=False)
            w_max = _max_abs(plan)[k]
        sq = _sq(v.astype(np.float32, copy=False))
        if not math.isfinite(sq):
            raise ReportRejected(f"{k}: values that are not finite")
        if w_max + math.sqrt(sq) > max_abs_value:
            _check_range(k, t.values, max_abs_value)
        total += sq
    return math.sqrt(total)


def _max_abs(plan: DevicePlan) -> dict[str, float]:
    """max |w| of each of the plan's tensors, once per round (:func:`per_checks`)."""
    return per_checks(plan, "max_abs", _max_abs_of)


def _max_abs_of(plan: DevicePlan) -> dict[str, float]:
    return {k: float(np.abs(w).max()) if w.size else 0.0 for k, w in plan.weights.items()}


def clip_report(plan: DevicePlan, report: Report, scale: float) -> Report:
    """The report with its update scaled by ``scale`` (< 1): w + scale (w_s - w) on the rows it sent."""
    tensors = {}
    for k, t in report.tensors.items():
        if t.sampled:  # differences (check_structure): scale the values, keep the sample and its probabilities
            c = TensorUpdate(t.shape, (scale * t.values.astype(np.float64)).astype(t.values.dtype), t.mask,
                             sample=t.sample, pcodes=t.pcodes)
        else:
            d = scale * _delta_rows(plan, k, t)
            if not plan.upload.get("delta") and plan.update != "gradient":
                w = plan.weights[k]
                d += w if t.mask is None else w[t.mask]
            c = TensorUpdate(t.shape, d.astype(t.values.dtype), t.mask)
        c.encoding = t.encoding
        tensors[k] = c
    return Report(report.task_id, report.device_id, report.n_samples, report.metrics, tensors, report.extras)


def admit(plan: DevicePlan, report: Report, rules: AdmissionRules, history: dict[str, Any]) -> tuple[Report, float]:
    """The report to aggregate and its update norm, or ReportRejected. Above the norm bound a report is clipped
    to it, unless it is more than ``refuse_factor`` times the bound (and ``clip`` is off): then it is refused.
    Honest reports do land above a median-based bound (late in training, a device with unusual data: seen at
    13-20x the median per step in the FedSparse benchmark over Mosquitto), and refusing them cost strikes and
    quarantine; clipping keeps their direction and bounds their weight, as it bounds a poisoner's."""
    check_structure(plan, report, rules)
    norm = update_norm(plan, report, rules.max_abs_value)
    bound = rules.bound(history, plan, report.n_samples)
    if bound is not None and norm > bound:
        if not rules.clip and norm > rules.refuse_factor * bound:
            raise ReportRejected(f"update norm {norm:.4g} is above the bound {bound:.4g} by more than "
                                 f"{rules.refuse_factor:g}x")
    cb = clip_bound(rules, bound, history)
    if cb is not None and norm > cb:
        report = clip_report(plan, report, cb / norm)
    return report, norm


def clip_bound(rules: AdmissionRules, bound: float | None, history: dict[str, Any]) -> float | None:
    """Where a report is clipped: the norm bound, or (``clip_factor``, once a round has committed and the bound is
    the median's) clip_factor / norm_factor of it."""
    if bound is None or rules.clip_factor is None or rules.norm_bound != "auto" or not history.get("median_norm_per_step"):
        return bound
    return bound * rules.clip_factor / rules.norm_factor


# ---------------------------------------------------------------- the plain report (ingest's fast path)

def plain_expected(plan: DevicePlan) -> dict[str, tuple[list[int], int]] | None:
    """Name -> (shape, value bytes) of a plain report of ``plan`` (:func:`edge.protocol.wire.plain_report`: dense
    float32 weights of every returned tensor), or None when the plan asks for anything else (differences,
    sampled rows, extras, a gradient, another value format): such reports take the general path."""
    up, shapes = plan.upload, plan.returned()
    ok = (plan.update == "weights" and not up.get("delta") and not up.get("sample") and not plan.extras
          and all(value_format(up, len(s)) == "f4" and plan.weights[k].dtype == np.float32
                  and plan.weights[k].flags.c_contiguous for k, s in shapes.items())
          and wire.plain_shapes_ok(shapes))
    return {k: (list(s), 4 * math.prod(s)) for k, s in shapes.items()} if ok else None


def admit_plain(plan: DevicePlan, report: PlainReport, rules: AdmissionRules,
                history: dict[str, Any]) -> tuple[dict[str, np.ndarray], float] | None:
    """:func:`admit` for a plain report it would accept as it is: the differences w_s - W (float32, flat) and the
    update's norm. None when it would do anything else (refuse a value out of range or not finite, clip or
    refuse a norm above the bound): the caller then takes the general path, which decides and says why.
    :func:`check_structure` has nothing to check that :func:`plain_expected` and the decoder have not, and the
    arithmetic is :func:`update_norm`'s (the same BLAS dot over the same values, summed in the same order), so
    the norm is the same to the bit (tests/test_plain_ingest.py)."""
    total = 0.0
    diffs = {}
    w_max = _max_abs(plan)
    flat = per_checks(plan, "flat", _flat_weights)
    for k, v in report.values.items():
        d = np.subtract(v, flat[k])
        sq = _sq(d)
        if not math.isfinite(sq) or w_max[k] + math.sqrt(sq) > rules.max_abs_value:
            return None
        total += sq
        diffs[k] = d
    norm = math.sqrt(total)
    bound = clip_bound(rules, rules.bound(history, plan, report.n_samples), history)
    if bound is not None and norm > bound:
        return None
    return diffs, norm


def _flat_weights(plan: DevicePlan) -> dict[str, np.ndarray]:
    return {k: w.reshape(-1) for k, w in plan.weights.items()}
