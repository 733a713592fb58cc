"""``fedge device`` (also ``fedge-device``): one device agent, from ``device.toml`` or the command line.

It lives with the device code and needs nothing of the coordinator package, so a phone-class or Pi install
(``pip install fedge`` plus one runtime) runs it. The coordinator's ``fedge`` command registers it too.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import typing
from dataclasses import dataclass, field

from .protocol.sizes import DEFAULT_CHUNK_BYTES
from .runtime.config import ConfigError, from_dict, load_toml, unknown
from .runtime.data import load_npz


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help, unless the help says it already or there is none to say (no value,
    a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or "default" in text.lower() or action.default in (None, False, [], "")
                or action.default is argparse.SUPPRESS or action.nargs == 0):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse, with a person's mistake on one line (``fedge simulate: unrecognized arguments: --epohcs 3; did
    you mean --epochs?``) and exit status 2, as every other mistake; subcommands get their help line as their
    description and every option's default in ``--help``."""

    def __init__(self, *args, **kw) -> None:
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message: str) -> typing.NoReturn:
        import difflib
        import re
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            close = difflib.get_close_matches(m[1], re.findall(r"'([^']*)'", m[2]), n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        self.exit(2, f"{self.prog}: {message}\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        import difflib
        a, extras = self.parse_known_args(args, namespace)
        if extras:
            p = self
            for act in self._actions:  # the subcommand's parser says it, with its own options to suggest
                if isinstance(act, argparse._SubParsersAction):
                    p = act.choices.get(getattr(a, act.dest, None), self)
            msg = f"unrecognized arguments: {' '.join(extras)}"
            flag = next((e.partition("=")[0] for e in extras if e.startswith("-")), None)
            close = difflib.get_close_matches(flag, list(p._option_string_actions), n=1) if flag else []
            p.error(msg + (f"; did you mean {close[0]}?" if close else ""))
        return a


def describe_subcommands(ap: argparse.ArgumentParser) -> None:
    """Each subcommand's help line (``fedge --help``'s list) as its ``--help`` description too, when it has none."""
    for act in ap._actions:
        if isinstance(act, argparse._SubParsersAction):
            for choice in act._choices_actions:
                p = act.choices[choice.dest]
                if not p.description:
                    p.description = choice.help


@dataclass
class DeviceSection:
    id: str | None = None
    data: str | None = None
    state_dir: str | None = None
    broker: str = "mqtt://127.0.0.1:1883"
    fleet: str = "default"
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    # reports above this many KiB go as chunks: below a broker's packet limit (docs/operations.md)
    chunk_kb: int = field(default=DEFAULT_CHUNK_BYTES // 1024, metadata={"min": 4})


def cmd_device(a: argparse.Namespace) -> int:
    """One device agent; settings from ``device.toml`` ([device] id, data, state_dir, broker, fleet, ca_file,
    [capabilities]), each overridable on the command line."""
    import threading
    from .protocol import wire
    from .protocol.capabilities import KNOWN_CAPABILITIES, BadCapabilities, parse_capabilities
    from .runtime.device import device_from_files
    from .runtime.mqtt import BrokerAddress

    conf = load_toml(a.config) if a.config else {}
    for k in conf:
        if k not in ("device", "capabilities"):
            raise unknown(k, ["device", "capabilities"], a.config, "section")
    d = from_dict(DeviceSection, conf.get("device", {}), "[device]")
    dev_id = a.id or d.id
    data = a.data or d.data
    if not dev_id or not data:
        raise ConfigError("fedge device: need --id and --data (or a [device] section in --config)")
    if not wire.ID_RE.match(dev_id):
        raise ConfigError(f"device id {dev_id!r}: use 1-128 of A-Z a-z 0-9 _ . : - (it becomes a topic level)")
    fleet = a.fleet or d.fleet
    if not wire.ID_RE.match(fleet):
        raise ConfigError(f"fleet {fleet!r}: use 1-128 of A-Z a-z 0-9 _ . : - (it becomes a topic level)")
    caps = dict(conf.get("capabilities", {})) | ({"runtime": a.runtime} if a.runtime else {})
    for k in caps:  # a person's file: a typo (netwrok) would otherwise leave the permissive default in force
        if k not in KNOWN_CAPABILITIES:
            raise unknown(k, list(KNOWN_CAPABILITIES), f"{a.config} [capabilities]")
    try:
        parse_capabilities(caps)
    except BadCapabilities as e:
        raise ConfigError(f"[capabilities] {e}") from None
    url = a.broker or d.broker
    try:
        BrokerAddress.parse(url, ca_file=a.ca_file or d.ca_file, cert_file=d.cert_file, key_file=d.key_file)
    except ValueError as e:
        raise ConfigError(f"[device] broker: {e}") from None
    try:
        load_npz(data)
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"[device] data = {data!r}: {e}") from None
    chunk_kb = a.chunk_kb if a.chunk_kb is not None else d.chunk_kb
    if chunk_kb < 4:
        raise ConfigError(f"--chunk-kb {chunk_kb}: must be at least 4")
    dev = device_from_files(dev_id, data, a.state_dir or d.state_dir or f"runs/device-{dev_id}", url,
                            fleet=fleet, capabilities=caps, chunk_bytes=chunk_kb * 1024,
                            tls={"ca_file": a.ca_file or d.ca_file, "cert_file": d.cert_file, "key_file": d.key_file})
    dev.warm_up()  # its runtime loaded before it checks in, not inside its first plan's round
    dev.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    dev.stop()
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("device", help="run one device agent (settings from --config device.toml, or flags)")
    d.add_argument("--config", help="device.toml ([device], [capabilities]); the flags below override it")
    d.add_argument("--id", help="the device id (its MQTT topics; 1-128 of A-Z a-z 0-9 _ . : -); default: [device] id")
    d.add_argument("--data", help=".npz with x and y; default: [device] data")
    d.add_argument("--state-dir", help="private state and program cache (default: [device] state_dir, else "
                                       "runs/device-<id>)")
    d.add_argument("--broker", help="mqtt://[user:password@]host:port or mqtts://... (default: [device] broker, "
                                    "else mqtt://127.0.0.1:1883)")
    d.add_argument("--fleet", help="the fleet name (default: [device] fleet, else 'default')")
    d.add_argument("--runtime", choices=["torch", "ort", "executorch"],
                   help="the trainer (default: [capabilities] runtime, else torch)")
    d.add_argument("--ca-file", help="CA certificate of an mqtts:// broker")
    d.add_argument("--chunk-kb", type=int, help="reports above this many KiB go as chunks: set it below the broker's "
                                                f"packet limit (default: [device] chunk_kb, else {DEFAULT_CHUNK_BYTES // 1024})")
    d.set_defaults(fn=cmd_device)


def parser() -> argparse.ArgumentParser:
    """``fedge-device``'s command line: ``fedge device``'s, with ``device`` implied (main prepends it)."""
    ap = Parser(prog="fedge-device", description=__doc__)
    ap.add_argument("-v", "--verbose", action="count", default=0, help="more log lines: -v info, -vv debug")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    sub.choices["device"].add_argument("-v", "--verbose", action="count", default=0,
                                       help="more log lines: -v info, -vv debug")
    sub.choices["device"].prog = "fedge-device"  # (its usage line: what a person types)
    describe_subcommands(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    """``fedge-device``: the device command on its own."""
    a = parser().parse_args(["device", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(level=logging.WARNING - 10 * a.verbose, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return a.fn(a)
    except ConfigError as e:
        print(f"fedge device: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
