"""ExecuTorch on-device training backend (executorch 1.5.1); torch and executorch are imported lazily.

Program: a ``.pte`` holding the objective's joint forward-backward method ``forward(*inputs)`` that returns
``[loss, aux..., gradients..., parameters...]`` (export/executorch.py), and a constant method ``fedge_meta``
returning a JSON string: format ``fedge-executorch/2``, the objective's name, spec, layout, parameter names
and shapes, inputs and outputs (edge.trainers.base.program_meta), plus the batch policy and whether the
weights are external. External-weights programs carry no weight values: the backend builds a zero ``.ptd``
for them (:func:`zero_weights_ptd`) and the plan's weights are copied in.

Row weights: every objective's data term is ``sum_i w_i l_i``; the backend feeds ``w_i = 1/N`` for the N
real rows and 0 for padding, which reproduces torch's batch mean while letting CNN programs have a fixed
batch (torch's fake conv kernel clamps a dynamic batch to [2, 15]). Cross-entropy programs split batches
longer than the program allows and sum the gradients before their single SGD update.

Traps handled (see shared/notes/runtimes.md): the program bytes must outlive the loaded method (ExecuTorch
does not copy them), so the trainer keeps a reference; ``named_parameters`` only exist after a first
forward-backward, so :meth:`ExecuTorchTrainer.load` runs one on a dummy batch (no update).
"""
from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from .base import Input, example_feeds, feeds, is_plain

log = logging.getLogger(__name__)

FORMAT = "fedge-executorch/2"
META_METHOD = "fedge_meta"
_GRAD_IDX = "__et_training_gradients_index_forward"
_PARAM_IDX = "__et_training_parameters_index_forward"
_FQN = "__et_training_fqn_forward"


def program_meta(obj: Any, **policy: Any) -> dict[str, Any]:
    """The ``fedge_meta`` of an exported objective (used by the exporter)."""
    from .base import program_meta as common
    return {"format": FORMAT, **common(obj), **policy}


def zero_weights_ptd(meta: dict[str, Any]) -> bytes:
    """A ``.ptd`` data file holding zeros for every parameter of an external-weights program.

    Programs are exported with ``external_mutable_weights`` and shipped without their ``.ptd`` (the .pte
    shrinks from ~4 bytes per parameter to ~20 KB); the weights come with the plan, so the device only
    needs correctly named and shaped storage, built here from the program's metadata.
    """
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload, TensorLayout
    from executorch.exir.schema import ScalarType
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    buffers, named = [], {}
    for i, name in enumerate(meta["params"]):
        shape = [int(d) for d in meta["shapes"][name]]
        buffers.append(bytes(4 * int(np.prod(shape, dtype=np.int64))))
        named[name] = DataEntry(buffer_index=i, alignment=16, tensor_layout=TensorLayout(
            scalar_type=ScalarType.FLOAT, sizes=shape, dim_order=list(range(len(shape)))))
    return bytes(FlatTensorSerializer().serialize(DataPayload(buffers=buffers, named_data=named)))


def read_meta(module: Any) -> dict[str, Any]:
    """The ``fedge_meta`` JSON of a loaded program."""
    out = module.run_method(META_METHOD, ())
    raw = out[0] if isinstance(out, (list, tuple)) else out
    meta = json.loads(raw)
    if meta.get("format") != FORMAT:
        raise ValueError("not a fedge ExecuTorch program (or one of another format version)")
    return meta


class ExecuTorchTrainer:
    """Any objective's gradients; plain SGD in place on the program's parameter memory for cross-entropy."""

    runtime = "executorch"

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self._m = None

    def load(self, program: bytes) -> None:
        from ..quiet import quiet
        with quiet(native=True):  # torchao's import warnings, the runtime's C++ cpuinfo/threadpool log (-v shows them)
            self._load(program)

    def _load(self, program: bytes) -> None:
        import torch
        from executorch.extension.pybindings import portable_lib as pl

        if self.threads:
            pl._unsafe_reset_threadpool(int(self.threads))
        if program[4:6] != b"ET":  # flatbuffer file identifier "ET.." at offset 4
            raise ValueError("not an ExecuTorch program")
        self._program = bytes(program)  # keep alive: the loaded program points into these bytes
        m = pl._load_for_executorch_from_buffer(self._program)
        meta = read_meta(m)
        self._ptd = None
        if meta.get("weights") == "external":
            self._ptd = zero_weights_ptd(meta)  # kept alive like the program bytes
            m = pl._load_for_executorch_from_buffer(self._program, self._ptd)
        self._torch, self._m = torch, m
        self.meta, self.spec, self.layout = meta, meta["model"], meta.get("layout") or {}
        self.objective_name = meta["objective"]
        self.params: list[str] = list(meta["params"])
        self.inputs = [Input.from_json(i) for i in meta["inputs"]]
        self.outputs = list(meta["outputs"])
        self._gi = int(m.run_method(_GRAD_IDX, ())[0])
        self._pi = int(m.run_method(_PARAM_IDX, ())[0])
        self._names = [str(f) for f in m.run_method(_FQN, ())]
        if sorted(self._names) != sorted(self.params):
            raise ValueError(f"program parameters {self._names} do not match its metadata {self.params}")
        self._fixed = meta["batch"] == "fixed"
        self._min, self._max = int(meta["min_batch"]), int(meta["max_batch"])
        # One forward-backward on a dummy batch exposes the parameter tensors (aliases of the program's
        # weight memory); nothing is updated.
        outs = self._run(example_feeds(self.inputs, self._min), self._min)[0]
        self._p = {n: outs[self._pi + i] for i, n in enumerate(self._names)}
        # numpy views of the parameter memory: weight copies and SGD updates run in numpy, because torch's
        # elementwise ops go multi-threaded (OpenMP) on tensors over 32768 elements whatever ``threads``
        # says; under load those spinning threads stalled steps 100x (0.1 ms -> 10 ms).
        self._np = {n: p.numpy() for n, p in self._p.items()}
        self._shapes = {n: tuple(p.shape) for n, p in self._p.items()}
        self.shapes, self.padding = dict(self._shapes), meta.get("padding")
        log.debug("loaded ExecuTorch %s program (%s batch %d..%d, xnnpack=%s)", self.objective_name, meta["batch"],
                  self._min, self._max, meta.get("xnnpack"))

    def _need(self) -> None:
        if self._m is None:
            raise RuntimeError("load a program first")

    def _run(self, given: dict[str, np.ndarray], n_real: int | None = None) -> tuple[list, int]:
        """Run the method on inputs by name, padding batched inputs with zero-weight rows to the program's
        batch; returns the outputs (program memory, valid until the next run) and the real row count."""
        arrays, n = feeds(self.inputs, given)
        size = self._max if self._fixed else max(n, self._min)
        if n > self._max:
            raise ValueError(f"batch of {n} rows, the program takes at most {self._max}")
        if size != n:
            for k, i in enumerate(self.inputs):
                if i.batched:
                    pad = np.zeros((size - n, *arrays[k].shape[1:]), arrays[k].dtype)
                    arrays[k] = np.concatenate([arrays[k], pad])  # padding rows have w = 0: they add nothing
        t = self._torch
        return self._m.run_method("forward", tuple(t.from_numpy(a) for a in arrays), clone_outputs=False), n

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self._need()
        if set(weights) != set(self.params):
            raise ValueError(f"weights {sorted(weights)} do not match the program's {sorted(self.params)}")
        arrays = {}
        for k in self.params:
            a = np.ascontiguousarray(weights[k], dtype=np.float32)
            if a.shape != self._shapes[k]:
                raise ValueError(f"{k}: shape {a.shape}, program wants {self._shapes[k]}")
            arrays[k] = a
        for k, a in arrays.items():
            np.copyto(self._np[k], a)

    def get_weights(self) -> dict[str, np.ndarray]:
        self._need()
        return {k: self._np[k].copy() for k in self.params}

    def loss_and_grads(self, inputs: dict[str, np.ndarray]):
        self._need()
        outs, n = self._run(inputs)
        grads = {name: outs[self._gi + i].numpy().copy() for i, name in enumerate(self._names)}
        aux = {name: outs[1 + j].numpy()[:n].copy() for j, name in enumerate(self.outputs[1:])}
        return float(outs[0]), {k: grads[k] for k in self.params}, aux

    def _plain(self) -> None:
        self._need()
        if not is_plain(self.inputs):
            raise ValueError(f"step and evaluate take cross-entropy programs, not {self.objective_name!r}")

    def _chunks(self, x: np.ndarray, y: np.ndarray):
        """Batches longer than the program allows, as pieces whose rows keep their 1/N weight."""
        x = np.asarray(x, np.float32).reshape(len(x), -1)
        y = np.asarray(y, np.int64)
        w = np.full(len(x), 1.0 / len(x), np.float32)
        for i in range(0, len(x), self._max):
            yield {"x": x[i:i + self._max], "y": y[i:i + self._max], "w": w[i:i + self._max]}

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        self._plain()
        if len(x) == 0:
            raise ValueError("empty batch")
        loss, grads = 0.0, None
        chunks = list(self._chunks(x, y))
        for c in chunks:
            outs, _ = self._run(c)
            loss += float(outs[0])
            g = [gi.numpy() for gi in outs[self._gi:self._pi]]
            if len(chunks) == 1:
                grads = g  # program memory, valid until the next run: used right away
            elif grads is None:
                grads = [gi.copy() for gi in g]
            else:
                for acc, gi in zip(grads, g):
                    acc += gi
        lr32 = np.float32(lr)
        for name, g in zip(self._names, grads):
            p = self._np[name]
            p -= lr32 * g
        return loss

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Runs the joint method (gradients computed and dropped; weights untouched)."""
        self._plain()
        if len(x) == 0:
            raise ValueError("nothing to evaluate")
        loss, correct = 0.0, 0
        for c in self._chunks(x, y):
            outs, n = self._run(c)
            loss += float(outs[0])
            correct += int((outs[1].numpy()[:n].argmax(1) == c["y"]).sum())
        return loss, correct / len(x)
