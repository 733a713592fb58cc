"""The device page in headless Chromium (issue 25; clients/web, docs/browser.md): a fleet with two Python devices where
every round commits with the page's report, a screenshot of the page mid-run, the page's first update against the
Python ORT device's and a numpy step, and ``fedge conformance`` against the page, every step."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import browser_device as B  # noqa: E402  (the harness the benchmark shares)

WHY = B.missing()
pytestmark = [pytest.mark.slow, pytest.mark.mosquitto,
              pytest.mark.skipif(WHY is not None and not os.environ.get("CI"), reason=f"the page cannot run here: {WHY}")]


def test_page_trains_in_a_fleet_with_python_devices(tmp_path):
    shot_dir = ROOT / "runs" / "browser_device"
    shot_dir.mkdir(parents=True, exist_ok=True)
    shot = shot_dir / "page-mid-run.png"
    if shot.exists():
        shot.unlink()
    run = B.fleet_run(tmp_path / "fleet", rounds=3, screenshot=shot)
    rows = run["rows"]
    assert [r["reports"] for r in rows] == [3, 3, 3], (rows, run["console"])
    # the page's report is in every round: one accepted ack per round's task, to the page
    accepted = {a.task_id for a in run["acks"] if a.status == "accepted"}
    assert len(accepted) == 3 and {r.task_id for r in run["reports"]} == accepted, (run["acks"], run["console"])
    assert not run["bad"], run["bad"]
    page = run["page"]
    assert page["accepted"] == 3 and page["conn"] == "connected", page
    assert page["caps"]["runtime"] == "ort" and page["firstCheckin"] is not None

    # the screenshot: taken after the page's first accepted report, while the fleet still ran; not blank, and the
    # page then showed its status
    assert run["shot"] and shot.exists(), run["console"]
    state = run["shot"]["state"]
    assert state["accepted"] >= 1 and state["conn"] == "connected" and state["state"].strip(), state
    from PIL import Image
    img = np.asarray(Image.open(shot).convert("L"), np.float64)
    assert img.shape[0] > 400 and img.shape[1] > 300
    assert img.std() > 20 and (img < 100).mean() > 0.01, "the screenshot is blank"

    # the page's first update (one full-batch step) against the Python ORT device's and a numpy step
    diff_py, diff_ref, _ = B.compare_first_update(run)
    assert diff_py <= 1e-5 and diff_ref <= 1e-5, (diff_py, diff_ref)
    plan = next(p for p in run["plans"] if p.program is not None)
    first = next(r for r in run["reports"] if r.task_id == plan.task_id)
    moved = max(float(np.abs(t.dense() - plan.weights[k]).max()) for k, t in first.tensors.items())
    assert moved > 1e-3, "the step barely moves the weights: the comparison would be weak"


def test_page_passes_fedge_conformance_in_chromium(tmp_path):
    verdicts, lines, console = B.page_conformance(tmp_path)
    print("\n".join(lines), file=sys.stderr)
    from coordinator import conformance as C
    assert verdicts == {k: "PASS" for k in C.STEPS}, "\n".join(lines) + "\n--- page:\n" + console


def test_coordinator_serves_the_page_and_fedge_writes_it(tmp_path):
    """/device/ beside the status page (its assets, with a policy that allows its wasm and WebSockets), and
    ``fedge web-device --out DIR`` writes the same files; a missing npm install is one line, exit 2."""
    import urllib.request

    from coordinator.cli import main
    from coordinator.web import StatusServer
    from coordinator.webdevice import VENDOR

    with StatusServer(lambda: "", lambda: {}) as srv:
        with urllib.request.urlopen(srv.url + "device/") as r:
            html = r.read().decode()
            assert "page.mjs" in html and "wasm-unsafe-eval" in r.headers["Content-Security-Policy"]
        with urllib.request.urlopen(srv.url + "device/vendor/ort-training-wasm-simd-threaded.wasm") as r:
            assert r.headers["Content-Type"] == "application/wasm" and len(r.read()) > 1_000_000
        with urllib.request.urlopen(srv.url + "device/demo.npz") as r:
            assert r.read()[:2] == b"PK"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(srv.url + "device/../coordinator/web.py")
        assert e.value.code == 404
    assert main(["web-device", "--out", str(tmp_path / "site")]) == 0
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "demo.npz").exists()
    assert all((tmp_path / "site" / k).exists() for k in VENDOR)
    os.environ["FEDGE_WEB_DEVICE_DIR"] = str(tmp_path / "nowhere")
    try:
        assert main(["web-device", "--out", str(tmp_path / "x")]) == 2
    finally:
        del os.environ["FEDGE_WEB_DEVICE_DIR"]
