"""Structured slicing: the physically smaller dense model of the surviving gate groups, and back.

Given the kept groups per gated layer (see :func:`export.models.gate_groups`), :func:`plan_subnet`
returns the small spec and, per global tensor, the index along each axis that the small tensor
occupies. :func:`slice_weights` gathers a device's weights; :func:`scatter` writes a sliced update
(new weights, deltas, gradients) back into global-shaped arrays; :func:`masks` gives the global
boolean mask of entries a subnetwork touches (what the Update contract sends).

A dropped group's output is zero in the masked full model (its row and bias are zero, ReLU(0) = 0),
so the sliced model computes exactly what the full model computes with those groups masked.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge.model import ModelSpec, param_shapes

from .models import gate_groups

Index = tuple[np.ndarray, ...]  # one int64 index array per axis of a global tensor


@dataclass(frozen=True)
class Subnet:
    """A subnetwork: its dense spec, the kept groups, and per-tensor index maps into the global model."""

    spec: ModelSpec
    full_spec: ModelSpec
    keep: dict[str, np.ndarray]
    index: dict[str, Index]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(len(i) for i in ix) for k, ix in self.index.items()}


def plan_subnet(spec: ModelSpec, keep: dict[str, np.ndarray | list[int]]) -> Subnet:
    """The subnetwork of ``spec`` keeping ``keep[layer]`` groups (layers not named keep everything).

    Every gated layer must keep at least one group; indices are sorted and deduplicated.
    """
    groups = gate_groups(spec)
    by_layer = {g.layer: g for g in groups}
    unknown = set(keep) - set(by_layer)
    if unknown:
        raise ValueError(f"not gated layers: {sorted(unknown)} (gated: {sorted(by_layer)})")
    kept: dict[str, np.ndarray] = {}
    for g in groups:
        k = np.unique(np.asarray(keep.get(g.layer, np.arange(g.size)), dtype=np.int64))
        if k.size == 0:
            raise ValueError(f"{g.layer}: at least one group must survive")
        if k.min() < 0 or k.max() >= g.size:
            raise ValueError(f"{g.layer}: group index out of range 0..{g.size - 1}")
        kept[g.layer] = k
    shapes = param_shapes(spec)
    index: dict[str, Index] = {}
    # input columns each layer reads: the producer's kept groups (expanded by span), else everything
    cols: dict[str, np.ndarray] = {}
    for g in groups:
        k = kept[g.layer]
        cols[g.consumer] = (k[:, None] * g.span + np.arange(g.span)[None, :]).reshape(-1)
    for name, shape in shapes.items():
        layer = name.rsplit(".", 1)[0]
        rows = kept.get(layer, np.arange(shape[0], dtype=np.int64))
        ix: list[np.ndarray] = [rows]
        if len(shape) > 1:
            ix.append(cols.get(layer, np.arange(shape[1], dtype=np.int64)))
            ix.extend(np.arange(s, dtype=np.int64) for s in shape[2:])
        index[name] = tuple(ix)
    return Subnet(_small_spec(spec, kept, groups), spec, kept, index)


def _small_spec(spec: ModelSpec, kept: dict[str, np.ndarray], groups) -> ModelSpec:
    small = dict(spec)
    sizes = list(spec["sizes"])
    if spec["arch"] == "cnn":
        convs = [list(c) for c in spec["convs"]]
        for i, c in enumerate(convs):
            c[0] = int(len(kept[f"conv{i}"]))
        small["convs"] = convs
        last = next(g for g in groups if g.layer == f"conv{len(convs) - 1}")
        sizes[0] = int(len(kept[last.layer]) * last.span)
    for i in range(1, len(sizes) - 1):
        sizes[i] = int(len(kept[f"fc{i - 1}"]))
    small["sizes"] = sizes
    return small


def slice_weights(sub: Subnet, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The subnetwork's dense weights (copies), in the small spec's parameter order."""
    out = {}
    for name in param_shapes(sub.spec):
        out[name] = np.ascontiguousarray(weights[name][np.ix_(*sub.index[name])])
    return out


def scatter(sub: Subnet, small: dict[str, np.ndarray], into: dict[str, np.ndarray],
            add: bool = False) -> dict[str, np.ndarray]:
    """Write (or with ``add``, accumulate) sliced tensors into copies of the global ``into`` arrays."""
    out = {k: np.array(v, copy=True) for k, v in into.items()}
    want = sub.shapes()
    for name, v in small.items():
        v = np.asarray(v)
        if v.shape != want[name]:
            raise ValueError(f"{name}: shape {v.shape}, subnet has {want[name]}")
        ix = np.ix_(*sub.index[name])
        if add:
            out[name][ix] += v
        else:
            out[name][ix] = v
    return out


def masks(sub: Subnet) -> dict[str, np.ndarray]:
    """Per global tensor, True where the subnetwork has an entry."""
    out = {}
    for name, shape in param_shapes(sub.full_spec).items():
        m = np.zeros(shape, bool)
        m[np.ix_(*sub.index[name])] = True
        out[name] = m
    return out


def masked_weights(sub: Subnet, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The full model with dropped groups switched off: their rows and biases zeroed."""
    out = {}
    for name, w in weights.items():
        rows = np.zeros(w.shape[0], bool)
        rows[sub.index[name][0]] = True
        out[name] = np.where(rows.reshape((-1,) + (1,) * (w.ndim - 1)), w, 0).astype(w.dtype)
    return out
