"""Slow chunked uploads (issue 30, "capacity follows bytes").

Six hostile devices of a fleet of sixteen, whenever selected, do not report: each opens two chunked transfers
on its report topic announcing the largest report its plan allows, and sends a 256-byte chunk of each every
half second until the plan's deadline, then gives the plan up (checks in, so it is selected again). Scaled down
as the issue measured it: 2 MiB messages (8 MiB of reassembly capacity), 64 KiB chunks, honest reports of about
1.2 MB (an MLP 64-512-512-10) in 19 chunks each, so that twelve trickling transfers announce more than the capacity.

The attacked fleet (ten honest devices and the six tricklers) runs for ``seconds`` against a clean fleet of the
same sixteen devices all honest, same seed and time; ``holds`` when the attacked run commits at least 80% of the
clean run's rounds. Figures: rounds committed, honest uploads refused as busy, transfers dropped as trickles.
"""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path

from benchmarks.common import SpyFleet, committed_rounds, honest_device, start_coordinator, write_fleet_toml
from coordinator.simulate import SimConfig, prepare
from edge.protocol import wire
from edge.protocol.agent import AgentConfig
from edge.runtime.data import load_npz, save_npz
from edge.runtime.device import Device
from edge.runtime.mqtt import BrokerAddress

FAMILY = "trickle"
TRICKLERS = 6
DEVICES = 16
MAX_MESSAGE = 2 * 1024 * 1024
CHUNK = 64 * 1024


class TricklingDevice(Device):
    """Given a plan, trickles two transfers of the largest report the plan allows instead of reporting."""

    sent_chunks = 0

    def _train(self, plan: wire.Plan) -> None:
        total = sum(4 * math.prod(w.shape) + 4 * (w.shape[0] if w.ndim else 1) + 64 for w in plan.weights.values())
        total += 64 * 1024  # what the coordinator allows a report of this plan (rounds.max_report_bytes)
        n = -(-total // 256)
        topic = wire.topic(self.agent.cfg.fleet, "report", self.agent.cfg.device_id)

        def trickle() -> None:
            i = 0
            while time.time() < plan.deadline and i < n - 1:
                for mid in (f"r-{plan.task_id}-a", f"r-{plan.task_id}-b"):
                    self.link.publish(topic, wire.encode(wire.Chunk(mid, i, n, total, b"\0" * 256)))
                    TricklingDevice.sent_chunks += 1
                i += 1
                time.sleep(0.5)
            self.link.call_soon(lambda: self._do(self.agent.training_done(None, time.time(), "trickled")))
        threading.Thread(target=trickle, daemon=True).start()


def _fleet(work: Path, broker_url: str, seed: int, seconds: float, hostile: bool) -> dict:
    cfg = SimConfig(devices=DEVICES, clients_per_round=5, hidden=(512, 512), seed=seed, partition="iid",
                    chunk_bytes=CHUNK, workdir=str(work), fleet=f"trickle{'h' if hostile else 'c'}{seed}")
    specs, data = prepare(cfg)
    save_npz(work / "test.npz", data.x_test, data.y_test)
    state = work / "state.sqlite"
    conf = write_fleet_toml(work / "fleet.toml", {
        "broker": {"url": broker_url}, "state": {"path": str(state)},
        "rounds": {"rounds": 10_000, "clients_per_round": 5, "over_selection": 1.4, "seed": seed, "fleet": cfg.fleet,
                   "round_timeout_s": 8.0, "selection_timeout_s": 1.0, "chunk_bytes": CHUNK,
                   "max_message_bytes": MAX_MESSAGE},
        "strategy": {"name": "fedavg", "sizes": [64, 512, 512, 10], "epochs": 1, "lr": 0.1},
        "data": {"test": str(work / "test.npz")}})
    log = work / "coordinator.log"
    proc = start_coordinator(conf, log)
    bad = {s["id"] for s in specs[:TRICKLERS]} if hostile else set()

    def make(spec: dict, url: str, executor):
        if spec["id"] not in bad:
            return honest_device(spec, url, executor)
        x, y = load_npz(spec["data"])
        ac = AgentConfig(spec["id"], fleet=spec["fleet"], capabilities=spec["caps"], chunk_bytes=CHUNK)
        return TricklingDevice(ac, x, y, spec["state"], BrokerAddress.parse(url), executor=executor)

    fleet = None
    try:
        time.sleep(1.0)
        fleet = SpyFleet(specs, broker_url, make=make)
        time.sleep(seconds)
        rounds = committed_rounds(state)
    finally:
        if fleet is not None:
            fleet.stop()
        proc.terminate()
        proc.wait(30)
    text = log.read_text(errors="replace")
    return {"rounds": rounds, "busy_refusals": text.count("reassembly capacity") + text.count("incomplete chunked"),
            "trickles_dropped": text.count("trickled below")}


def run(work: Path, broker_url: str, seed: int, quick: bool) -> dict:
    seconds = 30.0 if quick else 60.0
    clean = _fleet(work / "clean", broker_url, seed, seconds, hostile=False)
    attacked = _fleet(work / "attacked", broker_url, seed, seconds, hostile=True)
    share = attacked["rounds"] / clean["rounds"] if clean["rounds"] > 0 else 0.0
    return {"holds": share >= 0.8, "seconds": seconds, "tricklers": TRICKLERS, "devices": DEVICES,
            "rounds_clean": clean["rounds"], "rounds_attacked": attacked["rounds"], "rounds_share": round(share, 3),
            "honest_uploads_refused_busy": attacked["busy_refusals"], "trickles_dropped": attacked["trickles_dropped"],
            "chunks_trickled": TricklingDevice.sent_chunks}
