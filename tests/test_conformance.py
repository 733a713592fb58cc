"""``fedge conformance`` against the Python device over a private Mosquitto: the device passes every step, and a
device that ignores acks, sends the wrong dtype, trains another function or ignores deadlines fails the step that
names it (docs/protocol.md section 13)."""
from __future__ import annotations

import dataclasses
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from coordinator import conformance as C
from coordinator.broker import Mosquitto, mosquitto_binary
from edge.algorithms import driver as algo_driver
from edge.protocol.agent import AgentConfig
from edge.runtime.device import Device
from edge.runtime.mqtt import BrokerAddress

pytestmark = [pytest.mark.mosquitto,
              pytest.mark.skipif(mosquitto_binary() is None and not os.environ.get("CI"),
                                 reason="mosquitto not installed")]

FAST = dict(timeout_s=10.0, resend_within_s=3.0, quiet_s=0.6, pace_s=1.0)


@pytest.fixture(scope="module")
def broker():
    b = Mosquitto()
    yield b
    b.stop()


@pytest.fixture(scope="module", autouse=True)
def _torch_loaded():
    import edge.trainers.torch_backend  # noqa: F401 - imported once here, not inside the first step's timeout


def device_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def start_device(broker, tmp_path, device_id: str, port: int | None = None, runtime: str = "torch") -> Device:
    x, y = device_data()
    cfg = AgentConfig(device_id, fleet="conf", capabilities={"runtime": runtime, "charging": True},
                      ack_timeout_s=0.5, heartbeat_s=30.0)
    d = Device(cfg, x, y, tmp_path / device_id, BrokerAddress.parse(f"mqtt://127.0.0.1:{port or broker.port}"),
               executor=ThreadPoolExecutor(1))
    d.start()
    assert d.link.connected.wait(10)
    return d


def run(broker, device_id: str, proxy=None, **kw) -> tuple[dict[str, str], list[str]]:
    """The driver against one device, given the device's data (``data=None``: without)."""
    lines: list[str] = []
    o = C.Options(f"mqtt://127.0.0.1:{broker.port}", device_id, "conf", **(FAST | {"data": device_data()} | kw))
    return C.run(o, lines.append, proxy), lines


@pytest.mark.slow
def test_python_device_passes_every_step(broker, tmp_path):
    proxy = C.Proxy("127.0.0.1:0", BrokerAddress.parse(f"mqtt://127.0.0.1:{broker.port}"))
    d = start_device(broker, tmp_path, "py-1", proxy.address[1])
    try:
        verdicts, lines = run(broker, "py-1", proxy)
    finally:
        d.stop()
        proxy.close()
    print("\n".join(lines))
    assert verdicts == {k: "PASS" for k in C.STEPS}, "\n".join(lines)
    assert any(line.startswith("PASS train_maths: 3 full-batch steps at lr 0.3 on n = 60") for line in lines)


@pytest.mark.parametrize("runtime", ["ort", pytest.param("executorch", marks=pytest.mark.slow)])  # ET: ~30 s
def test_driver_exports_the_program_and_judges_the_maths(broker, tmp_path, runtime):
    """No --program: the driver exports the MLP for the device's runtime itself, and the device's training
    equals the driver's float64 reference as the torch device's does."""
    from edge.trainers import available_runtimes
    if runtime not in available_runtimes():
        pytest.skip(f"{runtime} is not installed")
    from edge.runtime.data import save_npz
    save_npz(tmp_path / "data.npz", *device_data())
    d = start_device(broker, tmp_path, f"py-x{runtime}", runtime=runtime)
    try:  # the data as --data gives them: the device's .npz
        verdicts, lines = run(broker, f"py-x{runtime}", only=("plan_report", "train_maths"), timeout_s=30.0,
                              data=tmp_path / "data.npz")
    finally:
        d.stop()
    assert verdicts == {"checkin": "PASS", "plan_report": "PASS", "train_maths": "PASS"}, "\n".join(lines)
    assert lines[0].startswith(f"exporting the {runtime} program for the MLP 4-8-2"), lines


def _scaled_lr(factor):
    """A FedAvg client whose SGD step is ``factor`` times the plan's lr (factor = rows: a sum, not a mean)."""
    from edge.algorithms.fedavg import FedAvgClient

    def step(self, idx):
        f = len(idx) if factor == "rows" else factor
        return self.ctx.trainer.step(self.ctx.x[idx], self.ctx.y[idx], self.hp.lr * f)
    return FedAvgClient, "step", step


@pytest.mark.parametrize("wrong", ["lr x 1.05", "sum over rows", "tanh"])
def test_a_device_that_trains_another_function_fails_train_maths(broker, tmp_path, monkeypatch, wrong):
    import torch

    from edge.trainers.torch_objectives import nets
    if wrong == "tanh":  # the device's MLP (the driver's reference does not use torch)
        monkeypatch.setattr(nets.torch, "relu", torch.tanh)
    else:
        monkeypatch.setattr(*_scaled_lr(1.05 if wrong.startswith("lr") else "rows"))
    dev = f"py-{wrong.split()[0]}"
    d = start_device(broker, tmp_path, dev)
    try:
        verdicts, lines = run(broker, dev, only=("train_maths",))
    finally:
        d.stop()
    assert verdicts == {"checkin": "PASS", "train_maths": "FAIL"}, "\n".join(lines)
    fail = next(line for line in lines if line.startswith("FAIL train_maths"))
    assert "the float32 tolerance" in fail and "as far as the reference" in fail, fail
    if wrong.startswith("lr"):  # the detail measures how far off: about 1.05x as far (3 steps: not exactly)
        assert 1.02 < float(re.search(r"the device moved ([0-9.]+)x as far", fail).group(1)) < 1.08, fail


def test_train_maths_needs_the_data_and_a_plan_that_does_not_fit_is_explained(broker, tmp_path):
    d = start_device(broker, tmp_path, "py-nodata")
    try:
        verdicts, lines = run(broker, "py-nodata", only=("train_maths",), data=None)
        assert verdicts == {"checkin": "PASS", "train_maths": "FAIL"}, "\n".join(lines)
        assert any(line.startswith("FAIL train_maths: needs --data FILE") for line in lines), lines
        verdicts, lines = run(broker, "py-nodata", only=("plan_report",), data=None, sizes=(5, 8, 2), timeout_s=2.0)
    finally:
        d.stop()
    assert verdicts == {"checkin": "PASS", "plan_report": "FAIL"}, "\n".join(lines)
    fail = next(line for line in lines if line.startswith("FAIL plan_report"))
    assert "checked in naming the task" in fail and "the MLP 5-8-2 does not fit its data" in fail, fail


def test_a_device_that_ignores_deadlines_fails_refuse_bad_plans(broker, tmp_path):
    d = start_device(broker, tmp_path, "py-late")
    on_plan = d.agent._on_plan  # the handler TRANSITIONS names: every plan is in time
    d.agent._on_plan = lambda plan, now: on_plan(dataclasses.replace(plan, deadline=max(plan.deadline, now + 60)), now)
    try:
        verdicts, lines = run(broker, "py-late", only=("refuse_bad_plans", "refuse_unknown_hparam"))
    finally:
        d.stop()
    want = {"checkin": "PASS", "refuse_bad_plans": "FAIL", "refuse_unknown_hparam": "PASS"}  # acked: still usable
    assert verdicts == want, "\n".join(lines)
    assert any(line.startswith("FAIL refuse_bad_plans: the plan whose deadline had passed") for line in lines), lines


@pytest.mark.slow
def test_a_device_that_ignores_acks_fails_the_ack_step(broker, tmp_path):
    d = start_device(broker, tmp_path, "py-noack")
    d.agent._on_ack = lambda ack, now: []  # the handler TRANSITIONS names: acks are dropped, resends go on
    try:
        verdicts, lines = run(broker, "py-noack", only=("plan_report", "resend", "ack"), timeout_s=3.0)
    finally:
        d.stop()
    assert verdicts == {"checkin": "PASS", "plan_report": "PASS", "resend": "PASS", "ack": "FAIL"}, "\n".join(lines)
    assert any(line.startswith("FAIL ack: no check-in naming") for line in lines)


def test_a_device_that_sends_the_wrong_dtype_fails_the_f2_step(broker, tmp_path, monkeypatch):
    monkeypatch.setitem(algo_driver._PLAIN, "f2", np.float32)  # asked for float16, sends float32
    d = start_device(broker, tmp_path, "py-f4")
    try:
        verdicts, lines = run(broker, "py-f4", only=("plan_report", "f2_delta"))
    finally:
        d.stop()
    assert verdicts == {"checkin": "PASS", "plan_report": "PASS", "f2_delta": "FAIL"}, "\n".join(lines)
    assert any("the plan asked for f2" in line for line in lines), "\n".join(lines)


def test_cli_lists_the_steps(capsys):
    from coordinator.cli import main
    assert main(["conformance", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(k in out for k in C.STEPS)
    assert main(["conformance", "--device", "x", "--only", "nope"]) == 2


def test_cli_sizes_that_do_not_fit_the_data_are_one_line(tmp_path, capsys):
    from coordinator.cli import main
    from edge.runtime.data import save_npz
    save_npz(tmp_path / "d.npz", *device_data())
    for sizes, why in (("5,8,2", "takes 5 features"), ("4,8,1", "has 1 classes"), ("4,x", "give input features")):
        assert main(["conformance", "--device", "x", "--data", str(tmp_path / "d.npz"), "--sizes", sizes]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err, err
    assert main(["conformance", "--device", "x", "--data", str(tmp_path / "none.npz")]) == 2
    assert "--data" in capsys.readouterr().err


@pytest.mark.parametrize("runtime", ["ort", pytest.param("executorch", marks=pytest.mark.slow)])  # ET: ~27 s
def test_driver_serves_an_exported_program(broker, tmp_path, runtime):
    """--program: the driver plans with a shipped golden program (MLP 64-200-200-10) for a device of another runtime."""
    from edge.trainers import available_runtimes
    from firmware_tests import GOLDEN, PROGRAM_SUFFIX
    if runtime not in available_runtimes():
        pytest.skip(f"{runtime} is not installed")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 64)).astype(np.float32)
    y = rng.integers(0, 10, 40).astype(np.int64)
    cfg = AgentConfig(f"py-{runtime}", fleet="conf", capabilities={"runtime": runtime}, ack_timeout_s=0.5)
    d = Device(cfg, x, y, tmp_path / runtime, BrokerAddress.parse(f"mqtt://127.0.0.1:{broker.port}"),
               executor=ThreadPoolExecutor(1))
    d.start()
    try:
        verdicts, lines = run(broker, f"py-{runtime}", only=("plan_report", "f2_delta"), sizes=(64, 200, 200, 10),
                              data=(x, y), program=(GOLDEN / f"mlp.{PROGRAM_SUFFIX[runtime]}").read_bytes(),
                              timeout_s=30.0)
    finally:
        d.stop()
    assert verdicts == {"checkin": "PASS", "plan_report": "PASS", "f2_delta": "PASS"}, "\n".join(lines)
