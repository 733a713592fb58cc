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
