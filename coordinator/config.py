"""``fleet.toml``: the coordinator's configuration, checked as a schema before anything starts.

Sections (each a dataclass; its field ``metadata`` holds the allowed ranges)::

    [broker]       url, ca_file, cert_file, key_file                  (edge.runtime.mqtt.BrokerAddress)
    [state]        path                                               (SQLite state file)
    [rounds]       rounds, clients_per_round, over_selection, ...     (coordinator.rounds.RoundConfig)
    [eligibility]  require_charging, require_unmetered, ...           (coordinator.registry.Eligibility)
    [admission]    norm_bound, norm_factor, clip, refuse_factor, max_abs_value, max_accuracy_drop
    [quarantine]   after, window_s, first_s, max_s
    [pace]         enabled, checkins_per_s, min_window_s, max_after_s          (coordinator.registry.Pacing)
    [strategy]     name, sizes (the zoo MLP), and that strategy's own options
    [model]        name (mlp | cnn | spec.json | path/file.py:factory | package.module:factory), input
    [data]         test                                               (held-out .npz for evaluation)
    [metrics]      port (0: off), host                                (/metrics, /status.json, the status page)
    [ingest]       shared (reports through `fedge ingest` workers on an MQTT 5 shared subscription)

Every mistake is a :class:`edge.config.ConfigError` with one line that names the section and key.
What defines the run (strategy and its options, model, data, seed, fleet) is fixed by the saved state;
the broker, round counts, timeouts, eligibility and defences may change when the coordinator restarts.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge.runtime.config import ConfigError, check_field, coerce, from_dict, load_toml, unknown
from edge.runtime.mqtt import BrokerAddress

from .admission import AdmissionRules
from .registry import Eligibility, Pacing, Quarantine
from .rounds import RoundConfig
from .strategies import REGISTRY, strategy_class

SECTIONS = ("broker", "state", "rounds", "eligibility", "admission", "quarantine", "pace", "strategy", "model",
            "data", "metrics", "ingest")


@dataclass
class BrokerSection:
    url: str = "mqtt://127.0.0.1:1883"
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


@dataclass
class StateSection:
    path: str = "runs/coordinator/state.sqlite"


@dataclass
class DataSection:
    test: str | None = None  # .npz with x and y, held out from every device


@dataclass
class ModelSection:
    name: str | None = None  # as --model (export/modelref.py); none: the zoo MLP of [strategy] sizes
    input: list[int] | None = None  # one example's shape; default: the [data] test examples'


@dataclass
class MetricsSection:
    """The coordinator's HTTP server: Prometheus metrics at /metrics, the status page at /. Off by default."""

    port: int = field(default=0, metadata={"min": 0, "max": 65535})  # 0: no server
    host: str = "127.0.0.1"  # loopback: the page shows device ids; "0.0.0.0" for a Prometheus elsewhere


@dataclass
class IngestSection:
    """``shared = true``: the coordinator takes reports from the inbox that ``fedge ingest`` workers fill
    (coordinator/ingest.py), not from the broker; the broker must speak MQTT 5 (Mosquitto, EMQX, HiveMQ)."""

    shared: bool = False


@dataclass
class FleetConfig:
    broker: BrokerAddress
    state_path: str
    rounds: RoundConfig
    strategy_name: str
    strategy_options: dict[str, Any]
    sizes: list[int]
    test: str | None
    raw: dict[str, Any] = field(default_factory=dict)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    ingest: IngestSection = field(default_factory=IngestSection)
    spec: dict[str, Any] | None = None  # the model, when [model] names one (else the MLP of ``sizes``)

    def model(self) -> dict[str, Any]:
        from edge.model import mlp
        return self.spec if self.spec is not None else mlp(self.sizes)

    def run(self) -> dict[str, Any]:
        """What defines the run: a saved state that holds another run is refused."""
        return {"strategy": self.strategy_name, "options": self.strategy_options,
                "model": self.sizes if self.spec is None else self.spec,
                "test": self.test, "seed": self.rounds.seed, "fleet": self.rounds.fleet}


def strategy_options(name: str, options: dict[str, Any], where: str = "[strategy]") -> dict[str, Any]:
    """Check ``options`` against the strategy's own fields (names and types); returns them coerced."""
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, list(REGISTRY), n=1)
        raise ConfigError(f"{where} name = {name!r}: unknown strategy (known: {', '.join(sorted(REGISTRY))})"
                          + (f"; did you mean {close[0]!r}?" if close else ""))
    cls, defaults = strategy_class(name)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in ("spec", "name")}
    out = {}
    for k, v in options.items():
        if k not in fields:
            raise unknown(k, list(fields), where)
        out[k] = coerce(v, hints[k], f"{where} {k}")
        check_field(fields[k], out[k], f"{where} {k}")
        _trainable(k, out[k], f"{where} {k}")
    try:  # the strategy's own checks (presets, variants, ...) run in its __post_init__
        cls(**(defaults | out))
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{where} {name}: {e}") from None
    return out


def _trainable(key: str, value: Any, what: str) -> None:
    """Options every strategy shares, refused when no device could train with them (every plan would fail on
    the devices, and the run would only say that too many dropped out): epochs and batch size at least 1, no
    negative learning rate, and value formats the devices encode (edge/protocol/codec.py VALUE_KINDS)."""
    from edge.algorithms.driver import SAMPLE_DESIGNS
    from edge.protocol.codec import VALUE_KINDS
    if value is None:
        return
    if key in ("epochs", "batch_size") and value < 1:
        raise ConfigError(f"{what} = {value!r}: must be at least 1")
    if (key == "lr" or key.endswith("_lr")) and value < 0:
        raise ConfigError(f"{what} = {value!r}: a learning rate must be at least 0")
    if (key.endswith("_dtype") or key.endswith("_dtype_1d")) and value not in VALUE_KINDS:
        raise ConfigError(f"{what} = {value!r}: must be one of {', '.join(VALUE_KINDS)}")
    if key == "upload_sample" and value not in SAMPLE_DESIGNS:
        raise ConfigError(f"{what} = {value!r}: must be one of {', '.join(SAMPLE_DESIGNS)}")


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    sec = raw.get(name, {})
    if not isinstance(sec, dict):
        raise ConfigError(f"[{name}] must be a table")
    return sec


def load_fleet(path: str | None, *, broker: str | None = None, state: str | None = None,
               metrics_port: int | None = None) -> FleetConfig:
    """Read and check ``fleet.toml`` (``None``: all defaults). ``broker``/``state``/``metrics_port`` override
    the file."""
    raw = load_toml(path) if path else {}
    where = path or "fleet config"
    for k in raw:
        if k not in SECTIONS:
            raise unknown(k, list(SECTIONS), where, "section")
    b = from_dict(BrokerSection, _section(raw, "broker"), "[broker]")
    try:
        addr = BrokerAddress.parse(broker or b.url, ca_file=b.ca_file, cert_file=b.cert_file, key_file=b.key_file)
    except ValueError as e:
        raise ConfigError(f"{'--broker' if broker else '[broker] url'}: {e}") from None
    st = from_dict(StateSection, _section(raw, "state"), "[state]")
    elig = from_dict(Eligibility, _section(raw, "eligibility"), "[eligibility]")
    adm = from_dict(AdmissionRules, _section(raw, "admission"), "[admission]")
    quar = from_dict(Quarantine, _section(raw, "quarantine"), "[quarantine]")
    pace = from_dict(Pacing, _section(raw, "pace"), "[pace]")
    rc = from_dict(RoundConfig, _section(raw, "rounds"), "[rounds]",
                   skip=("eligibility", "admission", "quarantine", "pace", "run_id"))
    rc = dataclasses.replace(rc, eligibility=elig, admission=adm, quarantine=quar, pace=pace)
    s = dict(_section(raw, "strategy"))
    name = s.pop("name", "fedavg")
    if not isinstance(name, str):
        raise ConfigError(f"[strategy] name = {name!r}: expected a string")
    sizes = s.pop("sizes", [64, 200, 200, 10])
    if (not isinstance(sizes, list) or len(sizes) < 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes)):
        raise ConfigError(f"[strategy] sizes = {sizes!r}: expected a list of at least two positive integers")
    opts = strategy_options(name, s)
    data = from_dict(DataSection, _section(raw, "data"), "[data]")
    if data.test is not None and not Path(data.test).is_file():
        raise ConfigError(f"[data] test = {data.test!r}: no such file")
    met = from_dict(MetricsSection, _section(raw, "metrics"), "[metrics]")
    if metrics_port is not None:
        if not 0 <= metrics_port <= 65535:
            raise ConfigError(f"--metrics-port = {metrics_port}: must be 0 (off) to 65535")
        met = dataclasses.replace(met, port=metrics_port)
    ing = from_dict(IngestSection, _section(raw, "ingest"), "[ingest]")
    spec = None
    msec = from_dict(ModelSection, _section(raw, "model"), "[model]")
    if msec.name is not None:
        if "sizes" in _section(raw, "strategy"):
            raise ConfigError("[strategy] sizes: give the model in [model] name, not both")
        spec = _model(msec, data.test)
    elif data.test is not None:
        _mlp_fits(sizes, data.test)
    state_path = _state_path(st.path if state is None else state, "[state] path" if state is None else "--state")
    return FleetConfig(addr, state_path, rc, name, opts, sizes, data.test, raw, met, ing, spec)


def _state_path(path: str, what: str) -> str:
    """The SQLite state file: a file's path (an empty one, or ``:memory:``, would be a database that is forgotten
    when the coordinator stops, and so would the run)."""
    if not path.strip() or path == ":memory:" or path.startswith("file:"):
        raise ConfigError(f"{what} = {path!r}: give the path of the state file (the run is kept there)")
    if Path(path).is_dir():
        raise ConfigError(f"{what} = {path!r}: is a directory; give the path of the state file in it")
    return path


def _mlp_fits(sizes: list[int], test: str) -> None:
    """The zoo MLP of [strategy] sizes against the [data] test examples: as many inputs as an example has
    features, and an output for every label."""
    from .datasets import check_xy, read_npz
    d = read_npz(test, f"[data] test = {test!r}")
    if "x" not in d or "y" not in d:
        raise ConfigError(f"[data] test = {test!r}: needs arrays x and y")
    x, y = check_xy(d["x"], d["y"], f"[data] test = {test!r}")
    features, classes = int(np.prod(x.shape[1:])), int(y.max()) + 1
    if features != sizes[0]:
        raise ConfigError(f"[strategy] sizes = {sizes}: the model takes {sizes[0]} inputs, the [data] test examples "
                          f"have {features} features")
    if classes > sizes[-1]:
        raise ConfigError(f"[strategy] sizes = {sizes}: the model has {sizes[-1]} classes, the [data] test labels "
                          f"go up to {classes - 1} ({classes} classes)")


def _model(m: ModelSection, test: str | None) -> dict[str, Any]:
    """[model] name for the examples of [model] input or of the [data] test file (whose labels it must cover)."""
    from .datasets import check_xy, read_npz
    from export.modelref import resolve
    shape, classes = m.input, None
    if test is not None:
        d = read_npz(test, f"[data] test = {test!r}")
        if "x" not in d or "y" not in d:
            raise ConfigError(f"[data] test = {test!r}: needs arrays x and y")
        x, y = check_xy(d["x"], d["y"], f"[data] test = {test!r}")
        if shape is not None and tuple(shape) != tuple(x.shape[1:]):
            raise ConfigError(f"[model] input = {shape}: the [data] test examples are {list(x.shape[1:])}")
        shape, classes = list(x.shape[1:]), int(y.max()) + 1
    if shape is None:
        raise ConfigError("[model] input: give one example's shape (or a [data] test file to read it from)")
    try:
        return resolve(m.name, tuple(shape), classes)
    except ConfigError as e:
        raise ConfigError(f"[model] name = {m.name!r}: {str(e).removeprefix(f'--model {m.name}: ')}") from None
