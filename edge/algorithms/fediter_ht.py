"""The clients of FLoPS's baselines, on the plain network (objective ``flops_dense``), and FedIter-HT's
per-tensor hard thresholding (shared with the server half, coordinator/strategies/fediter_ht.py):

- **FedIter-HT** (Tong et al. 2022, as paper 002 runs it): local SGD with the hard-thresholding operator H_k
  after every local step. Tong et al. (and paper 002's synthetic problems) threshold one parameter vector; on a
  network fedge thresholds **per tensor** (docs/flops.md, "The baselines"): each weight tensor keeps its own
  count of its largest |theta|, one-dimensional tensors (biases, norm scales) are kept whole. The plan and the
  report are top-k messages: the indices (int32, ascending) and the values there. The plan's indices fix the
  counts: the client keeps, in each tensor, as many entries as the plan has there.
- **FedAvg + final magnitude prune** (``fedavg-prune``): plain local SGD on a dense plan, dense report; the
  server prunes the global model once, at the end (coordinator/strategies/fediter_ht.py).
"""
from __future__ import annotations

import math

import numpy as np

from .. import flops as F
from ..optim import sgd
from .base import ClientAlgorithm, PlanError, Update
from .flops import model_shapes

Shapes = dict[str, tuple[int, ...]]


def spans(shapes: Shapes) -> list[tuple[int, int]]:
    """Each tensor's [start, end) in the flat vector (``edge.flops.flatten``'s order)."""
    out, i = [], 0
    for s in shapes.values():
        out.append((i, i + math.prod(s)))
        i += math.prod(s)
    return out


def keep_counts(shapes: Shapes, k: int) -> np.ndarray:
    """How many entries each tensor keeps when k are kept in all. Tensors of one dimension or none (biases,
    norm scales) keep all theirs, and count against k. The other k_w = k - (their size) are the weight
    tensors': one each, then the remaining k_w - L in proportion to (size - 1) by largest remainder (ties to
    the earlier tensor), so every weight tensor keeps at least one entry and the counts add up to k exactly.
    A ValueError when k cannot give every weight tensor one entry."""
    sizes = np.array([math.prod(s) for s in shapes.values()], np.int64)
    dense = np.array([len(s) <= 1 for s in shapes.values()])
    counts = np.where(dense, sizes, 0)
    weights = np.flatnonzero(~dense)
    if len(weights) == 0:
        raise ValueError("FedIter-HT: the model has no weight tensor (of two or more dimensions) to threshold")
    rest = k - int(sizes[dense].sum()) - len(weights)
    if rest < 0:
        raise ValueError(f"FedIter-HT: k = {k} cannot keep the {int(sizes[dense].sum())} bias entries and one "
                         f"entry in each of the {len(weights)} weight tensors; raise rho")
    m = sizes[weights] - 1
    total = int(m.sum())
    if rest > total:
        raise ValueError(f"FedIter-HT: k = {k} is more than the model's {int(sizes.sum())} parameters")
    share = (rest * m) // total if total else np.zeros(len(weights), np.int64)
    frac = (rest * m) % total if total else np.zeros(len(weights), np.int64)
    extra = np.argsort(-frac, kind="stable")[:rest - int(share.sum())]
    share[extra] += 1
    counts[weights] = 1 + share
    return counts


def support(theta: np.ndarray, shapes: Shapes, counts: np.ndarray) -> np.ndarray:
    """The kept indices: in each tensor, its count of largest |theta| (ties to the lower index); int32,
    ascending."""
    parts = [a + F.top_k(np.abs(theta[a:b]), int(c)) for (a, b), c in zip(spans(shapes), counts)]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def threshold(theta: np.ndarray, shapes: Shapes, counts: np.ndarray) -> np.ndarray:
    """Per-tensor H_k: theta on ``support``, zero elsewhere."""
    theta = np.asarray(theta, np.float32)
    out = np.zeros_like(theta)
    idx = support(theta, shapes, counts)
    out[idx] = theta[idx]
    return out


def counts_of(idx: np.ndarray, shapes: Shapes) -> np.ndarray:
    """How many of the (ascending) indices fall in each tensor."""
    edges = [b for _, b in spans(shapes)]
    return np.diff(np.searchsorted(idx, [0] + edges, side="left")).astype(np.int64)


class FedIterHTClient(ClientAlgorithm):
    name = "fediter-ht"

    def begin(self) -> None:
        w = self.ctx.plan.weights
        self.shapes = model_shapes(self.ctx.trainer, gated=False)
        n = F.size(self.shapes)
        try:
            if "idx" in w:
                idx, vals = np.asarray(w["idx"]), np.asarray(w["theta"], np.float32)
                F.check_message(F.Message(idx, vals, vals, np.zeros(1, np.float32)), n)
                theta = np.zeros(n, np.float32)
                theta[idx] = vals
                self.counts = counts_of(idx, self.shapes)
            else:
                theta = np.array(w["theta"], np.float32).reshape(-1)
                if theta.shape != (n,):
                    raise ValueError(f"dense theta must have {n} entries")
                self.counts = None
        except (KeyError, ValueError) as e:
            raise PlanError(f"{self.ctx.plan.strategy} plan: {e}") from None
        self.params = F.unflatten(theta, self.shapes)

    def step(self, idx: np.ndarray) -> float:
        t = self.ctx.trainer
        t.set_weights(self.params)
        loss, g, _ = t.loss_and_grads({"x": self.ctx.x[idx], "y": self.ctx.y[idx]})
        sgd(self.params, g, self.hp.lr)
        if self.counts is not None:
            flat = threshold(F.flatten(self.params, self.shapes), self.shapes, self.counts)
            self.params = F.unflatten(flat, self.shapes)
        return float(loss)

    def end(self) -> Update:
        theta = F.flatten(self.params, self.shapes)
        if self.counts is None:
            return Update({"theta": theta})
        idx = support(theta, self.shapes, self.counts)
        return Update({}, extras={"idx": idx, "theta": theta[idx]})


class FedAvgPruneClient(FedIterHTClient):
    name = "fedavg-prune"
