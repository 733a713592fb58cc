"""Server halves of the algorithms, one module each (FedJAX's fed_avg.py is the model)."""
from __future__ import annotations

from .base import DevicePlan, ReportRejected, ServerState, Strategy


def FedAvgAdam(**kw) -> Strategy:
    """FedAdam: FedAvg's clients with Adam on the server (paper 000's server for every method)."""
    from .fedavg import FedAvg
    kw.setdefault("server_lr", 1e-2)
    return FedAvg(server_opt="adam", **kw)


def make_strategy(name: str, **kw) -> Strategy:
    if name == "fedavg":
        from .fedavg import FedAvg
        return FedAvg(**kw)
    if name == "fedadam":
        return FedAvgAdam(**kw)
    if name == "fedl1":
        from .fedl1 import FedL1
        return FedL1(**kw)
    if name == "fedsparse":
        from .fedsparse import FedSparse
        return FedSparse(**kw)
    if name == "fedmix":
        from .fedmix import FedMix
        return FedMix(**kw)
    if name == "fedmix_sparse":
        from .fedmix_sparse import FedMixSparse
        return FedMixSparse(**kw)
    raise ValueError(f"unknown strategy {name!r}")


__all__ = ["DevicePlan", "ReportRejected", "ServerState", "Strategy", "make_strategy"]
