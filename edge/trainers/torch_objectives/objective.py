"""The objective contract: an algorithm's training objective, written once in torch.

The torch trainer runs an :class:`Objective` as it is; the exporters (``export/ort.py``,
``export/executorch.py``) lower the same module to ONNX Runtime training artifacts and to an ExecuTorch
training program. So every runtime computes one definition, and the forms that are safe on every runtime
are chosen here, once:

- **No in-graph randomness**: noise (hard-concrete ``u``) comes in as inputs, drawn in numpy by the client.
- **No stop-gradient**: ONNX has none, so anything the math detaches (FedSparse's group norms) comes in as
  an input the client computes.
- **Row weights** ``w`` on every data term (``sum_i w_i l_i``): the trainer feeds 1/N per row and 0 for
  padding, so a program with a fixed batch still computes torch's batch mean.
- **Softplus** as ``max(v, 0) + log(1 + exp(-|v|))`` (ORT has no Softplus gradient) and log-sigmoid as
  ``-softplus(-x)`` (ONNX writes ``logsigmoid`` as ``Log(Sigmoid)``, -inf at logits of thousands).
- **Cross-entropy** as log-softmax times a one-hot of y (:func:`log_likelihood`; ORT cannot differentiate
  the ONNX loss op torch writes for a per-row cross-entropy).
- **Auxiliary outputs** (logits, per-sample tables) are detached and per row (batch first): only the loss is
  differentiated.

A program is (objective name, model spec, layout): the layout is what else fixes the parameter shapes
(the experts a FedMix device holds, say). Parameters are registered under their plan names (``fc0.weight``,
``s1.fc0.v``), which become the ONNX initializer names and ExecuTorch parameter names unchanged.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ...model import ModelSpec
from ..base import Input


def batch_inputs(n_features: int) -> list[Input]:
    """x, y and the row weights w: the data every objective starts from."""
    return [Input("x", ("B", n_features)), Input("y", ("B",), "i8"), Input("w", ("B",))]


class Objective(nn.Module):
    """forward(*inputs in :meth:`inputs` order) -> (loss, *aux in :attr:`aux` order)."""

    name: ClassVar[str]
    aux: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec: ModelSpec, layout: dict[str, Any] | None = None):
        super().__init__()
        self.spec = spec
        self.layout = dict(layout or {})
        self._names: list[str] = []

    def param(self, name: str, shape: tuple[int, ...]) -> nn.Parameter:
        """Register a parameter under its plan name (dots make submodules, so state_dict keys match)."""
        *path, leaf = name.split(".")
        m: nn.Module = self
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, nn.Module())
            m = getattr(m, p)
        t = nn.Parameter(torch.zeros(shape))
        m.register_parameter(leaf, t)
        self._names.append(name)
        return t

    def params(self) -> dict[str, nn.Parameter]:
        """Parameters by plan name, in registration order."""
        own = dict(self.named_parameters())
        return {n: own[n] for n in self._names}

    def inputs(self) -> list[Input]:
        raise NotImplementedError

    def outputs(self) -> list[str]:
        return ["loss", *self.aux]

    def padding(self) -> dict[str, Any] | None:
        """How this program serves a smaller network of the same objective (edge/trainers/padded.py), or None
        when it cannot. A device feeds the smaller network's weights and inputs; every parameter and input is
        zero-padded at the end of each axis up to the program's shape (a parameter it does not feed is all
        zeros), except the inputs named in ``"inputs"``, padded with the value given; gradients come back
        sliced to the fed shapes, and each auxiliary output named in ``"aux"`` is cut, along each
        ``[axis, input]`` pair, to the fed length of that input's first axis. An objective returns a padding
        only if, so padded, its loss and the gradients of the fed entries are exactly those of the smaller
        network (padded units output nothing, pass no gradient and add no penalty): tests/test_padded.py
        holds each to that."""
        return None

    def example(self, batch: int = 4) -> tuple[torch.Tensor, ...]:
        """Inputs of the right shapes for tracing (values chosen so every op is defined)."""
        out = []
        for i in self.inputs():
            shape = [batch if d == "B" else int(d) for d in i.shape]
            if i.dtype == "i8":
                out.append(torch.zeros(shape, dtype=torch.long))
            elif i.name == "w":
                out.append(torch.full(shape, 1.0 / batch))
            elif i.name.startswith("u"):
                out.append(torch.full(shape, 0.5))
            elif i.name == "T":
                out.append(torch.ones(shape))
            else:
                out.append(torch.zeros(shape))
        return tuple(out)


def softplus(v: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(v)) in the form every runtime differentiates (ORT has no Softplus gradient)."""
    return torch.clamp(v, min=0) + torch.log(1 + torch.exp(-torch.abs(v)))


def one_hot(y: torch.Tensor, classes: int, dtype: torch.dtype) -> torch.Tensor:
    """y as one-hot rows, written as a comparison (every runtime has Equal and Cast)."""
    return (y.unsqueeze(1) == torch.arange(classes).unsqueeze(0)).to(dtype)


def log_likelihood(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y_i | x_i) per row, as log-softmax times a one-hot: ``cross_entropy(reduction="none")`` exports as
    ONNX SoftmaxCrossEntropyLoss without its log-prob output, and ORT's gradient builder needs that output."""
    return (torch.log_softmax(logits, dim=1) * one_hot(y, logits.shape[1], logits.dtype)).sum(1)


def weighted_ce(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_i w_i CE(logits_i, y_i): torch's batch mean when w = 1/N, padding rows weigh 0."""
    return -(log_likelihood(logits, y) * w).sum()
