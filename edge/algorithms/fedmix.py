"""FedMix's client half (paper 004, Alg. 1 client side, Alg. 2 pruning, App. B clustering variant).

The device keeps its gate theta_s = (A_s, b_s) (Eq. 9) in its LocalState between rounds and never sends it;
it receives only the experts the server chose for it (Alg. 2) plus phi, trains them with SGD on the MAP
bound (edge/trainers/torch_objectives/mixture.py), and returns only the experts it kept, phi and q'(z|s).

Two variational distributions (hparam ``variant``):
- ``label``: q_phi(z|y), a global C x K logit table trained by every device (Alg. 1).
- ``cluster``: q_pi(z|s), one distribution per device, re-estimated per mini-batch in closed form (Eq. 13,
  beta = 1) and damped, pi <- a pi + (1 - a) pi_new with a = 0.75 (App. B). pi is kept on the device.

A device with no gate yet (a new phone, before its first round) predicts with the gate's x-independent
stand-in, its q(z|s) (:func:`new_device_q`, docs/fedmix.md "A new device"), and trains from a uniform gate.

The program holds the experts a device was sent as *slots* in sorted order of their ids; the gate's rows
that an expert's last hidden units occupy (all of them here; FedMix x FedSparse prunes units) and the held
experts' columns of A, b and phi are sliced in and their gradients scattered back here, in numpy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..optim import sgd
from ..runtime.state import LocalState
from ..trainers.base import Trainer
from .base import ClientAlgorithm, Hparams as _Base, PlanError, Update

STATE = "fedmix"  # LocalState name of the private gate (and pi, and what the device last used)


@dataclass
class Hparams(_Base):
    K: int = field(default=4, metadata={"min": 1, "max": 64})
    eta: float = field(default=0.0, metadata={"min": 0.0})  # Alg. 2 pruning threshold (of eta/K)
    variant: str = field(default="label", metadata={"choices": ("label", "cluster")})
    gate_lr: float = field(default=0.05, metadata={"min": 0.0})
    damping: float = field(default=0.75, metadata={"min": 0.0, "max": 1.0})  # App. B
    eq13_gate: bool = True


def expert_of(name: str) -> int | None:
    """k for a tensor ``e{k}.fc{i}.*``, else None (phi, gate, pi_init)."""
    head = name.split(".", 1)[0]
    return int(head[1:]) if head[:1] == "e" and head[1:].isdigit() and "." in name else None


def expert_ids(weights: dict) -> list[int]:
    return sorted({k for k in map(expert_of, weights) if k is not None})


def softmax(a: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def label_marginal(phi: np.ndarray, y: np.ndarray) -> np.ndarray:
    """q_phi(z|s) = E_{y ~ D_s}[q_phi(z|y)] (Sec. 3): one matrix product with the label histogram."""
    hist = np.bincount(y, minlength=phi.shape[0]).astype(np.float64) / len(y)
    return hist @ softmax(phi.astype(np.float64), 1)


def threshold(q: np.ndarray, allowed: list[int], eta: float, K: int) -> list[int]:
    """Alg. 2: keep the allowed experts with q(z=k|s) >= eta/K. The paper is silent when none of the
    experts the device holds passes (q's mass moved to an expert it was not sent): keep the best held one."""
    keep = [k for k in allowed if q[k] >= eta / K]
    return keep or [max(allowed, key=lambda k: q[k])]


def restricted(q: np.ndarray, keep: list[int]) -> np.ndarray:
    """q' of Alg. 2: zero outside ``keep``, renormalised (Pal et al. 2005), as a full-K vector."""
    out = np.zeros_like(q, dtype=np.float64)
    out[keep] = q[keep]
    return out / out.sum()


def layout(plan_weights: dict[str, Any], variant: str, gated: bool, spec: dict | None = None) -> dict[str, Any]:
    """The mixture program's layout for the experts a plan holds: each slot's MLP sizes, in sorted id order
    (the coordinator computes the same from the same weights, so both ends name one program); for a person's
    module (a module ``spec``), the number of experts (each a copy of the module)."""
    if spec is not None and spec.get("arch") == "module":
        return {"experts": len(expert_ids(plan_weights)), "variant": variant, "gated": gated}
    slots = []
    for k in expert_ids(plan_weights):
        n = 0
        while f"e{k}.fc{n}.weight" in plan_weights:
            n += 1
        W = [plan_weights[f"e{k}.fc{i}.weight"].shape for i in range(n)]
        slots.append([int(W[0][1])] + [int(w[0]) for w in W])
    return {"slots": slots, "variant": variant, "gated": gated}


class FedMixClient(ClientAlgorithm):
    """One FedMix round on the device; SGD (lr) on experts and phi, SGD (gate_lr) on the private gate."""

    name = "fedmix"
    Hparams = Hparams
    stateful = True
    state_name = STATE
    gated = False

    # ---------------------------------------------------------------- hooks (FedMix x FedSparse extends them)
    def units(self, k: int, H: int) -> np.ndarray:
        """Where expert k's last hidden units sit among the gate's H input coordinates."""
        return np.arange(H)

    def _module(self) -> dict | None:
        spec = getattr(self.ctx.trainer, "spec", None) or {}
        return spec if spec.get("arch") == "module" else None

    def gate_width(self) -> int:
        spec = self._module()
        if spec is not None:  # the input width of the module's classifier
            return int(dict((n, s) for n, s in spec["params"])[f"{spec['classifier']}.weight"][1])
        k = self.held[0]
        last = max(int(n.split(".")[1][2:]) for n in self.ctx.plan.weights if n.startswith(f"e{k}.fc"))
        return int(self.ctx.plan.weights[f"e{k}.fc{last}.weight"].shape[1])

    def expert_params(self) -> dict[str, np.ndarray]:
        return {k: np.array(v, np.float32) for k, v in self.ctx.plan.weights.items() if expert_of(k) is not None}

    def hidden_names(self, k: int) -> list[str]:
        spec = self._module()
        if spec is not None:  # every parameter but the classifier's
            return [n for n, _s in spec["params"] if n.rsplit(".", 1)[0] != spec["classifier"]]
        n = sum(1 for name in self.ctx.plan.weights if name.startswith(f"e{k}.fc") and name.endswith(".weight"))
        return [f"fc{i}.{p}" for i in range(n - 1) for p in ("weight", "bias")]

    def extra_inputs(self, slots: dict[int, int]) -> dict[str, np.ndarray]:
        return {}

    def extra_step(self, g: dict[str, np.ndarray]) -> None:
        """Optimise what the base class does not (FedSparse's thresholds)."""

    def masks(self, keep: list[int]) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        return {}, {}

    def sent(self, k: int, name: str) -> bool:
        return True

    # ---------------------------------------------------------------- the round
    def begin(self) -> None:
        hp, plan = self.hp, self.ctx.plan
        self.K = hp.K
        self.held = expert_ids(plan.weights)
        if not self.held:
            raise PlanError("a FedMix plan without experts")
        H = self.gate_width()
        st = self.ctx.state.load(self.state_name)
        if st is None or st["A"].shape != (H, self.K):  # first time: a uniform gate (the paper is silent)
            st = {"A": np.zeros((H, self.K), np.float32), "b": np.zeros(self.K, np.float32),
                  "pi": np.full(self.K, 1.0 / self.K), "qs": np.full(self.K, 1.0 / self.K),
                  "active": np.ones(self.K, np.uint8)}
        if "pi_init" in plan.weights:  # a server-side restart of this device's assignment (docs/fedmix.md)
            st["pi"] = np.asarray(plan.weights["pi_init"], np.float64)
        self.A, self.b = st["A"].astype(np.float32), st["b"].astype(np.float32)
        self.pi = np.asarray(st.get("pi", np.full(self.K, 1.0 / self.K)), np.float64)
        self.params = self.expert_params()
        if hp.variant == "label":
            self.params["phi"] = np.array(plan.weights["phi"], np.float32)
        self.unit_idx = {k: self.units(k, H) for k in self.held}
        self.losses: list[float] = []

    def qzs(self) -> np.ndarray:
        return label_marginal(self.params["phi"], self.ctx.y) if self.hp.variant == "label" else self.pi

    def _program_weights(self) -> dict[str, np.ndarray]:
        held, p = self.held, self.params
        w = {}
        for j, k in enumerate(held):
            for n, a in p.items():
                if expert_of(n) == k:
                    w[f"s{j}.{n.split('.', 1)[1]}"] = a
            w[f"gate.A{j}"] = self.A[self.unit_idx[k]][:, held]
        w["gate.b"] = self.b[held]
        if "phi" in p:
            w["phi"] = p["phi"][:, held]
        return w

    def step(self, idx: np.ndarray) -> float:
        hp, held = self.hp, self.held
        q = self.qzs()
        act = threshold(q, held, hp.eta, self.K)  # Alg. 2, per batch
        qa = restricted(q, act)
        slots = {k: j for j, k in enumerate(held)}
        inputs = {"x": self.ctx.x[idx], "y": self.ctx.y[idx],
                  "active": np.array([1.0 if k in act else 0.0 for k in held], np.float32),
                  "qs": qa[held].astype(np.float32)}
        if hp.variant == "cluster":
            inputs["pi"] = restricted(self.pi, act)[held].astype(np.float32)
        for k, j in slots.items():
            for n in self.hidden_names(k):
                inputs[f"c{j}_{n.replace('.', '_')}"] = self.params[f"e{k}.{n}"]
        inputs |= self.extra_inputs(slots)
        t = self.ctx.trainer
        t.set_weights(self._program_weights())
        loss, g, aux = t.loss_and_grads(inputs)
        grads: dict[str, np.ndarray] = {}
        gA, gb = np.zeros_like(self.A), np.zeros_like(self.b)
        for name, a in g.items():
            if name.startswith("s"):
                j, rest = name[1:].split(".", 1)
                grads[f"e{held[int(j)]}.{rest}"] = a
            elif name.startswith("gate.A"):
                k = held[int(name[6:])]
                gA[np.ix_(self.unit_idx[k], held)] += a
            elif name == "gate.b":
                gb[held] += a
            elif name == "phi":
                gp = np.zeros_like(self.params["phi"])
                gp[:, held] = a
                grads["phi"] = gp
        self.extra_step(grads)
        sgd(self.params, grads, hp.lr)  # gradient ascent on the bound = descent on the loss
        gate = {"A": self.A, "b": self.b}
        sgd(gate, {"A": gA, "b": gb}, hp.gate_lr)
        if hp.variant == "cluster":
            # Eq. 13: log pi_k = mean_i log p(y_i, z=k|x_i) - logsumexp_k(...), over the active experts.
            cols = [slots[k] for k in act]
            joint = aux["ll"][:, cols].astype(np.float64) + (aux["lg"][:, cols] if hp.eq13_gate else 0.0)
            new = np.zeros(self.K)
            new[act] = softmax(joint.mean(0))
            self.pi = hp.damping * self.pi + (1 - hp.damping) * new  # App. B damping, per mini-batch
        return loss

    def end(self) -> Update:
        hp = self.hp
        q = self.qzs()
        keep = threshold(q, self.held, hp.eta, self.K)  # Alg. 2: return only experts with q >= eta/K
        # an expert whose weight underflows in the float32 report would carry no weight in Eq. 8: not sent
        keep = [k for k in keep if np.float32(restricted(q, keep)[k]) > 0]
        qp = restricted(q, keep)
        if hp.variant == "cluster":
            self.pi = qp  # the device drops the pruned experts for good and renormalises (Alg. 2)
        masks, metrics = self.masks(keep)
        weights = {n: a for n, a in self.params.items()
                   if expert_of(n) in keep and self.sent(expert_of(n), n)}
        extras = {"qzs": qp.astype(np.float32)}
        if hp.variant == "label":
            extras["phi"] = self.params["phi"]
        active = np.zeros(self.K, np.uint8)
        active[keep] = 1
        self.ctx.state.save(self.state_name, {"A": self.A, "b": self.b, "pi": self.pi, "qs": qp, "active": active})
        return Update(weights, masks, extras, {"experts": len(keep)} | metrics)


def new_device_q(plan_weights: dict[str, np.ndarray], variant: str, K: int, y: np.ndarray | None = None,
                 expert_ll: np.ndarray | None = None) -> np.ndarray:
    """q(z|s) of a device that has no gate yet, over the experts the plan holds (zero elsewhere, sums to 1):
    the stand-in for p(z|s) = E_x[p_theta_s(z|x,s)] that the paper itself uses (Alg. 2, App. I).

    - label variant: q_phi(z|s) = E_{y ~ D_s}[q_phi(z|y)] from the device's own labels ``y``; with none, the
      global mixture sum_c p(y=c) q_phi(z|y=c) at a uniform p(y) (the server's own p(y), line 8);
    - cluster variant: Eq. 13 (beta = 1) over the device's whole labelled data at its uniform first gate,
      softmax_k(mean_i log p_wk(y_i|x_i)) (``expert_ll`` [N, held]); with no labels, uniform."""
    held = _plan_experts(plan_weights)
    q = np.zeros(K)
    if variant == "label":
        phi = np.asarray(plan_weights["phi"], np.float64)
        q = label_marginal(phi, y) if y is not None and len(y) else softmax(phi, 1).mean(0)
    elif expert_ll is not None and len(expert_ll):
        q[held] = softmax(np.asarray(expert_ll, np.float64).mean(0))
    else:
        q[held] = 1.0
    return restricted(q, held)


def predict_proba(trainer: Trainer, plan_weights: dict[str, np.ndarray], state: LocalState, x: np.ndarray,
                  *, state_name: str = STATE, extra_inputs=None, variant: str = "label",
                  local: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """p(y|x,s) = sum_k p_theta(z=k|x,s) p_wk(y|x,z=k) (Sec. 3, inference for a known client): the experts the
    device kept (as the plan carried them), its private gate and its last q(z|s). ``trainer`` must hold the
    mixture program of exactly those experts (:func:`kept_layout`). Runs on the device.

    A device with no gate yet uses its q(z|s) for p_theta(z|x,s): p(y|x,s) = sum_k q(z=k|s) p_wk(y|x,z=k) over
    every expert the plan holds, q from :func:`new_device_q` with ``local`` = (x, y), its own training data
    if it has any, and the plan's ``variant``."""
    st = state.load(state_name)
    if st is not None:
        act = [k for k in range(st["active"].shape[0]) if st["active"][k]]
        qs = restricted(np.asarray(st["qs"], np.float64), act)
        aux = _mixture_aux(trainer, plan_weights, act, st["A"], st["b"], qs, x, extra_inputs)
        return (np.exp(aux["lg"].astype(np.float64))[:, :, None] * _expert_probs(aux)).sum(1)
    held = _plan_experts(plan_weights)
    K = int(np.asarray(plan_weights["phi"]).shape[1]) if "phi" in plan_weights else max(held) + 1
    b = np.zeros(K, np.float32)
    xl, yl = local if local is not None else (None, None)
    ll = None
    if variant == "cluster" and yl is not None and len(yl):  # Eq. 13 needs log p_wk(y_i|x_i): one pass
        ll = _mixture_aux(trainer, plan_weights, held, None, b, restricted(np.ones(K), held), xl, extra_inputs,
                          yl)["ll"]
    q = new_device_q(plan_weights, variant, K, yl, ll)
    aux = _mixture_aux(trainer, plan_weights, held, None, b, q, x, extra_inputs)
    return (_expert_probs(aux) * q[held][None, :, None]).sum(1)


def _plan_experts(plan_weights: dict[str, np.ndarray]) -> list[int]:
    held = expert_ids(plan_weights)
    if not held:
        raise ValueError("a FedMix plan without experts")
    return held


def _expert_probs(aux: dict[str, np.ndarray]) -> np.ndarray:
    """p_wk(y|x, z=k) for every slot, [B, k, C], from the program's logits."""
    logits = aux["logits"].astype(np.float64)
    probs = np.exp(logits - logits.max(2, keepdims=True))
    return probs / probs.sum(2, keepdims=True)


def _mixture_aux(trainer: Trainer, plan_weights: dict[str, np.ndarray], held: list[int], A: np.ndarray | None,
                 b: np.ndarray, qs: np.ndarray, x: np.ndarray, extra_inputs=None,
                 y: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The mixture program's aux outputs (``ll``, ``lg``, ``logits``) for the experts ``held`` (its slots, in
    order), the gate (A, b) (A None: zero, no gate yet) and the q(z|s) weights ``qs`` (full K)."""
    w, inputs = {}, {"x": x, "y": np.zeros(len(x), np.int64) if y is None else np.asarray(y, np.int64),
                     "active": np.ones(len(held), np.float32), "qs": qs[held].astype(np.float32)}
    for j, k in enumerate(held):
        last = _last(plan_weights, k)
        for n, a in plan_weights.items():
            if expert_of(n) == k and not n.endswith(".units"):
                rest = n.split(".", 1)[1]
                w[f"s{j}.{rest}"] = a
                if int(rest.split(".")[0][2:]) < last:  # the gate's features: copies of the hidden layers
                    inputs[f"c{j}_{rest.replace('.', '_')}"] = a
        if A is None:
            rows = len(plan_weights[f"e{k}.units"]) if f"e{k}.units" in plan_weights else \
                int(plan_weights[f"e{k}.fc{last}.weight"].shape[1])
            w[f"gate.A{j}"] = np.zeros((rows, len(held)), np.float32)
        else:
            units = np.asarray(plan_weights.get(f"e{k}.units", np.arange(A.shape[0])), np.int64)
            w[f"gate.A{j}"] = A[units][:, held]
    w["gate.b"] = np.asarray(b, np.float32)[held]
    if "phi" in trainer.params:
        w["phi"] = np.asarray(plan_weights["phi"], np.float32)[:, held]
    if "pi" in [i.name for i in trainer.inputs]:
        inputs["pi"] = qs[held].astype(np.float32)
    inputs |= (extra_inputs(held, x) if extra_inputs else {})
    trainer.set_weights(w)
    return trainer.loss_and_grads(inputs)[2]


def kept_layout(plan_weights: dict[str, np.ndarray], state: LocalState, *, state_name: str = STATE,
                variant: str = "label", gated: bool = False) -> dict[str, Any]:
    """The mixture program layout of the experts this device kept after its last round (what its
    :func:`predict_proba` needs); for a device with no gate yet, of every expert the plan holds."""
    st = state.load(state_name)
    if st is None:
        return layout(plan_weights, variant, gated)
    act = [k for k in range(st["active"].shape[0]) if st["active"][k]]
    return layout({n: w for n, w in plan_weights.items() if expert_of(n) in act}, variant, gated)


def _last(weights: dict, k: int) -> int:
    return max(int(n.split(".")[1][2:]) for n in weights if n.startswith(f"e{k}.fc") and n.endswith(".weight"))


def evaluate(trainer: Trainer, plan_weights: dict[str, np.ndarray], state: LocalState, x: np.ndarray,
             y: np.ndarray, **kw) -> float:
    """Accuracy of the device's mixture on its own held-out data (see predict_proba)."""
    return float(np.mean(predict_proba(trainer, plan_weights, state, x, **kw).argmax(1) == y))
