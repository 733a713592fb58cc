"""The coordinator at fleet scale: ``fedge coordinator`` (the daemon, in its own process, as a user runs it) with a
private Mosquitto on loopback and N virtual devices of the fleet simulator (coordinator/fleetsim, one asyncio
process: the real device agent core per device, synthetic updates of the model's shape).

For each fleet size, once with pace steering on and once off, it records: rounds committed and their round
times, reports ingested per second of round time, the coordinator's CPU seconds and peak RSS (``wait4`` rusage of
its process, exact), Mosquitto's CPU, the check-in arrival spread seen at the devices (per-second counts over the
steady state, after every device has connected), and messages lost: reports that never got an answer plus QoS 1
publishes the broker never acknowledged.

    PYTHONPATH=$PWD python benchmarks/fleet_scale.py                       # 1,000 and 10,000 devices
    PYTHONPATH=$PWD python benchmarks/fleet_scale.py --sizes 1000 --rounds 10 --per-round 100
    PYTHONPATH=$PWD python benchmarks/fleet_scale.py --modes 1000:on --append   # training instant: saturation
    PYTHONPATH=$PWD python benchmarks/fleet_scale.py --sizes 300 --per-round 200 --rounds 10 \
        --model 256,512,128,10 --modes 1000:on --out runs/bench/fleet_scale_200k.json [--workers 2]
                                                      # 200k parameters: the daemon's CPU per report

writes ``runs/bench/fleet_scale.json`` (top-level keys ``devices`` and ``messages_lost``: the largest fleet run, and
the sum over every run) and prints a summary. ``--workers N`` runs ``fedge ingest`` workers (``[ingest] shared =
true``) and records their CPU apart from the coordinator's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import start_coordinator, write_fleet_toml  # noqa: E402
from coordinator.broker import Mosquitto  # noqa: E402
from coordinator.fleetsim import traces as T  # noqa: E402
from coordinator.fleetsim.fleet import Fleet, SimConfig, spread  # noqa: E402

OUT = ROOT / "runs/bench/fleet_scale.json"


def _cpu_s(pid: int) -> float:
    """utime + stime of a live process, from /proc (clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_workers(conf: Path, wd: Path, k: int) -> list[tuple[subprocess.Popen, Path]]:
    """``fedge ingest`` workers (``[ingest] shared = true``), each once it is connected: a report published
    before any member of the shared subscription exists would go to nobody."""
    out = []
    for i in range(k):
        log = wd / f"ingest-w{i}.log"
        with open(log, "ab") as f:
            proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "-v", "ingest", "--config", str(conf),
                                     "--name", f"w{i}"], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        out.append((proc, log))
    end = time.time() + 60
    for proc, log in out:
        while b"connected to" not in log.read_bytes():
            if proc.poll() is not None or time.time() > end:
                raise RuntimeError(f"an ingest worker did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
    return out


def _stop_workers(workers: list[tuple[subprocess.Popen, Path]]) -> list[float]:
    """SIGTERM each worker; its CPU seconds (``wait4`` rusage)."""
    cpu = []
    for proc, _ in workers:
        proc.send_signal(signal.SIGTERM)
        _, _, ru = os.wait4(proc.pid, 0)
        cpu.append(ru.ru_utime + ru.ru_stime)
    return cpu


def run_one(n: int, per_round: int, rounds: int, pace: bool, *, sizes: list[int], speedup: float,
            round_timeout: float, max_wall: float, connect_rate: float, workdir: Path, seed: int,
            profile: bool = False, workers: int = 0) -> dict:
    load0 = os.getloadavg()[0]
    wd = workdir / f"n{n}-x{speedup:g}-{'pace' if pace else 'nopace'}{f'-w{workers}' if workers else ''}"
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    fleet_name = f"scale{n}x{speedup:g}{'p' if pace else 'n'}"
    with Mosquitto(max_queued=20000) as broker:
        conf = write_fleet_toml(wd / "fleet.toml", {
            "broker": {"url": broker.url},
            "state": {"path": str(wd / "state.sqlite")},
            "rounds": {"rounds": rounds, "clients_per_round": per_round, "over_selection": 1.3,
                       "round_timeout_s": round_timeout, "selection_timeout_s": 5.0, "fleet": fleet_name,
                       "seed": seed},
            "pace": {"enabled": pace},
            "strategy": {"name": "fedavg", "sizes": sizes, "epochs": 1, "batch_size": 20, "lr": 0.05},
            **({"ingest": {"shared": True}} if workers else {}),
        })
        ingest = _start_workers(conf, wd, workers) if workers else []
        log = wd / "coordinator.log"
        proc = start_coordinator(conf, log, verbose=0)
        # devices connect once the coordinator listens (a check-in published before it subscribed is lost to it)
        end = time.time() + 120
        while b"connected to the broker" not in log.read_bytes():
            if proc.poll() is not None or time.time() > end:
                raise RuntimeError(f"the coordinator did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        t_start = time.time()
        traces = T.generate(n, seed=seed, compute_ms=20.0, kbps=5000.0, samples=(20, 200))
        fleet = Fleet(traces, SimConfig(broker=broker.url, fleet=fleet_name, speedup=speedup,
                                        connect_per_s=connect_rate, seed=seed))
        mosq_cpu0 = _cpu_s(broker.proc.pid)
        rusage = None

        async def main() -> None:
            nonlocal rusage
            task = asyncio.ensure_future(fleet.run())
            end = time.time() + max_wall
            while time.time() < end:
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    rusage = ru
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    break
                await asyncio.sleep(0.2)
            fleet.stop()
            await task

        fleet_cpu0 = time.process_time()
        if profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.runcall(asyncio.run, main())
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        else:
            asyncio.run(main())
        fleet_cpu = time.process_time() - fleet_cpu0
        if rusage is None:  # out of time: stop it as a user would (it writes what it has)
            proc.send_signal(signal.SIGTERM)
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.time() - t_start
        mosq_cpu = _cpu_s(broker.proc.pid) - mosq_cpu0
        worker_cpu = _stop_workers(ingest)
    import sqlite3
    db = sqlite3.connect(str(wd / "state.sqlite"))
    rows = [json.loads(s) for (s,) in db.execute("SELECT summary FROM rounds WHERE status='committed' ORDER BY round")]
    abandoned = db.execute("SELECT COUNT(*) FROM rounds WHERE status='abandoned'").fetchone()[0]
    db.close()
    st = fleet.stats
    t_end = time.time()
    steady = (fleet.all_connected_at or t_end) + 15.0  # one heartbeat interval after the last device connected
    all_ci = [t for t, _, _ in st.checkins]
    hb = [t for t, c, _ in st.checkins if c == "heartbeat"]
    in_flight = sum(1 for d in fleet.devices if d.agent.state == "reporting")
    round_s = [r["wall_s"] for r in rows]
    reports = sum(r["reports"] for r in rows)
    res = {
        "devices": n, "clients_per_round": per_round, "pace": pace, "speedup": speedup, "rounds_target": rounds,
        "rounds_committed": len(rows), "attempts_abandoned": abandoned, "wall_s": wall,
        "connect_s": (fleet.all_connected_at - fleet.started_at) if fleet.all_connected_at else None,
        "round_s": {"median": sorted(round_s)[len(round_s) // 2] if round_s else None,
                    "max": max(round_s) if round_s else None, "all": round_s},
        "reports_committed": reports,
        "reports_per_s": reports / sum(round_s) if round_s else 0.0,
        "coordinator": {"cpu_s": rusage.ru_utime + rusage.ru_stime, "peak_rss_mb": rusage.ru_maxrss / 1024,
                        "exit_code": proc.returncode,
                        "cpu_s_per_report": (rusage.ru_utime + rusage.ru_stime) / reports if reports else None},
        # with workers the coordinator (the leader) reads reports from their inbox; the rest of ingest is theirs
        "ingest_workers": {"n": workers, "cpu_s": worker_cpu,
                           "cpu_s_per_report": sum(worker_cpu) / reports if reports and workers else None},
        "mosquitto_cpu_s": mosq_cpu,
        "fleet_cpu_s": fleet_cpu,  # the simulator's own process (all virtual devices)
        "loadavg_1min": {"start": load0, "end": os.getloadavg()[0]},  # the machine is shared: context
        # per 1 s and per 5 s (the simulator sweeps once a second, later when starved: see fleet.sweep_gap_s)
        "checkin_spread_all": spread(all_ci, steady, t_end),
        "checkin_spread_heartbeats": spread(hb, steady, t_end),
        "checkin_spread_all_5s": spread(all_ci, steady, t_end, 5.0),
        "checkin_spread_heartbeats_5s": spread(hb, steady, t_end, 5.0),
        "messages_lost": st.gave_up + st.unacked_at_end,
        "reports_unanswered_at_end": in_flight,  # sent to a coordinator that had finished: not lost, unanswered
        "accepted_acks_received": st.acks.get("accepted", 0),
        "fleet": st.summary(),
    }
    # every committed report was acked to its device (an accepted report of an abandoned attempt is acked too)
    res["acks_cover_commits"] = res["accepted_acks_received"] >= reports
    print(f"  {n} devices, speedup {speedup:g}, pace {'on ' if pace else 'off'}: {len(rows)}/{rounds} rounds, median round "
          f"{res['round_s']['median'] or 0:.2f} s, {res['reports_per_s']:.0f} reports/s, coordinator "
          f"{res['coordinator']['cpu_s']:.1f} CPU s = {1e3 * (res['coordinator']['cpu_s_per_report'] or 0):.2f} ms a "
          f"report (fleet {fleet_cpu:.0f}, broker {mosq_cpu:.0f}"
          f"{f', {workers} ingest workers {sum(worker_cpu):.1f}' if workers else ''}), peak RSS "
          f"{res['coordinator']['peak_rss_mb']:.0f} MB; "
          f"check-ins/s peak/mean {res['checkin_spread_all']['peak_to_mean']:.2f} "
          f"(mean {res['checkin_spread_all']['mean_per_bin']:.1f}/s), heartbeats per 5 s peak/mean "
          f"{res['checkin_spread_heartbeats_5s']['peak_to_mean']:.2f} (mean "
          f"{res['checkin_spread_heartbeats_5s']['mean_per_bin'] / 5:.1f}/s); lost {res['messages_lost']}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000", help="fleet sizes (comma list)")
    ap.add_argument("--per-round", default="100,1000", help="devices selected a round, per size")
    ap.add_argument("--rounds", default="50,50", help="round target, per size")
    ap.add_argument("--max-wall", default="120,300",
                    help="wall seconds per run, per size: then the coordinator is stopped (SIGTERM) and the rounds it "
                         "committed are what is reported")
    ap.add_argument("--model", default="64,32,10", help="MLP sizes (64-32-10: 2,410 parameters)")
    ap.add_argument("--round-timeout", type=float, default=60.0)
    ap.add_argument("--connect-rate", type=float, default=500.0)
    ap.add_argument("--modes", default="10:on,10:off",
                    help="runs per size as SPEEDUP:PACE (pace on|off); a large speedup makes training instant, so "
                         "rounds go as fast as the coordinator, the broker and the simulator allow")
    ap.add_argument("--append", action="store_true", help="add these runs to an existing fleet_scale.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile the fleet process")
    ap.add_argument("--out", type=Path, default=OUT, help="where the results go (default %(default)s)")
    ap.add_argument("--workers", type=int, default=0,
                    help="ingest workers ([ingest] shared = true, `fedge ingest`): reports reach the coordinator "
                         "through them; their CPU is recorded apart from the coordinator's")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    sizes, per, rounds, walls = ints(a.sizes), ints(a.per_round), ints(a.rounds), [float(x) for x in
                                                                                a.max_wall.split(",")]
    modes = [(float(m.split(":")[0]), m.split(":")[1] == "on") for m in a.modes.split(",")]
    workdir = ROOT / "runs/bench/fleet_scale"
    runs = json.loads(a.out.read_text())["runs"] if a.append and a.out.exists() else []
    for i, n in enumerate(sizes):
        for speedup, pace in modes:
            runs.append(run_one(n, per[i], rounds[i], pace, sizes=ints(a.model), speedup=speedup,
                                round_timeout=a.round_timeout, max_wall=walls[i], connect_rate=a.connect_rate,
                                workdir=workdir, seed=a.seed, profile=a.profile, workers=a.workers))
            runs[-1]["command"] = "python " + " ".join(sys.argv)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(_doc(runs, a), indent=1))
    print(f"wrote {a.out}")
    return 0


def _doc(runs: list[dict], a: argparse.Namespace) -> dict:
    return {"devices": max(r["devices"] for r in runs), "messages_lost": sum(r["messages_lost"] for r in runs),
            "cpus": os.cpu_count(), "model": a.model,
            "commands": list(dict.fromkeys(r.get("command", "") for r in runs)), "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
