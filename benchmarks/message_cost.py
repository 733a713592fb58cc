"""What one MQTT message costs fedge's MQTT adapter: with and without the allocator thresholds, and on each of
its two MQTT clients.

``python benchmarks/message_cost.py [--repeats 3] [--quick]`` writes ``runs/bench/message_cost.json``.

Two :class:`edge.runtime.mqtt.MqttLink` links (one network thread each, as a device and the coordinator have) on
a private Mosquitto: one publishes N messages of a size at QoS 1, the other receives them. Per message: the CPU
of the process (both links, both directions, the publishing loop) and its minor page faults, at 100 B (a
check-in), 256 KB (a chunk at the default ``chunk_bytes`` before it became 1020 KiB) and 800 KB (a whole dense
plan of a 200k-parameter model). Each configuration runs in a fresh child process, alternating, ``--repeats``
times; the table holds the medians:

- ``default``: glibc's own thresholds (``FEDGE_MALLOC_TUNE=0``), the links' own client (libmosquitto where
  installed);
- ``tuned``: what every fedge process runs with (edge/runtime/allocator.py: ``keep_large_buffers``), the same client;
- ``paho``: tuned, with every link on paho-mqtt (``FEDGE_MQTT_CLIENT=paho``), the pure-Python client.

The ratios default/tuned and paho/tuned are measured in one run. The CPU is a property of the machine; the page
faults are not.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "runs" / "bench" / "message_cost.json"
SIZES = ((100, 2000), (256 * 1024, 200), (800 * 1024, 60))  # (bytes, messages)


class _Counter:
    def __init__(self) -> None:
        self.n, self.want, self.done = 0, 0, threading.Event()

    def on_connected(self, *a) -> None: ...
    def on_disconnected(self, *a) -> None: ...
    def on_tick(self, *a) -> None: ...

    def on_message(self, link, topic, payload, now) -> None:
        self.n += 1
        if self.n == self.want:
            self.done.set()


def measure(scale: float) -> dict:
    """In this process: each size through two links; CPU ms and page faults per message."""
    from coordinator.broker import start_broker
    from edge.runtime import allocator
    from edge.runtime.mqtt import BrokerAddress, MqttLink

    broker = start_broker("mosquitto")
    out: dict = {}
    try:
        addr = BrokerAddress.parse(broker.url)
        rx, tx = _Counter(), _Counter()
        links = [MqttLink(addr, "mc-rx", rx, subscriptions=["mc/#"]).start(),
                 MqttLink(addr, "mc-tx", tx, subscriptions=[]).start()]
        for link in links:
            if not link.connected.wait(10):
                raise TimeoutError(f"no connection to {broker.url}")
        time.sleep(0.3)  # both subscribed
        out["tuned"] = bool(allocator._done)
        out["client"] = links[0].backend
        for size, n in SIZES:
            n = max(5, int(n * scale))
            payload = os.urandom(size)
            rx.n, rx.want = 0, n
            rx.done.clear()
            c0, f0, w0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.time()
            for i in range(n):
                links[1].client.publish(f"mc/{i}", payload, qos=1)
            if not rx.done.wait(120):
                raise TimeoutError(f"{rx.n} of {n} messages of {size} bytes arrived")
            out[str(size)] = {"messages": n, "cpu_ms": 1e3 * (time.process_time() - c0) / n,
                              "wall_ms": 1e3 * (time.time() - w0) / n,
                              "page_faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n}
        for link in links:
            link.stop()
    finally:
        broker.stop()
    return out


def _child(tune: bool, scale: float, client: str = "") -> dict:
    env = dict(os.environ, FEDGE_MALLOC_TUNE="1" if tune else "0", FEDGE_MQTT_CLIENT=client)
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, __file__, "--child", str(scale)], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"child failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/message_cost.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration, alternating (default 3)")
    ap.add_argument("--quick", action="store_true", help="a fifth of the messages, one repeat")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--child", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        print(json.dumps(measure(a.child)))
        return 0
    scale, repeats = (0.2, 1) if a.quick else (1.0, max(1, a.repeats))
    runs: dict[str, list[dict]] = {"default": [], "tuned": [], "paho": []}
    for _ in range(repeats):
        runs["default"].append(_child(False, scale))
        runs["tuned"].append(_child(True, scale))
        runs["paho"].append(_child(True, scale, "paho"))
    if not all(r["tuned"] for r in runs["tuned"]):
        print("note: the allocator thresholds could not be set here (not glibc?): both columns are the default")
    res: dict = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "libc": "-".join(platform.libc_ver()), "repeats": repeats,
                 "client": runs["tuned"][0]["client"], "sizes": {}}
    if res["client"] == "paho":
        print("note: libmosquitto is not installed here: every column is paho")
    lines = [f"client: {res['client']} (default, tuned), paho (paho)",
             f"{'bytes':>8} {'CPU ms/msg default':>19} {'tuned':>7} {'paho':>7} {'default/tuned':>14} "
             f"{'paho/tuned':>11} {'faults/msg default':>19} {'tuned':>7} {'paho':>7}"]
    for size, _n in SIZES:
        row = {}
        for cfg, rs in runs.items():
            row[cfg] = {k: statistics.median(r[str(size)][k] for r in rs) for k in ("cpu_ms", "wall_ms", "page_faults")}
            row[cfg]["cpu_ms_each"] = [r[str(size)]["cpu_ms"] for r in rs]
        row["cpu_ratio_default_to_tuned"] = row["default"]["cpu_ms"] / max(1e-9, row["tuned"]["cpu_ms"])
        row["cpu_ratio_paho_to_tuned"] = row["paho"]["cpu_ms"] / max(1e-9, row["tuned"]["cpu_ms"])
        res["sizes"][str(size)] = row
        lines.append(f"{size:>8} {row['default']['cpu_ms']:>19.3f} {row['tuned']['cpu_ms']:>7.3f} "
                     f"{row['paho']['cpu_ms']:>7.3f} {row['cpu_ratio_default_to_tuned']:>13.2f}x "
                     f"{row['cpu_ratio_paho_to_tuned']:>10.2f}x {row['default']['page_faults']:>19.1f} "
                     f"{row['tuned']['page_faults']:>7.1f} {row['paho']['page_faults']:>7.1f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
