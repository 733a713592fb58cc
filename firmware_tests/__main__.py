"""``python -m firmware_tests``: check a runtime against the shipped torch golden vectors.

Two kinds of program (see :data:`firmware_tests.PROGRAMS`):

- plain cross-entropy (``mlp``, ``cnn``): one SGD ``step`` equals the golden loss and weights, ten steps
  lower the loss, weights read back exactly; step time and peak memory;
- objective programs (``gated``, ``mixture``, ...): at every golden case ``loss_and_grads`` equals the golden
  loss, every gradient and every auxiliary output, one numpy SGD step equals the golden weights (all rel <=
  the program's ``rel_tol``: 1e-4, 3e-4 for ``gated``), ten numpy SGD steps on the case lower the objective,
  weights read back exactly; the time of what a client does per step (``set_weights`` and ``loss_and_grads``).
"""
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

from . import BATCH, GOLDEN, PROGRAM_SUFFIX, PROGRAMS, RUNTIMES, peak_rss_mb

log = logging.getLogger("firmware_tests")
TIMED_STEPS = 50


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-12)) if b.size else 0.0


def aux_rel(a: np.ndarray, b: np.ndarray) -> float:
    """Relative error of an auxiliary output, per column of axis 1 (a slot or a class), so that an inactive
    slot's log-probabilities near -1e4 do not hide an error in an active one."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return float("inf")
    if b.ndim < 2:
        return _rel(a, b)
    return max(_rel(a[:, j], b[:, j]) for j in range(b.shape[1]))


def _probe(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Weights that are not the golden ones, to check that what is set is what is read back."""
    return {n: (v * np.float32(0.5) - np.float32(0.25)).astype(np.float32) for n, v in w.items()}


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def load_golden(golden: Path, name: str) -> dict[str, Any]:
    """A plain cross-entropy program's golden vectors: a batch, w0, the loss and weights after one step."""
    g = _npz(golden / f"{name}.npz")
    names = [str(n) for n in g["names"]]
    return {"x": g["x"], "y": g["y"], "lr": float(g["lr"]), "loss1": float(g["loss1"]),
            "losses10": g["losses10"], "w0": {n: g[f"w0/{n}"] for n in names},
            "w1": {n: g[f"w1/{n}"] for n in names}, "names": names}


def load_objective_golden(golden: Path, name: str) -> dict[str, Any]:
    """An objective program's golden vectors: w0 and, per case, the inputs, the loss, every gradient, the
    auxiliary outputs, the weights after one numpy SGD step and ten steps' objectives."""
    g = _npz(golden / f"{name}.npz")
    names = [str(n) for n in g["names"]]
    aux_names = [str(n) for n in g["aux"]]
    cases = []
    for j in range(int(g["cases"])):
        p = f"c{j}/"
        cases.append({"in": {k[len(p) + 3:]: v for k, v in g.items() if k.startswith(p + "in/")},
                      "loss": float(g[p + "loss"]), "losses10": g[p + "losses10"],
                      "g": {n: g[f"{p}g/{n}"] for n in names}, "aux": {a: g[f"{p}aux/{a}"] for a in aux_names},
                      "w1": {n: g[f"{p}w1/{n}"] for n in names}})
    return {"names": names, "aux": aux_names, "lr": float(g["lr"]), "objective": str(g["objective"]),
            "w0": {n: g[f"w0/{n}"] for n in names}, "cases": cases}


THREADS: int | None = None  # --threads: the runtimes' thread count (None: each runtime's own choice)


def _start(runtime: str, name: str, golden: Path) -> tuple[dict[str, Any], Any]:
    from edge.trainers import make_trainer
    r: dict[str, Any] = {"runtime": runtime, "model": name, "checks": {}, "error": None,
                         "threads": THREADS or "default"}
    data = (golden / f"{name}.{PROGRAM_SUFFIX[runtime]}").read_bytes()
    t = make_trainer(runtime, threads=THREADS)
    t0 = time.perf_counter()
    t.load(data)
    r["load_ms"] = (time.perf_counter() - t0) * 1e3
    r["checks"]["loads"] = True
    return r, t


def check(runtime: str, name: str, golden: Path) -> dict[str, Any]:
    """A plain cross-entropy program, through the runtime's SGD ``step``; never raises, records failures."""
    r: dict[str, Any] = {"runtime": runtime, "model": name, "checks": {}, "error": None}
    try:
        g = load_golden(golden, name)
        r, t = _start(runtime, name, golden)
        c = r["checks"]
        # one step equals the golden loss and weights
        t.set_weights(g["w0"])
        loss = t.step(g["x"], g["y"], g["lr"])
        w1 = t.get_weights()
        r["loss_rel_err"] = abs(loss - g["loss1"]) / abs(g["loss1"])
        r["weight_rel_err"] = max(_rel(w1[n], g["w1"][n]) for n in g["names"])
        r["rel_err"] = max(r["loss_rel_err"], r["weight_rel_err"])
        r["rel_tol"] = PROGRAMS[name].rel_tol
        c["one_step_equals_golden"] = bool(r["rel_err"] <= r["rel_tol"] and set(w1) == set(g["names"]))
        # ten steps reduce the loss
        t.set_weights(g["w0"])
        losses = [t.step(g["x"], g["y"], g["lr"]) for _ in range(10)]
        r["loss_first"], r["loss_last"] = losses[0], losses[-1]
        c["ten_steps_reduce_loss"] = bool(losses[-1] < losses[0])
        # weights set by name read back exactly
        probe = _probe(g["w0"])
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
        log.exception("%s/%s failed", runtime, name)
        r["error"] = f"{type(e).__name__}: {e}"
    return _conclude(r, runtime)


def check_objective(runtime: str, name: str, golden: Path) -> dict[str, Any]:
    """An objective program, through ``loss_and_grads`` at every golden case (the optimisers of these
    objectives run in numpy on the device); never raises, records failures."""
    r: dict[str, Any] = {"runtime": runtime, "model": name, "checks": {}, "error": None}
    try:
        g = load_objective_golden(golden, name)
        r, t = _start(runtime, name, golden)
        c = r["checks"]
        names, lr = g["names"], np.float32(g["lr"])
        loss_err = grad_err = aux_err = w_err = 0.0
        ten = True
        for case in g["cases"]:
            t.set_weights(g["w0"])
            loss, grads, aux = t.loss_and_grads(case["in"])
            if list(grads) != names:
                raise ValueError(f"gradients for {sorted(grads)}, want {names}")
            if sorted(aux) != sorted(g["aux"]):
                raise ValueError(f"auxiliary outputs {sorted(aux)}, want {sorted(g['aux'])}")
            loss_err = max(loss_err, abs(loss - case["loss"]) / abs(case["loss"]))
            grad_err = max(grad_err, max(_rel(grads[n], case["g"][n]) for n in names))
            aux_err = max([aux_err] + [aux_rel(aux[a], case["aux"][a]) for a in g["aux"]])
            w1 = {n: (g["w0"][n] - lr * grads[n]).astype(np.float32) for n in names}
            w_err = max(w_err, max(_rel(w1[n], case["w1"][n]) for n in names))
            # ten numpy SGD steps on the same inputs lower the objective
            w, losses = dict(g["w0"]), []
            for _ in range(10):
                t.set_weights(w)
                lo, gr, _ = t.loss_and_grads(case["in"])
                losses.append(lo)
                w = {n: (w[n] - lr * gr[n]).astype(np.float32) for n in w}
            ten = ten and losses[-1] < losses[0]
        r["loss_rel_err"], r["grad_rel_err"], r["aux_rel_err"], r["weight_rel_err"] = loss_err, grad_err, aux_err, w_err
        r["rel_err"] = max(loss_err, grad_err, aux_err, w_err)
        r["rel_tol"] = PROGRAMS[name].rel_tol
        c["one_step_equals_golden"] = bool(r["rel_err"] <= r["rel_tol"])
        c["ten_steps_reduce_loss"] = bool(ten)
        probe = _probe(g["w0"])
        t.set_weights(probe)
        back = t.get_weights()
        c["weights_read_back_exactly"] = all(np.array_equal(back[n], probe[n]) for n in probe)
        # median time of what a client does per step: set the weights, objective and gradients
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
        log.exception("%s/%s failed", runtime, name)
        r["error"] = f"{type(e).__name__}: {e}"
    return _conclude(r, runtime)


def _conclude(r: dict[str, Any], runtime: str) -> dict[str, Any]:
    """Figures every check row carries, and its verdict: no error, every check passed, enough checks ran."""
    c = r["checks"]
    r["peak_mb"] = peak_rss_mb()
    r["torch_imported"] = sys.modules.get("torch") is not None  # (None: made unimportable)
    if runtime == "ort":
        c["no_torch_needed"] = not r["torch_imported"]
    r["ok"] = r["error"] is None and all(c.values()) and len(c) >= 4
    return r


def run_runtime(runtime: str, golden: Path, names: list[str] | None = None) -> list[dict[str, Any]]:
    out = []
    for name in names or list(PROGRAMS):
        fn = check if PROGRAMS[name].cases is None else check_objective
        out.append(fn(runtime, name, golden))
    return out


def _in_subprocess(runtime: str, golden: Path, names: list[str] | None, threads: int | None = None
                   ) -> list[dict[str, Any]]:
    """One runtime per process, so peak RSS and imports are that runtime's own."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "firmware_tests", "--runtime", runtime, "--golden", str(golden), "--json", "-"]
    if names:
        cmd += ["--only", ",".join(names)]
    if threads:
        cmd += ["--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)["results"]
    return [{"runtime": runtime, "model": m, "checks": {}, "ok": False,
             "error": f"subprocess exited {p.returncode}: {p.stderr.strip()[-500:]}"} for m in names or PROGRAMS]


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
        err = r.get("rel_err")  # the worst of loss, weights (and gradients, auxiliary outputs)
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
    ap = argparse.ArgumentParser(prog="python -m firmware_tests", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", default="all", choices=[*RUNTIMES, "all"])
    ap.add_argument("--golden", type=Path, default=GOLDEN, help="directory of golden vectors and programs")
    ap.add_argument("--only", help=f"comma-separated programs to check (default all: {','.join(PROGRAMS)})")
    ap.add_argument("--threads", type=int, help="threads for every runtime (default: each runtime's own choice)")
    ap.add_argument("--json", help="also write the results as JSON to this file ('-' = stdout, one line)")
    ap.add_argument("--protocol", action="store_true",
                    help="check the wire protocol's conformance vectors (firmware_tests/protocol) instead")
    a = ap.parse_args(argv)
    if a.protocol:
        from .protocol import check
        verdicts = check()
        for name, v in verdicts.items():
            print(f"{'PASS' if v == 'pass' else 'FAIL'}  {name}" + ("" if v == "pass" else f": {v}"))
        ok = all(v == "pass" for v in verdicts.values())
        print(f"{sum(v == 'pass' for v in verdicts.values())}/{len(verdicts)} vectors; " + ("ALL PASS" if ok else "FAILED"))
        return 0 if ok else 1
    global THREADS
    THREADS = a.threads
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    names = a.only.split(",") if a.only else None
    unknown = [n for n in names or [] if n not in PROGRAMS]
    if unknown:
        ap.error(f"unknown programs {unknown} (known: {', '.join(PROGRAMS)})")
    if a.runtime == "all":
        from edge.trainers import available_runtimes
        results = [r for rt in available_runtimes() for r in _in_subprocess(rt, a.golden, names, a.threads)]
    else:
        results = run_runtime(a.runtime, a.golden, names)
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
