"""FedAvg (McMahan et al. 2017), read as hard-EM (paper 000, section 2): the M-step (Eq. 10-11) is the
sample-weighted mean of the clients' weights. With ``server_lr != 1`` the mean difference is applied as a
pseudo-gradient step, the "difference as gradient" view of paper 000 App. F."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge import model as M
from edge.wire import Report

from .base import DevicePlan, ReportRejected, ServerState


@dataclass
class Accumulator:
    sums: dict[str, np.ndarray]
    total_n: float = 0.0
    count: int = 0


@dataclass
class FedAvg:
    spec: dict[str, Any] = field(default_factory=lambda: M.mlp([64, 200, 200, 10]))
    lr: float = 0.05
    epochs: int = 1
    batch_size: int = 20
    server_lr: float = 1.0
    upload_dtype: str = "f4"
    name: str = "fedavg"

    def init(self, seed: int) -> ServerState:
        return ServerState(0, M.init_weights(self.spec, seed))

    def plan(self, state: ServerState, device_id: str, caps: dict[str, Any]) -> DevicePlan:
        return DevicePlan(state.weights, {"lr": self.lr, "epochs": self.epochs, "batch_size": self.batch_size},
                          {"dtype": self.upload_dtype}, self.spec)

    def begin(self, state: ServerState) -> Accumulator:
        return Accumulator({k: np.zeros(v.shape, np.float64) for k, v in state.weights.items()})

    def accumulate(self, state: ServerState, acc: Accumulator, plan: DevicePlan, report: Report) -> None:
        if set(report.tensors) != set(plan.weights):
            raise ReportRejected(f"tensors {sorted(report.tensors)[:4]}... do not match the plan")
        dense = {}
        for k, t in report.tensors.items():
            if t.mask is not None and not t.mask.all():
                raise ReportRejected(f"{k}: FedAvg expects a dense update")
            if t.shape != plan.weights[k].shape:
                raise ReportRejected(f"{k}: shape {t.shape}, plan sent {plan.weights[k].shape}")
            dense[k] = t.dense()
        n = float(report.n_samples)
        for k, v in dense.items():
            acc.sums[k] += n * v  # float64 accumulator: summation order does not matter to 1e-12
        acc.total_n += n
        acc.count += 1

    def finish(self, state: ServerState, acc: Accumulator) -> ServerState:
        new = {}
        for k, w in state.weights.items():
            mean = acc.sums[k] / acc.total_n
            new[k] = (w + self.server_lr * (mean - w)).astype(np.float32)
        return ServerState(state.round + 1, new, state.opt, state.meta)

    def global_model(self, state: ServerState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return self.spec, state.weights
