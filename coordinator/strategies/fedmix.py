"""FedMix, the server half (paper 004, Alg. 1 and Alg. 2; App. B clustering variant).

K experts of one MLP architecture (tensors ``e{k}.fc{i}.*``) and, for the label variant, phi, the C x K
logits of q_phi(z|y) (zeros: uniform, Alg. 1 line 1). Each device's gate stays on the device
(edge/algorithms/fedmix.py); the server keeps per device only the last q'(z|s) it reported, in ``meta["qzs"]``
(JSON, so it survives a restart), which decides the experts it is sent (Alg. 2: q >= 0.9 eta / K; a device
seen for the first time gets all K).

Server step (Alg. 1 lines 6-9), with Delta = old - new:

    p(s|z=k)   = q(z=k|s) N_s / sum_{s' in round} q(z=k|s') N_s'                     (Eq. 8)
    Delta_wk   = sum_s p(s|z=k) (w_k - w_sk)      skipped when no device used expert k
    Delta_phi  = sum_s N_s/N (phi - phi_s) - lambda grad_phi H(sum_c p(y=c) q_phi(z|y=c))   (line 8)
    w, phi    <- Adam descent on Delta (or w - server_lr * Delta with server_opt="sgd")

Choices where the paper is silent are in docs/fedmix.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge import model as M
from edge.algorithms.fedmix import Hparams, expert_ids, expert_of, softmax
from edge.algorithms.fedmix import layout as mixture_layout
from edge.optim import Adam
from edge.protocol.wire import Report

from .. import buckets
from .base import DevicePlan, ReportRejected, ServerState, received_weights, upload_spec

PRESETS: dict[str, dict[str, Any]] = {
    # As published: server Adam "default hyperparameters" (lr 1e-3), no pruning delay, Eq. 13 with the gate.
    "paper": {"server_lr": 1e-3, "prune_after": 0, "eq13_gate": True, "restart": False},
    # Measured on digits (docs/fedmix.md): a larger server lr breaks the symmetry between experts sooner.
    "tuned": {"server_lr": 5e-3, "prune_after": 0, "eq13_gate": True, "restart": False},
    # tuned + the remedy against a wrong partition in the clustering variant (docs/fedmix.md).
    "remedy": {"server_lr": 5e-3, "prune_after": 0, "eq13_gate": True, "restart": True},
}


def entropy_grad(phi: np.ndarray, py: np.ndarray) -> tuple[float, np.ndarray]:
    """H(m) and dH/dphi for m = sum_c p(y=c) softmax(phi_c) (Alg. 1 line 8's marginal entropy).

    dH/dphi_cj = -p_c q_cj (log m_j - sum_k q_ck log m_k)."""
    q = softmax(phi.astype(np.float64), 1)
    m = py @ q
    logm = np.log(np.maximum(m, 1e-300))
    h = float(-(m * logm).sum())
    g = -py[:, None] * q * (logm[None, :] - (q * logm[None, :]).sum(1, keepdims=True))
    return h, g


@dataclass
class Accumulator:
    num: dict[str, np.ndarray]  # sum_s q_ks N_s w_sk per tensor
    den: np.ndarray  # sum_s q_ks N_s per expert
    phi: np.ndarray | None
    total_n: float = 0.0
    q: dict[str, list[float]] = field(default_factory=dict)
    loss: dict[str, float] = field(default_factory=dict)


@dataclass
class FedMix:
    spec: dict[str, Any] = field(default_factory=lambda: M.mlp([64, 200, 200, 10]))
    K: int = 4
    variant: str = "label"  # label: q_phi(z|y) (Alg. 1) | cluster: q_pi(z|s) (App. B)
    lr: float = 0.05
    gate_lr: float | None = None  # default: the client lr (Alg. 1 uses one alpha)
    epochs: int = 1
    batch_size: int = 20
    server_opt: str = "adam"
    preset: str = "paper"
    server_lr: float | None = None
    eta: float = 0.0  # Alg. 2 pruning threshold; 0 = Alg. 1 (no pruning)
    prune_after: int | None = None  # remedy: send eta = 0 until this many rounds have committed
    entropy_weight: float = 0.1  # lambda of the marginal-entropy regulariser (label variant)
    damping: float = 0.75  # App. B
    eq13_gate: bool | None = None
    restart: bool | None = None
    restart_every: int = 5
    upload_dtype: str = "f4"
    name: str = "fedmix"

    def __post_init__(self) -> None:
        if self.variant not in ("label", "cluster"):
            raise ValueError(f"variant must be label or cluster, not {self.variant!r}")
        if self.server_opt not in ("sgd", "adam"):
            raise ValueError(f"server_opt must be sgd or adam, not {self.server_opt!r}")
        p = PRESETS[self.preset]
        for k in ("server_lr", "prune_after", "eq13_gate", "restart"):
            if getattr(self, k) is None:
                setattr(self, k, p[k])
        self.C = M.num_classes(self.spec)
        self.names = list(M.param_shapes(self.spec))
        self._cache: dict = {}
        self._cache_state: ServerState | None = None

    def _cached(self, state: ServerState) -> dict:
        """Per-state memo of plans and slices. It holds the state object itself and starts afresh for another
        one, so a discarded candidate state can never alias a later one."""
        if self._cache_state is not state:
            self._cache, self._cache_state = {}, state
        return self._cache

    def extras_shapes(self) -> dict[str, tuple[int, ...]]:
        """What a report carries besides experts: q(z|s), and phi for the label variant."""
        out = {"qzs": (self.K,)}
        if self.variant == "label":
            out["phi"] = (self.C, self.K)
        return out

    # ---------------------------------------------------------------- state
    def init(self, seed: int) -> ServerState:
        w = {}
        for k in range(self.K):
            # expert 0 is drawn exactly as FedAvg's model, so K = 1 is FedAvg from the same seed
            for n, v in M.init_weights(self.spec, seed if k == 0 else [seed, k]).items():
                w[f"e{k}.{n}"] = v
        if self.variant == "label":
            w["phi"] = np.zeros((self.C, self.K), np.float32)
        return ServerState(0, w, {}, {"qzs": {}, "restarts": []})

    def experts_for(self, state: ServerState, device_id: str) -> list[int]:
        """Alg. 2: experts with stored q(z=k|s) >= 0.9 eta/K (the 0.9 is the paper's hysteresis)."""
        q = state.meta.get("qzs", {}).get(device_id)
        if q is None or device_id in state.meta.get("reset", {}):  # new, or restarted by the remedy: all K
            return list(range(self.K))
        eta = self._eta(state)
        keep = [k for k in range(self.K) if q[k] >= 0.9 * eta / self.K]
        return keep or [int(np.argmax(q))]

    def _eta(self, state: ServerState) -> float:
        return self.eta if state.round >= self.prune_after else 0.0

    def hparams(self, state: ServerState) -> Hparams:
        return Hparams(lr=self.lr, gate_lr=self.gate_lr if self.gate_lr is not None else self.lr,
                       epochs=self.epochs, batch_size=self.batch_size, K=self.K, eta=self._eta(state),
                       variant=self.variant, damping=self.damping, eq13_gate=bool(self.eq13_gate))

    def plan(self, state: ServerState, device_id: str, caps: dict[str, Any]) -> DevicePlan:
        ks = tuple(self.experts_for(state, device_id))
        reset = state.meta.get("reset", {}).get(device_id)
        key = (ks, None if reset is None else tuple(reset))
        cache = self._cached(state)
        if key not in cache:
            w = {f"e{k}.{n}": state.weights[f"e{k}.{n}"] for k in ks for n in self.names}
            if self.variant == "label":
                w["phi"] = state.weights["phi"]
            if reset is not None:
                w["pi_init"] = np.asarray(reset, np.float64)
            cache[key] = DevicePlan(w, self.hparams(state).to_wire(), upload_spec(self.upload_dtype), self.spec,
                                    objective="mixture", layout=mixture_layout(w, self.variant, False, self.spec),
                                    returns=tuple(n for n in w if expert_of(n) is not None),
                                    extras=self.extras_shapes())
            cache[key].padded = buckets.mixture(self.spec, cache[key].layout, self.K)  # issue #26
        return cache[key]

    # ---------------------------------------------------------------- aggregation
    def begin(self, state: ServerState) -> Accumulator:
        num = {k: np.zeros(v.shape, np.float64) for k, v in state.weights.items() if k.startswith("e")}
        phi = np.zeros((self.C, self.K)) if self.variant == "label" else None
        return Accumulator(num, np.zeros(self.K), phi)

    def check(self, plan: DevicePlan, report: Report) -> tuple[list[int], np.ndarray]:
        sent = expert_ids(plan.weights)
        back = expert_ids(report.tensors)
        if not set(back) <= set(sent):
            raise ReportRejected(f"experts {back} were not all sent ({sent})")
        want = {f"e{k}.{n}" for k in back for n in self.names}
        if set(report.tensors) != want:
            raise ReportRejected("an expert must come back whole")
        for k, t in report.tensors.items():
            if t.shape != plan.weights[k].shape or not t.dense_rows:
                raise ReportRejected(f"{k}: expected a dense {plan.weights[k].shape}")
        return back, self.check_extras(report, back)

    def check_extras(self, report: Report, back: list[int]) -> np.ndarray:
        """q(z|s): a distribution, positive exactly on the returned experts; phi when the variant has one."""
        q = report.extras.get("qzs")
        if q is None or q.shape != (self.K,) or (q < 0).any() or abs(float(q.sum()) - 1) > 1e-3:
            raise ReportRejected("qzs must be a distribution over the K experts")
        if set(np.flatnonzero(q > 0).tolist()) != set(back):
            raise ReportRejected("q(z|s) must be positive exactly on the returned experts")
        if self.variant == "label":
            phi = report.extras.get("phi")
            if phi is None or phi.shape != (self.C, self.K):
                raise ReportRejected("phi missing or of the wrong shape")
        return q.astype(np.float64)

    def accumulate(self, state: ServerState, acc: Accumulator, plan: DevicePlan, report: Report) -> None:
        back, q = self.check(plan, report)
        n = float(report.n_samples)
        for k in back:
            wgt = q[k] * n  # Eq. 8 numerator, p(s) = N_s / N_S' (the normaliser cancels)
            for name in self.names:
                acc.num[f"e{k}.{name}"] += wgt * received_weights(plan, report, f"e{k}.{name}")
            acc.den[k] += wgt
        if acc.phi is not None:
            acc.phi += n * report.extras["phi"].astype(np.float64)
        acc.total_n += n
        acc.q[report.device_id] = [float(v) for v in q]
        acc.loss[report.device_id] = float(report.metrics.get("train_loss", float("nan")))

    def finish(self, state: ServerState, acc: Accumulator) -> ServerState:
        new = {k: v.copy() for k, v in state.weights.items()}
        delta: dict[str, np.ndarray] = {}
        for k in range(self.K):
            if acc.den[k] <= 0:
                continue  # no device of this round used expert k: leave it (and its Adam moments) alone
            for name in self.names:
                t = f"e{k}.{name}"
                delta[t] = state.weights[t] - acc.num[t] / acc.den[k]  # Eq. 8
        if acc.phi is not None and acc.total_n > 0:
            _, gh = entropy_grad(state.weights["phi"], np.full(self.C, 1.0 / self.C))
            delta["phi"] = state.weights["phi"] - acc.phi / acc.total_n - self.entropy_weight * gh  # line 8
        opt = dict(state.opt)
        if self.server_opt == "adam":
            adam = Adam(lr=self.server_lr)
            adam.load(opt, "adam/")
            adam.step(new, delta)  # descent on Delta = ascent on the mean update (line 9)
            opt |= adam.state("adam/")
        else:
            for t, d in delta.items():
                new[t] = (new[t] - self.server_lr * d).astype(np.float32)
        meta = dict(state.meta)
        meta["qzs"] = dict(meta.get("qzs", {})) | acc.q
        meta.pop("reset", None)
        st = ServerState(state.round + 1, new, opt, meta)
        if self.restart and self.variant == "cluster":
            self._restart(st, acc)
        return st

    # ---------------------------------------------------------------- remedy (not in the paper)
    def _restart(self, state: ServerState, acc: Accumulator) -> None:
        """Split an expert that serves incompatible devices into the least-used one (docs/fedmix.md).

        Every ``restart_every`` rounds, group the devices by argmax of their stored q(z|s). If no device
        changed expert since the previous check (a locked-in partition), and the expert
        with the most devices has at least twice as many as the least used one and a mean train loss above
        the median expert's, overwrite the least used expert by a copy of it and tell the half of its devices
        with the highest train loss (by a one-off ``pi_init`` in their next plan) to start from the copy. The overwritten
        expert's devices restart from a uniform pi and move to whichever expert fits them, by Eq. 13.
        Assumes clusters of similar size: a genuinely large cluster with a poor fit would be split too."""
        if state.round % self.restart_every or len(acc.loss) < 2:
            return
        qzs = state.meta["qzs"]
        owner = {d: int(np.argmax(q)) for d, q in qzs.items()}
        by = {k: [d for d in sorted(owner) if owner[d] == k] for k in range(self.K)}
        mean = {k: float(np.mean([acc.loss[d] for d in by[k] if d in acc.loss]))
                for k in range(self.K) if any(d in acc.loss for d in by[k])}
        if len(mean) < 2:
            return
        stable = state.meta.get("owners") == owner  # no device changed expert since the last check
        state.meta["owners"] = owner
        if not stable:
            return  # a wrong partition is a locked-in one; while devices still move, Eq. 13 is working
        worst = max(range(self.K), key=lambda k: (len(by[k]), mean.get(k, -np.inf)))  # the most devices
        victim = min(range(self.K), key=lambda k: (len(by[k]), -mean.get(k, np.inf)))  # the fewest
        # Trigger: the most used expert has at least twice the devices of the least used one and fits its
        # devices worse than the median expert fits its own (a mixed expert, not merely a large cluster).
        if (len(by[worst]) < 2 * max(1, len(by[victim])) or worst == victim
                or mean.get(worst, 0.0) <= float(np.median(list(mean.values())))):
            return
        for n in self.names:
            state.weights[f"e{victim}.{n}"] = state.weights[f"e{worst}.{n}"].copy()
            for mv in ("m", "v"):
                src = state.opt.get(f"adam/{mv}/e{worst}.{n}")
                if src is not None:
                    state.opt[f"adam/{mv}/e{victim}.{n}"] = src.copy()
        # the half of its devices that it fits worst (the minority of a mixed expert) go to the copy
        ranked = sorted(by[worst], key=lambda d: (-acc.loss.get(d, 0.0), d))
        moved = set(ranked[: len(ranked) // 2])
        reset = {}
        for d in by[worst] + by[victim]:
            pi = np.full(self.K, 1.0 / self.K)
            if d in by[worst]:
                pi = np.full(self.K, 0.1 / (self.K - 1))
                pi[victim if d in moved else worst] = 0.9
            reset[d] = [float(v) for v in pi]
        state.meta["reset"] = reset
        state.meta["restarts"] = list(state.meta.get("restarts", [])) + [[state.round, worst, victim]]

    # ---------------------------------------------------------------- reporting
    def global_model(self, state: ServerState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The most used expert as a plain network (what the daemon's Evaluator can run); FedMix's real
        model is per device (experts + private gate), evaluated on the device (edge.algorithms.fedmix.evaluate)."""
        qzs = state.meta.get("qzs", {})
        use = np.sum([q for q in qzs.values()], axis=0) if qzs else np.zeros(self.K)
        k = int(np.argmax(use))
        return self.spec, {n: state.weights[f"e{k}.{n}"] for n in self.names}

    def metrics(self, state: ServerState) -> dict[str, float]:
        qzs = state.meta.get("qzs", {})
        out: dict[str, float] = {"restarts": float(len(state.meta.get("restarts", [])))}
        if qzs:
            q = np.array(list(qzs.values()))
            out["experts_per_device"] = float((q > 0).sum(1).mean())
            out["qzs_entropy"] = float(-(q * np.log(np.maximum(q, 1e-12))).sum(1).mean())
        if self.variant == "label":
            qzy = softmax(state.weights["phi"].astype(np.float64), 1)
            out["qzy_entropy"] = float(-(qzy * np.log(qzy)).sum(1).mean())
            out["marginal_entropy"] = entropy_grad(state.weights["phi"], np.full(self.C, 1.0 / self.C))[0]
        return out
