"""FLoPS and FLoPS-PA, the server halves (paper 002; the readings are in docs/flops.md).

The state is the flat vector of gated parameters theta_hat, their log-alphas phi and the Lagrange multiplier
lambda. The server does lambda's step (the constraint c(phi) = mean_j P(z_j != 0) - rho depends on phi only):

    lambda <- max(0, lambda + lam_lr c(phi)), and lambda <- 0 whenever c(phi) <= 0      (dual restart)

at the phi it has just committed; the clients minimise their local Lagrangian at the lambda of the plan.

- **FLoPS-PA** (``flops-pa``, one exchange per round): the state is kept compressed from round 0 (theta_hat
  zero beyond the top-k log-alphas, those log-alphas replaced by their mean), so the plan is the message
  (edge/flops.py) and loses nothing; reports are messages too. The server rebuilds each report, takes the
  weighted mean of (theta_hat, phi), applies the exact-density step from ``prune_start`` on, compresses, and
  steps lambda.
- **FLoPS** (``flops``, one exchange per step, FedSGD-like): dense plans and reports; each client takes one
  step from the same (theta_hat, phi) at the plan's lambda, so the weighted mean is
  theta_hat - lr sum_k w_k g_theta^k and phi - la_lr (sum_k w_k g_phi^k + lambda grad c(phi)), the paper's
  server step. ``steps_per_epoch`` exchanges make an epoch; prune start counts epochs.

The global model is theta_hat * z_hat with the noise-free gates z_hat: exactly k = round(rho |theta|) non-zero
entries once the exact-density step has run (``metrics`` reports that density).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edge import flops as F
from edge import model as M
from edge.algorithms.flops import Hparams
from edge.protocol.wire import Report

from .base import DevicePlan, ReportRejected, ServerState, upload_spec

ZOO_SPECS = {"mlp": lambda: M.mlp([64, 200, 200, 10]), "cnn": lambda: M.lenet((1, 8, 8), 10)}


@dataclass
class Accumulator:
    """The round's weighted sums: theta, and FLoPS-PA's log-alphas (None for the dense baselines)."""
    theta: np.ndarray
    la: np.ndarray | None = None
    total: float = 0.0
    count: int = 0


@dataclass
class FLoPSPA:
    objective: ClassVar[str] = "flops"
    compressed: ClassVar[bool] = True

    spec: dict[str, Any] = field(default_factory=lambda: M.mlp([64, 200, 200, 10]))
    lr: float = field(default=0.05, metadata={"min": 0.0})  # theta_hat
    la_lr: float = field(default=0.5, metadata={"min": 0.0})  # log_alpha
    lam_lr: float = field(default=1.0, metadata={"min": 0.0})  # lambda (server, once per exchange)
    rho: float = field(default=0.1, metadata={"min": 1e-9, "max": 1.0})  # target density
    rho0: float = field(default=0.5, metadata={"min": 1e-6, "max": 1 - 1e-6})  # log_alpha ~ N(logit rho0, 0.01)
    prune_start: int = field(default=10, metadata={"min": 0})  # first round (FLoPS: epoch) of the exact-density step
    epochs: int = 1
    batch_size: int = 20
    loss: str = field(default="ce", metadata={"choices": ("ce", "mse", "bce")})
    bias: bool = True  # gate the biases too; False: a network without biases (the paper's linear models)
    weighting: str = field(default="samples", metadata={"choices": ("samples", "uniform")})
    model: str = field(default="", metadata={"choices": ("", "mlp", "cnn")})  # a zoo network instead of spec
    # theta_hat's initialisation: the zoo's (dense: uniform +-1/sqrt(fan_in)), or that times 1/sqrt(rho)
    # (sparse: only about rho of each fan-in survives the round-0 compression; docs/flops.md)
    theta_init: str = field(default="dense", metadata={"choices": ("dense", "sparse")})
    name: str = "flops-pa"

    def __post_init__(self) -> None:
        if self.loss not in ("ce", "mse", "bce"):
            raise ValueError(f"loss must be ce, mse or bce, not {self.loss!r}")
        if self.weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be samples or uniform, not {self.weighting!r}")
        if self.theta_init not in ("dense", "sparse"):
            raise ValueError(f"theta_init must be dense or sparse, not {self.theta_init!r}")
        if self.model:
            if self.model not in ZOO_SPECS:
                raise ValueError(f"model must be one of {sorted(ZOO_SPECS)}, not {self.model!r}")
            self.spec = ZOO_SPECS[self.model]()
        if self.spec.get("arch") not in ("mlp", "cnn"):  # a person's module: the gates are laid out per layer
            raise ValueError(f"{self.name} takes the zoo's MLP and CNN (model = mlp or cnn), not a "
                             f"{self.spec.get('arch', 'module')!r} model brought as a file")
        if not 0 < self.rho <= 1 or not 0 < self.rho0 < 1:
            raise ValueError("rho must be in (0, 1] and rho0 in (0, 1)")
        self.shapes = F.gated_shapes(self.spec, self.bias)
        self.n = F.size(self.shapes)
        self.k = F.n_keep(self.n, self.rho)
        self._cache: tuple | None = None

    # ---- state
    def layout(self) -> dict[str, Any]:
        return {"loss": self.loss, "bias": self.bias}

    def pruning(self, round_: int) -> bool:
        """Whether the exact-density step runs in round ``round_`` (1-based; 0 is the initial state)."""
        return round_ >= self.prune_start

    def shape(self, theta: np.ndarray, la: np.ndarray, round_: int) -> tuple[np.ndarray, np.ndarray]:
        """What the server keeps and sends: exact density from prune start on, then the top-k compression."""
        if self.pruning(round_):
            la = F.exact_density(la, self.k)
        return F.rebuild(F.compress(theta, la, self.k), self.n)

    def init(self, seed: int) -> ServerState:
        w = M.init_weights(self.spec, seed)
        theta = F.flatten(w, self.shapes) * np.float32(1.0 if self.theta_init == "dense" else 1 / np.sqrt(self.rho))
        la = F.init_log_alpha(self.n, self.rho0, np.random.default_rng([seed, 2]))
        theta, la = self.shape(theta, la, 0)
        return ServerState(0, {"theta": theta, "log_alpha": la}, {"lambda": np.zeros(1)})

    @staticmethod
    def lam(state: ServerState) -> float:
        return float(state.opt["lambda"][0])

    def hparams(self, state: ServerState) -> Hparams:
        return Hparams(lr=self.lr, epochs=self.epochs, batch_size=self.batch_size, la_lr=self.la_lr,
                       lam=self.lam(state), rho=self.rho, prune=self.pruning(state.round + 1), steps=0)

    # ---- plans
    def message(self, state: ServerState) -> F.Message:
        return F.compress(state.weights["theta"], state.weights["log_alpha"], self.k)

    def _plan(self, state: ServerState) -> DevicePlan:
        msg = self.message(state)
        return DevicePlan(msg.arrays(), self.hparams(state).to_wire(), upload_spec("f4"), self.spec,
                          objective=self.objective, layout=self.layout(), returns=(),
                          extras={"idx": (self.k,), "theta": (self.k,), "log_alpha": (self.k,), "log_alpha_rest": (1,)},
                          extra_dtypes={"idx": "i4"})

    def plan(self, state: ServerState, device_id: str, caps: dict[str, Any]) -> DevicePlan:
        if self._cache is None or self._cache[0] is not state:  # every device of a round gets the same plan
            self._cache = (state, self._plan(state))
        return self._cache[1]

    # ---- aggregation
    def begin(self, state: ServerState) -> Accumulator:
        return Accumulator(np.zeros(self.n), np.zeros(self.n))

    def received(self, plan: DevicePlan, report: Report) -> tuple[np.ndarray, np.ndarray]:
        """(theta_hat, log_alpha) a report carries, rebuilt; ReportRejected if it is not a valid message."""
        try:
            msg = F.Message.from_arrays(report.extras)
            F.check_message(msg, self.n, self.k)
        except (KeyError, ValueError) as e:
            raise ReportRejected(f"{self.name}: {e}") from None
        return F.rebuild(msg, self.n)

    def accumulate(self, state: ServerState, acc: Accumulator, plan: DevicePlan, report: Report) -> None:
        theta, la = self.received(plan, report)
        w = float(report.n_samples) if self.weighting == "samples" else 1.0
        acc.theta += w * theta
        acc.la += w * la
        acc.total += w
        acc.count += 1

    def finish(self, state: ServerState, acc: Accumulator) -> ServerState:
        r = state.round + 1
        theta, la = self.shape(acc.theta / acc.total, acc.la / acc.total, r)
        lam = F.dual_step(self.lam(state), F.constraint(la, self.rho), self.lam_lr)
        return ServerState(r, {"theta": theta, "log_alpha": la}, {"lambda": np.array([lam])}, state.meta)

    # ---- the model
    def pruned(self, state: ServerState) -> np.ndarray:
        """theta_hat * z_hat, flat: the test-time model."""
        return F.pruned(state.weights["theta"], state.weights["log_alpha"])

    def global_model(self, state: ServerState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        w = F.unflatten(self.pruned(state), self.shapes)
        for k, s in M.param_shapes(self.spec).items():  # a network without biases: zeros
            w.setdefault(k, np.zeros(s, np.float32))
        return self.spec, w

    def metrics(self, state: ServerState) -> dict[str, float]:
        la = state.weights["log_alpha"]
        return {"density": F.density(self.pruned(state)), "expected_density": F.expected_density(la),
                "lambda": self.lam(state)}


@dataclass
class FLoPS(FLoPSPA):
    """One exchange per step: dense (theta_hat, log_alpha) both ways; ``steps_per_epoch`` exchanges an epoch."""

    compressed: ClassVar[bool] = False
    steps_per_epoch: int = field(default=5, metadata={"min": 1})
    name: str = "flops"

    def pruning(self, round_: int) -> bool:
        """Exchange ``round_`` (1-based) belongs to epoch (round_ - 1) // steps_per_epoch + 1."""
        epoch = 0 if round_ == 0 else (round_ - 1) // self.steps_per_epoch + 1
        return epoch >= self.prune_start

    def shape(self, theta, la, round_):
        if self.pruning(round_):
            la = F.exact_density(la, self.k)
        return np.asarray(theta, np.float32), np.asarray(la, np.float32)

    def hparams(self, state: ServerState) -> Hparams:
        return Hparams(lr=self.lr, epochs=1, batch_size=self.batch_size, la_lr=self.la_lr, lam=self.lam(state),
                       rho=self.rho, prune=False, steps=1)

    def _plan(self, state: ServerState) -> DevicePlan:
        return DevicePlan({k: state.weights[k] for k in ("theta", "log_alpha")}, self.hparams(state).to_wire(),
                          upload_spec("f4"), self.spec, objective=self.objective, layout=self.layout())

    def received(self, plan: DevicePlan, report: Report) -> tuple[np.ndarray, np.ndarray]:
        try:
            theta, la = (report.tensors[k] for k in ("theta", "log_alpha"))
        except KeyError as e:
            raise ReportRejected(f"{self.name}: missing {e}") from None
        if not (theta.dense_rows and la.dense_rows and theta.shape == la.shape == (self.n,)):
            raise ReportRejected(f"{self.name}: expects dense theta and log_alpha of {self.n} entries")
        return theta.dense().astype(np.float64), la.dense().astype(np.float64)
