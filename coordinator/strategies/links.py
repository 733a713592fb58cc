"""The server's side of the links: what a plan sends down, and what it lets a device send up.

- :class:`Downlink`: a plan's weights in lower precision and, where the device holds a model the server knows,
  as differences from it (edge/protocol/downlink.py does the coding on both ends). The server keeps, per device,
  the model the device will hold after its last plan and whether the device has confirmed it by reporting on
  that plan; only a confirmed model is used as a base, so a plan never refers to a model the device may lack.
  The records live in memory: after a restart every device gets absolute weights once.
- :func:`upload_for`: the upload spec for one device, its sampling budget taken from the link the device
  reports (capability ``link_kbps``) when the strategy gives an upload time.

Both are protocol extensions (docs/protocol.md 6.1 and 5): a device gets them only if its check-in declares
them (capabilities ``coded_downlink`` and ``sampled_upload``); any other device gets float32 weights without
tag or base, and a dense upload in the plan's value format, which every v1 device implements.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from edge.algorithms.driver import value_format
from edge.protocol import downlink
from edge.protocol.codec import VALUE_KINDS, value_nbytes

from .base import DevicePlan, upload_spec


@dataclass
class _Held:
    tag: str
    model: dict[str, np.ndarray]
    confirmed: bool = False


@dataclass
class Downlink:
    """Per-device downlink coding. ``fmt``: value format of matrices; ``fmt_1d``: of vectors; tensors whose name
    ends with one of ``exact`` always go as float32 (FedSparse's thresholds: T = 1e-3 turns a rounding of the
    threshold into whole units of logit). ``deltas``: send differences from the model a device holds."""

    fmt: str = "f4"
    fmt_1d: str = "f4"
    exact: tuple[str, ...] = (".v",)
    deltas: bool = True
    held: dict[str, _Held] = field(default_factory=dict)
    _count: int = 0
    _absolute: tuple[Any, dict, dict] | None = None  # (the plan weights it was made for, wire, model)

    def __post_init__(self) -> None:
        for f in (self.fmt, self.fmt_1d):
            if f not in VALUE_KINDS:
                raise ValueError(f"downlink format {f!r} is not one of {VALUE_KINDS}")

    @property
    def active(self) -> bool:
        return self.deltas or self.fmt != "f4" or self.fmt_1d != "f4"

    def formats(self, weights: dict[str, np.ndarray]) -> dict[str, str]:
        return {k: "f4" if k.endswith(self.exact) else (self.fmt if w.ndim >= 2 else self.fmt_1d)
                for k, w in weights.items()}

    def plan(self, dp: DevicePlan, device_id: str,
             fix: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
             caps: dict[str, Any] | None = None) -> DevicePlan:
        """``dp`` (the round's shared plan) for ``device_id``: its wire weights, tag and base. ``fix`` maps the
        model the device will hold to replacements for some of its float32 (``exact``) tensors, computed from
        what the device will actually see (FedSparse: thresholds that give the device the server's theta).
        A device whose capabilities (``caps``) do not declare ``coded_downlink`` gets ``dp`` as it is."""
        if not self.active:
            return dp
        if caps is not None and caps.get("coded_downlink") is not True:
            self.held.pop(device_id, None)  # it holds no model we made
            return dp
        rec = self.held.get(device_id)
        base = rec if (self.deltas and rec is not None and rec.confirmed) else None
        fmts = self.formats(dp.weights)
        if base is None:  # absolute: the same coding for every such device of the round, made once
            if self._absolute is None or self._absolute[0] is not dp.weights:
                wire_w, model = downlink.encode(dp.weights, None, fmts)
                if fix is not None:
                    wire_w, model = _refix(dp.weights, None, fmts, wire_w, model, fix)
                self._absolute = (dp.weights, wire_w, model)
            wire_w, model = self._absolute[1], self._absolute[2]
        else:
            wire_w, model = downlink.encode(dp.weights, base.model, fmts)
            if fix is not None:
                wire_w, model = _refix(dp.weights, base.model, fmts, wire_w, model, fix)
        self._count += 1
        tag = f"m{self._count}"
        if self.deltas:
            self.held[device_id] = _Held(tag, model)
        return replace(dp, wire=wire_w, tag=tag if self.deltas else "", base=base.tag if base else "")

    def confirm(self, device_id: str, plan: DevicePlan) -> None:
        """The device reported on ``plan``: it holds that plan's model."""
        rec = self.held.get(device_id)
        if rec is not None and plan.tag and rec.tag == plan.tag:
            rec.confirmed = True

    def model(self, device_id: str) -> dict[str, np.ndarray] | None:
        """The model the device holds after its last plan (what it trained from), if known."""
        rec = self.held.get(device_id)
        return None if rec is None else rec.model


def _refix(weights, held, fmts, wire_w, model, fix):
    new = fix(model)
    if any(fmts.get(k, "f4") != "f4" for k in new):
        raise ValueError("only float32 tensors can be fixed after coding")
    w2, m2 = downlink.encode(new, held, fmts)
    return {**wire_w, **w2}, {**model, **m2}


def dense_report_bytes(dp: DevicePlan) -> int:
    """Value bytes of a report of every returned tensor, whole, in the plan's upload formats."""
    return sum(value_nbytes(value_format(dp.upload, len(s)), s) for s in dp.returned().values())


def upload_for(dp: DevicePlan, caps: dict[str, Any], upload_s: float | None) -> DevicePlan:
    """``dp`` with its sampling budget cut to what the device's link carries in ``upload_s`` seconds (capability
    ``link_kbps``), counted in the update's bytes (values, probability codes, masks); unchanged without either.
    A plan that did not sample yet samples by norm. A device that does not declare ``sampled_upload`` is asked
    for every row."""
    if caps.get("sampled_upload") is not True:  # a device without the extension sends every row
        if "sample" not in dp.upload:
            return dp
        return replace(dp, upload={k: v for k, v in dp.upload.items() if k not in ("sample", "keep", "p_min")})
    kbps = caps.get("link_kbps")
    if not upload_s or not isinstance(kbps, (int, float)) or isinstance(kbps, bool) or kbps <= 0:
        return dp
    budget = kbps * 1000.0 / 8.0 * upload_s
    if budget >= dense_report_bytes(dp):
        return dp
    up = dict(dp.upload)
    # keep bounds the whole update's bytes against the dense update (edge/algorithms/driver.py: row_keep)
    keep = min(float(up.get("keep", 1.0)), max(budget / dense_report_bytes(dp), 1.0 / 255.0))
    up |= {"sample": up.get("sample", "norm"), "keep": keep, "p_min": min(float(up.get("p_min", 0.0)), keep),
           "delta": True}
    return replace(dp, upload=up)


@dataclass
class LinkOptions:
    """The link options a strategy exposes (``-S`` keys), in one place: upload formats and sampling, the
    per-device upload time that turns ``link_kbps`` into a budget, and the downlink's formats and differences."""

    upload_dtype: str = "f4"
    upload_dtype_1d: str | None = None
    upload_sample: str | None = None  # norm | uniform: Horvitz-Thompson sampled rows (edge/algorithms/driver.py)
    upload_keep: float = 1.0
    upload_p_min: float = 0.0
    upload_s: float | None = None
    down_dtype: str = "f4"
    down_dtype_1d: str = "f4"
    down_deltas: bool = False

    def upload(self) -> dict[str, Any]:
        return upload_spec(self.upload_dtype, dtype_1d=self.upload_dtype_1d, sample=self.upload_sample,
                           keep=self.upload_keep, p_min=self.upload_p_min)

    def downlink(self) -> Downlink:
        return Downlink(self.down_dtype, self.down_dtype_1d, deltas=self.down_deltas)

    @classmethod
    def of(cls, strategy: Any) -> "LinkOptions":
        return cls(**{f: getattr(strategy, f) for f in cls.__dataclass_fields__ if hasattr(strategy, f)})
