"""Every strategy at its defaults on models no preset was tuned on (issue 27), against FedAvg on the same bytes
axis.

Models and data: benchmarks/unseen_zoo.py (a CNN, a residual net and a net with BatchNorm and LayerNorm; digits
upsampled to 28 x 28 and a generated ``blobs28``). Setup, as ``fedge simulate`` runs a person's model with its
defaults: 10 devices with Dirichlet(0.5) label skew, 5 reports a round (7 selected, over-selection 1.3, the
first 5 of the seeded draw committed: the coordinator's reproducible mode), E = 1, batch 20, client SGD lr 0.05
(``fedge simulate``'s
defaults, with fewer devices so that 30 rounds are enough to learn), every strategy with no ``-S`` option. 20% of the data is the test split, the
next 15% a validation split beside it; the devices see neither.

Every run goes through the in-process loop (coordinator/inprocess.py): the real strategy, the real client halves,
every plan and report through the wire codec, reports admitted by the coordinator's default rules. Bytes are
every plan (with its program when the device lacks it) and every committed report.

Nothing is tuned: the defaults are what is measured, so every strategy has the same (zero) tuning budget.
Reported per (model, dataset, strategy): test accuracy as the mean of the last 10 rounds, its mean and standard
deviation over the seeds, total bytes, and the difference to FedAvg per seed (paired: same seed, same split,
same selection) with its mean, standard deviation and whether |mean| exceeds twice its standard error.

    python benchmarks/unseen_models.py [--rounds 30] [--seeds 0 1 2] [--jobs 2] [--quick]
        [--models cnn resnet bnnet] [--datasets digits28 blobs28] [--strategies ...]

``--quick``: 3 rounds, one seed, the CNN on digits28, FedAvg and FedSparse (a smoke run: the pipeline, not the
figures). Writes runs/bench/unseen_models.json (``--quick``: unseen_models_quick.json); finished runs are kept
under runs/bench/unseen_work/ by a hash of the setup, the job and benchmarks/unseen_zoo.py (``--fresh``: ignore
them).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("bench.unseen")
OUT = Path("runs/bench")
WORK = OUT / "unseen_work"
SETUP = {"devices": 10, "alpha": 0.5, "clients_per_round": 5, "over_selection": 1.3, "epochs": 1,
         "batch_size": 20, "lr": 0.05, "test_frac": 0.2, "val_frac": 0.15}
# The strategies a person can name for a classifier of their own module (README "Strategies"), each at its
# defaults. Left out, with the reasons in docs/your-model.md ("Which strategies take your model"): fedmix (its
# model is per device, experts and a private gate; no global model to hold to FedAvg's), fedmix_sparse,
# flops-pa, flops, fediter-ht and fedavg-prune (the zoo's networks only), sfvi and sfvi-avg (paper 003's
# Bayesian models, not a classifier of a person's module). ``--strategies`` can still name them.
STRATEGIES = ("fedavg", "fedadam", "fedprox", "fedl1", "fedsparse")
REF = "benchmarks/unseen_zoo.py:{}"


def federated(dataset: str, seed: int):
    """(shards, x_val, y_val, x_test, y_test): ``test_frac`` test, the next ``val_frac`` validation, the rest split
    by Dirichlet(alpha) label skew over the devices (coordinator/datasets.py)."""
    from benchmarks.unseen_zoo import DATASETS
    from coordinator.datasets import dirichlet_split
    x, y = DATASETS[dataset]()
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y))
    n_test, n_val = int(round(SETUP["test_frac"] * len(y))), int(round(SETUP["val_frac"] * len(y)))
    test, val, train = perm[:n_test], perm[n_test:n_test + n_val], perm[n_test + n_val:]
    xt, yt = x[train], y[train]
    shards = [(xt[i], yt[i]) for i in dirichlet_split(yt, SETUP["devices"], SETUP["alpha"], rng)]
    return shards, x[val], y[val], x[test], y[test]


def run_one(job: dict) -> dict:
    """One run: per-round bytes, density, validation and test accuracy."""
    import torch
    torch.set_num_threads(1)
    from coordinator.daemon import Evaluator
    from coordinator.inprocess import Loop
    from export.modelref import resolve
    from coordinator.strategies import make_strategy
    seed, rounds = job["seed"], job["rounds"]
    shards, xv, yv, xt, yt = federated(job["dataset"], seed)
    spec = resolve(REF.format(job["model"]), xt.shape[1:], 10)
    s = make_strategy(job["strategy"], spec=spec, lr=SETUP["lr"], epochs=SETUP["epochs"],
                      batch_size=SETUP["batch_size"], **job.get("kw", {}))
    loop = Loop(s, shards, seed=seed, ids=[f"d{i:04d}" for i in range(SETUP["devices"])], threads=1)
    ev_val, ev_test = Evaluator(xv, yv), Evaluator(xt, yt)
    rows, t0 = [], time.time()
    for _ in range(rounds):
        row = loop.round_as_coordinator(SETUP["clients_per_round"], SETUP["over_selection"])
        gspec, w = s.global_model(loop.state)
        row["val"] = float(ev_val(gspec, w)[1])
        row["accuracy"] = float(ev_test(gspec, w)[1])
        rows.append({k: (float(v) if isinstance(v, np.floating) else v) for k, v in row.items()})
    loop.close()
    last = rows[-10:]
    return {"job": job, "rows": rows, "wall_s": time.time() - t0,
            "test": float(np.mean([r["accuracy"] for r in last])), "val": float(np.mean([r["val"] for r in last])),
            "total_bytes": int(sum(r["bytes_down"] + r["bytes_up"] for r in rows)),
            "final_density": float(rows[-1].get("density", 1.0))}


def _key(job: dict) -> str:
    """A finished run is kept under runs/bench/unseen_work/ by a hash of the setup, the job and the model file."""
    import hashlib
    zoo = (Path(__file__).resolve().parent / "unseen_zoo.py").read_bytes()
    body = json.dumps({"setup": SETUP, **job}, sort_keys=True).encode() + zoo
    return hashlib.sha256(body).hexdigest()[:20]


def _safe(job: dict) -> dict:
    """A run that raises is a result too (the strategy cannot take the model): recorded, not fatal."""
    cached = WORK / f"{_key(job)}.json"
    if job.get("cache") and cached.exists():
        return json.loads(cached.read_text())
    try:
        r = run_one(job)
    except Exception as e:  # noqa: BLE001 - the message is the finding
        return {"job": job, "error": f"{type(e).__name__}: {e}"}
    if job.get("cache"):
        WORK.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(r))
    return r


def table(results: list[dict], seeds: list[int]) -> list[dict]:
    """One row per (model, dataset, strategy): the seed mean and spread, and the paired difference to FedAvg."""
    by = {}
    for r in results:
        j = r["job"]
        by.setdefault((j["model"], j["dataset"], j["strategy"]), {})[j["seed"]] = r
    runs = []
    for (m, d, st), per in sorted(by.items()):
        errors = sorted({r["error"] for r in per.values() if "error" in r})
        row: dict[str, Any] = {"model": m, "dataset": d, "strategy": st, "seeds": sorted(per)}
        if errors:
            runs.append(row | {"error": errors[0]})
            continue
        acc = np.array([per[s]["test"] for s in sorted(per)])
        byt = np.array([per[s]["total_bytes"] for s in sorted(per)], float)
        row |= {"accuracy": float(acc.mean()), "accuracy_spread": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
                "accuracy_per_seed": [float(a) for a in acc], "val_accuracy": float(np.mean([per[s]["val"] for s in per])),
                "total_bytes": float(byt.mean()), "final_density": float(np.mean([per[s]["final_density"] for s in per])),
                "wall_s": float(np.mean([per[s]["wall_s"] for s in per]))}
        base = by.get((m, d, "fedavg"), {})
        if all(s in base and "test" in base[s] for s in per):
            diff = acc - np.array([base[s]["test"] for s in sorted(per)])
            sd = float(diff.std(ddof=1)) if len(diff) > 1 else float("nan")
            se = sd / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
            row |= {"vs_fedavg_points": float(100 * diff.mean()), "vs_fedavg_points_sd": 100 * sd,
                    "vs_fedavg_beyond_noise": bool(len(diff) > 1 and abs(diff.mean()) > 2 * se),
                    "within_2_points": bool(100 * diff.mean() >= -2.0),
                    "bytes_vs_fedavg": float(byt.mean() / np.mean([base[s]["total_bytes"] for s in per])),
                    "accuracy_vs_fedavg": float(acc.mean() / np.mean([base[s]["test"] for s in per]))}
        runs.append(row)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (the machine has 2 cores)")
    ap.add_argument("--models", nargs="+", default=["cnn", "resnet", "bnnet"])
    ap.add_argument("--datasets", nargs="+", default=["digits28", "blobs28"])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 rounds, seed 0, cnn on digits28, fedavg + fedsparse")
    ap.add_argument("--out", default="")
    ap.add_argument("--fresh", action="store_true", help="ignore the runs kept under runs/bench/unseen_work/")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if a.quick:
        a.rounds, a.seeds, a.models, a.datasets, a.strategies = 3, [0], ["cnn"], ["digits28"], ["fedavg", "fedsparse"]
    out = Path(a.out) if a.out else OUT / ("unseen_models_quick.json" if a.quick else "unseen_models.json")
    jobs = [{"model": m, "dataset": d, "strategy": st, "seed": s, "rounds": a.rounds, "cache": not (a.quick or a.fresh)}
            for m in a.models for d in a.datasets for st in a.strategies for s in a.seeds]
    t0 = time.time()
    results = []
    if a.jobs > 1:
        with mp.get_context("spawn").Pool(a.jobs) as pool:
            for r in pool.imap_unordered(_safe, jobs):
                results.append(r)
                _log(r, len(results), len(jobs))
    else:
        for j in jobs:
            results.append(_safe(j))
            _log(results[-1], len(results), len(jobs))
    runs = table(results, a.seeds)
    body = {"setup": SETUP | {"rounds": a.rounds, "seeds": a.seeds, "accuracy": "test, mean of the last 10 rounds",
                              "accuracy_spread": "standard deviation over seeds (ddof 1)"},
            "runs": runs, "per_seed": [{k: v for k, v in r.items() if k != "job"} | r["job"] for r in results],
            "wall_s": time.time() - t0}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(body, indent=1))
    print(f"\n{'model':8} {'dataset':9} {'strategy':13} {'acc':>7} {'sd':>6} {'vs fedavg':>10} {'noise?':>7} "
          f"{'bytes/FA':>8} {'density':>7}")
    for r in runs:
        if "error" in r:
            print(f"{r['model']:8} {r['dataset']:9} {r['strategy']:13} ERROR {r['error'][:80]}")
            continue
        print(f"{r['model']:8} {r['dataset']:9} {r['strategy']:13} {r['accuracy']:7.4f} {r['accuracy_spread']:6.4f} "
              f"{r.get('vs_fedavg_points', float('nan')):+6.2f}+-{r.get('vs_fedavg_points_sd', float('nan')):4.2f} "
              f"{'beyond' if r.get('vs_fedavg_beyond_noise') else 'within':>7} {r.get('bytes_vs_fedavg', float('nan')):8.3f} "
              f"{r['final_density']:7.3f}")
    print(f"wrote {out} ({time.time() - t0:.0f} s)")


def _log(r: dict, i: int, n: int) -> None:
    j = r["job"]
    what = r.get("error") or f"test {r['test']:.4f} bytes {r['total_bytes'] / 1e6:.1f} MB {r['wall_s']:.0f} s"
    log.info("[%d/%d] %s %s %s seed %d: %s", i, n, j["model"], j["dataset"], j["strategy"], j["seed"], what)


if __name__ == "__main__":
    main()
