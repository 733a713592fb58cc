"""Small helpers the benchmarks share: memory of a process, a least-squares slope, a fleet.toml writer, the
coordinator started as a user starts it, and device agents in this process that record the acks they get.

Memory is read from ``/proc`` (psutil where there is no ``/proc``): the benchmarks sample a coordinator
subprocess's RSS many times a second, and opening a psutil handle per sample costs more than the read.
"""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ memory

def _status_mb(key: str, pid: int | str = "self") -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of ``pid`` (default: this process) in MiB."""
    v = _status_mb("VmRSS", pid or "self")
    if v is None:
        import psutil
        v = psutil.Process(pid).memory_info().rss / 2**20
    return v


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss would carry the parent's peak over a fork)."""
    v = _status_mb("VmHWM")
    if v is None:
        import resource
        v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return v


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, ``clear_refs`` 5), so each round's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (0.0 for fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


# ------------------------------------------------------------------ the coordinator as a user runs it

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for everything a path or a name holds
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {type(v).__name__}")


def write_fleet_toml(path: str | Path, sections: dict[str, dict[str, Any]]) -> Path:
    """``fleet.toml`` from ``{section: {key: value}}`` (keys with value None are left out)."""
    lines = []
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items() if v is not None]
    p = Path(path)
    p.write_text("\n".join(lines) + "\n")
    return p


def start_coordinator(conf: str | Path, log: str | Path, *, verbose: int = 1) -> subprocess.Popen:
    """``fedge coordinator --config fleet.toml`` in a child process, its output appended to ``log``
    (``verbose`` 1: INFO, which logs every round and every restart)."""
    cmd = [sys.executable, "-m", "coordinator.cli", *(["-v"] * verbose), "coordinator", "--config", str(conf)]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def committed_rounds(state: str | Path) -> int:
    """Rounds committed in a coordinator's state, read without disturbing it (a read-only connection:
    ``coordinator.store.Store`` tidies report files on open, which must not race a live coordinator)."""
    try:
        db = sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=1.0)
        try:
            return db.execute("SELECT COUNT(*) FROM rounds WHERE status='committed'").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:  # not created yet, or busy for a moment
        return -1


def wait_until(cond: Callable[[], bool], timeout: float, what: str, poll: float = 0.05) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


# ------------------------------------------------------------------ devices in this process

def honest_device(spec: dict, url: str, executor: Any) -> Any:
    """One device agent from a ``coordinator.simulate.prepare`` spec, training with one torch thread."""
    from edge.runtime.device import device_from_files
    return device_from_files(spec["id"], spec["data"], spec["state"], url, capabilities=spec["caps"],
                             fleet=spec["fleet"], chunk_bytes=spec["chunk_bytes"], executor=executor,
                             trainer_kw={"threads": 1})


class SpyFleet:
    """Device agents in this process, each with its own MQTT client, recording every ack they receive (with
    its arrival time), so a benchmark can hold the coordinator to what it told the devices."""

    def __init__(self, specs: list[dict], url: str, *, threads: int = 2,
                 make: Callable[[dict, str, Any], Any] = honest_device):
        """``make(spec, url, executor)`` builds one device (not started): a scenario's hostile or slowed ones."""
        from edge.protocol import wire
        self.pool = ThreadPoolExecutor(threads)
        self.acks: list[tuple[float, Any]] = []
        self.devs: dict[str, Any] = {}
        for s in specs:
            d = make(s, url, self.pool)
            orig = d.on_message

            def spy(link, topic, payload, now, orig=orig):
                if "/ack/" in topic:
                    try:
                        self.acks.append((time.time(), wire.decode(payload)))
                    except wire.WireError:
                        pass
                orig(link, topic, payload, now)
            d.on_message = spy
            self.devs[s["id"]] = d.start()

    def accepted(self, since: float = 0.0) -> list[tuple[str, str]]:
        """(task, device) of every 'accepted' ack received at or after ``since``."""
        return [(a.task_id, a.device_id) for t, a in list(self.acks) if a.status == "accepted" and t >= since]

    def stop(self) -> None:
        for d in self.devs.values():
            d.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
