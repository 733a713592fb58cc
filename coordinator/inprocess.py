"""An in-process federated loop for any strategy: the real server half, the real client halves, every plan
(with the program when the device lacks it) and report through the wire codec (bytes counted exactly as on
MQTT, before framing) and a private
LocalState per device; only the broker and the round machine's timing are left out, so 2 shared CPU cores
can run many seeds x rounds x devices (the FedMix benchmarks, FLoPS's per-step exchange). The MQTT path is
coordinator/simulate.py.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edge.protocol import wire
from edge.algorithms.driver import run_plan
from edge.runtime.program import torch_program
from edge.runtime.state import LocalState
from edge.trainers.torch_backend import TorchTrainer
from edge.protocol.wire import Plan
from edge.protocol.capabilities import EXTENSIONS

from .admission import AdmissionRules, admit, capped, local_steps, next_history, weight_cap
from .selection import device_seed, n_to_select, select_ordered
from .strategies.base import ReportRejected, ServerState, Strategy


@dataclass
class Loop:
    strategy: Strategy
    shards: list[tuple[np.ndarray, np.ndarray]]  # each device's training data
    seed: int = 0
    workdir: str | None = None
    state: ServerState | None = None
    trainers: dict[str, TorchTrainer] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    ids: list[str] | None = None  # device ids (default d0, d1, ...): selection and seeds depend on them
    threads: int | None = None  # torch threads (1, as simulated devices use, for bitwise comparisons)
    caps: dict[str, dict[str, Any]] = field(default_factory=dict)  # capabilities by device id (plan() sees them)
    # round_as_coordinator admits reports as the coordinator does (norm bound, clipping, refusals); None: off
    admission: AdmissionRules | None = field(default_factory=AdmissionRules)

    def __post_init__(self) -> None:
        self._tmp = None
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fedmix-loop-")
            self.workdir = self._tmp.name
        self.ids = list(self.ids) if self.ids is not None else [f"d{i}" for i in range(len(self.shards))]
        self.local = {d: LocalState(Path(self.workdir) / d) for d in self.ids}
        self.programs: dict[str, set[str]] = {d: set() for d in self.ids}  # program hashes each device holds
        self.state = self.strategy.init(self.seed)
        self.admission_history: dict[str, Any] = {}  # the round machine's (admission.next_history)

    def trainer(self, spec: dict, objective: str, layout: dict | None = None) -> TorchTrainer:
        prog = torch_program(spec, objective, layout)
        t = self.trainers.get(prog.hash)
        if t is None:
            t = self.trainers[prog.hash] = TorchTrainer(threads=self.threads)
            t.load(prog.data)
        return t

    def round_as_coordinator(self, clients_per_round: int, over_selection: float, attempt: int = 1) -> dict[str, Any]:
        """One round as the coordinator's reproducible mode runs it: the seeded draw over every device, the first
        ``clients_per_round`` of the draw committed in that order; the over-selected rest train (a stateful client
        keeps what it learnt) and are not used. Reports are admitted by the coordinator's rules (``admission``),
        so a clipped or refused report changes the run here as it does over MQTT."""
        k = n_to_select(clients_per_round, over_selection, len(self.ids))
        order = [self.ids.index(d) for d in select_ordered(self.ids, k, self.seed, self.state.round + 1, attempt)]
        if self.admission is None:
            return self.round(order[:clients_per_round], train_only=order[clients_per_round:])
        return self.round(order, commit=clients_per_round)

    def round(self, chosen: list[int], train_only: list[int] = (), commit: int | None = None) -> dict[str, Any]:
        """Devices ``chosen`` train and are aggregated in that order; ``train_only`` train and are not.

        With ``commit`` (and ``admission`` rules), every report of ``chosen`` is admitted as the coordinator
        admits it (clipped above the norm bound, refused far above it), and the first ``commit`` admitted
        ones are aggregated: a refused device's place goes to the next in order, as in reproducible mode."""
        rnd = self.state.round + 1
        observe = getattr(self.strategy, "observe_fleet", None)
        if observe is not None:  # the fleet as the coordinator's registry would hold it
            observe({d: len(self.shards[i][0]) for i, d in enumerate(self.ids)})
        acc = self.strategy.begin(self.state)
        down = up = 0
        summed: list[tuple[str, float, int]] = []  # (device, norm, steps) of the reports aggregated
        # the most samples a report weighs, from the selected devices' counts (RoundMachine's o.n_cap)
        cap = weight_cap(self.admission, [len(self.shards[i][0]) for i in chosen]) if commit is not None else None
        for i in [*chosen, *train_only]:
            d = self.ids[i]
            # its devices run this package's driver: they implement the protocol extensions (as a Device declares)
            dp = self.strategy.plan(self.state, d, {**EXTENSIONS, **self.caps.get(d, {})})
            prog = torch_program(dp.spec, dp.objective, dp.layout)
            # the program travels in the plan when the device lacks it, as the round machine sends it
            plan = Plan(f"r{rnd}", rnd, d, 1e18, self.strategy.name, "torch", prog.hash,
                        dp.weights if dp.wire is None else dp.wire, dp.hparams, device_seed(self.seed, rnd, d),
                        dp.upload, None if prog.hash in self.programs[d] else prog.data, tag=dp.tag, base=dp.base)
            payload = wire.encode(plan)
            down += len(payload)
            plan = wire.decode(payload)
            self.programs[d].add(prog.hash)
            x, y = self.shards[i]
            rep = run_plan(plan, self.trainer(dp.spec, dp.objective, dp.layout), x, y, self.local[d])
            payload = wire.encode(rep)
            if commit is not None:
                if len(summed) >= commit:
                    continue  # over-selected and not needed
                got = wire.decode(payload, finite_updates=False)
                try:
                    got, norm = admit(dp, capped(got, cap), self.admission, self.admission_history)
                except ReportRejected:
                    continue  # as the coordinator refuses it: the next device in order takes its place
                summed.append((d, norm, local_steps(dp, min(len(x), cap or len(x)))))
                up += len(payload)
                self.strategy.accumulate(self.state, acc, dp, got)
            elif i in chosen:
                up += len(payload)
                self.strategy.accumulate(self.state, acc, dp, wire.decode(payload))
        self.state = self.strategy.finish(self.state, acc)
        if commit is not None:
            self.admission_history = next_history(self.admission_history,
                                                  [n / s for _, n, s in sorted(summed)])
        row = {"round": rnd, "bytes_down": down, "bytes_up": up,
               "reports": len(chosen) if commit is None else len(summed)}
        metrics: Callable | None = getattr(self.strategy, "metrics", None)
        if metrics is not None:
            row |= metrics(self.state)
        self.history.append(row)
        return row

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
