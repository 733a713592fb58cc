"""Thin paho-mqtt adapters. All protocol decisions live in the sans-I/O cores; this only moves bytes.

:class:`MqttLink` owns one paho client and one network thread: it connects with exponential backoff and
full jitter (paho's own reconnect has no jitter), registers the last will, re-subscribes on every
connect, and hands every event to a handler *on its own thread*, so the cores need no locks.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, Protocol
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from .backoff import Backoff

log = logging.getLogger("fedge.mqtt")


@dataclass
class BrokerAddress:
    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> "BrokerAddress":
        u = urlparse(url if "://" in url else f"mqtt://{url}")
        if u.scheme not in ("mqtt", "tcp"):
            raise ValueError(f"unsupported broker scheme {u.scheme!r} (use mqtt://host:port)")
        return cls(u.hostname or "127.0.0.1", u.port or 1883, u.username, u.password)

    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"


class LinkHandler(Protocol):
    def on_connected(self, link: "MqttLink", now: float) -> None: ...
    def on_disconnected(self, link: "MqttLink", now: float) -> None: ...
    def on_message(self, link: "MqttLink", topic: str, payload: bytes, now: float) -> None: ...
    def on_tick(self, link: "MqttLink", now: float) -> None: ...


class MqttLink:
    def __init__(self, broker: BrokerAddress, client_id: str, handler: LinkHandler, *, subscriptions: list[str],
                 will: tuple[str, bytes] | None = None, clean_session: bool = True, keepalive: int = 30,
                 tick_s: float = 0.2, backoff: Backoff | None = None, max_inflight: int = 100):
        self.broker, self.handler, self.subscriptions, self.tick_s = broker, handler, subscriptions, tick_s
        self.client_id = client_id
        self.backoff = backoff or Backoff(0.2, 30.0)
        self.keepalive = keepalive
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean_session,
                        protocol=mqtt.MQTTv311)
        if broker.username:
            c.username_pw_set(broker.username, broker.password)
        if will:
            c.will_set(will[0], will[1], qos=1, retain=True)
        c.max_inflight_messages_set(max_inflight)
        c.max_queued_messages_set(0)
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.on_disconnect = self._on_disconnect
        self.client = c
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock_open = False
        self.connected = threading.Event()
        self.bytes_published = 0

    # ---- paho callbacks (run on our network thread, inside client.loop())
    def _on_connect(self, client, userdata, flags, reason_code, properties):
        if reason_code.is_failure:
            log.warning("%s: connect refused: %s", self.client_id, reason_code)
            return
        self.backoff.reset()
        for t in self.subscriptions:
            client.subscribe(t, qos=1)
        self.connected.set()
        self.handler.on_connected(self, time.time())

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        self.connected.clear()
        self._sock_open = False
        if not self._stop.is_set():
            log.info("%s: disconnected (%s)", self.client_id, reason_code)
        self.handler.on_disconnected(self, time.time())

    def _on_message(self, client, userdata, msg):
        self.handler.on_message(self, msg.topic, bytes(msg.payload), time.time())

    # ---- API for the handler (network thread) and for other threads
    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=qos, retain=retain)
        self.bytes_published += len(payload)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the network thread (how worker threads hand results back to the core)."""
        self._inbox.put(fn)
        # Wake the network loop now instead of at its next select timeout (up to 50 ms per report).
        # paho keeps a socket pair for exactly this; it is private, so fall back quietly without it.
        w = getattr(self.client, "_sockpairW", None)
        if w is not None:
            try:
                w.send(b"\0")
            except OSError:
                pass

    def start(self) -> "MqttLink":
        self._thread = threading.Thread(target=self._run, name=f"mqtt-{self.client_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout)
        try:
            self.client.disconnect()
        except Exception:  # already gone
            pass

    def kill(self) -> None:
        """Drop the socket without DISCONNECT, so the broker publishes the last will (tests' 'device dies')."""
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        sock = self.client.socket()
        if sock is not None:
            sock.close()

    def _run(self) -> None:
        next_tick = 0.0
        while not self._stop.is_set():
            if not self._sock_open:
                try:
                    self.client.connect(self.broker.host, self.broker.port, self.keepalive)
                    self._sock_open = True
                except OSError as e:
                    delay = self.backoff.next()
                    log.info("%s: broker %s unreachable (%s); retry in %.2fs", self.client_id, self.broker.url(), e, delay)
                    self._stop.wait(delay)
                    continue
            rc = self.client.loop(timeout=0.05)
            if rc != mqtt.MQTT_ERR_SUCCESS and not self._stop.is_set():
                self._sock_open = False
                self.connected.clear()
                delay = self.backoff.next()
                log.info("%s: connection lost (rc=%s); reconnect in %.2fs", self.client_id, rc, delay)
                self._stop.wait(delay)
            while True:
                try:
                    fn = self._inbox.get_nowait()
                except queue.Empty:
                    break
                fn()
            now = time.time()
            if now >= next_tick:
                next_tick = now + self.tick_s
                self.handler.on_tick(self, now)
