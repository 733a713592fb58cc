"""An emulated Raspberry Pi (arm64 Debian under qemu-user) runs the device suite and joins a fleet.

``python benchmarks/emulated_pi.py [--rounds 5] [--host-devices 4] [--emulated executorch,torch,native]
[--cpu cortex-a76] [--skip-suite]`` (as root; ``scripts/emulated_pi.sh`` does the provisioning) writes
``runs/bench/emulated_pi.json``::

    {"runtimes": {"executorch": {"suite": "pass"|"fail", "step_ms", "step_ms_by_model", "peak_mb", "suite_s"},
                  "torch": {...}},
     "rounds_completed": N, "wall_s": ..., "setup_s": {...}, "fleet": {...}, "disk_mb": {...},
     "native": {"torch_in_env": false, "install_bytes", "python_device_install_bytes", "binary_bytes", ...}, ...}

1. ``scripts/emulated_pi.sh setup``: host packages, binfmt, the arm64 rootfs, the aarch64 wheels, CPU identity.
   Each step is cached under ``runs/emulated-pi``; ``setup_s`` holds the seconds of the steps that ran
   (a warm run has only ``setup``).
2. ``python -m firmware_tests --runtime R`` inside the emulated Pi, for executorch and torch. ``suite`` is
   the suite's own verdict (every check of mlp, cnn and gated); ``step_ms`` is its median SGD step on the
   MLP (batch 20), ``step_ms_by_model`` all three. These are emulated timings, 50-100x a real core: they
   say the code runs, not how fast a Pi is.
3. A fleet: a private Mosquitto and a FedAvg coordinator (MLP 64-32-10, sklearn digits) on the host, host
   devices (torch) in one child process, and one device agent per ``--emulated`` runtime started in the
   emulated Pi as ``python -m coordinator.cli device`` (its ``.npz`` written on the host). Every device is
   selected every round (clients per round = fleet size, over-selection 1, all reports needed), so a round
   commits only with the emulated devices' reports. ``rounds_completed`` counts committed rounds in the
   coordinator's state (read with ``coordinator.store.Store``), and ``fleet.emulated`` says, per emulated
   device, in how many committed rounds its report was among the accepted and what was rejected from it.

4. ``native`` in ``--emulated`` (``python benchmarks/emulated_pi.py --runtimes "" --emulated native`` for it
   alone): ``scripts/emulated_pi.sh build-native`` cross-compiles clients/native for aarch64 against the aarch64
   executorch wheel's C++ runtime and installs it in the rootfs as /opt/fedge-native (the binary, the runtime
   libraries it loads, libmosquitto), and the fleet gets one ``fedge-native`` run under qemu-aarch64 with a
   clean environment (``scripts/emulated_pi.sh native``): no Python, no torch. It checks in as ``executorch``,
   so the coordinator serves it the ExecuTorch programs it exports on the host. ``native`` in the JSON:
   ``install_bytes`` (what /opt/fedge-native holds) against ``python_device_install_bytes`` (the Python
   device's site-packages: torch, its CUDA wheels, executorch and the rest), ``binary_bytes``, the libraries
   and their sizes, ``torch_in_env`` (whether anything of torch is in its install, its rootfs, its
   environment or its process's mapped files; must be false), the files it had mapped, its peak RSS (qemu's
   included), and its rounds.

``wall_s`` is the whole benchmark (setup, both suites, the fleet); ``fleet.wall_s`` is the fleet part from
the coordinator's start to its last commit. Exit code 0 only if both suites pass and every round committed
with every emulated device's report (and, with ``native``, only if it built and torch_in_env is false).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import collections
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/emulated_pi.py` from anywhere
    sys.path.insert(0, str(ROOT))
SCRIPT = ROOT / "scripts" / "emulated_pi.sh"
OUT = ROOT / "runs" / "bench" / "emulated_pi.json"
WORK = ROOT / "runs" / "bench" / "emulated_pi"
log = logging.getLogger("benchmarks.emulated_pi")


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def pi_env(cpu: str) -> dict[str, str]:
    # the host Python that runs this benchmark has pip: the script fetches the aarch64 wheels with it
    return {**os.environ, "FEDGE_PI_CPU": cpu, "FEDGE_HOST_PYTHON": os.environ.get("FEDGE_HOST_PYTHON", sys.executable)}


class SetupFailed(RuntimeError):
    """scripts/emulated_pi.sh ended with an error: the message names the command, its exit status and its
    error line, and ``tail`` holds the last lines it wrote (stdout and stderr, in order)."""

    def __init__(self, msg: str, tail: list[str]):
        super().__init__(msg)
        self.tail = tail


TAIL_LINES = 12


def setup(cpu: str, command: str = "setup", script: Path = SCRIPT, env: dict[str, str] | None = None
          ) -> dict[str, float]:
    """Provision (or reuse) the emulated Pi (``build-native``: its native device); returns {step: seconds} from
    the script's "done in" lines. Raises :class:`SetupFailed` with the script's error line and last lines."""
    steps: dict[str, float] = {}
    p = subprocess.Popen(["bash", str(script), command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env or pi_env(cpu))
    assert p.stdout is not None
    why = ""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    for line in p.stdout:
        print(line, end="", flush=True)
        tail.append(line.rstrip("\n"))
        m = re.match(r"\[emulated-pi\] (\w+) done in ([0-9.]+) s", line)
        if m:
            steps[m.group(1)] = float(m.group(2))
        if line.startswith("[emulated-pi] error: "):
            why = ": " + line[len("[emulated-pi] error: "):].strip()
    if p.wait() != 0:
        if not why:  # no error line of its own (killed by a signal, or an older script)
            why = " with no error line"
        name = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
        raise SetupFailed(f"{name} {command} exited {p.returncode}{why}", list(tail))
    return steps


def parse_suite(out_json: Path, text: str) -> dict[str, Any]:
    """The suite's verdict and median step times: from its --json file, else from its printed table."""
    if out_json.exists():
        d = json.loads(out_json.read_text())
        res = d["results"]
        by_model = {r["model"]: round(r["step_ms"], 3) for r in res if "step_ms" in r}
        return {"suite": "pass" if d["ok"] else "fail", "step_ms": by_model.get("mlp"),
                "step_ms_by_model": by_model, "peak_mb": round(max(r.get("peak_mb", 0.0) for r in res), 1),
                "checks": {r["model"]: ("pass" if r["ok"] else f"fail: {r.get('error') or r['checks']}") for r in res}}
    # no JSON (the suite died before writing it): read the table rows "runtime model ... step ms ... PASS"
    by_model = {}
    for line in text.splitlines():
        cols = line.split()
        if len(cols) >= 7 and cols[1] in ("mlp", "cnn", "gated") and re.fullmatch(r"[0-9.]+", cols[-5] or ""):
            by_model[cols[1]] = float(cols[-5])
    return {"suite": "pass" if "ALL PASS" in text else "fail", "step_ms": by_model.get("mlp"),
            "step_ms_by_model": by_model}


def run_suite(runtime: str, cpu: str, timeout: float) -> dict[str, Any]:
    WORK.mkdir(parents=True, exist_ok=True)
    out_json, log_path = WORK / f"suite_{runtime}.json", WORK / f"suite_{runtime}.log"
    out_json.unlink(missing_ok=True)
    say(f"python -m firmware_tests --runtime {runtime} in the emulated Pi ({cpu}); log: {log_path}")
    t0 = time.time()
    try:
        p = subprocess.run([str(SCRIPT), "run", "python3", "-m", "firmware_tests", "--runtime", runtime,
                            "--json", str(out_json)], capture_output=True, text=True, env=pi_env(cpu),
                           timeout=timeout)
        text, code = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:  # its stdout/stderr are bytes even with text=True
        out = [b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (e.stdout, e.stderr)]
        text, code = "".join(out) + f"\nTIMEOUT after {timeout} s", None
    log_path.write_text(text)
    r = parse_suite(out_json, text)
    r["suite_s"] = round(time.time() - t0, 1)
    r["exit_code"] = code
    if code not in (0, 1):  # 1 is the suite's own "FAILED"; anything else is a crash (SIGILL = -4)
        r["suite"] = "fail"
        r["error"] = text.strip().splitlines()[-1][:300] if text.strip() else f"exit {code}"
    say(f"{runtime}: {r['suite']}, step {r.get('step_ms')} ms (mlp), {r['suite_s']} s")
    return r


def run_fleet(emulated: list[str], host_devices: int, rounds: int, cpu: str, timeout: float) -> dict[str, Any]:
    from coordinator.broker import Mosquitto
    from coordinator.simulate import DeviceFleet, SimConfig, build_coordinator, prepare
    from coordinator.store import Store

    os.environ.setdefault("FEDGE_PROGRAM_CACHE", str(ROOT / "runs" / "programs"))  # the ET export, once
    n = host_devices + len(emulated)
    work = WORK / "fleet"
    if work.exists():
        shutil.rmtree(work)
    # a native device runs (and declares) executorch: the coordinator serves it the ExecuTorch programs
    served = {"executorch" if rt == "native" else rt for rt in emulated}
    cfg = SimConfig(devices=n, clients_per_round=n, over_selection=1.0, min_reports=n, rounds=rounds, epochs=1,
                    lr=0.1, hidden=(32,), seed=0, runtimes=tuple(sorted({"torch", *served})),
                    # the emulated agents take 10-40 s to check in and their first plan imports torch (and
                    # ExecuTorch) under emulation, 2-6 min on a loaded machine: rounds wait for them
                    selection_timeout_s=timeout, round_timeout_s=timeout, workdir=str(work),
                    fleet=f"pi-{os.getpid()}")
    specs, data = prepare(cfg)
    host_specs, emu_specs = specs[:host_devices], specs[host_devices:]
    for s in host_specs:
        s["caps"]["runtime"] = "torch"
    rows: list[dict] = []
    commits: list[float] = []
    res: dict[str, Any] = {"host_devices": host_devices, "rounds_planned": rounds, "model": "mlp 64-32-10",
                           "strategy": "fedavg"}
    procs: list[tuple[dict, subprocess.Popen, Any]] = []
    coord = fleet = None
    t0 = time.time()
    with Mosquitto() as broker:
        try:
            def on_round(s: dict) -> None:
                rows.append(s)
                commits.append(time.time())
                say(f"round {s['round']} committed: {s['reports']} reports ({', '.join(s.get('accepted', []))}), "
                    f"accuracy {s.get('accuracy', float('nan')):.3f}, {s['wall_s']:.1f} s")

            coord = build_coordinator(cfg, broker.url, (data.x_test, data.y_test), on_round=on_round).start()
            if not coord.link.connected.wait(30):
                raise TimeoutError(f"coordinator could not connect to {broker.url}")
            for s, rt in zip(emu_specs, emulated):
                ddir = Path(s["state"])
                if rt == "native":  # the aarch64 fedge-native, no Python (scripts/emulated_pi.sh native)
                    cmd = [str(SCRIPT), "native", "-v", "--id", s["id"], "--data", s["data"], "--state-dir",
                           str(ddir), "--broker", broker.url, "--fleet", s["fleet"], "--memory-mb", "4096"]
                else:
                    (ddir / "device.toml").write_text(
                        f'[device]\nfleet = "{s["fleet"]}"\n[capabilities]\ncharging = true\nnetwork = "wifi"\n'
                        f'idle = true\nmemory_mb = 4096\n')
                    cmd = [str(SCRIPT), "run", "python3", "-m", "coordinator.cli", "-v", "device", "--config",
                           str(ddir / "device.toml"), "--id", s["id"], "--data", s["data"], "--state-dir",
                           str(ddir), "--broker", broker.url, "--runtime", rt]
                logf = open(ddir / "device.log", "w")
                say(f"emulated device {s['id']} ({rt}) joins; log: {ddir / 'device.log'}")
                s["started"] = time.time()
                procs.append(({**s, "runtime": rt}, subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                                                     env=pi_env(cpu)), logf))
            fleet = DeviceFleet(host_specs, broker.url, 1)
            say(f"{host_devices} host devices (torch) started; waiting for {rounds} rounds")
            end = time.time() + timeout
            while not coord.wait(1.0):
                dead = [(s["id"], p.returncode) for s, p, _ in procs if p.poll() is not None]
                if dead:
                    res["error"] = f"emulated device(s) exited: {dead}"
                    break
                if coord.error or time.time() > end:
                    res["error"] = f"coordinator failed: {coord.error!r}" if coord.error else f"timeout {timeout} s"
                    break
            res["wall_s"] = round((commits[-1] if commits else time.time()) - t0, 1)
            for s, p, _ in procs:  # what the native device's process has mapped and its peak, while it lives
                if s["runtime"] == "native" and p.poll() is None:
                    s["proc"] = process_facts(p.pid)
        finally:
            if coord is not None:
                coord.stop()
            if fleet is not None:
                fleet.stop()
            for _, p, f in procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                f.close()
    st = Store(work / "coordinator.sqlite")
    try:
        summaries = st.summaries()
        rejections = st.rejections()
        devices = {d["device_id"]: d for d in st.devices()}
    finally:
        st.close()
    res["rounds_completed"] = len(summaries)
    res["accuracy"] = [round(s["accuracy"], 4) for s in summaries if "accuracy" in s]
    res["round_s"] = [round(s["wall_s"], 1) for s in summaries]
    res["emulated"] = []
    for s, p, _ in procs:
        did = s["id"]
        res["emulated"].append({
            "id": did, "runtime": s["runtime"], "checked_in": did in devices,
            "caps_runtime": devices.get(did, {}).get("caps", {}).get("runtime"),
            "accepted_rounds": sum(did in r.get("accepted", []) for r in summaries),
            "rejections": [r for r in rejections if r["device_id"] == did], "exit_code": p.returncode,
            "first_report_s": first_accepted_s(Path(s["state"]) / "device.log", s["started"]),
            **({"process": s["proc"]} if "proc" in s else {})})
    res["ok"] = (res["rounds_completed"] == rounds and "error" not in res
                 and all(e["accepted_rounds"] == rounds and not e["rejections"] for e in res["emulated"]))
    return res


def first_accepted_s(device_log: Path, started: float) -> float | None:
    """Seconds from starting the emulated agent to its first accepted report (its log's first "accepted"):
    start-up, check-in, the first plan, and the runtime's import under emulation, which dominates. The Python
    agent's lines start with a date and milliseconds, fedge-native's with HH:MM:SS (local time) only."""
    from datetime import datetime, timedelta
    for line in device_log.read_text(errors="replace").splitlines():
        if "accepted" in line and "report" in line:
            try:
                t = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                try:
                    hms = datetime.strptime(line[:8], "%H:%M:%S").time()
                except ValueError:
                    return None
                day = datetime.fromtimestamp(started)
                when = datetime.combine(day.date(), hms)
                if when.timestamp() < started - 1:  # past midnight
                    when += timedelta(days=1)
                t = when.timestamp()
            return round(t - started, 1)
    return None


def process_facts(pid: int) -> dict[str, Any]:
    """The emulated native device's process (qemu-aarch64 running fedge-native): the files it has mapped (the
    guest's libraries are mmapped from the rootfs), whether any is torch's, its environment's variable names,
    and its peak RSS (qemu's own included)."""
    facts: dict[str, Any] = {"pid": pid}
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        files = sorted({ln.split(None, 5)[5] for ln in maps if len(ln.split(None, 5)) == 6 and "/" in ln})
        facts["mapped_libs"] = sorted({os.path.basename(f) for f in files if ".so" in os.path.basename(f)})
        facts["maps_torch"] = any("torch" in f.replace("executorch", "") for f in files)
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        facts["env"] = sorted(e.split(b"=", 1)[0].decode() for e in env if e)
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("VmHWM:"):
                facts["peak_rss_mb"] = round(int(ln.split()[1]) / 1024, 1)
    except (OSError, IndexError) as e:
        facts["error"] = repr(e)
    return facts


def du_bytes(path: Path) -> int | None:
    if not path.exists():
        return None
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def native_facts(pi_dir: Path, fleet: dict[str, Any] | None) -> dict[str, Any]:
    """The native device's install against the Python device's, and whether torch is anywhere near it."""
    rootfs, site = pi_dir / "rootfs", pi_dir / "site"
    manifest = rootfs / "opt" / "fedge-native" / "MANIFEST"
    res: dict[str, Any] = {"prefix": "/opt/fedge-native"}
    libs: dict[str, int] = {}
    for line in manifest.read_text().splitlines():
        kind, size, path = line.split(None, 2)
        if kind == "binary":
            res["binary_bytes"] = int(size)
        else:
            libs[os.path.basename(path)] = int(size)
    res["libs"] = libs
    res["executorch_runtime_bytes"] = sum(v for k, v in libs.items() if k.startswith("libexecutorch"))
    res["libmosquitto_bytes"] = sum(v for k, v in libs.items() if k.startswith("libmosquitto"))
    res["install_bytes"] = res["binary_bytes"] + sum(libs.values())
    res["python_device_install_bytes"] = du_bytes(site)
    if site.exists():  # the Python device's biggest parts
        parts = {"torch": [site / "torch"], "nvidia_cuda_wheels": [site / "nvidia"], "executorch": [site / "executorch"],
                 "triton": [site / "triton"]}
        res["python_device_breakdown_bytes"] = {k: sum(du_bytes(p) or 0 for p in ps) for k, ps in parts.items()}
    if res["python_device_install_bytes"]:
        res["python_over_native"] = round(res["python_device_install_bytes"] / res["install_bytes"], 1)
    res["base_rootfs_bytes"] = du_bytes(rootfs)  # what both share: libc, libstdc++, libssl (and python3)
    # torch anywhere: in the install, in the rootfs (the site/ with torch is a separate directory, given to the
    # Python device by PYTHONPATH only), in the process's environment or its mapped files
    found = [str(p) for p in (rootfs / "opt" / "fedge-native").rglob("*torch*") if "executorch" not in p.name]
    found += [str(p) for p in (rootfs / "usr").rglob("*torch*") if "executorch" not in p.name]
    proc = {}
    for e in (fleet or {}).get("emulated", []):
        if e.get("runtime") == "native":
            proc = e.get("process", {})
            res["accepted_rounds"] = e["accepted_rounds"]
            res["first_report_s"] = e["first_report_s"]
    res["torch_files_in_env"] = found
    res["process"] = proc
    res["torch_in_env"] = bool(found or proc.get("maps_torch") or "PYTHONPATH" in proc.get("env", [])
                               or not proc)  # no process facts: not shown to be torch-free
    return res


def du_mb(path: Path) -> float | None:
    if not path.exists():
        return None
    out = subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True).stdout.split()
    return float(out[0]) if out else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/emulated_pi.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", default=os.environ.get("FEDGE_PI_CPU", "cortex-a76"),
                    help="emulated core: cortex-a76 (Pi 5), cortex-a72 (Pi 4), cortex-a53, max")
    ap.add_argument("--runtimes", default="executorch,torch", help="runtimes whose suite runs in the emulated Pi")
    ap.add_argument("--emulated", default="executorch,torch,native",
                    help="one emulated device agent per runtime listed (comma list; empty: no fleet); native: "
                         "the C++ device of clients/native, cross-compiled")
    ap.add_argument("--host-devices", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--suite-timeout", type=float, default=1200.0)
    ap.add_argument("--fleet-timeout", type=float, default=1200.0)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # the coordinator's ExecuTorch export (host side, first run only) is noisy and not what is measured here
    logging.getLogger("torchao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    t0 = time.time()
    res: dict[str, Any] = {"runtimes": {}, "rounds_completed": 0, "wall_s": None, "cpu": a.cpu,
                           "host": platform.machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "loadavg_start": os.getloadavg()}
    if res["loadavg_start"][0] > 1.0:
        say(f"load average {res['loadavg_start'][0]:.1f} before starting: other work on this machine will "
            "inflate the times")
    say(f"setup ({SCRIPT.relative_to(ROOT)} setup)")
    try:
        res["setup_s"] = setup(a.cpu)
    except SetupFailed as e:  # nothing else can run: why, and the script's last lines (stdout and stderr)
        say(f"setup failed: {e}; its last lines:")
        print("\n".join(f"    {ln}" for ln in e.tail or ["(no output)"]))
        res |= {"error": str(e), "setup_tail": e.tail, "wall_s": round(time.time() - t0, 1)}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
        print("FAILED")
        return 1
    emulated = [r for r in a.emulated.split(",") if r]
    if "native" in emulated:
        say(f"the native device ({SCRIPT.relative_to(ROOT)} build-native)")
        try:
            res["setup_s"].update(setup(a.cpu, "build-native"))
        except SetupFailed as e:  # clients/native does not build: the rest still runs, the result is FAILED
            say(f"no native device: {e}; its last lines:")
            print("\n".join(f"    {ln}" for ln in e.tail or ["(no output)"]))
            res["native"] = {"error": str(e), "setup_tail": e.tail, "torch_in_env": None}
            emulated.remove("native")
    res["cold"] = any(k in res["setup_s"] for k in ("download", "install", "debootstrap", "et_aarch64", "arm64_debs"))
    qemu = subprocess.run(["qemu-aarch64-static", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    res["qemu"] = qemu
    if not a.skip_suite:
        for rt in [r for r in a.runtimes.split(",") if r]:
            res["runtimes"][rt] = run_suite(rt, a.cpu, a.suite_timeout)
    if emulated:
        t1 = time.time()
        res["fleet"] = run_fleet(emulated, a.host_devices, a.rounds, a.cpu, a.fleet_timeout)
        res["fleet"]["total_s"] = round(time.time() - t1, 1)
        res["rounds_completed"] = res["fleet"]["rounds_completed"]
    pi_dir = ROOT / "runs" / "emulated-pi"
    res["disk_mb"] = {k: du_mb(pi_dir / k) for k in ("rootfs", "wheels", "site", "native")}
    if "native" in emulated:
        res["native"] = native_facts(pi_dir, res.get("fleet"))
    res["wall_s"] = round(time.time() - t0, 1)
    res["loadavg_end"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    ok = all(r["suite"] == "pass" for r in res["runtimes"].values()) and res.get("fleet", {}).get("ok", True)
    if "native" in res and "error" in res["native"]:
        ok = False
        print(f"native      not built: {res['native']['error']}")
    elif "native" in res:
        ok = ok and res["native"]["torch_in_env"] is False
        n = res["native"]
        print(f"native      install {n['install_bytes'] / 1e6:.1f} MB (binary {n['binary_bytes'] / 1e6:.1f} MB) vs the "
              f"Python device's {(n['python_device_install_bytes'] or 0) / 1e6:.0f} MB; torch in its environment: "
              f"{n['torch_in_env']}")
    for rt, r in res["runtimes"].items():
        print(f"{rt:<11} suite {r['suite']:<4}  step {r.get('step_ms')} ms (mlp)  {r.get('step_ms_by_model')}  "
              f"{r['suite_s']} s")
    if "fleet" in res:
        f = res["fleet"]
        print(f"fleet       {f['rounds_completed']}/{f['rounds_planned']} rounds, {f.get('wall_s')} s, accuracy "
              f"{f['accuracy']}, emulated: " + ", ".join(f"{e['id']} ({e['runtime']}) accepted in "
                                                     f"{e['accepted_rounds']} rounds" for e in f["emulated"]))
    print(f"setup {res['setup_s']}  disk MB {res['disk_mb']}  wall {res['wall_s']} s  -> {a.out}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
