"""The trainer interface every runtime implements (torch is the reference the others are tested against).

The training loop, the batch order and the optimiser step size live outside the runtime (see
:mod:`edge.training`), so every backend sees the same batches in the same order and must produce the
same weights.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class Trainer(Protocol):
    runtime: str

    def load(self, program: bytes) -> None:
        """Prepare the exported program; called once per program hash, never per round."""

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Overwrite parameters by name (shapes must match the program)."""

    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of all parameters by name."""

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        """One SGD step on one batch; returns the batch loss before the step."""

    def loss_and_grads(self, batch: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        """Gated programs only: the objective's value and the gradient of every parameter, for inputs by
        name (x, y, noise, server gate logits, penalty strengths). The optimisers run in numpy
        (:mod:`edge.optim`), so they are the same code on every runtime."""

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(mean loss, accuracy) on the given data, without changing weights."""
