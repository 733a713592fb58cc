"""A person's own ``torch.nn.Module``: loading its factory, reading its graph, running it functionally.

A user model is named by a *factory reference*, ``path/to/file.py:make`` or ``package.module:make``, where
``make()`` returns a ``torch.nn.Module``. :func:`describe` turns it into a spec (plain JSON, hashed into
program ids like the zoo's)::

    {"arch": "module", "factory": "m.py:make", "sha256": <hash of the factory's source file>,
     "input": [C, H, W] (or [F]), "classes": C,
     "params": [[name, shape], ...], "buffers": [[name, shape], ...],     # the module's own names
     "classifier": name, "groups": [{"layer", "size", "members", "norm", "exact"}, ...],
     "dropout": [p, ...]}                      # each Dropout's rate, in graph order (devices draw the masks)

A sliced spec (edge/subnet.py) is the same with smaller shapes, group sizes and offsets: the module's code
defines the graph and the layer settings (strides, eps, ...), the spec defines every shape.

**Graph.** The module is traced with ``torch.fx`` and every node is checked against what fedge can run on all
three runtimes: Linear, Conv1d/Conv2d (groups = 1), ReLU/GELU/Tanh/Sigmoid, Max/Avg/AdaptiveAvg pooling,
Flatten (and flatten-like view/reshape), Dropout, BatchNorm1d/2d, LayerNorm, GroupNorm, Identity, residual
``+`` and ``torch.cat``. Anything else is refused by :class:`ModelError` naming the layer and why, before
any export or device is involved.

**Gate groups** (:func:`analyse`) are read from the graph: an output unit of a Linear, or an output channel
of a conv, followed through activations, pooling, dropout, norm layers, flatten (one channel becomes H*W
columns) and concatenation to the input columns or channels it feeds. Residual additions tie the units on
both sides into one group; GroupNorm ties the channels of one norm group. A layer whose output cannot be
followed (it reaches the model's output, or an op that mixes units) is not gated; the classifier never is.
Members are ``[tensor, axis, span, offset]``: group g owns entries ``offset + g*span ... + span`` of the
tensor's ``axis``. Slicing a group out is exact, except through a LayerNorm over the gated units, which then
normalises over the surviving units only (``"exact": false``).

**Running it** (:class:`Network`): the traced graph is interpreted op by op from a name -> tensor mapping, in
forms every runtime differentiates correctly: max-pooling as a maximum over strided slices (ExecuTorch
1.5.1's max_pool2d backward is wrong), average pooling as a sum of slices (its backward is missing),
BatchNorm with batch statistics written out and weighted by the row weights ``w`` (train-mode batch_norm
does not lower to ExecuTorch; padding rows weigh 0), LayerNorm and GroupNorm written out, convolutions as
GEMMs for ExecuTorch (``conv_as_gemm``), dropout as a multiplication by a mask that comes in as an input.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import math
import operator
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from ...runtime.config import ConfigError

ARCH = "module"


class ModelError(ConfigError):
    """A model fedge cannot use, or cannot find: one line naming the layer (or the reference) and why."""


# ---------------------------------------------------------------------------------------------- factories
def split_ref(ref: str) -> tuple[str, str]:
    """``path/file.py:make`` or ``package.module:make`` -> (where, factory name)."""
    where, sep, name = str(ref).rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ModelError(f"model {ref!r}: expected path/to/file.py:factory or package.module:factory")
    return where, name


def _source_path(where: str) -> Path | None:
    if where.endswith(".py"):
        return Path(where)
    try:
        spec = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def source_hash(ref: str) -> str:
    """SHA-256 of the factory's source file (what else defines the model: the same reference to changed code
    is another model, so another program)."""
    where, _ = split_ref(ref)
    p = _source_path(where)
    if p is None or not p.is_file():
        raise ModelError(f"model {ref!r}: cannot find {where}")
    return hashlib.sha256(p.read_bytes()).hexdigest()


@functools.lru_cache(maxsize=None)
def _load_factory(ref: str, sha256: str | None) -> Callable[[], nn.Module]:
    where, name = split_ref(ref)
    if sha256 is not None and source_hash(ref) != sha256:
        raise ModelError(f"model {ref!r}: the source here differs from the coordinator's (sha256 mismatch); "
                         f"install the same file")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            if not path.is_file():
                raise ModelError(f"model {ref!r}: no such file {where}")
            modname = f"fedge_user_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
            spec = importlib.util.spec_from_file_location(modname, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[modname] = mod
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(where)
    except ModelError:
        raise
    except Exception as e:  # the person's module failed to import: say so in one line
        raise ModelError(f"model {ref!r}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ModelError(f"model {ref!r}: {where} has no callable {name!r}")
    return fn


def make_module(ref: str, sha256: str | None = None, seed: int | None = None) -> nn.Module:
    """A fresh module from the factory (its own initialisation, from ``seed`` when given)."""
    fn = _load_factory(ref, sha256)
    try:
        if seed is None:
            m = fn()
        else:
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                m = fn()
    except Exception as e:
        raise ModelError(f"model {ref!r}: the factory raised {type(e).__name__}: {e}") from None
    if not isinstance(m, nn.Module):
        raise ModelError(f"model {ref!r}: the factory returned {type(m).__name__}, not a torch.nn.Module")
    return m


def is_user(spec: Mapping[str, Any]) -> bool:
    return spec.get("arch") == ARCH


# ---------------------------------------------------------------------------------------------- the graph
ACTS = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "tanh": torch.tanh, "sigmoid": torch.sigmoid}
_ACT_MODULES = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid"}
_ACT_FUNCS = {torch.relu: "relu", F.relu: "relu", torch.tanh: "tanh", F.tanh: "tanh", torch.sigmoid: "sigmoid",
              F.sigmoid: "sigmoid"}
_ACT_METHODS = {"relu": "relu", "tanh": "tanh", "sigmoid": "sigmoid"}


SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Dropout,
             nn.Flatten, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d,
             nn.AdaptiveAvgPool2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)
WHAT = ("fedge exports Linear, Conv1d/2d, ReLU/GELU/Tanh/Sigmoid, Max/Avg/AdaptiveAvg pooling, Flatten, Dropout, "
        "BatchNorm/LayerNorm/GroupNorm, residual + and torch.cat")


@dataclass
class Op:
    """One node of the user's graph in the form fedge runs it."""

    name: str  # fx node name
    kind: str
    args: list[str]  # names of input nodes (tensors)
    module: str | None = None  # qualified module name (layers with parameters)
    attrs: dict[str, Any] = field(default_factory=dict)
    shape: tuple[int, ...] = ()  # output shape at the analysed (full) size, batch first


def _tuple(v: Any, n: int) -> tuple[int, ...]:
    return tuple(int(a) for a in v) if isinstance(v, (tuple, list)) else (int(v),) * n


def _what(node, mod: nn.Module | None = None) -> str:
    if node.op == "call_module":
        return f"{type(mod).__name__} {node.target!r}"
    if node.op == "call_function":
        return f"function {getattr(node.target, '__name__', node.target)} (node {node.name!r})"
    if node.op == "call_method":
        return f"method .{node.target}() (node {node.name!r})"
    return f"{node.op} {node.target!r}"


def _shape(node) -> tuple[int, ...] | None:
    tm = node.meta.get("tensor_meta")
    return tuple(int(d) for d in tm.shape) if tm is not None and hasattr(tm, "shape") else None


def _conv_padding(mod, ks: tuple[int, ...]) -> tuple[int, ...]:
    p = mod.padding
    if p == "valid":
        return (0,) * len(ks)
    if p == "same":
        if any(k % 2 == 0 for k in ks) or any(s != 1 for s in _tuple(mod.stride, len(ks))):
            raise ModelError(f"{type(mod).__name__}: padding='same' needs odd kernels and stride 1")
        return tuple(d * (k - 1) // 2 for k, d in zip(ks, _tuple(mod.dilation, len(ks))))
    return _tuple(p, len(ks))


def trace(module: nn.Module, input_shape: tuple[int, ...]) -> list[Op]:
    """The module's graph as ops fedge can run everywhere, with shapes (batch 2); :class:`ModelError` for
    anything else, naming the layer."""
    from torch.fx import symbolic_trace
    from torch.fx.passes.shape_prop import ShapeProp

    try:
        gm = symbolic_trace(module)
    except Exception as e:
        raise ModelError(f"torch.fx cannot trace the model ({type(e).__name__}: {str(e).splitlines()[0]}); "
                         f"fedge reads the graph to export and prune it, so forward() must be traceable "
                         f"(no data-dependent control flow)") from None
    mods = dict(gm.named_modules())
    was = module.training
    gm.eval()
    try:
        with torch.no_grad():
            try:  # the module itself first: its own error is the one to show (ShapeProp prints tracebacks)
                module.eval()
                module(torch.zeros(2, *input_shape))
            except Exception as e:
                raise ModelError(f"the model does not run on examples of shape {list(input_shape)} "
                                 f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
            ShapeProp(gm).propagate(torch.zeros(2, *input_shape))
    finally:
        gm.train(was)
        module.train(was)
    ops: list[Op] = []
    used_modules: set[str] = set()
    n_drop = 0
    for node in gm.graph.nodes:
        tensor_args = [a.name for a in node.all_input_nodes]
        shp = _shape(node)
        if node.op == "placeholder":
            if ops:
                raise ModelError(f"forward() takes more than one input ({node.target!r}); fedge feeds one tensor")
            ops.append(Op(node.name, "input", [], shape=shp))
            continue
        if node.op == "output":
            out = node.args[0]
            if not hasattr(out, "name") or shp is None or len(shp) != 2:
                raise ModelError("the model must return one tensor of logits shaped (batch, classes)")
            ops.append(Op(node.name, "output", [out.name], shape=shp))
            continue
        if node.op == "get_attr":
            raise ModelError(f"forward() uses the tensor {node.target!r} directly; fedge supports parameters "
                             f"only inside the supported layers")
        if node.op == "call_method" and node.target == "size":
            ops.append(Op(node.name, "size", tensor_args))
            continue
        mod = mods.get(node.target) if node.op == "call_module" else None
        if shp is None:
            if mod is not None and not isinstance(mod, SUPPORTED):
                raise ModelError(f"{_what(node, mod)} is not supported ({WHAT})")
            raise ModelError(f"{_what(node, mod)} does not return one tensor; fedge cannot follow it")
        if mod is not None:
            if node.target in used_modules:
                raise ModelError(f"{_what(node, mod)} is called twice; fedge needs each layer used once "
                                 f"(shared weights are not supported)")
            used_modules.add(node.target)
        op = _op(node, mod, tensor_args, shp)
        if op.kind == "dropout":
            op.attrs["index"] = n_drop
            n_drop += 1
        ops.append(op)
    return ops


def _op(node, mod: nn.Module | None, args: list[str], shp: tuple[int, ...]) -> Op:
    name, what = node.name, _what(node, mod)

    def mk(kind: str, **attrs: Any) -> Op:
        return Op(name, kind, args, node.target if mod is not None else None, attrs, shp)

    in_shape = _shape(node.all_input_nodes[0]) if node.all_input_nodes else None
    if mod is not None:
        if isinstance(mod, nn.Linear):
            if in_shape is None or len(in_shape) != 2:
                raise ModelError(f"{what} gets a {len(in_shape or ())}-D input; fedge supports Linear on "
                                 f"(batch, features)")
            return mk("linear")
        if isinstance(mod, (nn.Conv1d, nn.Conv2d)):
            nd = 1 if isinstance(mod, nn.Conv1d) else 2
            if mod.groups != 1:
                raise ModelError(f"{what} has groups={mod.groups}; fedge supports groups=1 only")
            if mod.padding_mode != "zeros":
                raise ModelError(f"{what} has padding_mode={mod.padding_mode!r}; fedge supports 'zeros' only")
            ks = _tuple(mod.kernel_size, nd)
            return mk("conv", nd=nd, kernel=ks, stride=_tuple(mod.stride, nd), padding=_conv_padding(mod, ks),
                      dilation=_tuple(mod.dilation, nd))
        if type(mod) in _ACT_MODULES:
            return mk("act", fn=_ACT_MODULES[type(mod)])
        if isinstance(mod, nn.GELU):
            return mk("act", fn="gelu" if mod.approximate == "none" else "gelu_tanh")
        if isinstance(mod, nn.Identity):
            return mk("identity")
        if isinstance(mod, nn.Dropout):
            return mk("dropout", p=float(mod.p))
        if isinstance(mod, nn.Flatten):
            if mod.start_dim != 1 or mod.end_dim != -1:
                raise ModelError(f"{what}: fedge supports Flatten(start_dim=1, end_dim=-1) only")
            return mk("flatten")
        if isinstance(mod, (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d)):
            nd = 1 if isinstance(mod, (nn.MaxPool1d, nn.AvgPool1d)) else 2
            ks = _tuple(mod.kernel_size, nd)
            st = _tuple(mod.stride if mod.stride is not None else ks, nd)
            pad = _tuple(mod.padding, nd)
            if mod.ceil_mode:
                raise ModelError(f"{what}: ceil_mode=True is not supported")
            if isinstance(mod, (nn.MaxPool1d, nn.MaxPool2d)):
                if mod.return_indices or any(d != 1 for d in _tuple(mod.dilation, nd)):
                    raise ModelError(f"{what}: dilation and return_indices are not supported")
                return mk("maxpool", nd=nd, kernel=ks, stride=st, padding=pad)
            if any(pad) or getattr(mod, "divisor_override", None):
                raise ModelError(f"{what}: average pooling with padding or divisor_override is not supported")
            return mk("avgpool", nd=nd, kernel=ks, stride=st)
        if isinstance(mod, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)):
            return _adaptive(mk, what, in_shape, shp)
        if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
            if in_shape is None or len(in_shape) not in ((2, 3) if isinstance(mod, nn.BatchNorm1d) else (4,)):
                raise ModelError(f"{what}: unexpected input shape {in_shape}")
            return mk("bn", eps=float(mod.eps), affine=bool(mod.affine), running=bool(mod.track_running_stats))
        if isinstance(mod, nn.LayerNorm):
            return mk("ln", dims=len(mod.normalized_shape), eps=float(mod.eps),
                      affine=bool(mod.elementwise_affine) and mod.weight is not None, bias=mod.bias is not None)
        if isinstance(mod, nn.GroupNorm):
            return mk("gn", cpg=mod.num_channels // mod.num_groups, eps=float(mod.eps), affine=bool(mod.affine))
        raise ModelError(f"{what} is not supported ({WHAT})")
    t = node.target
    if node.op == "call_function":
        if t in _ACT_FUNCS:
            return mk("act", fn=_ACT_FUNCS[t])
        if t is F.gelu:
            return mk("act", fn="gelu_tanh" if node.kwargs.get("approximate", "none") == "tanh" else "gelu")
        if t in (operator.add, torch.add) and len(args) == 2 and not node.kwargs.get("alpha"):
            return mk("add")
        if t is torch.cat:
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
            dim = dim % len(shp)
            return Op(name, "cat", [a.name for a in node.args[0]], None, {"dim": dim}, shp)
        if t is torch.flatten:
            start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
            end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
            if start == 1 and end in (-1, len(in_shape) - 1):
                return mk("flatten")
        if t is F.dropout:
            return mk("dropout", p=float(node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)))
        if t in (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d):
            return _adaptive(mk, what, in_shape, shp)
        if t is torch.mean:
            return _mean(mk, what, node, in_shape, shp)
    if node.op == "call_method":
        if t in _ACT_METHODS:
            return mk("act", fn=_ACT_METHODS[t])
        if t in ("view", "reshape", "flatten") and in_shape is not None and len(shp) == 2 \
                and shp[1] == math.prod(in_shape[1:]) and shp[0] == in_shape[0]:
            return Op(name, "flatten", args[:1], None, {}, shp)
        if t == "mean":
            return _mean(mk, what, node, in_shape, shp)
        if t == "add" and len(args) == 2 and not node.kwargs.get("alpha"):
            return mk("add")
    raise ModelError(f"{what} is not supported (fedge follows activations, pooling, flatten, residual + "
                     f"and torch.cat between the supported layers)")


def _adaptive(mk, what: str, in_shape, shp) -> Op:
    ins, outs = in_shape[2:], shp[2:]
    if any(i % o for i, o in zip(ins, outs)):
        raise ModelError(f"{what}: output size {list(outs)} does not divide the input {list(ins)}; "
                         f"fedge supports adaptive pooling to sizes that divide the input")
    ks = tuple(i // o for i, o in zip(ins, outs))
    return mk("avgpool", nd=len(ks), kernel=ks, stride=ks)


def _mean(mk, what: str, node, in_shape, shp) -> Op:
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
    dims = tuple(sorted(d % len(in_shape) for d in dims))
    keep = bool(node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False))
    if not dims or 0 in dims or 1 in dims:
        raise ModelError(f"{what}: fedge supports mean over spatial dimensions (global average pooling) only")
    return mk("mean", dims=dims, keepdim=keep)


# ---------------------------------------------------------------------------------------------- analysis
Segment = tuple[str | None, int, int]  # (producer layer or None, channels, entries per channel)


class _Union:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, a: str) -> str:
        self.parent.setdefault(a, a)
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def analyse(module: nn.Module, input_shape: tuple[int, ...]) -> dict[str, Any]:
    """Shapes, classifier and gate groups of a module (the spec's body; see the module docstring)."""
    ops = trace(module, input_shape)
    mods = dict(module.named_modules())
    params = [[n, list(p.shape)] for n, p in module.named_parameters()]
    buffers = [[n, list(b.shape)] for n, b in module.named_buffers() if not n.endswith("num_batches_tracked")]
    used = {o.module for o in ops if o.module is not None}
    for n, _ in params + buffers:
        owner = n.rsplit(".", 1)[0] if "." in n else ""
        if owner not in used:
            raise ModelError(f"parameter or buffer {n!r} belongs to no layer that forward() uses; "
                             f"fedge trains every parameter it sends, so remove unused ones")
    layout: dict[str, list[Segment]] = {}
    rows: dict[str, int] = {}
    members: dict[str, list[list]] = {}
    norm: dict[str, list[str]] = {}
    tie: dict[str, int] = {}
    ungated: dict[str, str] = {}
    inexact: set[str] = set()
    uf = _Union()
    producers: list[str] = []

    def producers_of(lay: list[Segment]) -> list[str]:
        return [p for p, _c, _s in lay if p is not None]

    def stop(lay: list[Segment], why: str) -> None:
        for p in producers_of(lay):
            ungated.setdefault(p, why)

    def add_members(lay: list[Segment], tensor: str, axis: int, scale: int = 1) -> None:
        off = 0
        for p, c, s in lay:
            if p is not None:
                members[p].append([tensor, axis, s * scale, off])
            off += c * s * scale

    def channels(lay: list[Segment]) -> int:
        return sum(c * s for _p, c, s in lay)

    for op in ops:
        a = [layout.get(n) for n in op.args]
        k = op.kind
        if k == "input":
            layout[op.name] = [(None, op.shape[1], 1)]
        elif k == "size":
            continue
        elif k in ("linear", "conv"):
            lay = a[0]
            if k == "conv" and any(s != 1 for _p, _c, s in lay):
                stop(lay, "reaches a conv after flatten")
            else:
                add_members(lay, f"{op.module}.weight", 1)
            m = mods[op.module]
            name = op.module
            producers.append(name)
            rows[name] = int(m.weight.shape[0])
            members[name] = [[f"{name}.weight", 0, 1, 0]]
            norm[name] = [f"{name}.weight"]
            if m.bias is not None:
                members[name].append([f"{name}.bias", 0, 1, 0])
                norm[name].append(f"{name}.bias")
            tie[name] = 1
            layout[op.name] = [(name, rows[name], 1)]
        elif k in ("act", "identity", "dropout", "maxpool", "avgpool"):
            layout[op.name] = a[0]
        elif k == "mean":
            layout[op.name] = a[0]
        elif k == "flatten":
            in_shape = next(o for o in ops if o.name == op.args[0]).shape
            per = math.prod(in_shape[2:]) if len(in_shape) > 2 else 1
            layout[op.name] = [(p, c, s * per) for p, c, s in a[0]]
        elif k == "bn":
            lay = a[0]
            m = mods[op.module]
            names = ([f"{op.module}.weight", f"{op.module}.bias"] if op.attrs["affine"] else []) + \
                    ([f"{op.module}.running_mean", f"{op.module}.running_var"] if m.running_mean is not None else [])
            for t in names:
                add_members(lay, t, 0)
            layout[op.name] = lay
        elif k == "ln":
            lay = a[0]
            src_shape = next(o for o in ops if o.name == op.args[0]).shape
            nd = op.attrs["dims"]
            if nd >= len(src_shape) - 1:  # the unit axis is normalised over
                if op.attrs["affine"]:  # the parameter covers the normalised dims: a unit owns its axis-0 slice
                    for t in [f"{op.module}.weight"] + ([f"{op.module}.bias"] if op.attrs["bias"] else []):
                        add_members(lay, t, 0)
                inexact.update(producers_of(lay))
            layout[op.name] = lay
        elif k == "gn":
            lay = a[0]
            cpg = op.attrs["cpg"]
            off = 0
            for p, c, s in lay:
                if p is not None:
                    if s != 1 or off % cpg or c % cpg:
                        ungated.setdefault(p, f"GroupNorm {op.module!r} groups do not align with its channels")
                    else:
                        tie[p] = math.lcm(tie[p], cpg)
                off += c * s
            if op.attrs["affine"]:
                add_members(lay, f"{op.module}.weight", 0)
                add_members(lay, f"{op.module}.bias", 0)
            layout[op.name] = lay
        elif k == "add":
            la, lb = a
            if [(c, s) for _p, c, s in la] == [(c, s) for _p, c, s in lb]:
                for (pa, _c, _s), (pb, _c2, _s2) in zip(la, lb):
                    if pa is not None and pb is not None:
                        uf.union(pa, pb)
                    elif pa is not None or pb is not None:
                        ungated.setdefault(pa or pb, f"is added (node {op.name!r}) to a tensor that is no "
                                                     f"layer's output")
                layout[op.name] = la
            else:
                stop(la, f"is added (node {op.name!r}) to a tensor laid out differently")
                stop(lb, f"is added (node {op.name!r}) to a tensor laid out differently")
                layout[op.name] = [(None, op.shape[1], 1)]
        elif k == "cat":
            if op.attrs["dim"] == 1:
                layout[op.name] = [seg for lay in a for seg in lay]
            else:
                for lay in a:
                    stop(lay, f"is concatenated along dim {op.attrs['dim']} (node {op.name!r})")
                layout[op.name] = [(None, op.shape[1], 1)]
        elif k == "output":
            stop(a[0], "feeds the model's output (the classifier is never gated)")
        else:  # pragma: no cover - trace() admits only the kinds above
            raise AssertionError(k)

    out = ops[-1]
    classifier = [p for p in producers_of(layout[out.args[0]])]
    if len(classifier) != 1:
        raise ModelError("the model's output must come from one Linear or Conv layer (its classifier)")
    comps: dict[str, list[str]] = {}
    for p in producers:
        comps.setdefault(uf.find(p), []).append(p)
    groups = []
    for p in producers:
        root = uf.find(p)
        comp = comps.get(root)
        if comp is None or comp[0] != p:
            continue
        if any(q in ungated for q in comp) or len({rows[q] for q in comp}) != 1:
            continue
        t = math.lcm(*[tie[q] for q in comp])
        n = rows[p] // t
        if n < 2:
            continue
        mem = []
        for q in comp:
            for tensor, axis, span, off in members[q]:
                mem.append([tensor, axis, span * t, off])
        groups.append({"layer": p, "size": n, "members": mem, "norm": [x for q in comp for x in norm[q]],
                       "exact": not any(q in inexact for q in comp)})
    return {"input": [int(d) for d in input_shape], "classes": int(out.shape[1]), "params": params,
            "buffers": buffers, "classifier": classifier[0], "groups": groups,
            "dropout": [o.attrs["p"] for o in ops if o.kind == "dropout"],
            "_ungated": {p: ungated[p] for p in producers if p in ungated}}


def describe(ref: str, input_shape: tuple[int, ...] | list[int]) -> dict[str, Any]:
    """The spec of the factory's module for inputs of ``input_shape`` (one example, no batch)."""
    sha = source_hash(ref)
    body = analyse(make_module(ref, sha, seed=0), tuple(int(d) for d in input_shape))
    body.pop("_ungated")
    return {"arch": ARCH, "factory": str(ref), "sha256": sha, **body}


def ungated_layers(ref: str, input_shape) -> dict[str, str]:
    """Layers that are not gated and why (for ``fedge export --model ... --groups``)."""
    return analyse(make_module(ref, None, seed=0), tuple(int(d) for d in input_shape))["_ungated"]


def init_weights(spec: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """The module's own initialisation (its factory under ``torch.manual_seed(seed)``), as numpy arrays:
    parameters and buffers by name, at the spec's (full) shapes."""
    m = make_module(spec["factory"], spec.get("sha256"), seed=seed)
    sd = {k: v.detach().numpy().astype("float32").copy() for k, v in m.state_dict().items()}
    out = {}
    for n, shape in list(spec["params"]) + list(spec.get("buffers", [])):
        if list(sd[n].shape) != list(shape):
            raise ModelError(f"{n}: the factory makes shape {list(sd[n].shape)}, the spec says {shape}")
        out[n] = sd[n]
    return out


# ---------------------------------------------------------------------------------------------- running it
def _slices(x: torch.Tensor, nd: int, kernel, stride, dilation=None, out=None):
    """The strided slices of x's last ``nd`` dims, one per kernel offset (the patches of a conv or pool)."""
    dilation = dilation or (1,) * nd
    sp = x.shape[-nd:]
    out = out or tuple((sp[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(nd))
    idx = [()]
    for i in range(nd):
        idx = [p + (o,) for p in idx for o in range(kernel[i])]
    res = []
    for offs in idx:
        sl = [slice(None), slice(None)]
        for i, o in enumerate(offs):
            start = o * dilation[i]
            sl.append(slice(start, start + stride[i] * (out[i] - 1) + 1, stride[i]))
        res.append(x[tuple(sl)])
    return res, out


def _pad(x: torch.Tensor, nd: int, pad, value: float = 0.0) -> torch.Tensor:
    """Padding as concatenation (the backward of F.pad is a negative constant_pad_nd, which ExecuTorch's
    portable kernel rejects)."""
    for i in range(nd):
        p = pad[i]
        if not p:
            continue
        dim = x.dim() - nd + i
        shape = list(x.shape)
        shape[dim] = p
        z = x.new_full(shape, value)
        x = torch.cat([z, x, z], dim)
    return x


def conv_gemm(x, weight, bias, nd, stride, padding, dilation):
    """Convolution as kernel-offset slices, one GEMM and reshapes (XNNPACK runs the GEMM forward and backward;
    it cannot compile a convolution whose weights are program inputs)."""
    n, c = x.shape[0], x.shape[1]
    o = weight.shape[0]
    kernel = tuple(weight.shape[2:])
    x = _pad(x, nd, padding)
    patches, out = _slices(x, nd, kernel, stride, dilation)
    L = math.prod(out)
    cols = torch.stack(patches, dim=2).reshape(n, c * len(patches), L).transpose(1, 2).reshape(n * L, -1)
    y = F.linear(cols, weight.reshape(o, -1), bias)
    return y.reshape(n, L, o).transpose(1, 2).reshape(n, o, *out)


def max_pool(x, nd, kernel, stride, padding):
    """Max-pooling as a running maximum over strided slices: ExecuTorch 1.5.1's max_pool2d backward does not
    zero its output (wrong gradients); torch.maximum is right on every runtime (ties split the gradient, which
    after a ReLU only happens at 0 where the gradient is 0 anyway)."""
    if any(padding):
        x = _pad(x, nd, padding, float("-inf"))
    patches, _ = _slices(x, nd, kernel, stride)
    y = patches[0]
    for p in patches[1:]:
        y = torch.maximum(y, p)
    return y


def avg_pool(x, nd, kernel, stride):
    """Average pooling as a sum of strided slices (ExecuTorch has no avg_pool2d backward kernel)."""
    patches, _ = _slices(x, nd, kernel, stride)
    if len(patches) == 1:
        return patches[0]
    y = patches[0]
    for p in patches[1:]:
        y = y + p
    return y * (1.0 / len(patches))


class Network:
    """The user's module, run from a name -> tensor mapping in runtime-safe forms (see the module docstring).

    ``run`` returns (logits, features entering the classifier, batch statistics): for every BatchNorm in
    train mode, per row, the channel means and the channel mean squares about the batch mean, which the
    device turns into the running statistics it reports (docs/your-model.md).
    """

    def __init__(self, spec: Mapping[str, Any]):
        self.spec = spec
        module = make_module(spec["factory"], spec.get("sha256"), seed=0)
        self.ops = [o for o in trace(module, tuple(spec["input"])) if o.kind != "size"]
        self.shapes = {n: tuple(s) for n, s in list(spec["params"]) + list(spec.get("buffers", []))}
        self.bns = [o for o in self.ops if o.kind == "bn"]
        self.dropouts = [o for o in self.ops if o.kind == "dropout"]
        self.classifier = spec["classifier"]
        # gate segments per consumer weight (input axis): [(group index, span, offset), ...]
        self.gated_inputs: dict[str, list[tuple[int, int, int]]] = {}
        for gi, g in enumerate(spec.get("groups", [])):
            for tensor, axis, span, off in g["members"]:
                if axis == 1 and tensor.endswith(".weight"):
                    self.gated_inputs.setdefault(tensor[:-len(".weight")], []).append((gi, int(span), int(off)))
        self.sizes = [int(g["size"]) for g in spec.get("groups", [])]

    def stat_names(self) -> list[str]:
        return [f"stat.{o.module}.{k}" for o in self.bns if o.attrs["running"] for k in ("mean", "var")]

    def dropout_shapes(self) -> list[tuple[int, ...]]:
        """Per-row shapes of the dropout masks at the spec's (possibly sliced) sizes."""
        if not self.dropouts:
            return []
        with torch.no_grad():
            shapes = {}
            p = {n: torch.zeros(s) for n, s in self.shapes.items()}
            x = torch.zeros(1, math.prod(self.spec["input"]))
            self.run(p, x, mode="eval", record=shapes)
        return [tuple(shapes[o.name][1:]) for o in self.dropouts]

    def _gate(self, consumer: str, x: torch.Tensor, gates) -> torch.Tensor:
        segs = self.gated_inputs.get(consumer)
        if not segs or gates is None:
            return x
        n = int(self.shapes[f"{consumer}.weight"][1])  # static (a traced x.shape[1] would be a tensor)
        pieces, at = [], 0
        for gi, span, off in sorted(segs, key=lambda s: s[2]):
            if off > at:
                pieces.append(x.new_ones(off - at))
            z = gates[gi]
            if z is None:  # a group without a gate (a residual stream: edge/subnet.py pruned_groups)
                pieces.append(x.new_ones(self.sizes[gi] * span))
            else:
                pieces.append(z.unsqueeze(1).expand(z.shape[0], span).reshape(-1) if span > 1 else z)
            at = off + self.sizes[gi] * span
        if at < n:
            pieces.append(x.new_ones(n - at))
        vec = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return x * vec.reshape(1, n, *([1] * (x.dim() - 2)))

    def run(self, p: Mapping[str, torch.Tensor], x: torch.Tensor, *, w: torch.Tensor | None = None,
            mode: str = "train", gates=None, masks=None, prefix: str = "", conv_as_gemm: bool = False,
            record: dict | None = None):
        """(logits, classifier input, stats). ``p`` maps ``prefix + name`` to tensors; ``gates[i]`` is group
        i's gate vector; ``masks[j]`` dropout j's mask [B, ...] (train mode; eval runs dropout as identity)."""
        env: dict[str, torch.Tensor] = {}
        stats: list[torch.Tensor] = []
        feat = None
        for op in self.ops:
            k = op.kind
            a = [env[n] for n in op.args]
            if k == "input":
                y = x.reshape(x.shape[0], *self.spec["input"])
            elif k == "output":
                y = a[0]
                env[op.name] = y
                break
            elif k in ("linear", "conv"):
                h = self._gate(op.module, a[0], gates)
                W = p[f"{prefix}{op.module}.weight"]
                b = p.get(f"{prefix}{op.module}.bias")
                if op.module == self.classifier:
                    feat = h
                if k == "linear":
                    y = F.linear(h, W, b)
                elif conv_as_gemm:
                    y = conv_gemm(h, W, b, op.attrs["nd"], op.attrs["stride"], op.attrs["padding"],
                                  op.attrs["dilation"])
                else:
                    conv = F.conv1d if op.attrs["nd"] == 1 else F.conv2d
                    y = conv(h, W, b, op.attrs["stride"], op.attrs["padding"], op.attrs["dilation"])
            elif k == "act":
                y = ACTS[op.attrs["fn"]](a[0])
            elif k == "identity":
                y = a[0]
            elif k == "dropout":
                y = a[0] if mode == "eval" or masks is None else a[0] * masks[op.attrs["index"]]
            elif k == "maxpool":
                y = max_pool(a[0], op.attrs["nd"], op.attrs["kernel"], op.attrs["stride"], op.attrs["padding"])
            elif k == "avgpool":
                y = avg_pool(a[0], op.attrs["nd"], op.attrs["kernel"], op.attrs["stride"])
            elif k == "mean":
                y = a[0].mean(dim=op.attrs["dims"], keepdim=op.attrs["keepdim"])
            elif k == "flatten":
                y = a[0].reshape(a[0].shape[0], -1)
            elif k == "bn":
                y = self._bn(op, a[0], p, prefix, w, mode, stats)
            elif k == "ln":
                h = a[0]
                dims = tuple(range(h.dim() - op.attrs["dims"], h.dim()))
                mu = h.mean(dim=dims, keepdim=True)
                d = h - mu
                y = d / torch.sqrt((d * d).mean(dim=dims, keepdim=True) + op.attrs["eps"])
                if op.attrs["affine"]:
                    y = y * p[f"{prefix}{op.module}.weight"]
                    if op.attrs["bias"]:
                        y = y + p[f"{prefix}{op.module}.bias"]
            elif k == "gn":
                h = a[0]
                n, c = h.shape[0], h.shape[1]
                g = h.reshape(n, c // op.attrs["cpg"], -1)
                mu = g.mean(dim=2, keepdim=True)
                d = g - mu
                y = (d / torch.sqrt((d * d).mean(dim=2, keepdim=True) + op.attrs["eps"])).reshape(h.shape)
                if op.attrs["affine"]:
                    bshape = (1, c) + (1,) * (h.dim() - 2)
                    y = y * p[f"{prefix}{op.module}.weight"].reshape(bshape) + \
                        p[f"{prefix}{op.module}.bias"].reshape(bshape)
            elif k == "add":
                y = a[0] + a[1]
            elif k == "cat":
                y = torch.cat(a, dim=op.attrs["dim"])
            else:  # pragma: no cover
                raise AssertionError(k)
            env[op.name] = y
            if record is not None:
                record[op.name] = tuple(y.shape)
        return env[self.ops[-1].name], feat, stats

    def _bn(self, op: Op, h, p, prefix, w, mode, stats):
        """BatchNorm: batch statistics weighted by the row weights in train mode (padding rows weigh 0), the
        running statistics in eval mode (when the layer tracks them)."""
        c = h.shape[1]
        bshape = (1, c) + (1,) * (h.dim() - 2)
        red = tuple(range(2, h.dim()))
        eps = op.attrs["eps"]
        running = op.attrs["running"]
        if mode == "eval" and running:
            mu = p[f"{prefix}{op.module}.running_mean"].reshape(bshape)
            var = p[f"{prefix}{op.module}.running_var"].reshape(bshape)
            y = (h - mu) / torch.sqrt(var + eps)
        else:
            wt = w if w is not None else h.new_full((h.shape[0],), 1.0 / h.shape[0])
            wn = (wt / wt.sum()).reshape(-1, 1)
            m_i = h.mean(dim=red) if red else h  # [B, C]
            mu = (m_i * wn).sum(0)
            d = h - mu.reshape(bshape)
            s_i = (d * d).mean(dim=red) if red else d * d  # [B, C]
            var = (s_i * wn).sum(0)
            y = d / torch.sqrt(var.reshape(bshape) + eps)
            if running and mode == "train":
                stats += [m_i.detach(), s_i.detach()]
        if op.attrs["affine"]:
            y = y * p[f"{prefix}{op.module}.weight"].reshape(bshape) + p[f"{prefix}{op.module}.bias"].reshape(bshape)
        return y


@functools.lru_cache(maxsize=64)
def _network(key: str) -> Network:
    import json
    return Network(json.loads(key))


def network(spec: Mapping[str, Any]) -> Network:
    """The :class:`Network` of a spec (built once per spec per process)."""
    import json
    return _network(json.dumps(spec, sort_keys=True))


def evaluate(spec: Mapping[str, Any], weights: Mapping[str, Any], x, y, chunk: int = 1024) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the module in eval mode (running statistics, no dropout) with
    ``weights`` (numpy, parameters and buffers by name)."""
    import numpy as np
    net = network(spec)
    p = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in weights.items()}
    x = np.asarray(x, np.float32).reshape(len(x), -1)
    y = np.asarray(y, np.int64)
    total, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            logits, _, _ = net.run(p, torch.from_numpy(x[i:i + chunk]), mode="eval")
            yt = torch.from_numpy(y[i:i + chunk])
            total += float(F.cross_entropy(logits, yt, reduction="sum"))
            correct += int((logits.argmax(1) == yt).sum())
    return total / len(x), correct / len(x)
