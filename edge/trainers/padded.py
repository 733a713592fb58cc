"""One program for every subnetwork: a trainer whose program was exported at a larger shape (a *bucket*) runs a
smaller network of the same objective, padded (docs/protocol.md section 14.2, docs/trainers.md).

A FedSparse plan holds a pruned MLP, a FedMix plan a subset of the experts; the coordinator serves a device that
declares the ``padded_programs`` extension the program of the smallest bucket that holds the plan (its full shape,
or every hidden layer at 1/2 or 1/4 of its width; FedMix: all K slots, or K/2, K/4), so a run exports a few
programs per (model, runtime, objective) however the model is pruned. The plan's weights, the update and every
byte on the wire stay those of the smaller network; only the device pads, here:

- ``set_weights``: every fed tensor is written into the leading corner of a zero array of the program's shape
  (a parameter not fed at all, such as a FedMix slot the device does not hold, stays zero);
- ``loss_and_grads``: every fed input is padded the same way, with the value the program's ``padding`` names for
  it (default 0), an input not fed is that value throughout; the gradients come back cut to the fed shapes, and
  the auxiliary outputs the program's ``padding`` names are cut to the fed slots.

The objective guarantees that a padded unit or slot contributes nothing (torch_objectives/objective.py:
``Objective.padding``; tests/test_padded.py checks it against the unpadded program on every runtime), so the loss
and the gradients of the fed entries are the smaller network's. The device computes on the bucket's shapes:
compute shrinks by bucket, not by unit.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..model import is_module
_DT = {"f4": np.float32, "i8": np.int64}


def applies(trainer: Any) -> bool:
    """Whether ``trainer``'s program declares how it serves smaller networks."""
    return getattr(trainer, "padding", None) is not None


def _pad(a: np.ndarray, shape: tuple[int, ...], value: float, what: str) -> np.ndarray:
    if a.shape == shape:
        return a
    if a.ndim != len(shape) or any(s > t for s, t in zip(a.shape, shape)):
        raise ValueError(f"{what}: shape {a.shape} does not fit the program's {shape}")
    out = np.full(shape, value, a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def active_spec(spec: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """The network the plan's weights describe: an MLP program's spec with the hidden widths of the plan's
    ``fc{i}`` tensors (FedSparse's pruned network); the program's spec when the plan holds no such tensors."""
    if is_module(spec) or spec.get("arch") != "mlp":
        return spec
    sizes = list(spec["sizes"])
    names = [f"fc{i}.weight" for i in range(len(sizes) - 1)]
    if not all(n in weights for n in names):
        return spec
    out = dict(spec)
    out["sizes"] = [int(np.shape(weights[names[0]])[1])] + [int(np.shape(weights[n])[0]) for n in names]
    return out


class PaddedTrainer:
    """``inner`` (a loaded trainer whose program has a ``padding``) running the network of ``plan_weights``."""

    def __init__(self, inner: Any, plan_weights: dict[str, np.ndarray]):
        if not applies(inner):
            raise ValueError("the program does not declare a padding")
        self.inner = inner
        self.spec = active_spec(inner.spec, plan_weights)
        pad = inner.padding
        self._in_pad: dict[str, float] = {k: float(v) for k, v in (pad.get("inputs") or {}).items()}
        self._aux_cut: dict[str, list[tuple[int, str]]] = {k: [(int(a), str(n)) for a, n in v]
                                                           for k, v in (pad.get("aux") or {}).items()}
        self._shapes = {k: tuple(int(d) for d in s) for k, s in inner.shapes.items()}
        self._bufs = {k: np.zeros(s, np.float32) for k, s in self._shapes.items()}
        self._fed: dict[str, tuple[int, ...]] = {}

    def __getattr__(self, name: str) -> Any:  # runtime, objective_name, params, inputs, outputs, layout, ...
        return getattr(self.inner, name)

    @property
    def padded(self) -> bool:
        """Whether the last weights set were smaller than the program (anything was padded)."""
        return any(self._fed.get(k) != s for k, s in self._shapes.items())

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        unknown = set(weights) - set(self._shapes)
        if unknown:
            raise ValueError(f"weights {sorted(unknown)[:5]} are not parameters of this program")
        fed = {}
        for k, want in self._shapes.items():
            buf = self._bufs[k]
            if k not in weights:
                buf[...] = 0.0
                continue
            a = np.asarray(weights[k], np.float32)
            if a.ndim != len(want) or any(s > t for s, t in zip(a.shape, want)):
                raise ValueError(f"{k}: shape {a.shape} does not fit the program's {want}")
            fed[k] = a.shape
            if a.shape != want:
                old = self._fed.get(k)
                if old != a.shape:
                    buf[...] = 0.0  # the padding is zero (entries outside the last fed shape too)
                buf[tuple(slice(0, s) for s in a.shape)] = a
            else:
                buf[...] = a
        self.inner.set_weights(self._bufs)
        self._fed = fed

    def get_weights(self) -> dict[str, np.ndarray]:
        w = self.inner.get_weights()
        return {k: np.ascontiguousarray(w[k][tuple(slice(0, s) for s in shape)]) for k, shape in self._fed.items()}

    def _feeds(self, given: dict[str, Any]) -> dict[str, np.ndarray]:
        declared = {i.name: i for i in self.inner.inputs}
        unknown = set(given) - set(declared)
        if unknown:
            raise ValueError(f"inputs {sorted(unknown)[:5]} are not inputs of this program")
        n = len(given["x"])
        out: dict[str, np.ndarray] = {}
        for name, i in declared.items():
            want = tuple(n if d == "B" else int(d) for d in i.shape)
            value = self._in_pad.get(name, 0.0)
            if name not in given:
                if name != "w":  # w defaults to 1/N in the backend (trainers/base.py: feeds)
                    out[name] = np.full(want, value, _DT[i.dtype])
                continue
            a = np.asarray(given[name], _DT[i.dtype])
            if name == "x":
                a = a.reshape(n, -1)
            out[name] = _pad(a, want, value, f"input {name}")
        return out

    def loss_and_grads(self, inputs: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray],
                                                                       dict[str, np.ndarray]]:
        loss, grads, aux = self.inner.loss_and_grads(self._feeds(inputs))
        g = {k: (v if v.shape == self._fed[k] else np.ascontiguousarray(v[tuple(slice(0, s) for s in self._fed[k])]))
             for k, v in grads.items() if k in self._fed}
        out = {}
        for name, a in aux.items():
            cut = [slice(None)] * a.ndim
            for axis, by in self._aux_cut.get(name, ()):
                if by in inputs:
                    cut[axis] = slice(0, int(np.shape(inputs[by])[0]))
            out[name] = a[tuple(cut)]
        return loss, g, out

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        raise ValueError("a padded program computes loss_and_grads only (its optimiser runs in numpy)")

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        raise ValueError("a padded program computes loss_and_grads only")


__all__ = ["PaddedTrainer", "applies", "active_spec"]
