"""The attacks of the untrusted-devices issue, sent during a real run over Mosquitto against the coordinator
daemon as a user starts it (``fedge coordinator --config fleet.toml``): it finishes every round, exits 0,
and commits a model that is finite and as accurate as a clean run's."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.broker import Mosquitto, mosquitto_binary
from coordinator.faults import ATTACKS, HostileDevice, bad_checkins
from coordinator.simulate import SimConfig, prepare
from coordinator.store import Store
from edge.protocol import wire
from edge.protocol.agent import AgentConfig
from edge.runtime.data import load_npz, save_npz
from edge.runtime.device import device_from_files
from edge.runtime.mqtt import BrokerAddress

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow,
              pytest.mark.skipif(mosquitto_binary() is None and not os.environ.get("CI"),
                                 reason="mosquitto not installed")]

ROUNDS = 10


def _run(tmp_path, broker, *, hostile: bool) -> tuple[int, list[dict], dict, list[str], str]:
    work = tmp_path / ("attacked" if hostile else "clean")
    # IID shards: who is picked depends on timing, and with label-skewed shards that alone moved the last rounds'
    # accuracy by up to 0.06 (and the attacked run, whose d0007 never contributes, lost that device's labels). With
    # IID shards 4 pairs of runs agreed within 0.006, so a tight margin below can catch a model an attack degraded.
    cfg = SimConfig(devices=8, clients_per_round=4, over_selection=1.25, rounds=ROUNDS, epochs=5, hidden=(32,),
                    workdir=str(work), fleet="f" + ("h" if hostile else "c"), seed=1, partition="iid")
    specs, data = prepare(cfg)
    save_npz(work / "test.npz", data.x_test, data.y_test)
    state = work / "state.sqlite"
    conf = work / "fleet.toml"
    conf.write_text(f'[broker]\nurl = "{broker.url}"\n[state]\npath = "{state}"\n'
                    f"[rounds]\nrounds = {ROUNDS}\nclients_per_round = 4\nover_selection = 1.25\nseed = 1\n"
                    f'fleet = "{cfg.fleet}"\nround_timeout_s = 30\nselection_timeout_s = 2\n'
                    # keep the hostile device in the fleet so that it tries many attacks (quarantine has its own test)
                    "[quarantine]\nafter = 1000\n"
                    f'[strategy]\nname = "fedavg"\nsizes = [64, 32, 10]\nepochs = 5\nlr = 0.1\n[data]\ntest = "{work / "test.npz"}"\n')
    log = work / "coordinator.log"
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "coordinator", "--config", str(conf)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    pool = ThreadPoolExecutor(2)
    devs, sent = [], []
    stop = threading.Event()
    try:
        time.sleep(1.0)
        for s in specs:
            if hostile and s["id"] == "d0007":
                x, y = load_npz(s["data"])
                ac = AgentConfig(s["id"], fleet=cfg.fleet, capabilities=s["caps"])
                d = HostileDevice(ac, x, y, s["state"], BrokerAddress.parse(broker.url), executor=pool,
                                  attacks=["float64_1e300", "huge_sample_count", "float32_huge_norm", "rows_2_31",
                                           "kind_is_a_map", "nan", "wrong_shape", "negative_samples"])
            else:
                d = device_from_files(s["id"], s["data"], s["state"], broker.url, capabilities=s["caps"],
                                      fleet=cfg.fleet, executor=pool)
            devs.append(d.start())
        if hostile:  # and a stranger spraying the same families on device topics
            spray = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="sprayer")
            spray.connect("127.0.0.1", broker.port)
            spray.loop_start()

            def sprayer():
                rng = np.random.default_rng(0)
                payloads = [msgpack.packb({"v": 1, "k": {}}), msgpack.packb({"v": 1, "k": []}), b"\x00garbage",
                            *bad_checkins("x1")]
                while not stop.is_set():
                    for kind in ("report", "checkin", "status"):
                        who = ["x1", "d0003", "not/valid"][int(rng.integers(3))]
                        spray.publish(f"fedge/v1/{cfg.fleet}/{kind}/{who}", payloads[int(rng.integers(len(payloads)))],
                                      qos=1)
                    stop.wait(0.05)
            threading.Thread(target=sprayer, daemon=True).start()
        rc = proc.wait(180)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
        for d in devs:
            d.stop()
            if isinstance(d, HostileDevice):
                sent = d.sent
        pool.shutdown(wait=False, cancel_futures=True)
    st = Store(state)
    rows, weights, rej = st.summaries(), st.latest_state().weights, st.rejections()
    st.close()
    return rc, rows, weights, sent, log.read_text() + "\n" + "\n".join(map(str, rej))


def test_attacks_during_a_real_run_leave_the_coordinator_up_and_the_model_sound(tmp_path):
    with Mosquitto() as b:
        rc_clean, clean, _, _, _ = _run(tmp_path, b, hostile=False)
        rc, rows, weights, sent, text = _run(tmp_path, b, hostile=True)
    assert rc_clean == 0 and rc == 0, text[-3000:]
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert all(np.isfinite(w).all() for w in weights.values())
    assert len(sent) >= 3, f"the hostile device tried only {sent}"
    acc, acc_clean = np.mean([r["accuracy"] for r in rows[-3:]]), np.mean([r["accuracy"] for r in clean[-3:]])
    assert acc >= acc_clean - 0.02, (acc, acc_clean)
    assert all("d0007" not in r["accepted"] for r in rows if r["accepted"])  # nothing of it was admitted
