"""The trainer interface every runtime implements (torch is the reference the others are tested against).

A trainer loads a *program*: one objective (edge/trainers/torch_objectives) for one model spec and layout,
exported for its runtime. It sets and gets parameters by name and computes the objective with the
gradient of every parameter (``loss_and_grads``); the optimisers run in numpy (edge/optim.py), so every
runtime trains the same way. Programs of the plain cross-entropy objective also take an SGD ``step``
inside the runtime (its fast path) and ``evaluate``.

The batch order, the number of steps and the step size live outside the runtime (edge/algorithms/driver.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class Input:
    """One program input: ``shape`` uses ``"B"`` for the batch dimension; dtype ``f4`` or ``i8``. Programs
    carry their inputs in their metadata, so a backend feeds them by name without knowing the algorithm."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str = "f4"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Input":
        return cls(str(d["name"]), tuple(d["shape"]), str(d["dtype"]))

    @property
    def batched(self) -> bool:
        return "B" in self.shape

_DT = {"f4": np.float32, "i8": np.int64}


class Trainer(Protocol):
    runtime: str
    objective_name: str
    inputs: list[Input]
    params: list[str]

    def load(self, program: bytes) -> None:
        """Prepare the exported program; called once per program hash, never per round."""

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Overwrite every parameter by name (names and shapes must match the program)."""

    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of all parameters by name."""

    def loss_and_grads(self, inputs: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray],
                                                                     dict[str, np.ndarray]]:
        """(objective, gradient of every parameter, auxiliary outputs) at the current weights."""

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        """Cross-entropy programs: one SGD step on one batch; returns the batch loss before the step."""

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Cross-entropy programs: (mean loss, accuracy), weights unchanged."""


def feeds(inputs: list[Input], given: dict[str, Any]) -> tuple[list[np.ndarray], int]:
    """The arrays for a program's inputs, in order, and the batch size. ``w`` (row weights) defaults to 1/N,
    which makes every data term torch's batch mean; everything is checked against the declared inputs and
    shapes (an input the program does not declare is an error, not something to ignore)."""
    n = len(given["x"])
    if n == 0:
        raise ValueError("empty batch")
    extra = set(given) - {i.name for i in inputs}
    if extra:  # a client feeding inputs this program does not take is running the wrong program
        raise ValueError(f"inputs {sorted(extra)[:5]} are not inputs of this program")
    out = []
    for i in inputs:
        if i.name == "w" and "w" not in given:
            a = np.full(n, 1.0 / n, np.float32)
        elif i.name not in given:
            raise ValueError(f"the program needs input {i.name!r}")
        else:
            a = np.asarray(given[i.name], dtype=_DT[i.dtype])
            if i.name == "x":
                a = a.reshape(n, -1)
        want = tuple(n if d == "B" else int(d) for d in i.shape)
        if a.shape != want:
            raise ValueError(f"input {i.name}: shape {a.shape}, the program wants {want}")
        # contiguous and writable (arrays decoded from the wire are read-only views, which ExecuTorch must not
        # be handed); not np.ascontiguousarray, which would make 0-d arrays 1-d
        out.append(a if a.flags.c_contiguous and a.flags.writeable else a.copy())
    return out, n


def is_plain(inputs: list[Input]) -> bool:
    """Whether a program's inputs are just (x, y, w): the cross-entropy shape that step/evaluate take."""
    return [i.name for i in inputs] == ["x", "y", "w"]


def program_meta(obj: Any) -> dict[str, Any]:
    """What every exported program carries about its objective (read from an Objective without importing
    torch here): its name, spec, layout, parameter names and shapes, inputs and outputs."""
    params = obj.params()
    meta = {"objective": obj.name, "model": obj.spec, "layout": obj.layout, "params": list(params),
            "shapes": {k: list(p.shape) for k, p in params.items()},
            "inputs": [i.to_json() for i in obj.inputs()], "outputs": obj.outputs()}
    padding = obj.padding() if hasattr(obj, "padding") else None
    if padding is not None:  # the program also serves smaller networks (edge/trainers/padded.py)
        meta["padding"] = padding
    return meta


def example_feeds(inputs: list[Input], n: int) -> dict[str, np.ndarray]:
    """Inputs of the right shapes on which every op is defined (noise 0.5, T = 1), for a first call."""
    out = {}
    for i in inputs:
        shape = tuple(n if d == "B" else int(d) for d in i.shape)
        if i.dtype == "i8":
            out[i.name] = np.zeros(shape, np.int64)
        else:
            fill = 1.0 / n if i.name == "w" else 0.5 if i.name.startswith("u") else 1.0 if i.name == "T" else 0.0
            out[i.name] = np.full(shape, fill, np.float32)
    return out
