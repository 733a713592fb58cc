"""A phone's browser as a device (issue 25; docs/browser.md), measured with the device page in headless Chromium.

``python benchmarks/browser_device.py [--rounds 3] [--out runs/bench/browser_device.json]`` runs

- a fleet: Mosquitto with a WebSockets listener, the coordinator daemon (FedAvg on digits, MLP 64-16-10, one
  full-batch step per round), two Python ORT devices and the page (served by the coordinator's HTTP server under
  /device/, its data file picked through the file input), with a screenshot once the page shows a report accepted;
- ``fedge conformance`` against the page (every step, over MQTT over WebSockets through the driver's relay);
- the page's first update against the Python ORT device's on the same plan (captured from the broker);

and writes ``browser`` (Chromium's version), ``rounds``, ``rounds_with_page_reports``, ``conformance``,
``max_abs_diff_vs_python``, ``screenshot``, ``first_checkin_s`` (page load to its first check-in), ``step_ms`` (the
page's and the Python ORT device's, per step on the same plan), ``page_bytes`` (everything the page loads). The
functions are shared with tests/test_browser_device.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WEB = ROOT / "clients" / "web"
CHROMIUM = os.environ.get("FEDGE_CHROMIUM", "/usr/bin/chromium")


def missing() -> str | None:
    """Why the page cannot be run here (None: it can)."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is not installed (apt-get install chromium)"
    if not (WEB / "node_modules" / "playwright-core").exists() or not (WEB / "node_modules" / "onnxruntime-web").exists():
        return "clients/web's npm packages are absent (npm ci --prefix clients/web)"
    from coordinator.broker import mosquitto_binary
    if mosquitto_binary() is None:
        return "mosquitto is not installed"
    return None


class Browser:
    """The device page in headless Chromium (clients/web/browse.mjs), open until :meth:`close`."""

    def __init__(self, url: str, *, data: Path | None = None, screenshot: Path | None = None, shot_when: str = ""):
        args = ["node", str(WEB / "browse.mjs"), "--url", url, "--chromium", CHROMIUM]
        if screenshot:
            args += ["--screenshot", str(screenshot), "--shot-when", shot_when]
        if data:
            args += ["--data", str(data)]
        self.events: list[dict] = []
        self.cv = threading.Condition()
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                ev = {"event": "console", "text": line.rstrip()}
            with self.cv:
                self.events.append(ev)
                self.cv.notify_all()

    def _first(self, match, timeout: float) -> dict | None:
        end = time.time() + timeout
        with self.cv:
            while True:
                got = next((e for e in self.events if match(e)), None)
                if got or time.time() >= end or self.proc.poll() is not None:
                    return got
                self.cv.wait(min(0.2, max(0.0, end - time.time())))

    def wait_for(self, event: str, timeout: float) -> dict | None:
        return self._first(lambda e: e["event"] == event, timeout)

    def wait_accepted(self, count: int, timeout: float) -> bool:
        """Whether the page counted ``count`` accepted reports within ``timeout``: the coordinator's ack for the
        last round reaches the page after the round commits, so the page's count lags the coordinator's."""
        return self._first(lambda e: e["event"] == "accepted" and e["count"] >= count, timeout) is not None

    def close(self) -> dict | None:
        """Closes the page; returns its final numbers (window.fedge)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        final = self.wait_for("final", 1)
        return final["state"] if final else None

    def console(self) -> str:
        err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
        return "\n".join(e.get("text", json.dumps(e)) for e in self.events)[-4000:] + err[-2000:]


class Sniffer:
    """An MQTT client that keeps one device's plans, reports and acks (reassembled), to compare the page's work."""

    def __init__(self, broker_url: str, fleet: str, device: str):
        import paho.mqtt.client as mqtt

        from edge.protocol import wire
        self.wire, self.r = wire, wire.Reassembler()
        self.got: dict[str, list] = {"plan": [], "report": [], "ack": []}
        self.lock = threading.Lock()
        host, port = broker_url.split("//")[1].split(":")
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sniff-{device}")
        self.c.on_connect = lambda c, u, f, rc, p: c.subscribe([(f"fedge/v1/{fleet}/{k}/{device}", 1) for k in self.got])
        self.c.on_message = self._msg
        self.c.connect(host, int(port))
        self.c.loop_start()

    def _msg(self, c, u, m) -> None:
        kind = m.topic.split("/")[3]
        try:
            msg = self.wire.decode(m.payload)
            if isinstance(msg, self.wire.Chunk):
                whole = self.r.feed(kind, msg, time.time())
                if whole is None:
                    return
                msg = self.wire.decode(whole)
        except Exception as e:  # noqa: BLE001 - what we sniff is judged by the test
            msg = e
        with self.lock:
            self.got[kind].append(msg)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def python_step(plan, data: tuple[np.ndarray, np.ndarray], repeat: int = 20) -> tuple[dict, float]:
    """The Python ORT device's update for ``plan`` (its program from the first plan) and its time per step (ms)."""
    from edge.algorithms.driver import run_plan
    from edge.trainers.ort_backend import OrtTrainer
    t = OrtTrainer(threads=1)
    t.load(plan.program)
    rep = run_plan(plan, t, *data)
    t0 = time.perf_counter()
    steps = 0
    for _ in range(repeat):
        steps += run_plan(plan, t, *data).metrics["steps"]
    return {k: u.dense() for k, u in rep.tensors.items()}, (time.perf_counter() - t0) * 1000 / steps


def numpy_step(w: dict, x: np.ndarray, y: np.ndarray, lr: float) -> dict:
    """One full-batch SGD step of the ReLU MLP's mean cross-entropy, written out in float64."""
    L = len([k for k in w if k.endswith(".weight")])
    acts, pre = [x.astype(np.float64)], []
    for i in range(L):
        z = acts[-1] @ w[f"fc{i}.weight"].T.astype(np.float64) + w[f"fc{i}.bias"]
        pre.append(z)
        acts.append(np.maximum(z, 0) if i < L - 1 else z)
    p = np.exp(acts[-1] - acts[-1].max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    d = (p - np.eye(p.shape[1])[y]) / len(y)
    out = {}
    for i in reversed(range(L)):
        out[f"fc{i}.weight"] = w[f"fc{i}.weight"] - lr * d.T @ acts[i]
        out[f"fc{i}.bias"] = w[f"fc{i}.bias"] - lr * d.sum(0)
        if i:
            d = (d @ w[f"fc{i}.weight"].astype(np.float64)) * (pre[i - 1] > 0)
    return out


def fleet_run(workdir: Path, *, rounds: int = 3, screenshot: Path | None = None) -> dict:
    """Mosquitto (with WebSockets) + the coordinator + two Python ORT devices + the page in Chromium; returns the
    coordinator's rows, the page's numbers, and its first plan and report as captured on the broker."""
    from coordinator.broker import Mosquitto
    from coordinator.simulate import SimConfig, build_coordinator, prepare
    from coordinator.web import StatusServer
    from edge.runtime.data import load_npz

    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: the coordinator would resume a state left here
    workdir.mkdir(parents=True)
    fleet = "webfleet"
    cfg = SimConfig(devices=3, clients_per_round=3, over_selection=1.0, rounds=rounds, epochs=1, lr=0.5,
                    batch_size=100_000, hidden=(16,), seed=0, fleet=fleet, workdir=str(workdir / "sim"),
                    round_timeout_s=120.0, runtimes=("ort",))
    specs, data = prepare(cfg)
    page_id = specs[-1]["id"]
    rows: list[dict] = []
    out: dict = {"page_id": page_id}
    caps = workdir / "caps.toml"
    caps.write_text('[capabilities]\nruntime = "ort"\ncharging = true\nnetwork = "wifi"\nidle = true\n')
    with Mosquitto(websockets=0) as b, StatusServer(lambda: "", lambda: {}) as srv:
        sniff = Sniffer(b.url, fleet, page_id)
        coord = build_coordinator(cfg, b.url, (data.x_test, data.y_test), rows.append).start()
        procs, browser = [], None
        try:
            assert coord.link.connected.wait(30), "the coordinator did not connect"
            for s in specs[:-1]:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "coordinator.cli", "device", "--config", str(caps), "--id", s["id"],
                     "--data", str(s["data"]), "--broker", b.url, "--fleet", fleet, "--state-dir", str(s["state"])],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT))
            url = f"{srv.url}device/?broker={b.ws_url}&fleet={fleet}&id={page_id}"
            browser = Browser(url, data=Path(specs[-1]["data"]), screenshot=screenshot)
            finished = coord.wait(60 + 60 * rounds)
            browser.wait_accepted(rounds, 15)  # the test judges the count: this only waits for the last ack
            out["shot"] = browser.wait_for("screenshot", 5)
            out["browser"] = (browser.wait_for("browser", 5) or {}).get("version")
            out["loaded_s"] = (browser.wait_for("loaded", 5) or {}).get("seconds")
            out["page"] = browser.close()
            out["console"] = browser.console()
            assert finished and coord.error is None, (f"the fleet did not finish: {rows}", out["console"])
        finally:
            coord.stop()
            if browser:
                browser.close()
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(20)
            sniff.close()
    out["rows"] = rows
    out["plans"] = [m for m in sniff.got["plan"] if not isinstance(m, Exception)]
    out["reports"] = [m for m in sniff.got["report"] if not isinstance(m, Exception)]
    out["acks"] = [m for m in sniff.got["ack"] if not isinstance(m, Exception)]
    out["bad"] = [str(m) for ms in sniff.got.values() for m in ms if isinstance(m, Exception)]
    out["data"] = load_npz(specs[-1]["data"])
    return out


def page_conformance(workdir: Path) -> tuple[dict, list[str], str]:
    """``fedge conformance`` against the page in Chromium (its demo shard as the data), over WebSockets through the
    driver's relay (``--proxy-to``). Returns the verdicts, the driver's lines and the page's console."""
    from coordinator import conformance as C
    from coordinator.broker import Mosquitto
    from coordinator.web import StatusServer
    from coordinator.webdevice import demo_shard
    from edge.runtime.data import load_npz
    from edge.runtime.mqtt import BrokerAddress

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "demo.npz").write_bytes(demo_shard())
    x, y = load_npz(workdir / "demo.npz")
    lines: list[str] = []
    with Mosquitto(websockets=0) as b, StatusServer(lambda: "", lambda: {}) as srv:
        proxy = C.Proxy("127.0.0.1:0", BrokerAddress.parse(b.url), ("127.0.0.1", b.ws_port))
        browser = Browser(f"{srv.url}device/?broker=ws://127.0.0.1:{proxy.address[1]}&fleet=conf&id=page-1&demo=1&start=1")
        try:
            o = C.Options(b.url, "page-1", "conf", timeout_s=20.0, resend_within_s=8.0, quiet_s=1.0, pace_s=1.0,
                          first_wait_s=60.0, data=(x, y))
            verdicts = C.run(o, lines.append, proxy)
        finally:
            browser.close()
            proxy.close()
    return verdicts, lines, browser.console()


def page_bytes() -> int:
    """Bytes of everything the page loads (its modules, MQTT.js, ONNX Runtime Web's training build and wasm)."""
    from coordinator.webdevice import files
    return sum(p.stat().st_size for p in files().values())


def compare_first_update(run: dict) -> tuple[float, float, float]:
    """(max |page - Python ORT device|, max |page - numpy step|, Python's ms per step) on the page's first plan."""
    plan = next(p for p in run["plans"] if p.program is not None)
    report = next(r for r in run["reports"] if r.task_id == plan.task_id)
    py, py_ms = python_step(plan, run["data"])
    ref = numpy_step(plan.weights, *run["data"], float(plan.hparams["lr"]))
    page = {k: u.dense() for k, u in report.tensors.items()}
    assert set(page) == set(py) == set(ref)
    return (max(float(np.abs(page[k] - py[k]).max()) for k in page),
            max(float(np.abs(page[k] - ref[k]).max()) for k in page), py_ms)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "browser_device.json"))
    a = ap.parse_args(argv)
    why = missing()
    if why:
        print(f"browser_device: cannot run: {why}", file=sys.stderr)
        return 2
    work = ROOT / "runs" / "bench" / "browser_device"
    shot = work / "page.png"
    run = fleet_run(work / "fleet", rounds=a.rounds, screenshot=shot)
    diff_py, diff_ref, py_ms = compare_first_update(run)
    verdicts, lines, _ = page_conformance(work / "conformance")
    page = run["page"] or {}
    train = {"step_ms": page.get("stepMs")}
    accepted_rounds = sorted({a.task_id for a in run["acks"] if a.status == "accepted"})
    res = {
        "browser": f"Chromium {run['browser']}",
        "rounds": len(run["rows"]),
        "rounds_with_page_reports": len(accepted_rounds),
        "reports_per_round": [r["reports"] for r in run["rows"]],
        "accuracy": [round(r["accuracy"], 4) for r in run["rows"]],
        "conformance": "pass" if all(v == "PASS" for v in verdicts.values()) else "fail",
        "conformance_steps": verdicts,
        "max_abs_diff_vs_python": diff_py,
        "max_abs_diff_vs_numpy": diff_ref,
        "screenshot": str(shot.relative_to(ROOT)) if run.get("shot") else None,
        "screenshot_state": (run.get("shot") or {}).get("state", {}).get("state"),
        "first_checkin_s": page.get("firstCheckin"),
        "page_load_s": run.get("loaded_s"),
        "step_ms": {"page": train.get("step_ms"), "python_ort": py_ms},
        "step_ms_note": "one full-batch step (the page's shard, MLP 64-16-10): the page's is the mean over its "
                        "plans' steps in Chromium (the ONNX Runtime Web run and the SGD update), the first plan's "
                        "included; Python's is run_plan per step on the page's first plan, warm",
        "page_bytes": page_bytes(),
        "caps_seen": page.get("caps"),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0 if res["conformance"] == "pass" and res["rounds_with_page_reports"] == res["rounds"] else 1


if __name__ == "__main__":
    sys.exit(main())
