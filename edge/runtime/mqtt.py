"""Thin paho-mqtt adapters. All protocol decisions live in the sans-I/O cores; this only moves bytes.

:class:`MqttLink` owns one paho client and one network thread: it connects with exponential backoff and
full jitter (paho's own reconnect has no jitter), registers the last will, re-subscribes on every
connect, and hands every event to a handler *on its own thread*, so the cores need no locks.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, Protocol
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from . import libmosquitto
from .allocator import keep_large_buffers
from .backoff import Backoff

log = logging.getLogger("fedge.mqtt")


@dataclass
class BrokerAddress:
    """Where the broker is and how to talk to it: ``mqtt://[user:password@]host[:1883]`` or, over TLS,
    ``mqtts://...[:8883]`` with the CA that signed the broker's certificate (``ca_file``; the system's
    trust store when absent) and, for brokers that want client certificates, ``cert_file``/``key_file``."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def parse(cls, url: str, *, ca_file: str | None = None, cert_file: str | None = None,
              key_file: str | None = None) -> "BrokerAddress":
        u = urlparse(url if "://" in url else f"mqtt://{url}")
        if u.scheme not in ("mqtt", "tcp", "mqtts", "ssl"):
            raise ValueError(f"unsupported broker scheme {u.scheme!r} in {url!r} (use mqtt://host:port or "
                             "mqtts://host:port)")
        try:
            port = u.port
        except ValueError:
            raise ValueError(f"bad port in broker address {url!r}") from None
        # a missing ':' (mqtt//host) or host (mqtt://:1883) must not become another broker, retried for ever
        if u.path.strip("/") or u.params or u.query or u.fragment:
            raise ValueError(f"a broker address has no path: {url!r} (use mqtt://host:port)")
        if not u.hostname:
            raise ValueError(f"no host in broker address {url!r} (use mqtt://host:port)")
        if port == 0 or (port is None and u.netloc.endswith(":")):
            raise ValueError(f"bad port in broker address {url!r}")
        tls = u.scheme in ("mqtts", "ssl")
        if not tls and (ca_file or cert_file or key_file):
            raise ValueError(f"a CA or client certificate needs an mqtts:// broker address, not {url!r}")
        if bool(cert_file) != bool(key_file):
            raise ValueError("a client certificate needs both cert_file and key_file")
        for f in (ca_file, cert_file, key_file):
            if f and not os.path.isfile(f):
                raise ValueError(f"{f}: no such file")
        return cls(u.hostname, port or (8883 if tls else 1883), u.username, u.password, tls,
                   ca_file, cert_file, key_file)

    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


class LinkHandler(Protocol):
    def on_connected(self, link: "MqttLink", now: float) -> None: ...
    def on_disconnected(self, link: "MqttLink", now: float) -> None: ...
    def on_message(self, link: "MqttLink", topic: str, payload: bytes, now: float) -> None: ...
    def on_tick(self, link: "MqttLink", now: float) -> None: ...
    # optional: ``on_pass_end(link, now)``, called after each pass of the network loop (the messages that
    # were waiting, hand-backs from other threads, maybe a tick): where a handler writes a batch at once


def nodelay(sock) -> None:
    """Switch Nagle's algorithm off on a link's socket (libmosquitto.py does the same, MOSQ_OPT_TCP_NODELAY).
    fedge's small messages (an ack, a check-in) follow large ones (a report, a plan) on the same connection:
    with Nagle on, a small write waits for the peer's acknowledgement of the last segment, which the peer's
    delayed ACK holds up to 40 ms. Measured in benchmarks/round_overhead.py: an ack took a median 40 ms to reach
    its device and the check-in that answered it 46 ms to come back, and a device drawn again in the next round
    waited those 86 ms for its plan; with it off, 0.3 and 1.2 ms (docs/operations.md, "Nagle's algorithm")."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # not a TCP socket (a websocket transport wraps its own)
        pass


class MqttLink:
    def __init__(self, broker: BrokerAddress, client_id: str, handler: LinkHandler, *, subscriptions: list[str],
                 will: tuple[str, bytes] | None = None, clean_session: bool = True, keepalive: int = 30,
                 tick_s: float = 0.2, backoff: Backoff | None = None, max_inflight: int = 100, max_batch: int = 256,
                 mqtt5: bool = False, new_id_on_takeover: bool = False):
        """``mqtt5``: speak MQTT 5 (needed for shared subscriptions, ``$share/<group>/<filter>``); the session
        then starts clean when ``clean_session`` and otherwise outlives a disconnect by a day.

        A link that keeps losing its connection soon after making it (``TAKEOVER_AFTER`` times within
        ``TAKEOVER_WINDOW_S``) is most likely being taken off the broker by another client connecting with its
        client id (MQTT lets any client that logs in do that; a broker configured by ``fedge credentials``
        does not): it says so in a warning, and with ``new_id_on_takeover`` it moves to a new client id (the
        given one with a random suffix, a new session), which a client that knows only the old one cannot take."""
        keep_large_buffers()  # messages of a model's size, without a fresh mmap per buffer (allocator.py)
        self.broker, self.handler, self.subscriptions, self.tick_s = broker, handler, subscriptions, tick_s
        self.client_id = self.base_client_id = client_id
        self.new_id_on_takeover = new_id_on_takeover
        self._connected_at: float | None = None
        self._short: deque = deque()  # times of connections lost soon after they were made (takeover_check)
        self._takeover_warned = -1e18
        self.takeovers = 0  # times this link concluded another client took its client id
        self.backoff = backoff or Backoff(0.2, 30.0)
        self.keepalive = keepalive
        self.mqtt5, self._clean = mqtt5, clean_session
        self.backend = "paho"
        if mqtt5:  # MQTT 5 has clean_start + a session expiry instead of clean_session
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        elif not broker.tls and libmosquitto.available():  # the C client: libmosquitto.py says why
            c = libmosquitto.Client(client_id, clean_session)
            self.backend = "libmosquitto"
        else:
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean_session,
                            protocol=mqtt.MQTTv311)
        if broker.username:
            c.username_pw_set(broker.username, broker.password)
        if broker.tls:
            # verifies the broker's certificate and host name against ca_file (or the system store)
            c.tls_set(ca_certs=broker.ca_file, certfile=broker.cert_file, keyfile=broker.key_file)
        if will:
            c.will_set(will[0], will[1], qos=1, retain=True)
        c.max_inflight_messages_set(max_inflight)
        c.max_queued_messages_set(0)
        if self.backend == "paho":
            c.on_socket_open = lambda _c, _u, sock: nodelay(sock)
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
        self._unconfirmed: deque = deque()  # (sent at, MQTTMessageInfo) of QoS 1 publishes, oldest first
        self._warned_at = -1e18
        self.messages_received = 0
        self.max_batch = max_batch
        self._pass_end = getattr(handler, "on_pass_end", None)

    # ---- paho callbacks (run on our network thread, inside client.loop())
    def _on_connect(self, client, userdata, flags, reason_code, properties):
        if reason_code.is_failure:
            log.warning("%s: the broker at %s refused the connection: %s", self.client_id, self.broker.url(),
                        reason_code)
            return
        self.backoff.reset()
        self._connected_at = time.monotonic()
        if self._warned_at > 0:
            log.warning("%s: connected to %s", self.client_id, self.broker.url())
            self._warned_at = -1e18
        for t in self.subscriptions:
            client.subscribe(t, qos=1)
        self.connected.set()
        self.handler.on_connected(self, time.time())

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        self.connected.clear()
        self._sock_open = False
        if not self._stop.is_set():
            log.info("%s: disconnected (%s)", self.client_id, reason_code)
            self._takeover_check(getattr(reason_code, "value", reason_code) == 142)  # MQTT 5 "Session taken over"
        self.handler.on_disconnected(self, time.time())

    TAKEOVER_SHORT_S = 10.0  # a connection lost this soon after it was made counts towards a takeover
    TAKEOVER_AFTER, TAKEOVER_WINDOW_S = 3, 60.0

    def _takeover_check(self, certain: bool = False) -> None:
        now, since = time.monotonic(), self._connected_at
        self._connected_at = None
        if since is None or (now - since > self.TAKEOVER_SHORT_S and not certain):
            return
        q = self._short
        q.append(now)
        while q and q[0] < now - self.TAKEOVER_WINDOW_S:
            q.popleft()
        if len(q) < self.TAKEOVER_AFTER and not certain:
            return
        self.takeovers += 1
        n = len(q)
        q.clear()
        old = self.client_id
        if self.new_id_on_takeover:
            import secrets
            self.client_id = f"{self.base_client_id}-{secrets.token_hex(4)}"
            if self.backend == "libmosquitto":
                self.client.reinitialise(self.client_id)
            else:
                self.client._client_id = self.client_id.encode()  # paho has no setter; read at the next CONNECT
        if now - self._takeover_warned >= 60.0 or self.new_id_on_takeover:
            self._takeover_warned = now
            log.warning("%s: taken off the broker at %s %s: most likely another client is connecting with this "
                        "client id (any client that logs in may take a client id, unless the broker binds ids to "
                        "users: `fedge credentials` writes use_username_as_clientid; docs/security.md)%s", old,
                        self.broker.url(), "(session taken over)" if certain else
                        f"{n} times within {self.TAKEOVER_WINDOW_S:.0f} s, each within "
                        f"{self.TAKEOVER_SHORT_S:.0f} s of connecting",
                        f"; reconnecting as {self.client_id} (a new session)" if self.client_id != old else "")

    def _on_message(self, client, userdata, msg):
        self.messages_received += 1
        self.handler.on_message(self, msg.topic, bytes(msg.payload), time.time())

    # ---- API for the handler (network thread) and for other threads
    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        self.bytes_published += len(payload)
        if qos:
            self._unconfirmed.append((time.monotonic(), info))

    def in_flight(self, stale_s: float = 60.0) -> int:
        """QoS 1 publishes the broker has not confirmed yet (queued in paho or on the wire): how a sender paces
        itself. One that stays unconfirmed for ``stale_s`` (a connection lost in between) stops counting."""
        q = self._unconfirmed
        now = time.monotonic()
        while q and (q[0][1].is_published() or now - q[0][0] > stale_s):
            q.popleft()
        return sum(1 for _t, info in q if not info.is_published())

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

    def _unreachable(self, err: object, delay: float) -> None:
        """Say so at default verbosity the first time, then once a minute (not once per retry)."""
        now = time.time()
        if now - self._warned_at >= 60.0:
            self._warned_at = now
            log.warning("%s: cannot reach the broker at %s (%s); retrying with back-off", self.client_id,
                        self.broker.url(), err)
        else:
            log.info("%s: broker %s unreachable (%s); retry in %.2fs", self.client_id, self.broker.url(), err, delay)

    def _run(self) -> None:
        next_tick = 0.0
        while not self._stop.is_set():
            if not self._sock_open:
                try:
                    if self.mqtt5:
                        from paho.mqtt.packettypes import PacketTypes
                        from paho.mqtt.properties import Properties
                        props = Properties(PacketTypes.CONNECT)
                        props.SessionExpiryInterval = 0 if self._clean else 86400
                        self.client.connect(self.broker.host, self.broker.port, self.keepalive,
                                            clean_start=self._clean, properties=props)
                    else:
                        self.client.connect(self.broker.host, self.broker.port, self.keepalive)
                    self._sock_open = True
                except OSError as e:
                    delay = self.backoff.next()
                    self._unreachable(e, delay)
                    self._stop.wait(delay)
                    continue
            # select() waits at most a tick (messages, and call_soon's wake-up byte, end it at once): 50 device
            # links in two processes polling every 50 ms took the GIL from their training thread 1,000 times a second
            rc = self.client.loop(timeout=min(0.2, max(0.05, self.tick_s)))
            if rc == mqtt.MQTT_ERR_SUCCESS:
                rc = self._drain()
            if rc != mqtt.MQTT_ERR_SUCCESS and not self._stop.is_set():
                self._sock_open = False
                self.connected.clear()
                if self._connected_at is not None:  # lost without paho's on_disconnect
                    self._takeover_check()
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
            if self._pass_end is not None:
                self._pass_end(self, now)

    def _drain(self) -> int:
        """Read the packets already waiting: with few messages in flight paho reads one packet per loop() call,
        and every call waits in select(). Stops when a read yields nothing, or at ``max_batch`` messages."""
        for _ in range(self.max_batch):
            before = self.messages_received
            rc = self.client.loop_read()
            if rc != mqtt.MQTT_ERR_SUCCESS or self.messages_received == before:
                return rc
        return mqtt.MQTT_ERR_SUCCESS
