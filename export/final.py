"""Inference export of a trained model: ONNX and an ExecuTorch XNNPACK ``.pte``, both checked against torch.

Weights are baked in as constants (unlike the training programs), so XNNPACK's default partitioner
delegates every linear and conv. Both files take flat float32 inputs [N, features] and return logits.
``python -m export.final --model mlp --weights w.npz --out DIR`` (weights default to the init weights).
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from edge.model import ModelSpec, init_weights, input_size

from .models import ZOO, build

log = logging.getLogger(__name__)
CHECK_BATCHES = (1, 7, 64)


@dataclass
class FinalArtifact:
    path: str
    bytes: int
    export_seconds: float
    max_abs_err: float  # against torch on the check batches
    batches: list[int]
    min_batch: int = 1
    max_batch: int | None = None  # None: unbounded


def _check_inputs(spec: ModelSpec, seed: int = 0, min_batch: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(max(n, min_batch), input_size(spec))).astype(np.float32) for n in CHECK_BATCHES]


def export_onnx(net: torch.nn.Module, spec: ModelSpec, path: Path) -> FinalArtifact:
    """ONNX (opset 17, dynamic batch), verified with an onnxruntime InferenceSession."""
    import onnxruntime as ort
    t0 = time.perf_counter()
    buf = io.BytesIO()
    torch.onnx.export(net, (torch.zeros(2, input_size(spec)),), buf, input_names=["x"], output_names=["logits"],
                      opset_version=17, dynamo=False, dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})
    path.write_bytes(buf.getvalue())
    dt = time.perf_counter() - t0
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    err = 0.0
    for x in _check_inputs(spec):
        with torch.no_grad():
            want = net(torch.from_numpy(x)).numpy()
        got = sess.run(["logits"], {"x": x})[0]
        err = max(err, float(np.abs(got - want).max()))
    return FinalArtifact(str(path), path.stat().st_size, dt, err, list(CHECK_BATCHES), 1, None)


def export_pte(net: torch.nn.Module, spec: ModelSpec, path: Path, max_batch: int = 1024) -> FinalArtifact:
    """ExecuTorch ``.pte`` lowered to XNNPACK with a dynamic batch, verified by running it.

    The batch range is what survives lowering and memory planning (a CNN gets 2..15, see below); it
    is recorded in the artifact, and callers chunk or pad to it.
    """
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
    from torch.export import Dim, export

    t0 = time.perf_counter()
    b = Dim("batch", min=1, max=max_batch)
    ep = export(net, (torch.zeros(4, input_size(spec)),), dynamic_shapes={"x": {0: b}}, strict=True)
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    (vr,) = edge.exported_program().range_constraints.values()
    lo, hi = int(vr.lower), int(vr.upper)
    prog = edge.to_executorch()
    data = bytes(prog.buffer)
    path.write_bytes(data)
    dt = time.perf_counter() - t0
    m = _load_for_executorch_from_buffer(data)  # ``data`` stays referenced while m is used
    # Memory planning can bound the batch below the declared range: torch 2.13's fake conv kernel
    # guards on batch < 16 (_select_conv_backend), so a CNN's buffers are planned for 15 rows.
    hi = min(hi, int(m.method_meta("forward").input_tensor_meta(0).sizes()[0]))
    if lo == 2:  # the range says 2 after 0/1 specialisation; one row often runs fine, so try it
        try:
            m.forward((torch.zeros(1, input_size(spec)),))
            lo = 1
        except RuntimeError:
            pass
    err, sizes = 0.0, []
    for x in _check_inputs(spec, min_batch=lo):
        x = x[:hi]
        with torch.no_grad():
            want = net(torch.from_numpy(x)).numpy()
        got = m.forward((torch.from_numpy(x),))[0].numpy()
        err = max(err, float(np.abs(got - want).max()))
        sizes.append(len(x))
    del m
    return FinalArtifact(str(path), len(data), dt, err, sizes, lo, hi)


def export_final(spec: ModelSpec, weights: dict[str, np.ndarray], out: str | Path, name: str = "model",
                 tol: float = 1e-4) -> dict[str, FinalArtifact]:
    """Write ``<name>.onnx`` and ``<name>.pte`` to ``out``; raise if either differs from torch by > tol."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    net = build(spec, weights).eval()
    res = {"onnx": export_onnx(net, spec, out / f"{name}.onnx"), "pte": export_pte(net, spec, out / f"{name}.pte")}
    for kind, a in res.items():
        log.info("%s: %s (%d bytes, %.2fs, max |err| %.2e)", kind, a.path, a.bytes, a.export_seconds, a.max_abs_err)
        if not a.max_abs_err <= tol:
            raise RuntimeError(f"{kind} export differs from torch by {a.max_abs_err:.3e} > {tol}")
    (out / f"{name}.json").write_text(json.dumps({"model": spec, **{k: asdict(v) for k, v in res.items()}},
                                                 indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.final", description=__doc__)
    ap.add_argument("--model", default="mlp", choices=sorted(ZOO))
    ap.add_argument("--weights", type=Path, help=".npz of named weights (default: init weights, seed 0)")
    ap.add_argument("--out", type=Path, default=Path("runs/final"))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = ZOO[a.model]
    if a.weights:
        with np.load(a.weights) as f:
            weights = {k: f[k] for k in f.files}
    else:
        weights = init_weights(spec, 0)
    export_final(spec, weights, a.out, a.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
