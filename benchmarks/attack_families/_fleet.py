"""A time-boxed fleet for the flood and takeover families: ``fedge coordinator --config fleet.toml`` in a child
process, honest device agents in this process, over the given Mosquitto; an attack runs beside it. (Not a family:
no ``FAMILY``.)"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import committed_rounds, honest_device, start_coordinator, wait_until, write_fleet_toml


def meta(state: Path, key: str) -> str | None:
    try:
        db = sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=1.0)
        try:
            row = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        finally:
            db.close()
        return row[0] if row else None
    except sqlite3.Error:
        return None


def query(state: Path, sql: str) -> list[tuple]:
    try:
        db = sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=2.0)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return []


def run_fleet(work: Path, broker_url: str, seed: int, *, fleet: str, duration_s: float, devices: int = 6,
              clients_per_round: int = 3, rounds_kw: dict[str, Any] | None = None,
              attack: Callable[[dict], Callable[[], dict]] | None = None) -> dict:
    """Run for ``duration_s`` from the first committed round's opening; ``attack(ctx)`` (ctx: state, fleet,
    t0, url) starts the attack once the fleet runs and returns a function that stops it and returns its figures."""
    from coordinator.simulate import SimConfig, prepare
    from edge.runtime.data import save_npz
    work.mkdir(parents=True, exist_ok=True)
    cfg = SimConfig(devices=devices, clients_per_round=clients_per_round, over_selection=1.0, rounds=100_000,
                    epochs=1, hidden=(32,), workdir=str(work), fleet=fleet, seed=seed, partition="iid")
    specs, data = prepare(cfg)
    save_npz(work / "test.npz", data.x_test, data.y_test)
    state = work / "state.sqlite"
    conf = write_fleet_toml(work / "fleet.toml", {
        "broker": {"url": broker_url}, "state": {"path": str(state)},
        "rounds": {"rounds": 100_000, "clients_per_round": clients_per_round, "over_selection": 1.0, "seed": seed,
                   "fleet": fleet, "round_timeout_s": 10.0, "selection_timeout_s": 1.0, **(rounds_kw or {})},
        "strategy": {"name": "fedavg", "sizes": [64, 32, 10], "epochs": 1, "lr": 0.1},
        "data": {"test": str(work / "test.npz")}})
    log = work / "coordinator.log"
    proc = start_coordinator(conf, log)
    pool = ThreadPoolExecutor(2)
    devs, figures, stop_attack = [], {}, None
    try:
        wait_until(lambda: meta(state, "run_id") is not None, 60, "the coordinator's state")
        for s in specs:
            devs.append(honest_device(s, broker_url, pool).start())
        wait_until(lambda: committed_rounds(state) >= 1, 120, "a first round")
        t0 = time.time()
        r0 = committed_rounds(state)
        if attack is not None:
            stop_attack = attack({"state": state, "fleet": fleet, "t0": t0, "url": broker_url, "log": log})
        time.sleep(duration_s)
        if stop_attack is not None:
            figures = stop_attack()
            stop_attack = None
        rounds = committed_rounds(state) - r0
    finally:
        if stop_attack is not None:
            stop_attack()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except Exception:  # noqa: BLE001
                proc.kill()
        for d in devs:
            d.stop()
        pool.shutdown(wait=False, cancel_futures=True)
    return {"rounds": rounds, "t0": t0, "state": state, "log": log.read_text(errors="replace"), **figures}


def loop_in_thread(body: Callable[[threading.Event], None]) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    t = threading.Thread(target=body, args=(stop,), daemon=True)
    t.start()
    return stop, t


def selected_rounds(state: Path) -> list[tuple[float, list[str], str]]:
    """(opened_at, selected, status) of every attempt, in order."""
    return [(r[0], json.loads(r[1]), r[2]) for r in
            query(state, "SELECT opened_at, selected, status FROM rounds ORDER BY opened_at")]
