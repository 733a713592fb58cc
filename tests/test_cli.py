"""The `fedge` command as a user runs it: `fedge simulate` on the embedded broker writes the run report."""
from __future__ import annotations

import json

import pytest

from coordinator.cli import main

KEYS = {"strategy", "runtime", "devices", "clients_per_round", "rounds", "final_accuracy", "total_bytes", "wall_s"}
ROUND_KEYS = {"round", "accuracy", "loss", "bytes_down", "bytes_up", "reports", "dropped", "wall_s"}


@pytest.mark.slow
def test_simulate_on_the_embedded_broker_writes_report_and_plot(tmp_path, capsys):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    rc = main(["simulate", "--strategy", "fedsparse", "-S", "preset=mid", "--devices", "4", "--clients-per-round", "2",
               "--rounds", "2", "--processes", "1", "--no-progress", "--workdir", str(tmp_path / "w"),
               "--out", str(out), "--plot", str(png)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert KEYS <= set(rep) and rep["strategy"] == "fedsparse" and rep["devices"] == 4
    assert [r["round"] for r in rep["rounds"]] == [1, 2]
    assert all(ROUND_KEYS | {"density"} <= set(r) for r in rep["rounds"])
    assert rep["total_bytes"] == sum(r["bytes_down"] + r["bytes_up"] for r in rep["rounds"])
    assert png.stat().st_size > 5000
    assert "final accuracy" in capsys.readouterr().out


@pytest.mark.slow
def test_sigterm_to_simulate_stops_its_devices_and_broker(tmp_path):
    """`kill` (or a CI timeout) on `fedge simulate` mid-run: it says so and exits, and nothing it started
    (device processes, the private Mosquitto) is left running: its whole process group is gone."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    if not any(Path(d, "mosquitto").exists() for d in ("/usr/sbin", "/usr/bin", "/usr/local/sbin")):
        pytest.skip("mosquitto is not installed")
    root = Path(__file__).resolve().parents[1]
    work = tmp_path / "w"
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "simulate", "--broker", "mosquitto",
                             "--devices", "4", "--clients-per-round", "2", "--rounds", "100000", "--processes", "2",
                             "--no-progress", "--workdir", str(work)],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    pgid = os.getpgid(proc.pid)
    try:
        time.sleep(15)  # broker, coordinator and device processes up, rounds running
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert len(subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True, text=True)
                   .stdout.split()) >= 3  # simulate, its broker, its device processes
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err.decode()[-2000:]
        assert b"interrupted" in err
        deadline = time.time() + 15
        while time.time() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.3)
        else:
            left = subprocess.run(["ps", "-o", "pid,args", "-g", str(pgid)], capture_output=True, text=True).stdout
            raise AssertionError(f"processes left behind:\n{left}")
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- issue #30: a good config starts; a full disk is one line, not a traceback
def _run_coordinator(tmp_path, toml: str, prelude: str = "", stop_after: str | None = None, timeout: float = 60):
    """``fedge coordinator --config`` as a user runs it, in its own process; SIGTERM once ``stop_after`` is
    printed. ``prelude``: Python run first (to make a disk full)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(toml)
    code = f"{prelude}\nimport sys\nfrom coordinator.cli import main\nsys.exit(main(['coordinator', '--config', {str(cfg)!r}]))"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    out = []
    end = time.time() + timeout
    try:
        if stop_after is not None:
            for line in proc.stdout:
                out.append(line)
                if stop_after in line or time.time() > end:
                    break
            proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(out) + rest, err


def _broker():
    from coordinator.broker import Mosquitto, mosquitto_binary
    if mosquitto_binary() is None:
        pytest.skip("mosquitto not installed")
    return Mosquitto()


@pytest.mark.mosquitto
def test_a_good_config_starts_and_stops_cleanly(tmp_path):
    with _broker() as b:
        rc, out, err = _run_coordinator(tmp_path, f"[broker]\nurl = 'mqtt://127.0.0.1:{b.port}'\n[state]\n"
                                        f"path = '{tmp_path / 's.sqlite'}'\n[strategy]\nepochs = 2\nbatch_size = 8\n"
                                        "lr = 0.1\nupload_dtype = 'f2'\n", stop_after="connected to the broker")
    assert rc == 0 and "starting run" in out and "stopped after round 0" in out, (out, err)
    assert "Traceback" not in err


def test_a_full_disk_at_start_is_one_line(tmp_path):
    prelude = ("import sqlite3\nfrom coordinator.store import Store\n"
               "def full(*a): raise sqlite3.OperationalError('database or disk is full')\n"
               "Store.save_initial_state = full")
    rc, out, err = _run_coordinator(tmp_path, f"[state]\npath = '{tmp_path / 's.sqlite'}'\n", prelude)
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("fedge coordinator: the disk is full (database or disk is full)"), err


@pytest.mark.mosquitto
def test_a_full_disk_while_running_is_one_line(tmp_path):
    prelude = ("import errno\nfrom coordinator.rounds import RoundMachine\n"
               "def full(*a): raise OSError(errno.ENOSPC, 'No space left on device')\n"
               "RoundMachine.tick = full")
    with _broker() as b:
        rc, out, err = _run_coordinator(tmp_path, f"[broker]\nurl = 'mqtt://127.0.0.1:{b.port}'\n[state]\n"
                                        f"path = '{tmp_path / 's.sqlite'}'\n", prelude)
    assert rc == 1 and "Traceback" not in err, err
    assert "coordinator stopped after round 0 of" in out and "the disk is full" in out, out
    assert all("disk is full" in line for line in err.splitlines()), err


def test_device_takes_its_fleet_on_the_command_line(tmp_path, capsys):
    """``fedge device --fleet`` (as ``fedge-native --fleet``): a fleet that cannot be a topic level is one line."""
    import numpy as np
    from edge.runtime.data import save_npz
    save_npz(tmp_path / "d.npz", np.zeros((3, 4), np.float32), np.zeros(3, np.int64))
    assert main(["device", "--id", "d1", "--data", str(tmp_path / "d.npz"), "--fleet", "a/b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fleet 'a/b'" in err[0], err


@pytest.mark.parametrize("argv, config, chunk", [([], "", 1020 * 1024), (["--chunk-kb", "120"], "", 120 * 1024),
                                                  ([], "chunk_kb = 64\n", 64 * 1024),
                                                  (["--chunk-kb", "120"], "chunk_kb = 64\n", 120 * 1024)])
def test_device_chunk_size_comes_from_its_flag_or_its_file(tmp_path, monkeypatch, argv, config, chunk):
    """A broker whose packet limit is below the default chunk (AWS IoT Core: 128 KB) needs the device's reports
    chunked below it: ``fedge device --chunk-kb`` or ``[device] chunk_kb``, the flag first."""
    import numpy as np
    import edge.runtime.device
    from edge.cli import cmd_device, parser
    from edge.runtime.data import save_npz

    class Made(Exception):
        pass

    def fake(*args, **kw):
        raise Made(kw["chunk_bytes"])

    save_npz(tmp_path / "d.npz", np.zeros((3, 4), np.float32), np.zeros(3, np.int64))
    (tmp_path / "device.toml").write_text(f'[device]\nid = "d1"\ndata = "{tmp_path / "d.npz"}"\n{config}')
    monkeypatch.setattr(edge.runtime.device, "device_from_files", fake)
    with pytest.raises(Made) as got:
        cmd_device(parser().parse_args(["device", "--config", str(tmp_path / "device.toml"), *argv]))
    assert got.value.args == (chunk,)


@pytest.mark.parametrize("url, says", [("mqtt//h:1883", "--broker = 'mqtt//h:1883': must be embedded, mosquitto or"),
                                       ("mosquito", "--broker = 'mosquito': must be embedded, mosquitto or"),
                                       ("mqtt://:1883", "--broker: no host in broker address")])
def test_simulate_refuses_a_broker_it_would_have_taken_for_the_embedded_one(capsys, url, says):
    assert main(["simulate", "--broker", url, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_devices_on_a_damaged_state_is_one_line(tmp_path, capsys):
    bad = tmp_path / "s.sqlite"
    bad.write_bytes(b"not sqlite at all\n" * 64)
    assert main(["devices", "--state", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a coordinator state file" in err, err
