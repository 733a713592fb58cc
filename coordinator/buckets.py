"""Program buckets: the few program shapes that serve every subnetwork of a model (issue #26).

A FedSparse plan's network shrinks as units are pruned and a FedMix plan holds a subset of the experts, so
exporting each plan's exact shape would export a program per pruning step. A device that declares the
``padded_programs`` extension (docs/protocol.md 14.2) instead gets the program of the smallest *bucket* that
holds its plan and pads the plan into it (edge/trainers/padded.py). The buckets of a model are its full shape
and the same shape at 1/2 and 1/4 (rounded up) of every hidden layer's width, or of the number of FedMix slots:
at most three programs per (model, runtime, objective) in a run, however the model is pruned, and a device whose
network fits a smaller bucket computes on the smaller shape.

:func:`fedsparse` and :func:`mixture` return the :class:`Padded` a strategy attaches to its plan (DevicePlan.
``padded``): the bucket's (spec, layout), and every bucket of the family, largest first, which the round
machine asks the program catalog to build ahead of time, in the background, so that the rounds that prune into
a smaller bucket find its program built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FRACTIONS = (4, 2, 1)  # widths full/4, full/2, full: the smallest that holds a plan is its bucket


@dataclass(frozen=True)
class Padded:
    """The program a padding device runs for a plan: (``spec``, ``layout``) of its bucket, and ``family``, the
    (spec, layout) of every bucket of the model (the bucket included), largest first, to be built ahead of time
    (a bucket before the plan's in ``family`` holds the plan too: the round machine falls back on it while the
    plan's own is exporting)."""

    spec: dict[str, Any]
    layout: dict[str, Any]
    family: tuple[tuple[dict[str, Any], dict[str, Any]], ...]


def _widths(full: list[int], d: int) -> list[int]:
    return [math.ceil(h / d) for h in full]


def mlp_buckets(full: dict[str, Any]) -> list[dict[str, Any]]:
    """The bucket specs of an MLP, largest first (duplicates dropped: a layer of 2 units at 1/4 is 1)."""
    out: list[dict[str, Any]] = []
    for d in sorted(FRACTIONS):
        sizes = list(full["sizes"])
        spec = dict(full) | {"sizes": [sizes[0], *_widths(sizes[1:-1], d), sizes[-1]]}
        if spec not in out:
            out.append(spec)
    return out


def mlp_bucket(full: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any] | None:
    """The smallest bucket of ``full`` that holds ``spec`` (a subnetwork: the same MLP with narrower hidden
    layers), or None when ``spec`` is not one."""
    if full.get("arch") != "mlp" or spec.get("arch") != "mlp" or len(full["sizes"]) != len(spec["sizes"]):
        return None
    if {k: v for k, v in full.items() if k != "sizes"} != {k: v for k, v in spec.items() if k != "sizes"}:
        return None
    if full["sizes"][0] != spec["sizes"][0] or full["sizes"][-1] != spec["sizes"][-1]:
        return None
    for b in reversed(mlp_buckets(full)):  # smallest first
        if all(s <= w for s, w in zip(spec["sizes"][1:-1], b["sizes"][1:-1])):
            return b
    return None


def fedsparse(full: dict[str, Any], spec: dict[str, Any], layout: dict[str, Any]) -> Padded | None:
    """FedSparse's bucket for a plan of the pruned network ``spec`` of ``full``. None where padding is not exact:
    a module, or the per-weight L0 charge (``l0`` "weight"), which counts each unit's fan-in
    (edge/trainers/torch_objectives/fedsparse.py: padding)."""
    if layout.get("l0") == "weight":
        return None
    b = mlp_bucket(full, spec)
    if b is None:
        return None
    return Padded(b, dict(layout), tuple((s, dict(layout)) for s in mlp_buckets(full)))


def mixture(spec: dict[str, Any], layout: dict[str, Any], K: int) -> Padded | None:
    """FedMix's bucket for a plan of ``len(layout["slots"])`` of the ``K`` experts (each of model ``spec``): the
    same slots, then slots of the same shape up to ceil(K/4), ceil(K/2) or K. Only when every slot has one shape
    (plain FedMix; FedMix x FedSparse slices each expert differently) and for zoo MLPs (a module's layout counts
    ``experts``)."""
    slots = layout.get("slots")
    if not slots or layout.get("gated") or any(list(s) != list(slots[0]) for s in slots) or len(slots) > K:
        return None
    counts = sorted({math.ceil(K / d) for d in FRACTIONS})
    fam = tuple((spec, dict(layout) | {"slots": [list(slots[0])] * c}) for c in reversed(counts))
    k = next(c for c in counts if c >= len(slots))
    return Padded(spec, dict(layout) | {"slots": [list(slots[0])] * k}, fam)
