"""The coordinator's HTTP server: ``/metrics`` (Prometheus), ``/status.json``, the live status page ``/``, and the
browser device's page under ``/device/`` (coordinator/webdevice.py, docs/browser.md).

Standard library only (``http.server`` on a daemon thread). Read-only: every route is a GET of what the
daemon's :class:`~coordinator.metrics.FleetMetrics` observer holds. It binds to loopback unless told
otherwise (``[metrics] host``); the page shows device ids and rejection reasons, so put it behind a reverse
proxy with authentication before exposing it beyond the machine. The page fetches nothing but
``/status.json`` from the same server (no CDN): it works on an air-gapped coordinator.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable

log = logging.getLogger("fedge.coordinator.web")

CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"


def page_html(status: dict[str, Any] | None = None) -> bytes:
    """The status page, with the current status inlined so the first paint needs no request."""
    html = resources.files("coordinator").joinpath("status.html").read_text(encoding="utf-8")
    # JSON inside <script>: "<" escaped, so no device-supplied text can close the element
    data = json.dumps(status).replace("<", "\\u003c") if status is not None else "null"
    return html.replace("/*INITIAL_STATUS*/null", data).encode()


class StatusServer:
    """Serves ``metrics()`` at /metrics and ``status()`` at /status.json and, as a page, at /."""

    def __init__(self, metrics: Callable[[], str], status: Callable[[], dict[str, Any]], *,
                 host: str = "127.0.0.1", port: int = 0):
        srv = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "fedge"
            sys_version = ""

            def do_GET(self):  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        self._send(200, CONTENT_TYPE_METRICS, srv.metrics().encode())
                    elif path == "/status.json":
                        self._send(200, "application/json", json.dumps(srv.status()).encode())
                    elif path in ("/", "/index.html"):
                        self._send(200, "text/html; charset=utf-8", page_html(srv.status()))
                    elif path == "/healthz":
                        self._send(200, "text/plain; charset=utf-8", b"ok\n")
                    elif path == "/device" or path.startswith("/device/"):  # the browser device (coordinator/webdevice.py)
                        from .webdevice import CSP, MissingAssets, asset
                        try:
                            got = asset(path)
                        except MissingAssets as e:
                            log.warning("status server: %s", e)
                            self._send(503, "text/plain; charset=utf-8", f"{e}\n".encode())
                            return
                        if got is None:
                            self._send(404, "text/plain; charset=utf-8", b"not found\n")
                        else:
                            self._send(200, got[0], got[1], csp=CSP)
                    else:
                        self._send(404, "text/plain; charset=utf-8", b"not found: try /, /status.json or /metrics\n")
                except Exception:  # noqa: BLE001 - a bug here must not take the coordinator down
                    log.exception("status server: %s failed", path)
                    self._send(500, "text/plain; charset=utf-8", b"internal error\n")

            def do_HEAD(self):  # noqa: N802
                self._head_only = True
                self.do_GET()

            def _send(self, code: int, ctype: str, body: bytes, csp: str | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                if csp:
                    self.send_header("Content-Security-Policy", csp)
                elif ctype.startswith("text/html"):
                    # only our own inline script and style; nothing from elsewhere
                    self.send_header("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; "
                                     "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:")
                self.end_headers()
                if not getattr(self, "_head_only", False):
                    self.wfile.write(body)

            def log_message(self, fmt, *args):  # requests at debug level, not on stderr
                log.debug("%s %s", self.address_string(), fmt % args)

        self.metrics, self.status = metrics, status
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    def start(self) -> "StatusServer":
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="fedge-status-http", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(fleet_metrics, *, host: str = "127.0.0.1", port: int = 0) -> StatusServer:
    """Start the server for a :class:`~coordinator.metrics.FleetMetrics`."""
    return StatusServer(fleet_metrics.exposition, fleet_metrics.status, host=host, port=port).start()
