"""``fedge fleetsim``: a virtual fleet against a running broker and coordinator."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import time
from pathlib import Path

from edge.runtime.config import ConfigError

log = logging.getLogger("fedge.fleetsim")


def cmd_fleetsim(a: argparse.Namespace) -> int:
    from . import traces as T
    from .fleet import Fleet, SimConfig, spread

    checks = [("--windows", a.windows, a.windows >= 1, "must be at least 1"),
              ("--active-fraction", a.active_fraction, 0 < a.active_fraction <= 1, "must be above 0 and at most 1"),
              ("--dropout", a.dropout, 0 <= a.dropout <= 1, "must be 0 to 1"),
              ("--speedup", a.speedup, a.speedup > 0, "must be above 0"),
              ("--heartbeat", a.heartbeat, a.heartbeat > 0, "must be above 0"),
              ("--connect-rate", a.connect_rate, a.connect_rate > 0, "must be above 0")]
    if not a.trace:
        checks.insert(0, ("--devices", a.devices, a.devices >= 1, "must be at least 1"))
    for flag, value, ok, need in checks:
        if not ok:
            raise ConfigError(f"{flag} = {value}: {need}")
    if a.trace and not Path(a.trace).is_file():
        raise ConfigError(f"--trace {a.trace}: no such file")
    if not a.broker.startswith(("mqtt://", "tcp://")) and "://" in a.broker:
        raise ConfigError(f"--broker = {a.broker!r}: the fleet simulator speaks plain MQTT (mqtt://host:port)")
    try:
        if a.trace:
            traces = T.load(a.trace)
        else:
            traces = T.generate(a.devices, seed=a.seed, compute_ms=a.compute_ms, kbps=a.kbps, period_s=a.period,
                                windows=a.windows, active_fraction=a.active_fraction, dropout=a.dropout)
        cfg = SimConfig(broker=a.broker, fleet=a.fleet, speedup=a.speedup, runtime=a.runtime,
                        heartbeat_s=a.heartbeat, connect_per_s=a.connect_rate, seed=a.seed)
        fleet = Fleet(traces, cfg)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if a.save_trace:
        T.save(traces, a.save_trace)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {len(traces)} virtual devices -> {a.broker} (fleet {a.fleet}, "
          f"speedup {a.speedup:g})", flush=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, fleet.stop)
        await fleet.run(a.duration)

    t0 = time.time()
    asyncio.run(main())
    st = fleet.stats
    heart = [t for t, c, _ in st.checkins if c == "heartbeat"]
    out = {"devices": len(traces), "wall_s": time.time() - t0, "stats": st.summary(),
           "heartbeat_spread": spread(heart, fleet.all_connected_at or t0, time.time())}
    print(json.dumps(out, indent=1), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fleetsim", help="run many virtual devices (the real agent core, synthetic training) against "
                                        "a broker and coordinator")
    f.add_argument("--broker", default="mqtt://127.0.0.1:1883", help="the broker the coordinator is on")
    f.add_argument("--fleet", default="default", help="the coordinator's fleet name")
    f.add_argument("--trace", help="a trace file (docs/fleetsim.md); else traces are generated")
    f.add_argument("--save-trace", metavar="PATH", help="write the traces used to PATH")
    f.add_argument("--devices", type=int, default=100, help="generated devices")
    f.add_argument("--seed", type=int, default=0, help="seeds the generated traces")
    f.add_argument("--compute-ms", type=float, default=20.0, help="median inference ms per sample (lognormal)")
    f.add_argument("--kbps", type=float, default=5000.0, help="median link kbit/s (lognormal)")
    f.add_argument("--period", type=float, default=3600.0, help="availability period, trace seconds")
    f.add_argument("--windows", type=int, default=2, help="available windows per period")
    f.add_argument("--active-fraction", type=float, default=1.0, help="fraction of each slot available (1: always)")
    f.add_argument("--dropout", type=float, default=0.0, help="chance a device vanishes during a plan")
    f.add_argument("--speedup", type=float, default=1.0, help="trace seconds per wall second")
    f.add_argument("--runtime", default="torch", help="the runtime capability the devices declare")
    f.add_argument("--heartbeat", type=float, default=15.0, help="idle check-in interval, s")
    f.add_argument("--connect-rate", type=float, default=500.0, help="connections opened per second")
    f.add_argument("--duration", type=float, help="stop after this many seconds (default: until interrupted)")
    f.add_argument("--out", help="write the devices' figures (JSON) here")
    f.set_defaults(fn=cmd_fleetsim)
