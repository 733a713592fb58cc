"""The device page (clients/web): a phone's browser as a fedge device (docs/browser.md).

The coordinator's HTTP server serves it under ``/device/`` beside the status page (coordinator/web.py), and
``fedge web-device --out DIR`` writes the same files for any static web server to host. Everything the page loads
comes from this repository and its installed npm packages (``npm ci --prefix clients/web``): the device modules,
MQTT.js's browser build and ONNX Runtime Web's training build (WebAssembly). Nothing is fetched from elsewhere at
run time, and the person's data never leaves the page.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("fedge.coordinator.webdevice")

PREFIX = "/device/"
_ORT = "node_modules/onnxruntime-web/dist/"
# URL path under /device/ -> file under clients/web
VENDOR = {
    "vendor/mqtt.esm.js": "node_modules/mqtt/dist/mqtt.esm.js",
    "vendor/ort.training.wasm.min.mjs": _ORT + "ort.training.wasm.min.mjs",
    "vendor/ort-training-wasm-simd-threaded.mjs": _ORT + "ort-training-wasm-simd-threaded.mjs",
    "vendor/ort-training-wasm-simd-threaded.wasm": _ORT + "ort-training-wasm-simd-threaded.wasm",
}
OWN = ("index.html", "page.mjs", "src/msgpack.mjs", "src/wire.mjs", "src/sha256.mjs", "src/algorithms.mjs",
       "src/trainer.mjs", "src/device.mjs", "src/data.mjs")
TYPES = {".html": "text/html; charset=utf-8", ".mjs": "text/javascript; charset=utf-8",
         ".js": "text/javascript; charset=utf-8", ".wasm": "application/wasm", ".npz": "application/octet-stream"}
# What the page may do: its own scripts and WebAssembly, MQTT over WebSockets to any broker, nothing else.
CSP = ("default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; connect-src 'self' ws: wss:; "
       "worker-src 'self' blob:; style-src 'self' 'unsafe-inline'; img-src 'self' data:")


class MissingAssets(RuntimeError):
    """The npm packages the page needs are not installed."""


def root() -> Path:
    """clients/web of this checkout (``FEDGE_WEB_DEVICE_DIR`` overrides it)."""
    return Path(os.environ.get("FEDGE_WEB_DEVICE_DIR") or Path(__file__).resolve().parents[1] / "clients" / "web")


def files() -> dict[str, Path]:
    """Every file of the page by its path under /device/; MissingAssets when npm's packages are absent."""
    r = root()
    out = {name: r / name for name in OWN} | {name: r / src for name, src in VENDOR.items()}
    missing = [str(p) for p in out.values() if not p.is_file()]
    if missing:
        raise MissingAssets(f"the device page needs {missing[0]}{' and more' if len(missing) > 1 else ''}: "
                            f"run `npm ci --prefix {r}`")
    return out


@lru_cache(maxsize=1)
def demo_shard() -> bytes:
    """The page's own demo data: 60 rows of sklearn's digits (the demo fleet's data), as an .npz."""
    import tempfile
    from .datasets import digits_sample
    with tempfile.TemporaryDirectory(prefix="fedge-demo-") as d:
        return digits_sample(Path(d) / "demo.npz", n=60, seed=0).read_bytes()


def asset(path: str) -> tuple[str, bytes] | None:
    """(content type, bytes) of a page file by URL path (``/device/...``), or None when there is no such file."""
    if path in ("/device", PREFIX):
        path = PREFIX + "index.html"
    if not path.startswith(PREFIX):
        return None
    name = path[len(PREFIX):]
    if name == "demo.npz":
        return TYPES[".npz"], demo_shard()
    f = files().get(name)
    if f is None:
        return None
    return TYPES.get(f.suffix, "application/octet-stream"), f.read_bytes()


def write_static(out: str | os.PathLike) -> list[Path]:
    """The page as static files under ``out`` (index.html at its root); returns the files written."""
    out = Path(out)
    written = []
    for name, src in files().items():
        dst = out / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        written.append(dst)
    (out / "demo.npz").write_bytes(demo_shard())
    written.append(out / "demo.npz")
    return written


def cmd_web_device(a: argparse.Namespace) -> int:
    from edge.runtime.config import ConfigError
    try:
        written = write_static(a.out)
    except MissingAssets as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"--out {a.out}: {e.strerror or e}") from None
    size = sum(p.stat().st_size for p in written)
    print(f"wrote the device page to {a.out} ({len(written)} files, {size / 1e6:.1f} MB): serve that directory over "
          f"http(s) and open index.html?broker=ws://BROKER:9001&fleet=FLEET&id=DEVICE (docs/browser.md)")
    return 0


def add_parser(sub) -> None:
    w = sub.add_parser("web-device", help="write the browser device page as static files to host (docs/browser.md)")
    w.add_argument("--out", required=True, metavar="DIR", help="the directory to write (created if absent)")
    w.set_defaults(fn=cmd_web_device)
