"""ONNX Runtime on-device training backend (onnxruntime-training 1.19.2); never imports torch.

Program format ``fedge-ort/1``: one msgpack map (msgpack is a core dependency, so a device needs
nothing else to unpack it)::

    {"format": "fedge-ort/1",
     "model": <model spec>,                 # edge.model spec, for shapes and logging
     "params": [names in spec order],
     "inputs": ["x", "labels"],             # training/eval model inputs, in order
     "checkpoint": "nominal" | "full",      # nominal: names and shapes only, no values
     "files": {"training_model.onnx": bytes, "eval_model.onnx": bytes,
               "optimizer_model.onnx": bytes, "checkpoint": bytes}}

The files are exactly what ``onnxruntime.training.artifacts.generate_artifacts`` writes (plain SGD
optimizer, mean cross-entropy loss, ``logits`` as an extra output); see :mod:`export.programs`.

Gated programs (``"objective": "fedsparse"``, :mod:`export.gated`) carry only
``training_model.onnx`` and the checkpoint: the model's one output is the objective, ``inputs`` lists
its inputs by name (``x, y, u{i}, theta_logit{i}, lambda0, ce_scale, T, nw{i}, nb{i}``), and
:meth:`OrtTrainer.loss_and_grads` reads each parameter's gradient. ``nw{i}``/``nb{i}`` are copies of
the current weights from which the graph takes the group norms: ONNX has no stop-gradient, and the
reference detaches the norm.

The exporter ships ORT's *nominal* checkpoint by default (a few hundred bytes instead of ~4 bytes
per parameter): the weights always arrive with the plan. Two traps with it, both handled in
:meth:`OrtTrainer.load`: parameters of a nominal state can be set by name only after a flat buffer
was copied in (``copy_buffer_to_parameters(..., trainable_only=False)``), and an ``Optimizer``
created *before* that segfaults in ``set_learning_rate`` (measured, exit 139); created after, it works.

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

log = logging.getLogger(__name__)

FORMAT = "fedge-ort/1"
FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")
GATED_FILES = ("training_model.onnx", "checkpoint")  # gated programs: gradients only, optimisers in numpy
EVAL_CHUNK = 1024


def pack_program(spec: dict, params: list[str], files: dict[str, bytes], nominal: bool = False,
                 objective: str = "ce", inputs: list[str] | None = None) -> bytes:
    """The program bytes for a set of ORT training artifacts (used by the exporter)."""
    need = FILES if objective == "ce" else GATED_FILES
    missing = [f for f in need if f not in files]
    if missing:
        raise ValueError(f"missing ORT artifacts: {missing}")
    body = {"format": FORMAT, "model": spec, "params": list(params), "inputs": inputs or ["x", "labels"],
            "checkpoint": "nominal" if nominal else "full", "files": {k: bytes(files[k]) for k in need}}
    if objective != "ce":
        body["objective"] = objective
    return msgpack.packb(body, use_bin_type=True)


def unpack_program(data: bytes) -> dict[str, Any]:
    """Parse and check a ``fedge-ort/1`` program."""
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ValueError(f"not a fedge ORT program: {e}") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError("not a fedge ORT program")
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
    """Plain SGD on mean cross-entropy with ORT's training, eval and SGD optimizer graphs."""

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
        self.objective = body.get("objective", "ce")
        gated = self.objective != "ce"
        # ORT's training API reads only paths; the files are read at construction, so the
        # directory can go right after (checked by the tests: training continues after removal).
        with tempfile.TemporaryDirectory(prefix="fedge-ort-") as d:
            for name in body["files"]:
                with open(os.path.join(d, name), "wb") as f:
                    f.write(body["files"][name])
            state = api.CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
            # Bind the state to a Module before touching parameters (setting them earlier segfaults).
            mod = api.Module(os.path.join(d, "training_model.onnx"), state,
                             None if gated else os.path.join(d, "eval_model.onnx"), device="cpu",
                             session_options=so)
            if body.get("checkpoint") == "nominal":
                # materialise the parameters (zeros until set_weights) before the Optimizer exists
                from onnxruntime import OrtValue
                flat = np.zeros(mod.get_parameters_size(False), np.float32)
                mod.copy_buffer_to_parameters(OrtValue.ortvalue_from_numpy(flat)._ortvalue, trainable_only=False)
            opt = None if gated else api.Optimizer(os.path.join(d, "optimizer_model.onnx"), mod)
        self.spec = body["model"]
        self.params: list[str] = list(body["params"])
        self._state, self._mod, self._opt = state, mod, opt
        self._shapes = {n: tuple(state.parameters[n].data.shape) for n in self.params}
        self._lr: float | None = None
        self._inputs_order: list[str] = list(body["inputs"])
        self._current: dict[str, np.ndarray] = {}
        if gated:
            self._current = {n: np.zeros(self._shapes[n], np.float32) for n in self.params}
        mod.train()
        log.debug("loaded ORT program for %s (%d params, objective %s)", self.spec.get("arch"), len(self.params),
                  self.objective)

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
        if self._opt is None:
            # gated programs compute the (detached) group norms from copies fed as inputs (export.gated)
            self._current = {k: a.copy() for k, a in arrays.items()}

    def loss_and_grads(self, batch: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        """The gated objective and the gradient of every parameter, at the weights last set."""
        self._need()
        if self._opt is not None:
            raise ValueError("loss_and_grads needs a gated (fedsparse) program")
        feeds = []
        for name in self._inputs_order:
            if name.startswith(("nw", "nb")) and name[2:].isdigit():
                a = self._current[f"fc{name[2:]}.{'weight' if name[1] == 'w' else 'bias'}"]
            elif name == "x":
                a = np.ascontiguousarray(batch["x"], dtype=np.float32)
                a = a.reshape(len(a), -1)
            elif name == "y":
                a = np.ascontiguousarray(batch["y"], dtype=np.int64)
            else:
                a = np.array(batch[name], dtype=np.float32)  # keeps 0-d scalars 0-d
            feeds.append(a)
        self._mod.lazy_reset_grad()  # the next call overwrites the gradient buffers instead of adding
        loss = self._mod(*feeds)
        params = self._state.parameters
        grads = {k: np.array(params[k].grad, dtype=np.float32, copy=True) for k in self.params}
        return float(np.asarray(loss)), grads

    def get_weights(self) -> dict[str, np.ndarray]:
        self._need()
        return {k: np.array(self._state.parameters[k].data, dtype=np.float32, copy=True) for k in self.params}

    @staticmethod
    def _inputs(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        return x.reshape(len(x), -1), np.ascontiguousarray(y, dtype=np.int64)

    def _plain(self) -> None:
        if self._opt is None:
            raise ValueError("a gated program only computes loss_and_grads (its optimisers run in numpy)")

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        self._need()
        self._plain()
        xb, yb = self._inputs(x, y)
        if lr != self._lr:
            self._opt.set_learning_rate(float(lr))
            self._lr = lr
        loss, _logits = self._mod(xb, yb)  # gradients are computed here, loss is before the update
        self._opt.step()
        self._mod.lazy_reset_grad()
        return float(loss)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        self._need()
        self._plain()
        xb, yb = self._inputs(x, y)
        if len(xb) == 0:
            raise ValueError("nothing to evaluate")
        self._mod.eval()
        try:
            total, correct = 0.0, 0
            for i in range(0, len(xb), EVAL_CHUNK):
                xc, yc = xb[i:i + EVAL_CHUNK], yb[i:i + EVAL_CHUNK]
                loss, logits = self._mod(xc, yc)
                total += float(loss) * len(xc)
                correct += int((np.asarray(logits).argmax(1) == yc).sum())
        finally:
            self._mod.train()
        return total / len(xb), correct / len(xb)
