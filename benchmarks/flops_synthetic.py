"""FLoPS / FLoPS-PA against FedIter-HT and FedAvg + final magnitude prune on paper 002's synthetic problems.

Settings (``SETTINGS``; docs/flops.md, "Measured"):

- ``i``: the paper's regime (i), SNR 20, Toeplitz correlation r = 0.2, true density 0.05, target rho 0.05,
  10,000 training samples (20 a dimension on LR and LG);
- ``ii``, ``iii``, ``iv``: the paper's other regimes (SNR 3 / r 0.2, SNR 3 / r 0.7, SNR 20 / r 0.7) with 2,000
  training samples (4 a dimension), where the methods differ (at 10,000 regime (i) is saturated: every method
  reaches the best R2);
- ``i-0.95``: Table 2's dense rows, true density 0.95 and rho 0.95, regime (i).

Methods: ``flops-pa``, ``flops``, ``fediter-ht``, ``fedavg-prune``, and two variants:
``flops(0.95)`` (FLoPS with target 0.95 on a truth of density 0.05: the paper's Table 1 control) and
``flops-pa/p0`` (FLoPS-PA with the exact-density step from round 0: the "scaling ... from epoch zero" reading).
The gated methods also run with ``lam_lr = 0`` at their tuned step sizes on every seed (the multiplier
ablation).

100 clients, 10 per round (seeded partial participation), 50 rounds, one local pass over a client's data in
batches of 20 per round (FLoPS: one-batch exchanges, as many per epoch as a client's mean number of batches).
Every plan and report goes through the wire codec (coordinator/inprocess.py), so bytes are the MQTT payloads.
Every problem is linear without bias: one weight tensor, where FedIter-HT's per-tensor H_k is the global H_k
of Tong et al. (docs/flops.md, "The baselines").

Learning rates are tuned per (setting, task, split, method) on the validation split of seed 0 (R2 for LR,
accuracy for LG and MC: no method sees the truth), from the same candidates for every method; the figures are
the test split's over ``SEEDS`` (3 of them on the saturated settings; mean, standard deviation, and for every comparison with FLoPS-PA the paired
difference over the seeds with its 95% t-interval). Writes ``runs/bench/flops_synthetic.json`` (rows) and
``_details.json`` (per seed, candidates, lambda and density traces).

    PYTHONPATH=. python -m benchmarks.flops_synthetic [--quick]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from coordinator.inprocess import Loop
from coordinator.selection import select_ordered
from coordinator.strategies import make_strategy
from coordinator.synthetic import make_problem, quality, support_metrics
from edge.model import mlp
from edge.protocol.wire import WireError

log = logging.getLogger("bench.flops")

ROUNDS = 50
CLIENTS = 100
PER_ROUND = 10
BATCH = 20
SEEDS = (0, 1, 2, 3, 4)
TUNE_SEED = 0
PROBLEMS = {"LR": {"d": 500}, "LG": {"d": 500}, "MC": {"d": 200, "classes": 5}}
LOSS = {"LR": "mse", "LG": "bce", "MC": "ce"}
SPLITS = {"iid": {"alpha": 100.0, "shift": 0.0}, "non-iid": {"alpha": 0.5, "shift": 0.2}}
SETTINGS = {
    "i": {"snr": 20.0, "r": 0.2, "n_train": 10_000, "true_density": 0.05, "rho": 0.05},
    "ii": {"snr": 3.0, "r": 0.2, "n_train": 2_000, "true_density": 0.05, "rho": 0.05},
    "iii": {"snr": 3.0, "r": 0.7, "n_train": 2_000, "true_density": 0.05, "rho": 0.05},
    "iv": {"snr": 20.0, "r": 0.7, "n_train": 2_000, "true_density": 0.05, "rho": 0.05},
    "i-0.95": {"snr": 20.0, "r": 0.2, "n_train": 10_000, "true_density": 0.95, "rho": 0.95},
}
BASE = ("flops-pa", "flops", "fediter-ht", "fedavg-prune")
CONTROL, P0 = "flops(0.95)", "flops-pa/p0"
# (setting, task, split, methods): what the full run measures (about 25 minutes on 2 shared cores), the
# harder regimes first; the saturated settings (regime (i) at 10,000 samples, the dense truth) on 3 seeds
CELLS = ([("iii", t, s, BASE + (CONTROL, P0) if s == "iid" else BASE) for t in PROBLEMS for s in SPLITS]
         + [(g, "LR", "iid", BASE) for g in ("ii", "iv")]
         + [("i-0.95", t, "iid", ("flops-pa", "fediter-ht", "fedavg-prune")) for t in PROBLEMS]
         + [("i", t, s, BASE + (CONTROL,) if (t, s) == ("LR", "iid") else ("flops-pa", "fediter-ht", "fedavg-prune"))
            for t in PROBLEMS for s in SPLITS])
N_SEEDS = {"i": 3, "i-0.95": 3}  # the others: len(SEEDS)
QUICK_CELLS = [("iii", "LR", "iid", BASE + (CONTROL, P0))]
GATED = ("flops-pa", "flops", CONTROL, P0)
ABLATE = ("flops-pa", "flops")  # the lam_lr = 0 column
# fixed readings (docs/flops.md): init density, prune start (round / epoch), the gate and dual step sizes
FIXED = {"rho0": 0.5, "prune_start": 40}
LA_LR, LAM_LR = 10.0, 0.1
# The candidates, the same 4 values for every method: learning rates on the task's scale (the MSE of LR has
# larger gradients than the logistic and softmax losses). The gated methods' gate step and dual step are fixed
# readings (paper 002 fixes its three step sizes "for stable learning dynamics"), so they get no extra candidates.
LR_SCALE = {"LR": (0.003, 0.01, 0.03, 0.1), "LG": (0.1, 0.5, 2.0, 5.0), "MC": (0.1, 0.5, 2.0, 5.0)}
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def spec_for(task: str) -> dict:
    p = PROBLEMS[task]
    return mlp([p["d"], p.get("classes", 1) if task == "MC" else 1])


def steps_per_epoch(setting: str) -> int:
    """FLoPS's exchanges per epoch: a client's mean number of batches (the per-round methods' local steps)."""
    return max(1, round(SETTINGS[setting]["n_train"] / CLIENTS / BATCH))


def strategy(method: str, setting: str, task: str, hp: dict):
    rho = 0.95 if method == CONTROL else SETTINGS[setting]["rho"]
    name = {CONTROL: "flops", P0: "flops-pa"}.get(method, method)
    kw = dict(spec=spec_for(task), rho=rho, loss=LOSS[task], bias=False, batch_size=BATCH)
    if method in GATED:
        kw |= FIXED | ({"prune_start": 0} if method == P0 else {})
    if name == "flops":
        kw["steps_per_epoch"] = steps_per_epoch(setting)
    return make_strategy(name, **(kw | hp))


def run(method: str, setting: str, task: str, prob, hp: dict, seed: int) -> dict:
    """One federated run; the final model's metrics on validation and test, the bytes both ways, and every
    5th round's test-time density, relaxed density and lambda."""
    s = strategy(method, setting, task, hp)
    loop = Loop(s, prob.shards, seed=seed, threads=1)
    try:
        with np.errstate(all="ignore"):
            train(method, setting, loop, seed)
        theta = s.pruned(loop.state)
        w = theta.reshape(-1, prob.x_val.shape[1])
        keys = ("round", "density", "expected_density", "lambda")
        per = steps_per_epoch(setting) if method in ("flops", CONTROL) else 1
        trace = [{k: h[k] for k in keys if k in h} for i, h in enumerate(loop.history) if (i + 1) % (5 * per) == 0]
        return {"bytes": int(sum(r["bytes_down"] + r["bytes_up"] for r in loop.history)),
                **support_metrics(theta, prob.support),
                "val": quality(task, w, prob.x_val, prob.y_val), "test": quality(task, w, prob.x_test, prob.y_test),
                "trace": trace}
    except WireError as e:  # a diverged client's loss is not finite: its report cannot be encoded
        log.info("%s %s %s seed %d %s diverged: %s", setting, task, method, seed, hp, e)
        nan = {"r2": None, "accuracy": None}
        return {"bytes": None, "tdr": None, "recall": None, "density": None, "val": nan, "test": nan,
                "trace": [], "diverged": True}
    finally:
        loop.close()


def train(method: str, setting: str, loop: Loop, seed: int) -> None:
    if method in ("flops", CONTROL):  # the participants are drawn per epoch and exchange once per step
        for epoch in range(1, ROUNDS + 1):
            chosen = [loop.ids.index(d) for d in select_ordered(loop.ids, PER_ROUND, seed, epoch, 1)]
            for _ in range(steps_per_epoch(setting)):
                loop.round(chosen)
    else:
        for _ in range(ROUNDS):
            loop.round_as_coordinator(PER_ROUND, 1.0)


def value(task: str, q: dict) -> float:
    v = q["r2"] if task == "LR" else q["accuracy"]
    return float("nan") if v is None or not np.isfinite(v) else float(v)


def score(task: str, q: dict) -> float:
    v = value(task, q)
    return -np.inf if math.isnan(v) else v


def grid(method: str, task: str) -> list[dict]:
    if method in GATED:
        return [{"lr": lr, "la_lr": LA_LR, "lam_lr": LAM_LR} for lr in LR_SCALE[task]]
    return [{"lr": lr} for lr in LR_SCALE[task]]


class Cache:
    """Finished runs by (setting, task, split, method, hp, seed, rounds), one JSON line each: a rerun resumes."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[str, dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line)
                self.rows[r["key"]] = r["result"]

    @staticmethod
    def key(*parts) -> str:
        return json.dumps(parts, sort_keys=True)

    def has(self, *parts) -> bool:
        return self.key(*parts) in self.rows

    def get(self, setting, task, split, method, hp, seed, rounds):
        k = self.key(setting, task, split, method, hp, seed, rounds)
        if k not in self.rows:
            prob = problem(setting, task, split, seed)
            t0 = time.time()
            res = run(method, setting, task, prob, hp, seed)
            res["wall_s"] = time.time() - t0
            self.rows[k] = res
            with self.path.open("a") as f:
                f.write(json.dumps({"key": k, "result": res}) + "\n")
            log.info("%s %s %s %-12s seed %d %s: tdr %s val %s test %s (%.1fs)", setting, task, split, method, seed,
                     hp, res["tdr"], res["val"], res["test"], res["wall_s"])
        return self.rows[k]


_PROBLEMS: dict = {}


def problem(setting: str, task: str, split: str, seed: int):
    k = (setting, task, split, seed)
    if k not in _PROBLEMS:
        _PROBLEMS.clear()  # one instance at a time in memory
        g = {x: v for x, v in SETTINGS[setting].items() if x != "rho"}
        _PROBLEMS[k] = make_problem(task, **PROBLEMS[task], **SPLITS[split], **g, n_clients=CLIENTS, seed=seed)
    return _PROBLEMS[k]


def spread(xs: list[float]) -> dict:
    """Mean and sample standard deviation over the seeds (None where a run diverged)."""
    a = np.array([np.nan if x is None else x for x in xs], float)
    return {"mean": float(np.mean(a)), "sd": float(np.std(a, ddof=1)) if len(a) > 1 else 0.0, "n": len(a)}


def paired(a: list[float], b: list[float]) -> dict:
    """a - b over the same seeds: the mean, the 95% t-interval's half-width, and whether the interval excludes
    0 (the difference is larger than its noise)."""
    d = np.array([np.nan if x is None or y is None else x - y for x, y in zip(a, b)], float)
    n = len(d)
    half = float(T975[n - 1] * np.std(d, ddof=1) / math.sqrt(n)) if n > 1 else float("inf")
    m = float(np.mean(d))
    return {"diff": m, "ci95": half, "exceeds_noise": bool(np.isfinite(m) and abs(m) > half)}


def cell(cache: Cache, setting, task, split, methods, seeds, cached_only) -> tuple[list[dict], list[dict]]:
    rows, missing = [], []
    per_method: dict[str, list[dict]] = {}
    for method in methods:
        cands = grid(method, task)
        if cached_only and not all(cache.has(setting, task, split, method, hp, TUNE_SEED, ROUNDS) for hp in cands):
            missing.append({"setting": setting, "task": task, "split": split, "method": method, "missing": "tuning"})
            continue
        tuned = [(score(task, cache.get(setting, task, split, method, hp, TUNE_SEED, ROUNDS)["val"]), -i, hp)
                 for i, hp in enumerate(cands)]
        best = max(tuned, key=lambda t: (t[0], t[1]))[2]
        runs = {"": best} | ({"lam_lr=0": best | {"lam_lr": 0.0}} if method in ABLATE else {})
        if cached_only and not all(cache.has(setting, task, split, method, hp, s, ROUNDS)
                                   for hp in runs.values() for s in seeds):
            missing.append({"setting": setting, "task": task, "split": split, "method": method, "missing": "seeds"})
            continue
        for variant, hp in runs.items():
            per_seed = [cache.get(setting, task, split, method, hp, s, ROUNDS) for s in seeds]
            name = method + (f" {variant}" if variant else "")
            per_method[name] = per_seed
            q = [value(task, r["test"]) for r in per_seed]
            row = {"setting": setting, "task": task, "split": split, "method": name,
                   "rho": 0.95 if method == CONTROL else SETTINGS[setting]["rho"], "hparams": hp,
                   "candidates": [{"hp": h, "val": v} for v, _, h in tuned],
                   "density": spread([r["density"] for r in per_seed]),
                   "tdr": spread([r["tdr"] for r in per_seed]), "recall": spread([r["recall"] for r in per_seed]),
                   "quality": spread(q), "bytes": spread([r["bytes"] for r in per_seed]),
                   "final_expected_density": spread([r["trace"][-1].get("expected_density") if r["trace"] else None
                                                     for r in per_seed]),
                   "final_lambda": spread([r["trace"][-1].get("lambda") if r["trace"] else None for r in per_seed]),
                   "per_seed": [{k: r[k] for k in ("density", "tdr", "recall", "bytes", "test", "trace")}
                                for r in per_seed]}
            rows.append(row)
    ref = per_method.get("flops-pa")
    for row in rows:
        runs = per_method[row["method"]]
        base = row["method"].removesuffix(" lam_lr=0")
        if ref is not None and row["method"] != "flops-pa" and base == row["method"]:
            row["vs_flops_pa"] = {m: paired([r[m] for r in runs], [r[m] for r in ref]) for m in ("tdr",)}
            row["vs_flops_pa"]["quality"] = paired([value(task, r["test"]) for r in runs],
                                                   [value(task, r["test"]) for r in ref])
        if base != row["method"]:  # the ablation against the same method with its multiplier
            row["vs_with_multiplier"] = {
                "tdr": paired([r["tdr"] for r in runs], [r["tdr"] for r in per_method[base]]),
                "quality": paired([value(task, r["test"]) for r in runs],
                                  [value(task, r["test"]) for r in per_method[base]])}
    return rows, missing


def fmt(s: dict, digits: int = 3) -> str:
    return "nan" if not np.isfinite(s["mean"]) else f"{s['mean']:.{digits}f} ± {s['sd']:.{digits}f}"


def fmt_diff(p: dict | None, digits: int = 3) -> str:
    if p is None:
        return ""
    return f"{p['diff']:+.{digits}f} ± {p['ci95']:.{digits}f}{' *' if p['exceeds_noise'] else ''}"


def main(argv: list[str] | None = None) -> int:
    global ROUNDS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench/flops_synthetic.json")
    ap.add_argument("--quick", action="store_true", help="regime (iii) LR IID only, seeds 0 and 1 (about a minute)")
    ap.add_argument("--settings", help=f"only these settings (comma-separated, of {','.join(SETTINGS)})")
    ap.add_argument("--tasks", default="LR,LG,MC")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--runs", help="the finished runs' cache (default: beside --out, <stem>_runs.jsonl)")
    ap.add_argument("--cached-only", action="store_true",
                    help="tabulate the finished runs only: a (cell, method) missing any run is listed as missing")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ROUNDS = a.rounds
    cells, seeds = (QUICK_CELLS, SEEDS[:2]) if a.quick else (CELLS, SEEDS)
    if a.settings:
        cells = [c for c in cells if c[0] in a.settings.split(",")]
    cells = [c for c in cells if c[1] in a.tasks.split(",")]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cache = Cache(Path(a.runs) if a.runs else out.with_name(out.stem + "_runs.jsonl"))
    rows, missing = [], []
    t0 = time.time()
    for setting, task, split, methods in cells:
        r, m = cell(cache, setting, task, split, methods, seeds[:N_SEEDS.get(setting, len(seeds))], a.cached_only)
        rows += r
        missing += m
    setup = {"rounds": ROUNDS, "clients": CLIENTS, "per_round": PER_ROUND, "batch": BATCH, "seeds": seeds,
             "n_seeds": N_SEEDS, "tune_seed": TUNE_SEED, "problems": PROBLEMS, "splits": SPLITS, "settings": SETTINGS, "fixed": FIXED,
             "la_lr": LA_LR, "lam_lr": LAM_LR, "wall_s": time.time() - t0}
    slim = [{k: v for k, v in r.items() if k not in ("per_seed", "candidates")} for r in rows]
    out.write_text(json.dumps({"setup": setup, "runs": slim, "missing": missing}, indent=1))
    out.with_name(out.stem + "_details.json").write_text(json.dumps({"setup": setup, "runs": rows}, indent=1))
    print(f"seeds {list(seeds)} ({', '.join(f'{g}: the first {n}' for g, n in N_SEEDS.items())}); mean ± sd; vs FLoPS-PA / vs with multiplier: paired difference ± 95% CI "
          f"(* the interval excludes 0)")
    print("| setting | task | split | method | lr | density | TDR | R2 / acc | relaxed density | lambda | kB |"
          " ΔTDR vs FLoPS-PA | Δ R2/acc vs FLoPS-PA | Δ R2/acc, lam_lr=0 |")
    print("|" + "---|" * 14)
    for r in rows:
        vs, ab = r.get("vs_flops_pa", {}), r.get("vs_with_multiplier", {})
        print(f"| {r['setting']} | {r['task']} | {r['split']} | {r['method']} | {r['hparams']['lr']} | "
              f"{fmt(r['density'], 4)} | {fmt(r['tdr'], 2)} | {fmt(r['quality'])} | "
              f"{fmt(r['final_expected_density'])} | {fmt(r['final_lambda'], 2)} | {r['bytes']['mean'] / 1e3:.1f} | "
              f"{fmt_diff(vs.get('tdr'))} | {fmt_diff(vs.get('quality'))} | {fmt_diff(ab.get('quality'), 4)} |")
    for m in missing:
        print(f"{m['setting']} {m['task']} {m['split']} {m['method']}: not run ({m['missing']} missing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
