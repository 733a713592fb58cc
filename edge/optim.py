"""Optimisers in numpy, shared by devices (client halves) and the coordinator (server halves).

They follow torch's update rules exactly (Kingma & Ba 2015 for Adam and Adamax, torch's placement of
eps), so a step here matches ``torch.optim`` to float32 rounding. ``maximize=True`` ascends, which is how
the server treats pseudo-gradients (paper 000 Alg. 1 lines 7-9).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Adam:
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    maximize: bool = False
    t: int = 0
    m: dict[str, np.ndarray] = field(default_factory=dict)
    v: dict[str, np.ndarray] = field(default_factory=dict)

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        """In place on ``params`` for the names in ``grads``."""
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for k, g in grads.items():
            g = -g if self.maximize else g
            m = self.m.setdefault(k, np.zeros_like(g, dtype=np.float64))
            v = self.v.setdefault(k, np.zeros_like(g, dtype=np.float64))
            m *= self.b1
            m += (1 - self.b1) * g
            v *= self.b2
            v += (1 - self.b2) * g * g
            upd = self.lr * (m / c1) / (np.sqrt(v / c2) + self.eps)
            params[k] -= upd.astype(params[k].dtype)

    def state(self, prefix: str) -> dict[str, np.ndarray]:
        out = {f"{prefix}t": np.array(self.t)}
        out |= {f"{prefix}m/{k}": v for k, v in self.m.items()} | {f"{prefix}v/{k}": v for k, v in self.v.items()}
        return out

    def load(self, arrays: dict[str, np.ndarray], prefix: str) -> None:
        self.t = int(arrays.get(f"{prefix}t", 0))
        self.m = {k[len(prefix) + 2:]: v.copy() for k, v in arrays.items() if k.startswith(f"{prefix}m/")}
        self.v = {k[len(prefix) + 2:]: v.copy() for k, v in arrays.items() if k.startswith(f"{prefix}v/")}


@dataclass
class Adamax(Adam):
    lr: float = 2e-3

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        self.t += 1
        c1 = 1 - self.b1 ** self.t
        for k, g in grads.items():
            g = -g if self.maximize else g
            m = self.m.setdefault(k, np.zeros_like(g, dtype=np.float64))
            u = self.v.setdefault(k, np.zeros_like(g, dtype=np.float64))
            m *= self.b1
            m += (1 - self.b1) * g
            np.maximum(self.b2 * u, np.abs(g) + self.eps, out=u)
            params[k] -= (self.lr / c1 * m / u).astype(params[k].dtype)


def sgd(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float) -> None:
    for k, g in grads.items():
        params[k] -= (lr * g).astype(params[k].dtype)
