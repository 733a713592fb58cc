"""Over a real broker (a private Mosquitto): whole runs, a device dying mid-round, a coordinator killed with
SIGKILL and restarted, and equivalence with an in-process FedAvg loop."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from coordinator.broker import Mosquitto, mosquitto_binary
from coordinator.datasets import digits_federated
from coordinator.selection import device_seed, select
from coordinator.simulate import SimConfig, build_coordinator, prepare, simulate
from coordinator.store import Store
from edge.protocol import wire
from edge.runtime.device import device_from_files
from edge.model import init_weights, mlp
from edge.runtime.program import torch_program
from edge.trainers import make_trainer

from conftest import reference_sgd  # noqa: E402

pytestmark = [pytest.mark.mosquitto,
              pytest.mark.skipif(mosquitto_binary() is None and not os.environ.get("CI"),
                                 reason="mosquitto not installed")]


@pytest.fixture
def broker():
    with Mosquitto() as b:
        yield b


def wait_until(cond, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_ten_devices_five_rounds(tmp_path, broker):
    cfg = SimConfig(devices=10, clients_per_round=5, rounds=5, epochs=2, hidden=(32,), broker=broker.url,
                    processes=2, workdir=str(tmp_path / "w"))
    rep = simulate(cfg, out=str(tmp_path / "run.json"), progress=False)
    assert [r["round"] for r in rep["rounds"]] == [1, 2, 3, 4, 5]
    assert all(r["reports"] == 5 and r["bytes_down"] > 0 and r["bytes_up"] > 0 for r in rep["rounds"])
    assert rep["rounds"][-1]["accuracy"] > rep["rounds"][0]["accuracy"]
    assert rep["total_bytes"] == sum(r["bytes_down"] + r["bytes_up"] for r in rep["rounds"])
    assert (tmp_path / "run.json").exists()


class Fleet:
    """Device agents in this process, each with its own MQTT client; records every ack they get."""

    def __init__(self, specs, url):
        self.pool = ThreadPoolExecutor(2)
        self.acks: list[wire.Ack] = []
        self.devs = {}
        for s in specs:
            d = device_from_files(s["id"], s["data"], s["state"], url, capabilities=s["caps"], executor=self.pool,
                                  fleet=s["fleet"])
            orig = d.on_message

            def spy(link, topic, payload, now, orig=orig):
                if "/ack/" in topic:
                    self.acks.append(wire.decode(payload))
                orig(link, topic, payload, now)
            d.on_message = spy
            self.devs[s["id"]] = d.start()

    def stop(self):
        for d in self.devs.values():
            d.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.slow
def test_device_killed_mid_round_round_commits_through_over_selection(tmp_path, broker):
    cfg = SimConfig(devices=8, clients_per_round=4, over_selection=1.5, rounds=2, hidden=(16,), broker=broker.url,
                    workdir=str(tmp_path / "w"), round_timeout_s=60)
    specs, data = prepare(cfg)
    victim_gate = threading.Event()
    rows = []
    coord = build_coordinator(cfg, broker.url, (data.x_test, data.y_test), rows.append).start()
    assert coord.link.connected.wait(10)
    fleet = Fleet(specs, broker.url)
    try:
        # Hold every device's training until we have killed one selected device.
        for d in fleet.devs.values():
            orig = d._train
            d._train = lambda plan, orig=orig: (victim_gate.wait(30), orig(plan))
        wait_until(lambda: coord.machine.open is not None, 20, "round 1 to open")
        victim = coord.machine.open.selected[0]
        fleet.devs[victim].kill()  # socket dropped: the broker publishes its last will
        wait_until(lambda: victim in coord.machine.open.finished, 20, "the last will to reach the coordinator")
        victim_gate.set()
        assert coord.wait(60) and coord.error is None
    finally:
        fleet.stop()
        coord.stop()
    assert rows[0]["reports"] == 4 and victim not in rows[0]["accepted"]
    assert len(rows) == 2


def _coordinator_proc(conf: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", "-v", "coordinator", "--config", str(conf)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.parametrize("mqtt_client", ["default", "paho"])
def test_coordinator_sigkill_and_restart_loses_no_accepted_report(tmp_path, broker, mqtt_client, monkeypatch):
    """On either MQTT client (libmosquitto, where installed, acknowledges a message before its handler runs; paho
    after): a report is lost only if the coordinator never acked it, and then its device sends it again."""
    if mqtt_client == "paho":
        monkeypatch.setenv("FEDGE_MQTT_CLIENT", "paho")  # the coordinator's child process and the devices inherit it
    cfg = SimConfig(devices=6, clients_per_round=6, over_selection=1.0, rounds=4, hidden=(16,), broker=broker.url,
                    workdir=str(tmp_path / "w"))
    specs, data = prepare(cfg)
    state = tmp_path / "state.sqlite"
    conf = tmp_path / "fleet.toml"
    conf.write_text(f'[broker]\nurl = "{broker.url}"\n[state]\npath = "{state}"\n'
                    f"[rounds]\nrounds = 4\nclients_per_round = 6\nover_selection = 1.0\nround_timeout_s = 120\n"
                    f"selection_timeout_s = 2\n[strategy]\nname = \"fedavg\"\nsizes = [64, 16, 10]\n")
    log = tmp_path / "coord.log"
    proc = _coordinator_proc(conf, log)
    fleet = None
    try:
        time.sleep(1.5)
        fleet = Fleet(specs, broker.url)
        # One device is slow in round 2, so the round is open with 5 accepted reports when we kill.
        slow = fleet.devs["d0003"]
        orig = slow._train
        release = threading.Event()
        slow._train = lambda plan: (release.wait(60) if plan.round == 2 else None, orig(plan))
        r2 = lambda t: t.endswith("-r2a1")  # noqa: E731 (task ids carry the run id)
        wait_until(lambda: sum(1 for a in fleet.acks if r2(a.task_id) and a.status == "accepted") == 5, 60,
                   "five accepted reports in round 2")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        release.set()  # its report now waits at the broker in the coordinator's persistent session
        time.sleep(0.5)
        proc = _coordinator_proc(conf, log)
        wait_until(lambda: proc.poll() is not None, 90, "the restarted coordinator to finish")
        assert proc.returncode == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        if fleet:
            fleet.stop()
    store = Store(state)
    rounds = store.summaries()
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    by_task = {r["task_id"]: set(r["accepted"]) for r in rounds}
    accepted = [(a.task_id, a.device_id) for a in fleet.acks if a.status == "accepted"]
    assert any(r2(t) and d == "d0003" for t, d in accepted)
    lost = [(t, d) for t, d in accepted if d not in by_task.get(t, set())]
    assert lost == []
    assert "resuming from committed round 1" in log.read_text()


@pytest.mark.slow
def test_mqtt_fedavg_equals_in_process_reference(tmp_path, broker):
    cfg = SimConfig(devices=5, clients_per_round=5, over_selection=1.0, rounds=3, epochs=2, lr=0.1, hidden=(24,),
                    broker=broker.url, workdir=str(tmp_path / "w"), seed=7)
    rep = simulate(cfg, progress=False)
    got = rep["_state"].weights

    # The reference: FedAvg written out, on the same shards, seeds and initial weights.
    spec = mlp([64, 24, 10])
    data = digits_federated(5, cfg.alpha, cfg.seed)
    ids = [f"d{i:04d}" for i in range(5)]
    w = init_weights(spec, cfg.seed)
    t = make_trainer("torch")
    t.load(torch_program(spec).data)
    for rnd in range(1, 4):
        chosen = select(ids, 5, cfg.seed, rnd, 1)
        sums = {k: np.zeros(v.shape) for k, v in w.items()}
        total = 0
        for d in chosen:
            x, y = data.shards[ids.index(d)]
            t.set_weights(w)
            reference_sgd(t, x, y, epochs=2, batch_size=20, lr=0.1, seed=device_seed(cfg.seed, rnd, d))
            for k, v in t.get_weights().items():
                sums[k] += len(x) * v.astype(np.float64)
            total += len(x)
        w = {k: (s / total).astype(np.float32) for k, s in sums.items()}
    diff = max(float(np.abs(got[k] - w[k]).max()) for k in w)
    assert diff <= 1e-6, diff
    assert max(float(np.abs(w[k] - init_weights(spec, cfg.seed)[k]).max()) for k in w) > 1e-3


@pytest.mark.slow
def test_broker_restart_mid_run_everyone_reconnects_and_training_finishes(tmp_path):
    """The broker dies after round 1 and comes back on the same port: devices and the coordinator reconnect
    (exponential backoff with jitter), devices check in again, and the run completes."""
    cfg = SimConfig(devices=6, clients_per_round=4, over_selection=1.5, rounds=4, hidden=(16,),
                    workdir=str(tmp_path / "w"), round_timeout_s=6, selection_timeout_s=1)
    b = Mosquitto()
    port = b.port
    specs, data = prepare(cfg)
    rows = []
    coord = build_coordinator(cfg, b.url, (data.x_test, data.y_test), rows.append).start()
    fleet = None
    try:
        assert coord.link.connected.wait(10)
        fleet = Fleet(specs, b.url)
        wait_until(lambda: len(rows) >= 1, 30, "round 1")
        b.stop()
        wait_until(lambda: not coord.link.connected.is_set(), 10, "the coordinator to notice")
        time.sleep(1.0)
        b = Mosquitto(port)
        assert coord.wait(90), f"run did not finish; rounds: {[r['round'] for r in rows]}"
        assert coord.error is None
    finally:
        if fleet:
            fleet.stop()
        coord.stop()
        b.stop()
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
