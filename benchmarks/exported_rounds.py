"""Exports in a run whose model is pruned (issue #26): one program per bucket, built ahead, no round waiting.

FedSparse (the ``earned-high`` preset, which prunes over many rounds: 200 rounds, in which the hidden layers go
from 200 units to about 20, through all three buckets; ``--quick`` compresses its schedules) and FedMix (K = 4 experts, Alg. 2 dropping experts per device)
run over MQTT twice each with the same seed: on a fleet of ONNX Runtime and ExecuTorch devices (alternating),
and on torch devices. Each ORT/ExecuTorch run starts from an empty program cache (cold: every export is in its
wall time) with the daemon's background catalog: the coordinator asks for the first round's bucket and the
bucket family as soon as it starts (``Coordinator.prefetch``), and for the family of every later bucket when a
round needs one (coordinator/buckets.py, the round machine); a round opens only with programs that exist, and
does not wait while enough devices have theirs (a larger built bucket for a padding device; the devices whose
programs are exporting passed over).

Recorded per run: ``wall_s`` (coordinator start to the last commit), ``exports`` (programs exported, per
runtime, counted in the run's own program store; an export under way at the end is finished and counted,
those not started are dropped), ``rounds_abandoned`` (attempts abandoned), ``late_plans``
(plan messages published after their round's deadline), the rounds' summed ``export_s`` (time a round waited
for an export before opening), ``passed_over`` (selected devices a round left out because their programs were
still exporting: coordinator/rounds.py, production mode), the program shapes each run exported, and, for FedSparse, the hidden widths per
round. Then, measured on the ExecuTorch programs the run exported: ``loss_and_grads`` time per bucket (batch 20,
one thread), the compute that shrinks with the subnetwork.

    python benchmarks/exported_rounds.py [--quick] [--rounds N] [--epochs E] [--out runs/bench/exported_rounds.json]

``--quick``: fewer rounds (a check that the machinery runs, not the figures).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.broker import start_broker  # noqa: E402
from coordinator.daemon import ProgramCatalog  # noqa: E402
from coordinator.observe import Observer  # noqa: E402
from coordinator.simulate import DeviceFleet, SimConfig, build_coordinator, fleet_runtimes, model_spec, prepare  # noqa: E402

FEDSPARSE_KW = {"preset": "earned-high"}  # as published: lambda0 ramped over 50 rounds, T annealed over rounds 61-120
QUICK_FEDSPARSE_KW = {"preset": "earned-high", "anneal_from": 2, "anneal_rounds": 4, "lambda0_ramp": 2}
ROUNDS = {"fedsparse": 200, "fedmix": 60}  # FedSparse prunes 200-200 units to about 19-14 by round 150 (epochs 10)
FEDMIX_KW = {"K": 4, "prune_after": 3}
RUNTIME_FLEETS = {"exported": ("ort", "executorch"), "torch": ("torch",)}


class Watch(Observer):
    """Abandoned attempts and plans published after their round's deadline (the daemon's network thread)."""

    def __init__(self) -> None:
        self.deadline: float | None = None
        self.abandoned = 0
        self.late_plans = 0
        self.plans = 0

    def persisted(self, what, data):
        if what == "open":
            self.deadline = float(data["deadline"])
        elif what == "abandon":
            self.abandoned += 1

    def published(self, topic, payload):
        if "/plan/" in topic:
            self.plans += 1
            if self.deadline is None or time.time() > self.deadline:
                self.late_plans += 1


def exported(cache: Path) -> list[dict]:
    out = []
    for k in sorted((cache / "keys").glob("*.json")):
        rec = json.loads(k.read_text())
        out.append({"runtime": rec["runtime"], "objective": rec["objective"], "sizes": rec["spec"].get("sizes"),
                    "slots": len(rec["layout"].get("slots", [])) or None, "export_s": round(rec["export_seconds"], 1),
                    "hash": rec["hash"]})
    return out


def one_run(strategy: str, fleet: str, rounds: int, workdir: Path, seed: int, epochs: int, quick: bool) -> dict:
    kw = (QUICK_FEDSPARSE_KW if quick else FEDSPARSE_KW) if strategy == "fedsparse" else FEDMIX_KW
    runtimes = RUNTIME_FLEETS[fleet]
    cfg = SimConfig(strategy=strategy, devices=16, clients_per_round=5, rounds=rounds, epochs=epochs, seed=seed,
                    runtimes=runtimes, processes=2, workdir=str(workdir / f"{strategy}-{fleet}"),
                    fleet=f"xr-{strategy}-{fleet}-{int(time.time() * 1000) % 10**8}", strategy_kw=dict(kw),
                    round_timeout_s=60.0, mode="production", over_selection=1.0)
    if Path(cfg.workdir).exists():
        shutil.rmtree(cfg.workdir)
    specs, data = prepare(cfg)
    cfg = replace(cfg, spec=model_spec(cfg, data), devices=len(specs))
    cache = workdir / f"programs-{strategy}-{fleet}"
    shutil.rmtree(cache, ignore_errors=True)  # cold: every export of the run is in its wall time
    programs = ProgramCatalog(cache, background=True)
    watch = Watch()
    rows: list[dict] = []
    widths: list = []
    broker = start_broker("embedded")
    t0 = time.time()
    coord = devices = None
    try:
        coord = build_coordinator(cfg, broker.url, (data.x_test, data.y_test), rows.append, observer=watch,
                                  programs=programs)
        asked = coord.prefetch(fleet_runtimes(runtimes))
        coord.start()
        devices = DeviceFleet(specs, broker.url, cfg.processes)
        if not coord.wait(60 * rounds + 900):
            raise TimeoutError(f"{strategy} on {fleet} did not finish")
        if coord.error:
            raise RuntimeError("coordinator failed") from coord.error
        wall = time.time() - t0
        # an export still under way when the run ended counts (and must not slow the next run): finish it
        programs.close(wait=True)
        state = coord.state
        if strategy == "fedsparse":
            widths = [int(state.opt[f"alive/fc{i}"].sum()) for i in range(2)]
    finally:
        if coord is not None:
            coord.stop()
        if devices is not None:
            devices.stop()
        broker.stop()
    progs = exported(cache)
    counts: dict[str, int] = {}
    for p in progs:
        counts[p["runtime"]] = counts.get(p["runtime"], 0) + 1
    return {"strategy": strategy, "runtimes": list(runtimes), "wall_s": round(wall, 1),
            "exports": counts, "rounds_abandoned": watch.abandoned, "late_plans": watch.late_plans,
            "plans": watch.plans, "rounds": len(rows), "prefetched": asked,
            "export_s": round(sum(r.get("export_s", 0.0) for r in rows), 2),
            "passed_over": sum(r.get("passed_over", 0) for r in rows),
            "round_wall_s": round(sum(r.get("wall_s", 0.0) for r in rows), 1),
            "final_accuracy": rows[-1]["accuracy"] if rows else None,
            "final_widths": widths or None, "programs": progs, "_cache": str(cache)}


def bucket_step_ms(cache: Path, steps: int = 200) -> list[dict]:
    """``loss_and_grads`` time per ExecuTorch FedSparse bucket program of ``cache`` (batch 20, one thread,
    median of ``steps`` after 20 warm-up): what a device's compute is at each bucket."""
    import numpy as np

    from edge.runtime.program import ProgramCache
    from edge.trainers import make_trainer
    from edge.trainers.base import example_feeds
    out = []
    store = ProgramCache(cache / "programs")
    for p in exported(cache):
        if p["runtime"] != "executorch" or p["objective"] != "fedsparse":
            continue
        t = make_trainer("executorch", threads=1)
        t.load(store.get(p["hash"]))
        rng = np.random.default_rng(0)
        t.set_weights({k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in t.shapes.items()})
        feeds = example_feeds(t.inputs, 20)
        times = []
        for i in range(steps + 20):
            a = time.perf_counter()
            t.loss_and_grads(feeds)
            if i >= 20:
                times.append(time.perf_counter() - a)
        out.append({"sizes": p["sizes"], "ms": round(1e3 * float(np.median(times)), 4)})
    full = max((o["ms"] for o in out if o["sizes"] == max(x["sizes"] for x in out)), default=None)
    for o in out:
        o["x_full"] = round(o["ms"] / full, 3) if full else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=10, help="local epochs: the devices' work, where the runtimes differ")
    ap.add_argument("--out", default="runs/bench/exported_rounds.json")
    args = ap.parse_args()
    rounds = {s: args.rounds or (8 if args.quick else n) for s, n in ROUNDS.items()}
    work = Path(tempfile.mkdtemp(prefix="fedge-exported-rounds-"))
    runs = []
    try:
        for strategy in ("fedsparse", "fedmix"):
            for fleet in ("exported", "torch"):
                r = one_run(strategy, fleet, rounds[strategy], work, args.seed, args.epochs, args.quick)
                print(json.dumps({k: v for k, v in r.items() if k not in ("programs", "_cache")}), flush=True)
                runs.append(r)
        steps = bucket_step_ms(Path(runs[0]["_cache"]))
        for r in runs:
            r.pop("_cache")
        checks = {}
        for s in ("fedsparse", "fedmix"):
            ex = next(r for r in runs if r["strategy"] == s and r["runtimes"] != ["torch"])
            to = next(r for r in runs if r["strategy"] == s and r["runtimes"] == ["torch"])
            checks[s] = {"wall_ratio": round(ex["wall_s"] / to["wall_s"], 3),
                         "executorch_exports": ex["exports"].get("executorch", 0)}
        res = {"rounds": rounds, "epochs": args.epochs, "quick": args.quick, "runs": runs, "bucket_step_ms": steps, "checks": checks}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(json.dumps({"checks": checks, "bucket_step_ms": steps}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
