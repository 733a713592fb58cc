"""``fedge export``: build (or fetch from the cache) trainer programs for zoo models, JSON specs or a person's
own module (``--model path/to/file.py:factory`` with ``--input`` or ``--data`` for the example shape)."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SUFFIX = {"torch": "torch.json", "ort": "ort", "executorch": "pte"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``export`` subcommand on the coordinator CLI."""
    s = sub.add_parser("export", help="export trainer programs, cached by content hash")
    s.add_argument("--model", default="mlp", help="zoo model name (mlp, cnn), a JSON model spec (text or .json "
                                                  "file), or path/to/file.py:factory | package.module:factory")
    s.add_argument("--input", help="example shape of a factory model, e.g. 1,28,28 (or give --data)")
    s.add_argument("--data", help=".npz whose x gives the example shape (and whose y is checked against the classes)")
    s.add_argument("--objective", default="ce", help="training objective: ce (FedAvg, FedL1, ...), fedsparse, fedprox")
    s.add_argument("--runtime", default="all", choices=["torch", "ort", "executorch", "all"],
                   help="which runtime's program (all: every one)")
    s.add_argument("--cache", default="runs/programs", help="program store directory")
    s.add_argument("--out", help="also copy each program here as <name>.<torch.json|ort|pte>")
    s.add_argument("--spec-out", help="write the model spec (JSON) here: --model SPEC.json reuses it")
    s.set_defaults(fn=cmd_export)


def model_spec(a: argparse.Namespace) -> tuple[dict, str]:
    """The spec ``--model`` names and a file name for it; ConfigError (one line) for any mistake."""
    from export.modelref import is_factory_ref, resolve, check
    from edge.runtime.config import ConfigError
    from .models import ZOO

    shape, classes = None, None
    if a.data:
        from edge.runtime.data import check_xy, read_npz
        d = read_npz(a.data)
        if "x" not in d or "y" not in d:
            raise ConfigError(f"--data {a.data}: needs arrays x and y")
        x, y = check_xy(d["x"], d["y"], a.data)
        shape, classes = x.shape[1:], int(y.max()) + 1
    if a.input:
        try:
            shape = tuple(int(v) for v in a.input.replace("x", ",").split(","))
        except ValueError:
            raise ConfigError(f"--input {a.input!r}: expected sizes like 1,28,28") from None
    if a.model in ZOO and shape is None:
        return ZOO[a.model], a.model
    if a.model.lstrip().startswith("{"):
        try:
            spec = json.loads(a.model)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--model: not valid JSON: {e}") from None
        return (spec if shape is None else check(spec, tuple(shape), classes, "JSON")), spec.get("arch", "model")
    if shape is None and a.model.endswith(".json"):
        p = Path(a.model)
        if not p.is_file():
            raise ConfigError(f"--model {a.model}: no such file")
        spec = json.loads(p.read_text())
        return spec, p.stem
    if shape is None:
        raise ConfigError(f"--model {a.model}: give the example shape with --input C,H,W or --data FILE.npz")
    spec = resolve(a.model, tuple(shape), classes)
    name = a.model.rpartition(":")[2] if is_factory_ref(a.model) else Path(a.model).stem
    return spec, name


def cmd_export(a: argparse.Namespace) -> int:
    from edge.runtime.config import ConfigError
    from .build import RUNTIMES
    from .store import ProgramStore

    spec, name = model_spec(a)
    if a.spec_out:
        Path(a.spec_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.spec_out).write_text(json.dumps(spec, indent=1))
    if spec.get("arch") == "module":
        for g in spec["groups"]:
            note = "" if g.get("exact", True) else " (renormalised by a LayerNorm when sliced)"
            print(f"gated {g['layer']:<24} {g['size']:>5} groups{note}")
    store = ProgramStore(a.cache)
    for rt in (RUNTIMES if a.runtime == "all" else (a.runtime,)):
        try:
            prog, info = store.get(spec, rt, objective=a.objective)
        except ConfigError:
            raise
        except ModuleNotFoundError as e:  # `make demo`'s venv: torch only
            raise ConfigError(f"--runtime {rt}: the export toolchain is not installed ({e}); `make install` (or "
                              "pip install 'fedge[export]') installs it") from None
        except Exception as e:  # an exporter failing on this model: one line, not a traceback
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise ConfigError(f"exporting {a.model} for {rt} failed: {type(e).__name__}: {first}") from None
        state = "cached" if info.cached else "exported"
        print(f"{rt:10s} {info.hash}  {info.size:>9d} B  {state} (export {info.export_seconds:.2f}s)")
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(a.cache) / "programs" / info.hash, Path(a.out) / f"{name}.{SUFFIX[rt]}")
    return 0
