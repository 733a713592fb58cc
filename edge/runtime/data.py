"""A device's local data: an ``.npz`` with ``x`` (float32 features) and ``y`` (int labels)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def load_npz(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        x, y = f["x"].astype(np.float32), f["y"].astype(np.int64)
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"{path}: x and y must be non-empty and of the same length")
    return x, y


def save_npz(path: str | os.PathLike, x: np.ndarray, y: np.ndarray) -> None:
    np.savez(path, x=np.asarray(x, np.float32), y=np.asarray(y, np.int64))


# ------------------------------------------------------------------ a person's data (one-line ConfigErrors)
def _config_error(msg: str) -> Exception:
    from .config import ConfigError
    return ConfigError(msg)


def check_xy(x: np.ndarray, y: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """x as float32 (any shape, examples first), y as int64 labels 0..C-1; a one-line ConfigError otherwise."""
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim < 2:
        raise _config_error(f"{what}: x must be examples x features (or examples x C x H x W), got shape {x.shape}")
    if y.ndim != 1 or len(y) != len(x):
        raise _config_error(f"{what}: y must be one label per example ({len(x)}), got shape {y.shape}")
    if len(x) == 0:
        raise _config_error(f"{what}: no examples")
    if not np.issubdtype(x.dtype, np.number):
        raise _config_error(f"{what}: x must be numbers, not {x.dtype}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise _config_error(f"{what}: x has NaN or infinite values")
    if np.issubdtype(y.dtype, np.floating):
        if not np.array_equal(y, np.round(y)):
            raise _config_error(f"{what}: y must be integer class labels")
    elif not np.issubdtype(y.dtype, np.integer):
        raise _config_error(f"{what}: y must be integer class labels, not {y.dtype}")
    y = y.astype(np.int64)
    if y.min() < 0:
        raise _config_error(f"{what}: labels must be 0..C-1, found {int(y.min())}")
    return x, y


def read_npz(path: str | Path, what: str | None = None) -> dict[str, np.ndarray]:
    what = what or str(path)
    p = Path(path)
    if not p.is_file():
        raise _config_error(f"{what}: no such file")
    try:
        with np.load(p, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except Exception as e:  # not an npz, object arrays, ...
        raise _config_error(f"{what}: cannot read as .npz ({type(e).__name__}: {e})") from None
