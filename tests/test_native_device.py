"""The native device (clients/native: C++ on the ExecuTorch runtime of the executorch wheel, libmosquitto,
msgpack-cxx; no Python, no torch) against the golden vectors, ``fedge conformance`` over Mosquitto (the numeric
step included), a copy of it that trains another function, and a mixed fleet with the real coordinator.

Built once per session by scripts/build_native.sh into build/native (the build is incremental across runs)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator import conformance as C
from coordinator.datasets import digits_sample
from coordinator.broker import Mosquitto, mosquitto_binary
from conftest import build_native

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "native"
VECTORS = ROOT / "firmware_tests" / "protocol"
# the line the wrong-function copy changes: the row weights that make the loss the batch mean
WRONG_FUNCTION = ("clients/native/src/algorithms.cpp", "1.0f / static_cast<float>(N)", "2.0f / static_cast<float>(N)")

pytestmark = [pytest.mark.slow]
_needs_broker = pytest.mark.skipif(mosquitto_binary() is None and not os.environ.get("CI"), reason="mosquitto not installed")


@pytest.fixture(scope="session")
def native(native_build) -> Path:
    return native_build


def test_native_device_reads_every_vector(native):
    r = subprocess.run([str(native / "vectors_test"), str(VECTORS)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    m = re.search(r"^(\d+) passed, (\d+) failed$", r.stdout, re.M)
    assert m and m.group(2) == "0", r.stdout[-2000:]
    # every vector file was read: each .json is one check at least
    assert int(m.group(1)) >= len(list(VECTORS.glob("*.json"))), r.stdout[-2000:]


def run_conformance(binary: Path, data: Path, state: Path, *, device: str = "nat-1") -> tuple[dict, list[str], str]:
    """``fedge conformance`` (every step, the numeric one included, with the program the driver exports) against
    the native device over a private Mosquitto; returns the verdicts, the driver's lines and the device's log."""
    lines: list[str] = []
    with Mosquitto() as b:
        o = C.Options(f"mqtt://127.0.0.1:{b.port}", device, "conf", timeout_s=60.0, resend_within_s=3.0,
                      quiet_s=0.6, pace_s=1.0, first_wait_s=30.0, data=str(data))
        verdicts, _peak, out = C.run_device([str(binary), "--id", device, "--data", str(data), "--state-dir",
                                             str(state), "--ack-timeout", "0.5", "--heartbeat", "30"], o, lines.append)
    return verdicts, lines, out


@_needs_broker
@pytest.mark.mosquitto
def test_native_device_passes_fedge_conformance(native, tmp_path):
    data = digits_sample(tmp_path / "data.npz")
    verdicts, lines, out = run_conformance(native / "fedge-native", data, tmp_path / "state")
    print("\n".join(lines), file=sys.stderr)
    assert verdicts == {k: "PASS" for k in C.STEPS}, "\n".join(lines) + "\n--- device:\n" + out[-4000:]


@_needs_broker
@pytest.mark.mosquitto
def test_a_native_copy_that_trains_another_function_fails_conformance(native, tmp_path):
    """A copy of the device whose loss is twice the batch mean (its row weights 2/N, not 1/N): every other step passes,
    the numeric one does not."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "clients", src / "clients")
    shutil.copytree(ROOT / "scripts", src / "scripts")
    path, old, new = WRONG_FUNCTION
    text = (src / path).read_text()
    assert old in text, f"{path} no longer has the line the wrong copy changes: update WRONG_FUNCTION"
    (src / path).write_text(text.replace(old, new))
    wrong = build_native(tmp_path / "build", src)
    data = digits_sample(tmp_path / "data.npz")
    verdicts, lines, out = run_conformance(wrong / "fedge-native", data, tmp_path / "state")
    print("\n".join(lines), file=sys.stderr)
    assert verdicts["train_maths"] == "FAIL", "\n".join(lines)
    assert verdicts["plan_report"] == "PASS", "\n".join(lines) + "\n--- device:\n" + out[-3000:]


@_needs_broker
@pytest.mark.mosquitto
def test_mixed_fleet_commits_every_round_with_native_reports(native, tmp_path):
    """FedSparse at its 'max' preset (q8r differences down from the model the device holds, sampled q8r updates
    up) over Mosquitto: 2 native and 2 Python devices, every device in every round. Every round commits with both
    native devices' reports, and the mixed fleet learns as an all-Python fleet of the same size and seed does."""
    from coordinator.simulate import SimConfig, simulate

    base = dict(strategy="fedsparse", devices=4, clients_per_round=4, over_selection=1.0, rounds=6, epochs=2,
                lr=0.1, hidden=(32,), seed=1, processes=1, round_timeout_s=300, strategy_kw={"preset": "max"},
                native_binary=str(native / "fedge-native"))
    reps = {}
    with Mosquitto() as broker:
        for name, runtimes in [("python", ("executorch",)), ("mixed", ("native", "executorch"))]:
            cfg = SimConfig(**base, runtimes=runtimes, broker=broker.url, workdir=str(tmp_path / name))
            reps[name] = simulate(cfg, progress=False)
    rows = reps["mixed"]["rounds"]
    logs = "".join((p.read_text()[-2000:] for p in (tmp_path / "mixed").glob("devices/*/native.log")))
    assert [r["reports"] for r in rows] == [4] * 6, (rows, logs)
    assert [r["native_reports"] for r in rows] == [2] * 6, (rows, logs)
    # both learn (10 classes: chance is 0.1); one seed of six early FedSparse rounds varies by about 0.1 between
    # seeds (benchmarks/native_device.py measures the fleets against each other over seeds), so this bound only
    # catches a native device whose updates are wrong, not a small difference
    acc_py, acc_mixed = reps["python"]["final_accuracy"], reps["mixed"]["final_accuracy"]
    assert acc_py > 0.3 and acc_mixed > 0.3, (acc_mixed, acc_py)
    assert acc_mixed > rows[0]["accuracy"], rows
    assert abs(acc_mixed - acc_py) <= 0.25, (acc_mixed, acc_py)


@pytest.mark.parametrize("url, says", [("mqtt//host:1883", "a broker address has no path"),
                                       ("mqtt://:1883", "no host in broker address"),
                                       ("mqtt://host:1883/fleet", "a broker address has no path"),
                                       ("mqtt://host:", "bad port"), ("mqtt://host:0", "bad port")])
def test_native_device_refuses_the_broker_urls_the_python_one_refuses(native_build, tmp_path, url, says):
    """As edge/runtime/mqtt.py: BrokerAddress.parse (issue #30): one line and status 2, not a broker retried for ever."""
    from edge.runtime.mqtt import BrokerAddress
    with pytest.raises(ValueError, match=says):
        BrokerAddress.parse(url)
    r = subprocess.run([str(native_build / "fedge-native"), "--broker", url, "--id", "d1", "--data",
                        str(tmp_path / "none.npz")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
