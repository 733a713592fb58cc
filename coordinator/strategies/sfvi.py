"""SFVI and SFVI-Avg(m), the server halves (paper 003, Algorithms 1 and 2; docs/sfvi.md).

The server holds theta and eta_G = (mu_G, log sigma_G, L_G) of q(Z_G) (edge/vi.py), in float64; plans carry
float32 copies, and everything the server computes about them is computed at those copies, the point the
devices compute at.

SFVI (Algorithm 1). Each round the server draws eps_G (edge/randn.py: the plan carries a seed, or eps_G itself
with ``eps_on_wire``), the devices return g_j^theta / N_j and g_j^eta / N_j (a ``"gradient"`` plan; per sample,
so the coordinator's norm bound, a median over the fleet, sees every silo on one scale and neither clips nor
refuses a large one: docs/sfvi.md, "Admission"), and the server steps

    g = (J / |S_t|) sum_{j in S_t} N_j (g_j / N_j)  +  grad L_0,   L_0 = log p_theta(Z_G) - log q(Z_G)   (S4, S7)

N_j is the count the device declared at check-in (``observe_fleet``; a report must carry it, and the round
machine's weight cap, which lowers a report's ``n_samples``, does not change it).

with its own optimiser (Adam ascent by default). The sum, not the mean: with every device in, g is the
full-data joint STL gradient, so the run does not depend on how the data are split (the paper's Remark); a
partial round scales the participants' sum by J / |S_t| (unbiased for uniform selection; not in the paper),
and a device that sits out keeps its factors. J is ``fleet_size``, else the fleet the coordinator knows
(``observe_fleet``), else the devices seen so far.

SFVI-Avg(m) (Algorithm 2). The devices run m local steps and return (theta^(j), eta_G^(j)); theta becomes
their unweighted mean and q(Z_G) the 2-Wasserstein barycenter of the N(mu_j, Sigma_j): mu* = mean mu_j and,
for a diagonal family, sigma* = mean sigma_j (closed form); for a full L_G, the fixed-point iteration of
Alvarez-Esteban et al. (2016). N (the fleet's sample count, for the devices' N / N_j) is ``total_samples``,
else the sum of the sample counts the coordinator knows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edge import model as M
from edge.algorithms.sfvi import EPS_G, AvgHparams, Hparams
from edge.optim import Adam, sgd
from edge.protocol.wire import Report
from edge.vi import build_model, from_gaussian, gaussian, global_shapes, global_term, init_global
from edge import randn

from .base import DevicePlan, ReportRejected, ServerState


def sqrtm_psd(S: np.ndarray) -> np.ndarray:
    """The symmetric square root of a symmetric positive semi-definite matrix."""
    w, V = np.linalg.eigh((S + S.T) / 2)
    return (V * np.sqrt(np.clip(w, 0, None))) @ V.T


def barycenter_cov(covs: list[np.ndarray], tol: float = 1e-12, max_iter: int = 500) -> tuple[np.ndarray, int]:
    """The 2-Wasserstein barycenter's covariance of N(., Sigma_j) with equal weights: the fixed point of
    S = mean_j (S^1/2 Sigma_j S^1/2)^1/2, by Alvarez-Esteban et al. (2016)'s iteration
    S <- S^-1/2 (mean_j (S^1/2 Sigma_j S^1/2)^1/2)^2 S^-1/2, from the mean covariance. Returns (S, iterations)."""
    S = np.mean(covs, axis=0)
    for it in range(1, max_iter + 1):
        r = sqrtm_psd(S)
        ri = np.linalg.inv(r)
        T = np.mean([sqrtm_psd(r @ C @ r) for C in covs], axis=0)
        new = ri @ T @ T @ ri
        new = (new + new.T) / 2
        if np.abs(new - S).max() <= tol * max(1.0, np.abs(S).max()):
            return new, it
        S = new
    return S, max_iter


@dataclass
class Accumulator:
    sums: dict[str, np.ndarray]
    count: int = 0
    elbo: float = 0.0
    n: dict[str, int] = field(default_factory=dict)
    kept: list[dict[str, np.ndarray]] = field(default_factory=list)  # SFVI-Avg: each device's eta_G


@dataclass
class SFVI:
    objective: ClassVar[str] = "sfvi"

    spec: dict[str, Any] = field(default_factory=lambda: M.mlp([64, 200, 200, 10]))
    layout: dict[str, Any] = field(default_factory=dict)  # the family and the BNN's options (edge/vi.py)
    lr: float = 1e-2  # the devices' optimiser of eta_Lj
    server_lr: float | None = None  # default: lr (one Adam over every parameter, as centralised SVI)
    server_opt: str = field(default="adam", metadata={"choices": ("adam", "sgd")})
    local_opt: str = field(default="adam", metadata={"choices": ("adam", "sgd")})
    epochs: int = 1
    batch_size: int = 1 << 20  # bounds a device's memory only: its term is summed over all its batches
    eps_on_wire: bool = False  # send eps_G itself instead of its seed
    fleet_size: int | None = None  # J; default: the fleet the coordinator knows
    name: str = "sfvi"

    def __post_init__(self) -> None:
        if self.server_opt not in ("adam", "sgd") or self.local_opt not in ("adam", "sgd"):
            raise ValueError("server_opt and local_opt must be adam or sgd")
        self.model, self.fam = build_model(self.spec, self.layout)
        self.shapes = global_shapes(self.model, self.fam)
        self._fleet: dict[str, int] = {}
        self._cache: tuple | None = None

    @property
    def layout_full(self) -> dict[str, Any]:
        """The program's layout: the family spelled out, so equal families name one program."""
        return dict(self.layout) | {"family": self.fam.to_layout()}

    # ---------------------------------------------------------------- state
    def init(self, seed: int) -> ServerState:
        return ServerState(0, init_global(self.model, self.fam, seed), {}, {"seed": int(seed), "seen": {}})

    def observe_fleet(self, devices: dict[str, int]) -> None:
        self._fleet = dict(devices)

    def hparams(self, state: ServerState) -> Hparams:
        return Hparams(lr=self.lr, epochs=self.epochs, batch_size=self.batch_size, opt=self.local_opt,
                       eps_seed=int(state.meta.get("seed", 0)), eps_stream=state.round + 1)

    def eps(self, state: ServerState) -> np.ndarray:
        """eps_G of the round after ``state``."""
        h = self.hparams(state)
        return randn.normal(h.eps_seed, h.eps_stream, self.model.n_G)

    def sent(self, state: ServerState) -> dict[str, np.ndarray]:
        """theta and eta_G as the plans carry them (float32)."""
        return {k: np.asarray(v, np.float32) for k, v in state.weights.items()}

    def plan(self, state: ServerState, device_id: str, caps: dict[str, Any]) -> DevicePlan:
        if self._cache is None or self._cache[0] is not state:
            w = self.sent(state)
            if self.eps_on_wire:
                w[EPS_G] = self.eps(state)
            dp = DevicePlan(w, self.hparams(state).to_wire(), {"dtype": "f4"}, self.spec, objective=self.objective,
                            layout=self.layout_full, returns=tuple(self.shapes), update=self.update_kind)
            self._cache = (state, dp)
        return self._cache[1]

    update_kind: ClassVar[str] = "gradient"

    # ---------------------------------------------------------------- aggregation
    def begin(self, state: ServerState) -> Accumulator:
        return Accumulator({k: np.zeros(s, np.float64) for k, s in self.shapes.items()})

    def check(self, plan: DevicePlan, report: Report) -> None:
        if set(report.tensors) != set(self.shapes):
            raise ReportRejected(f"tensors {sorted(report.tensors)[:4]} are not theta and eta_G")
        for k, t in report.tensors.items():
            if t.shape != self.shapes[k] or not t.dense_rows:
                raise ReportRejected(f"{k}: expected a dense {self.shapes[k]}")

    def silo_size(self, report: Report) -> int:
        """N_j: the sample count the device declared (the registry's), else the report's."""
        return int(self._fleet.get(report.device_id) or report.n_samples)

    def accumulate(self, state: ServerState, acc: Accumulator, plan: DevicePlan, report: Report) -> None:
        self.check(plan, report)
        n = float(self.silo_size(report))
        for k, t in report.tensors.items():
            acc.sums[k] += n * t.dense().astype(np.float64)  # the device sent g_j / N_j
        acc.count += 1
        acc.elbo += float(report.metrics.get("elbo", 0.0))
        acc.n[report.device_id] = int(report.n_samples)

    def fleet_size_now(self, state: ServerState, acc: Accumulator) -> int:
        if self.fleet_size:
            return int(self.fleet_size)
        known = set(self._fleet) | set(state.meta.get("seen", {})) | set(acc.n)
        return max(len(known), acc.count)

    def gradient(self, state: ServerState, acc: Accumulator) -> tuple[dict[str, np.ndarray], float, int]:
        """The round's full gradient of the ELBO in (theta, eta_G), its ELBO estimate, and J."""
        J = self.fleet_size_now(state, acc)
        scale = J / acc.count
        at = {k: v.astype(np.float64) for k, v in self.sent(state).items()}
        l0, g0 = global_term(self.model, at, self.eps(state))
        g = {k: scale * acc.sums[k] + g0[k] for k in self.shapes}
        return g, scale * acc.elbo + l0, J

    def finish(self, state: ServerState, acc: Accumulator) -> ServerState:
        meta = dict(state.meta)
        meta["seen"] = dict(meta.get("seen", {})) | acc.n
        new = {k: v.astype(np.float64).copy() for k, v in state.weights.items()}
        opt = dict(state.opt)
        if acc.count:
            g, elbo, J = self.gradient(state, acc)
            self._step(new, opt, g)
            meta |= {"elbo": elbo, "J": J, "participants": acc.count}
        return ServerState(state.round + 1, new, opt, meta)

    def _step(self, params: dict[str, np.ndarray], opt: dict[str, np.ndarray], g: dict[str, np.ndarray]) -> None:
        lr = self.lr if self.server_lr is None else self.server_lr
        if self.server_opt == "adam":
            adam = Adam(lr=lr, maximize=True)
            adam.load(opt, "adam/")
            adam.step(params, g)
            opt |= adam.state("adam/")
        else:
            sgd(params, {k: -v for k, v in g.items()}, lr)

    # ---------------------------------------------------------------- reporting
    def global_model(self, state: ServerState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The BNN's population network (eps = 0 at q's means; a local head is zero: it lives on the devices),
        or, for other models, q(Z_G)'s mean by name."""
        mu = np.asarray(state.weights["qG.mu"], np.float64)
        if hasattr(self.model, "weights"):
            return self.spec, self.model.weights(mu)
        return self.spec, {k: v.astype(np.float32) for k, v in self.model.global_summary(mu).items()}

    def metrics(self, state: ServerState) -> dict[str, float]:
        return {k: float(state.meta[k]) for k in ("elbo", "J", "participants") if k in state.meta}


@dataclass
class SFVIAvg(SFVI):
    """SFVI-Avg(m): m = epochs x batches local steps per round (full-batch steps by default)."""

    total_samples: int | None = None  # N; default: the sample counts the coordinator knows
    barycenter_tol: float = 1e-12
    name: str = "sfvi_avg"
    update_kind: ClassVar[str] = "weights"

    def hparams(self, state: ServerState) -> AvgHparams:
        return AvgHparams(lr=self.lr, epochs=self.epochs, batch_size=self.batch_size, opt=self.local_opt,
                          N=self.total(state))

    def total(self, state: ServerState) -> int:
        if self.total_samples:
            return int(self.total_samples)
        known = dict(state.meta.get("seen", {})) | self._fleet
        return int(sum(known.values()))

    def accumulate(self, state: ServerState, acc: Accumulator, plan: DevicePlan, report: Report) -> None:
        self.check(plan, report)
        vals = {k: t.dense().astype(np.float64) for k, t in report.tensors.items()}
        if not np.all(np.isfinite(vals["qG.s"])):
            raise ReportRejected("qG.s is not finite")
        for k, v in vals.items():
            if not k.startswith("qG."):
                acc.sums[k] += v  # theta: a running sum for the mean
        acc.kept.append({k: v for k, v in vals.items() if k.startswith("qG.")})
        acc.count += 1
        acc.n[report.device_id] = int(report.n_samples)

    def barycenter(self, etas: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], int]:
        """eta_G of the Wasserstein barycenter of the q(Z_G) in ``etas`` (equal weights), and the iterations
        the full-covariance case took (0: closed form)."""
        mu = np.mean([e["qG.mu"] for e in etas], axis=0)
        if not self.fam.G_full:
            sig = np.mean([np.exp(e["qG.s"]) for e in etas], axis=0)
            return {"qG.mu": mu, "qG.s": np.log(sig)}, 0
        covs = [gaussian(e)[1] for e in etas]
        S, it = barycenter_cov(covs, self.barycenter_tol)
        return from_gaussian(mu, S, True), it

    def finish(self, state: ServerState, acc: Accumulator) -> ServerState:
        meta = dict(state.meta)
        meta["seen"] = dict(meta.get("seen", {})) | acc.n
        new = {k: v.astype(np.float64).copy() for k, v in state.weights.items()}
        if acc.count:
            eta, it = self.barycenter(acc.kept)
            new |= eta
            for k in self.shapes:
                if not k.startswith("qG."):
                    new[k] = acc.sums[k] / acc.count
            meta |= {"participants": acc.count, "barycenter_iterations": it}
        return ServerState(state.round + 1, new, dict(state.opt), meta)

    def metrics(self, state: ServerState) -> dict[str, float]:
        return {k: float(state.meta[k]) for k in ("participants", "barycenter_iterations") if k in state.meta}
