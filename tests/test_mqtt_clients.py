"""MqttLink on its two MQTT clients, libmosquitto (C, through ctypes: edge/runtime/libmosquitto.py) and paho, over
a private Mosquitto: what a device and the coordinator rely on, the same on both."""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from coordinator.broker import Mosquitto
from edge.runtime import libmosquitto
from edge.runtime.mqtt import BrokerAddress, MqttLink


class Inbox:
    def __init__(self, fail_on: bytes | None = None):
        self.got: list[tuple[str, bytes]] = []
        self.fail_on = fail_on
        self.lock = threading.Lock()

    def on_connected(self, link, now):
        pass

    def on_disconnected(self, link, now):
        pass

    def on_message(self, link, topic, payload, now):
        if payload == self.fail_on:
            raise RuntimeError("this handler fails on this message")
        with self.lock:
            self.got.append((topic, payload))

    def on_tick(self, link, now):
        pass


def subscribed(tx: MqttLink, inbox: Inbox, topic: str) -> None:
    """Wait until the broker delivers ``topic`` to ``inbox``'s link: a link is connected before its SUBSCRIBE is
    processed, and a publish on another connection may overtake it."""
    def probe():
        tx.call_soon(lambda: tx.publish(topic, b"probe"))
        return wait_for(lambda: any(p == b"probe" for _t, p in inbox.got), 0.2)
    assert wait_for(probe, 10)
    time.sleep(0.1)  # the last probes' deliveries
    with inbox.lock:
        inbox.got.clear()


def wait_for(cond, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def use_libmosquitto(monkeypatch) -> None:
    """Links made now take libmosquitto. CI installs it (.ci/run: libmosquitto-dev), and there its absence fails;
    elsewhere these cases skip, as the native device's do."""
    monkeypatch.delenv("FEDGE_MQTT_CLIENT", raising=False)
    if not libmosquitto.available():
        if os.environ.get("CI"):
            pytest.fail("libmosquitto (Debian's libmosquitto1) is not installed")
        pytest.skip("libmosquitto not installed (apt-get install libmosquitto1)")


@pytest.fixture(params=["libmosquitto", "paho"])
def client(request, monkeypatch):
    """The MQTT client links get (FEDGE_MQTT_CLIENT is read when a link is made)."""
    if request.param == "paho":
        monkeypatch.setenv("FEDGE_MQTT_CLIENT", "paho")
    else:
        use_libmosquitto(monkeypatch)
    return request.param


def test_messages_arrive_whole_and_in_order_and_the_broker_confirms_them(client):
    """A check-in's size and a dense plan's (800 KB) through one broker, QoS 1: every byte, in publishing order,
    and in_flight() (how the coordinator paces its plans) falls to 0 once the broker has confirmed them all."""
    with Mosquitto() as b:
        inbox = Inbox()
        addr = BrokerAddress.parse(b.url)
        rx = MqttLink(addr, "rx", inbox, subscriptions=["t/rx"]).start()
        tx = MqttLink(addr, "tx", Inbox(), subscriptions=["t/tx"]).start()
        try:
            assert rx.backend == tx.backend == client
            assert rx.connected.wait(10) and tx.connected.wait(10)
            subscribed(tx, inbox, "t/rx")
            before = tx.bytes_published
            sent = [bytes([i]) * n for i, n in enumerate([100, 800_000, 1, 800_000, 257, 65_536])]
            for p in sent:
                tx.call_soon(lambda p=p: tx.publish("t/rx", p))
            assert wait_for(lambda: len(inbox.got) == len(sent)), len(inbox.got)
            assert [p for _t, p in inbox.got] == sent and {t for t, _p in inbox.got} == {"t/rx"}
            assert tx.bytes_published - before == sum(map(len, sent))
            assert wait_for(lambda: tx.in_flight() == 0)
        finally:
            rx.stop()
            tx.stop()



def test_links_and_the_private_broker_switch_nagles_algorithm_off(client):
    """Every link's socket has TCP_NODELAY, and so has the Mosquitto fedge starts (set_tcp_nodelay): with Nagle's
    algorithm on, an ack or a check-in written after a large report waited for the peer's delayed ACK, and a
    device drawn in consecutive rounds got its plan about 86 ms late (docs/operations.md, "Nagle's algorithm")."""
    import socket
    with Mosquitto() as b:
        assert "set_tcp_nodelay true" in (Path(b.dir) / "mosquitto.conf").read_text().splitlines()
        link = MqttLink(BrokerAddress.parse(b.url), "nd", Inbox(), subscriptions=["t/nd"]).start()
        try:
            assert link.connected.wait(10) and link.backend == client
            sock = link.client.socket()
            fd = sock.fd if client == "libmosquitto" else sock.fileno()
            probe = socket.socket(fileno=os.dup(fd))
            try:
                assert probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            finally:
                probe.close()  # a duplicate of the link's descriptor: closing it leaves the link's open
        finally:
            link.stop()


def test_publishes_from_another_thread_are_all_confirmed(client):
    """MqttLink.publish from a thread other than the link's (the broker's confirmation may then arrive on the
    link's thread before publish() returns): every message arrives and in_flight() falls to 0."""
    with Mosquitto() as b:
        inbox = Inbox()
        addr = BrokerAddress.parse(b.url)
        rx = MqttLink(addr, "rx", inbox, subscriptions=["t/rx"]).start()
        tx = MqttLink(addr, "tx", Inbox(), subscriptions=[]).start()
        try:
            assert rx.connected.wait(10) and tx.connected.wait(10)
            subscribed(tx, inbox, "t/rx")
            sent = [i.to_bytes(2, "big") for i in range(300)]
            for p in sent:
                tx.publish("t/rx", p)
            assert wait_for(lambda: len(inbox.got) == len(sent)), len(inbox.got)
            assert sorted(p for _t, p in inbox.got) == sent
            assert wait_for(lambda: tx.in_flight() == 0), tx.in_flight()
        finally:
            rx.stop()
            tx.stop()


def test_a_link_killed_without_disconnect_leaves_its_last_will(client):
    """kill() (the tests' 'device dies') drops the connection without DISCONNECT: the broker publishes the will."""
    with Mosquitto() as b:
        inbox = Inbox()
        addr = BrokerAddress.parse(b.url)
        watcher = MqttLink(addr, "watcher", inbox, subscriptions=["t/status/+"]).start()
        dev = MqttLink(addr, "dev", Inbox(), subscriptions=["t/plan/dev"], will=("t/status/dev", b"offline")).start()
        try:
            assert watcher.connected.wait(10) and dev.connected.wait(10)
            subscribed(dev, inbox, "t/status/probe")
            dev.kill()
            assert wait_for(lambda: ("t/status/dev", b"offline") in inbox.got), inbox.got
        finally:
            watcher.stop()


def test_a_handler_that_raises_loses_only_its_own_message(monkeypatch, caplog):
    """libmosquitto calls the handler from C, where an exception cannot go: it is logged, the message is
    acknowledged, and the link goes on receiving (paho would end the link's thread)."""
    use_libmosquitto(monkeypatch)
    caplog.set_level(logging.ERROR, "fedge.mqtt")
    with Mosquitto() as b:
        inbox = Inbox(fail_on=b"bad")
        addr = BrokerAddress.parse(b.url)
        rx = MqttLink(addr, "rx", inbox, subscriptions=["t/rx"]).start()
        tx = MqttLink(addr, "tx", Inbox(), subscriptions=[]).start()
        try:
            assert rx.backend == "libmosquitto"
            assert rx.connected.wait(10) and tx.connected.wait(10)
            subscribed(tx, inbox, "t/rx")
            for p in (b"one", b"bad", b"two"):
                tx.call_soon(lambda p=p: tx.publish("t/rx", p))
            assert wait_for(lambda: len(inbox.got) == 2)
            assert [p for _t, p in inbox.got] == [b"one", b"two"]
            assert any("handling a message failed" in r.getMessage() for r in caplog.records)
            assert rx._thread.is_alive()
        finally:
            rx.stop()
            tx.stop()


def test_a_publish_before_connecting_survives_a_move_to_a_new_client_id(monkeypatch):
    """A QoS 1 publish made while disconnected is sent once connected, and reinitialise (the coordinator's move
    to a new client id when another client keeps taking its own) queues the unconfirmed ones again."""
    use_libmosquitto(monkeypatch)
    with Mosquitto() as b:
        inbox = Inbox()
        rx = MqttLink(BrokerAddress.parse(b.url), "rx", inbox, subscriptions=["t/rx"]).start()
        tx = MqttLink(BrokerAddress.parse(b.url), "tx", Inbox(), subscriptions=[]).start()
        try:
            assert rx.connected.wait(10) and tx.connected.wait(10)
            subscribed(tx, inbox, "t/rx")
            c = libmosquitto.Client("old-id", clean_session=False)
            info = c.publish("t/rx", b"queued while disconnected", qos=1)
            assert not info.is_published()
            c.reinitialise("new-id")
            connected = []
            c.on_connect = lambda *a: connected.append(a[3])
            c.connect("127.0.0.1", b.port, 30)
            assert wait_for(lambda: (c.loop(0.05) or True) and info.is_published(), 10)
            assert connected == [0]
            assert wait_for(lambda: inbox.got == [("t/rx", b"queued while disconnected")])
            c.disconnect()
        finally:
            rx.stop()
            tx.stop()


def test_links_use_paho_where_the_c_client_does_not_serve(monkeypatch, tmp_path):
    """TLS and MQTT 5 (the ingest workers' shared subscriptions) go through paho, as does every link with
    FEDGE_MQTT_CLIENT=paho; a plain MQTT 3.1.1 link takes libmosquitto."""
    use_libmosquitto(monkeypatch)
    plain = BrokerAddress.parse("mqtt://127.0.0.1:1")
    assert MqttLink(plain, "a", Inbox(), subscriptions=[]).backend == "libmosquitto"
    assert MqttLink(plain, "b", Inbox(), subscriptions=[], mqtt5=True).backend == "paho"
    assert MqttLink(BrokerAddress.parse("mqtts://127.0.0.1:1"), "c", Inbox(), subscriptions=[]).backend == "paho"
    monkeypatch.setenv("FEDGE_MQTT_CLIENT", "paho")
    assert MqttLink(plain, "d", Inbox(), subscriptions=[]).backend == "paho"
