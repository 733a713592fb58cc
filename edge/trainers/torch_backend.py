"""The reference trainer: plain torch eager, built from the model spec in the program."""
from __future__ import annotations

import json

import numpy as np
import torch
from torch import nn

from ..model import ModelSpec, param_shapes


def build_module(spec: ModelSpec) -> "SpecNet":
    """The torch module for a spec; its parameter names are exactly the spec's (``fc0.weight``, ...)."""
    if spec["arch"] not in ("mlp", "cnn"):
        raise ValueError(f"unknown architecture {spec['arch']!r}")
    return SpecNet(spec)


class SpecNet(nn.Module):
    """conv{i} (+ReLU) ... flatten ... fc{i} (+ReLU except after the last).

    Attributes are named like the spec, so ``named_parameters()`` and exported ONNX initializers or
    ExecuTorch parameters carry the spec's names and no runtime needs a name map. Inputs are flat
    [N, features]; a CNN reshapes them to [N, C, H, W] inside the graph.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.n_conv = 0
        if spec["arch"] == "cnn":
            c = int(spec["input"][0])
            for i, (out_c, k, stride, pad) in enumerate(spec["convs"]):
                setattr(self, f"conv{i}", nn.Conv2d(c, out_c, k, stride=stride, padding=pad))
                c = out_c
            self.n_conv = len(spec["convs"])
            self.in_shape = tuple(int(v) for v in spec["input"])
        s = spec["sizes"]
        self.n_fc = len(s) - 1
        for i in range(self.n_fc):
            setattr(self, f"fc{i}", nn.Linear(s[i], s[i + 1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.n_conv:
            x = x.reshape(x.shape[0], *self.in_shape)
            for i in range(self.n_conv):
                x = torch.relu(getattr(self, f"conv{i}")(x))
            x = x.flatten(1)
        for i in range(self.n_fc):
            x = getattr(self, f"fc{i}")(x)
            if i < self.n_fc - 1:
                x = torch.relu(x)
        return x

    def spec_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters in the spec's order (see :func:`edge.model.param_shapes`)."""
        own = dict(self.named_parameters())
        return {k: own[k] for k in param_shapes(self.spec)}


class TorchTrainer:
    runtime = "torch"

    def __init__(self, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.model: SpecNet | None = None
        self.spec: ModelSpec | None = None

    def load(self, program: bytes) -> None:
        body = json.loads(program)
        if body.get("format") != "fedge-torch/1":
            raise ValueError("not a fedge torch program")
        self.spec = body["model"]
        self.gated = None
        if body.get("objective") == "fedsparse":
            from .torch_gated import TorchGated
            self.gated = TorchGated(self.spec)
        elif body.get("objective") == "fedmix":
            from .torch_mixture import TorchMixture
            self.gated = TorchMixture(self.spec)
        self.model = build_module(self.spec)
        self._params = self.model.spec_parameters()
        self._shapes = param_shapes(self.spec)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        if self.gated is not None:
            return self.gated.set_weights(weights)
        if set(weights) != set(self._params):
            raise ValueError(f"weights {sorted(weights)} do not match the program's {sorted(self._params)}")
        with torch.no_grad():
            for k, p in self._params.items():
                a = np.asarray(weights[k], dtype=np.float32)
                if a.shape != tuple(p.shape):
                    raise ValueError(f"{k}: shape {a.shape}, program wants {tuple(p.shape)}")
                p.copy_(torch.from_numpy(a.copy()))

    def get_weights(self) -> dict[str, np.ndarray]:
        if self.gated is not None:
            return self.gated.get_weights()
        return {k: p.detach().numpy().copy() for k, p in self._params.items()}

    def loss_and_grads(self, batch: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        """Loss and gradients for every parameter (gated programs; the optimisers run in numpy)."""
        if self.gated is None:
            raise ValueError("loss_and_grads needs a gated (fedsparse) program")
        return self.gated.loss_and_grads(batch)

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        self.model.zero_grad(set_to_none=True)
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
        loss = nn.functional.cross_entropy(self.model(xt), yt)
        loss.backward()
        with torch.no_grad():
            for p in self._params.values():
                p.sub_(p.grad, alpha=lr)
        return float(loss.detach())

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        with torch.no_grad():
            logits = self.model(torch.from_numpy(np.asarray(x, np.float32)))
            yt = torch.from_numpy(np.asarray(y, np.int64))
            loss = nn.functional.cross_entropy(logits, yt)
            acc = (logits.argmax(1) == yt).float().mean()
        return float(loss), float(acc)
