"""Poisoning from inside the rules (issue 30): well-formed reports inside the norm bound, and sample counts a
device is free to declare.

A real fleet of ten devices over Mosquitto (sklearn digits, Dirichlet 0.5, FedAvg, every device selected every
round, the coordinator as a user starts it with the default [admission] rules), against a clean run of the same
seed. Scenarios:

- ``flip1`` / ``flip3``: 1 or 3 devices send their honest update sign-flipped and scaled 9.5x (an attacker whose
  own update is a median one: just inside the default norm bound of 10x the median), from round 1;
- ``lie``: one device declares 10^6 samples (max_samples) and sends its update sign-flipped at 9.5x, from round 1;
- ``stall``: one device honest until round ``STALL_FROM``, then declares 10^6 samples and sends sign-flipped
  updates at 9.5x (before the guard could leave reports out, every attempt of that round was refused and
  retried with the same devices, forever).

``holds`` (per scenario, and for the family when every scenario holds): every round commits with at most 2
abandoned attempts, and the final accuracy is within 2 points of the clean run's. ``min_reports`` is 6 so that
a fleet of ten that quarantined three poisoners can still commit a round.
"""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import numpy as np

from benchmarks.common import SpyFleet, honest_device, start_coordinator, write_fleet_toml
from coordinator.simulate import SimConfig, prepare
from edge.algorithms.driver import run_plan
from edge.protocol import wire
from edge.protocol.agent import AgentConfig
from edge.protocol.wire import Report, TensorUpdate
from edge.runtime.data import load_npz, save_npz
from edge.runtime.device import Device
from edge.runtime.mqtt import BrokerAddress

FAMILY = "poison"
DEVICES = 10
SCALE = 9.5
LIE = 10**6
STALL_FROM = 8


class PoisonDevice(Device):
    """From round ``poison_from``: its update sign-flipped and scaled by SCALE, and (``lie``) LIE samples declared."""

    poison_from, lie = 1, False

    def _train(self, plan: wire.Plan) -> None:
        honest = run_plan(plan, self._trainer_for(plan), self.x, self.y, self.local)
        report = honest
        if self.lie and plan.round >= self.poison_from - 1:
            self.agent.n_samples = LIE  # its next check-in declares it
        if plan.round >= self.poison_from:
            tens = {k: TensorUpdate(t.shape, (plan.weights[k] - SCALE * (t.values - plan.weights[k])).astype(np.float32))
                    for k, t in honest.tensors.items()}
            report = Report(honest.task_id, honest.device_id, LIE if self.lie else honest.n_samples, honest.metrics,
                            tens)
        self.link.call_soon(lambda: self._do(self.agent.training_done(report, time.time())))


def _fleet(work: Path, url: str, seed: int, rounds: int, name: str, bad: dict[str, tuple[int, bool]],
           timeout_s: float) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    cfg = SimConfig(devices=DEVICES, clients_per_round=DEVICES, hidden=(64,), seed=seed, workdir=str(work),
                    fleet=f"poison{name}{seed}")
    specs, data = prepare(cfg)
    save_npz(work / "test.npz", data.x_test, data.y_test)
    state = work / "state.sqlite"
    conf = write_fleet_toml(work / "fleet.toml", {
        "broker": {"url": url}, "state": {"path": str(state)},
        "rounds": {"rounds": rounds, "clients_per_round": DEVICES, "over_selection": 1.0, "min_reports": 6,
                   "seed": seed, "fleet": cfg.fleet, "round_timeout_s": 10.0, "selection_timeout_s": 2.0},
        "strategy": {"name": "fedavg", "sizes": [64, 64, 10], "epochs": 1, "lr": 0.1},
        "data": {"test": str(work / "test.npz")}})
    proc = start_coordinator(conf, work / "coordinator.log")

    def make(spec: dict, u: str, executor):
        if spec["id"] not in bad:
            return honest_device(spec, u, executor)
        x, y = load_npz(spec["data"])
        ac = AgentConfig(spec["id"], fleet=spec["fleet"], capabilities=spec["caps"], chunk_bytes=spec["chunk_bytes"])
        d = PoisonDevice(ac, x, y, spec["state"], BrokerAddress.parse(u), executor=executor,
                         trainer_kw={"threads": 1})
        d.poison_from, d.lie = bad[spec["id"]]
        return d

    fleet = None
    t0 = time.time()
    try:
        time.sleep(1.0)
        fleet = SpyFleet(specs, url, make=make)
        while proc.poll() is None and time.time() - t0 < timeout_s:
            time.sleep(0.5)
    finally:
        if fleet is not None:
            fleet.stop()
        if proc.poll() is None:
            proc.terminate()
        proc.wait(30)
    db = sqlite3.connect(f"file:{state}?mode=ro", uri=True)
    try:
        summaries = [json.loads(s) for (s,) in db.execute(
            "SELECT summary FROM rounds WHERE status='committed' ORDER BY round")]
        abandoned = dict(db.execute("SELECT round, COUNT(*) FROM rounds WHERE status='abandoned' GROUP BY round"))
        quarantined = [d for (d,) in db.execute("SELECT device_id FROM devices WHERE quarantines > 0")] \
            if _has_column(db, "devices", "quarantines") else []
    finally:
        db.close()
    return {"rounds": len(summaries), "final_accuracy": summaries[-1].get("accuracy") if summaries else None,
            "accuracy": [round(s.get("accuracy", 0.0), 4) for s in summaries],
            "max_abandoned_per_round": max(abandoned.values(), default=0),
            "abandoned": sum(abandoned.values()),
            "excluded": {s["round"]: s["excluded"] for s in summaries if s.get("excluded")},
            "quarantined": quarantined, "wall_s": round(time.time() - t0, 1)}


def _has_column(db, table: str, col: str) -> bool:
    return any(r[1] == col for r in db.execute(f"PRAGMA table_info({table})"))


SCENARIOS = {
    "flip1": {"d0002": (1, False)},
    "flip3": {"d0001": (1, False), "d0004": (1, False), "d0007": (1, False)},
    "lie": {"d0002": (1, True)},
    "stall": {"d0003": (STALL_FROM, True)},
}


def run(work: Path, broker_url: str, seed: int, quick: bool) -> dict:
    rounds = 12 if quick else 20
    timeout_s = 120.0 if quick else 300.0
    clean = _fleet(work / "clean", broker_url, seed, rounds, "c", {}, timeout_s)
    out = {"rounds": rounds, "devices": DEVICES, "scale": SCALE, "clean": clean}
    holds = clean["rounds"] == rounds
    for name, bad in SCENARIOS.items():
        r = _fleet(work / name, broker_url, seed, rounds, name, bad, timeout_s)
        ok = (r["rounds"] == rounds and r["max_abandoned_per_round"] <= 2 and r["final_accuracy"] is not None
              and clean["final_accuracy"] is not None and r["final_accuracy"] >= clean["final_accuracy"] - 0.02)
        out[name] = r | {"holds": ok}
        holds = holds and ok
    return {"holds": holds} | out
