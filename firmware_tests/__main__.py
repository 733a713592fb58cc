"""``python -m firmware_tests``: check a runtime against the shipped torch golden vectors."""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import ALL_MODELS, BATCH, GATED, GOLDEN, MODELS, PROGRAM_SUFFIX, REL_TOL, RUNTIMES, peak_rss_mb

log = logging.getLogger("firmware_tests")
TIMED_STEPS = 50


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-12))


def load_golden(golden: Path, model: str) -> dict[str, Any]:
    with np.load(golden / f"{model}.npz", allow_pickle=False) as f:
        g = {k: f[k] for k in f.files}
    names = [str(n) for n in g["names"]]
    return {"x": g["x"], "y": g["y"], "lr": float(g["lr"]), "loss1": float(g["loss1"]),
            "losses10": g["losses10"], "w0": {n: g[f"w0/{n}"] for n in names},
            "w1": {n: g[f"w1/{n}"] for n in names}, "names": names}


def check(runtime: str, model: str, golden: Path) -> dict[str, Any]:
    """All checks for one (runtime, model); never raises, records failures instead."""
    from edge.trainers import make_trainer
    r: dict[str, Any] = {"runtime": runtime, "model": model, "checks": {}, "error": None}
    c = r["checks"]
    try:
        g = load_golden(golden, model)
        data = (golden / f"{model}.{PROGRAM_SUFFIX[runtime]}").read_bytes()
        t = make_trainer(runtime)
        t0 = time.perf_counter()
        t.load(data)
        r["load_ms"] = (time.perf_counter() - t0) * 1e3
        c["loads"] = True
        # one step equals the golden loss and weights
        t.set_weights(g["w0"])
        loss = t.step(g["x"], g["y"], g["lr"])
        w1 = t.get_weights()
        r["loss_rel_err"] = abs(loss - g["loss1"]) / abs(g["loss1"])
        r["weight_rel_err"] = max(_rel(w1[n], g["w1"][n]) for n in g["names"])
        c["one_step_equals_golden"] = bool(r["loss_rel_err"] <= REL_TOL and r["weight_rel_err"] <= REL_TOL
                                           and set(w1) == set(g["names"]))
        # ten steps reduce the loss
        t.set_weights(g["w0"])
        losses = [t.step(g["x"], g["y"], g["lr"]) for _ in range(10)]
        r["loss_first"], r["loss_last"] = losses[0], losses[-1]
        c["ten_steps_reduce_loss"] = bool(losses[-1] < losses[0])
        # weights set by name read back exactly
        probe = {n: (v * np.float32(0.5) - np.float32(0.25)).astype(np.float32) for n, v in g["w0"].items()}
        t.set_weights(probe)
        back = t.get_weights()
        c["weights_read_back_exactly"] = all(np.array_equal(back[n], probe[n]) for n in probe)
        # median step time
        x, y = g["x"][:BATCH], g["y"][:BATCH]
        for _ in range(10):
            t.step(x, y, 1e-3)
        times = []
        for _ in range(TIMED_STEPS):
            t0 = time.perf_counter()
            t.step(x, y, 1e-3)
            times.append(time.perf_counter() - t0)
        r["step_ms"] = float(np.median(times) * 1e3)
    except Exception as e:  # a broken runtime is a failed check, not a crash of the harness
        log.exception("%s/%s failed", runtime, model)
        r["error"] = f"{type(e).__name__}: {e}"
    return _conclude(r, c, runtime)


def _conclude(r: dict[str, Any], c: dict[str, bool], runtime: str) -> dict[str, Any]:
    """Figures every check row carries, and its verdict: no error, every check passed, enough checks ran."""
    r["peak_mb"] = peak_rss_mb()
    r["torch_imported"] = "torch" in sys.modules
    if runtime == "ort":
        c["no_torch_needed"] = not r["torch_imported"]
    r["ok"] = r["error"] is None and all(c.values()) and len(c) >= 4
    return r


def load_gated_golden(golden: Path) -> dict[str, Any]:
    with np.load(golden / f"{GATED}.npz", allow_pickle=False) as f:
        g = {k: f[k] for k in f.files}
    names = [str(n) for n in g["names"]]
    cases = []
    for j in range(int(g["cases"])):
        p = f"c{j}/"
        inputs = {k[len(p) + 3:]: v for k, v in g.items() if k.startswith(p + "in/")}
        cases.append({"in": inputs, "loss": float(g[p + "loss"]), "losses10": g[p + "losses10"],
                      "g": {n: g[f"{p}g/{n}"] for n in names}, "w1": {n: g[f"{p}w1/{n}"] for n in names}})
    return {"names": names, "lr": float(g["lr"]), "w0": {n: g[f"w0/{n}"] for n in names}, "cases": cases}


def check_gated(runtime: str, golden: Path) -> dict[str, Any]:
    """The gated FedSparse MLP: objective, every gradient (thresholds v included) and the weights after one
    numpy SGD step equal torch's, for fixed noise, at T = 1e-3 and T = 1. Never raises."""
    from edge.trainers import make_trainer
    r: dict[str, Any] = {"runtime": runtime, "model": GATED, "checks": {}, "error": None}
    c = r["checks"]
    try:
        g = load_gated_golden(golden)
        data = (golden / f"{GATED}.{PROGRAM_SUFFIX[runtime]}").read_bytes()
        t = make_trainer(runtime)
        t0 = time.perf_counter()
        t.load(data)
        r["load_ms"] = (time.perf_counter() - t0) * 1e3
        c["loads"] = True
        lr = np.float32(g["lr"])
        loss_err, grad_err, w_err, ten = 0.0, 0.0, 0.0, True
        for case in g["cases"]:
            t.set_weights(g["w0"])
            loss, grads = t.loss_and_grads(case["in"])
            if set(grads) != set(g["names"]):
                raise ValueError(f"gradients for {sorted(grads)}, want {g['names']}")
            loss_err = max(loss_err, abs(loss - case["loss"]) / abs(case["loss"]))
            grad_err = max(grad_err, max(_rel(grads[n], case["g"][n]) for n in g["names"]))
            w1 = {n: (g["w0"][n] - lr * grads[n]).astype(np.float32) for n in g["names"]}
            w_err = max(w_err, max(_rel(w1[n], case["w1"][n]) for n in g["names"]))
            # ten numpy SGD steps on the same batch and noise lower the objective
            w, losses = dict(g["w0"]), []
            for _ in range(10):
                t.set_weights(w)
                lo, gr = t.loss_and_grads(case["in"])
                losses.append(lo)
                w = {n: (w[n] - lr * gr[n]).astype(np.float32) for n in w}
            ten = ten and losses[-1] < losses[0]
        r["loss_rel_err"], r["grad_rel_err"], r["weight_rel_err"] = loss_err, grad_err, w_err
        c["one_step_equals_golden"] = bool(loss_err <= REL_TOL and grad_err <= REL_TOL and w_err <= REL_TOL)
        c["ten_steps_reduce_loss"] = bool(ten)
        probe = {n: (v * np.float32(0.5) - np.float32(0.25)).astype(np.float32) for n, v in g["w0"].items()}
        t.set_weights(probe)
        back = t.get_weights()
        c["weights_read_back_exactly"] = all(np.array_equal(back[n], probe[n]) for n in probe)
        # median time of what run_fedsparse does per step: set the weights, objective and gradients
        case = g["cases"][0]["in"]
        times = []
        for i in range(10 + TIMED_STEPS):
            t0 = time.perf_counter()
            t.set_weights(g["w0"])
            t.loss_and_grads(case)
            if i >= 10:
                times.append(time.perf_counter() - t0)
        r["step_ms"] = float(np.median(times) * 1e3)
    except Exception as e:  # a broken runtime is a failed check, not a crash of the harness
        log.exception("%s/%s failed", runtime, GATED)
        r["error"] = f"{type(e).__name__}: {e}"
    return _conclude(r, c, runtime)


def run_runtime(runtime: str, golden: Path) -> list[dict[str, Any]]:
    return [check(runtime, m, golden) for m in MODELS] + [check_gated(runtime, golden)]


def _in_subprocess(runtime: str, golden: Path) -> list[dict[str, Any]]:
    """One runtime per process, so peak RSS and imports are that runtime's own."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "firmware_tests", "--runtime", runtime, "--golden", str(golden),
                        "--json", "-"], capture_output=True, text=True, env=env, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)["results"]
    return [{"runtime": runtime, "model": m, "checks": {}, "ok": False,
             "error": f"subprocess exited {p.returncode}: {p.stderr.strip()[-500:]}"} for m in ALL_MODELS]


def torch_reference(golden: Path) -> dict[str, dict[str, float]]:
    p = golden / "torch_ref.json"
    return json.loads(p.read_text()) if p.exists() else {}


def table(results: list[dict[str, Any]], ref: dict[str, dict[str, float]]) -> str:
    cols = ["runtime", "model", "loads", "1 step = golden", "10 steps ↓", "set/get", "step ms",
            "torch ms", "peak MB", "torch MB", "result"]
    rows = []
    yes = {True: "pass", False: "FAIL", None: "-"}
    for r in results:
        c = r.get("checks", {})
        tr = ref.get(r["model"], {})
        err = r.get("grad_rel_err", r.get("weight_rel_err"))  # gated: gradients are the strict check
        rows.append([r["runtime"], r["model"], yes[c.get("loads")],
                     f"{yes[c.get('one_step_equals_golden')]} ({err:.1e})" if err is not None else "-",
                     yes[c.get("ten_steps_reduce_loss")], yes[c.get("weights_read_back_exactly")],
                     f"{r['step_ms']:.3f}" if "step_ms" in r else "-",
                     f"{tr['step_ms']:.3f}" if "step_ms" in tr else "-",
                     f"{r['peak_mb']:.0f}" if "peak_mb" in r else "-",
                     f"{tr['peak_mb']:.0f}" if "peak_mb" in tr else "-",
                     "PASS" if r.get("ok") else "FAIL" + (f": {r['error']}" if r.get("error") else "")])
    widths = [max(len(str(x)) for x in [h] + [row[i] for row in rows]) for i, h in enumerate(cols)]
    line = lambda row: "  ".join(str(v).ljust(w) for v, w in zip(row, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m firmware_tests", description=__doc__)
    ap.add_argument("--runtime", default="all", choices=[*RUNTIMES, "all"])
    ap.add_argument("--golden", type=Path, default=GOLDEN, help="directory of golden vectors and programs")
    ap.add_argument("--json", help="also write the results as JSON to this file ('-' = stdout, one line)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if a.runtime == "all":
        from edge.trainers import available_runtimes
        results = [r for rt in available_runtimes() for r in _in_subprocess(rt, a.golden)]
    else:
        results = run_runtime(a.runtime, a.golden)
    ok = bool(results) and all(r["ok"] for r in results)
    if a.json == "-":
        print(json.dumps({"ok": ok, "results": results}))
        return 0 if ok else 1
    if a.json:
        Path(a.json).write_text(json.dumps({"ok": ok, "results": results}, indent=1))
    print(table(results, torch_reference(a.golden)))
    print("ALL PASS" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
