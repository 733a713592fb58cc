"""``python -m export.golden [--out DIR] [--only NAME,...]``: rewrite the firmware suite's golden vectors and
programs (``firmware_tests/golden/``) from the torch reference.

Needs the export toolchain (torch, onnx, onnxruntime-training, executorch); the suite that reads the files
(``python -m firmware_tests``) needs none of it. For every program of :data:`firmware_tests.PROGRAMS`:

- plain cross-entropy (``cases`` unset): ``<name>.npz`` holds the initial weights, a fixed batch, the loss
  and the weights after one torch SGD step of ``lr``, and ten-step losses;
- objective programs: ``<name>.npz`` holds the initial weights and, per test point of the registered case
  builder (``firmware_tests/cases.py``), the inputs, the torch objective, every gradient, the auxiliary
  outputs, the weights after one numpy SGD step and the objectives of ten such steps;
- and the programs ``<name>.torch.json|.ort|.pte``, exported now.

Then ``torch_ref.json``: torch's own median step time and peak RSS on this machine, measured by running the
suite on torch in a separate process (which must pass its own golden vectors). ExecuTorch exports take
20-60 s each on a loaded machine; ``--only`` regenerates some programs and keeps the others' files, and
``--figures-only`` re-measures torch_ref.json alone (step times are noisy on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.model import init_weights, input_size, num_classes
from edge.runtime.program import torch_program
from edge.trainers.base import feeds
from edge.trainers.torch_backend import TorchTrainer
from edge.trainers.torch_objectives import build
from firmware_tests import BATCH, GOLDEN, PROGRAM_SUFFIX, PROGRAMS, RUNTIMES, Golden
from firmware_tests import cases as case_builders

from .build import build_program

log = logging.getLogger("export.golden")


def _trainer(g: Golden) -> TorchTrainer:
    t = TorchTrainer(threads=1)  # the same numbers; multi-threaded torch stalls on a loaded machine
    t.load(torch_program(g.spec, g.objective, g.layout).data)
    return t


# ------------------------------------------------------------------------------ tolerances from float32 error
# Two float32 runs of the same step (another CPU's BLAS or libm, another runtime) differ by their rounding, not by
# a fixed amount: at FedSparse's T = 1e-3 one ulp of softplus(v) moves a gradient by ~3e-5 of its tensor, while
# most objectives round at ~1e-7. So a comparison's tolerance is the computation's own float32 error, measured
# against the same step in float64, times SAFETY, never less than SAFETY float32 epsilons of the tensor's scale.
SAFETY = 10.0
EPS32 = float(np.finfo(np.float32).eps)


def float64_reference(g: Golden, weights: dict[str, np.ndarray], inputs: dict[str, Any]
                      ) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The torch program of ``g`` evaluated in float64 at ``weights`` and ``inputs``: the loss, every gradient
    and the auxiliary outputs (what :meth:`TorchTrainer.loss_and_grads` returns, without float32 rounding)."""
    import torch
    obj = build(g.objective, g.spec, g.layout).double()
    params = obj.params()
    with torch.no_grad():
        for k, t in params.items():
            t.copy_(torch.from_numpy(np.asarray(weights[k], np.float64)))
    arrays, _ = feeds(obj.inputs(), inputs)
    out = obj(*[torch.from_numpy(a.astype(np.float64) if a.dtype == np.float32 else a) for a in arrays])
    out[0].backward()
    grads = {k: t.grad.numpy().copy() if t.grad is not None else np.zeros(tuple(t.shape)) for k, t in params.items()}
    aux = {n: a.detach().numpy().copy() for n, a in zip(obj.outputs()[1:], out[1:])}
    return float(out[0].detach()), grads, aux


def tolerance(x32: Any, x64: Any) -> float:
    """Absolute tolerance for comparing two float32 computations of ``x`` (any shape): SAFETY times the float32
    result's largest deviation from the float64 one, at least SAFETY float32 epsilons of max |x64|."""
    a, b = np.asarray(x32, np.float64), np.asarray(x64, np.float64)
    if not b.size:
        return 0.0
    return SAFETY * max(float(np.abs(a - b).max()), EPS32 * float(np.abs(b).max()))


def plain_vectors(g: Golden, seed: int = 0) -> dict[str, np.ndarray]:
    """A plain cross-entropy program's golden arrays, from torch's own SGD step."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, input_size(g.spec))).astype(np.float32)
    y = rng.integers(0, num_classes(g.spec), BATCH).astype(np.int64)
    w0 = init_weights(g.spec, seed)
    t = _trainer(g)
    t.set_weights(w0)
    loss1 = t.step(x, y, g.lr)
    w1 = t.get_weights()
    t.set_weights(w0)
    losses10 = np.array([t.step(x, y, g.lr) for _ in range(10)], np.float64)
    arrays = {"x": x, "y": y, "lr": np.float64(g.lr), "loss1": np.float64(loss1), "losses10": losses10,
              "names": np.array(list(w0)), "spec": np.array(json.dumps(g.spec, sort_keys=True))}
    arrays.update({f"w0/{k}": v for k, v in w0.items()})
    arrays.update({f"w1/{k}": v for k, v in w1.items()})
    return arrays


def objective_points(g: Golden, seed: int = 0) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """The registered builder's weights and cases for program ``g``."""
    return getattr(case_builders, g.cases)(g.spec, g.layout, seed)


def objective_vectors(g: Golden, seed: int = 0) -> dict[str, np.ndarray]:
    """An objective program's golden arrays: torch's objective, gradients and auxiliary outputs per case."""
    w0, cases = objective_points(g, seed)
    t = _trainer(g)
    if list(w0) != t.params:
        raise ValueError(f"the case builder's weights {list(w0)} are not the program's {t.params}")
    lr = np.float32(g.lr)
    aux_names = t.outputs[1:]
    arrays = {"names": np.array(list(w0)), "aux": np.array(aux_names, dtype=str), "lr": np.float64(g.lr),
              "cases": np.int64(len(cases)), "objective": np.array(g.objective),
              "spec": np.array(json.dumps(g.spec, sort_keys=True)),
              "layout": np.array(json.dumps(g.layout, sort_keys=True))}
    arrays.update({f"w0/{k}": v for k, v in w0.items()})
    for j, c in enumerate(cases):
        t.set_weights(w0)
        loss, grads, aux = t.loss_and_grads(c)
        arrays.update({f"c{j}/in/{k}": np.asarray(v) for k, v in c.items()})
        arrays[f"c{j}/loss"] = np.float64(loss)
        arrays.update({f"c{j}/g/{k}": v for k, v in grads.items()})
        arrays.update({f"c{j}/aux/{k}": v for k, v in aux.items()})
        arrays.update({f"c{j}/w1/{k}": (w0[k] - lr * grads[k]).astype(np.float32) for k in w0})
        w, losses = dict(w0), []
        for _ in range(10):
            t.set_weights(w)
            lo, gr, _ = t.loss_and_grads(c)
            losses.append(lo)
            w = {k: (w[k] - lr * gr[k]).astype(np.float32) for k in w}
        if not losses[-1] < losses[0]:
            raise ValueError(f"case {j}: ten SGD steps of {g.lr} do not lower the objective in torch: {losses}")
        arrays[f"c{j}/losses10"] = np.array(losses, np.float64)
    return arrays


def write_program(out: Path, name: str, g: Golden, runtimes=RUNTIMES) -> None:
    """The vectors and every runtime's program for registry entry ``name``."""
    arrays = plain_vectors(g) if g.cases is None else objective_vectors(g)
    np.savez(out / f"{name}.npz", **arrays)
    for rt in runtimes:
        prog = build_program(g.spec, rt, objective=g.objective, layout=g.layout or None)
        (out / f"{name}.{PROGRAM_SUFFIX[rt]}").write_bytes(prog.data)
        log.info("%s/%s program: %d bytes", name, rt, len(prog.data))


def torch_figures(out: Path) -> dict[str, dict[str, float]]:
    """torch's own step time and peak RSS per program, measured like every other runtime's (its own process)."""
    p = subprocess.run([sys.executable, "-m", "firmware_tests", "--runtime", "torch", "--golden", str(out),
                        "--json", "-"], capture_output=True, text=True, check=False)
    res = next((json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")), None)
    if res is None or not res["ok"]:
        raise RuntimeError(f"torch does not pass its own golden vectors: {res or p.stderr[-2000:]}")
    return {r["model"]: {"step_ms": r["step_ms"], "peak_mb": r["peak_mb"]} for r in res["results"]}


def regen(out: Path = GOLDEN, only: list[str] | None = None, figures_only: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in [] if figures_only else only or list(PROGRAMS):
        write_program(out, name, PROGRAMS[name])
    ref = torch_figures(out)
    (out / "torch_ref.json").write_text(json.dumps(ref, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.golden", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=GOLDEN)
    ap.add_argument("--only", help=f"comma-separated programs (default all: {','.join(PROGRAMS)})")
    ap.add_argument("--figures-only", action="store_true",
                    help="only re-measure torch's step times and memory (torch_ref.json): no vectors, no exports")
    a = ap.parse_args(argv)
    only = a.only.split(",") if a.only else None
    unknown = [n for n in only or [] if n not in PROGRAMS]
    if unknown:
        ap.error(f"unknown programs {unknown} (known: {', '.join(PROGRAMS)})")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    regen(a.out, only, a.figures_only)
    print(f"golden vectors written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
