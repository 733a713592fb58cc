"""Programs cached by content: a request (spec, runtime, objective, layout, options, exporter and torch
versions) maps to the hash of the program it produced, so a shape seen before is never exported again.

Exports are not byte-reproducible (onnxblock numbers its generated node names with a process-wide counter),
which is why the store remembers which request produced which hash. The export time is logged and kept.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edge.model import ModelSpec
from edge.runtime.program import Program, ProgramCache

from .build import build_program

log = logging.getLogger(__name__)

# Bumped whenever an exporter's output changes meaning, so stale cache keys are never reused.
EXPORTER_VERSION = 8  # 7: ORT programs carry gradient_model.onnx; 8: in standard ONNX ops where it can be


@dataclass
class BuildInfo:
    """How a program was obtained: its hash, whether it came from the cache, and its export time."""

    hash: str
    runtime: str
    cached: bool
    export_seconds: float
    size: int


def request_key(spec: ModelSpec, runtime: str, options: dict[str, Any]) -> str:
    """SHA-256 of the canonical export request."""
    body = {"spec": spec, "runtime": runtime, "options": options, "v": EXPORTER_VERSION, "torch": torch.__version__}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _padding(spec: ModelSpec, runtime: str, objective: str, layout: dict | None) -> dict | None:
    """The objective's padding declaration (edge/trainers/padded.py), which its exported programs carry: part of
    the request's key, so a program exported before it was declared is not taken for one that has it."""
    if runtime == "torch":
        return None
    from edge.trainers.torch_objectives import build
    try:
        return build(objective, spec, layout).padding()
    except Exception:  # an objective that cannot be built for this spec fails in the export, with its message
        return None


class ProgramStore:
    """Programs by content hash under ``root/programs``; requests map to hashes under ``root/keys``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.programs = ProgramCache(self.root / "programs")
        (self.root / "keys").mkdir(parents=True, exist_ok=True)
        self.exports = 0  # exports done by this instance (a cache hit does not count)

    def get(self, spec: ModelSpec, runtime: str, objective: str = "ce", layout: dict | None = None,
            **options: Any) -> tuple[Program, BuildInfo]:
        opts = {"objective": objective, "layout": layout or {}, **options}
        padding = _padding(spec, runtime, objective, layout)
        if padding is not None:  # a program that serves smaller networks carries it (its key names it)
            opts["padding"] = padding
        key = request_key(spec, runtime, opts)
        kp = self.root / "keys" / f"{key}.json"
        if kp.exists():
            rec = json.loads(kp.read_text())
            data = self.programs.get(rec["hash"])
            if data is not None:
                log.debug("program cache hit %s %s -> %s", runtime, objective, rec["hash"][:12])
                return Program(runtime, data), BuildInfo(rec["hash"], runtime, True, float(rec["export_seconds"]),
                                                         len(data))
        t0 = time.perf_counter()
        prog = build_program(spec, runtime, objective=objective, layout=layout, **options)
        dt = time.perf_counter() - t0
        self.exports += 1
        h = self.programs.put(prog.data)
        tmp = kp.with_suffix(".tmp")
        tmp.write_text(json.dumps({"hash": h, "runtime": runtime, "spec": spec, "objective": objective,
                                   "layout": layout or {}, "options": options, "export_seconds": dt,
                                   "size": len(prog.data)}, sort_keys=True))
        os.replace(tmp, kp)
        log.info("exported %s %s program in %.2fs (%d bytes, %s)", runtime, objective, dt, len(prog.data), h[:12])
        return prog, BuildInfo(h, runtime, False, dt, len(prog.data))

    def get_by_hash(self, h: str) -> bytes | None:
        return self.programs.get(h)


def cached_program(spec: ModelSpec, runtime: str, cache_dir: str | os.PathLike | None, *, objective: str = "ce",
                   layout: dict | None = None, **options: Any) -> Program:
    """The program through the :class:`ProgramStore` at ``cache_dir`` (a request seen before is never exported
    again); with ``cache_dir`` None, exported now (:func:`export.build.build_program`)."""
    if cache_dir is None:
        return build_program(spec, runtime, objective=objective, layout=layout, **options)
    return ProgramStore(cache_dir).get(spec, runtime, objective=objective, layout=layout, **options)[0]
