"""A device process: the agent core wired to MQTT, a program cache and a trainer on a worker thread."""
from __future__ import annotations

import dataclasses

import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..protocol.capabilities import EXTENSIONS
from ..protocol.agent import AgentConfig, DeviceAgent, Publish, StartTraining, StoreProgram
from ..algorithms.driver import run_plan
from .data import load_npz
from .mqtt import BrokerAddress, MqttLink
from .program import ProgramCache
from .state import LocalState
from ..trainers import make_trainer
from ..protocol import wire
from ..protocol.wire import Plan

log = logging.getLogger("fedge.device")


class Device:
    """Owns one :class:`DeviceAgent` and carries out its actions. Training runs on ``executor``."""

    def __init__(self, cfg: AgentConfig, x: np.ndarray, y: np.ndarray, state_dir: str | Path,
                 broker: BrokerAddress, *, executor: Executor | None = None, trainer_kw: dict | None = None):
        self.x, self.y = x, y
        # the protocol extensions this device's driver implements (capabilities.EXTENSIONS), unless set
        cfg = dataclasses.replace(cfg, capabilities={**EXTENSIONS, **cfg.capabilities})
        self.cache = ProgramCache(Path(state_dir) / "programs")
        self.local = LocalState(Path(state_dir) / "local")
        self.agent = DeviceAgent(cfg, n_samples=len(x), programs=self.cache.hashes())
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix=f"train-{cfg.device_id}")
        self.trainer_kw = trainer_kw or {}
        self._trainers: dict[str, Any] = {}  # program hash -> loaded trainer (never re-exported or reloaded)
        self._topics = set(self.agent.subscriptions())
        self.link = MqttLink(broker, f"dev-{cfg.device_id}", self, subscriptions=self.agent.subscriptions(),
                             will=self.agent.last_will(), clean_session=False)

    # ---- LinkHandler
    def on_connected(self, link, now):
        self._do(self.agent.connected(now))

    def on_disconnected(self, link, now):
        self._do(self.agent.disconnected(now))

    def on_message(self, link, topic, payload, now):
        if topic not in self._topics:  # amqtt delivers retained messages of other topics; not input for us
            log.debug("%s: broker delivered unsubscribed topic %s; ignored", self.agent.cfg.device_id, topic)
            return
        self._do(self.agent.received(topic, payload, now))

    def on_tick(self, link, now):
        self._do(self.agent.tick(now))

    # ---- actions
    def _do(self, actions) -> None:
        for a in actions:
            if isinstance(a, Publish):
                self.link.publish(a.topic, a.payload, a.qos, a.retain)
            elif isinstance(a, StoreProgram):
                self.cache.put(a.data)
            elif isinstance(a, StartTraining):
                self.executor.submit(self._train, a.plan)

    def _trainer_for(self, plan: Plan):
        t = self._trainers.get(plan.program_hash)
        if t is None:
            t = make_trainer(plan.runtime, **self.trainer_kw)
            t.load(self.cache.get(plan.program_hash))
            self._trainers = {plan.program_hash: t}  # keep one: a device holds one shape at a time
        return t

    def _train(self, plan: Plan) -> None:
        try:
            report = run_plan(plan, self._trainer_for(plan), self.x, self.y, self.local)
            err = ""
        except Exception as e:  # a failed plan must not kill the device
            log.exception("%s: plan %s failed", self.agent.cfg.device_id, plan.task_id)
            report, err = None, f"{type(e).__name__}: {e}"
        self.link.call_soon(lambda: self._do(self.agent.training_done(report, time.time(), err)))

    def warm_up(self) -> float:
        """Load this device's runtime now, before it checks in: see :func:`warm_up`. Returns the seconds it took."""
        return warm_up(self.agent.cfg.capabilities.get("runtime", "torch"), **self.trainer_kw)

    def start(self) -> "Device":
        self.link.start()
        return self

    def stop(self) -> None:
        self.link.stop()

    def kill(self) -> None:
        self.link.kill()


def warm_up(runtime: str, **trainer_kw) -> float:
    """Import the runtime's trainer backend and, for torch, run one step of a tiny model, so that the device's
    first plan does not pay it inside its round (torch's import and first step take 1-3 s on 2 cores: measured,
    they made a simulation's first round 10 times its median, issue #26). Once per process; a failure is left
    for the first plan to meet and report. Returns the seconds it took."""
    t0 = time.perf_counter()
    try:
        t = make_trainer(runtime, **trainer_kw)
        if runtime == "torch":
            from ..model import init_weights, mlp
            from .program import torch_program
            spec = mlp([4, 4, 2])
            t.load(torch_program(spec).data)
            t.set_weights(init_weights(spec, 0))
            t.step(np.zeros((2, 4), np.float32), np.zeros(2, np.int64), 0.0)
    except Exception as e:  # noqa: BLE001 - not fatal here: the first plan fails and says why
        log.debug("warming up the %s runtime failed: %s: %s", runtime, type(e).__name__, e)
    return time.perf_counter() - t0


def device_from_files(device_id: str, data: str, state_dir: str, broker: str, *, fleet: str = "default",
                      capabilities: dict | None = None, chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES, tls: dict | None = None,
                      **kw) -> Device:
    """``tls``: ca_file / cert_file / key_file for an ``mqtts://`` broker."""
    x, y = load_npz(data)
    caps = {"runtime": "torch", "memory_mb": 2048, "battery": 1.0, "charging": True, "network": "wifi", "idle": True}
    caps.update(capabilities or {})
    cfg = AgentConfig(device_id=device_id, fleet=fleet, capabilities=caps, chunk_bytes=chunk_bytes)
    return Device(cfg, x, y, state_dir, BrokerAddress.parse(broker, **(tls or {})), **kw)
