"""Exported programs shared by the trainer/export/firmware tests: each (model, runtime) is exported
once per test session (ExecuTorch exports take ~10 s each), into a throw-away store."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import numpy as np

_ROOT = tempfile.mkdtemp(prefix="fedge-test-programs-")
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def store():
    from export.programs import ProgramStore
    return ProgramStore(_ROOT)


@functools.lru_cache(maxsize=None)
def program(model: str, runtime: str) -> bytes:
    """Program bytes for a zoo model ("mlp" or "cnn") and a runtime."""
    from export.models import ZOO
    prog, _info = store().get(ZOO[model], runtime)
    return prog.data


def batch(spec: dict, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A reproducible random batch (features ~ N(0, 1), labels uniform)."""
    from edge.model import input_size, num_classes
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, input_size(spec))).astype(np.float32)
    y = rng.integers(0, num_classes(spec), n).astype(np.int64)
    return x, y


GATED_SIZES = (64, 30, 20, 10)  # small: the gated tests need every runtime, and ExecuTorch exports are slow


@functools.lru_cache(maxsize=None)
def gated_program(runtime: str, sizes: tuple[int, ...] = GATED_SIZES) -> bytes:
    """A FedSparse (gated objective) program for ``mlp(sizes)``, exported once per session."""
    from edge.model import mlp
    prog, _info = store().get(mlp(list(sizes)), runtime, objective="fedsparse")
    return prog.data
