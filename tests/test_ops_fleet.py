"""Operations on a running fleet over a private Mosquitto: /metrics against what the run did, the status page in
headless Chromium (a screenshot), and `fedge coordinator` as a user runs it (its lines, --out, --plot)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.broker import Mosquitto, free_port, mosquitto_binary
from coordinator.cli import main
from coordinator.metrics import FleetMetrics
from coordinator.simulate import DeviceFleet, SimConfig, build_coordinator, prepare
from coordinator.store import Store
from coordinator.web import serve
from edge.runtime.data import save_npz

from test_mqtt_integration import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.mosquitto,
              pytest.mark.skipif(mosquitto_binary() is None and not os.environ.get("CI"),
                                 reason="mosquitto not installed")]

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and os.path.exists(p)), None)
# what works headless here (no GPU, no sandbox as root, no network but loopback)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1280,820"]


@pytest.fixture(scope="module")
def broker():
    with Mosquitto() as b:
        yield b


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


class LiveFleet:
    """A coordinator (with its metrics observer and HTTP server) and device processes, in a test."""

    def __init__(self, cfg: SimConfig, url: str):
        self.cfg = cfg
        specs, data = prepare(cfg)
        self.metrics = FleetMetrics()
        self.coord = build_coordinator(cfg, url, (data.x_test, data.y_test), observer=self.metrics)
        self.metrics.attach(self.coord)
        self.server = serve(self.metrics)
        self.coord.start()
        self.devices = DeviceFleet(specs, url, cfg.processes)

    def stop(self):
        self.devices.stop()
        self.coord.stop()
        self.server.stop()


def test_metrics_match_what_the_run_did(tmp_path, broker, capsys):
    cfg = SimConfig(devices=6, clients_per_round=3, rounds=3, hidden=(16,), broker=broker.url, processes=1,
                    workdir=str(tmp_path / "w"), fleet="ops-metrics")
    f = LiveFleet(cfg, broker.url)
    try:
        assert f.coord.wait(150) and f.coord.error is None
        text = get(f.server.url + "metrics").decode()
        status = json.loads(get(f.server.url + "status.json"))
        assert main(["status", "--url", f.server.url]) == 0
        live = capsys.readouterr().out
    finally:
        f.stop()
    rounds = Store(cfg.workdir + "/coordinator.sqlite").summaries()
    assert [r["round"] for r in rounds] == [1, 2, 3]

    fams = {fam.name: fam for fam in text_string_to_metric_families(text)}
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value for fam in fams.values() for x in fam.samples}
    assert s[("fedge_rounds_committed_total", ())] == 3 and s[("fedge_round", ())] == 3
    assert s[("fedge_rounds_abandoned_total", ())] == 0
    assert s[("fedge_accuracy", ())] == pytest.approx(rounds[-1]["accuracy"])
    reports = sum(r["reports"] for r in rounds)
    assert s[("fedge_reports_accepted_total", ())] == reports
    assert s[("fedge_reports_plain_path_total", ())] == 0  # a reproducible run sums in its seeded order instead
    assert s[("fedge_report_acks_total", (("status", "accepted"),))] == reports
    assert s[("fedge_persisted_records_total", (("what", "report"),))] == reports
    # bytes counted into rounds are the run report's, exactly
    assert s[("fedge_round_bytes_total", (("direction", "down"),))] == sum(r["bytes_down"] for r in rounds)
    assert s[("fedge_round_bytes_total", (("direction", "up"),))] == sum(r["bytes_up"] for r in rounds)
    # every plan byte went out through the client; every report byte that counted came in through it
    assert s[("fedge_sent_bytes_total", (("kind", "plan"),))] == sum(r["bytes_down"] for r in rounds)
    assert s[("fedge_received_bytes_total", (("kind", "report"),))] >= sum(r["bytes_up"] for r in rounds)
    # every report that came in was answered once: accepted, or late (over-selected ones, reproducible mode)
    answered = sum(s[("fedge_report_acks_total", (("status", k),))] for k in ("accepted", "late", "rejected",
                                                                              "duplicate"))
    assert answered == s[("fedge_received_messages_total", (("kind", "report"),))]
    assert answered == s[("fedge_sent_messages_total", (("kind", "ack"),))]
    # each message is one `receive` stage; durable records are written in batches (group commit), each batch
    # one `persist` (plus one per committed round's metrics), so there are at most as many as records
    assert s[("fedge_stage_duration_seconds_count", (("stage", "receive"),))] == sum(
        s[("fedge_received_messages_total", (("kind", k),))] for k in ("checkin", "report", "status", "other"))
    records = sum(v for (n, _), v in s.items() if n == "fedge_persisted_records_total")
    assert 3 < s[("fedge_stage_duration_seconds_count", (("stage", "persist"),))] <= records + 3
    assert s[("fedge_stage_duration_seconds_count", (("stage", "evaluate"),))] == 3
    assert s[("fedge_round_duration_seconds_count", ())] == 3
    assert s[("fedge_round_attempt_duration_seconds_count", (("outcome", "committed"),))] == 3
    assert s[("fedge_round_duration_seconds_sum", ())] >= sum(r["wall_s"] for r in rounds) - 1e-6
    assert s[("fedge_devices", (("state", "registered"),))] == 6
    assert s[("fedge_devices", (("state", "online"),))] == 6
    assert s[("fedge_devices", (("state", "quarantined"),))] == 0
    assert s[("fedge_round_open", ())] == 0 and s[("fedge_rounds_target", ())] == 3

    assert status["phase"] == "finished" and status["round"] == 3 and len(status["curve"]) == 3
    assert status["bytes"]["total"] == sum(r["bytes_down"] + r["bytes_up"] for r in rounds)
    assert [r["accuracy"] for r in status["rounds"]] == pytest.approx([r["accuracy"] for r in rounds])
    assert status["devices"]["registered"] == 6 and status["reports"]["accepted"] == reports

    print(live)
    assert "fleet ops-metrics" in live and "round 3 of 3 committed [" in live and "finished" in live
    assert main(["status", "--state", cfg.workdir + "/coordinator.sqlite"]) == 0
    after = capsys.readouterr().out
    assert "round 3 committed; not running" in after and "devices: 6 registered" in after


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium; .ci/run does)")
def test_status_page_of_a_running_fleet_in_headless_chromium(tmp_path, broker):
    cfg = SimConfig(devices=8, clients_per_round=4, rounds=400, epochs=2, lr=0.1, hidden=(32,), broker=broker.url,
                    processes=1, workdir=str(tmp_path / "w"), fleet="ops-page", round_timeout_s=30)
    f = LiveFleet(cfg, broker.url)
    png = tmp_path / "status_page.png"
    try:
        wait_until(lambda: len(f.metrics.rows) >= 12, 150, "twelve committed rounds")
        base = [CHROMIUM, *CHROMIUM_FLAGS, "--virtual-time-budget=4000"]
        with tempfile.TemporaryDirectory() as prof:
            shot = subprocess.run(base + [f"--user-data-dir={prof}", f"--screenshot={png}", f.server.url],
                                  capture_output=True, timeout=120)
        with tempfile.TemporaryDirectory() as prof:
            dom = subprocess.run(base + [f"--user-data-dir={prof}", "--dump-dom", f.server.url],
                                 capture_output=True, timeout=120).stdout.decode()
        committed = len(f.metrics.rows)
        running = not f.coord.done.is_set()
    finally:
        f.stop()
    assert shot.returncode == 0 and png.exists(), shot.stderr.decode()[-2000:]
    assert png.stat().st_size > 20_000  # a rendered page with a chart, not a blank one
    keep = ROOT / "runs" / "screens" / "status_page.png"
    keep.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(png, keep)  # for a person to look at
    assert running and committed < cfg.rounds
    # what the script drew from /status.json: identity, progress, a curve point per round, the rounds table
    assert "fleet ops-page" in dom and "/ 400</div>" in dom
    chart = dom.split('id="chart"', 1)[1].split("</svg>", 1)[0]
    assert '<polyline points="' in chart and chart.count('class="pt"') >= 12
    assert "cumulative MB on the wire" in chart and "test accuracy" in chart
    table = dom.split('id="rounds"', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") >= 12 + 1
    assert 'id="error" style="display: none;"' in dom or 'id="error"></div>' in dom  # it reached the coordinator


def test_fedge_coordinator_prints_a_line_per_round_and_writes_report_and_plot(tmp_path, broker):
    cfg = SimConfig(devices=4, clients_per_round=3, rounds=3, hidden=(16,), broker=broker.url, processes=1,
                    workdir=str(tmp_path / "w"), fleet="ops-cli")
    specs, data = prepare(cfg)
    save_npz(tmp_path / "test.npz", data.x_test, data.y_test)
    port = free_port()
    conf = tmp_path / "fleet.toml"
    conf.write_text(f'[broker]\nurl = "{broker.url}"\n[state]\npath = "{tmp_path / "state.sqlite"}"\n'
                    "[rounds]\nrounds = 3\nclients_per_round = 3\nover_selection = 1.0\nround_timeout_s = 60\n"
                    'selection_timeout_s = 1\nfleet = "ops-cli"\n'
                    f'[strategy]\nname = "fedavg"\nsizes = [64, 16, 10]\n[data]\ntest = "{tmp_path / "test.npz"}"\n')
    out, png = tmp_path / "report.json", tmp_path / "report.png"
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "coordinator", "--config", str(conf),
                             "--out", str(out), "--plot", str(png), "--metrics-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env=os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    devices = None
    seen = []
    try:
        devices = DeviceFleet(specs, broker.url, 1)
        end = time.time() + 180
        while proc.poll() is None and time.time() < end:
            try:
                seen.append(json.loads(get(f"http://127.0.0.1:{port}/status.json")))
            except OSError:
                pass
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        if devices is not None:
            devices.stop()
    stdout, stderr = stdout.decode(), stderr.decode()
    print(stdout, stderr)  # what a person sees (pytest shows it with -s, or on failure)
    assert proc.returncode == 0, stdout + stderr
    lines = stdout.splitlines()
    assert "starting run" in lines[0] and "fedavg, fleet ops-cli): 3 rounds of 3 reports" in lines[0]
    assert f"status page and /metrics at http://127.0.0.1:{port}/" in lines[0]
    assert any("connected to the broker at " in ln for ln in lines)
    rounds = [ln for ln in lines if " round " in ln and ": accuracy " in ln]
    assert [ln.split(" round ")[1].split(":")[0] for ln in rounds] == ["1/3", "2/3", "3/3"]
    assert all(", 3 reports, 0 unused, " in ln and " MB down + " in ln for ln in rounds)
    assert "run finished: 3 rounds, final accuracy " in lines[-2]
    assert lines[-1].endswith(f"report in {out}; plot in {png}")
    assert "Traceback" not in stderr and "ERROR" not in stderr
    rep = json.loads(out.read_text())
    assert {"strategy", "runtime", "devices", "clients_per_round", "rounds", "final_accuracy", "total_bytes",
            "wall_s"} <= set(rep)
    assert [r["round"] for r in rep["rounds"]] == [1, 2, 3] and rep["devices"] == 4 and rep["finished"] is True
    assert set(rep["rounds"][0]) >= {"round", "accuracy", "loss", "bytes_down", "bytes_up", "reports", "dropped",
                                     "wall_s"}
    assert rep["total_bytes"] == sum(r["bytes_down"] + r["bytes_up"] for r in rep["rounds"])
    assert f"{rep['total_bytes'] / 1e6:.2f} MB on the wire" in lines[-2]
    assert png.stat().st_size > 5000
    assert seen and seen[-1]["fleet"] == "ops-cli"  # the status endpoint answered while it ran
