"""FedMix x FedSparse, the client objective in torch (paper 004's mixture bound with paper 000's group gates
inside every expert). The algorithm (optimisers, pruning, sampling z) lives in numpy in
edge/fedmix_sparse.py; this only computes the loss, its gradients and the two per-sample tables.

Parameters (names as in a plan; the gate never travels):
    e{k}.fc{i}.weight / .bias   expert k, sliced to its surviving hidden units (shapes differ per expert)
    e{k}.fc{i}.v                expert k's thresholds, one per surviving unit of hidden layer i (Eq. 23)
    gate.A [H, K], gate.b [K]   the device's private gate (Eq. 9), H = the *unpruned* last hidden width
    phi [C, K]                  logits of q_phi(z|y)

Batch inputs: FedMix's (x, y, active, qs) plus, per held expert k and gated layer i, ``u{k}.{i}`` (the
hard-concrete noise, drawn in numpy), ``theta_logit{k}.{i}`` (the server's theta as a logit, for H(pi, theta)),
``units{k}`` (where expert k's last hidden units sit in the gate's H coordinates) and the scalars
``lambda0``, ``ce_scale``, ``T``. Per batch:

    loss = FedMix's  -(1/M) sum_i sum_{k active} q_ik [log p_wk(y_i|x_i) + log p_theta(z=k|x_i,s)]
           + sum_{k active} sum_{i gated} [lambda0 sum_g pi_kg + ce_scale sum_g H(pi_kg, theta_kg)]

where expert k's hidden units are multiplied by hard-concrete gates (FedSparse, edge/trainers/torch_gated.py,
same constants). Without noise in the batch (evaluation) every surviving unit is on: the pruned global
expert, as FedSparse's global model.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from .torch_gated import hard_concrete, softplus
from .torch_mixture import TorchMixture
from ..gates import LOG_RATIO


class TorchMixtureSparse(TorchMixture):
    def __init__(self, spec):
        super().__init__(spec)
        self._b: dict[str, np.ndarray] = {}
        self._penalty = torch.zeros(())

    def expert(self, k: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the gated expert k and its last hidden layer scattered into the gate's H coordinates."""
        b, h = self._b, x
        T = float(b.get("T", 1e-3))
        for i in range(self.n):
            W, bias = self._p[f"e{k}.fc{i}.weight"], self._p[f"e{k}.fc{i}.bias"]
            if i == self.n - 1:
                feat = h
            h = F.linear(h, W, bias)
            if i < self.n - 1:
                h = torch.relu(h)
                if f"u{k}.{i}" in b:  # training: FedSparse's relaxed gates and penalties
                    norm = torch.sqrt((W * W).sum(1) + bias * bias).detach()
                    logit_pi = (norm - softplus(self._p[f"e{k}.fc{i}.v"])) / T
                    h = h * hard_concrete(logit_pi + LOG_RATIO, torch.from_numpy(b[f"u{k}.{i}"]))
                    pi = torch.sigmoid(logit_pi)
                    th = torch.from_numpy(np.asarray(b[f"theta_logit{k}.{i}"], np.float32))
                    h_ce = -(pi * F.logsigmoid(th) + (1 - pi) * F.logsigmoid(-th))
                    self._penalty = self._penalty + float(b["lambda0"]) * pi.sum() + float(b["ce_scale"]) * h_ce.sum()
        H = self._p["gate.A"].shape[0]
        full = feat.new_zeros((feat.shape[0], H))
        full[:, torch.from_numpy(np.asarray(b[f"units{k}"], np.int64))] = feat
        return h, full

    def _begin(self, b: dict[str, np.ndarray]) -> None:
        self._b, self._penalty = b, torch.zeros(())  # expert() reads the gate inputs and adds the penalties

    def _extra_loss(self) -> torch.Tensor:
        return self._penalty

    def predict_proba(self, b: dict[str, np.ndarray]) -> np.ndarray:
        self._b = {k: v for k, v in b.items() if not (k.startswith("u") and not k.startswith("units"))}
        return super().predict_proba(self._b)
