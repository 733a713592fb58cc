"""Any objective (edge/trainers/torch_objectives) lowered to ONNX Runtime training artifacts, as one
``fedge-ort/2`` program (the format is in edge/trainers/ort_backend.py).

The objective's module is exported to ONNX as it is (``dynamo=False``, opset 17: the dynamo exporter
constant-folds parameter-only terms such as softplus(v), which cuts their gradient; runtimes.md gotcha 2),
then ``generate_artifacts`` builds the gradient graph with the module's first output as the loss and the
auxiliary outputs passed through. Cross-entropy programs also get ORT's SGD optimizer and eval graphs (the
runtime's own step and evaluate); the others only compute gradients (their optimisers run in numpy).

Every program also carries ``gradient_model.onnx`` (:func:`gradient_model`): the training graph with ORT's
in-place gradient accumulators cut out, so the loss *and the gradients* are ordinary graph outputs. ORT's
training API hands gradients back only through its C/Python ``Module``; ONNX Runtime Web's training build has no
such call, but runs this graph as a plain ``InferenceSession`` (the browser device, clients/web, docs/browser.md).
"""
from __future__ import annotations

import io
import logging
import tempfile
from pathlib import Path

import torch

from edge.trainers import ort_backend
from edge.trainers.base import is_plain, program_meta
from edge.trainers.torch_objectives import Objective

log = logging.getLogger(__name__)


def to_onnx(obj: Objective, batch: int = 2):
    """The objective's forward graph as an ONNX model whose initializers carry the plan's names."""
    import onnx

    inputs = obj.inputs()
    dyn = {i.name: {d: "batch" for d, s in enumerate(i.shape) if s == "B"} for i in inputs if i.batched}
    dyn |= {name: {0: "batch"} for name in obj.aux}  # auxiliary outputs are per row (objective.py)
    buf = io.BytesIO()
    torch.onnx.export(obj, obj.example(batch), buf, input_names=[i.name for i in inputs], output_names=obj.outputs(),
                      opset_version=17, dynamo=False, export_params=True, do_constant_folding=False,
                      training=torch.onnx.TrainingMode.TRAINING, dynamic_axes=dyn)
    model = onnx.load_from_string(buf.getvalue())
    got = [i.name for i in model.graph.input]
    if got != [i.name for i in inputs]:
        raise RuntimeError(f"ONNX export changed the inputs of {obj.name}: {got}")
    missing = set(obj.params()) - {i.name for i in model.graph.initializer}
    if missing:
        raise RuntimeError(f"ONNX export renamed parameters of {obj.name}: {sorted(missing)[:5]}")
    return model


def gradient_model(training_model: bytes, params: list[str], shapes: dict[str, list[int]]) -> bytes:
    """The training graph as one that returns the gradients: each ``InPlaceAccumulatorV2`` (which adds the gradient
    into the ``<p>_grad.accumulation.buffer`` input in place and outputs only a flag, so a session that is not ORT's
    training ``Module`` never sees the gradient) is dropped, and the gradient tensor it consumed becomes the graph
    output ``<p>_grad``. The buffer inputs and ``lazy_reset_grad`` go; the parameters stay graph inputs (after the
    program's inputs; feed them by name). Outputs: ``loss``, the auxiliary outputs, then ``<p>_grad`` in ``params``
    order."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load_from_string(training_model)
    g = m.graph
    acc = {n.output[0]: n for n in g.node if n.op_type == "InPlaceAccumulatorV2"}
    grad_of: dict[str, str] = {}
    for n in acc.values():
        buf, grad = n.input[0], n.input[1]
        p = buf.removesuffix("_grad.accumulation.buffer")
        if p == buf or p not in params:
            raise ValueError(f"unexpected gradient accumulator {n.name!r} on {buf!r}")
        grad_of[p] = grad
    missing = [p for p in params if p not in grad_of]
    if missing:
        raise ValueError(f"the training graph has no gradient for {missing[:5]}")
    dropped_inputs = {n.input[0] for n in acc.values()} | {"lazy_reset_grad"}
    kept_nodes = [n for n in g.node if n.op_type != "InPlaceAccumulatorV2"]
    del g.node[:]
    g.node.extend(kept_nodes)
    used = {i for n in g.node for i in n.input}
    if used & dropped_inputs:
        raise ValueError(f"the training graph reads {sorted(used & dropped_inputs)[:3]} outside its accumulators")
    inputs = [i for i in g.input if i.name not in dropped_inputs]
    del g.input[:]
    g.input.extend(inputs)
    outputs = [o for o in g.output if o.name not in acc]
    renames = {grad_of[p]: f"{p}_grad" for p in params}
    for n in g.node:  # the gradient tensors take the output names (a node's output may be read by others too)
        n.output[:] = [renames.get(o, o) for o in n.output]
        n.input[:] = [renames.get(i, i) for i in n.input]
    del g.output[:]
    g.output.extend(outputs + [helper.make_tensor_value_info(f"{p}_grad", TensorProto.FLOAT, list(shapes[p]))
                               for p in params])
    vi = [v for v in g.value_info if v.name not in renames]
    del g.value_info[:]
    g.value_info.extend(vi)
    return m.SerializeToString()


def _lower_relu_grad(n, fresh):
    """ReluGrad(dY, X) = dY where X > 0, else 0 (ORT's kernel: contrib_ops/cpu/activations: x > 0 ? dy : 0)."""
    from onnx import helper
    zero, mask = fresh("zero"), fresh("mask")
    return [helper.make_node("Constant", [], [zero], value_float=0.0),
            helper.make_node("Greater", [n.input[1], zero], [mask]),
            helper.make_node("Where", [mask, n.input[0], zero], [n.output[0]])]


def _lower_sigmoid_grad(n, fresh):
    """SigmoidGrad(dY, Y) = dY * Y * (1 - Y), Y the sigmoid's output."""
    from onnx import helper
    one, rest, dy_y = fresh("one"), fresh("one_minus_y"), fresh("dy_y")
    return [helper.make_node("Constant", [], [one], value_float=1.0),
            helper.make_node("Sub", [one, n.input[1]], [rest]),
            helper.make_node("Mul", [n.input[0], n.input[1]], [dy_y]),
            helper.make_node("Mul", [dy_y, rest], [n.output[0]])]


def _lower_log_softmax_grad(n, fresh):
    """LogSoftmaxGrad_13(dY, Y, axis) = dY - exp(Y) * sum(dY over axis), Y the log-softmax's output."""
    from onnx import helper
    axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
    axes, total, p, scaled = fresh("axes"), fresh("sum_dy"), fresh("softmax"), fresh("p_sum")
    return [helper.make_node("Constant", [], [axes], value_ints=[axis]),
            helper.make_node("ReduceSum", [n.input[0], axes], [total], keepdims=1),
            helper.make_node("Exp", [n.input[1]], [p]),
            helper.make_node("Mul", [p, total], [scaled]),
            helper.make_node("Sub", [n.input[0], scaled], [n.output[0]])]


# ORT's gradient kernels (com.microsoft domain) that have an exact expression in standard ONNX ops (opset 17).
# With only these in a graph, any ONNX Runtime runs it: Web's plain build, ORT Mobile on Android and iOS, aarch64
# Linux, where no ORT training build exists. A convolution's gradient (ConvGrad) has none here: CNN programs keep it.
STANDARD_LOWERINGS = {"ReluGrad": _lower_relu_grad, "SigmoidGrad": _lower_sigmoid_grad,
                      "LogSoftmaxGrad_13": _lower_log_softmax_grad}


def standard_ops(model_bytes: bytes) -> bytes | None:
    """The graph with every ORT training kernel replaced by standard ONNX ops (STANDARD_LOWERINGS), or None when
    it holds one that has no lowering."""
    import onnx

    m = onnx.load_from_string(model_bytes)
    g = m.graph
    contrib = {n.op_type for n in g.node if n.domain not in ("", "ai.onnx")}
    if not contrib <= set(STANDARD_LOWERINGS):
        return None
    counter = iter(range(1 << 30))

    def fresh(what: str) -> str:
        return f"fedge_std/{what}_{next(counter)}"

    nodes = []
    for n in g.node:
        nodes.extend(STANDARD_LOWERINGS[n.op_type](n, fresh) if n.domain not in ("", "ai.onnx") else [n])
    del g.node[:]
    g.node.extend(nodes)
    kept = [o for o in m.opset_import if o.domain in ("", "ai.onnx")]
    del m.opset_import[:]
    m.opset_import.extend(kept)
    onnx.checker.check_model(m)
    return m.SerializeToString()


def export_ort(obj: Objective, *, nominal: bool = True) -> bytes:
    """``nominal``: ship ORT's nominal checkpoint (names and shapes, no values): the weights always come with
    the plan, so the program shrinks from ~4 bytes per parameter to a few KB."""
    from onnxruntime.training import artifacts

    base = to_onnx(obj)
    plain = is_plain(obj.inputs())
    wanted = ort_backend.FILES if plain else ort_backend.GRAD_FILES
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))  # generate_artifacts logs every file it writes via root
    # onnxblock builds the gradient graph with a default SessionOptions, whose C++ logger prints ~20 INFO
    # lines per export to stderr; hand it a quiet one for the duration of the call.
    import onnxruntime.training.onnxblock._training_graph_utils as tgu
    plain_options = tgu.SessionOptions

    def quiet_options():
        so = plain_options()
        so.log_severity_level = 3
        return so

    tgu.SessionOptions = quiet_options
    try:
        with tempfile.TemporaryDirectory(prefix="fedge-ortx-") as d:
            artifacts.generate_artifacts(base, requires_grad=list(obj.params()), frozen_params=[], loss=None,
                                         loss_input_names=["loss"], additional_output_names=list(obj.aux) or None,
                                         optimizer=artifacts.OptimType.SGD if plain else None,
                                         artifact_directory=d, nominal_checkpoint=nominal)
            files = {f: Path(d, f).read_bytes() for f in wanted}
            if nominal:
                files["checkpoint"] = Path(d, "nominal_checkpoint").read_bytes()
    finally:
        root.setLevel(level)
        tgu.SessionOptions = plain_options
    meta = program_meta(obj)
    grads = gradient_model(files["training_model.onnx"], list(meta["params"]), meta["shapes"])
    files[ort_backend.GRADIENT_FILE] = standard_ops(grads) or grads  # standard ops where every kernel lowers
    return ort_backend.pack_program(meta, files, nominal=nominal)
