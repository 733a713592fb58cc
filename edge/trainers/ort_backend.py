"""ONNX Runtime on-device training backend (onnxruntime-training 1.19.2); never imports torch.

Program format ``fedge-ort/2``: one msgpack map (msgpack is a core dependency, so a device needs nothing
else to unpack it)::

    {"format": "fedge-ort/2",
     "objective": name, "model": <spec>, "layout": {...},      # which objective, for which shapes
     "params": [names], "shapes": {name: shape},
     "inputs": [{"name", "shape" ("B" = batch), "dtype"}],     # the training model's inputs, in order
     "outputs": ["loss", aux...],
     "checkpoint": "nominal" | "full",                          # nominal: names and shapes only, no values
     "files": {"training_model.onnx": bytes, "checkpoint": bytes,
               ["eval_model.onnx": bytes, "optimizer_model.onnx": bytes],
               ["gradient_model.onnx": bytes]}}

The files are what ``onnxruntime.training.artifacts.generate_artifacts`` writes for the objective's graph
(export/ort.py). Cross-entropy programs (inputs exactly x, y, w) carry ORT's SGD optimizer and eval graphs
too, for :meth:`OrtTrainer.step` and :meth:`OrtTrainer.evaluate`; every program computes
:meth:`OrtTrainer.loss_and_grads`. Programs exported since the browser device also carry
``gradient_model.onnx`` (export/ort.py: gradient_model): the same loss with the gradients as graph outputs, which
any ONNX Runtime session with the training ops runs (ONNX Runtime Web's training build: clients/web). This device
does not use it, and a program without it (exported before) loads here as before.

The exporter ships ORT's *nominal* checkpoint by default (a few hundred bytes instead of ~4 bytes per
parameter): the weights always arrive with the plan. Two traps with it, both handled in :meth:`OrtTrainer.load`:
parameters of a nominal state can be set by name only after a flat buffer was copied in
(``copy_buffer_to_parameters(..., trainable_only=False)``), and an ``Optimizer`` created *before* that
segfaults in ``set_learning_rate`` (measured, exit 139); created after, it works.

Traps handled here (see shared/notes/runtimes.md):
- ``import onnxruntime.training`` imports torch; we register a stub package for it when torch is not
  already loaded, so ``training.api`` loads without torch.
- Setting a parameter on a ``CheckpointState`` that is not yet bound to a ``Module`` segfaults; the
  state is always bound first in :meth:`OrtTrainer.load`.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import types
from typing import Any

import msgpack
import numpy as np

from .base import Input, feeds, is_plain

log = logging.getLogger(__name__)

FORMAT = "fedge-ort/2"
FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")
GRAD_FILES = ("training_model.onnx", "checkpoint")  # objectives whose optimisers run in numpy
GRADIENT_FILE = "gradient_model.onnx"  # optional: loss and gradients as outputs (the browser device's graph)
EVAL_CHUNK = 1024


def pack_program(meta: dict[str, Any], files: dict[str, bytes], nominal: bool = False) -> bytes:
    """The program bytes for a set of ORT training artifacts (``meta``: edge.trainers.base.program_meta)."""
    need = FILES if "optimizer_model.onnx" in files else GRAD_FILES
    missing = [f for f in need if f not in files]
    if missing:
        raise ValueError(f"missing ORT artifacts: {missing}")
    body = {"format": FORMAT, **meta, "checkpoint": "nominal" if nominal else "full",
            "files": {k: bytes(files[k]) for k in (*need, GRADIENT_FILE) if k in files}}
    return msgpack.packb(body, use_bin_type=True)


def unpack_program(data: bytes) -> dict[str, Any]:
    """Parse and check a ``fedge-ort/2`` program."""
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ValueError(f"not a fedge ORT program: {e}") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError("not a fedge ORT program (or one of another format version)")
    return body


def _training_api() -> types.ModuleType:
    """``onnxruntime.training.api`` without importing torch.

    In the training build, ``import onnxruntime`` itself probes ``onnxruntime.training.ortmodule``
    (which imports torch), and ``onnxruntime.training/__init__`` imports torch too. Unless torch is
    already loaded, we register a bare package for ``onnxruntime.training`` (its real directory as
    ``__path__``, so ``training.api`` still imports) and mark ``ortmodule`` as absent *before* the
    first ``import onnxruntime``; ORT then takes its "no ORTModule" path.
    """
    if "onnxruntime.training" not in sys.modules and sys.modules.get("torch") is None:
        import importlib.util
        spec = importlib.util.find_spec("onnxruntime")  # locates the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("onnxruntime-training is not installed")
        stub = types.ModuleType("onnxruntime.training")
        stub.__path__ = [os.path.join(p, "training") for p in spec.submodule_search_locations]
        stub.__doc__ = "fedge stub: onnxruntime.training without its torch-importing __init__"
        sys.modules["onnxruntime.training"] = stub
        sys.modules.setdefault("onnxruntime.training.ortmodule", None)  # type: ignore[arg-type]
        import onnxruntime
        onnxruntime.training = stub  # type: ignore[attr-defined]
    import onnxruntime.training.api as api
    return api


class OrtTrainer:
    """Any objective's gradients with ORT's training graph; SGD and evaluation for cross-entropy programs."""

    runtime = "ort"

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self._mod = None

    def load(self, program: bytes) -> None:
        body = unpack_program(program)
        api = _training_api()
        import onnxruntime as ort
        ort.set_default_logger_severity(3)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if self.threads:
            so.intra_op_num_threads = int(self.threads)
            so.inter_op_num_threads = 1
        files = body["files"]
        plain = "optimizer_model.onnx" in files
        # ORT's training API reads only paths; the files are read at construction, so the directory can go
        # right after (checked by the tests: training continues after removal).
        with tempfile.TemporaryDirectory(prefix="fedge-ort-") as d:
            for name, data in files.items():
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
            state = api.CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
            # Bind the state to a Module before touching parameters (setting them earlier segfaults).
            mod = api.Module(os.path.join(d, "training_model.onnx"), state,
                             os.path.join(d, "eval_model.onnx") if plain else None, device="cpu", session_options=so)
            if body.get("checkpoint") == "nominal":
                # materialise the parameters (zeros until set_weights) before the Optimizer exists
                from onnxruntime import OrtValue
                flat = np.zeros(mod.get_parameters_size(False), np.float32)
                mod.copy_buffer_to_parameters(OrtValue.ortvalue_from_numpy(flat)._ortvalue, trainable_only=False)
            opt = api.Optimizer(os.path.join(d, "optimizer_model.onnx"), mod) if plain else None
        self.spec, self.layout = body["model"], body.get("layout") or {}
        self.objective_name = body["objective"]
        self.params: list[str] = list(body["params"])
        self.inputs = [Input.from_json(i) for i in body["inputs"]]
        self.outputs = list(body["outputs"])
        self._state, self._mod, self._opt = state, mod, opt
        self._shapes = {n: tuple(state.parameters[n].data.shape) for n in self.params}
        self.shapes, self.padding = dict(self._shapes), body.get("padding")
        self._lr: float | None = None
        mod.train()
        log.debug("loaded ORT %s program (%d params)", self.objective_name, len(self.params))

    def _need(self) -> None:
        if self._mod is None:
            raise RuntimeError("load a program first")

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self._need()
        if set(weights) != set(self.params):
            raise ValueError(f"weights {sorted(weights)} do not match the program's {sorted(self.params)}")
        arrays = {}
        for k in self.params:  # validate everything before changing anything
            a = np.ascontiguousarray(weights[k], dtype=np.float32)
            if a.shape != self._shapes[k]:
                raise ValueError(f"{k}: shape {a.shape}, program wants {self._shapes[k]}")
            arrays[k] = a
        for k, a in arrays.items():
            self._state.parameters[k] = a

    def get_weights(self) -> dict[str, np.ndarray]:
        self._need()
        return {k: np.array(self._state.parameters[k].data, dtype=np.float32, copy=True) for k in self.params}

    def _outs(self, out) -> list[np.ndarray]:
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def loss_and_grads(self, inputs: dict[str, np.ndarray]):
        self._need()
        arrays, _ = feeds(self.inputs, inputs)
        self._mod.lazy_reset_grad()  # the next call overwrites the gradient buffers instead of adding
        outs = self._outs(self._mod(*arrays))
        params = self._state.parameters
        grads = {k: np.array(params[k].grad, dtype=np.float32, copy=True) for k in self.params}
        aux = {name: np.array(a, copy=True) for name, a in zip(self.outputs[1:], outs[1:])}
        return float(np.asarray(outs[0])), grads, aux

    def _plain(self) -> None:
        self._need()
        if self._opt is None or not is_plain(self.inputs):
            raise ValueError(f"step and evaluate take cross-entropy programs, not {self.objective_name!r}")

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        self._plain()
        arrays, _ = feeds(self.inputs, {"x": x, "y": y})
        if lr != self._lr:
            self._opt.set_learning_rate(float(lr))
            self._lr = lr
        loss = self._outs(self._mod(*arrays))[0]  # gradients are computed here, loss is before the update
        self._opt.step()
        self._mod.lazy_reset_grad()
        return float(np.asarray(loss))

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        self._plain()
        x = np.asarray(x, np.float32).reshape(len(x), -1)
        y = np.asarray(y, np.int64)
        if len(x) == 0:
            raise ValueError("nothing to evaluate")
        self._mod.eval()
        try:
            total, correct = 0.0, 0
            for i in range(0, len(x), EVAL_CHUNK):
                xc, yc = x[i:i + EVAL_CHUNK], y[i:i + EVAL_CHUNK]
                arrays, _ = feeds(self.inputs, {"x": xc, "y": yc})
                loss, logits = self._outs(self._mod(*arrays))[:2]
                total += float(np.asarray(loss)) * len(xc)
                correct += int((np.asarray(logits).argmax(1) == yc).sum())
        finally:
            self._mod.train()
        return total / len(x), correct / len(x)
