"""FedSparse's client objective in torch (paper 000, Eq. 41 with lambda = 0): the reference every runtime's
exported gated program is checked against.

Per batch (a minimisation, batch-mean data term; the paper is silent on scaling and we keep the
penalties per group, unscaled, as the reference implementation in the notes did):

    CE(f(x; w_s * z)) + lambda0 * sum_g pi_sg + ce_scale * sum_g H(pi_sg, theta_g)

with z the hard-concrete gates (noise ``u`` is an input), pi_sg = sigmoid((||w_sg|| - softplus(v_sg))/T)
with the norm detached (Eq. 23), and H the cross-entropy between the client's and the server's gate
probabilities (theta enters as its logit, an input). Gradients go to every weight and every v.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from ..gates import BETA, GAMMA, LOG_RATIO, ZETA
from ..model import ModelSpec, param_shapes


def softplus(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(v, min=0) + torch.log(1 + torch.exp(-torch.abs(v)))


def hard_concrete(log_alpha: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + log_alpha) / BETA)
    return torch.clamp(s * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


class GatedMLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        s = spec["sizes"]
        self.n = len(s) - 1
        self.params = nn.ParameterDict()
        for name, shape in param_shapes(spec).items():
            self.params[name.replace(".", "_")] = nn.Parameter(torch.zeros(shape))
        for i in range(self.n - 1):
            self.params[f"fc{i}_v"] = nn.Parameter(torch.zeros(s[i + 1]))

    def names(self) -> list[str]:
        return [k.replace("_", ".", 1) for k in self.params.keys()]

    def forward(self, x, y, us, theta_logits, lambda0, ce_scale, T):
        h, penalty = x, torch.zeros(())
        for i in range(self.n):
            W, b = self.params[f"fc{i}_weight"], self.params[f"fc{i}_bias"]
            h = h @ W.t() + b
            if i < self.n - 1:
                h = torch.relu(h)
                norm = torch.sqrt((W * W).sum(1) + b * b).detach()
                logit_pi = (norm - softplus(self.params[f"fc{i}_v"])) / T
                h = h * hard_concrete(logit_pi + LOG_RATIO, us[i])
                pi = torch.sigmoid(logit_pi)
                th = theta_logits[i]
                h_ce = -(pi * nn.functional.logsigmoid(th) + (1 - pi) * nn.functional.logsigmoid(-th))
                penalty = penalty + lambda0 * pi.sum() + ce_scale * h_ce.sum()
        return nn.functional.cross_entropy(h, y) + penalty


class TorchGated:
    """The gated objective behind TorchTrainer (objective ``fedsparse``)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.model = GatedMLP(spec)
        self._p = {n: self.model.params[n.replace(".", "_")] for n in self.model.names()}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for k, a in weights.items():
                p = self._p[k]
                if tuple(a.shape) != tuple(p.shape):
                    raise ValueError(f"{k}: shape {a.shape}, program wants {tuple(p.shape)}")
                p.copy_(torch.from_numpy(np.array(a, np.float32)))

    def get_weights(self) -> dict[str, np.ndarray]:
        return {k: p.detach().numpy().copy() for k, p in self._p.items()}

    def loss_and_grads(self, b: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        for p in self._p.values():
            p.grad = None
        nh = self.model.n - 1
        loss = self.model(torch.from_numpy(b["x"]), torch.from_numpy(b["y"]),
                          [torch.from_numpy(b[f"u{i}"]) for i in range(nh)],
                          [torch.from_numpy(b[f"theta_logit{i}"]) for i in range(nh)],
                          torch.tensor(float(b["lambda0"])), torch.tensor(float(b["ce_scale"])),
                          torch.tensor(float(b["T"])))
        loss.backward()
        return float(loss.detach()), {k: p.grad.numpy().copy() for k, p in self._p.items()}
