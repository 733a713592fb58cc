"""ExecuTorch on-device training backend (executorch 1.5.1); torch and executorch are imported lazily.

Program: a plain ``.pte`` holding a joint forward-backward method ``forward(x, y, w)`` that returns
``[loss, logits, grads..., params...]`` with ``loss = sum_i w_i * CE_i``, and a constant method
``fedge_meta`` returning a JSON string (format, model spec, parameter names, batch policy, whether
the weights are external). External-weights programs carry no weight values: the backend builds a
zero ``.ptd`` for them (:func:`zero_weights_ptd`) and the plan's weights are copied in. The
backend feeds ``w_i = 1/N`` for the N real rows and 0 for padding rows, which reproduces torch's mean
cross-entropy exactly while letting programs have a fixed batch (CNNs: torch's fake conv kernel
clamps a dynamic batch to [2, 15]) or a bounded dynamic one (MLPs: 1..max). Batches longer than the
program allows are split and their gradients summed before the single SGD update.

Gated programs (``objective: "fedsparse"`` in the metadata, :mod:`export.gated`) hold
``forward(x, y, w, u..., theta_logit..., lambda0, ce_scale, T)`` returning ``[loss, grads...,
params...]``; :meth:`ExecuTorchTrainer.loss_and_grads` feeds them by name (``meta["inputs"]``).

Traps handled (see shared/notes/runtimes.md): the program bytes must outlive the loaded method
(ExecuTorch does not copy them), so the trainer keeps a reference; ``named_parameters`` only exist
after a first forward-backward, so :meth:`load` runs one on a dummy batch (no update).
"""
from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from ..model import input_size

log = logging.getLogger(__name__)

FORMAT = "fedge-executorch/1"
META_METHOD = "fedge_meta"
_GRAD_IDX = "__et_training_gradients_index_forward"
_PARAM_IDX = "__et_training_parameters_index_forward"
_FQN = "__et_training_fqn_forward"


def zero_weights_ptd(meta: dict[str, Any]) -> bytes:
    """A ``.ptd`` data file holding zeros for every parameter of an external-weights program.

    Programs are exported with ``external_mutable_weights`` and shipped without their ``.ptd``
    (the .pte shrinks from ~4 bytes per parameter to ~20 KB); the weights come with the plan, so the
    device only needs correctly named and shaped storage, built here from the program's metadata.
    """
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload, TensorLayout
    from executorch.exir.schema import ScalarType
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    from ..model import param_shapes

    shapes = dict(param_shapes(meta["model"]))
    for name in meta["params"]:
        if name.endswith(".v"):  # gated programs: one threshold per unit of hidden layer fc{i}
            shapes[name] = (int(meta["model"]["sizes"][int(name[2:-2]) + 1]),)
    buffers, named = [], {}
    for i, name in enumerate(meta["params"]):
        shape = list(shapes[name])
        buffers.append(bytes(4 * int(np.prod(shape, dtype=np.int64))))
        named[meta.get("prefix", "") + name] = DataEntry(
            buffer_index=i, alignment=16,
            tensor_layout=TensorLayout(scalar_type=ScalarType.FLOAT, sizes=shape, dim_order=list(range(len(shape)))))
    return bytes(FlatTensorSerializer().serialize(DataPayload(buffers=buffers, named_data=named)))


def read_meta(module: Any) -> dict[str, Any]:
    """The ``fedge_meta`` JSON of a loaded program."""
    out = module.run_method(META_METHOD, ())
    raw = out[0] if isinstance(out, (list, tuple)) else out
    meta = json.loads(raw)
    if meta.get("format") != FORMAT:
        raise ValueError("not a fedge ExecuTorch program")
    return meta


class ExecuTorchTrainer:
    """Plain SGD (in place on the program's parameter memory) on mean cross-entropy."""

    runtime = "executorch"

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self._m = None

    def load(self, program: bytes) -> None:
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
        self._torch = torch
        self._m = m
        self.meta, self.spec = meta, meta["model"]
        self.params: list[str] = list(meta["params"])
        self._gi = int(m.run_method(_GRAD_IDX, ())[0])
        self._pi = int(m.run_method(_PARAM_IDX, ())[0])
        fqn = [str(f) for f in m.run_method(_FQN, ())]
        prefix = meta.get("prefix", "")
        self._names = [f[len(prefix):] if f.startswith(prefix) else f for f in fqn]
        if sorted(self._names) != sorted(self.params):
            raise ValueError(f"program parameters {self._names} do not match its metadata {self.params}")
        self._fixed = meta["batch"] == "fixed"
        self._min, self._max = int(meta["min_batch"]), int(meta["max_batch"])
        self._nin = input_size(self.spec)
        self.objective = meta.get("objective", "ce")
        # One forward-backward on a dummy batch exposes the parameter tensors (aliases of the program's
        # weight memory); nothing is updated.
        if self.objective == "ce":
            outs = self._run(np.zeros((self._min, self._nin), np.float32), np.zeros(self._min, np.int64),
                             np.full(self._min, 1.0 / self._min, np.float32))
        else:
            sizes = self.spec["sizes"]
            dummy = {"x": np.zeros((self._min, self._nin), np.float32), "y": np.zeros(self._min, np.int64),
                     "lambda0": np.float32(0), "ce_scale": np.float32(0), "T": np.float32(1)}
            for i in range(len(sizes) - 2):
                dummy[f"u{i}"] = np.full(sizes[i + 1], 0.5, np.float32)
                dummy[f"theta_logit{i}"] = np.zeros(sizes[i + 1], np.float32)
            outs = self._run_gated(dummy)
        self._p = {n: outs[self._pi + i] for i, n in enumerate(self._names)}
        # numpy views of the parameter memory: weight copies and SGD updates run in numpy, because
        # torch's elementwise ops go multi-threaded (OpenMP) on tensors over 32768 elements whatever
        # ``threads`` says; under load those spinning threads stalled steps 100x (0.1 ms -> 10 ms).
        self._np = {n: p.numpy() for n, p in self._p.items()}
        self._shapes = {n: tuple(p.shape) for n, p in self._p.items()}
        log.debug("loaded ExecuTorch program %s (%s batch %d..%d, xnnpack=%s)", self.spec.get("arch"),
                  meta["batch"], self._min, self._max, meta.get("xnnpack"))

    def _need(self) -> None:
        if self._m is None:
            raise RuntimeError("load a program first")

    def _run(self, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> list:
        t = self._torch
        return self._m.run_method("forward", (t.from_numpy(x), t.from_numpy(y), t.from_numpy(w)),
                                  clone_outputs=False)

    def _run_gated(self, batch: dict[str, np.ndarray]) -> list:
        """The gated method on inputs by name (``w`` = 1/N per row: torch's batch-mean cross-entropy)."""
        t = self._torch
        x, y = self._inputs(batch["x"], batch["y"])
        n = len(x)
        if not self._min <= n <= self._max:
            raise ValueError(f"batch of {n} rows, the gated program takes {self._min}..{self._max}")
        feeds = []
        for name in self.meta["inputs"]:
            if name == "x":
                a = x
            elif name == "y":
                a = y
            elif name == "w":
                a = np.full(n, 1.0 / n, np.float32)
            else:
                a = np.array(batch[name], dtype=np.float32)  # keeps 0-d scalars 0-d
            feeds.append(t.from_numpy(a))
        return self._m.run_method("forward", tuple(feeds), clone_outputs=False)

    def loss_and_grads(self, batch: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        """The gated objective and the gradient of every parameter, at the current weights."""
        self._need()
        if self.objective == "ce":
            raise ValueError("loss_and_grads needs a gated (fedsparse) program")
        outs = self._run_gated(batch)
        grads = {n: outs[self._gi + i].numpy().copy() for i, n in enumerate(self._names)}
        return float(outs[0]), {n: grads[n] for n in self.params}  # the program's order is by module

    def _plain(self) -> None:
        if self.objective != "ce":
            raise ValueError("a gated program only computes loss_and_grads (its optimisers run in numpy)")

    def _chunks(self, x: np.ndarray, y: np.ndarray):
        """(x, y, w, n_real) per program call: rows 1/N-weighted, padded with w=0 rows as needed."""
        n = len(x)
        inv = np.float32(1.0 / n)
        for i in range(0, n, self._max):
            xc, yc = x[i:i + self._max], y[i:i + self._max]
            k = len(xc)
            size = self._max if self._fixed else max(k, self._min)
            w = np.zeros(size, np.float32)
            w[:k] = inv
            if size != k:
                xp = np.zeros((size, self._nin), np.float32)
                xp[:k] = xc
                yp = np.zeros(size, np.int64)
                yp[:k] = yc
                xc, yc = xp, yp
            yield np.ascontiguousarray(xc), np.ascontiguousarray(yc), w, k

    def _inputs(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        x = x.reshape(len(x), -1)
        if x.shape[1] != self._nin:
            raise ValueError(f"inputs have {x.shape[1]} features, program wants {self._nin}")
        return x, np.ascontiguousarray(y, dtype=np.int64)

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

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        self._need()
        self._plain()
        x, y = self._inputs(x, y)
        if len(x) == 0:
            raise ValueError("empty batch")
        loss, grads = 0.0, None
        chunks = list(self._chunks(x, y))
        for xc, yc, w, _k in chunks:
            outs = self._run(xc, yc, w)
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
        self._need()
        self._plain()
        x, y = self._inputs(x, y)
        if len(x) == 0:
            raise ValueError("nothing to evaluate")
        loss, correct = 0.0, 0
        for xc, yc, w, k in self._chunks(x, y):
            outs = self._run(xc, yc, w)
            loss += float(outs[0])
            correct += int((outs[1].numpy()[:k].argmax(1) == yc[:k]).sum())
        return loss, correct / len(x)
