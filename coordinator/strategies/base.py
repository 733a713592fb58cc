"""The strategy contract: a few small functions over explicit state.

``init`` -> ``plan`` per device -> ``begin`` / ``accumulate`` (a streaming weighted sum, so memory does not
grow with the number of reports) -> ``finish`` (the server step). State is plain arrays and scalars so the
store can persist it and a restarted coordinator can resume.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edge.algorithms.base import Hparams
from edge.protocol.wire import Report


class ReportRejected(ValueError):
    """A report that decoded fine but does not fit what was asked of the device."""


@dataclass
class ServerState:
    round: int  # rounds committed so far
    weights: dict[str, np.ndarray]
    opt: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        arrays = {f"w/{k}": v for k, v in self.weights.items()} | {f"o/{k}": v for k, v in self.opt.items()}
        np.savez(buf, __meta__=np.frombuffer(json.dumps({"round": self.round, "meta": self.meta}).encode(), np.uint8),
                 **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "ServerState":
        with np.load(io.BytesIO(data), allow_pickle=False) as f:
            head = json.loads(f["__meta__"].tobytes())
            w = {k[2:]: f[k] for k in f.files if k.startswith("w/")}
            o = {k[2:]: f[k] for k in f.files if k.startswith("o/")}
        return cls(head["round"], w, o, head["meta"])


@dataclass
class DevicePlan:
    """What the strategy asks of one device; the round machine wraps it into a wire Plan.

    ``returns``, ``maskable`` and ``extras`` say what the device may send back, so that every report is
    checked against its own plan before a strategy sees it (coordinator/admission.py): the tensors it
    may return (default: every tensor of ``weights``, same shapes), those that may carry a row mask,
    and the extra arrays with their shapes (float32 unless ``extra_dtypes`` names another wire dtype,
    e.g. ``{"idx": "i4"}`` for indices). ``update`` says what the returned tensors are: ``"weights"``
    (trained values, whose change from the plan's is what admission bounds) or ``"gradient"`` (values that
    are themselves the update, e.g. SFVI's gradients: admission bounds their own norm).
    """

    weights: dict[str, np.ndarray]
    hparams: dict[str, Any]
    upload: dict[str, Any]
    spec: dict[str, Any]  # model spec of the (possibly sliced) network the device trains
    objective: str = "ce"  # the training objective (edge/trainers/torch_objectives) the device's program runs
    layout: dict[str, Any] = field(default_factory=dict)  # what else fixes the program's shapes (FedMix's experts)
    returns: tuple[str, ...] | None = None  # None: every tensor of weights
    maskable: frozenset[str] = frozenset()
    extras: dict[str, tuple[int, ...]] = field(default_factory=dict)
    extra_dtypes: dict[str, str] = field(default_factory=dict)  # wire dtype code per extra; absent: "f4"
    update: str = "weights"  # "weights" | "gradient": what the returned tensors are
    # The downlink (edge/protocol/downlink.py, coordinator/strategies/links.py): what goes on the wire in place
    # of ``weights`` (coded, or differences from the model the device holds), the tag of the model it makes
    # and the tag it is relative to. ``weights`` stays the server's exact weights: reports are read against it.
    wire: dict[str, Any] | None = None
    tag: str = ""
    base: str = ""
    # The program a device with the padded_programs extension runs instead of (spec, layout)'s own: the smallest
    # bucket that holds this network, and the bucket family to build ahead of time (coordinator/buckets.py).
    padded: Any = None

    def __post_init__(self) -> None:
        if self.update not in ("weights", "gradient"):
            raise ValueError(f"update must be weights or gradient, not {self.update!r}")
        if self.update == "gradient" and self.upload.get("delta"):
            raise ValueError("a gradient is not sent as a difference from the plan's weights")

    def returned(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor the device may send back."""
        names = self.weights if self.returns is None else self.returns
        return {k: tuple(self.weights[k].shape) for k in names}


def received_weights(plan: DevicePlan, report: Report, name: str) -> np.ndarray:
    """The device's weights for tensor ``name`` in float64, full (sliced-plan) shape, zeros in inactive rows.
    Undoes ``upload.delta`` (values sent as differences from the plan's weights) and, for a sampled update,
    divides each row sent by its inclusion probability (Horvitz-Thompson; an active row not sent is the plan's
    weight plus this unbiased estimate of its difference, i.e. the plan's weight)."""
    t = report.tensors[name]
    w = t.estimate()
    if plan.upload.get("delta"):
        w += plan.weights[name]
        if t.mask is not None:
            w[~t.mask] = 0.0
    return w


def plan_difference(plan: DevicePlan, report: Report, name: str) -> np.ndarray | None:
    """w_s - w (float32) of a dense float32 tensor sent as weights, computed once per report: admission's norm
    and FedAvg's sum both need it. It is kept on the report, so it goes when the report does (ingest's next
    report then reuses that memory while it is still in cache), and a report held for later (reproducible
    mode) or clipped (a new object) never reads another's. None when the tensor is not that case."""
    memo = report.__dict__.get("_differences")
    if memo is None or memo[0] is not plan:
        memo = report.__dict__["_differences"] = (plan, {})
    d = memo[1].get(name, _NOT_YET)
    if d is _NOT_YET:
        t, w = report.tensors[name], plan.weights[name]
        plain = (t.plain and t.values.dtype == np.float32 and w.dtype == np.float32 and t.values.shape == w.shape
                 and not plan.upload.get("delta") and plan.update != "gradient")
        d = memo[1][name] = np.subtract(t.values, w) if plain else None
    return d


_NOT_YET = object()


def drop_differences(report: Report) -> None:
    """Forget the differences :func:`plan_difference` kept on a report that will wait (reproducible mode holds
    reports until their turn): a held report should not keep a second copy of its values."""
    report.__dict__.pop("_differences", None)


def upload_spec(dtype: str, *, dtype_1d: str | None = None, delta: bool | None = None, sample: str | None = None,
                keep: float = 1.0, p_min: float = 0.0) -> dict[str, Any]:
    """What a device sends back (edge.algorithms.driver.encode_update). Anything but float32 travels as
    differences unless told otherwise (a low-precision weight swallows a round's small change); ``sample`` (norm
    or uniform) sends about ``keep`` of the rows of each matrix, each with a known probability >= ``p_min``."""
    out: dict[str, Any] = {"dtype": dtype, "delta": dtype != "f4" if delta is None else bool(delta)}
    if dtype_1d is not None:
        out["dtype_1d"] = dtype_1d
    if sample is not None and keep < 1.0:
        out |= {"sample": sample, "keep": float(keep), "p_min": float(p_min), "delta": True}
    return out


class Strategy(Protocol):
    name: str

    def init(self, seed: int) -> ServerState: ...
    def hparams(self, state: ServerState) -> Hparams: ...
    def plan(self, state: ServerState, device_id: str, caps: dict[str, Any]) -> DevicePlan: ...
    def begin(self, state: ServerState) -> Any: ...
    def accumulate(self, state: ServerState, acc: Any, plan: DevicePlan, report: Report) -> None: ...
    def finish(self, state: ServerState, acc: Any) -> ServerState: ...
    def global_model(self, state: ServerState) -> tuple[dict[str, Any], dict[str, np.ndarray]]: ...
    # Optional: ``observe_fleet(devices: dict[str, int])``, the registered devices and their declared sample
    # counts, called before a round's plans are made (strategies that scale by the fleet's size, e.g. SFVI's
    # J / |S_t| and SFVI-Avg's N / N_j).
