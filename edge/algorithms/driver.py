"""The one client driver: run a plan on local data and encode the update. It owns what every algorithm
shares (decoding the hyperparameters, the batch order, the training metrics, the update's encoding), so an
algorithm's client half is only its own steps."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..protocol import downlink
from ..protocol.codec import VALUE_KINDS, value_nbytes
from ..protocol.wire import Plan, Report, TensorUpdate
from ..runtime.state import LocalState
from ..trainers import padded
from ..trainers.base import Trainer
from ..trainers.module_state import ModuleTrainer, needs_wrapping
from . import client_class
from .base import Context, PlanError

# random streams of the plan's seed the driver owns (algorithms use small numbers; 0 orders the batches):
# stochastic rounding, row sampling, and a module's dropout masks
STREAM_ROUNDING, STREAM_SAMPLE, DROPOUT_STREAM = 100, 101, 102
SAMPLE_DESIGNS = ("norm", "uniform")
_PLAIN = {"f4": np.float32, "f2": np.float16}
_F16_MAX = 65504.0


def batches(n: int, batch_size: int, epochs: int, seed: int):
    """Index batches for ``epochs`` passes; a fresh permutation per epoch (numpy, from the plan's seed, so
    every runtime sees the same batches); the last batch may be short."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        perm = rng.permutation(n)
        for i in range(0, n, batch_size):
            yield perm[i:i + batch_size]


def value_format(upload: dict, ndim: int) -> str:
    """The value format a plan's upload spec asks for a tensor of ``ndim`` dimensions: ``dtype``, or for vectors
    ``dtype_1d`` when given (a per-row scale is no saving on a vector of biases)."""
    if ndim <= 1 and "dtype_1d" in upload:
        return str(upload["dtype_1d"])
    return str(upload.get("dtype", "f4"))


def _upload_options(upload: dict) -> tuple[bool, str | None, float, float]:
    """The upload keys this device reads, typed strictly (docs/protocol.md section 6): ``delta`` a bool, ``keep`` and
    ``p_min`` numbers (a string "false" is not false, and a bool is not a number)."""
    delta = upload.get("delta", False)
    if type(delta) is not bool:
        raise PlanError(f"upload delta must be true or false, not {delta!r}")
    design = upload.get("sample")
    keep, p_min = upload.get("keep", 1.0), upload.get("p_min", 0.0)
    if any(type(v) not in (int, float) for v in (keep, p_min)):
        raise PlanError("upload keep and p_min must be numbers")
    keep, p_min = float(keep), float(p_min)
    if design is not None:
        if design not in SAMPLE_DESIGNS:
            raise PlanError(f"upload sample {design!r} is not one of {SAMPLE_DESIGNS}")
        if not delta:
            raise PlanError("sampled uploads send differences (upload.delta)")
        if not (0.0 < keep <= 1.0 and 0.0 <= p_min <= 1.0):
            raise PlanError(f"upload keep {keep} must be in (0, 1] and p_min {p_min} in [0, 1]")
    return delta, design, keep, p_min


def inclusion_probabilities(norms: list[np.ndarray], row_bytes: list[float], keep: float, p_min: float,
                            design: str) -> list[np.ndarray]:
    """Per row of every sampled tensor, the probability it is sent, so that the expected value bytes are ``keep``
    of all rows' (at least ``p_min`` each; 1 at most). ``norm``: p proportional to ||row|| / sqrt(bytes), the
    allocation that minimises the Horvitz-Thompson estimate's variance sum ||row||^2 / p for the expected bytes;
    ``uniform``: p = keep. Rounded up to the wire's grid of 1/255."""
    sizes = [len(n) for n in norms]
    byt = np.concatenate([np.full(len(n), float(b)) for n, b in zip(norms, row_bytes)]) if norms else np.zeros(0)
    total = float(byt.sum())
    target = keep * total
    if design == "uniform" or not total:
        flat = np.full(len(byt), max(keep, p_min))
    else:
        score = np.concatenate([n.astype(np.float64) / math.sqrt(b) for n, b in zip(norms, row_bytes)])

        def spent(c: float) -> float:
            return float((np.clip(c * score, p_min, 1.0) * byt).sum())

        if spent(0.0) >= target:
            c = 0.0
        elif float((np.where(score > 0, 1.0, min(p_min, 1.0)) * byt).sum()) <= target:
            c = np.inf  # every row that changed goes; rows with no change stay at p_min
        else:  # bisection on log c: spent() is monotone in c
            pos = score[score > 0]
            lo, hi = math.log(max(p_min, 1e-12) / pos.max()) - 1.0, math.log(1.0 / pos.min()) + 1.0
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if spent(math.exp(mid)) < target else (lo, mid)
            c = math.exp(hi)
        with np.errstate(invalid="ignore"):
            flat = np.clip(np.where(score > 0, c * score, 0.0), p_min, 1.0)
    ps = np.split(flat, np.cumsum(sizes)[:-1]) if sizes else []
    return [np.clip(np.ceil(p * 255.0 - 1e-9), 1, 255) / 255.0 for p in ps]


PCODE_BYTES = 1  # a sent row's inclusion probability goes as a uint8 code


def mask_bytes_bound(n: int) -> int:
    """Bytes a sample mask over ``n`` rows takes at most: a bitmask (the codec sends the smallest form)."""
    return (n + 7) // 8


def row_keep(keep: float, dense: float, whole: float, rows: float) -> float:
    """The fraction of the sampled rows' cost (``rows``: values plus a probability code each) that fits a budget
    of ``keep`` x the value bytes of the whole update sent dense (``dense``), after what always goes (``whole``:
    vectors, and a sample mask per matrix). So ``keep`` bounds the bytes of the update that is sent, not only
    of its sampled values; half a grid step (p is rounded up to 1/255) is held back. At least one grid step."""
    if rows <= 0:
        return 1.0
    fit = (keep * dense - whole) / rows - 0.5 / 255.0
    return float(min(1.0, max(fit, 1.0 / 255.0)))


def systematic_sample(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A sample that contains row j with probability exactly p[j] (p <= 1) and has floor or ceil of sum(p)
    rows: systematic sampling over a random order (Madow 1949), so a budget in expectation is also a budget
    per draw, to one row."""
    n = len(p)
    order = rng.permutation(n)
    cum = np.cumsum(p[order])
    u = rng.random()
    hits = np.ceil(cum - u) - np.ceil(cum - p[order] - u)  # points u + m in [cum - p, cum)
    out = np.zeros(n, bool)
    out[order] = hits > 0
    return out


def encode_update(new: dict[str, np.ndarray], plan: Plan, masks: dict[str, np.ndarray] | None = None
                  ) -> dict[str, TensorUpdate]:
    """Per tensor the active rows (``masks`` over rows; absent = dense) in the plan's value format
    (:func:`value_format`; f4, f2, bf16, q8, q8r: edge/protocol/codec.py; int8 rounds stochastically from a stream
    of the plan's seed, so the server's sum stays unbiased).

    With ``upload.delta`` the values are w_s - w (the plan's weights) instead of w_s: a float16 weight
    keeps ~3 significant digits of |w|, which swallows a round's small change; its difference keeps them.

    With ``upload.sample`` (``norm`` or ``uniform``; differences only) a tensor of two or more dimensions sends a
    random subset of its active rows, each with a known inclusion probability (:func:`inclusion_probabilities`,
    drawn by :func:`systematic_sample`), so that the update's bytes (values, probability codes, sample masks and
    the vectors that go whole) are about ``keep`` of the same update's values sent dense (:func:`row_keep`); the
    server divides each row by its probability (Horvitz-Thompson), which keeps the update
    unbiased. Vectors (biases) always go whole.
    """
    up = plan.upload
    delta, design, keep, p_min = _upload_options(up)
    rng_q = np.random.default_rng([plan.seed, STREAM_ROUNDING])
    rows: dict[str, np.ndarray] = {}
    for k, w in new.items():
        code = value_format(up, w.ndim)
        if code not in VALUE_KINDS:
            raise PlanError(f"upload value format {code!r} is not one this device encodes")
        v = w.astype(np.float64) - plan.weights[k] if delta else w
        m = (masks or {}).get(k)
        rows[k] = np.asarray(v if m is None else v[m])
    sampled = [k for k, w in new.items() if design and keep < 1.0 and w.ndim >= 2 and len(rows[k])]
    probs: dict[str, np.ndarray] = {}
    if sampled:
        norms = [np.sqrt((rows[k].astype(np.float64) ** 2).reshape(len(rows[k]), -1).sum(1)) for k in sampled]
        nb = [value_nbytes(value_format(up, 2), (1, *new[k].shape[1:])) + PCODE_BYTES for k in sampled]
        dense = sum(value_nbytes(value_format(up, w.ndim), rows[k].shape) for k, w in new.items())
        whole = (sum(value_nbytes(value_format(up, w.ndim), rows[k].shape) for k, w in new.items() if k not in sampled)
                 + sum(mask_bytes_bound(len(rows[k])) for k in sampled))
        fit = row_keep(keep, dense, whole, sum(len(n) * b for n, b in zip(norms, nb)))
        probs = dict(zip(sampled, inclusion_probabilities(norms, nb, fit, p_min, design)))
    rng_s = np.random.default_rng([plan.seed, STREAM_SAMPLE])
    out = {}
    for k, w in new.items():
        code = value_format(up, w.ndim)
        m = (masks or {}).get(k)
        vals, kw = rows[k], {}
        if k in probs:
            s = systematic_sample(probs[k], rng_s)
            vals, kw = vals[s], {"sample": s, "pcodes": np.round(probs[k][s] * 255.0).astype(np.uint8)}
        if code in _PLAIN:  # a plain array (as before the codec): encoded when the report is
            if code == "f2":  # binary16 saturates at +-65504 (section 6), where a cast would give infinity
                vals = np.clip(vals, -_F16_MAX, _F16_MAX)
            out[k] = TensorUpdate(tuple(w.shape), np.asarray(vals, _PLAIN[code]), m, **kw)
        else:
            out[k] = TensorUpdate.encoded(tuple(w.shape), vals, m, code=code, rng=rng_q, **kw)
    return out


def prepare(plan: Plan, state: LocalState | None) -> Plan:
    """The plan with the weights the device trains from: a plan with a ``base`` adds its differences to the
    model the device holds (edge/protocol/downlink.py); a plan with a ``tag`` is kept as the held model."""
    if not plan.tag and not plan.base:
        return plan
    held = None
    if plan.base:
        got = downlink.held(state)
        if got is None or got[0] != plan.base:
            raise PlanError(f"the plan's weights are differences from model {plan.base!r}, which this device "
                            f"does not hold ({'none' if got is None else repr(got[0])})")
        held = got[1]
    weights = downlink.decode(plan.weights, held)
    if plan.tag and state is not None:
        downlink.store(state, plan.tag, weights)
    return dataclasses.replace(plan, weights=weights)


def run_plan(plan: Plan, trainer: Trainer, x: np.ndarray, y: np.ndarray, state: LocalState | None = None) -> Report:
    """Run ``plan`` on local data; ``state`` is the device's private store (stateful algorithms need it)."""
    cls = client_class(plan.strategy)
    hp = cls.Hparams.from_wire(plan.hparams)
    if cls.stateful and state is None:
        raise PlanError(f"strategy {plan.strategy!r} needs the device's local state")
    plan = prepare(plan, state)
    if needs_wrapping(trainer):  # a module's dropout masks and BatchNorm statistics (trainers/module_state.py)
        trainer = ModuleTrainer(trainer, np.random.default_rng([plan.seed, DROPOUT_STREAM]))
    elif padded.applies(trainer):  # a program that serves smaller networks: pads the plan's (trainers/padded.py)
        trainer = padded.PaddedTrainer(trainer, plan.weights)
    algo = cls(Context(plan, hp, trainer, x, y, state))
    algo.begin()
    losses = [algo.step(idx) for idx in batches(len(x), hp.batch_size, hp.epochs, plan.seed)]
    up = algo.end()
    if isinstance(trainer, ModuleTrainer):
        up.extras = {**up.extras, **trainer.running_stats()}
    metrics = {"train_loss": float(np.mean(losses)) if losses else 0.0, "steps": len(losses)} | up.metrics
    return Report(plan.task_id, plan.device_id, len(x), metrics, encode_update(up.weights, plan, up.masks), up.extras)
