"""A client that connects with the coordinator's client id takes it off the broker (issue #30: 510 kicks, no
round for 41 s, nothing logged). The link notices connections lost soon after they were made, says so at
default verbosity, and (the coordinator's) moves to a new client id the kicker does not know."""
from __future__ import annotations

import logging
import threading
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.broker import Mosquitto, mosquitto_binary
from edge.runtime.mqtt import BrokerAddress, MqttLink

pytestmark = [pytest.mark.mosquitto, pytest.mark.skipif(mosquitto_binary() is None, reason="mosquitto not installed")]


class Counter:
    def __init__(self):
        self.connects = self.drops = 0
        self.got: list[str] = []

    def on_connected(self, link, now):
        self.connects += 1

    def on_disconnected(self, link, now):
        self.drops += 1

    def on_message(self, link, topic, payload, now):
        self.got.append(topic)

    def on_tick(self, link, now):
        pass


def kicker(port: int, client_id: str, stop: threading.Event, every_s: float = 0.1) -> list[int]:
    """Connect with ``client_id`` again and again (each connection takes the id over), as in the issue."""
    n = [0]

    def run():
        while not stop.is_set():
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
            try:
                c.connect("127.0.0.1", port)
                c.loop(0.05)
                n[0] += 1
            except OSError:
                pass
            stop.wait(every_s)
            try:
                c.socket() and c.socket().close()
            except OSError:
                pass
    threading.Thread(target=run, daemon=True).start()
    return n


@pytest.mark.parametrize("new_id", [True, False])
def test_a_link_taken_off_the_broker_again_and_again_says_so_and_moves_to_a_new_id(new_id, caplog):
    caplog.set_level(logging.WARNING, "fedge.mqtt")
    with Mosquitto() as b:
        h = Counter()
        link = MqttLink(BrokerAddress.parse(b.url), "fedge-coordinator-f-abc", h, subscriptions=["t/#"],
                        clean_session=False, tick_s=0.05, new_id_on_takeover=new_id).start()
        assert link.connected.wait(10)
        stop = threading.Event()
        kicks = kicker(b.port, "fedge-coordinator-f-abc", stop)
        time.sleep(8.0)
        # after the move, the link stays connected and hears what is published
        pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pub")
        pub.connect("127.0.0.1", b.port)
        pub.loop_start()
        drops_before = h.drops
        for i in range(20):
            pub.publish("t/x", b"1", qos=1)
            time.sleep(0.1)
        time.sleep(1.0)
        stop.set()
        drops = h.drops  # (before our own disconnect)
        pub.loop_stop()
        link.stop()
    warnings = [r.getMessage() for r in caplog.records if "taken off the broker" in r.getMessage()]
    assert warnings and "another client is connecting with this client id" in warnings[0]
    assert kicks[0] > 20
    if new_id:
        assert link.client_id.startswith("fedge-coordinator-f-abc-") and link.takeovers == 1
        assert drops == drops_before and drops <= 4, drops  # not kicked once it moved
        assert len(h.got) == 20
    else:  # the id stays (a device's, say): it keeps reconnecting, and the warning is not repeated for every kick
        assert link.client_id == "fedge-coordinator-f-abc" and drops > 10
        assert len(warnings) <= 2
