"""A person's mistakes, on every subcommand: each is exactly one line on stderr that names what is wrong, exit
status 2, no traceback (issue 29). Each runs ``fedge`` as a person does, in its own process.

The table covers a wrong flag, a bad value, a missing file, a file that is not TOML, an .npz without ``y``, and
an unknown key in every table of every configuration file (``fleet.toml``'s twelve tables and ``device.toml``'s
two), each refused with a "did you mean".
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def fedge(*argv: str, cwd: Path, exe: str = "fedge", timeout: float = 90) -> subprocess.CompletedProcess:
    cmd = [str(BIN / exe)] if (BIN / exe).exists() else [sys.executable, "-m",
                                                          "edge.cli" if exe == "fedge-device" else "coordinator.cli"]
    return subprocess.run([*cmd, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mistakes")
    rng = np.random.default_rng(0)
    np.savez(d / "good.npz", x=rng.normal(size=(40, 64)).astype(np.float32), y=rng.integers(0, 10, 40))
    np.savez(d / "noy.npz", x=rng.normal(size=(40, 64)).astype(np.float32))
    (d / "notnpz.npz").write_text("x,y\n1,2\n")
    (d / "bad.toml").write_text("[rounds]\nrounds = \n")
    (d / "notes.txt").write_text("not a state file")
    (d / "m.py").write_text("def make():\n    raise RuntimeError('no model here')\n")
    return d


def toml(d: Path, name: str, text: str) -> str:
    (d / name).write_text(text)
    return name


# (id, argv, what the one line must name). Paths are relative to the fixture directory.
MISTAKES = [
    # broker
    ("broker-port-not-a-number", ["broker", "--port", "eighteen"], "--port"),
    ("broker-port-out-of-range", ["broker", "--port", "99999"], "--port"),
    ("broker-unknown-flag", ["broker", "--prot", "1884"], "did you mean --port"),
    # coordinator
    ("coordinator-missing-config", ["coordinator", "--config", "nope.toml"], "nope.toml: no such file"),
    ("coordinator-not-toml", ["coordinator", "--config", "bad.toml"], "not valid TOML"),
    ("coordinator-unknown-section", ["coordinator", "--config", "@[round]\nrounds = 3\n"], "did you mean 'rounds'"),
    ("coordinator-wrong-type", ["coordinator", "--config", '@[rounds]\nclients_per_round = "ten"\n'],
     "[rounds] clients_per_round"),
    ("coordinator-test-missing", ["coordinator", "--config", '@[data]\ntest = "gone.npz"\n'], "gone.npz"),
    ("coordinator-test-without-y", ["coordinator", "--config", '@[data]\ntest = "noy.npz"\n'], "x and y"),
    ("coordinator-strategy-typo", ["coordinator", "--config", '@[strategy]\nname = "fedavgg"\n'],
     "did you mean 'fedavg'"),
    ("coordinator-metrics-port", ["coordinator", "--metrics-port", "70000"], "--metrics-port"),
    ("coordinator-broker-scheme", ["coordinator", "--broker", "http://127.0.0.1:1883"], "--broker"),
    ("coordinator-verbose-typo", ["coordinator", "--verbsoe"], "did you mean --verbose"),
    # ingest
    ("ingest-not-shared", ["ingest"], "[ingest] shared"),
    # device
    ("device-no-id", ["device", "--data", "good.npz"], "--id"),
    ("device-data-missing", ["device", "--id", "pi-1", "--data", "gone.npz"], "gone.npz"),
    ("device-data-without-y", ["device", "--id", "pi-1", "--data", "noy.npz"], "noy.npz"),
    ("device-data-not-npz", ["device", "--id", "pi-1", "--data", "notnpz.npz"], "notnpz.npz"),
    ("device-bad-id", ["device", "--id", "pi 1", "--data", "good.npz"], "device id"),
    ("device-runtime-choice", ["device", "--runtime", "tflite"], "tflite"),
    ("device-chunk-too-small", ["device", "--id", "pi-1", "--data", "good.npz", "--chunk-kb", "1"], "--chunk-kb 1"),
    ("device-chunk-kb-in-file", ["device", "--data", "good.npz", "--config", '@[device]\nid = "pi-1"\nchunk_kb = 2\n'],
     "chunk_kb = 2"),
    ("device-unknown-section", ["device", "--config", '@[devices]\nid = "pi-1"\n'], "did you mean 'device'"),
    ("device-broker-scheme", ["device", "--id", "pi-1", "--data", "good.npz", "--broker", "http://x:1883"],
     "broker"),
    # simulate
    ("simulate-strategy-typo", ["simulate", "--strategy", "fedavgg"], "did you mean 'fedavg'"),
    ("simulate-flag-typo", ["simulate", "--epohcs", "3"], "did you mean --epochs"),
    ("simulate-rounds-zero", ["simulate", "--rounds", "0"], "--rounds"),
    ("simulate-lr-not-a-number", ["simulate", "--lr", "fast"], "--lr"),
    ("simulate-data-missing", ["simulate", "--data", "gone.npz"], "gone.npz"),
    ("simulate-data-without-y", ["simulate", "--data", "noy.npz"], "noy.npz"),
    ("simulate-partition", ["simulate", "--partition", "dirichlet:-1"], "--partition"),
    ("simulate-broker-scheme", ["simulate", "--broker", "http://127.0.0.1:1883"], "--broker"),
    ("simulate-option-typo", ["simulate", "-S", "lrr=0.1"], "did you mean 'lr'"),
    ("simulate-model-file-missing", ["simulate", "--model", "gone.py:make"], "gone.py"),
    ("simulate-clients-above-devices", ["simulate", "--devices", "3", "--clients-per-round", "5"],
     "--clients-per-round"),
    ("simulate-mode-choice", ["simulate", "--mode", "fast"], "--mode"),
    # export
    ("export-data-without-y", ["export", "--model", "m.py:make", "--data", "noy.npz"], "noy.npz"),
    ("export-data-missing", ["export", "--model", "m.py:make", "--data", "gone.npz"], "gone.npz"),
    ("export-input-not-sizes", ["export", "--model", "m.py:make", "--input", "1,x,8"], "--input"),
    ("export-runtime-choice", ["export", "--runtime", "tflite"], "tflite"),
    ("export-model-raises", ["export", "--model", "m.py:make", "--input", "64"], "no model here"),
    # conformance
    ("conformance-no-device", ["conformance"], "--device"),
    ("conformance-data-missing", ["conformance", "--device", "d1", "--data", "gone.npz"], "gone.npz"),
    ("conformance-unknown-step", ["conformance", "--device", "d1", "--only", "chekin"], "chekin"),
    # fleetsim
    ("fleetsim-devices-zero", ["fleetsim", "--devices", "0"], "--devices"),
    ("fleetsim-trace-missing", ["fleetsim", "--trace", "gone.json"], "gone.json"),
    ("fleetsim-broker-scheme", ["fleetsim", "--broker", "http://127.0.0.1:1883", "--devices", "1"], "broker"),
    # status and devices
    ("status-state-missing", ["status", "--state", "gone.sqlite"], "gone.sqlite"),
    ("status-state-not-sqlite", ["status", "--state", "notes.txt"], "notes.txt"),
    ("status-both", ["status", "--state", "x.sqlite", "--url", "http://127.0.0.1:1"], "not both"),
    ("status-url-nothing-there", ["status", "--url", "http://127.0.0.1:{closed}"], "127.0.0.1"),
    ("devices-state-missing", ["devices", "--state", "gone.sqlite"], "gone.sqlite"),
    # credentials
    ("credentials-no-devices", ["credentials"], "--devices"),
    ("credentials-bad-id", ["credentials", "--devices", "pi 1,phone-2", "--out", "auth"], "pi 1"),
    ("credentials-out-is-a-file", ["credentials", "--devices", "pi-1", "--out", "notes.txt"], "notes.txt"),
    # the top level
    ("subcommand-typo", ["simulat"], "did you mean 'simulate'"),
]


def _prepare(argv: list[str], d: Path, case: str) -> list[str]:
    out = []
    for a in argv:
        if a.startswith("@"):  # an inline config file
            a = toml(d, f"{case}.toml", a[1:])
        out.append(a.replace("{closed}", str(closed_port())))
    return out


def assert_one_line(p: subprocess.CompletedProcess, says: str, what: str) -> None:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, f"{what}: exit {p.returncode}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, f"{what}:\n{p.stderr[-3000:]}"
    assert len(lines) == 1, f"{what}: {len(lines)} lines on stderr:\n{p.stderr[-3000:]}"
    assert says.lower() in lines[0].lower(), f"{what}: {lines[0]!r} does not say {says!r}"
    assert lines[0].startswith(("fedge", "fedge-device")), lines[0]


def test_the_table_is_long_and_covers_every_subcommand():
    assert len(MISTAKES) >= 20
    assert len({c for c, *_ in MISTAKES}) == len(MISTAKES)
    covered = {argv[0] for _, argv, _ in MISTAKES}
    assert {"broker", "coordinator", "device", "simulate", "export", "conformance", "fleetsim", "status",
            "credentials"} <= covered


@pytest.mark.parametrize("case,argv,says", MISTAKES, ids=[c for c, *_ in MISTAKES])
def test_a_mistake_is_one_line(files, case, argv, says):
    p = fedge(*_prepare(argv, files, case), cwd=files)
    assert_one_line(p, says, " ".join(argv))


# ---- an unknown key in every table of every config file is refused with a "did you mean"

def _fleet_tables() -> dict[str, str]:
    """fleet.toml's tables -> a real key of each (the typo drops its last letter)."""
    from coordinator import config as C
    from coordinator.admission import AdmissionRules
    from coordinator.registry import Eligibility, Pacing, Quarantine
    from coordinator.rounds import RoundConfig
    classes = {"broker": C.BrokerSection, "state": C.StateSection, "rounds": RoundConfig, "eligibility": Eligibility,
               "admission": AdmissionRules, "quarantine": Quarantine, "pace": Pacing, "model": C.ModelSection,
               "data": C.DataSection, "metrics": C.MetricsSection, "ingest": C.IngestSection}
    assert set(classes) | {"strategy"} == set(C.SECTIONS), "a new table: add it here"
    out = {name: next(f.name for f in dataclasses.fields(cls) if f.init and len(f.name) > 3)
           for name, cls in classes.items()}
    out["strategy"] = "epochs"
    return out


FLEET_TABLES = _fleet_tables()


@pytest.mark.parametrize("table", sorted(FLEET_TABLES))
def test_an_unknown_key_in_every_fleet_table(files, table):
    key = FLEET_TABLES[table]
    name = toml(files, f"typo-{table}.toml", f"[{table}]\n{key[:-1]} = 1\n")
    p = fedge("coordinator", "--config", name, cwd=files)
    assert_one_line(p, f"did you mean '{key}'", f"[{table}] {key[:-1]}")
    assert f"[{table}]" in p.stderr


@pytest.mark.parametrize("table,key", [("device", "broker"), ("capabilities", "network")])
def test_an_unknown_key_in_every_device_table(files, table, key):
    device = {"id": '"pi-1"', "data": '"good.npz"'} | ({key[:-1]: '"x"'} if table == "device" else {})
    text = "[device]\n" + "".join(f"{k} = {v}\n" for k, v in device.items())
    name = toml(files, f"dtypo-{table}.toml", text + (f'[{table}]\n{key[:-1]} = "x"\n' if table != "device" else ""))
    p = fedge("--config", name, cwd=files, exe="fedge-device")
    assert_one_line(p, f"did you mean '{key}'", f"[{table}] {key[:-1]}")
    assert f"[{table}]" in p.stderr


def test_a_device_mistake_is_one_line_as_fedge_device_too(files):
    p = fedge("--id", "pi-1", "--data", "noy.npz", cwd=files, exe="fedge-device")
    assert_one_line(p, "noy.npz", "fedge-device --data noy.npz")


def test_simulate_against_a_broker_that_is_not_there(files):
    """Nothing listens at the --broker address: one line, at once (not a traceback after 31 s)."""
    import time
    t0 = time.monotonic()
    p = fedge("simulate", "--broker", f"mqtt://127.0.0.1:{closed_port()}", "--devices", "2", "--clients-per-round",
              "1", "--rounds", "1", "--no-progress", "--processes", "1", "--workdir", "w", cwd=files)
    assert_one_line(p, "127.0.0.1", "simulate --broker <nothing there>")
    assert time.monotonic() - t0 < 30


def test_export_without_its_toolchain_is_one_line(files, tmp_path):
    """`make demo`'s venv has no ONNX (nor ExecuTorch): `fedge export` says what to install, in one line."""
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'onnx'\", name='onnx')\n")
    exe = BIN / "fedge"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "coordinator.cli"]
    p = subprocess.run([*cmd, "export", "--model", "mlp", "--runtime", "ort", "--cache", str(tmp_path / "c")],
                       cwd=files, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"))
    assert_one_line(p, "make install", "export without onnx")
    p = subprocess.run([*cmd, "simulate", "--runtimes", "torch,ort", "--workdir", "w"], cwd=files, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"))
    assert_one_line(p, "make install", "simulate --runtimes ort without onnx")
