"""Per-device credentials on a real Mosquitto: a device can write only its own topics and read only its own
plans; a device that writes on another's topic is not heard, and the run goes on."""
from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.broker import Mosquitto, mosquitto_binary
from coordinator.credentials import write_mosquitto_auth

pytestmark = pytest.mark.skipif(mosquitto_binary() is None, reason="mosquitto not installed")


def client(port, user, pw, topics, got):
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"t-{user}")
    c.username_pw_set(user, pw)
    ready = threading.Event()
    c.on_connect = lambda cl, u, f, rc, p: ([cl.subscribe(t, qos=1) for t in topics], ready.set())
    c.on_message = lambda cl, u, m: got.append((user, m.topic))
    c.connect("127.0.0.1", port)
    c.loop_start()
    assert ready.wait(10)
    time.sleep(0.3)
    return c


@pytest.mark.slow
def test_devices_are_confined_to_their_own_topics(tmp_path):
    paths = write_mosquitto_auth(tmp_path / "auth", "fleet1", ["d1", "d2"],
                                 passwords={"coordinator": "cpw", "d1": "p1", "d2": "p2"})
    assert "pattern write fedge/v1/fleet1/report/%u" in paths["acl"].read_text()
    with Mosquitto(auth=paths) as b:
        got: list = []
        coord = client(b.port, "coordinator", "cpw", ["fedge/v1/fleet1/report/+"], got)
        d1 = client(b.port, "d1", "p1", ["fedge/v1/fleet1/plan/+"], got)  # asks for every device's plans
        d1.publish("fedge/v1/fleet1/report/d1", b"mine", qos=1).wait_for_publish(5)
        d1.publish("fedge/v1/fleet1/report/d2", b"forged", qos=1).wait_for_publish(5)
        coord.publish("fedge/v1/fleet1/plan/d1", b"plan1", qos=1).wait_for_publish(5)
        coord.publish("fedge/v1/fleet1/plan/d2", b"plan2", qos=1).wait_for_publish(5)
        time.sleep(1.0)
        bad = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="t-bad")
        bad.username_pw_set("d2", "wrong")
        refused = []
        bad.on_connect = lambda cl, u, f, rc, p: refused.append(rc.is_failure)
        bad.connect("127.0.0.1", b.port)
        bad.loop_start()
        time.sleep(1.0)
        for c in (coord, d1, bad):
            c.loop_stop()
            c.disconnect()
    assert ("coordinator", "fedge/v1/fleet1/report/d1") in got
    assert ("coordinator", "fedge/v1/fleet1/report/d2") not in got  # the forgery never arrived
    assert ("d1", "fedge/v1/fleet1/plan/d1") in got
    assert ("d1", "fedge/v1/fleet1/plan/d2") not in got  # nor does d1 read d2's plan
    assert refused and all(refused)  # a wrong password is refused (paho may retry)


@pytest.mark.slow
def test_a_device_cannot_take_the_coordinators_client_id(tmp_path):
    """MQTT lets a client that connects with a held client id disconnect the holder; the generated broker
    configuration makes every client id its user name, so a device asking for the coordinator's id (or another
    device's) gets its own, and the coordinator and its ingest workers (each its own user) stay connected."""
    paths = write_mosquitto_auth(tmp_path / "auth", "fleet1", ["d1", "d2"], ingest_workers=2,
                                 passwords={"coordinator": "cpw", "d1": "p1", "d2": "p2", "coordinator-ingest-1": "i1",
                                            "coordinator-ingest-2": "i2"})
    assert "use_username_as_clientid true" in paths["conf"].read_text()
    assert "user coordinator-ingest-1\ntopic read fedge/v1/fleet1/report/#" in paths["acl"].read_text()
    with Mosquitto(auth=paths) as b:
        got: list = []
        drops: dict[str, int] = {}

        def watch(c, name):
            c.on_disconnect = lambda *a: drops.__setitem__(name, drops.get(name, 0) + 1)

        coord = client(b.port, "coordinator", "cpw", ["fedge/v1/fleet1/report/+"], got)
        watch(coord, "coordinator")
        workers = [client(b.port, f"coordinator-ingest-{i}", f"i{i}", ["$share/g/fedge/v1/fleet1/report/+"], got)
                   for i in (1, 2)]
        for i, w in enumerate(workers, 1):
            watch(w, f"ingest-{i}")
        d2 = client(b.port, "d2", "p2", ["fedge/v1/fleet1/plan/d2"], got)
        watch(d2, "d2")
        rogues = []
        for cid in ("coordinator", "t-coordinator", "d2", "t-d2", "coordinator-ingest-1"):
            r = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid)
            r.username_pw_set("d1", "p1")
            r.connect("127.0.0.1", b.port)
            r.loop_start()
            rogues.append(r)
            time.sleep(0.3)
        time.sleep(0.5)
        d2.publish("fedge/v1/fleet1/report/d2", b"still here", qos=1).wait_for_publish(5)
        workers[0].publish("fedge/v1/fleet1/plan/d2", b"not a worker's to send", qos=1)
        time.sleep(1.0)
        taken = dict(drops)  # before our own disconnects below
        for c in (coord, d2, *workers, *rogues):
            c.loop_stop()
            c.disconnect()
    assert taken == {}, f"clients taken off the broker: {taken}"
    assert ("coordinator", "fedge/v1/fleet1/report/d2") in got
    assert [u for u, t in got if t == "fedge/v1/fleet1/report/d2" and u.startswith("coordinator-ingest-")]
    assert not [t for _u, t in got if "/plan/" in t]  # a worker's user reads reports and sends nothing
