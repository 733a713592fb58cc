"""``fedge simulate``: a coordinator and N device agents over a real broker, each agent its own MQTT client.

Devices run in ``processes`` child processes (each with its own MQTT clients and a small training pool);
the coordinator runs in this process. Data are written as one ``.npz`` per device, as a real device would
hold them; the held-out test split stays with the coordinator. The data are sklearn's digits, or a person's
``.npz`` (``data``: one file split by ``partition``, or a directory of ``<device id>.npz`` + ``test.npz``), and
the model a zoo name or a person's own (``model``; export/modelref.py).

A runtime named ``native`` in ``runtimes`` is a device with no Python: the C++ device of clients/native
(``fedge-native``, built by ``scripts/build_native.sh``) as its own process, which checks in as ``executorch``.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge.protocol import wire
from edge.runtime.data import save_npz
from edge.runtime.mqtt import BrokerAddress

from .broker import start_broker
from .daemon import Coordinator, CoordinatorConfig, Evaluator, ProgramCatalog
from .datasets import FederatedData, digits_federated, from_dir, from_file, load_digits_xy, partition
from .registry import Eligibility
from .report import plot_accuracy_vs_bytes, run_report, write_json
from .rounds import RoundConfig
from .strategies import make_strategy

log = logging.getLogger("fedge.simulate")

NATIVE = "native"  # a device run by the C++ device of clients/native; it trains ExecuTorch programs
NATIVE_BINARY = Path(__file__).resolve().parent.parent / "build" / "native" / "fedge-native"


def device_runtime(runtime: str) -> str:
    """The runtime a device of ``runtime`` declares (a native device runs ExecuTorch programs)."""
    return "executorch" if runtime == NATIVE else runtime


def fleet_runtimes(runtimes: tuple[str, ...]) -> tuple[str, ...]:
    """The runtimes the coordinator serves for a fleet of these devices, each once."""
    return tuple(dict.fromkeys(device_runtime(r) for r in runtimes))


@dataclass
class SimConfig:
    strategy: str = "fedavg"
    devices: int = 20
    clients_per_round: int = 10
    rounds: int = 30
    epochs: int = 1
    lr: float = 0.05
    batch_size: int = 20
    seed: int = 0
    alpha: float = 0.5
    val_frac: float = 0.0  # a validation split beside the test split, taken from the training data (datasets.py)
    hidden: tuple[int, ...] = (200, 200)
    over_selection: float = 1.3
    mode: str = "reproducible"  # reproducible: a pure function of seed and data; production: who comes first
    min_reports: int = 0
    round_timeout_s: float = 60.0
    selection_timeout_s: float = 5.0
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES
    runtimes: tuple[str, ...] = ("torch",)  # assigned round-robin to devices; "native": the C++ device
    native_binary: str = ""  # the fedge-native executable for "native" devices ("": NATIVE_BINARY)
    broker: str = "embedded"  # embedded | mosquitto | mqtt://host:port
    processes: int = 1
    workdir: str = "runs/simulate"
    fleet: str = ""  # topic namespace; empty: a fresh one per run, so runs sharing a broker never mix
    ingest_workers: int = 0  # >0: reports go through that many MQTT 5 shared-subscription workers (coordinator/ingest.py)
    strategy_kw: dict[str, Any] = field(default_factory=dict)
    data: str | None = None  # a person's .npz (split by ``partition``) or directory (one file per device); None: digits
    partition: str | None = None  # iid | dirichlet:ALPHA | shards:K; None: dirichlet:<alpha>
    test_frac: float = 0.2  # held out of ``data`` when it has no x_test/y_test
    model: str = "mlp"  # zoo name, spec .json or a factory reference (export/modelref.py)
    spec: dict[str, Any] | None = None  # the resolved model (model_spec() fills it)


def _device_worker(specs: list[dict], broker_url: str, stop: Any, ready: Any,
                   device_class: type | None = None) -> None:  # noqa: D401
    """Child process: run a group of devices until told to stop (``device_class``: a subclass of Device that
    each is made into, such as a benchmark's that times itself)."""
    logging.basicConfig(level=os.environ.get("FEDGE_LOG", "WARNING"),
                        format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s")
    from concurrent.futures import ThreadPoolExecutor
    from edge.runtime.device import device_from_files
    pool = ThreadPoolExecutor(max_workers=1)  # one trainer at a time per process: the machine has 2 cores
    devs = [device_from_files(s["id"], s["data"], s["state"], broker_url, capabilities=s["caps"], fleet=s["fleet"],
                              chunk_bytes=s["chunk_bytes"], executor=pool, trainer_kw={"threads": 1})
            for s in specs]
    for d in devs:
        if device_class is not None:
            d.__class__ = device_class
    warm_runtimes(devs)
    devs = [d.start() for d in devs]
    ready.set()
    stop.wait()
    for d in devs:
        d.stop()
    pool.shutdown(wait=False, cancel_futures=True)


def warm_runtimes(devs: list) -> None:
    """Each runtime of these devices loaded once, before they check in (``Device.warm_up``): a round's first
    plans would otherwise pay the process's torch import."""
    seen = set()
    for d in devs:
        rt = d.agent.cfg.capabilities.get("runtime")
        if rt not in seen:
            seen.add(rt)
            d.warm_up()


class DeviceFleet:
    """Device agents spread over child processes."""

    def __init__(self, specs: list[dict], broker_url: str, processes: int, native_binary: str = "", *,
                 worker: Any = None, worker_args: tuple = ()):
        """``worker``: the child processes' function (default :func:`_device_worker`), called as
        ``worker(specs, broker_url, stop, ready, *worker_args)``; a benchmark's devices that time themselves."""
        ctx = mp.get_context("spawn")
        self.stop_event = ctx.Event()
        self.procs = []
        self.native: list[subprocess.Popen] = []
        natives = [s for s in specs if s.get("native")]
        specs = [s for s in specs if not s.get("native")]
        if natives:
            self.native = [start_native(s, broker_url, native_binary) for s in natives]
        groups = [specs[i::processes] for i in range(max(1, processes))] if specs else []
        readies = []
        for i, g in enumerate(groups):
            if not g:
                continue
            ready = ctx.Event()
            p = ctx.Process(target=worker or _device_worker, args=(g, broker_url, self.stop_event, ready, *worker_args),
                            name=f"devices-{i}", daemon=True)
            p.start()
            self.procs.append(p)
            readies.append(ready)
        end = time.time() + 120
        for p, r in zip(self.procs, readies):
            while not r.wait(0.2):
                if not p.is_alive():
                    self.stop()
                    raise RuntimeError(f"device process {p.name} exited with code {p.exitcode} while starting")
                if time.time() > end:
                    self.stop()
                    raise TimeoutError("device processes did not start")

    def stop(self) -> None:
        self.stop_event.set()
        for n in self.native:
            n.terminate()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        for n in self.native:
            try:
                n.wait(10)
            except subprocess.TimeoutExpired:
                n.kill()
                n.wait()


def start_native(spec: dict, broker_url: str, binary: str = "") -> subprocess.Popen:
    """One native device process (clients/native), its log in its state directory."""
    exe = Path(binary or NATIVE_BINARY)
    if not exe.is_file():
        raise FileNotFoundError(f"{exe}: no native device; build it with scripts/build_native.sh")
    logf = open(Path(spec["state"]) / "native.log", "ab")
    try:
        return subprocess.Popen([str(exe), "--id", spec["id"], "--data", spec["data"], "--broker", broker_url,
                                 "--fleet", spec["fleet"], "--state-dir", spec["state"],
                                 "--chunk-bytes", str(spec["chunk_bytes"])],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)
    finally:
        logf.close()


def load_data(cfg: SimConfig) -> tuple[list[str] | None, FederatedData]:
    """The federated data of a run, and the device ids when the data name them (a directory)."""
    if cfg.data is not None and Path(cfg.data).is_dir():
        ids, data = from_dir(cfg.data)
        return ids, data
    if cfg.data is not None:
        return None, from_file(cfg.data, cfg.devices, cfg.partition or f"dirichlet:{cfg.alpha}", cfg.seed,
                               cfg.test_frac)
    if cfg.partition is None:
        return None, digits_federated(cfg.devices, cfg.alpha, cfg.seed, val_frac=cfg.val_frac)
    x, y = load_digits_xy()
    rng = np.random.default_rng(cfg.seed)
    perm = rng.permutation(len(y))
    n_test = int(round(0.2 * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    xt, yt = x[train], y[train]
    return None, FederatedData([(xt[i], yt[i]) for i in partition(yt, cfg.devices, cfg.partition, rng)],
                               x[test], y[test], 10)


def model_spec(cfg: SimConfig, data: FederatedData) -> dict[str, Any]:
    """The model the run trains: the digits MLP by default, else ``cfg.model`` for the data's examples."""
    if cfg.spec is not None:
        return cfg.spec
    from edge.model import mlp
    from export.modelref import resolve
    if cfg.model == "mlp" and cfg.data is None:
        return mlp([64, *cfg.hidden, 10])
    return resolve(cfg.model, data.x_test.shape[1:], data.num_classes, hidden=cfg.hidden)


def prepare(cfg: SimConfig) -> tuple[list[dict], Any]:
    """Write each device's shard to its own file (a directory's files are used where they are); returns device
    specs and the federated data."""
    work = Path(cfg.workdir)
    ids, data = load_data(cfg)
    specs = []
    for i, (x, y) in enumerate(data.shards):
        did = f"d{i:04d}" if ids is None else ids[i]
        ddir = work / "devices" / did
        ddir.mkdir(parents=True, exist_ok=True)
        if ids is None:
            save_npz(ddir / "data.npz", x, y)
        path = ddir / "data.npz" if ids is None else Path(cfg.data) / f"{did}.npz"
        rt = cfg.runtimes[i % len(cfg.runtimes)]
        caps = {"runtime": device_runtime(rt), "memory_mb": 2048, "battery": 0.9,
                "charging": True, "network": "wifi", "idle": True}
        specs.append({"id": did, "data": str(path), "state": str(ddir), "caps": caps, "native": rt == NATIVE,
                      "chunk_bytes": cfg.chunk_bytes, "fleet": cfg.fleet or "default"})
    return specs, data


def preflight(cfg: SimConfig, programs: ProgramCatalog) -> None:
    """Export the first round's program for every runtime of the run now, before a broker, a device or a round
    exists: a model a runtime cannot take is one line (ConfigError) here, not a failed round."""
    from edge.runtime.config import ConfigError
    try:
        strategy = make_strategy(cfg.strategy, spec=cfg.spec, lr=cfg.lr, epochs=cfg.epochs,
                                 batch_size=cfg.batch_size, **cfg.strategy_kw)
    except (TypeError, ValueError) as e:  # a strategy that cannot take this model or these settings
        raise ConfigError(f"--strategy {cfg.strategy}: {e}") from None
    dp = strategy.plan(strategy.init(cfg.seed), "preflight", {})
    for rt in fleet_runtimes(cfg.runtimes):
        try:
            programs(dp.spec, rt, dp.objective, dp.layout)
        except ConfigError:
            raise
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise ConfigError(f"--model {cfg.model}: exporting it for {rt} failed: {type(e).__name__}: {first}") from None


def build_coordinator(cfg: SimConfig, broker_url: str | BrokerAddress, test: tuple, on_round=None, *,
                      observer=None, programs: ProgramCatalog | None = None) -> Coordinator:
    from edge.model import mlp
    spec = cfg.spec if cfg.spec is not None else mlp([64, *cfg.hidden, 10])
    strategy = make_strategy(cfg.strategy, spec=spec, lr=cfg.lr, epochs=cfg.epochs,
                             batch_size=cfg.batch_size, **cfg.strategy_kw)
    if cfg.mode not in ("reproducible", "production"):
        raise ValueError(f"mode must be reproducible or production, not {cfg.mode!r}")
    rc = RoundConfig(rounds=cfg.rounds, clients_per_round=cfg.clients_per_round, over_selection=cfg.over_selection,
                     reproducible=cfg.mode == "reproducible", expected_devices=cfg.devices,
                     min_reports=cfg.min_reports, round_timeout_s=cfg.round_timeout_s,
                     selection_timeout_s=cfg.selection_timeout_s, seed=cfg.seed, chunk_bytes=cfg.chunk_bytes,
                     fleet=cfg.fleet or "default",
                     eligibility=Eligibility(runtimes=fleet_runtimes(cfg.runtimes)))
    addr = broker_url if isinstance(broker_url, BrokerAddress) else BrokerAddress.parse(broker_url)
    cc = CoordinatorConfig(rc, addr, str(Path(cfg.workdir) / "coordinator.sqlite"),
                           ingest="shared" if cfg.ingest_workers else "direct")
    return Coordinator(cc, strategy, evaluator=Evaluator(*test), on_round=on_round, observer=observer,
                       programs=programs)


def start_ingest_workers(n: int, coord: Coordinator) -> list:
    """``n`` ingest workers (threads here; processes in production, ``fedge ingest``) for ``coord``'s inbox."""
    from .ingest import IngestWorker, inbox_path
    workers = [IngestWorker(coord.cfg.broker, coord.machine.cfg.fleet, inbox_path(coord.cfg.state_path),
                            name=f"w{i}").start() for i in range(n)]
    for w in workers:
        if not w.link.connected.wait(30):
            raise TimeoutError(f"ingest worker {w.name} could not connect to {coord.cfg.broker.url()} (shared "
                               "subscriptions need an MQTT 5 broker such as Mosquitto)")
    return workers


def simulate(cfg: SimConfig, *, out: str | None = None, plot: str | None = None, progress: bool = True) -> dict:
    """Run a whole federated training over MQTT; returns the run report (and writes it to ``out``)."""
    if not cfg.fleet:
        cfg = replace(cfg, fleet=f"sim-{os.getpid()}-{int(time.time() * 1000) % 10**9}")
    if cfg.data is not None and Path(cfg.workdir).resolve() in [Path(cfg.data).resolve(), *Path(cfg.data).resolve().parents]:
        from edge.runtime.config import ConfigError
        raise ConfigError(f"--data {cfg.data} is inside --workdir {cfg.workdir}, which a run deletes first")
    if Path(cfg.workdir).exists():
        shutil.rmtree(cfg.workdir)
    specs, data = prepare(cfg)
    cfg = replace(cfg, spec=model_spec(cfg, data), devices=len(specs))
    # exports off the coordinator's network thread, as the daemon runs them (a round waits for its programs, or in
    # production mode passes over the devices that lack them: coordinator/rounds.py), with the first round's
    # bucket family asked for before any device checks in
    programs = ProgramCatalog(background=True)
    if cfg.spec.get("arch") == "module":
        preflight(cfg, programs)
    broker = None
    url = cfg.broker
    t0 = time.time()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.rounds, desc=f"{cfg.strategy} rounds", unit="round")
    rows: list[dict] = []

    natives = {sp["id"] for sp in specs if sp["native"]}

    def on_round(s: dict) -> None:
        if natives:  # how many of the committed reports came from native devices (the run report keeps the count)
            s = s | {"native_reports": len(natives.intersection(s.get("accepted", ())))}
        rows.append(s)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(acc=f"{s['accuracy']:.3f}", MB=f"{(s['bytes_down'] + s['bytes_up']) / 1e6:.2f}")
        else:
            log.info("round %d accuracy %.4f", s["round"], s["accuracy"])

    devices = coord = None
    workers: list = []
    try:
        if not url.startswith("mqtt://"):
            broker = start_broker(url)
            url = broker.url
        coord = build_coordinator(cfg, url, (data.x_test, data.y_test), on_round, programs=programs)
        coord.prefetch(fleet_runtimes(cfg.runtimes))
        coord.start()
        if not coord.link.connected.wait(30):
            raise TimeoutError(f"coordinator could not connect to {url}")
        workers = start_ingest_workers(cfg.ingest_workers, coord)
        devices = DeviceFleet(specs, url, cfg.processes, cfg.native_binary)
        coord.wait()
        if coord.error:
            raise RuntimeError("coordinator failed") from coord.error
        final_state = coord.state
    finally:
        if bar is not None:
            bar.close()
        for w in workers:
            w.stop()
        if coord is not None:
            coord.stop()
        if devices is not None:
            devices.stop()
        if broker is not None:
            broker.stop()
    rep = run_report(strategy=cfg.strategy, runtime="+".join(cfg.runtimes), devices=cfg.devices, mode=cfg.mode,
                     clients_per_round=cfg.clients_per_round, rounds=rows, wall_s=time.time() - t0, seed=cfg.seed,
                     model=cfg.model, data=cfg.data or "digits",
                     partition=cfg.partition or f"dirichlet:{cfg.alpha}" if not (cfg.data and Path(cfg.data).is_dir())
                     else "natural")
    if out:
        write_json(out, rep)
    if plot:
        plot_accuracy_vs_bytes([(cfg.strategy, rows)], plot, title=f"{cfg.strategy}, {cfg.devices} devices")
    rep["_state"] = final_state
    return rep
