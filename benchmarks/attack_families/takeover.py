"""Takeover: a client connects again and again (every 0.1 s) with the coordinator's MQTT client id, each time
taking the id (and its session) over, on an anonymous Mosquitto (one with ``fedge credentials``' broker.conf
binds client ids to user names and is not open to this at all: tests/test_credentials.py).

The kicker is given the coordinator's real client id (read from the state, as if it had leaked: since issue #30
the id ends in a secret, so a device can no longer derive it from the run id in its task ids; the guessable
``fedge-coordinator-<fleet>-<run id>`` is kicked too and must cost nothing). Figures: rounds committed in the
same time, attacked and clean (same seed), the kicker's connections, and whether the coordinator warned.
``holds``: at most 20% of the clean run's rounds lost, and the warning logged at default verbosity."""
from __future__ import annotations

from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from benchmarks.attack_families._fleet import loop_in_thread, meta, run_fleet

FAMILY = "takeover"


def _kicker(url: str, ids: list[str], every_s: float) -> tuple[callable, list[int]]:
    from urllib.parse import urlparse
    u = urlparse(url)
    n = [0]

    def body(stop):
        i = 0
        while not stop.is_set():
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=ids[i % len(ids)])
            i += 1
            try:
                c.connect(u.hostname, u.port)
                c.loop(0.05)  # sends CONNECT: the broker hands it the id, dropping its holder
                n[0] += 1
            except OSError:
                pass
            stop.wait(every_s)
            s = c.socket()
            if s is not None:
                s.close()
    stop, t = loop_in_thread(body)

    def halt():
        stop.set()
        t.join(5)
    return halt, n


def run(work: Path, broker_url: str, seed: int, quick: bool) -> dict:
    duration = 40.0 if quick else 60.0
    clean = run_fleet(work / "clean", broker_url, seed, fleet=f"tkc{seed}", duration_s=duration)

    def attack(ctx):
        st, fleet = ctx["state"], ctx["fleet"]
        run_id = meta(st, "run_id")
        real = f"fedge-coordinator-{fleet}-{run_id}-{meta(st, 'secret:client_id')}"
        guessable = f"fedge-coordinator-{fleet}-{run_id}"
        halt, n = _kicker(ctx["url"], [real, guessable], 0.05)  # each id every 0.1 s

        def stop():
            halt()
            return {"kicker_connections": n[0]}
        return stop

    hit = run_fleet(work / "attacked", broker_url, seed, fleet=f"tka{seed}", duration_s=duration, attack=attack)
    warned = [ln for ln in hit["log"].splitlines() if "taken off the broker" in ln]
    lost = 1.0 - hit["rounds"] / max(1, clean["rounds"])
    return {"holds": lost <= 0.20 and bool(warned), "duration_s": duration, "rounds_clean": clean["rounds"],
            "rounds_attacked": hit["rounds"], "rounds_lost_fraction": round(lost, 3),
            "kicker_connections": hit.get("kicker_connections", 0), "coordinator_warnings": len(warned),
            "first_warning": warned[0][-400:] if warned else ""}
