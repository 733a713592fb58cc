"""Any objective (edge/trainers/torch_objectives) lowered to an ExecuTorch training program (``.pte``).

``torch.export`` of the objective, then ``_export_forward_backward`` (the joint graph returns the loss, the
auxiliary outputs, then every gradient and every parameter), a clean-up of the joint graph, and XNNPACK
with ``force_non_static_weights_for_f32_linear``, so the forward and backward GEMMs run as XNNPACK dynamic
fully connected nodes while the parameters stay program inputs that can be set and read in place
(runtimes.md section 5). Convolutions are asked of the objective as GEMMs (``conv_as_gemm``): XNNPACK cannot
compile a convolution whose weights are program inputs. The parameters go to an external ``.ptd`` that is
not shipped: the device builds a zero one from the program's metadata and the plan's weights fill it.
"""
from __future__ import annotations

import inspect
import json

import torch

from edge.trainers import executorch_backend as etb
from edge.trainers.torch_objectives import Objective

DEFAULT_MAX_BATCH = 1024   # upper bound of the dynamic batch dimension (memory is planned for it)
DEFAULT_FIXED_BATCH = 20   # batch of CNN programs (FedAvg's default plan batch size)


def clean_training_graph(gm):
    """Exact rewrites of a joint forward-backward edge graph that let XNNPACK take (nearly) all of it.

    Measured on the plain MLP (runtimes.md section 5): ~0.9x torch eager with only the partitioner flag,
    ~0.5-0.6x with these. Each rewrite computes the same numbers:
    - ``alias_copy(x)`` -> ``x`` and ``permute_copy(permute_copy(x, [1, 0]), [1, 0])`` -> ``x``
      (the portable copies were ~30% of the step);
    - ``addmm(b, x, permute_copy(W, [1, 0]))`` -> ``linear(x, W, b)`` (one XNNPACK fully connected node,
      no transposed copy of W);
    - ReLU's backward ``where(le(r, 0), 0, g)`` -> ``g * ceil(clamp(r, 0, 1))``: the factor is 0 where
      r <= 0 and 1 where r > 0, for any r, and every op has an XNNPACK kernel, so the backward no longer
      leaves the delegate. (XNNPACK flushes denormals, so r in (0, 1.2e-38) counts as 0; torch passes g.)
    """
    from executorch.exir.dialects._ops import ops as exir_ops
    from torch.fx import Node
    from torch.fx.passes.infra.pass_base import PassResult

    E = exir_ops.edge.aten
    g = gm.graph

    def is_t(n) -> bool:
        return isinstance(n, Node) and n.target == E.permute_copy.default and list(n.args[1]) == [1, 0]

    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target == E.alias_copy.default:
            n.replace_all_uses_with(n.args[0])
        elif is_t(n) and is_t(n.args[0]):
            n.replace_all_uses_with(n.args[0].args[0])
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if (n.target == E.addmm.default and not n.kwargs and is_t(n.args[2])
                and n.args[0].meta["val"].dim() == 1):
            b, x, wt = n.args
            with g.inserting_before(n):
                lin = g.call_function(E.linear.default, (x, wt.args[0], b))
            lin.meta = dict(n.meta)
            n.replace_all_uses_with(lin)
        elif n.target == E.where.self:
            cond, zero, grad = n.args
            if not (isinstance(cond, Node) and cond.target == E.le.Scalar and cond.args[1] == 0
                    and isinstance(zero, Node) and zero.target == torch.ops.aten.scalar_tensor.default
                    and zero.args[0] == 0 and isinstance(grad, Node)):
                continue
            r = cond.args[0]
            if r.meta["val"].shape != n.meta["val"].shape:
                continue
            with g.inserting_before(n):
                cl = g.call_function(E.clamp.default, (r, 0.0, 1.0))
                ce = g.call_function(E.ceil.default, (cl,))
                mul = g.call_function(E.mul.Tensor, (grad, ce))
            cl.meta, ce.meta, mul.meta = dict(r.meta), dict(r.meta), dict(n.meta)
            n.replace_all_uses_with(mul)
    g.eliminate_dead_code()
    gm.recompile()
    return PassResult(gm, True)


# XNNPACK's preprocess runs every pass of its pass manager on every delegated partition. Two of them only
# rewrite subgraphs matching their patterns, and every pattern of each holds these ops (checked by
# tests/test_export_speed.py against the patterns themselves): without them in a graph the pass is a no-op.
# Building their patterns and matching them was ~6 s of a 26 s MLP export (runtimes.md section 5b).
PATTERN_PASS_ANCHORS = {"ConvertToUpsampleBilinear2d": frozenset({"aten.upsample_bilinear2d.vec"}),
                        "ConvertToSDPAPass": frozenset({"aten._softmax.default", "aten.bmm.default"})}


def graph_ops(graph) -> set[str]:
    """The names of the operators a graph calls (``aten.mm.default``, ...)."""
    return {getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"}


def applicable_passes(passes: list, ops: set[str]) -> list:
    """``passes`` without the pattern passes that cannot match a graph calling ``ops``."""
    return [p for p in passes if pattern_pass_applies(p, ops)]


def pattern_pass_applies(pass_: type, ops: set[str]) -> bool:
    anchors = PATTERN_PASS_ANCHORS.get(getattr(pass_, "__name__", ""))
    return anchors is None or anchors <= ops


def _skip_inapplicable_xnnpack_passes() -> None:
    """Wrap XNNPACK's pass manager once per process so that its default pass list drops the pattern passes
    that cannot match the partition at hand. Exact: the dropped passes would change nothing (a test compares
    the program bytes with and without)."""
    try:
        from executorch.backends.xnnpack import _passes as xp
    except ImportError:  # pragma: no cover - executorch without XNNPACK
        return
    manager = xp.XNNPACKPassManager
    if getattr(manager, "_fedge_trimmed", False):
        return
    plain_init = manager.__init__

    def init(self, exported_program, passes=None):
        plain_init(self, exported_program, passes)
        if not passes:  # the default list: trim it for this partition
            self.passes = applicable_passes(self.passes, graph_ops(exported_program.graph))

    manager._fedge_plain_init = plain_init  # the tests export with it too, and compare the bytes
    manager.__init__ = init
    manager._fedge_trimmed = True


def xnnpack_partitioner():
    """XNNPACK for training graphs: GEMMs with non-static weights; no convolutions (they would need static
    weights: "XNNCompiler::compileModel failed: 0x1" at load); no GELU or tanh, which XNNPACK approximates
    (a GELU MLP's gradients were 1.3e-4 off torch's with them, 1.3e-7 without: they stay on portable kernels)."""
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS, ConvolutionConfig
    from executorch.backends.xnnpack.partition.config.generic_node_configs import GeluConfig, TanhConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    _skip_inapplicable_xnnpack_passes()
    configs = [c for c in ALL_PARTITIONER_CONFIGS if c not in (ConvolutionConfig, GeluConfig, TanhConfig)]
    return XnnpackPartitioner(configs=configs, force_non_static_weights_for_f32_linear=True)


def needs_fixed_batch(obj: Objective) -> bool:
    # torch 2.13's fake conv kernel guards on batch < 16, which clamps a dynamic batch to [2, 15] after
    # to_edge, and the GEMM-lowered conv graph cannot go to XNNPACK with a dynamic batch ("Output node ... is
    # already in the inputs"): CNN programs get a fixed batch, padded by the backend with rows of weight 0.
    from edge.model import has_conv
    return has_conv(obj.spec)


def _dynamic_shapes(obj: Objective, dim):
    """torch.export's dynamic_shapes for the objective's forward signature (named and *varargs inputs)."""
    specs = [{d: dim for d, s in enumerate(i.shape) if s == "B"} or None for i in obj.inputs()]
    out, k = {}, 0
    for name, prm in inspect.signature(obj.forward).parameters.items():
        if prm.kind is inspect.Parameter.VAR_POSITIONAL:
            if k < len(specs):  # an empty *args is not an argument torch.export knows of
                out[name] = tuple(specs[k:])
            k = len(specs)
        else:
            out[name] = specs[k]
            k += 1
    return out


def export_executorch(obj: Objective, *, xnnpack: bool = True, max_batch: int = DEFAULT_MAX_BATCH,
                      fixed_batch: int = DEFAULT_FIXED_BATCH, external_weights: bool = True, clean: bool = True) -> bytes:
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge, to_edge_transform_and_lower
    from torch.export import Dim, export
    from torch.export.experimental import _export_forward_backward

    if hasattr(obj, "conv_as_gemm"):
        obj.conv_as_gemm = True
    fixed = needs_fixed_batch(obj)
    n = fixed_batch if fixed else 4
    dyn = None if fixed else _dynamic_shapes(obj, Dim("batch", min=1, max=max_batch))
    obj.eval()
    ep = _export_forward_backward(export(obj, obj.example(n), dynamic_shapes=dyn, strict=True))
    clean = bool(clean and xnnpack)
    meta = etb.program_meta(obj, batch="fixed" if fixed else "dynamic", min_batch=n if fixed else 1,
                            max_batch=n if fixed else max_batch, xnnpack=bool(xnnpack), clean=clean,
                            weights="external" if external_weights else "embedded")
    consts = {etb.META_METHOD: json.dumps(meta, sort_keys=True)}
    if xnnpack:
        edge = to_edge_transform_and_lower(ep, transform_passes=[clean_training_graph] if clean else None,
                                           partitioner=[xnnpack_partitioner()], constant_methods=consts,
                                           compile_config=EdgeCompileConfig(_check_ir_validity=not clean))
    else:
        edge = to_edge(ep, constant_methods=consts)
    prog = edge.to_executorch(ExecutorchBackendConfig(external_mutable_weights=external_weights))
    return bytes(prog.buffer)
