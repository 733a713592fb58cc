"""The reference trainer: the objective's torch module, run eagerly.

Program ``fedge-torch/1``: canonical JSON ``{"format", "objective", "model", "layout"}``; the module comes
from :mod:`edge.trainers.torch_objectives`, so the torch runtime computes exactly the definition the
exporters lower for the other runtimes.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from .base import feeds, is_plain
from .torch_objectives import build

FORMAT = "fedge-torch/1"


class TorchTrainer:
    runtime = "torch"

    def __init__(self, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.obj = None

    def load(self, program: bytes) -> None:
        body = json.loads(program)
        if body.get("format") != FORMAT:
            raise ValueError("not a fedge torch program")
        self.spec, self.layout = body["model"], body.get("layout") or {}
        self.objective_name = body.get("objective", "ce")
        self.obj = build(self.objective_name, self.spec, self.layout)
        self._p = self.obj.params()
        self.params = list(self._p)
        self.inputs = self.obj.inputs()
        self.outputs = self.obj.outputs()
        self.shapes = {n: tuple(p.shape) for n, p in self._p.items()}
        self.padding = self.obj.padding()

    def _need(self) -> None:
        if self.obj is None:
            raise RuntimeError("load a program first")

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self._need()
        if set(weights) != set(self._p):
            raise ValueError(f"weights {sorted(weights)} do not match the program's {sorted(self._p)}")
        arrays = {}
        for k, p in self._p.items():  # validate everything before changing anything
            a = np.asarray(weights[k], dtype=np.float32)
            if not a.flags.writeable:  # a view of received bytes: torch wants writable memory even to read it
                a = a.copy()
            if a.shape != tuple(p.shape):
                raise ValueError(f"{k}: shape {a.shape}, program wants {tuple(p.shape)}")
            arrays[k] = a
        with torch.no_grad():
            for k, a in arrays.items():
                self._p[k].copy_(torch.from_numpy(a))

    def get_weights(self) -> dict[str, np.ndarray]:
        self._need()
        return {k: p.detach().numpy().copy() for k, p in self._p.items()}

    def _forward(self, given: dict[str, np.ndarray]):
        arrays, _ = feeds(self.inputs, given)
        return self.obj(*[torch.from_numpy(a) for a in arrays])

    def loss_and_grads(self, inputs: dict[str, np.ndarray]):
        self._need()
        for p in self._p.values():
            p.grad = None
        out = self._forward(inputs)
        out[0].backward()
        grads = {k: (p.grad.numpy().copy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
                 for k, p in self._p.items()}
        aux = {name: t.numpy().copy() for name, t in zip(self.outputs[1:], out[1:])}
        return float(out[0].detach()), grads, aux

    def _plain(self) -> None:
        self._need()
        if not is_plain(self.inputs):
            raise ValueError(f"step and evaluate take cross-entropy programs, not {self.objective_name!r}")

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        self._plain()
        for p in self._p.values():
            p.grad = None
        loss = self._forward({"x": x, "y": y})[0]
        loss.backward()
        with torch.no_grad():
            for p in self._p.values():
                p.sub_(p.grad, alpha=lr)
        return float(loss.detach())

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        self._plain()
        with torch.no_grad():
            loss, logits = self._forward({"x": x, "y": y})
        return float(loss), float((logits.argmax(1).numpy() == np.asarray(y)).mean())
