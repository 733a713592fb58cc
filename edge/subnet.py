"""Structured slicing: the physically smaller dense model of the surviving gate groups, and back.

One implementation for everything that slices (the coordinator's plans, pruned exports, tests), in numpy,
beside the model specs it reads. A *gate group* is the unit structured sparsity switches on or off as a
whole: one output neuron of a hidden linear layer (a row of ``fc{i}.weight`` plus ``fc{i}.bias[i]``) or one
output channel of a conv (``conv{i}.weight[c]`` plus ``conv{i}.bias[c]``); the classifier's outputs are never
gated. Switching a group off also removes what its output feeds: the matching input column(s) of the next
layer (for the last conv, the ``H*W`` flattened columns of that channel in ``fc0``).

A group's *members* say where it lives: ``(tensor, axis, span, offset)``, group g owning entries
``offset + g*span ... offset + (g+1)*span - 1`` along ``axis``. The zoo's groups have three members (rows of
the weight and the bias, columns of the consumer); a person's module has the groups its graph implies
(edge/trainers/torch_objectives/usermodel.py reads them with torch.fx and writes them into the spec): norm
layers' parameters and running statistics, several consumers after a concatenation, the layers on both
sides of a residual add tied into one group.

Given the kept groups per gated layer (:func:`gate_groups`), :func:`plan_subnet`
returns the small spec and, per global tensor, the index along each axis that the small tensor
occupies. :func:`slice_weights` gathers a device's weights; :func:`scatter` writes a sliced update
(new weights, deltas, gradients) back into global-shaped arrays; :func:`masks` gives the global
boolean mask of entries a subnetwork touches (what the Update contract sends).

A dropped group contributes nothing in the masked full model (its rows and the columns it feeds are zero),
so the sliced model computes exactly what the full model computes with those groups masked (for a module,
except through a LayerNorm over the gated units, which renormalises over the survivors: ``exact`` False).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import ModelSpec, is_module, param_shapes, tensor_shapes

Index = tuple[np.ndarray, ...]  # one int64 index array per axis of a global tensor
Member = tuple[str, int, int, int]  # (tensor, axis, span, offset)


@dataclass(frozen=True)
class GateGroup:
    """One gated layer: ``size`` groups; ``members`` where each group lives; ``norm`` the tensors of the
    group's own weights (its rows of the layers it is an output of), whose norm FedSparse's gate reads."""

    layer: str
    size: int
    members: tuple[Member, ...]
    norm: tuple[str, ...]
    exact: bool = True

    @property
    def params(self) -> tuple[str, ...]:
        return self.norm

    @property
    def consumer(self) -> str:
        """The (first) layer whose input the group feeds."""
        return next(t for t, axis, _s, _o in self.members if axis == 1).rsplit(".", 1)[0]

    @property
    def span(self) -> int:
        """Input columns per group in that consumer."""
        return next(s for _t, axis, s, _o in self.members if axis == 1)


def gate_groups(spec: ModelSpec) -> list[GateGroup]:
    """Gate groups of a spec, in layer order; the classifier (last linear) has none."""
    if is_module(spec):
        return [GateGroup(str(g["layer"]), int(g["size"]), tuple((str(t), int(a), int(s), int(o))
                                                                 for t, a, s, o in g["members"]),
                          tuple(g["norm"]), bool(g.get("exact", True))) for g in spec.get("groups", [])]
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
        own = (f"{layer}.weight", f"{layer}.bias")
        out.append(GateGroup(layer, size, ((own[0], 0, 1, 0), (own[1], 0, 1, 0), (f"{nxt}.weight", 1, span, 0)),
                             own))
    return out


def is_residual(group: GateGroup) -> bool:
    """Whether the group's units are rows of several layers whose outputs are added (a residual stream)."""
    return len({name.rsplit(".", 1)[0] for name in group.norm}) > 1


def pruned_groups(spec: ModelSpec) -> list[GateGroup]:
    """The groups the pruning algorithms (FedSparse, FedL1, random pruning) switch: the zoo's hidden linear
    layers ``fc{i}`` (not its convolutions), or the groups read from a module's graph but its residual streams.

    A residual stream's channel is one group across every block it runs through; gating it drops the channel
    from the whole trunk at once. FedSparse pruned that group while accuracy was still low and reached 0.81x
    FedAvg on the residual net of benchmarks/unseen_zoo.py; gating only the channels inside the blocks (as
    channel pruning of ResNets usually does) is docs/fedsparse.md's reading, where the paper is silent."""
    gs = gate_groups(spec)
    if is_module(spec):
        return [g for g in gs if not is_residual(g)]
    return [g for g in gs if g.layer.startswith("fc")]


def own_rows(group: GateGroup, weights: dict[str, np.ndarray], name: str) -> np.ndarray:
    """View of norm tensor ``name`` as [groups, entries of one group] (a view: writing to it writes the tensor)."""
    span = next(s for t, a, s, _o in group.members if t == name and a == 0)
    return weights[name][:group.size * span].reshape(group.size, -1)


def group_norms(group: GateGroup, weights: dict[str, np.ndarray]) -> np.ndarray:
    """||w_g|| per group over the group's own weights (for the zoo: a unit's weight row and its bias), float64."""
    total = np.zeros(group.size)
    for name in group.norm:
        w = weights[name]
        span = next(s for t, a, s, _o in group.members if t == name and a == 0)
        total = total + (w[:group.size * span].astype(np.float64) ** 2).reshape(group.size, -1).sum(axis=1)
    return np.sqrt(total)


def group_sizes(group: GateGroup, shapes: dict[str, tuple[int, ...]]) -> int:
    """Weights in one group of ``group``: the entries of its own rows in the tensors its norm reads (for the zoo:
    a unit's weight row and its bias; a conv channel's filter and bias; every tied row of a residual group).
    ``shapes``: the spec's parameter shapes (model.param_shapes). FedSparse's per-weight L0 charges each
    group this many times lambda0 (docs/fedsparse.md)."""
    total = 0
    for name in group.norm:
        span = next(s for t, a, s, _o in group.members if t == name and a == 0)
        shape = shapes[name]
        total += span * int(np.prod(shape[1:], dtype=np.int64))
    return int(total)


@dataclass(frozen=True)
class Subnet:
    """A subnetwork: its dense spec, the kept groups, and per-tensor index maps into the global model."""

    spec: ModelSpec
    full_spec: ModelSpec
    keep: dict[str, np.ndarray]
    index: dict[str, Index]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(len(i) for i in ix) for k, ix in self.index.items()}

    def whole(self, name: str) -> bool:
        """Whether the subnetwork has all of tensor ``name`` (then slicing and scattering are plain copies)."""
        cache = self.__dict__.setdefault("_whole", {})
        if name not in cache:
            full = tensor_shapes(self.full_spec)[name]
            cache[name] = all(len(ix) == n for ix, n in zip(self.index[name], full))
        return cache[name]

    def rows(self, name: str) -> np.ndarray:
        """The global rows (groups, for a gated layer's tensors) that tensor ``name`` keeps."""
        return self.index[name][0]


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
    shapes = tensor_shapes(spec)
    # per (tensor, axis): which entries survive; entries no group owns always do
    alive: dict[tuple[str, int], np.ndarray] = {}
    for g in groups:
        k = kept[g.layer]
        for t, axis, span, off in g.members:
            m = alive.setdefault((t, axis), np.ones(shapes[t][axis], bool))
            m[off:off + g.size * span] = False
            m[(off + k[:, None] * span + np.arange(span)[None, :]).reshape(-1)] = True
    index: dict[str, Index] = {}
    for name, shape in shapes.items():
        index[name] = tuple(np.flatnonzero(alive[(name, a)]) if (name, a) in alive else np.arange(n, dtype=np.int64)
                            for a, n in enumerate(shape))
    small = _small_module_spec(spec, kept, groups, index, alive) if is_module(spec) else _small_spec(spec, kept, groups)
    return Subnet(small, spec, kept, index)


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


def _small_module_spec(spec: ModelSpec, kept, groups, index, alive) -> ModelSpec:
    """The module spec at the sliced shapes: tensors' shapes, groups' sizes and their members' offsets (an
    offset moves down by the entries dropped before it)."""
    small = dict(spec)
    small["params"] = [[n, [len(i) for i in index[n]]] for n, _s in spec["params"]]
    small["buffers"] = [[n, [len(i) for i in index[n]]] for n, _s in spec.get("buffers", [])]
    out = []
    for g, raw in zip(groups, spec.get("groups", [])):
        members = [[t, a, s, int(np.count_nonzero(alive[(t, a)][:o]))] for t, a, s, o in g.members]
        out.append(dict(raw) | {"size": int(len(kept[g.layer])), "members": members})
    small["groups"] = out
    return small


def take(sub: Subnet, name: str, w: np.ndarray) -> np.ndarray:
    """The subnetwork's part of global tensor ``name`` (a copy)."""
    return w.copy() if sub.whole(name) else np.ascontiguousarray(w[np.ix_(*sub.index[name])])


def slice_weights(sub: Subnet, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The subnetwork's dense weights (copies), in the small spec's parameter order (then its buffers, when
    ``weights`` has them)."""
    return {name: take(sub, name, weights[name]) for name in tensor_shapes(sub.spec) if name in weights}


def scatter_add(sub: Subnet, name: str, target: np.ndarray, sliced: np.ndarray) -> None:
    """target[subnet's entries of ``name``] += sliced, in place (a plain add when nothing was sliced away:
    the common dense case, ~10x faster than fancy indexing)."""
    if sub.whole(name):
        target += sliced
    else:
        target[np.ix_(*sub.index[name])] += sliced


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
    """The full model with dropped groups switched off: every entry they own zeroed (their rows, biases and
    norm parameters, and the columns they feed, so that an activation with f(0) != 0 adds nothing either)."""
    out = {k: np.array(v, copy=True) for k, v in weights.items()}
    keep = {}
    for g in gate_groups(sub.full_spec):
        k = np.zeros(g.size, bool)
        k[sub.keep[g.layer]] = True
        keep[g.layer] = k
    zero_dead(sub.full_spec, out, keep)
    return out


def zero_dead(spec: ModelSpec, weights: dict[str, np.ndarray], keep: dict[str, np.ndarray]) -> None:
    """In place: every entry of a dropped group (rows, norm parameters, the columns it feeds) set to 0, for the
    tensors of ``weights`` (``keep``: per gated layer, a boolean mask over its groups)."""
    zero_dead_groups(gate_groups(spec), weights, keep)


def zero_dead_groups(groups: list[GateGroup], weights: dict[str, np.ndarray], keep: dict[str, np.ndarray]) -> None:
    """:func:`zero_dead` for the given groups."""
    for g in groups:
        k = keep.get(g.layer)
        if k is None:
            continue
        dead = np.flatnonzero(~np.asarray(k, bool))
        if dead.size == 0:
            continue
        for t, axis, span, off in g.members:
            if t not in weights:
                continue
            ix = (off + dead[:, None] * span + np.arange(span)[None, :]).reshape(-1)
            sl = [slice(None)] * weights[t].ndim
            sl[axis] = ix
            weights[t][tuple(sl)] = 0.0
