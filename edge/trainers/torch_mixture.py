"""FedMix's client objective in torch (paper 004, Eq. 5/6 without H(q), Eq. 9 gate): the runtime only
computes the loss, its gradients and two per-sample tables; the algorithm (optimisers, Eq. 13, pruning)
lives in numpy in edge/fedmix.py so it runs the same on every runtime.

Parameters (names as they travel in a plan; the gate never travels):
    e{k}.fc{i}.weight / .bias   expert k, an MLP of the program's spec
    gate.A [H, K], gate.b [K]   the device's private gate theta_s (Eq. 9)
    phi [C, K]                  logits of q_phi(z|y) (label variant only)

Batch inputs: x, y, ``active`` (expert ids in use this batch), ``qs`` (q(z|s) over the active experts, the
Eq. 9 pooling weights) and either ``pi`` (q_pi(z|s), App. B clustering variant) or nothing (q_phi(z|y)
from ``phi``). Per batch (a minimisation of the negative MAP bound, batch mean):

    loss = -(1/M) sum_i sum_{k in active} q_ik [ log p_wk(y_i|x_i) + log p_theta(z=k|x_i, s) ]

with q_ik = softmax(phi[y_i, active]) (q_phi(z|y) pruned to the active experts and renormalised, Alg. 2)
or pi. The gate sees h_s(x) = sum_k qs_k h_k(x) with h_k detached: the paper is silent on whether the gate
loss trains the experts' features; we keep the experts trained by their own term only (docs/fedmix.md).
The tables returned as ``out:ll`` and ``out:lg`` (M x |active|) are log p_wk(y|x) and log p_theta(k|x),
which the client half needs for Eq. 13.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from ..model import ModelSpec


class TorchMixture:
    def __init__(self, spec: ModelSpec):
        if spec["arch"] != "mlp":
            raise ValueError("FedMix experts are MLPs")
        self.spec = spec
        self.n = len(spec["sizes"]) - 1
        self._p: dict[str, torch.Tensor] = {}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Any subset of experts plus gate/phi: a device holds only the experts it was sent."""
        self._p = {k: torch.tensor(np.array(a, np.float32), requires_grad=True) for k, a in weights.items()}

    def get_weights(self) -> dict[str, np.ndarray]:
        return {k: p.detach().numpy().copy() for k, p in self._p.items()}

    def expert(self, k: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of expert k and h_k(x), the input to its output layer (App. A)."""
        h = x
        for i in range(self.n):
            if i == self.n - 1:
                feat = h
            h = F.linear(h, self._p[f"e{k}.fc{i}.weight"], self._p[f"e{k}.fc{i}.bias"])
            if i < self.n - 1:
                h = torch.relu(h)
        return h, feat

    def _tables(self, b: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        x = torch.from_numpy(np.ascontiguousarray(b["x"], np.float32))
        active = [int(k) for k in b["active"]]
        qs = torch.from_numpy(np.asarray(b["qs"], np.float32))
        logits, feats = zip(*(self.expert(k, x) for k in active))
        hs = sum(qs[j] * feats[j].detach() for j in range(len(active)))  # Eq. 9, h_s(x)
        idx = torch.tensor(active)
        lg = F.log_softmax(hs @ self._p["gate.A"][:, idx] + self._p["gate.b"][idx], dim=1)
        return lg, idx, list(logits)

    def _begin(self, b: dict[str, np.ndarray]) -> None:
        """Per-batch set-up before the forward pass (a subclass's gates read their inputs here)."""

    def _extra_loss(self) -> torch.Tensor | float:
        """Terms a subclass adds to the objective (FedSparse's penalties in the composition)."""
        return 0.0

    def loss_and_grads(self, b: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        for p in self._p.values():
            p.grad = None
        self._begin(b)
        y = torch.from_numpy(np.ascontiguousarray(b["y"], np.int64))
        lg, idx, logits = self._tables(b)
        ll = torch.stack([-F.cross_entropy(z, y, reduction="none") for z in logits], dim=1)
        if "pi" in b:
            q = torch.from_numpy(np.asarray(b["pi"], np.float32)).expand(len(y), -1)
        else:
            q = torch.softmax(self._p["phi"][y][:, idx], dim=1)
        loss = -(q * (ll + lg)).sum(1).mean() + self._extra_loss()
        loss.backward()
        out = {k: p.grad.numpy().copy() for k, p in self._p.items() if p.grad is not None}
        out["out:ll"] = ll.detach().numpy().copy()
        out["out:lg"] = lg.detach().numpy().copy()
        return float(loss.detach()), out

    def predict_proba(self, b: dict[str, np.ndarray]) -> np.ndarray:
        """p(y|x,s) = sum_k p_theta(z=k|x,s) p_wk(y|x,z=k) (Sec. 3, inference for a known client)."""
        with torch.no_grad():
            lg, _, logits = self._tables(b)
            probs = torch.stack([torch.softmax(z, dim=1) for z in logits], dim=1)  # M x Ka x C
            return (lg.exp().unsqueeze(2) * probs).sum(1).numpy()
