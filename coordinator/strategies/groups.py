"""Structured groups of an MLP (hidden units; never the output layer's classes) and the slicing that turns
the surviving groups into a physically smaller dense network, plus the index maps that scatter a sliced
update back into the global tensors. Pure numpy: the coordinator needs no torch for this.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from edge import model as M

Index = dict[str, tuple[np.ndarray | None, np.ndarray | None]]  # tensor -> (rows kept, columns kept)


def gated_layers(spec: dict[str, Any]) -> list[int]:
    return list(range(len(spec["sizes"]) - 2))


def index_maps(spec: dict[str, Any], alive: dict[int, np.ndarray]) -> Index:
    idx: Index = {}
    prev = None
    for i in range(len(spec["sizes"]) - 1):
        rows = np.flatnonzero(alive[i]) if i in alive else None
        idx[f"fc{i}.weight"] = (rows, prev)
        idx[f"fc{i}.bias"] = (rows, None)
        prev = rows
    return idx


def sliced_spec(spec: dict[str, Any], alive: dict[int, np.ndarray]) -> dict[str, Any]:
    s = list(spec["sizes"])
    for i, a in alive.items():
        s[i + 1] = int(np.count_nonzero(a))
    return M.mlp(s)


def take(a: np.ndarray, rows, cols) -> np.ndarray:
    if rows is not None:
        a = a[rows]
    if cols is not None:
        a = a[:, cols]
    return np.ascontiguousarray(a)


def slice_weights(weights: dict[str, np.ndarray], idx: Index) -> dict[str, np.ndarray]:
    return {k: take(v, *idx[k]) for k, v in weights.items()}


def scatter_add(target: np.ndarray, sliced: np.ndarray, rows, cols) -> None:
    if rows is None and cols is None:
        target += sliced  # the common dense case: no fancy indexing (10x faster)
        return
    r = rows if rows is not None else np.arange(target.shape[0])
    if cols is not None:
        target[np.ix_(r, cols)] += sliced
    else:
        target[r] += sliced


def zero_dead(weights: dict[str, np.ndarray], alive: dict[int, np.ndarray]) -> None:
    """A removed unit has no row, no bias and no column in the next layer."""
    for i, a in alive.items():
        dead = ~a.astype(bool)
        weights[f"fc{i}.weight"][dead] = 0.0
        weights[f"fc{i}.bias"][dead] = 0.0
        weights[f"fc{i + 1}.weight"][:, dead] = 0.0


def density(alive: dict[int, np.ndarray]) -> float:
    return sum(int(np.count_nonzero(a)) for a in alive.values()) / max(1, sum(len(a) for a in alive.values()))
