"""ORT programs' gradient_model.onnx in standard ONNX ops (export/ort.py: standard_ops): each lowering of an ORT
training kernel against its formula in numpy, whole MLP programs against ORT's own gradients, and the graph run by
an ONNX Runtime build with no training kernels (ONNX Runtime Web's plain wasm build, in Node)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import msgpack
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

from edge.model import mlp  # noqa: E402
from edge.trainers.base import example_feeds, feeds as make_feeds  # noqa: E402
from edge.trainers.ort_backend import GRADIENT_FILE, OrtTrainer  # noqa: E402
from export.build import build_program  # noqa: E402
from export.models import ZOO  # noqa: E402
from export.ort import STANDARD_LOWERINGS, standard_ops  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "clients" / "web"
U = 2.0 ** -24


def _kernel_graph(op: str, shape: list[int], **attrs) -> bytes:
    dy = helper.make_tensor_value_info("dy", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    dx = helper.make_tensor_value_info("dx", TensorProto.FLOAT, shape)
    node = helper.make_node(op, ["dy", "y"], ["dx"], domain="com.microsoft", **attrs)
    g = helper.make_graph([node], "k", [dy, y], [dx])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString()


def _run(model: bytes, **inputs) -> np.ndarray:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, inputs)[0]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("op", sorted(STANDARD_LOWERINGS))
def test_each_lowering_is_its_kernel_and_its_formula(op):
    """Random inputs at non-unit scales, exact zeros among ReLU's inputs (its gradient there is 0): the lowered graph
    equals ORT's kernel and the formula computed in float64, within a few float32 roundings."""
    rng = np.random.default_rng(3)
    shape = [5, 7]
    dy = (rng.normal(size=shape) * 3.0).astype(np.float32)
    if op == "ReluGrad":
        y = (rng.normal(size=shape) * 2.0).astype(np.float32)
        y[0, :3] = 0.0
        want = np.where(y > 0, dy.astype(np.float64), 0.0)
        attrs = {}
    elif op == "SigmoidGrad":
        y = (1 / (1 + np.exp(-rng.normal(size=shape) * 2.0))).astype(np.float32)
        want = dy.astype(np.float64) * y * (1 - y.astype(np.float64))
        attrs = {}
    else:
        y = _log_softmax(rng.normal(size=shape) * 2.5).astype(np.float32)
        d = dy.astype(np.float64)
        want = d - np.exp(y.astype(np.float64)) * d.sum(axis=1, keepdims=True)
        attrs = {"axis": 1}
    kernel = _kernel_graph(op, shape, **attrs)
    lowered = standard_ops(kernel)
    assert lowered is not None
    assert {n.domain for n in onnx.load_from_string(lowered).graph.node} == {""}
    got, ref = _run(lowered, dy=dy, y=y), _run(kernel, dy=dy, y=y)
    tol = 8 * U * (np.abs(dy).max() * (1 + np.abs(y).max()) * shape[1] + np.abs(want).max())
    assert np.abs(got - want).max() <= tol
    assert np.abs(got - ref).max() <= tol
    if op == "ReluGrad":
        assert np.all(got[0, :3] == 0.0)


@pytest.fixture(scope="module")
def programs():
    return {obj: build_program(mlp([8, 6, 5, 3]), "ort", objective=obj) for obj in ("ce", "fedsparse", "fedprox", "flops")}


def _feeds(trainer: OrtTrainer, rng) -> dict[str, np.ndarray]:
    f = example_feeds(trainer.inputs, 7)
    f["x"] = (rng.normal(size=f["x"].shape) * 1.7).astype(np.float32)
    return f


@pytest.mark.parametrize("obj", ["ce", "fedsparse", "fedprox", "flops"])
def test_mlp_programs_ship_standard_gradients_equal_to_orts(programs, obj):
    body = msgpack.unpackb(programs[obj].data, raw=False)
    g = onnx.load_from_string(body["files"][GRADIENT_FILE])
    assert {n.domain for n in g.graph.node} == {""} and {o.domain for o in g.opset_import} <= {"", "ai.onnx"}
    t = OrtTrainer()
    t.load(programs[obj].data)
    rng = np.random.default_rng(1)
    w = {k: (rng.normal(size=s) * 0.6).astype(np.float32) for k, s in t.shapes.items()}
    t.set_weights(w)
    f = _feeds(t, rng)
    loss, grads, _aux = t.loss_and_grads(f)
    arrays, _ = make_feeds(t.inputs, f)
    s = ort.InferenceSession(body["files"][GRADIENT_FILE], providers=["CPUExecutionProvider"])
    given = {i.name: a for i, a in zip(t.inputs, arrays)} | w
    out = dict(zip([o.name for o in s.get_outputs()], s.run(None, {i.name: given[i.name] for i in s.get_inputs()})))
    assert abs(float(out["loss"]) - loss) <= 1e-5 * max(1.0, abs(loss))
    for k, gk in grads.items():
        assert np.abs(out[f"{k}_grad"] - gk).max() <= 1e-5 * max(1e-3, np.abs(gk).max()), k


def test_a_convolution_keeps_orts_gradient_kernels():
    body = msgpack.unpackb(build_program(ZOO["cnn"], "ort", objective="ce").data, raw=False)
    ops = {n.op_type for n in onnx.load_from_string(body["files"][GRADIENT_FILE]).graph.node if n.domain}
    assert "ConvGrad" in ops and standard_ops(body["files"][GRADIENT_FILE]) is None


@pytest.mark.skipif(shutil.which("node") is None or not (WEB / "node_modules" / "onnxruntime-web").exists(),
                    reason="needs node and clients/web's npm packages (npm ci --prefix clients/web)")
def test_an_onnx_runtime_without_training_kernels_runs_it(programs, tmp_path):
    """ONNX Runtime Web's plain wasm build (no training kernels) computes the ce program's loss and gradients, equal
    to ORT training's."""
    t = OrtTrainer()
    t.load(programs["ce"].data)
    rng = np.random.default_rng(2)
    w = {k: (rng.normal(size=s) * 0.6).astype(np.float32) for k, s in t.shapes.items()}
    t.set_weights(w)
    f = _feeds(t, rng)
    loss, grads, _ = t.loss_and_grads(f)
    body = msgpack.unpackb(programs["ce"].data, raw=False)
    (tmp_path / "g.onnx").write_bytes(body["files"][GRADIENT_FILE])
    arrays, _ = make_feeds(t.inputs, f)
    given = {i.name: a for i, a in zip(t.inputs, arrays)} | w
    spec = {k: {"dtype": "int64" if v.dtype == np.int64 else "float32", "shape": list(v.shape),
                "data": [int(x) for x in v.ravel()] if v.dtype == np.int64 else [float(x) for x in v.ravel()]}
            for k, v in given.items()}
    (tmp_path / "feeds.json").write_text(json.dumps(spec))
    script = tmp_path / "run.mjs"
    script.write_text(f"""
import * as ort from '{(WEB / "node_modules/onnxruntime-web/dist/ort.wasm.mjs").as_posix()}';
import fs from 'fs';
ort.env.wasm.numThreads = 1;
const spec = JSON.parse(fs.readFileSync('{(tmp_path / "feeds.json").as_posix()}'));
const s = await ort.InferenceSession.create(fs.readFileSync('{(tmp_path / "g.onnx").as_posix()}'));
const feeds = {{}};
for (const k of s.inputNames) {{
  const v = spec[k];
  feeds[k] = v.dtype === 'int64' ? new ort.Tensor('int64', BigInt64Array.from(v.data.map(BigInt)), v.shape)
                                 : new ort.Tensor('float32', Float32Array.from(v.data), v.shape);
}}
const out = await s.run(feeds);
console.log(JSON.stringify(Object.fromEntries(Object.entries(out).map(([k, t]) => [k, Array.from(t.data)]))));
""")
    r = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert abs(out["loss"][0] - loss) <= 1e-5 * max(1.0, abs(loss))
    for k, gk in grads.items():
        got = np.array(out[f"{k}_grad"], np.float32).reshape(gk.shape)
        assert np.abs(got - gk).max() <= 1e-5 * max(1e-3, np.abs(gk).max()), k
