"""Brokers for development and tests: the embedded amqtt broker and a private Mosquitto.

amqtt needs nothing but pip, so it is the default for a newcomer; it speaks MQTT 3.1.1 only and has known
delivery bugs, so reliability tests and benchmarks use Mosquitto. Both run as child processes so a test
can kill them, and both bind to loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("fedge.broker")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
            raise RuntimeError(f"broker exited with code {proc.returncode}: {err}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"no broker on port {port} after {timeout}s")


class _Child:
    proc: subprocess.Popen
    port: int

    tls = False

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class EmbeddedBroker(_Child):
    """amqtt in a child process (``python -m coordinator.broker``)."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1"):
        self.port = port or free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "coordinator.broker", "--host", host, "--port",
                                      str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for_port(self.port, proc=self.proc)


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto",) if os.path.exists(p)), None)


class Mosquitto(_Child):
    """A private Mosquitto on a free loopback port, with limits set explicitly (not the defaults)."""

    def __init__(self, port: int | None = None, *, max_packet_mb: int = 64, max_queued: int = 10000,
                 auth: dict[str, Path] | None = None, tls: dict[str, Path] | None = None,
                 websockets: int | None = None, host: str = "127.0.0.1"):
        """``auth``: paths from :func:`coordinator.credentials.write_mosquitto_auth` (per-device ACLs, and its
        ``broker.conf``: client ids are user names).
        ``tls``: paths from :func:`coordinator.tls.make_broker_certs`; the listener then speaks only TLS.
        ``websockets``: also a listener for MQTT over WebSockets on that port (0: a free one), for devices in a web
        page (docs/browser.md); with ``tls`` it speaks wss://. ``host``: the address both listeners bind."""
        exe = mosquitto_binary()
        if exe is None:
            raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
        self.port = port or free_port()
        self.ws_port = (websockets or free_port()) if websockets is not None else None
        self.dir = tempfile.mkdtemp(prefix="fedge-mosq-")
        conf = Path(self.dir) / "mosquitto.conf"
        certs = (f"cafile {tls['ca.pem']}\ncertfile {tls['broker.pem']}\nkeyfile {tls['broker.key']}\n"
                 "tls_version tlsv1.2\n" if tls else "")
        conf.write_text(
            # The private broker runs as whoever started it (as root, Mosquitto would switch to its own
            # user, which cannot read the test's files). Listener options (TLS) follow their listener line.
            f"per_listener_settings false\nlistener {self.port} {host}\n{certs}"
            + (f"listener {self.ws_port} {host}\nprotocol websockets\n{certs}" if self.ws_port else "")
            + f"persistence false\nuser {getpass.getuser()}\n"
            + ((Path(auth["conf"]).read_text() if "conf" in auth else
                f"allow_anonymous false\npassword_file {auth['passwd']}\nacl_file {auth['acl']}\n") if auth
               else "allow_anonymous true\n") +
            f"message_size_limit {max_packet_mb * 1024 * 1024}\nmax_queued_messages {max_queued}\n"
            f"max_inflight_messages 1000\nset_tcp_nodelay true\nlog_dest stderr\nlog_type error\nlog_type warning\n"
        )
        self.tls = bool(tls)
        self.proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for_port(self.port, proc=self.proc)
        if self.ws_port:
            wait_for_port(self.ws_port, proc=self.proc)

    @property
    def ws_url(self) -> str | None:
        """ws:// (or wss://) URL of the WebSockets listener, if there is one."""
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.ws_port}" if self.ws_port else None


def serve_mosquitto(host: str, port: int, websockets: int) -> None:
    """``fedge broker --websockets PORT``: a Mosquitto in the foreground with MQTT on ``port`` and MQTT over
    WebSockets on ``websockets`` (for devices in a web page, docs/browser.md), until interrupted."""
    b = Mosquitto(port, websockets=websockets, host=host)
    print(f"mosquitto on {host}: mqtt:// port {b.port}, ws:// port {b.ws_port} (config {b.dir}/mosquitto.conf); "
          "Ctrl-C stops it", flush=True)
    try:
        b.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        b.stop()


def start_broker(kind: str = "embedded", port: int | None = None) -> _Child:
    if kind == "mosquitto":
        return Mosquitto(port)
    return EmbeddedBroker(port)


async def _serve(host: str, port: int) -> None:
    from amqtt.broker import Broker
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}", "max_connections": 5000}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    broker = Broker(config)
    await broker.start()
    log.info("embedded broker on %s:%d", host, port)
    await asyncio.Event().wait()


def serve(host: str = "127.0.0.1", port: int = 1883) -> None:
    """Run the embedded broker in the foreground (``fedge broker``)."""
    logging.getLogger("amqtt").setLevel(logging.WARNING)
    asyncio.run(_serve(host, port))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1883)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    serve(a.host, a.port)
