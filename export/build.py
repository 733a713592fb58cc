"""The trainer program for (model spec, runtime, objective, layout): exported now, or taken from a store.

- ``torch``: the canonical JSON of :func:`edge.runtime.program.torch_program`.
- ``ort``: ONNX Runtime training artifacts (export/ort.py).
- ``executorch``: a ``.pte`` joint forward-backward program (export/executorch.py).

Every program is the same objective module (edge/trainers/torch_objectives), so adding an algorithm's
objective adds it to every runtime here without a line of this file changing.
"""
from __future__ import annotations

from typing import Any, Callable

from edge.model import ModelSpec
from edge.quiet import quiet
from edge.runtime.program import Program, torch_program
from edge.trainers.torch_objectives import Objective, build

RUNTIMES = ("torch", "ort", "executorch")


# fedge's calls into the export toolchains: their warnings and log lines (torch.export's pytree FutureWarnings,
# torchao's import warnings, onnxblock's and ExecuTorch's C++ log) are not shown at default verbosity (-v shows them).
def _ort(obj: Objective, **options: Any) -> bytes:
    with quiet(native=True):
        from .ort import export_ort
        return export_ort(obj, **options)


def _executorch(obj: Objective, **options: Any) -> bytes:
    with quiet(native=True):
        from .executorch import export_executorch
        return export_executorch(obj, **options)


EXPORTERS: dict[str, Callable[..., bytes]] = {"ort": _ort, "executorch": _executorch}


def build_program(spec: ModelSpec, runtime: str, *, objective: str = "ce", layout: dict | None = None,
                  **options: Any) -> Program:
    """The program, exported now. Through a cache: :func:`export.store.cached_program` (the store imports this
    module; this one imports nothing of the store, so the two do not lean on each other)."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r} (known: {', '.join(RUNTIMES)})")
    if runtime == "torch":
        return torch_program(spec, objective, layout)
    obj = build(objective, spec, layout)
    return Program(runtime, EXPORTERS[runtime](obj, **options))
