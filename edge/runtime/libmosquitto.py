"""An MQTT 3.1.1 client on the C library libmosquitto (through ctypes), for :class:`edge.runtime.mqtt.MqttLink`.

Why: paho-mqtt frames every packet in Python. Profiled in ``benchmarks/round_overhead.py`` (cProfile on the
links' threads, CPU time), paho's own reading, framing and acknowledging was about half of the device links'
CPU and a third of the coordinator's network thread, and on two cores a round is CPU-bound. libmosquitto does
the framing, the QoS 1 handshakes and the socket work in C, with the GIL released (ctypes releases it for every
foreign call); Python runs only for a delivered message, a confirmed publish, a connect and a disconnect.

This speaks exactly the subset of paho's ``Client`` that ``MqttLink`` uses (connect, subscribe, publish with
an info whose ``is_published()`` says when the broker confirmed it, a ``loop``/``loop_read`` driven by the
link's own thread, a wake-up socket for ``call_soon``), over plain TCP with MQTT 3.1.1. ``MqttLink`` takes it
when :func:`available` and the link needs nothing else (no TLS, no MQTT 5); paho serves the rest, and every
link when ``FEDGE_MQTT_CLIENT=paho``. libmosquitto is Debian's ``libmosquitto1`` (what the native device links
against); without it, paho.

One difference a reader of the durability rules should know: libmosquitto acknowledges a QoS 1 message to the
broker before it calls the handler, paho after the handler returns. Nothing in fedge rests on the broker
redelivering a message its receiver crashed while handling: a report is resent by its device until the
coordinator's own ``ack`` (sent only once the report is on disk), a plan lost with a crashed device is that device
dropping out of its round (what over-selection and the deadline are for), and check-ins repeat as heartbeats
(docs/protocol.md, section 9).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import socket
import threading
from typing import Any, Callable

log = logging.getLogger("fedge.mqtt")

MOSQ_ERR_SUCCESS, MOSQ_ERR_NO_CONN, MOSQ_ERR_CONN_LOST = 0, 4, 7
MOSQ_OPT_PROTOCOL_VERSION, MQTT_PROTOCOL_V311, MOSQ_OPT_TCP_NODELAY = 1, 4, 11


class _Message(ctypes.Structure):
    _fields_ = [("mid", ctypes.c_int), ("topic", ctypes.c_char_p), ("payload", ctypes.c_void_p),
                ("payloadlen", ctypes.c_int), ("qos", ctypes.c_int), ("retain", ctypes.c_bool)]


_ON_RC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
_ON_MESSAGE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_Message))
_lib: Any = None
_tried = False


def _load() -> Any:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    name = ctypes.util.find_library("mosquitto") or "libmosquitto.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        log.debug("libmosquitto not found: MQTT links use paho")
        return None
    vp, ci, cp, b, on_rc, on_msg = (ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_bool, _ON_RC,
                                    _ON_MESSAGE)
    pi = ctypes.POINTER(ci)
    sig = {  # name: (argument types, result type), as mosquitto.h declares them
        "mosquitto_lib_init": ([], ci),
        "mosquitto_new": ([cp, b, vp], vp),
        "mosquitto_destroy": ([vp], None),
        "mosquitto_int_option": ([vp, ci, ci], ci),
        "mosquitto_username_pw_set": ([vp, cp, cp], ci),
        "mosquitto_will_set": ([vp, cp, ci, cp, ci, b], ci),
        "mosquitto_max_inflight_messages_set": ([vp, ctypes.c_uint], ci),
        "mosquitto_connect": ([vp, cp, ci, ci], ci),
        "mosquitto_disconnect": ([vp], ci),
        "mosquitto_publish": ([vp, pi, cp, ci, cp, ci, b], ci),
        "mosquitto_subscribe": ([vp, pi, cp, ci], ci),
        "mosquitto_loop_read": ([vp, ci], ci),
        "mosquitto_loop_write": ([vp, ci], ci),
        "mosquitto_loop_misc": ([vp], ci),
        "mosquitto_socket": ([vp], ci),
        "mosquitto_want_write": ([vp], b),
        "mosquitto_connect_callback_set": ([vp, on_rc], None),
        "mosquitto_disconnect_callback_set": ([vp, on_rc], None),
        "mosquitto_publish_callback_set": ([vp, on_rc], None),
        "mosquitto_message_callback_set": ([vp, on_msg], None),
        "mosquitto_strerror": ([ci], cp),
    }
    try:
        for fn, (args, res) in sig.items():
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, res
    except AttributeError as e:  # a libmosquitto older than 1.6
        log.debug("libmosquitto lacks %s: MQTT links use paho", e)
        return None
    lib.mosquitto_lib_init()
    _lib = lib
    return lib


def available() -> bool:
    """Whether links can use libmosquitto here: found, and not turned off with ``FEDGE_MQTT_CLIENT=paho``
    (read at each link's creation)."""
    return os.environ.get("FEDGE_MQTT_CLIENT", "") != "paho" and _load() is not None


class ReasonCode(int):
    """paho's reason code, as far as MqttLink reads it: a failure flag and a value."""

    @property
    def is_failure(self) -> bool:
        return self != 0

    @property
    def value(self) -> int:
        return int(self)


class PublishInfo:
    """paho's MQTTMessageInfo, as far as MqttLink reads it: whether the broker confirmed the publish."""

    __slots__ = ("mid", "_done")

    def __init__(self, mid: int, done: bool):
        self.mid, self._done = mid, done

    def is_published(self) -> bool:
        return self._done


class Message:
    __slots__ = ("topic", "payload")

    def __init__(self, topic: str, payload: bytes):
        self.topic, self.payload = topic, payload


class Client:
    """One libmosquitto client driven from one thread (its link's), as :class:`MqttLink` drives paho's."""

    def __init__(self, client_id: str, clean_session: bool = True):
        lib = _load()
        if lib is None:
            raise RuntimeError("libmosquitto is not available")
        self._lib = lib
        self.on_connect: Callable | None = None
        self.on_message: Callable | None = None
        self.on_disconnect: Callable | None = None
        # QoS 1 publishes the broker has not confirmed: mid -> (info, topic, payload, qos, retain), the payload
        # kept so that a move to a new client id (reinitialise) can queue them again, as paho keeps its own
        self._pending: dict[int, tuple] = {}
        # a publish from another thread can be confirmed on the link's thread before publish() returns (the GIL is
        # free during the C call): mids confirmed while a call was under way, kept until the calls end
        self._early: set[int] = set()
        self._calls = 0  # publish() calls under way
        self._lock = threading.Lock()
        self._settings: list[tuple[str, tuple]] = []  # the set-up calls, replayed by reinitialise
        # kept referenced: libmosquitto holds these C function pointers
        self._cbs = (_ON_RC(self._c_connect), _ON_RC(self._c_disconnect), _ON_RC(self._c_publish),
                     _ON_MESSAGE(self._c_message))
        self._m = None
        self._new(client_id, clean_session)
        # call_soon's wake-up (MqttLink writes a byte to _sockpairW, as with paho's own pair)
        self._sockpairR, self._sockpairW = socket.socketpair()
        self._sockpairR.setblocking(False)
        self._sockpairW.setblocking(False)

    def _new(self, client_id: str, clean_session: bool) -> None:
        lib = self._lib
        m = lib.mosquitto_new(client_id.encode(), clean_session, None)
        if not m:
            raise RuntimeError(f"mosquitto_new failed for {client_id!r}")
        if self._m:
            lib.mosquitto_destroy(self._m)
        self._m, self._clean = m, clean_session
        lib.mosquitto_int_option(m, MOSQ_OPT_PROTOCOL_VERSION, MQTT_PROTOCOL_V311)
        lib.mosquitto_int_option(m, MOSQ_OPT_TCP_NODELAY, 1)  # see mqtt.py: nodelay
        lib.mosquitto_connect_callback_set(m, self._cbs[0])
        lib.mosquitto_disconnect_callback_set(m, self._cbs[1])
        lib.mosquitto_publish_callback_set(m, self._cbs[2])
        lib.mosquitto_message_callback_set(m, self._cbs[3])
        for fn, args in self._settings:
            self._check(getattr(lib, fn)(m, *args))

    def reinitialise(self, client_id: str) -> None:
        """Connect next time as ``client_id`` (a new session), keeping the settings and the unconfirmed QoS 1
        publishes, which are queued again (paho's client keeps them across a change of its ``_client_id``)."""
        with self._lock:
            pending = [self._pending[k] for k in sorted(self._pending)]
            self._pending, self._early = {}, set()
        self._new(client_id, self._clean)
        for info, topic, payload, qos, retain in pending:
            again = self.publish(topic, payload, qos, retain)
            info.mid = again.mid
            with self._lock:
                if again.mid in self._pending:
                    self._pending[again.mid] = (info,) + self._pending[again.mid][1:]

    def __del__(self) -> None:
        m, self._m = getattr(self, "_m", None), None
        if m:
            self._lib.mosquitto_destroy(m)
        for s in (getattr(self, "_sockpairR", None), getattr(self, "_sockpairW", None)):
            if s is not None:
                s.close()

    # ---- libmosquitto's callbacks (inside loop_read/loop_write/loop_misc, on the link's thread)
    # An exception cannot cross back into C: it is logged here and the loop goes on (the message is acknowledged,
    # so it is not redelivered into the same failure; paho would end the link's thread instead).
    def _c_connect(self, _m, _obj, rc: int) -> None:
        self._status("on_connect", rc)

    def _c_disconnect(self, _m, _obj, rc: int) -> None:
        self._status("on_disconnect", rc)

    def _status(self, name: str, rc: int) -> None:
        """paho's on_connect/on_disconnect, with its arguments (client, userdata, flags, reason code, properties)."""
        try:
            cb = getattr(self, name)
            if cb is not None:
                cb(self, None, None, ReasonCode(rc), None)
        except Exception:  # noqa: BLE001
            log.exception("%s failed", name)

    def _c_publish(self, _m, _obj, mid: int) -> None:
        with self._lock:
            hit = self._pending.pop(mid, None)
            if hit is None and self._calls:
                self._early.add(mid)
        if hit is not None:
            hit[0]._done = True

    def _c_message(self, _m, _obj, msg) -> None:
        try:
            if self.on_message is None:
                return
            c = msg.contents
            payload = ctypes.string_at(c.payload, c.payloadlen) if c.payloadlen else b""
            self.on_message(self, None, Message(c.topic.decode("utf-8", "replace"), payload))
        except Exception:  # noqa: BLE001
            log.exception("handling a message failed")

    # ---- paho's Client, the part MqttLink uses
    def _setting(self, fn: str, *args: Any) -> None:
        self._check(getattr(self._lib, fn)(self._m, *args))
        self._settings.append((fn, args))

    def username_pw_set(self, username: str, password: str | None = None) -> None:
        self._setting("mosquitto_username_pw_set", username.encode(), None if password is None else password.encode())

    def will_set(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        self._setting("mosquitto_will_set", topic.encode(), len(payload), payload, qos, retain)

    def max_inflight_messages_set(self, n: int) -> None:
        self._setting("mosquitto_max_inflight_messages_set", n)

    def max_queued_messages_set(self, n: int) -> None:
        """libmosquitto queues without bound, as paho does with 0."""

    def connect(self, host: str, port: int, keepalive: int) -> None:
        rc = self._lib.mosquitto_connect(self._m, host.encode(), port, keepalive)
        if rc != MOSQ_ERR_SUCCESS:
            raise ConnectionRefusedError(self._err(rc))

    def subscribe(self, topic: str, qos: int = 0) -> int:
        return self._lib.mosquitto_subscribe(self._m, None, topic.encode(), qos)

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> PublishInfo:
        """Queued (and written at once if the socket takes it); a QoS 1 message is kept and resent across
        reconnections until the broker confirms it, also when published while disconnected."""
        if type(payload) is not bytes:  # bytearray, memoryview: what paho takes too
            payload = bytes(payload)
        mid, rc = ctypes.c_int(0), -1
        with self._lock:
            self._calls += 1
        try:
            rc = self._lib.mosquitto_publish(self._m, ctypes.byref(mid), topic.encode(), len(payload), payload, qos,
                                             retain)
        finally:
            with self._lock:
                self._calls -= 1
                early = mid.value in self._early
                self._early.discard(mid.value)
                info = PublishInfo(mid.value, (qos == 0 and rc == MOSQ_ERR_SUCCESS) or (qos > 0 and early))
                if qos and not early and rc in (MOSQ_ERR_SUCCESS, MOSQ_ERR_NO_CONN, MOSQ_ERR_CONN_LOST):
                    self._pending[info.mid] = (info, topic, payload, qos, retain)
                if not self._calls:
                    self._early.clear()  # confirmations of QoS 0 publishes, which nothing waits for
        if rc not in (MOSQ_ERR_SUCCESS, MOSQ_ERR_NO_CONN, MOSQ_ERR_CONN_LOST):
            log.debug("publish to %s failed: %s", topic, self._err(rc))
        return info

    def socket(self) -> socket.socket | None:
        fd = self._lib.mosquitto_socket(self._m)
        return None if fd < 0 else _FdSocket(fd, self)

    def loop(self, timeout: float = 1.0) -> int:
        """Wait up to ``timeout`` for the socket or a wake-up byte, then read, write and keep alive."""
        fd = self._lib.mosquitto_socket(self._m)
        if fd < 0:
            return MOSQ_ERR_NO_CONN
        wr = [fd] if self._lib.mosquitto_want_write(self._m) else []
        try:
            rd, wr, _ = select.select([fd, self._sockpairR], wr, [], timeout)
        except (OSError, ValueError):
            return MOSQ_ERR_CONN_LOST
        if self._sockpairR in rd:
            try:
                self._sockpairR.recv(10000)
            except BlockingIOError:
                pass
        rc = self._io(fd in rd, bool(wr))
        if rc == MOSQ_ERR_SUCCESS:
            rc = self._lib.mosquitto_loop_misc(self._m)
        return rc

    def loop_read(self) -> int:
        """Read what is waiting (MqttLink's drain): without data this returns at once."""
        if self._lib.mosquitto_socket(self._m) < 0:
            return MOSQ_ERR_NO_CONN
        return self._io(True, False)

    def _io(self, read: bool, writable: bool) -> int:
        """Read if asked, then write what is queued (a handler's publishes during the read included)."""
        rc = self._lib.mosquitto_loop_read(self._m, 1) if read else MOSQ_ERR_SUCCESS
        if rc == MOSQ_ERR_SUCCESS and (writable or self._lib.mosquitto_want_write(self._m)):
            rc = self._lib.mosquitto_loop_write(self._m, 1)
        return rc

    def disconnect(self) -> int:
        return self._lib.mosquitto_disconnect(self._m)

    def _check(self, rc: int) -> None:
        if rc != MOSQ_ERR_SUCCESS:
            raise ValueError(self._err(rc))

    def _err(self, rc: int) -> str:
        s = self._lib.mosquitto_strerror(rc)
        return s.decode() if s else f"error {rc}"


class _FdSocket:
    """MqttLink.kill() closes the link's socket to drop the connection without DISCONNECT."""

    def __init__(self, fd: int, client: Client):
        self.fd, self.client = fd, client

    def close(self) -> None:
        try:
            socket.socket(fileno=os.dup(self.fd)).shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
