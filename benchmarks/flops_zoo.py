"""FLoPS-PA beyond the paper's linear models: the zoo MLP (64-200-200-10) and CNN (LeNet-family, 8x8 digits) on
sklearn's digits, 20 devices with Dirichlet(0.5) label skew, 10 per round, in process through the wire codec;
FedIter-HT (H_k per tensor, biases whole: docs/flops.md, "The baselines") and FedAvg + final magnitude prune at
the same density and budget beside it.

Every (model, method) runs on several seeds (``--seeds``, default 0 1 2; the seed draws the training,
validation and test split, the Dirichlet partition, the initial model, the selection and the devices'
batches). On each seed, every method's learning rate is picked on that seed's validation split (half of the
held-out digits) from the same candidates (the same three runs per seed for every method; the first candidate
wins ties); the figures are the other half's (test).
``runs`` holds the picked run of every seed (``seed``, ``accuracy``, ...); ``summary`` holds per (model,
method) the mean and sample sd over the seeds, and the paired difference per seed against FedAvg + prune and
against FLoPS-PA, with its mean, sd, standard error, whether |mean| > 2 SE and whether the 95% t-interval
excludes 0. The pruned FLoPS-PA model of the first seed is exported for inference (export/final.py: ONNX and
an ExecuTorch .pte, both checked against torch) and its density is read back from the ONNX file.

    PYTHONPATH=. python -m benchmarks.flops_zoo                      # writes runs/bench/flops_zoo.json
    PYTHONPATH=. python -m benchmarks.flops_zoo --table runs/bench/flops_zoo.json   # the doc's table from a run
    PYTHONPATH=. python -m benchmarks.flops_zoo --methods fediter-ht --out runs/bench/flops_zoo_fediter_ht.json
    PYTHONPATH=. python -m benchmarks.flops_zoo --state runs/simulate/coordinator.sqlite -S rho=0.1
                                                                     # export the final model of an MQTT run
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from coordinator.datasets import digits_federated
from coordinator.inprocess import Loop
from coordinator.strategies import make_strategy

log = logging.getLogger("bench.flops_zoo")

DEVICES, PER_ROUND, ROUNDS, ALPHA, RHO = 20, 10, 200, 0.5, 0.1  # 20 rounds: FLoPS-PA had not yet started (docs/flops.md)
COMMON = {"epochs": 1, "batch_size": 20}
CANDIDATES = (0.05, 0.2, 0.5)  # learning rates, the same for every method (0.2 won most at 20 rounds: 0.5 added)
SEEDS = (0, 1, 2)
BASELINES = {"vs_fedavg_prune": "fedavg-prune", "vs_flops_pa": "flops-pa"}  # the paired comparisons in summary
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
# Fixed readings (docs/flops.md): FLoPS-PA's gate and dual steps and prune start; the two methods that are
# k-sparse from round 0 start from the zoo's init scaled by 1/sqrt(rho) (theta_init=sparse: at the zoo's scale a
# 10%-dense network's output is nearly constant and the first rounds are lost)
METHODS = {
    "flops-pa": {"la_lr": 10.0, "lam_lr": 0.1, "prune_start": 15, "theta_init": "sparse"},  # as flops_synthetic
    "fediter-ht": {"theta_init": "sparse"},
    "fedavg-prune": {},
}


def onnx_density(path: Path) -> tuple[int, int]:
    """(non-zero, total) entries over the initializers of an exported inference model."""
    import onnx
    from onnx import numpy_helper
    m = onnx.load(str(path))
    arrays = [numpy_helper.to_array(t) for t in m.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    return int(sum(np.count_nonzero(a) for a in arrays)), int(sum(a.size for a in arrays))


def export_pruned(strategy, state, out: Path, name: str) -> dict:
    """Export the strategy's global model (theta_hat * z_hat for FLoPS) and check its density in the file."""
    from export.final import export_final
    spec, weights = strategy.global_model(state)
    arts = export_final(spec, weights, out, name)
    nnz, total = onnx_density(out / f"{name}.onnx")
    dens = nnz / total
    log.info("%s: exported %d of %d weights non-zero (density %.6f, k/n = %d/%d)", name, nnz, total, dens,
             getattr(strategy, "k", nnz), getattr(strategy, "n", total))
    return {"nonzero": nnz, "total": total, "density": dens, "onnx_bytes": arts["onnx"].bytes,
            "pte_bytes": arts["pte"].bytes, "max_abs_err": max(a.max_abs_err for a in arts.values())}


def run(model: str, method: str, lr: float, seed: int = 0) -> tuple[dict, object, object]:
    data = digits_federated(DEVICES, ALPHA, seed)
    half = len(data.y_test) // 2
    val, test = (data.x_test[:half], data.y_test[:half]), (data.x_test[half:], data.y_test[half:])
    kw = COMMON | METHODS[method] | {"lr": lr}
    s = make_strategy(method, model=model, rho=RHO, **kw)
    loop = Loop(s, data.shards, seed=seed, threads=1)
    from coordinator.daemon import Evaluator
    ev_val, ev_test = Evaluator(*val), Evaluator(*test)
    t0 = time.time()
    curve = []
    for _ in range(ROUNDS):
        row = loop.round_as_coordinator(PER_ROUND, 1.0)
        curve.append({"round": row["round"], "density": row.get("density", 1.0),
                      "bytes": row["bytes_down"] + row["bytes_up"]})
    loop.close()
    spec, w = s.global_model(loop.state)
    res = {"model": model, "method": method, "val_accuracy": ev_val(spec, w)[1], "accuracy": ev_test(spec, w)[1],
           "density": curve[-1]["density"], "bytes": int(sum(c["bytes"] for c in curve)),
           "wall_s": time.time() - t0, "hparams": kw, "curve": curve}
    log.info("%s %s lr %g: val %.4f test %.4f, density %.4f, %.2f MB, %.0fs", model, method, lr,
             res["val_accuracy"], res["accuracy"], res["density"], res["bytes"] / 1e6, res["wall_s"])
    return res, s, loop.state


def spread(xs: list[float]) -> dict:
    """Mean and sample standard deviation over the seeds, with the per-seed values."""
    a = np.asarray(xs, float)
    return {"mean": float(a.mean()), "sd": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "n": len(a),
            "values": [float(x) for x in a]}


def paired(a: list[float], b: list[float], seeds: list[int]) -> dict:
    """a - b seed by seed: the differences, their mean, sample sd and standard error, whether |mean| > 2 SE
    (the issue's test; with 3 seeds it is about an 82% interval) and whether the 95% t-interval excludes 0."""
    d = np.asarray(a, float) - np.asarray(b, float)
    n = len(d)
    m = float(d.mean())
    if n < 2:  # one seed: no noise estimate, so no difference is shown to exceed it
        return {"seeds": list(seeds), "diffs": [float(x) for x in d], "mean": m, "sd": None, "se": None, "n": n,
                "beyond_2se": False, "t95_half": None, "beyond_t95": False}
    sd = float(d.std(ddof=1))
    se = sd / math.sqrt(n)
    half = T975.get(n - 1, T975[9]) * se  # beyond 10 seeds, df 9's 2.262: a little wide, never narrow
    return {"seeds": list(seeds), "diffs": [float(x) for x in d], "mean": m, "sd": sd, "se": se, "n": n,
            "beyond_2se": bool(abs(m) > 2 * se), "t95_half": half, "beyond_t95": bool(abs(m) > half)}


def summarise(rows: list[dict]) -> list[dict]:
    """Per (model, method): the spread over the seeds of the picked runs, and the paired differences in test
    accuracy against each baseline of BASELINES on the seeds both ran."""
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["method"]), {})[r["seed"]] = r
    out = []
    for (model, method), runs in by.items():
        seeds = sorted(runs)
        rs = [runs[s] for s in seeds]
        row = {"model": model, "method": method, "seeds": seeds, "lr": [r["hparams"]["lr"] for r in rs],
               "accuracy": spread([r["accuracy"] for r in rs]),
               "val_accuracy": spread([r["val_accuracy"] for r in rs]),
               "density": spread([r["density"] for r in rs]), "bytes": spread([r["bytes"] for r in rs])}
        for key, base in BASELINES.items():
            ref = by.get((model, base))
            common = [s for s in seeds if ref and s in ref]
            if base != method and common:
                row[key] = paired([runs[s]["accuracy"] for s in common], [ref[s]["accuracy"] for s in common], common)
        out.append(row)
    return out


def _diff(c: dict | None) -> str:
    if not c:
        return ""
    sd = "n/a" if c["sd"] is None else f"{c['sd']:.3f}"
    return f"{c['mean']:+.3f} ± {sd} " + ("**yes**" if c["beyond_2se"] else "no")


def table(res: dict) -> str:
    """The markdown table of docs/flops.md (zoo section) from a result file."""
    lines = ["| model | method | lr picked (seeds " + ", ".join(map(str, res["seeds"])) + ") | test accuracy | "
             "per seed | density | MB (both ways) | Δ acc. vs FedAvg + prune | Δ acc. vs FLoPS-PA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["summary"]:
        a = r["accuracy"]
        lines.append(f"| {r['model'].upper()} | {r['method']} | {', '.join(f'{x:g}' for x in r['lr'])} | "
                     f"{a['mean']:.3f} ± {a['sd']:.3f} | {', '.join(f'{x:.3f}' for x in a['values'])} | "
                     f"{r['density']['mean']:.4f} | {r['bytes']['mean'] / 1e6:.2f} | "
                     f"{_diff(r.get('vs_fedavg_prune'))} | {_diff(r.get('vs_flops_pa'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global ROUNDS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench/flops_zoo.json")
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--candidates", type=float, nargs="+", default=list(CANDIDATES),
                    help="learning rates tried on every seed, the same for every method")
    ap.add_argument("--no-export", action="store_true", help="skip the export of the first seed's FLoPS-PA model")
    ap.add_argument("--table", metavar="JSON", help="print the doc's markdown table from a result file and exit")
    ap.add_argument("--state", help="an MQTT run's coordinator.sqlite: export its final FLoPS-PA model instead")
    ap.add_argument("-S", action="append", default=[], metavar="KEY=VALUE", help="that run's strategy options")
    a = ap.parse_args(argv)
    ROUNDS = a.rounds
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if a.state:
        from coordinator.cli import _strategy_args
        from coordinator.store import Store
        from edge.model import mlp
        kw = {"spec": mlp([64, 200, 200, 10])} | _strategy_args(a.S)
        s = make_strategy("flops-pa", **kw)
        st = Store(a.state).latest_state()
        res = export_pruned(s, st, Path(a.state).parent / "final", "flops-pa") | {"round": st.round, "k": s.k, "n": s.n}
        print(json.dumps(res, indent=1))
        return 0 if res["nonzero"] == s.k else 1
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return 0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    t_start = time.time()

    def write() -> None:
        out.write_text(json.dumps({"rho": RHO, "devices": DEVICES, "per_round": PER_ROUND, "rounds": ROUNDS,
                                   "candidates": a.candidates, "seeds": a.seeds, "tune": "per seed",
                                   "wall_s": time.time() - t_start, "runs": rows, "summary": summarise(rows)},
                                  indent=1))

    for model in a.models.split(","):
        for method in a.methods.split(","):
            for seed in a.seeds:
                tried = [run(model, method, lr, seed) for lr in a.candidates]
                res, s, st = max(tried, key=lambda t: t[0]["val_accuracy"])  # first candidate on ties
                res["seed"] = seed
                res["candidates"] = [{"lr": t[0]["hparams"]["lr"], "val_accuracy": t[0]["val_accuracy"],
                                      "accuracy": t[0]["accuracy"]} for t in tried]
                if method == "flops-pa" and seed == a.seeds[0] and not a.no_export:
                    res["export"] = export_pruned(s, st, out.parent / "flops_zoo" / model, f"{model}-flops-pa")
                    res["export"]["k"], res["export"]["n"] = s.k, s.n
                rows.append(res)
                write()
    for r in rows:
        print(f"{r['model']:<4} {r['method']:<12} seed {r['seed']} lr {r['hparams']['lr']:<5} "
              f"val {r['val_accuracy']:.4f} test {r['accuracy']:.4f} density {r['density']:.4f} "
              f"{r['bytes'] / 1e6:7.2f} MB"
              + (f"  exported {r['export']['nonzero']}/{r['export']['total']}" if "export" in r else ""))
    print(table(json.loads(out.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
