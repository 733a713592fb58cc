"""``python -m firmware_tests.regen``: rewrite the golden vectors and programs from the torch reference.

Needs the export toolchain (torch, onnx, onnxruntime-training, executorch). Writes, per zoo model,
``<model>.npz`` (initial weights, a fixed batch, the loss and weights after one SGD step, ten-step
losses), the programs ``<model>.torch.json|.ort|.pte``, and ``torch_ref.json`` (torch's own median
step time and peak RSS on this machine, measured in a separate process).
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np

from . import BATCH, GOLDEN, LR, MODELS, PROGRAM_SUFFIX, RUNTIMES

log = logging.getLogger("firmware_tests.regen")


def regen(out: Path = GOLDEN, seed: int = 0) -> None:
    from edge.model import init_weights, input_size, num_classes
    from edge.program import torch_program
    from edge.trainers.torch_backend import TorchTrainer
    from export.models import ZOO
    from export.programs import build_program

    out.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        spec = ZOO[model]
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(BATCH, input_size(spec))).astype(np.float32)
        y = rng.integers(0, num_classes(spec), BATCH).astype(np.int64)
        w0 = init_weights(spec, seed)
        t = TorchTrainer()
        t.load(torch_program(spec).data)
        t.set_weights(w0)
        loss1 = t.step(x, y, LR)
        w1 = t.get_weights()
        t.set_weights(w0)
        losses10 = np.array([t.step(x, y, LR) for _ in range(10)], np.float64)
        arrays = {"x": x, "y": y, "lr": np.float64(LR), "loss1": np.float64(loss1), "losses10": losses10,
                  "names": np.array(list(w0)), "spec": np.array(json.dumps(spec, sort_keys=True))}
        arrays.update({f"w0/{k}": v for k, v in w0.items()})
        arrays.update({f"w1/{k}": v for k, v in w1.items()})
        np.savez(out / f"{model}.npz", **arrays)
        for rt in RUNTIMES:
            prog = build_program(spec, rt)
            (out / f"{model}.{PROGRAM_SUFFIX[rt]}").write_bytes(prog.data)
            log.info("%s/%s program: %d bytes", model, rt, len(prog.data))
    # torch's own numbers, measured like every other runtime's (its own process)
    p = subprocess.run([sys.executable, "-m", "firmware_tests", "--runtime", "torch", "--golden", str(out),
                        "--json", "-"], capture_output=True, text=True, check=False)
    res = next(json.loads(line) for line in p.stdout.splitlines() if line.startswith("{"))
    if not res["ok"]:
        raise RuntimeError(f"torch does not pass its own golden vectors: {res}")
    ref = {r["model"]: {"step_ms": r["step_ms"], "peak_mb": r["peak_mb"]} for r in res["results"]}
    (out / "torch_ref.json").write_text(json.dumps(ref, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m firmware_tests.regen", description=__doc__)
    ap.add_argument("--out", type=Path, default=GOLDEN)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    regen(a.out)
    print(f"golden vectors written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
