"""Where an ExecuTorch export's seconds go (issue #26, "make an export itself cheaper").

``python benchmarks/export_cost.py [--repeats 3] [--pairs mlp:fedsparse,mlp:ce,cnn:ce]`` writes
``runs/bench/export_cost.json`` and prints a table.

Each export runs in a fresh Python process (a cold process is what ``fedge export`` and a first background
export pay), timed by phase with the same calls ``export/executorch.py`` makes:

- ``imports``: torch, executorch and the exporter (executorch's import brings torchao);
- ``export``: ``torch.export`` of the objective; ``joint``: ``_export_forward_backward``;
- ``edge``: the decomposition to the edge dialect inside ``to_edge_transform_and_lower`` (the lowering less
  XNNPACK's preprocess);
- ``xnnpack``: XNNPACK's preprocess of every delegated partition (its pass pipeline and serialisation), with
  ``partitions`` the number of delegated partitions;
- ``to_executorch``: memory planning and serialisation of the program.

Each (model, objective) is exported as shipped (``trimmed``: the XNNPACK pattern passes that cannot match are
skipped, export/executorch.py) and with XNNPACK's full pass list (``full``), in alternating processes, so the
ratio is read in one run; the two programs must be byte-identical (``same_bytes``).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "runs" / "bench" / "export_cost.json"
PHASES = ("imports", "export", "joint", "edge", "xnnpack", "to_executorch")

CHILD = r"""
import hashlib, json, sys, time
t0 = time.perf_counter()
import torch
from torch.export import Dim, export
from torch.export.experimental import _export_forward_backward
from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.backends.xnnpack import xnnpack_preprocess as xp_pre
from executorch.backends.xnnpack import _passes as xp
from export.models import ZOO
from edge.trainers.torch_objectives import build
from export import executorch as ex
model, objective, variant = sys.argv[1:4]
T = {"imports": time.perf_counter() - t0}
pre = {"s": 0.0, "n": 0}
plain_pre = xp_pre.XnnpackBackend.preprocess
def timed_pre(*a, **k):
    t = time.perf_counter()
    try:
        return plain_pre(*a, **k)
    finally:
        pre["s"] += time.perf_counter() - t; pre["n"] += 1
xp_pre.XnnpackBackend.preprocess = staticmethod(timed_pre)
part = ex.xnnpack_partitioner()   # installs the trim
if variant == "full":
    xp.XNNPACKPassManager.__init__ = xp.XNNPACKPassManager._fedge_plain_init
obj = build(objective, ZOO[model], None)
if hasattr(obj, "conv_as_gemm"):
    obj.conv_as_gemm = True
fixed = ex.needs_fixed_batch(obj)
n = ex.DEFAULT_FIXED_BATCH if fixed else 4
dyn = None if fixed else ex._dynamic_shapes(obj, Dim("batch", min=1, max=ex.DEFAULT_MAX_BATCH))
obj.eval()
t = time.perf_counter(); e = export(obj, obj.example(n), dynamic_shapes=dyn, strict=True); T["export"] = time.perf_counter() - t
t = time.perf_counter(); ep = _export_forward_backward(e); T["joint"] = time.perf_counter() - t
t = time.perf_counter()
edge = to_edge_transform_and_lower(ep, transform_passes=[ex.clean_training_graph], partitioner=[part],
                                   compile_config=EdgeCompileConfig(_check_ir_validity=False))
lower = time.perf_counter() - t
T["xnnpack"] = pre["s"]; T["edge"] = lower - pre["s"]
t = time.perf_counter(); prog = edge.to_executorch(ExecutorchBackendConfig(external_mutable_weights=True))
data = bytes(prog.buffer); T["to_executorch"] = time.perf_counter() - t
print(json.dumps({"phases": T, "partitions": pre["n"], "bytes": len(data),
                  "sha256": hashlib.sha256(data).hexdigest()}))
"""


def run_child(model: str, objective: str, variant: str) -> dict:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model, objective, variant], cwd=ROOT, capture_output=True,
                         text=True, check=False)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"export of {model}/{objective} ({variant}) failed: {out.stderr.strip().splitlines()[-1:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="processes per variant (default %(default)s)")
    ap.add_argument("--pairs", default="mlp:fedsparse,mlp:ce,cnn:ce",
                    help="zoo model:objective pairs (default %(default)s; FedSparse gates MLPs and modules only)")
    ap.add_argument("--out", type=Path, default=OUT, help="JSON output (default %(default)s)")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    pairs = [p.split(":", 1) for p in a.pairs.split(",")]
    if any(len(p) != 2 for p in pairs):
        ap.error(f"--pairs takes model:objective,... (got {a.pairs!r})")
    rows = []
    for model, objective in pairs:
        got: dict[str, list[dict]] = {"trimmed": [], "full": []}
        for _ in range(a.repeats):
            for variant in ("trimmed", "full"):  # alternate, so drift hits both
                got[variant].append(run_child(model, objective, variant))
        row = {"model": model, "objective": objective, "partitions": got["trimmed"][0]["partitions"],
               "program_bytes": got["trimmed"][0]["bytes"],
               "same_bytes": len({r["sha256"] for v in got.values() for r in v}) == 1}
        for variant, runs in got.items():
            row[variant] = {"wall_s": statistics.median(r["wall_s"] for r in runs),
                            "wall_s_all": [round(r["wall_s"], 2) for r in runs],
                            "phases_s": {p: statistics.median(r["phases"][p] for r in runs) for p in PHASES}}
        row["ratio_trimmed_to_full"] = statistics.median(
            t["wall_s"] / f["wall_s"] for t, f in zip(got["trimmed"], got["full"]))
        rows.append(row)
        ph = row["trimmed"]["phases_s"]
        print(f"{model:4s} {objective:10s} wall {row['trimmed']['wall_s']:5.1f} s (full passes "
              f"{row['full']['wall_s']:5.1f} s, ratio {row['ratio_trimmed_to_full']:.2f}, same bytes "
              f"{row['same_bytes']}), partitions {row['partitions']}: "
              + ", ".join(f"{p} {ph[p]:.1f}" for p in PHASES), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                 "repeats": a.repeats, "runs": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
