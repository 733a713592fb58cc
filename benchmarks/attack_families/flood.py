"""Check-in flood: on an anonymous broker, a client publishes well-formed check-ins for thousands of fake device
ids within about 2 s, each once (issue #30: 20,000 ids registered 14,928, and rounds were then abandoned with 0
reports for ~16 hours, since registrations never expired).

The run's expiry is shortened to fit in minutes (``[rounds] stale_after_s``, ``forget_after_s``; the defaults are
60 s and 3,600 s). Figures: fakes sent and registered (durable rows at the peak), how long after the flood the
selection was clean (the first attempt from which on no fake is selected) against its bound (1.5 *
stale_after_s: a new device's first pace is at most stale_after_s / 2, plus an attempt's round_timeout_s during
which fakes selected before may still hold it), the durable rows at the end, and rounds committed against a clean
run of the same seed and duration. ``holds``: the selection was clean within the bound and the registry shrank
back to the honest devices and the fakes selected before the expiry (those are forgotten later: their plans'
deadlines set when they are expected)."""
from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from benchmarks.attack_families._fleet import query, run_fleet, selected_rounds
from edge.protocol import wire

FAMILY = "flood"
CAPS = {"runtime": "torch", "charging": True, "network": "wifi", "idle": True}


def run(work: Path, broker_url: str, seed: int, quick: bool) -> dict:
    fakes = 2000 if quick else 20_000
    stale, forget, timeout = (10.0, 20.0, 10.0) if quick else (15.0, 30.0, 10.0)
    duration = 45.0 if quick else 70.0
    kw = {"stale_after_s": stale, "forget_after_s": forget, "round_timeout_s": timeout}
    clean = run_fleet(work / "clean", broker_url, seed, fleet=f"flc{seed}", duration_s=duration, rounds_kw=kw)
    peak = [0]

    def attack(ctx):
        u = urlparse(ctx["url"])
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"flooder{seed}")
        c.max_queued_messages_set(0)
        c.connect(u.hostname, u.port)
        c.loop_start()
        t = time.time()
        for i in range(fakes):
            d = f"fake{i:05d}"
            c.publish(wire.topic(ctx["fleet"], "checkin", d), wire.encode(wire.CheckIn(d, CAPS, [], 30)), qos=0)
            if i % 500 == 499:
                time.sleep(max(0.0, t + 2.0 * (i + 1) / fakes - time.time()))  # ~2 s for the lot
        sent_s = time.time() - t
        ctx["flood_at"] = t

        def stop():
            c.loop_stop()
            c.disconnect()
            return {"flood_at": t, "flood_s": round(sent_s, 2)}
        return stop

    def watch_attack(ctx):  # samples the registry's durable rows while the attacked run goes on
        stop_flood = attack(ctx)
        from benchmarks.attack_families._fleet import loop_in_thread

        def body(ev):
            while not ev.wait(0.5):
                n = query(ctx["state"], "SELECT COUNT(*) FROM devices WHERE device_id LIKE 'fake%'")
                if n:
                    peak[0] = max(peak[0], n[0][0])
        ev, th = loop_in_thread(body)

        def stop():
            ev.set()
            th.join(5)
            return stop_flood()
        return stop

    hit = run_fleet(work / "attacked", broker_url, seed, fleet=f"fla{seed}", duration_s=duration, rounds_kw=kw,
                    attack=watch_attack)
    flood_at = hit["flood_at"]
    attempts = [(t, sel) for t, sel, _ in selected_rounds(hit["state"]) if t >= flood_at]
    dirty = [t for t, sel in attempts if any(d.startswith("fake") for d in sel)]
    clean_from = next((t for t, _ in attempts if t > max(dirty, default=flood_at)), None)
    clean_after = None if clean_from is None else clean_from - flood_at
    bound = 1.5 * stale + timeout + 2.0 + hit["flood_s"]
    fakes_selected = {d for t, sel in attempts for d in sel if d.startswith("fake")}
    rows_end = query(hit["state"], "SELECT COUNT(*) FROM devices WHERE device_id LIKE 'fake%'")
    rows_end = rows_end[0][0] if rows_end else -1
    return {"holds": clean_after is not None and clean_after <= bound and 0 <= rows_end <= len(fakes_selected),
            "fakes_sent": fakes, "flood_s": hit["flood_s"], "fakes_registered_peak": peak[0],
            "stale_after_s": stale, "forget_after_s": forget, "selection_clean_after_s":
            None if clean_after is None else round(clean_after, 1), "selection_clean_bound_s": round(bound, 1),
            "attempts_with_fakes": len(dirty), "fakes_selected": len(fakes_selected), "fake_rows_at_end": rows_end,
            "duration_s": duration, "rounds_clean": clean["rounds"], "rounds_attacked": hit["rounds"]}
