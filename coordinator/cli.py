"""The ``fedge`` command: broker, coordinator, ingest, status, devices, device, fleetsim, credentials, simulate,
conformance (and export, when its tooling is installed)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import signal
import threading
import time
import sys
from pathlib import Path

from edge.protocol.sizes import DEFAULT_CHUNK_BYTES
from edge.runtime.config import ConfigError, from_dict, load_toml, unknown

log = logging.getLogger("fedge")


def cmd_broker(a: argparse.Namespace) -> int:
    import socket
    from .broker import mosquitto_binary, serve, serve_mosquitto
    for flag, port in (("--port", a.port), *([("--websockets", a.websockets)] if a.websockets else [])):
        try:  # a busy port is a person's mistake: one line, not amqtt's traceback
            with socket.create_server((a.host, port)):
                pass
        except OSError as e:
            raise ConfigError(f"--host {a.host} {flag} {port}: cannot listen there ({e.strerror or e}); another "
                              "broker may be running: use it, or give another port") from None
    if a.websockets is not None:
        if mosquitto_binary() is None:
            raise ConfigError("--websockets runs Mosquitto, which is not installed (apt-get install mosquitto)")
        serve_mosquitto(a.host, a.port, a.websockets)
        return 0
    serve(a.host, a.port)
    return 0


def _say(line: str) -> None:
    """What the daemon says at default verbosity: one line on stdout, stamped, flushed (journald reads it)."""
    import time
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", flush=True)


def round_line(s: dict, target: int, total_bytes: int) -> str:
    """One committed round, as ``fedge coordinator`` prints it."""
    acc = "-" if s.get("accuracy") is None else f"{s['accuracy']:.4f}"
    attempts = s.get("attempts") or 1
    return (f"round {s['round']}/{target}: accuracy {acc}, {s['reports']} reports, {s['dropped']} unused, "
            f"{s['bytes_down'] / 1e6:.3f} MB down + {s['bytes_up'] / 1e6:.3f} MB up "
            f"({total_bytes / 1e6:.2f} MB in all), {s['wall_s']:.2f} s"
            + (f" (+{s['export_s']:.2f} s waiting for program exports)" if s.get("export_s") else "")
            + (f", {s['passed_over']} passed over while their programs exported" if s.get("passed_over") else "")
            + (f", {attempts} attempts" if attempts > 1 else ""))


def disk_full(e: BaseException) -> bool:
    """A write that failed for want of space (or quota): the file system's, or SQLite's own."""
    import errno
    import sqlite3
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(e, sqlite3.OperationalError) and (getattr(e, "sqlite_errorname", None) == "SQLITE_FULL"
                                                        or "disk is full" in str(e))


class _DiskFullOneLine(logging.Filter):
    """A full disk is logged as one line (what failed, and the error), not as a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        if e is not None and disk_full(e):
            record.msg, record.args = f"{record.getMessage()}: the disk is full ({e})", None
            record.exc_info = record.exc_text = None
        return True


def _port(text: str) -> int:
    """A TCP port on the command line: 1 to 65535 (argparse says so in one line)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port}: a port is 1 to 65535")
    return port


def _writable(path: str | None, flag: str) -> None:
    if path:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{flag} {path}: {e.strerror}") from None


def cmd_coordinator(a: argparse.Namespace) -> int:
    """A long-running coordinator with settings from ``fleet.toml`` (coordinator/config.py lists the sections).

    At default verbosity it prints a line when it starts or resumes, when it first reaches the broker, one per
    committed round, and one when it finishes or stops; ``--out``/``--plot`` then get the run report and the
    accuracy-against-MB plot (also when stopped early: the rounds so far)."""
    import time
    from .config import load_fleet
    from .daemon import Coordinator, CoordinatorConfig, Evaluator
    from .metrics import FleetMetrics
    from .strategies import make_strategy

    fc = load_fleet(a.config, broker=a.broker, state=a.state, metrics_port=a.metrics_port)
    _writable(a.out, "--out")
    _writable(a.plot, "--plot")
    check_model_for(fc.strategy_name, fc.model(), tuple(fc.rounds.eligibility.runtimes))
    strategy = make_strategy(fc.strategy_name, spec=fc.model(), **fc.strategy_options)
    evaluator = Evaluator(*_load_data(fc.test, "[data] test")) if fc.test else None
    target = fc.rounds.rounds
    t0 = time.time()
    obs = FleetMetrics()
    total = [0]

    def on_round(s: dict) -> None:
        total[0] += s["bytes_down"] + s["bytes_up"]
        _say(round_line(s, target, total[0]))

    server = None
    if fc.metrics.port:
        from .web import serve
        try:
            server = serve(obs, host=fc.metrics.host, port=fc.metrics.port)
        except OSError as e:
            raise ConfigError(f"[metrics] port = {fc.metrics.port}: cannot listen on {fc.metrics.host}: "
                              f"{e.strerror or e}") from None
    try:
        coord = Coordinator(CoordinatorConfig(fc.rounds, fc.broker, fc.state_path,
                                              ingest="shared" if fc.ingest.shared else "direct"), strategy, evaluator=evaluator,
                            on_round=on_round, run=fc.run(), observer=obs)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    obs.attach(coord)
    total[0] = sum(r["bytes_down"] + r["bytes_up"] for r in obs.rows)
    done_before = obs.rows[-1]["round"] if obs.rows else 0
    rc = coord.machine.cfg
    where = f"state {fc.state_path}, broker {fc.broker.url()}" + (f", status page and /metrics at {server.url}"
                                                                 if server else "")
    if coord.machine.finished:
        _say(f"run {rc.run_id} ({fc.strategy_name}, fleet {rc.fleet}) already finished at round {done_before} of "
             f"{target}; nothing to do ({where})")
    elif done_before or coord.machine.open is not None:
        o = coord.machine.open
        _say(f"resuming run {rc.run_id} ({fc.strategy_name}, fleet {rc.fleet}) after round {done_before} of {target}"
             + (f"; round {o.round} re-opened with {len(o.accepted)} accepted reports" if o is not None else "")
             + f" ({where})")
    else:
        _say(f"starting run {rc.run_id} ({fc.strategy_name}, fleet {rc.fleet}): {target} rounds of "
             f"{rc.clients_per_round} reports ({where})")
    why = ""

    def on_term(*_):
        nonlocal why
        why = "SIGTERM"
        coord.done.set()

    signal.signal(signal.SIGTERM, on_term)
    coord.start()
    said_connected = False
    try:
        while True:  # checked before each wait: a short run can connect and finish within one wait
            if not said_connected and coord.link.connected.is_set():
                said_connected = True
                _say(f"connected to the broker at {fc.broker.url()}; waiting for devices"
                     if coord.machine.open is None else f"connected to the broker at {fc.broker.url()}")
            if coord.wait(0.05 if not said_connected else 0.5):
                break
    except KeyboardInterrupt:
        why = "interrupted"
    finally:
        coord.stop()
        if server is not None:
            server.stop()
    rows = list(obs.rows)
    last = rows[-1]["round"] if rows else 0
    acc = rows[-1].get("accuracy") if rows else None
    figures = (f"final accuracy {'-' if acc is None else f'{acc:.4f}'}, {total[0] / 1e6:.2f} MB on the wire, "
               f"{time.time() - t0:.1f} s")
    if coord.error is not None and disk_full(coord.error):
        _say(f"coordinator stopped after round {last} of {target}: the disk is full ({coord.error}); free space "
             "(the state directory and its write-ahead log), then run the same command to resume")
    elif coord.error is not None:
        _say(f"coordinator failed after round {last} of {target}: {type(coord.error).__name__}: {coord.error}")
    elif coord.machine.finished:
        if last > done_before:  # (a run that was finished already said so when it started)
            _say(f"run finished: {last} rounds, {figures}")
    else:
        _say(f"stopped after round {last} of {target} ({why or 'stopped'}); {figures}; run the same command to "
             "resume")
    if not (coord.error is not None and disk_full(coord.error)):  # (no room for a report either)
        _write_report(a, fc, coord, rows, time.time() - t0, done_before)
    return 1 if coord.error else 0


def _write_report(a: argparse.Namespace, fc, coord, rows: list[dict], wall_s: float, done_before: int) -> None:
    """``--out``: the run report of ``fedge simulate`` (every committed round of the run, the resumed ones
    too); ``--plot``: its accuracy-against-MB plot."""
    from .report import plot_accuracy_vs_bytes, run_report, write_json
    if not (a.out or a.plot):
        return
    registry = coord.machine.registry
    runtimes = sorted({str(d.capabilities.get("runtime", "torch")) for d in registry.devices.values()}) or \
        list(fc.rounds.eligibility.runtimes)
    rep = run_report(strategy=fc.strategy_name, runtime="+".join(runtimes), devices=len(registry.devices),
                     clients_per_round=fc.rounds.clients_per_round, rounds=rows, wall_s=wall_s,
                     mode="reproducible" if fc.rounds.reproducible else "production", seed=fc.rounds.seed,
                     fleet=fc.rounds.fleet, run_id=coord.machine.cfg.run_id, rounds_target=fc.rounds.rounds,
                     finished=bool(coord.machine.finished), resumed_after=done_before)
    wrote = []
    if a.out:
        write_json(a.out, rep)
        wrote.append(f"report in {a.out}")
    if a.plot:
        if any(r.get("accuracy") is not None for r in rows):
            plot_accuracy_vs_bytes([(fc.strategy_name, [r for r in rows if r.get("accuracy") is not None])], a.plot,
                                   title=f"{fc.strategy_name}, {len(registry.devices)} devices, fleet {fc.rounds.fleet}")
            wrote.append(f"plot in {a.plot}")
        else:
            wrote.append("no plot: no round has a test accuracy" + ("" if fc.test else " (set [data] test)"))
    _say("; ".join(wrote))


def cmd_ingest(a: argparse.Namespace) -> int:
    """One ingest worker for a coordinator with ``[ingest] shared = true`` (start as many as the load needs,
    on the coordinator's machine: they share its state directory's inbox)."""
    from .config import load_fleet
    from .ingest import IngestWorker, inbox_path

    fc = load_fleet(a.config, broker=a.broker, state=a.state)
    if not fc.ingest.shared:
        raise ConfigError(f"{a.config or 'fleet config'}: [ingest] shared is not true, so the coordinator takes "
                          "reports from the broker itself and would never read this worker's inbox")
    w = IngestWorker(fc.broker, fc.rounds.fleet, inbox_path(fc.state_path), name=a.name).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _say(f"ingest worker {w.name} for fleet {fc.rounds.fleet}: broker {fc.broker.url()}, inbox "
         f"{inbox_path(fc.state_path)}")
    last = time.monotonic()
    try:
        while not stop.wait(0.5) and not w.done.is_set():
            if time.monotonic() - last >= 30:
                last = time.monotonic()
                log.info("ingest %s: %d received, %d spooled, %d refused", w.name, w.received, w.spooled, w.refused)
    except KeyboardInterrupt:
        pass
    if w.failed:  # already said in one line; exit 1 so that systemd starts a fresh worker
        return 1
    w.stop()
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    """A run's progress: from a coordinator's status endpoint (``--url``) or its state file (``--state``)."""
    from .status import from_state, from_url, render
    if a.url and a.state:
        raise ConfigError("give --url or --state, not both")
    s = from_url(a.url) if a.url else from_state(a.state or "runs/coordinator/state.sqlite", last_rounds=a.rounds)
    if a.json:
        print(json.dumps(s, indent=2))
    else:
        print(render(s, rounds=a.rounds))
    return 0


def _load_data(path: str, what: str):
    from edge.runtime.data import load_npz
    try:
        return load_npz(path)
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"{what} = {path!r}: {e}") from None


def cmd_devices(a: argparse.Namespace) -> int:
    """The fleet as the coordinator's state records it: who is online, busy, quarantined, and what was rejected."""
    import time
    from .status import StateReader
    if not Path(a.state).is_file():
        raise ConfigError(f"{a.state}: no such state file")
    # read-only: opening it as a Store would tidy the report files of a coordinator running on it
    import sqlite3
    st = StateReader(a.state)
    now = time.time()
    rej: dict[str, list[dict]] = {}
    try:
        rejections, devices = st.rejections(), st.devices()
    except sqlite3.DatabaseError as e:  # not SQLite, damaged, or not a coordinator's (no such table)
        raise ConfigError(f"{a.state}: not a coordinator state file ({e})") from None
    for r in rejections:
        rej.setdefault(r["device_id"], []).append(r)
    print(f"{'device':<24} {'online':>6} {'free':>5} {'rejected':>8} {'strikes':>7}  quarantine / last reason")
    for d in devices:
        rs = rej.pop(d["device_id"], [])
        q = d["quarantined_until"] - now
        note = (f"for {q:.0f} s more (#{d['quarantines']})" if q > 0 else
                (rs[-1]["last_reason"][:60] if rs else ""))
        print(f"{d['device_id']:<24} {'yes' if d['online'] else 'no':>6} {'yes' if d['available'] else 'no':>5} "
              f"{sum(r['count'] for r in rs):>8} {sum(r['strikes'] for r in rs):>7}  {note}")
    for dev, rs in sorted(rej.items()):  # ids that never checked in
        print(f"{dev:<24} {'-':>6} {'-':>5} {sum(r['count'] for r in rs):>8} {sum(r['strikes'] for r in rs):>7}  "
              f"never checked in; {rs[-1]['last_reason'][:50]}")
    st.close()
    return 0


def _strategy_args(items: list[str]) -> dict:
    """KEY=VALUE pairs; values parsed as JSON when they can be (numbers, booleans), else kept as text."""
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise ConfigError(f"-S needs KEY=VALUE, got {item!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def check_model_for(strategy: str, spec: dict, runtimes: tuple[str, ...]) -> None:
    """What cannot run a module spec is refused here, before anything is exported or contacted."""
    from edge.model import buffer_shapes, is_module
    if not is_module(spec):
        return
    if strategy in ("fedmix", "fedmix_sparse") and buffer_shapes(spec):
        raise ConfigError(f"--strategy {strategy}: experts with BatchNorm running statistics are not supported "
                          f"(use GroupNorm or LayerNorm, or train without running statistics)")
    if strategy == "fedmix_sparse":
        raise ConfigError("--strategy fedmix_sparse takes the zoo MLP only; FedMix takes your module")


def cmd_credentials(a: argparse.Namespace) -> int:
    """Mosquitto password and ACL files: each device confined to its own topics."""
    from .credentials import write_mosquitto_auth
    if Path(a.out).exists() and not Path(a.out).is_dir():
        raise ConfigError(f"--out {a.out}: is a file; give a directory for the password, ACL and certificate files")
    ids = [d.strip() for d in a.devices.split(",") if d.strip()]
    paths = write_mosquitto_auth(a.out, a.fleet, ids, coordinator_user=a.coordinator_user,
                                 ingest_workers=a.ingest_workers)
    print(f"wrote {paths['passwd']} and {paths['acl']}, and {paths['conf']} (the lines of mosquitto.conf that use "
          f"them, in the listener's block: allow_anonymous false, and use_username_as_clientid so that no client can "
          f"take another's client id); clear-text passwords for provisioning in {paths['credentials']}")
    if a.ingest_workers:
        print(f"ingest workers: start each with its own user, `fedge ingest --broker mqtt://{a.coordinator_user}-"
              f"ingest-<i>:<password>@host:port` (the coordinator's user is the coordinator's alone)")
    if a.tls_host:
        from .tls import make_broker_certs
        certs = make_broker_certs(a.out, a.tls_host)
        print(f"wrote {certs['broker.pem']} and {certs['broker.key']} (certfile / keyfile), signed by "
              f"{certs['ca.pem']} (cafile; give it to every device as ca_file; keep {certs['ca.key']} elsewhere)")
    return 0


def _export_toolchain(runtimes: tuple[str, ...], flag: str) -> None:
    """Devices on exported programs need the export toolchain here (`make demo`'s venv has torch only)."""
    import importlib
    from edge.quiet import quiet
    need = {"ort": ("onnx", "onnxruntime"), "executorch": ("executorch",), "native": ("executorch",)}
    for rt in runtimes:
        for mod in need.get(rt, ()):
            try:
                with quiet():
                    importlib.import_module(mod)
            except ImportError as e:
                raise ConfigError(f"{flag} {rt}: the export toolchain is not installed ({e}); `make install` (or "
                                  "pip install 'fedge[export]') installs it") from None


def _interrupt(*_) -> None:
    """SIGTERM (kill, systemd, a CI timeout) as Ctrl-C: the run's finally blocks stop the device processes and
    the private broker instead of leaving them behind."""
    raise KeyboardInterrupt


def cmd_simulate(a: argparse.Namespace) -> int:
    from .config import strategy_options
    from .datasets import from_dir, parse_partition
    from .simulate import NATIVE, NATIVE_BINARY, SimConfig, fleet_runtimes, load_data, model_spec, simulate
    from edge.trainers import RUNTIMES
    n_files = None
    if a.data is not None and Path(a.data).is_dir():
        if a.partition is not None:
            raise ConfigError(f"--partition: --data {a.data} is a directory, already one file per device")
        n_files = len(from_dir(a.data)[0])
        if a.devices is not None and a.devices != n_files:
            raise ConfigError(f"--devices = {a.devices}, but --data {a.data} holds {n_files} device files")
    elif a.data is not None and not Path(a.data).is_file():
        raise ConfigError(f"--data {a.data}: no such file or directory")
    devices = n_files or (a.devices if a.devices is not None else 20)
    for name, v in (("devices", devices), ("clients_per_round", a.clients_per_round), ("rounds", a.rounds),
                    ("epochs", a.epochs), ("batch_size", a.batch_size), ("processes", a.processes)):
        if v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} = {v}: must be at least 1")
    if a.clients_per_round > devices:
        raise ConfigError(f"--clients-per-round = {a.clients_per_round} is more than --devices = {devices}")
    if a.over_selection < 1.0:
        raise ConfigError(f"--over-selection = {a.over_selection}: must be at least 1")
    if a.broker not in ("embedded", "mosquitto"):  # anything else was taken for the embedded broker
        from edge.runtime.mqtt import BrokerAddress
        if not a.broker.startswith("mqtt://"):
            raise ConfigError(f"--broker = {a.broker!r}: must be embedded, mosquitto or mqtt://host:port")
        try:
            addr = BrokerAddress.parse(a.broker)
        except ValueError as e:
            raise ConfigError(f"--broker: {e}") from None
        import socket
        try:  # nothing there is a person's mistake: say so now, not in a traceback after the connect timeout
            socket.create_connection((addr.host, addr.port), timeout=5).close()
        except OSError as e:
            raise ConfigError(f"--broker {a.broker}: no broker answers there ({e.strerror or e}); start one "
                              "(fedge broker, mosquitto), or leave --broker out for the embedded one") from None
    runtimes = tuple(r.strip() for r in a.runtimes.split(",") if r.strip())
    bad = [r for r in runtimes if r not in (*RUNTIMES, NATIVE)]
    if bad or not runtimes:
        raise ConfigError(f"--runtimes = {a.runtimes!r}: each must be one of {', '.join((*RUNTIMES, NATIVE))}")
    _export_toolchain(runtimes, "--runtimes")
    if NATIVE in runtimes and not Path(a.native_binary or NATIVE_BINARY).is_file():
        raise ConfigError(f"--runtimes {NATIVE}: no native device at {a.native_binary or NATIVE_BINARY} "
                          "(build it: bash scripts/build_native.sh)")
    if a.partition is not None:
        parse_partition(a.partition)
    strategy_options(a.strategy, _strategy_args(a.strategy_arg), "-S")
    cfg = SimConfig(strategy=a.strategy, devices=devices, clients_per_round=a.clients_per_round, rounds=a.rounds,
                    epochs=a.epochs, lr=a.lr, batch_size=a.batch_size, seed=a.seed, alpha=a.alpha,
                    over_selection=a.over_selection, round_timeout_s=a.round_timeout, broker=a.broker, mode=a.mode,
                    processes=a.processes, workdir=a.workdir, runtimes=runtimes, native_binary=a.native_binary or "",
                    chunk_bytes=a.chunk_kb * 1024, strategy_kw=_strategy_args(a.strategy_arg),
                    data=a.data, partition=a.partition, test_frac=a.test_frac, model=a.model,
                    hidden=tuple(a.hidden))
    if a.ingest_workers:
        if a.broker == "embedded":
            raise ConfigError("--ingest-workers needs an MQTT 5 broker (--broker mosquitto); the embedded one speaks 3.1.1")
        cfg.ingest_workers = a.ingest_workers
    # the data and the model are checked (one line each) before any broker, process or export starts
    _ids, data = load_data(cfg)
    spec = model_spec(cfg, data)
    check_model_for(a.strategy, spec, fleet_runtimes(runtimes))
    cfg = dataclasses.replace(cfg, spec=spec)
    signal.signal(signal.SIGTERM, _interrupt)  # unwind like Ctrl-C: simulate's cleanup stops what it started
    try:
        rep = simulate(cfg, out=a.out, plot=a.plot, progress=not a.no_progress)
    except KeyboardInterrupt:
        print("fedge simulate: interrupted; devices, workers and the private broker were stopped", file=sys.stderr)
        return 130
    rep.pop("_state", None)
    dens = any("density" in r for r in rep["rounds"])
    print(f"{'round':>5} {'accuracy':>8} {'MB down':>8} {'MB up':>8} {'reports':>7} {'unused':>7} {'s':>6}"
          f" {'export s':>8}" + (f" {'density':>7}" if dens else ""))
    for r in rep["rounds"]:
        print(f"{r['round']:>5} {r['accuracy']:>8.4f} {r['bytes_down'] / 1e6:>8.3f} {r['bytes_up'] / 1e6:>8.3f} "
              f"{r['reports']:>7} {r['dropped']:>7} {r['wall_s']:>6.2f} {r.get('export_s') or 0.0:>8.2f}"
              + (f" {r.get('density', 1.0):>7.3f}" if dens else ""))
    if any(r["dropped"] for r in rep["rounds"]):  # (the report's "dropped"): not failures, mostly
        print(f"unused: selected devices whose reports the round did not need (--over-selection {a.over_selection:g} "
              f"selects {math.ceil(a.clients_per_round * a.over_selection)} for {a.clients_per_round} reports) or "
              "that did not report in time")
    print(f"final accuracy {rep['final_accuracy']:.4f}, total {rep['total_bytes'] / 1e6:.1f} MB, "
          f"{rep['wall_s']:.1f} s" + (f"; report in {a.out}" if a.out else "") + (f", plot in {a.plot}" if a.plot else ""))
    return 0


def parser() -> argparse.ArgumentParser:
    """The ``fedge`` command line, every subcommand registered (the tests walk it)."""
    from edge.cli import Parser, describe_subcommands
    ap = Parser(prog="fedge", description=__doc__)
    ap.add_argument("-v", "--verbose", action="count", default=0, help="more log lines: -v info, -vv debug")
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("broker", help="run the embedded MQTT broker (amqtt; MQTT 3.1.1, for development)")
    b.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    b.add_argument("--port", type=_port, default=1883, help="TCP port to listen on")
    b.add_argument("--websockets", type=_port, metavar="PORT", help="run Mosquitto instead, with MQTT over "
                   "WebSockets on PORT too (web-page devices, docs/browser.md)")
    b.set_defaults(fn=cmd_broker)

    v = sub.add_parser("devices", help="list the fleet from a coordinator's state: online, busy, rejected, "
                                       "quarantined")
    v.add_argument("--state", default="runs/coordinator/state.sqlite", help="the coordinator's SQLite state file")
    v.set_defaults(fn=cmd_devices)

    c = sub.add_parser("coordinator", help="run the coordinator daemon")
    c.add_argument("--config", help="fleet.toml (default: every setting at its default, README's example)")
    c.add_argument("--broker", help="mqtt://host:port (overrides the config)")
    c.add_argument("--state", help="SQLite state file (overrides the config)")
    c.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve /metrics, /status.json and the status page on PORT (overrides [metrics] port; 0: off)")
    c.add_argument("--out", help="write the run report JSON here when the coordinator ends")
    c.add_argument("--plot", help="write the accuracy-vs-MB PNG here when the coordinator ends")
    c.set_defaults(fn=cmd_coordinator)

    g = sub.add_parser("ingest", help="run one ingest worker (MQTT 5 shared subscription) for a coordinator "
                                      "with [ingest] shared = true")
    g.add_argument("--config", help="fleet.toml (the coordinator's)")
    g.add_argument("--broker", help="mqtt://host:port (overrides the config)")
    g.add_argument("--state", help="the coordinator's SQLite state file (overrides the config); the inbox is beside it")
    g.add_argument("--name", default="", help="this worker's name (part of its MQTT client id; default random)")
    g.set_defaults(fn=cmd_ingest)

    st = sub.add_parser("status", help="a run's progress, last rounds, devices and quarantines, from a coordinator's "
                                       "status endpoint or its state file")
    st.add_argument("--state", help="the coordinator's SQLite state file (default runs/coordinator/state.sqlite)")
    st.add_argument("--url", help="http://host:port of a coordinator's status server ([metrics] port)")
    st.add_argument("--rounds", type=int, default=10, help="how many of the last rounds to list")
    st.add_argument("--json", action="store_true", help="print the status as JSON (the page's /status.json)")
    st.set_defaults(fn=cmd_status)

    from edge.cli import add_parser as add_device  # the device's own command: it needs nothing of the coordinator
    add_device(sub)

    from .fleetsim.cli import add_parser as add_fleetsim
    add_fleetsim(sub)

    k = sub.add_parser("credentials", help="per-device Mosquitto password + ACL files")
    k.add_argument("--fleet", default="default", help="the fleet name the ACL's topics are under")
    k.add_argument("--devices", required=True, help="comma-separated device ids (each becomes a username)")
    k.add_argument("--coordinator-user", default="coordinator", help="the coordinator's MQTT username")
    k.add_argument("--ingest-workers", type=int, default=0, metavar="N",
                   help="also N read-only users <coordinator-user>-ingest-<i> for `fedge ingest` workers")
    k.add_argument("--out", default="runs/auth", help="directory for passwd, acl, mosquitto.conf lines and the "
                                                     "clear-text credentials")
    k.add_argument("--tls-host", action="append", default=[], metavar="HOST",
                   help="also write a CA and a broker certificate for mqtts:// valid for HOST (repeatable)")
    k.set_defaults(fn=cmd_credentials)

    s = sub.add_parser("simulate", help="a coordinator plus N device agents over MQTT")
    from .strategies import REGISTRY as strategies
    s.add_argument("--strategy", default="fedavg", choices=sorted(strategies), metavar="NAME",
                   help=f"the algorithm: one of {', '.join(sorted(strategies))} (README, \"Strategies\")")
    s.add_argument("--data", help="FILE.npz (x, y; x_test, y_test or --test-frac) split by --partition, or DIR/ "
                                  "of <device id>.npz + test.npz (default: sklearn's digits)")
    s.add_argument("--partition", help="iid | dirichlet:ALPHA | shards:K (default dirichlet:--alpha)")
    s.add_argument("--test-frac", type=float, default=0.2, help="held out of --data FILE when it has no x_test")
    s.add_argument("--model", default="mlp", help="mlp | cnn | spec.json | path/to/file.py:factory | "
                                                  "package.module:factory (docs/your-model.md)")
    s.add_argument("--hidden", type=int, nargs="+", default=[200, 200], help="hidden sizes of --model mlp")
    s.add_argument("--devices", type=int, default=None, help="default 20 (a --data directory: its files)")
    s.add_argument("--clients-per-round", type=int, default=10, help="reports a round commits with")
    s.add_argument("--rounds", type=int, default=30, help="rounds to run")
    s.add_argument("--epochs", type=int, default=1, help="local epochs each device trains per round")
    s.add_argument("--lr", type=float, default=0.05, help="the devices' learning rate")
    s.add_argument("--batch-size", type=int, default=20, help="the devices' minibatch size")
    s.add_argument("--seed", type=int, default=0, help="seeds the data split, the model's initial weights and "
                                                       "the selection")
    s.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label-skew concentration")
    s.add_argument("--over-selection", type=float, default=1.3,
                   help="devices selected per round, as a multiple of --clients-per-round (the rest drop out)")
    s.add_argument("--mode", choices=["reproducible", "production"], default="reproducible",
                   help="reproducible (default): selection, committed reports and the aggregate are a pure function "
                        "of the seed and the data; production: availability and arrival order decide, as in a fleet")
    s.add_argument("--round-timeout", type=float, default=60.0, help="seconds before a round commits with "
                                                                     "the reports it has")
    s.add_argument("--runtimes", default="torch", help="comma list assigned round-robin to devices (torch, ort, "
                   "executorch; native: the C++ device of clients/native, on ExecuTorch)")
    s.add_argument("--native-binary", default=None, help="the fedge-native executable (default build/native/fedge-native)")
    s.add_argument("--broker", default="embedded", help="embedded | mosquitto | mqtt://host:port")
    s.add_argument("--processes", type=int, default=2, help="device processes")
    s.add_argument("--ingest-workers", type=int, default=0, metavar="N",
                   help="take reports through N shared-subscription ingest workers (MQTT 5; --broker mosquitto)")
    s.add_argument("--chunk-kb", type=int, default=DEFAULT_CHUNK_BYTES // 1024,
                   help="MQTT messages above this many KiB are chunked")
    s.add_argument("--workdir", default="runs/simulate", help="the devices' data, state and the coordinator's "
                                                             "state go here")
    s.add_argument("--strategy-arg", "-S", action="append", default=[], metavar="KEY=VALUE",
                   help="strategy option, e.g. -S preset=high -S server_lr=0.03 (repeatable)")
    s.add_argument("--out", help="write the run report JSON here")
    s.add_argument("--plot", help="write accuracy-vs-MB PNG here")
    s.add_argument("--no-progress", action="store_true", help="no progress bar (only the round table)")
    s.set_defaults(fn=cmd_simulate)

    from .conformance import add_parser as add_conformance
    add_conformance(sub)
    from .webdevice import add_parser as add_web_device
    add_web_device(sub)

    try:
        from export.cli import add_parser as add_export  # export tooling is optional on a coordinator
        add_export(sub)
    except ImportError:
        pass

    for p in sub.choices.values():  # -v after the subcommand too (fedge coordinator -v), as people type it
        p.add_argument("-v", "--verbose", action="count", default=0, dest="verbose_after",
                       help="more log lines: -v info, -vv debug")
    describe_subcommands(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.verbose += a.verbose_after
    logging.basicConfig(level=logging.WARNING - 10 * a.verbose,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for h in logging.getLogger().handlers:
        h.addFilter(_DiskFullOneLine())
    return run(a)


def run(a: argparse.Namespace) -> int:
    """A person's mistake is one line on stderr and exit code 2, never a traceback; so is a state file that
    cannot be resumed (damaged, or rows missing). A full disk is one line and exit code 1: once there is room,
    the same command resumes (systemd's Restart=on-failure retries it)."""
    from .store import BadState, OtherRun, StateInUse
    try:
        return a.fn(a)
    except (ConfigError, StateInUse, OtherRun, BadState) as e:
        print(f"fedge {a.cmd}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not disk_full(e):
            raise
        print(f"fedge {a.cmd}: the disk is full ({e}); free space, then run the same command again",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
