"""Trainer backends behind one interface. Each backend imports its runtime lazily."""
from __future__ import annotations

from .base import Trainer

RUNTIMES = ("torch", "ort", "executorch")


def make_trainer(runtime: str, **kw) -> Trainer:
    """The backend for ``runtime``; imports that runtime only now."""
    if runtime == "torch":
        from .torch_backend import TorchTrainer
        return TorchTrainer(**kw)
    if runtime == "ort":
        from .ort_backend import OrtTrainer
        return OrtTrainer(**kw)
    if runtime == "executorch":
        from .executorch_backend import ExecuTorchTrainer
        return ExecuTorchTrainer(**kw)
    raise ValueError(f"runtime {runtime!r} is not available on this device (known: {', '.join(RUNTIMES)})")


def available_runtimes() -> list[str]:
    """Runtimes whose Python package is importable here, checked without importing them."""
    import importlib.util
    # ORT needs the training build (plain onnxruntime has no training API); ExecuTorch's bindings need torch.
    mods = {"torch": ("torch",), "executorch": ("executorch", "torch")}

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    def ort_training() -> bool:
        import os
        spec = importlib.util.find_spec("onnxruntime")
        if spec is None or not spec.submodule_search_locations:
            return False
        return any(os.path.isdir(os.path.join(p, "training", "api")) for p in spec.submodule_search_locations)

    out = []
    for r in RUNTIMES:
        if r == "ort":
            if ort_training():
                out.append(r)
        elif all(found(m) for m in mods[r]):
            out.append(r)
    return out


__all__ = ["Trainer", "make_trainer", "available_runtimes", "RUNTIMES"]
