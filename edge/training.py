"""The local training loop, shared by every runtime: numpy decides the batch order from the plan's seed."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .trainers.base import Trainer


@dataclass
class LocalResult:
    loss: float
    steps: int


def batches(n: int, batch_size: int, epochs: int, seed: int):
    """Index batches for ``epochs`` passes; a fresh permutation per epoch; the last batch may be short."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        perm = rng.permutation(n)
        for i in range(0, n, batch_size):
            yield perm[i:i + batch_size]


def local_train(trainer: Trainer, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int, lr: float,
                seed: int) -> LocalResult:
    losses = []
    for idx in batches(len(x), batch_size, epochs, seed):
        losses.append(trainer.step(x[idx], y[idx], lr))
    return LocalResult(float(np.mean(losses)) if losses else float("nan"), len(losses))
