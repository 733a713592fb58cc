"""FLoPS's baselines, the server halves, on the plain network (objective ``flops_dense``):

- **FedIter-HT** (``fediter-ht``; Tong et al. 2022, "Federated nonconvex sparse learning"): the weighted mean
  of the clients' models, then the hard-thresholding operator H_k, per tensor: k = round(rho |theta|) entries
  are kept in all, biases whole and the rest shared among the weight tensors in proportion to their sizes,
  each keeping its largest |theta| (edge/algorithms/fediter_ht.py: ``keep_counts``, ``threshold``; one global
  H_k over a network keeps the largest layer's weights only, docs/flops.md). Clients also threshold after
  every local step. Since the model is k-sparse both ways, plans and reports are top-k messages: int32
  indices and the values there, as many in each tensor as its count.
- **FedAvg + final magnitude prune** (``fedavg-prune``): dense FedAvg; the global model is H_k of the averaged
  weights (paper 002's "FedAvg": dense training and magnitude pruning in the last epoch).

The options mirror FLoPS-PA's (coordinator/strategies/flops.py), so a benchmark gives every method the same
model, loss, data and budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edge import flops as F
from edge import model as M
from edge.algorithms import fediter_ht as HT
from edge.algorithms.base import Hparams
from edge.protocol.wire import Report

from .base import DevicePlan, ReportRejected, ServerState, upload_spec
from .flops import ZOO_SPECS, Accumulator


@dataclass
class FedIterHT:
    objective: ClassVar[str] = "flops_dense"

    spec: dict[str, Any] = field(default_factory=lambda: M.mlp([64, 200, 200, 10]))
    lr: float = field(default=0.05, metadata={"min": 0.0})
    rho: float = field(default=0.1, metadata={"min": 1e-9, "max": 1.0})
    epochs: int = 1
    batch_size: int = 20
    loss: str = field(default="ce", metadata={"choices": ("ce", "mse", "bce")})
    bias: bool = True
    weighting: str = field(default="samples", metadata={"choices": ("samples", "uniform")})
    model: str = field(default="", metadata={"choices": ("", "mlp", "cnn")})
    theta_init: str = field(default="dense", metadata={"choices": ("dense", "sparse")})  # as FLoPS-PA's
    name: str = "fediter-ht"
    per_tensor: ClassVar[bool] = True  # H_k per tensor (FedIter-HT) or over the flat vector (FedAvg + prune)

    def __post_init__(self) -> None:
        if (self.loss not in ("ce", "mse", "bce") or self.weighting not in ("samples", "uniform")
                or self.theta_init not in ("dense", "sparse")):
            raise ValueError(f"bad loss {self.loss!r}, weighting {self.weighting!r} or theta_init {self.theta_init!r}")
        if self.model:
            if self.model not in ZOO_SPECS:
                raise ValueError(f"model must be one of {sorted(ZOO_SPECS)}, not {self.model!r}")
            self.spec = ZOO_SPECS[self.model]()
        if self.spec.get("arch") not in ("mlp", "cnn"):  # a person's module: the gates are laid out per layer
            raise ValueError(f"{self.name} takes the zoo's MLP and CNN (model = mlp or cnn), not a "
                             f"{self.spec.get('arch', 'module')!r} model brought as a file")
        self.shapes = F.gated_shapes(self.spec, self.bias)
        self.n = F.size(self.shapes)
        self.k = F.n_keep(self.n, self.rho)
        self.counts = HT.keep_counts(self.shapes, self.k) if self.per_tensor else None
        self._cache: tuple | None = None

    def layout(self) -> dict[str, Any]:
        return {"loss": self.loss, "bias": self.bias}

    def threshold(self, theta: np.ndarray) -> np.ndarray:
        """H_k per tensor (``self.counts``), or over the whole vector when ``per_tensor`` is off."""
        if self.counts is None:
            return F.hard_threshold(np.asarray(theta, np.float32), self.k)
        return HT.threshold(theta, self.shapes, self.counts)

    def initial(self, seed: int) -> np.ndarray:
        theta = F.flatten(M.init_weights(self.spec, seed), self.shapes)
        return theta * np.float32(1.0 if self.theta_init == "dense" else 1 / np.sqrt(self.rho))

    def init(self, seed: int) -> ServerState:
        return ServerState(0, {"theta": self.threshold(self.initial(seed))})

    def hparams(self, state: ServerState) -> Hparams:
        return Hparams(lr=self.lr, epochs=self.epochs, batch_size=self.batch_size)

    def _plan(self, state: ServerState) -> DevicePlan:
        theta = state.weights["theta"]
        idx = HT.support(theta, self.shapes, self.counts)
        return DevicePlan({"idx": idx, "theta": theta[idx]}, self.hparams(state).to_wire(), upload_spec("f4"),
                          self.spec, objective=self.objective, layout=self.layout(), returns=(),
                          extras={"idx": (self.k,), "theta": (self.k,)}, extra_dtypes={"idx": "i4"})

    def plan(self, state: ServerState, device_id: str, caps: dict[str, Any]) -> DevicePlan:
        if self._cache is None or self._cache[0] is not state:
            self._cache = (state, self._plan(state))
        return self._cache[1]

    def begin(self, state: ServerState) -> Accumulator:
        return Accumulator(np.zeros(self.n))

    def received(self, report: Report) -> np.ndarray:
        try:
            idx, vals = report.extras["idx"], report.extras["theta"]
            F.check_message(F.Message(idx, vals, vals, np.zeros(1, np.float32)), self.n, self.k)
            if not np.array_equal(HT.counts_of(idx, self.shapes), self.counts):
                raise ValueError("its indices are not the plan's count in each tensor")
        except (KeyError, ValueError) as e:
            raise ReportRejected(f"{self.name}: {e}") from None
        theta = np.zeros(self.n)
        theta[idx] = vals
        return theta

    def accumulate(self, state: ServerState, acc: Accumulator, plan: DevicePlan, report: Report) -> None:
        w = float(report.n_samples) if self.weighting == "samples" else 1.0
        acc.theta += w * self.received(report)
        acc.total += w
        acc.count += 1

    def finish(self, state: ServerState, acc: Accumulator) -> ServerState:
        return ServerState(state.round + 1, {"theta": self.threshold(acc.theta / acc.total)}, {}, state.meta)

    def pruned(self, state: ServerState) -> np.ndarray:
        return self.threshold(state.weights["theta"])

    def global_model(self, state: ServerState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        w = F.unflatten(self.pruned(state), self.shapes)
        for k, s in M.param_shapes(self.spec).items():
            w.setdefault(k, np.zeros(s, np.float32))
        return self.spec, w

    def metrics(self, state: ServerState) -> dict[str, float]:
        return {"density": F.density(self.pruned(state))}


@dataclass
class FedAvgPrune(FedIterHT):
    """Dense FedAvg; the global model is the magnitude-pruned average (the k largest |theta| of the whole
    vector: trained dense, the layers' scales are the data's, and this prune was measured as it is)."""

    name: str = "fedavg-prune"
    per_tensor: ClassVar[bool] = False

    def init(self, seed: int) -> ServerState:
        return ServerState(0, {"theta": F.flatten(M.init_weights(self.spec, seed), self.shapes)})

    def _plan(self, state: ServerState) -> DevicePlan:
        return DevicePlan({"theta": state.weights["theta"]}, self.hparams(state).to_wire(), upload_spec("f4"),
                          self.spec, objective=self.objective, layout=self.layout())

    def received(self, report: Report) -> np.ndarray:
        t = report.tensors.get("theta")
        if t is None or not t.dense_rows or t.shape != (self.n,):
            raise ReportRejected(f"{self.name}: expects a dense theta of {self.n} entries")
        return t.dense().astype(np.float64)

    def finish(self, state: ServerState, acc: Accumulator) -> ServerState:
        return ServerState(state.round + 1, {"theta": (acc.theta / acc.total).astype(np.float32)}, {}, state.meta)
