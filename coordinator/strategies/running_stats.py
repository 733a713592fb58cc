"""BatchNorm running statistics of a person's module, federated beside any strategy.

Devices train BatchNorm with batch statistics (every runtime; edge/trainers/torch_objectives/usermodel.py) and
report, as update extras named after the buffers (``<layer>.running_mean``, ``<layer>.running_var``), the
mean and population variance of each BatchNorm layer's inputs over their whole local run
(edge/trainers/module_state.py). :class:`RunningStats` wraps the strategy: it asks every plan for those
extras (at the plan's sliced shapes), pools them over the round's reports exactly as one population
(mean = sum_s N_s mean_s / N, var = sum_s N_s (var_s + mean_s^2) / N - mean^2, per channel over the devices
that have it) and keeps the result in the server state (``opt["bn/<buffer>"]``); the global model (evaluation,
inference export) carries them as its buffers. The strategy's own aggregation never sees them: no optimiser
steps a variance (an Adam step could make one negative), and the weights' aggregation stays the paper's.

Running statistics are the pooled statistics of the last committed round: they describe the inputs the
BatchNorm layers saw while the round's devices trained, the federated counterpart of torch's running average.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from edge.model import buffer_shapes, init_buffers

from . import groups as G
from .base import DevicePlan, ServerState


class RunningStats:
    """``inner`` plus the federated running statistics of the spec's BatchNorm layers."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.buffers = buffer_shapes(inner.spec)
        self.layers = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in self.buffers))
        self._plans: tuple[DevicePlan, DevicePlan] | None = None
        self._sub: tuple[ServerState, G.Subnet] | None = None

    def __getattr__(self, name: str) -> Any:  # name, spec, hparams, metrics, ...
        if name == "inner":  # not set yet: a copy (copy.deepcopy, pickle) asks before __init__ has run
            raise AttributeError(name)
        return getattr(self.inner, name)

    def can_snapshot(self) -> bool:
        """No durable sums: the inner strategy's snapshot would leave out the statistics summed here, so the
        round keeps every report's payload."""
        return False

    def subnet(self, state: ServerState) -> G.Subnet:
        """The round's slicing (from the strategy's ``alive/<layer>`` masks; everything when it prunes nothing)."""
        if self._sub is None or self._sub[0] is not state:
            alive = {L: state.opt[f"alive/{L}"].astype(bool) for L in G.layers(self.spec) if f"alive/{L}" in state.opt}
            self._sub = (state, G.index_maps(self.spec, alive))
        return self._sub[1]

    def init(self, seed: int) -> ServerState:
        st = self.inner.init(seed)
        st.opt.update({f"bn/{n}": v for n, v in init_buffers(self.spec).items()})
        return st

    def plan(self, state: ServerState, device_id: str, caps: dict[str, Any]) -> DevicePlan:
        dp = self.inner.plan(state, device_id, caps)
        if self._plans is None or self._plans[0] is not dp:  # the inner strategy's per-round plan, once
            shapes = self.subnet(state).shapes()
            self._plans = (dp, replace(dp, extras=dp.extras | {n: shapes[n] for n in self.buffers}))
        return self._plans[1]

    def begin(self, state: ServerState) -> Any:
        def zero():
            return {L: np.zeros(self.buffers[f"{L}.running_mean"]) for L in self.layers}
        return {"inner": self.inner.begin(state), "n": zero(), "s1": zero(), "s2": zero()}

    def accumulate(self, state: ServerState, acc: Any, plan: DevicePlan, report: Any) -> None:
        self.inner.accumulate(state, acc["inner"], plan, report)
        sub = self.subnet(state)
        n = float(report.n_samples)
        for L in self.layers:
            rows = sub.rows(f"{L}.running_mean")
            m = report.extras[f"{L}.running_mean"].astype(np.float64)
            v = np.maximum(report.extras[f"{L}.running_var"].astype(np.float64), 0.0)
            acc["n"][L][rows] += n
            acc["s1"][L][rows] += n * m
            acc["s2"][L][rows] += n * (v + m * m)

    def finish(self, state: ServerState, acc: Any) -> ServerState:
        new = self.inner.finish(state, acc["inner"])
        opt = dict(new.opt)
        for L in self.layers:
            n = acc["n"][L]
            seen = n > 0
            mean = np.where(seen, acc["s1"][L] / np.maximum(n, 1e-300), state.opt[f"bn/{L}.running_mean"])
            var = np.where(seen, acc["s2"][L] / np.maximum(n, 1e-300) - mean * mean, state.opt[f"bn/{L}.running_var"])
            opt[f"bn/{L}.running_mean"] = mean.astype(np.float32)
            opt[f"bn/{L}.running_var"] = np.maximum(var, 0.0).astype(np.float32)
        return ServerState(new.round, new.weights, opt, new.meta)

    def global_model(self, state: ServerState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        spec, weights = self.inner.global_model(state)
        sub = self.subnet(state)
        return spec, dict(weights) | {n: G.take(sub, n, state.opt[f"bn/{n}"]) for n in self.buffers}


def wrap(strategy: Any) -> Any:
    """The strategy, wrapped when its model has BatchNorm running statistics."""
    spec = getattr(strategy, "spec", None)
    return RunningStats(strategy) if spec is not None and buffer_shapes(spec) else strategy
