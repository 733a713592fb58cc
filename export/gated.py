"""FedSparse's gated objective as exportable torch graphs (ORT and ExecuTorch).

The math is :mod:`edge.trainers.torch_gated` op for op (same order of operations), so the exported
loss and gradients equal the torch reference's. Two things differ in how it is written, not in what it
computes:

- log-sigmoid of the server gate logits is ``-softplus(-th)`` with the softplus of
  :func:`edge.trainers.torch_gated.softplus`: the ONNX exporter writes ``logsigmoid`` as
  ``Log(Sigmoid(th))``, which is ``-inf`` for the logits of thousands that T = 1e-3 gives, and
  ``0 * -inf`` is NaN.
- The group norm is detached in the reference. ExecuTorch's joint graph honours ``detach``; an ONNX
  graph has no stop-gradient, so for ORT (``norm_inputs=True``) the norm is computed from *copies* of
  the weights that come in as graph inputs (``nw{i}``, ``nb{i}``), which the backend feeds with the
  current parameters. ORT then has no path from the norm to a trainable parameter.
"""
from __future__ import annotations

import torch
from torch import nn

from edge.gates import BETA, GAMMA, LOG_RATIO, ZETA
from edge.model import ModelSpec, init_weights, param_shapes


def softplus(v: torch.Tensor) -> torch.Tensor:
    """max(v, 0) + log(1 + exp(-|v|)), as the reference (ORT has no Softplus gradient)."""
    return torch.clamp(v, min=0) + torch.log(1 + torch.exp(-torch.abs(v)))


def hard_concrete(log_alpha: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + log_alpha) / BETA)
    return torch.clamp(s * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def gated_inputs(spec: ModelSpec) -> list[str]:
    """Non-parameter inputs of the gated objective, by name (what ``loss_and_grads`` takes)."""
    nh = len(spec["sizes"]) - 2
    return (["x", "y"] + [f"u{i}" for i in range(nh)] + [f"theta_logit{i}" for i in range(nh)]
            + ["lambda0", "ce_scale", "T"])


def gated_param_names(spec: ModelSpec) -> list[str]:
    """Parameters of the gated program: the spec's, then ``fc{i}.v`` per hidden layer."""
    nh = len(spec["sizes"]) - 2
    return list(param_shapes(spec)) + [f"fc{i}.v" for i in range(nh)]


class GatedObjective(nn.Module):
    """forward(x, y, w, u..., theta_logit..., lambda0, ce_scale, T[, nw..., nb...]) -> loss.

    ``w`` weights the per-row cross-entropy (the backend feeds 1/N per row), as in the plain
    ExecuTorch programs; ``weighted=False`` uses torch's mean instead (no ``w`` input).
    """

    def __init__(self, spec: ModelSpec, *, norm_inputs: bool, weighted: bool):
        super().__init__()
        if spec["arch"] != "mlp":
            raise ValueError("gated programs exist for MLPs only")
        s = spec["sizes"]
        self.n = len(s) - 1
        self.nh = self.n - 1
        self.norm_inputs, self.weighted = norm_inputs, weighted
        w0 = init_weights(spec, 0)
        for i in range(self.n):
            lin = nn.Linear(s[i], s[i + 1])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w0[f"fc{i}.weight"]))
                lin.bias.copy_(torch.from_numpy(w0[f"fc{i}.bias"]))
            if i < self.nh:
                lin.v = nn.Parameter(torch.zeros(s[i + 1]))
            setattr(self, f"fc{i}", lin)

    def forward(self, x, y, *rest):
        rest = list(rest)
        w = rest.pop(0) if self.weighted else None
        nh = self.nh
        us, ths = rest[:nh], rest[nh:2 * nh]
        lambda0, ce_scale, T = rest[2 * nh:2 * nh + 3]
        norms_in = rest[2 * nh + 3:]
        h, penalty = x, None
        for i in range(self.n):
            lin = getattr(self, f"fc{i}")
            W, b = lin.weight, lin.bias
            h = h @ W.t() + b
            if i < nh:
                h = torch.relu(h)
                if self.norm_inputs:
                    nw, nb = norms_in[i], norms_in[nh + i]
                    norm = torch.sqrt((nw * nw).sum(1) + nb * nb)
                else:
                    norm = torch.sqrt((W * W).sum(1) + b * b).detach()
                logit_pi = (norm - softplus(lin.v)) / T
                h = h * hard_concrete(logit_pi + LOG_RATIO, us[i])
                pi = torch.sigmoid(logit_pi)
                th = ths[i]
                h_ce = -(pi * -softplus(-th) + (1 - pi) * -softplus(th))
                term = lambda0 * pi.sum() + ce_scale * h_ce.sum()
                penalty = term if penalty is None else penalty + term
        if self.weighted:
            ce = (nn.functional.cross_entropy(h, y, reduction="none") * w).sum()
        else:
            ce = nn.functional.cross_entropy(h, y)
        return ce + penalty if penalty is not None else ce


def example_inputs(spec: ModelSpec, n: int, *, norm_inputs: bool, weighted: bool) -> tuple[torch.Tensor, ...]:
    s = spec["sizes"]
    nh = len(s) - 2
    ins = [torch.zeros(n, s[0]), torch.zeros(n, dtype=torch.long)]
    if weighted:
        ins.append(torch.full((n,), 1.0 / n))
    ins += [torch.full((s[i + 1],), 0.5) for i in range(nh)]
    ins += [torch.zeros(s[i + 1]) for i in range(nh)]
    ins += [torch.tensor(1e-3), torch.tensor(1e-4), torch.tensor(1.0)]
    if norm_inputs:
        ins += [torch.zeros(s[i + 1], s[i]) for i in range(nh)] + [torch.zeros(s[i + 1]) for i in range(nh)]
    return tuple(ins)


__all__ = ["GatedObjective", "gated_inputs", "gated_param_names", "example_inputs", "softplus", "hard_concrete"]
