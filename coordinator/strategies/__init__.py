"""Server halves of the algorithms, one module each (FedJAX's fed_avg.py is the model)."""
from __future__ import annotations

from .base import DevicePlan, ReportRejected, ServerState, Strategy


def make_strategy(name: str, **kw) -> Strategy:
    if name == "fedavg":
        from .fedavg import FedAvg
        return FedAvg(**kw)
    if name == "fedsparse":
        from .fedsparse import FedSparse
        return FedSparse(**kw)
    raise ValueError(f"unknown strategy {name!r}")


__all__ = ["DevicePlan", "ReportRejected", "ServerState", "Strategy", "make_strategy"]
