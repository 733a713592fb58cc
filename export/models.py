"""The model zoo as torch modules, each declaring its gate groups.

A *gate group* is the unit that structured sparsity switches on or off as a whole: one output neuron
of a hidden linear layer (a row of ``fc{i}.weight`` plus ``fc{i}.bias[i]``) or one output channel of a
conv (``conv{i}.weight[c]`` plus ``conv{i}.bias[c]``). The output layer's classes are never gated.
Switching a group off also removes what its output feeds: the matching input column(s) of the next
layer (for the last conv, the ``H*W`` flattened columns of that channel in ``fc0``).

The modules are :class:`edge.trainers.torch_backend.SpecNet` (the torch reference), so the exported
programs and the reference trainer share one definition and one set of parameter names.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edge.model import ModelSpec, init_weights, lenet, mlp, param_shapes
from edge.trainers.torch_backend import SpecNet, build_module

ZOO: dict[str, ModelSpec] = {
    "mlp": mlp([64, 200, 200, 10]),
    "cnn": lenet((1, 8, 8), 10),
}


@dataclass(frozen=True)
class GateGroup:
    """One gated layer: ``size`` groups along axis 0 of ``params``; the layer's output feeds
    ``consumer``'s input axis 1, ``span`` consecutive columns per group."""

    layer: str
    size: int
    params: tuple[str, ...]
    consumer: str
    span: int


def gate_groups(spec: ModelSpec) -> list[GateGroup]:
    """Gate groups of a spec, in layer order; the classifier (last linear) has none."""
    shapes = param_shapes(spec)
    layers: list[str] = []
    for name in shapes:
        layer = name.rsplit(".", 1)[0]
        if layer not in layers:
            layers.append(layer)
    out = []
    for i, layer in enumerate(layers[:-1]):
        nxt = layers[i + 1]
        size = shapes[f"{layer}.weight"][0]
        span = 1
        if layer.startswith("conv") and nxt.startswith("fc"):
            span = shapes[f"{nxt}.weight"][1] // size  # flatten order is channel-major: c*H*W + h*W + w
        out.append(GateGroup(layer, size, (f"{layer}.weight", f"{layer}.bias"), nxt, span))
    return out


class ZooNet(SpecNet):
    """A zoo model: the reference network plus its gate-group declaration."""

    def gate_groups(self) -> list[GateGroup]:
        return gate_groups(self.spec)


def build(spec: ModelSpec, weights: dict[str, np.ndarray] | None = None, seed: int = 0) -> ZooNet:
    """The torch module for ``spec`` with ``weights`` (default: :func:`edge.model.init_weights`)."""
    net = ZooNet(spec)
    load_weights(net, init_weights(spec, seed) if weights is None else weights)
    return net


def load_weights(net: SpecNet, weights: dict[str, np.ndarray]) -> None:
    """Copy named numpy arrays into a module (names and shapes must match exactly)."""
    params = net.spec_parameters()
    if set(weights) != set(params):
        raise ValueError(f"weights {sorted(weights)} do not match {sorted(params)}")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(torch.from_numpy(np.ascontiguousarray(weights[k], dtype=np.float32)))


__all__ = ["ZOO", "GateGroup", "gate_groups", "ZooNet", "build", "load_weights", "build_module"]
