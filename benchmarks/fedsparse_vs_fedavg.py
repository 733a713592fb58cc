"""FedSparse against the baselines (issues 4 and 13): every method tuned on validation, reported on test.

Setup: sklearn digits, 50 devices with Dirichlet(0.5) label skew, 10 reports per round (13 selected, over-selection
1.3, the first 10 of the seeded draw committed: the coordinator's reproducible mode), E = 1, batch 20, client SGD
lr 0.05, MLP 64-200-200-10, 200 rounds. 20% of the data is the test split and the next 15% a validation split
beside it (coordinator/datasets.py; the devices never see either).

Every run goes through the in-process loop of the reproducible mode (coordinator/inprocess.py): the real strategy,
the real client halves and every plan and report through the wire codec. Bytes are every plan (with its program
when the device lacks it) and every committed report, as the round machine counts them on MQTT; ``--mqtt``
repeats the fedsparse-max run of the first seed over a private Mosquitto (``fedge simulate``) and compares.

Tuning, the same budget for every method: three configurations on the first seed, judged on validation accuracy
(mean of the last 10 rounds). FedAdam's server lr is tuned first; every other Adam-server method runs at that lr
(the server optimiser settings it would use alone) and tunes its own knob; the random controls, which have no knob
of their own, tune the server lr. A method that trades accuracy for bytes takes the configuration with the fewest
bytes among those within 1 point of FedAdam's validation accuracy (else the most accurate); the others, the most
accurate. The chosen configuration is then run on every seed and reported on test.

    label             strategy and preset                         tuned (3 values)
    fedavg            plain averaging (server SGD)                server lr
    fedadam           FedAvg's clients, server Adam               server lr
    fedl1             FedL1 at FedAdam's lr                       lambda (group lasso)
    fedsparse-paper   preset paper at FedAdam's lr                lambda0 (the paper's low/mid/high)
    fedsparse-mid     preset earned: sparsity earned over rounds  lambda0, most accurate
    fedsparse-high    preset earned-high                          lambda0, fewest bytes within 1 point
    fedsparse-max     preset max: earned + every link option      lambda0, fewest bytes within 1 point
    random-<x>        FedAdam's server, random structured pruning that follows fedsparse-<x>'s per-layer unit
                      counts round by round (same seed) with <x>'s link options: the same density and bytes
    fedadam-links     ablation: FedAdam with max's link options at FedAdam's lr (not tuned)

    python benchmarks/fedsparse_vs_fedavg.py [--rounds 200] [--seeds 0 1 2] [--jobs 2] [--mqtt]
        [--only LABEL ...] [--schedule-scale 0.5] [--links-seeds 1]

``--only`` runs a subset (fedadam always; random-<x> with fedsparse-<x>); ``--schedule-scale`` shortens the
earned presets' round schedule for shorter runs (docs/fedsparse.md has the command of the measured run).

writes runs/bench/fedsparse_vs_fedavg.json and runs/bench/fedsparse_vs_fedavg.png (the signature plot: test
accuracy against cumulative bytes, every method). Finished runs are kept under runs/bench/fedsparse_work/ by a hash
of their configuration and reused (``--fresh`` ignores them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("bench.fedsparse")
OUT = Path("runs/bench")
WORK = OUT / "fedsparse_work"
SETUP = {"devices": 50, "alpha": 0.5, "clients_per_round": 10, "over_selection": 1.3, "epochs": 1, "batch_size": 20,
         "lr": 0.05, "hidden": [200, 200], "val_frac": 0.15}
ADAM_LRS = [1e-2, 3e-2, 1e-1]


# ---------------------------------------------------------------- one run


def dense_report_bytes(dp, strategy_name: str, rng: np.random.Generator) -> dict[str, int]:
    """Bytes of a report that sends every surviving group of ``dp`` whole: in the plan's value formats without
    sampling, and in float32 (FedAdam's upload)."""
    from edge.algorithms.driver import encode_update
    from edge.protocol import wire
    from edge.protocol.wire import Plan, Report
    new = {k: (dp.weights[k] + rng.normal(0, 1e-2, dp.weights[k].shape)).astype(np.float32) for k in dp.returned()}
    masks = {k: np.ones(dp.weights[k].shape[0], bool) for k in dp.maskable}
    metrics = {"train_loss": 0.123456789, "steps": 2} | ({"kept": 1.0} if strategy_name == "fedsparse" else {})
    out = {}
    for name, up in (("same_format", {k: v for k, v in dp.upload.items() if k not in ("sample", "keep", "p_min")}),
                     ("f4", {"dtype": "f4", "delta": False})):
        plan = Plan("r1", 1, "d0000", 1e18, strategy_name, "torch", "0" * 64, dp.weights, {}, 1, up)
        out[name] = len(wire.encode(Report("r200a1", "d0000", 25, metrics, encode_update(new, plan, masks))))
    return out


def _shared_plan(strategy, state):
    """The round's plan before any device's link options (no side effects on the downlink's records)."""
    return (strategy._round_plan(state) if hasattr(strategy, "_round_plan") else strategy._round(state))[0]


def run_one(job: dict) -> dict:
    """One run of ``job`` (strategy, kwargs, seed, rounds): per-round bytes, density, validation and test accuracy."""
    import torch
    torch.set_num_threads(1)
    from coordinator.daemon import Evaluator
    from coordinator.datasets import digits_federated
    from coordinator.inprocess import Loop
    from coordinator.strategies import make_strategy
    from edge.model import mlp
    seed, rounds = job["seed"], job["rounds"]
    data = digits_federated(SETUP["devices"], SETUP["alpha"], seed, val_frac=SETUP["val_frac"])
    s = make_strategy(job["strategy"], spec=mlp([64, *SETUP["hidden"], 10]), lr=SETUP["lr"], epochs=SETUP["epochs"],
                      batch_size=SETUP["batch_size"], **job["kw"])
    loop = Loop(s, data.shards, seed=seed, ids=[f"d{i:04d}" for i in range(SETUP["devices"])], threads=1)
    ev_val, ev_test = Evaluator(data.x_val, data.y_val), Evaluator(data.x_test, data.y_test)
    rng = np.random.default_rng(0)
    rows = []
    t0 = time.time()
    for r in range(rounds):
        dense = dense_report_bytes(_shared_plan(s, loop.state), s.name, rng) if r + 1 > 50 else {}
        row = loop.round_as_coordinator(SETUP["clients_per_round"], SETUP["over_selection"])
        spec, w = s.global_model(loop.state)
        row["val"] = float(ev_val(spec, w)[1])
        row["accuracy"] = float(ev_test(spec, w)[1])  # test
        row.update({f"dense_up_{k}": v for k, v in dense.items()})
        rows.append({k: (float(v) if isinstance(v, (np.floating,)) else v) for k, v in row.items()})
    loop.close()
    return {"job": job, "rows": rows, "wall_s": time.time() - t0, **summary(rows)}


def summary(rows: list[dict]) -> dict:
    late = [r for r in rows if r["round"] > 50 and "dense_up_same_format" in r]
    up = [r["bytes_up"] / max(1, r["reports"]) for r in late]
    return {"val": float(np.mean([r["val"] for r in rows[-10:]])),
            "test": float(np.mean([r["accuracy"] for r in rows[-10:]])),
            "total_bytes": int(sum(r["bytes_down"] + r["bytes_up"] for r in rows)),
            "bytes_down": int(sum(r["bytes_down"] for r in rows)), "bytes_up": int(sum(r["bytes_up"] for r in rows)),
            "final_density": float(rows[-1].get("density", 1.0)),
            "late_upload_vs_dense_same_format": (float(np.mean([u / r["dense_up_same_format"] for u, r in zip(up, late)]))
                                                 if late else None),
            "late_upload_vs_dense_f4": (float(np.mean([u / r["dense_up_f4"] for u, r in zip(up, late)]))
                                        if late else None),
            "late_upload_bytes": float(np.mean(up)) if up else None}


def job_key(job: dict) -> str:
    """The cache key: the setup, the job and what its preset expands to (a changed preset is a new job)."""
    from coordinator.strategies.fedsparse import PRESETS
    preset = PRESETS.get(job["kw"].get("preset")) if job["strategy"] == "fedsparse" else None
    body = json.dumps({"setup": SETUP, **job} | ({"preset_values": preset} if preset else {}), sort_keys=True,
                      default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class Runner:
    """Runs jobs in ``jobs`` worker processes, each result kept on disk by the hash of its configuration."""

    def __init__(self, jobs: int, fresh: bool):
        self.pool = mp.get_context("spawn").Pool(jobs) if jobs > 1 else None
        self.fresh = fresh
        WORK.mkdir(parents=True, exist_ok=True)

    def run(self, named: list[tuple[str, dict]]) -> dict[str, dict]:
        todo, out = [], {}
        for name, job in named:
            path = WORK / f"{job_key(job)}.json"
            if path.exists() and not self.fresh:
                out[name] = json.loads(path.read_text())
            else:
                todo.append((name, job, path))
        if todo:
            log.info("running %d jobs: %s", len(todo), ", ".join(n for n, _, _ in todo))
            results = (self.pool.map(run_one, [j for _, j, _ in todo], chunksize=1) if self.pool
                       else [run_one(j) for _, j, _ in todo])
            for (name, job, path), res in zip(todo, results):
                path.write_text(json.dumps(res))
                out[name] = res
                log.info("%-28s seed %d: val %.4f test %.4f, %.1f MB, density %.3f (%.0f s)", name, job["seed"],
                         res["val"], res["test"], res["total_bytes"] / 1e6, res["final_density"], res["wall_s"])
        return out

    def close(self) -> None:
        if self.pool:
            self.pool.close()
            self.pool.join()


# ---------------------------------------------------------------- the benchmark


def methods(lr: float, only: list[str] | None = None, schedule: dict | None = None) -> dict[str, dict[str, Any]]:
    """label -> strategy, fixed kwargs, the tuned knob and its three values, and the selection rule. ``schedule``
    overrides the earned presets' round schedule (anneal_from, anneal_rounds, lambda0_ramp) for shorter runs."""
    out = {
        "fedavg": {"strategy": "fedavg", "kw": {}, "knob": "server_lr", "values": [4.0, 8.0, 16.0], "rule": "acc"},
        "fedl1": {"strategy": "fedl1", "kw": {"server_opt": "adam", "server_lr": lr}, "knob": "l1",
                  "values": [2e-3, 1e-2, 2e-2], "rule": "bytes"},
        "fedsparse-paper": {"strategy": "fedsparse", "kw": {"preset": "paper", "server_lr": lr}, "knob": "lambda0",
                            "values": [5e-7, 5e-6, 5e-5], "rule": "bytes"},
        "fedsparse-mid": {"strategy": "fedsparse", "kw": {"preset": "earned", "server_lr": lr}, "knob": "lambda0",
                          "values": [5e-4, 1e-3, 2e-3], "rule": "acc"},
        "fedsparse-high": {"strategy": "fedsparse", "kw": {"preset": "earned-high", "server_lr": lr},
                           "knob": "lambda0", "values": [2e-3, 3e-3, 5e-3], "rule": "bytes"},
        "fedsparse-max": {"strategy": "fedsparse", "kw": {"preset": "max", "server_lr": lr}, "knob": "lambda0",
                          "values": [1e-3, 2e-3, 3e-3], "rule": "bytes"},
    }
    for label in ("fedsparse-mid", "fedsparse-high", "fedsparse-max"):
        out[label]["kw"] = out[label]["kw"] | (schedule or {})
    return {k: v for k, v in out.items() if only is None or k in only}


def link_options(kw: dict) -> dict:
    """The link options a FedSparse configuration runs with (its preset's, then its own)."""
    from coordinator.strategies.fedsparse import PRESETS
    from coordinator.strategies.links import LinkOptions
    keys = set(LinkOptions.__dataclass_fields__)
    return {k: v for k, v in (PRESETS[kw.get("preset", "mid")] | kw).items() if k in keys}


def schedule_of(res: dict) -> list[list[int]]:
    """Per-round alive unit counts per hidden layer of a FedSparse run (its density curve)."""
    n = SETUP["hidden"]
    return [[int(round(r[f"density_fc{i}"] * n[i])) for i in range(len(n))] for r in res["rows"]]


def choose(results: dict[Any, dict], rule: str, target: float) -> Any:
    if rule == "bytes":
        ok = [k for k, r in results.items() if r["val"] >= target - 0.01]
        if ok:
            return min(ok, key=lambda k: (results[k]["total_bytes"], -results[k]["val"]))
    return max(results, key=lambda k: results[k]["val"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (the machine has 2 cores)")
    ap.add_argument("--fresh", action="store_true", help="rerun every job instead of reusing runs/bench/fedsparse_work")
    ap.add_argument("--mqtt", action="store_true", help="also run fedsparse-max (first seed) over Mosquitto and compare")
    ap.add_argument("--out", default=str(OUT / "fedsparse_vs_fedavg.json"))
    ap.add_argument("--only", nargs="+", default=None, choices=ALL,
                    help="these methods only (fedadam always runs; random-<x> runs with fedsparse-<x>)")
    ap.add_argument("--schedule-scale", type=float, default=1.0,
                    help="multiply the earned presets' anneal_from, anneal_rounds and lambda0_ramp (for shorter runs)")
    ap.add_argument("--links-seeds", type=int, default=None, help="run the fedadam-links ablation on this many seeds")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    seeds, s0 = args.seeds, args.seeds[0]
    only = args.only
    schedule = None
    if args.schedule_scale != 1.0:
        from coordinator.strategies.fedsparse import EARNED
        schedule = {k: int(round(EARNED[k] * args.schedule_scale)) for k in ("anneal_from", "anneal_rounds", "lambda0_ramp")}
    args.schedule = schedule
    links_seeds = seeds[:args.links_seeds] if args.links_seeds is not None else seeds
    xs = [x for x in ("mid", "high", "max") if only is None or f"fedsparse-{x}" in only]
    runner = Runner(args.jobs, args.fresh)

    def job(strategy, kw, seed):
        return {"strategy": strategy, "kw": kw, "seed": seed, "rounds": args.rounds}

    try:
        # 1. FedAdam's server lr and plain FedAvg's, on validation
        m = methods(0.0, only, schedule)
        t_adam = runner.run([(f"fedadam lr={v:g}", job("fedadam", {"server_lr": v}, s0)) for v in ADAM_LRS]
                            + [(f"fedavg server_lr={v:g}", job("fedavg", {"server_lr": v}, s0))
                               for v in (m["fedavg"]["values"] if "fedavg" in m else [])])
        adam = {v: t_adam[f"fedadam lr={v:g}"] for v in ADAM_LRS}
        lr = max(adam, key=lambda v: adam[v]["val"])
        target = adam[lr]["val"]
        log.info("fedadam: server lr %g (validation %.4f)", lr, target)
        m = methods(lr, only, schedule)
        tuning: dict[str, dict] = {"fedadam": {"knob": "server_lr", "results": adam, "chosen": lr}}
        if "fedavg" in m:
            tuning["fedavg"] = {"knob": "server_lr", "results": {v: t_adam[f"fedavg server_lr={v:g}"]
                                                                 for v in m["fedavg"]["values"]}}
        # 2. every other method's knob at FedAdam's lr; finals of fedadam and fedavg
        named = []
        for label, spec in m.items():
            if label == "fedavg":
                continue
            for v in spec["values"]:
                named.append((f"{label} {spec['knob']}={v:g}", job(spec["strategy"], spec["kw"] | {spec["knob"]: v}, s0)))
        res = runner.run(named + [(f"fedadam seed {s}", job("fedadam", {"server_lr": lr}, s)) for s in seeds[1:]])
        for label, spec in m.items():
            if label != "fedavg":
                tuning[label] = {"knob": spec["knob"],
                                 "results": {v: res[f"{label} {spec['knob']}={v:g}"] for v in spec["values"]}}
            tuning[label]["chosen"] = choose(tuning[label]["results"], spec["rule"], target)
            log.info("%s: %s = %g", label, spec["knob"], tuning[label]["chosen"])
        chosen_kw = {label: m[label]["kw"] | {m[label]["knob"]: tuning[label]["chosen"]} for label in m}
        fedavg_lr = tuning["fedavg"]["chosen"] if "fedavg" in m else None
        per_seed: dict[str, list[dict]] = {"fedadam": [adam[lr]] + [res[f"fedadam seed {s}"] for s in seeds[1:]]}
        # 3. finals of every method on the other seeds; the random controls tuned on the first seed
        named = [(f"fedavg seed {s}", job("fedavg", {"server_lr": fedavg_lr}, s)) for s in seeds[1:]] if "fedavg" in m else []
        for label in m:
            if label != "fedavg":
                named += [(f"{label} seed {s}", job(m[label]["strategy"], chosen_kw[label], s)) for s in seeds[1:]]
        for x in xs:
            src = tuning[f"fedsparse-{x}"]["results"][tuning[f"fedsparse-{x}"]["chosen"]]
            rkw = link_options(chosen_kw[f"fedsparse-{x}"]) | {"prune_schedule": schedule_of(src)}
            named += [(f"random-{x} server_lr={v:g}", job("fedadam", rkw | {"server_lr": v}, s0)) for v in ADAM_LRS]
        named += [(f"fedadam-links seed {s}", job("fedadam", {"server_lr": lr} | link_options({"preset": "max"}), s))
                  for s in links_seeds]
        res3 = runner.run(named)
        if "fedavg" in m:
            per_seed["fedavg"] = [tuning["fedavg"]["results"][fedavg_lr]] + [res3[f"fedavg seed {s}"] for s in seeds[1:]]
        for label in m:
            if label != "fedavg":
                first = tuning[label]["results"][tuning[label]["chosen"]]
                per_seed[label] = [first] + [res3[f"{label} seed {s}"] for s in seeds[1:]]
        if links_seeds:
            per_seed["fedadam-links"] = [res3[f"fedadam-links seed {s}"] for s in links_seeds]
        # 4. the random controls on the other seeds, each following fedsparse-<x> of the same seed
        named = []
        for x in xs:
            tuning[f"random-{x}"] = {"knob": "server_lr", "results": {v: res3[f"random-{x} server_lr={v:g}"]
                                                                      for v in ADAM_LRS}}
            rl = tuning[f"random-{x}"]["chosen"] = choose(tuning[f"random-{x}"]["results"], "acc", target)
            for i, s in enumerate(seeds[1:], 1):
                rkw = (link_options(chosen_kw[f"fedsparse-{x}"]) | {"prune_schedule": schedule_of(per_seed[f"fedsparse-{x}"][i]),
                                                                    "server_lr": rl})
                named.append((f"random-{x} seed {s}", job("fedadam", rkw, s)))
        res4 = runner.run(named)
        for x in xs:
            per_seed[f"random-{x}"] = ([tuning[f"random-{x}"]["results"][tuning[f"random-{x}"]["chosen"]]]
                                       + [res4[f"random-{x} seed {s}"] for s in seeds[1:]])
        mqtt = confirm_over_mqtt(chosen_kw["fedsparse-max"], s0, args.rounds, per_seed["fedsparse-max"][0]) \
            if args.mqtt and "fedsparse-max" in m else None
    finally:
        runner.close()
    write(args, per_seed, tuning, chosen_kw | {"fedadam": {"server_lr": lr}}
          | ({"fedavg": {"server_lr": fedavg_lr}} if fedavg_lr is not None else {}), mqtt)
    return 0


ALL = ["fedavg", "fedl1", "fedsparse-paper", "fedsparse-mid", "fedsparse-high", "fedsparse-max"]
ORDER = ["fedavg", "fedadam", "fedl1", "fedsparse-paper", "fedsparse-mid", "fedsparse-high", "fedsparse-max",
         "random-mid", "random-high", "random-max", "fedadam-links"]
CURVE_AT = [1, 10, 25, 40, 50, 60, 75, 100, 150, 200]


def write(args, per_seed: dict[str, list[dict]], tuning: dict, chosen: dict, mqtt: dict | None) -> None:
    from coordinator.report import plot_accuracy_vs_bytes, write_json
    runs = []
    base = per_seed["fedadam"]
    base_bytes = float(np.mean([r["total_bytes"] for r in base]))
    base_acc = float(np.mean([r["test"] for r in base]))
    for label in [k for k in ORDER if k in per_seed]:
        rs = per_seed[label]
        dens = {rnd: float(np.mean([r["rows"][min(rnd, len(r["rows"])) - 1].get("density", 1.0) for r in rs]))
                for rnd in CURVE_AT if rnd <= args.rounds}
        late_same = [r["late_upload_vs_dense_same_format"] for r in rs if r["late_upload_vs_dense_same_format"]]
        late_f4 = [r["late_upload_vs_dense_f4"] for r in rs if r["late_upload_vs_dense_f4"]]
        tb = float(np.mean([r["total_bytes"] for r in rs]))
        runs.append({
            "label": label, "config": chosen.get(label, rs[0]["job"]["kw"]),
            "accuracy": float(np.mean([r["test"] for r in rs])), "accuracy_per_seed": [r["test"] for r in rs],
            "val_accuracy": float(np.mean([r["val"] for r in rs])),
            "total_bytes": tb, "bytes_down": float(np.mean([r["bytes_down"] for r in rs])),
            "bytes_up": float(np.mean([r["bytes_up"] for r in rs])),
            "bytes_ratio_to_fedadam": tb / base_bytes, "accuracy_vs_fedadam": float(np.mean([r["test"] for r in rs])) - base_acc,
            "bytes_saved_vs_fedadam": 1 - tb / base_bytes,
            "final_density": float(np.mean([r["final_density"] for r in rs])), "density_curve": dens,
            "late_upload_vs_dense_same_format": float(np.mean(late_same)) if late_same else None,
            "late_upload_vs_dense_f4": float(np.mean(late_f4)) if late_f4 else None,
        })
    by = {r["label"]: r for r in runs}
    floors = {}
    if "fedsparse-max" in by:
        mx = by["fedsparse-max"]
        floors = {"fedsparse-max": {
            "within_1pt_of_fedadam": mx["accuracy_vs_fedadam"] >= -0.01,
            "at_most_1_8_of_fedadam_bytes": mx["bytes_ratio_to_fedadam"] <= 1 / 8,
            "late_uploads_at_most_half_a_dense_upload": (mx["late_upload_vs_dense_same_format"] or 1.0) <= 0.5}}
    versus_random = {}
    for x in [x for x in ("mid", "high", "max") if f"random-{x}" in per_seed]:
        a = [r["test"] for r in per_seed[f"fedsparse-{x}"]]
        b = [r["test"] for r in per_seed[f"random-{x}"]]
        d = np.array(a) - np.array(b)
        versus_random[x] = {"fedsparse_minus_random_per_seed": d.tolist(), "mean": float(d.mean()),
                            "sd": float(d.std(ddof=1)) if len(d) > 1 else None,
                            "bytes_ratio": by[f"fedsparse-{x}"]["total_bytes"] / by[f"random-{x}"]["total_bytes"]}
    tuning_out = {label: {"knob": t["knob"], "chosen": t.get("chosen"),
                          "validation": {f"{k:g}": {"val": r["val"], "test": r["test"], "total_bytes": r["total_bytes"],
                                                    "final_density": r["final_density"]}
                                         for k, r in t["results"].items()}} for label, t in tuning.items()}
    result = {"config": SETUP | {"rounds": args.rounds, "seeds": args.seeds, "runtime": "torch",
                                 "loop": "coordinator/inprocess.py (reproducible mode)",
                                 "earned_schedule_override": args.schedule,
                                 "accuracy": "test accuracy, mean of the last 10 rounds, mean over seeds",
                                 "tuning": "3 configurations per method on the first seed, validation accuracy"},
              "runs": runs, "floors": floors, "versus_random": versus_random, "tuning": tuning_out,
              "curves": {k: [{f: r.get(f) for f in ("round", "accuracy", "val", "bytes_down", "bytes_up", "density",
                                                    "density_fc0", "density_fc1", "kept")}
                             for r in v[0]["rows"]] for k, v in per_seed.items()},
              "density_curves_per_seed": {k: [[r.get("density", 1.0) for r in s["rows"]] for s in v]
                                          for k, v in per_seed.items() if "density" in v[0]["rows"][0]},
              "per_seed": {k: [{kk: vv for kk, vv in r.items() if kk != "rows"} for r in v] for k, v in per_seed.items()},
              "mqtt": mqtt}
    write_json(args.out, result)
    png = Path(args.out).with_suffix(".png")
    plot_accuracy_vs_bytes([(k, per_seed[k][0]["rows"]) for k in ORDER if k in per_seed], png,
                           title=f"digits, 50 devices, seed {args.seeds[0]}: test accuracy against bytes",
                           logx=True, ylim=(0.85, 1.0), smooth=5)
    print(f"\n{'label':<16} {'test acc':>8} {'vs adam':>8} {'MB':>8} {'ratio':>7} {'density':>7}  density curve "
          f"(rounds {', '.join(str(c) for c in CURVE_AT if c <= args.rounds)})")
    for r in runs:
        print(f"{r['label']:<16} {r['accuracy']:>8.4f} {r['accuracy_vs_fedadam']:>+8.4f} {r['total_bytes'] / 1e6:>8.1f} "
              f"{r['bytes_ratio_to_fedadam']:>7.4f} {r['final_density']:>7.3f}  "
              + " ".join(f"{v:.2f}" for v in r["density_curve"].values()))
    print(json.dumps({"floors": floors, "versus_random": versus_random, "mqtt": mqtt}, indent=1))


def confirm_over_mqtt(kw: dict, seed: int, rounds: int, inproc: dict) -> dict:
    """The fedsparse-max run of ``seed`` over a private Mosquitto (fedge simulate, reproducible mode), next to the
    in-process run of the same configuration."""
    from coordinator.broker import Mosquitto
    from coordinator.simulate import SimConfig, simulate
    with Mosquitto() as mq:
        cfg = SimConfig(strategy="fedsparse", devices=SETUP["devices"], clients_per_round=SETUP["clients_per_round"],
                        rounds=rounds, epochs=SETUP["epochs"], batch_size=SETUP["batch_size"], lr=SETUP["lr"],
                        seed=seed, alpha=SETUP["alpha"], val_frac=SETUP["val_frac"],
                        over_selection=SETUP["over_selection"], hidden=tuple(SETUP["hidden"]), broker=mq.url,
                        processes=2, workdir=str(WORK / "mqtt"), strategy_kw=kw)
        t0 = time.time()
        rep = simulate(cfg, progress=False)
    rows = rep["rounds"]
    ip = inproc["rows"]
    acc_m = float(np.mean([r["accuracy"] for r in rows[-10:]]))
    tb = int(sum(r["bytes_down"] + r["bytes_up"] for r in rows))
    same_acc = all(abs(a["accuracy"] - b["accuracy"]) < 1e-12 for a, b in zip(rows, ip))
    out = {"label": "fedsparse-max", "seed": seed, "wall_s": time.time() - t0, "accuracy": acc_m,
           "inprocess_accuracy": inproc["test"], "total_bytes": tb, "inprocess_total_bytes": inproc["total_bytes"],
           "bytes_ratio_mqtt_to_inprocess": tb / inproc["total_bytes"], "same_accuracy_every_round": same_acc,
           "final_density": rows[-1].get("density"), "inprocess_final_density": inproc["final_density"]}
    log.info("mqtt: %s", out)
    return out


if __name__ == "__main__":
    sys.exit(main())
