"""SFVI and SFVI-Avg(m), the client halves (paper 003, Algorithms 1 and 2; docs/sfvi.md).

The device's local variational parameters eta_Lj (``qL.*``, edge/vi.py) and their optimiser state live in its
LocalState (``sfvi``) and never leave it; so does a private ``salt`` that keys its own noise eps_Lj
(edge/randn.py, stream = round), which the server therefore cannot reproduce.

SFVI (Algorithm 1, one exchange per iteration). The plan carries theta and eta_G, and eps_G or the seed that
regenerates it (``eps_seed``, ``eps_stream``). The device computes its ELBO term L_j at one sample
(edge/trainers/torch_objectives/sfvi.py) over all its data, accumulating over batches (row weight 1 / epochs,
local term 1 / batches: the sum is the full-data term exactly, whatever batch_size bounds the memory), then

- steps eta_Lj with the gradient (S6), computed at the same point as the one it sends (digest note c);
- returns g_j^theta and g_j^eta (S8, S5), gradients of the ELBO (ascent), under the plan's names, divided by
  its sample count N_j: a per-sample gradient, on one scale for a silo of 10 and one of 2,000, so the
  coordinator's norm bound (a median of the fleet's norms) neither clips nor refuses a large silo; the server
  multiplies by N_j again and sums (coordinator/strategies/sfvi.py, docs/sfvi.md "Admission").

SFVI-Avg(m) (Algorithm 2): m = epochs x batches local steps of SVI on (theta, eta_G, eta_Lj) with the
likelihood rows weighted N / |B| and the local prior and entropy N / N_j (the coordinator broadcasts N), plus
the global term L_0 (computed in numpy, edge.vi.global_term, as the server would); fresh eps_G and eps_L per
step, from the salt. A fresh Adam for the copy of (theta, eta_G) each round; eta_Lj's persists. Returns the
trained (theta, eta_G); the server averages theta and takes the Wasserstein barycenter of q(Z_G).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from .. import randn
from ..optim import Adam, sgd
from ..runtime.state import LocalState
from ..trainers.base import Trainer
from ..vi import RanEf, build_model, global_shapes, global_term, init_local, unitri
from .base import ClientAlgorithm, Hparams as _Base, PlanError, Update

STATE = "sfvi"
EPS_G = "eps_G"  # the plan tensor that carries eps_G when the coordinator sends it instead of a seed


@dataclass
class Hparams(_Base):
    lr: float = field(default=1e-2, metadata={"min": 0.0})  # the optimiser of eta_Lj (and SFVI-Avg's copies)
    batch_size: int = field(default=1 << 20, metadata={"min": 1, "max": 1 << 20})
    opt: str = field(default="adam", metadata={"choices": ("adam", "sgd")})
    eps_seed: int = field(default=0, metadata={"min": 0, "max": (1 << 63) - 1})
    eps_stream: int = field(default=0, metadata={"min": 0, "max": (1 << 63) - 1})


@dataclass
class AvgHparams(Hparams):
    N: int = field(default=0, metadata={"min": 0, "max": 1 << 40})  # the fleet's total sample count (0: N_j)


def signature(spec: dict, layout: dict) -> np.ndarray:
    """What eta_Lj's shapes depend on, hashed: a state saved for another program is started afresh."""
    h = hashlib.sha256(json.dumps([spec, layout], sort_keys=True).encode()).digest()
    return np.frombuffer(h, np.uint8).copy()


def local_noise(salt: int, stream: int, n: int) -> np.ndarray:
    """The device's private noise: eps_Lj of round ``stream`` (SFVI)."""
    return randn.normal(salt, stream, n)


def avg_stream(round_: int, step: int, which: int) -> int:
    """SFVI-Avg's noise stream for local step ``step`` (which: 0 eps_G, 1 eps_L)."""
    return (round_ << 32) | (step << 1) | which


def load_local(state: LocalState, trainer: Trainer, *, name: str = STATE):
    """(model, family, eta_Lj, its Adam, salt) from the device's state, initialised on first use."""
    m, f = build_model(trainer.spec, trainer.layout)
    sig = signature(trainer.spec, trainer.layout)
    st = state.load(name)
    if st is None or not np.array_equal(st.get("sig"), sig):
        salt = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
        eta = init_local(m, f, np.random.default_rng(salt))
        adam = Adam()
    else:
        salt = int(st["salt"][0])
        eta = {k[4:]: st[k].astype(np.float64) for k in st if k.startswith("eta/")}
        adam = Adam()
        adam.load(st, "adam/")
    return m, f, eta, adam, salt


def save_local(state: LocalState, trainer: Trainer, eta: dict, adam: Adam, salt: int, *, name: str = STATE) -> None:
    arrays = {"sig": signature(trainer.spec, trainer.layout), "salt": np.array([salt], np.int64)}
    arrays |= {f"eta/{k}": v for k, v in eta.items()} | adam.state("adam/")
    state.save(name, arrays)


def stop_grad_inputs(eta_L: dict, eta_G: dict, f) -> dict[str, np.ndarray]:
    """The copies of the variational parameters that log q is written on (STL; ONNX has no stop-gradient)."""
    out = {"sg_muL": eta_L["qL.mu"], "sg_sL": eta_L["qL.s"]}
    if f.coupled:
        out |= {"sg_muG": eta_G["qG.mu"], "sg_C": eta_L["qL.C"]}
    if f.L_full:
        out["sg_LinvL"] = np.linalg.inv(unitri(eta_L["qL.L"]))
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def group_mask(m, x: np.ndarray) -> dict[str, np.ndarray]:
    """ranef: 1 for the device's groups (x[:, 0] = 0, 1, ...), 0 for unused slots."""
    if not isinstance(m, RanEf):
        return {}
    g = x[:, 0]
    if len(g) and (g.min() < 0 or g.max() >= m.groups or not np.array_equal(g, np.round(g))):
        raise PlanError(f"group ids must be whole numbers in [0, {m.groups})")
    n = int(g.max()) + 1 if len(g) else 0
    return {"gmask": (np.arange(m.groups) < n).astype(np.float32)}


class SFVIClient(ClientAlgorithm):
    """One SFVI iteration on the device (Algorithm 1, silo side)."""

    name = "sfvi"
    Hparams = Hparams
    stateful = True

    def begin(self) -> None:
        plan, t = self.ctx.plan, self.ctx.trainer
        self.m, self.f, self.loc, self.adam, self.salt = load_local(self.ctx.state, t)
        want = global_shapes(self.m, self.f)
        got = {k: tuple(v.shape) for k, v in plan.weights.items() if k != EPS_G}
        if got != want:
            raise PlanError(f"plan tensors {sorted(got)} do not match the program's {sorted(want)}")
        self.glob = {k: np.asarray(v, np.float32) for k, v in plan.weights.items() if k != EPS_G}
        self.prog = {k: v for k, v in self.glob.items() if k in t.params}  # theta of log p(Z_G) only: not in it
        if EPS_G in plan.weights:
            self.eps_G = np.asarray(plan.weights[EPS_G], np.float64)
            if self.eps_G.shape != (self.m.n_G,):
                raise PlanError(f"eps_G of shape {self.eps_G.shape}, the model has n_G = {self.m.n_G}")
        else:
            self.eps_G = randn.normal(self.hp.eps_seed, self.hp.eps_stream, self.m.n_G)
        self.eps_L = local_noise(self.salt, plan.round, self.m.n_L)
        n = len(self.ctx.x)
        self.batches = self.hp.epochs * math.ceil(n / self.hp.batch_size)
        self.fixed = {"eps_G": self.eps_G.astype(np.float32), "eps_L": self.eps_L.astype(np.float32),
                      "klw": np.float32(1.0 / self.batches)} | stop_grad_inputs(self.loc, self.glob, self.f)
        self.fixed |= group_mask(self.m, self.ctx.x)
        self.grads = {k: np.zeros(v.shape, np.float64) for k, v in {**self.glob, **self.loc}.items()}
        self.elbo = 0.0

    def step(self, idx: np.ndarray) -> float:
        t = self.ctx.trainer
        t.set_weights(self.prog | {k: v.astype(np.float32) for k, v in self.loc.items()})
        w = np.full(len(idx), 1.0 / self.hp.epochs, np.float32)
        loss, g, _ = t.loss_and_grads({"x": self.ctx.x[idx], "y": self.ctx.y[idx], "w": w} | self.fixed)
        for k, v in g.items():
            self.grads[k] -= v  # the gradient of the ELBO: the program's loss is minus it
        self.elbo -= loss
        return loss

    def end(self) -> Update:
        gl = {k: self.grads[k] for k in self.loc}
        if self.hp.opt == "adam":
            self.adam.lr = self.hp.lr
            self.adam.maximize = True
            self.adam.step(self.loc, gl)
        else:
            sgd(self.loc, {k: -v for k, v in gl.items()}, self.hp.lr)
        save_local(self.ctx.state, self.ctx.trainer, self.loc, self.adam, self.salt)
        n = max(1, len(self.ctx.x))  # the server multiplies by the N_j this device declared (its data's size)
        out = {k: (self.grads[k] / n).astype(np.float32) for k in self.glob}
        return Update(out, metrics={"elbo": float(self.elbo)})


class SFVIAvgClient(SFVIClient):
    """SFVI-Avg(m) on the device (Algorithm 2, silo side)."""

    name = "sfvi_avg"
    Hparams = AvgHparams

    def begin(self) -> None:
        plan, t = self.ctx.plan, self.ctx.trainer
        self.m, self.f, self.loc, self.adam, self.salt = load_local(self.ctx.state, t)
        want = global_shapes(self.m, self.f)
        got = {k: tuple(v.shape) for k, v in plan.weights.items()}
        if got != want:
            raise PlanError(f"plan tensors {sorted(got)} do not match the program's {sorted(want)}")
        self.glob = {k: np.array(v, np.float64) for k, v in plan.weights.items()}
        self.gadam = Adam(lr=self.hp.lr, maximize=True)
        n = len(self.ctx.x)
        N = self.hp.N or n
        if N < n:
            raise PlanError(f"the fleet's N = {N} is below this device's {n} samples")
        self.scale = N / n
        self.gmask = group_mask(self.m, self.ctx.x)
        self.k = 0

    def step(self, idx: np.ndarray) -> float:
        t, m, rnd = self.ctx.trainer, self.m, self.ctx.plan.round
        eps_G = randn.normal(self.salt, avg_stream(rnd, self.k, 0), m.n_G)
        eps_L = randn.normal(self.salt, avg_stream(rnd, self.k, 1), m.n_L)
        self.k += 1
        g32 = {k: v.astype(np.float32) for k, v in self.glob.items()}
        t.set_weights({k: v for k, v in g32.items() if k in t.params} | {k: v.astype(np.float32) for k, v in self.loc.items()})
        w = np.full(len(idx), len(self.ctx.x) * self.scale / len(idx), np.float32)  # N / |B|
        inputs = {"x": self.ctx.x[idx], "y": self.ctx.y[idx], "w": w, "eps_G": eps_G.astype(np.float32),
                  "eps_L": eps_L.astype(np.float32), "klw": np.float32(self.scale)}
        inputs |= stop_grad_inputs(self.loc, g32, self.f) | self.gmask
        loss, g, _ = t.loss_and_grads(inputs)
        l0, g0 = global_term(m, {k: v.astype(np.float64) for k, v in g32.items()}, eps_G)
        gg = {k: -g[k].astype(np.float64) + g0[k] if k in g else g0[k] for k in self.glob}
        gl = {k: -g[k].astype(np.float64) for k in self.loc}
        if self.hp.opt == "adam":
            self.gadam.step(self.glob, gg)
            self.adam.lr, self.adam.maximize = self.hp.lr, True
            self.adam.step(self.loc, gl)
        else:
            sgd(self.glob, {k: -v for k, v in gg.items()}, self.hp.lr)
            sgd(self.loc, {k: -v for k, v in gl.items()}, self.hp.lr)
        return loss - l0

    def end(self) -> Update:
        save_local(self.ctx.state, self.ctx.trainer, self.loc, self.adam, self.salt)
        return Update({k: v.astype(np.float32) for k, v in self.glob.items()})


# ---------------------------------------------------------------------- prediction on the device
def predict_proba(trainer: Trainer, plan_weights: dict[str, np.ndarray], state: LocalState, x: np.ndarray, *,
                  samples: int = 16, seed: int = 0) -> np.ndarray:
    """The hierarchical BNN's posterior predictive p(y | x, device) on the device: softmax averaged over
    ``samples`` draws of (Z_G, Z_Lj) from q (0: the network at q's means). ``plan_weights``: theta and eta_G."""
    if state.load(STATE) is None:
        raise ValueError("this device has no SFVI state yet")
    m, f, loc, _, _ = load_local(state, trainer)
    glob = {k: np.asarray(v, np.float32) for k, v in plan_weights.items() if k != EPS_G}
    trainer.set_weights({k: v for k, v in glob.items() if k in trainer.params} | {k: v.astype(np.float32) for k, v in loc.items()})
    rng = np.random.default_rng(seed)
    base = {"x": x, "y": np.zeros(len(x), np.int64), "w": np.zeros(len(x), np.float32), "klw": np.float32(0.0)}
    base |= stop_grad_inputs(loc, glob, f) | group_mask(m, x)
    probs = 0.0
    for _ in range(max(samples, 1)):
        if samples:
            eG, eL = rng.standard_normal(m.n_G), rng.standard_normal(m.n_L)
        else:
            eG, eL = np.zeros(m.n_G), np.zeros(m.n_L)
        _, _, aux = trainer.loss_and_grads(base | {"eps_G": eG.astype(np.float32), "eps_L": eL.astype(np.float32)})
        lg = aux["logits"].astype(np.float64)
        p = np.exp(lg - lg.max(1, keepdims=True))
        probs = probs + p / p.sum(1, keepdims=True)
    return probs / max(samples, 1)


def evaluate(trainer: Trainer, plan_weights: dict[str, np.ndarray], state: LocalState, x: np.ndarray, y: np.ndarray,
             **kw) -> float:
    """Accuracy of the device's personalised posterior predictive on its own held-out data."""
    return float(np.mean(predict_proba(trainer, plan_weights, state, x, **kw).argmax(1) == y))


__all__ = ["Hparams", "AvgHparams", "SFVIClient", "SFVIAvgClient", "STATE", "EPS_G", "local_noise", "load_local",
           "predict_proba", "evaluate", "stop_grad_inputs"]
