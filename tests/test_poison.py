"""Poisoning from inside the rules (issue #30): reports that are well formed, within the norm bound, from devices
that declare what they like. The accuracy guard must not stall the fleet (a refused commit leaves its culprits
out and strikes them), and a declared sample count must not buy the mean."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import rounds as R
from coordinator.daemon import Evaluator, ProgramCatalog
from coordinator.datasets import digits_federated
from coordinator.rounds import RoundConfig, RoundMachine
from coordinator.strategies.fedavg import FedAvg
from edge import model as M
from edge.protocol import agent as A
from edge.protocol import wire
from edge.protocol.wire import Report, TensorUpdate

from conftest import Bus

CAPS = {"runtime": "torch", "charging": True, "network": "wifi", "idle": True, "memory_mb": 1024}


class PoisonBus(Bus):
    """The Bus, with ``poisoners`` that from round ``start`` send their honest update sign-flipped and scaled to
    ``frac`` of the norm bound the coordinator will apply to them (what an attacker who reads the fleet's norms
    can reach), claiming ``lie`` samples in the report (and at check-in, see make_poison_bus) if set."""

    poisoners: set[str] = set()
    start: int = 1
    frac: float = 0.95
    lie: int | None = None

    def tick(self, dt=0.0):
        if self.lie and self.m.open is None and self.m.state.round + 1 >= self.start:
            for d in self.poisoners:  # from now on it declares the lie (as its next check-in would)
                self.agents[d].n_samples = self.m.registry.devices[d].n_samples = self.lie
        super().tick(dt)

    def _device_actions(self, dev, actions):
        if dev in self.poisoners:
            actions = [self._poison(dev, a) if isinstance(a, A.Publish) and "/report/" in a.topic else a
                       for a in actions]
        super()._device_actions(dev, actions)

    def _poison(self, dev, a):
        r = wire.decode(a.payload)
        m, o = self.m, self.m.open
        if o is None or r.task_id != o.task_id:
            return a
        if o.round < self.start:
            return a
        plan = o.plans[dev]
        if self.frac is None:  # its honest update, with the count it declared
            return A.Publish(a.topic, wire.encode(Report(r.task_id, r.device_id, self.lie, r.metrics, r.tensors)))
        d = {k: t.values.astype(np.float64) - plan.weights[k] for k, t in r.tensors.items()}
        norm = float(np.sqrt(sum(float((v * v).sum()) for v in d.values())))
        n = self.lie or r.n_samples
        bound = m.cfg.admission.bound(m.history, plan, min(n, o.n_cap or n))
        scale = self.frac * bound / norm
        tens = {k: TensorUpdate(t.shape, (plan.weights[k] - scale * d[k]).astype(np.float32))
                for k, t in r.tensors.items()}
        return A.Publish(a.topic, wire.encode(Report(r.task_id, r.device_id, n, r.metrics, tens)))


def make_poison_bus(tmp_path, *, poisoners=(), start=1, frac=0.95, lie=None, rounds=12, devices=10, seed=0,
                    admission=None, strategy=None) -> PoisonBus:
    data = digits_federated(devices, 0.5, seed)
    strategy = strategy or FedAvg(spec=M.mlp([64, 32, 10]), lr=0.1, epochs=3, batch_size=20)
    cfg = RoundConfig(rounds=rounds, clients_per_round=devices, over_selection=1.0, round_timeout_s=30.0,
                      selection_timeout_s=5.0, seed=seed, **({"admission": admission} if admission else {}))
    m = RoundMachine(cfg, strategy, strategy.init(seed), ProgramCatalog(), now=1000.0)
    ev = Evaluator(data.x_test, data.y_test)

    def vet(st):
        loss, acc = ev(*strategy.global_model(st))
        return {"accuracy": acc, "loss": loss}

    m.vet = vet
    ids = [f"d{i}" for i in range(devices)]
    shards = {d: data.shards[i] for i, d in enumerate(ids)}
    agents = {d: A.DeviceAgent(A.AgentConfig(d, capabilities=dict(CAPS)),
                               n_samples=len(shards[d][0])) for d in ids}
    bus = PoisonBus(m, agents, shards, tmp_path)
    bus.poisoners, bus.start, bus.frac, bus.lie = set(poisoners), start, frac, lie
    return bus


def run(bus: PoisonBus, max_ticks: int = 400) -> None:
    bus.connect_all()
    for _ in range(max_ticks):
        if bus.m.finished:
            break
        bus.tick(1.0)


def abandoned(bus) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in bus.persisted:
        if p.what == "abandon":
            out[p.data["round"]] = out.get(p.data["round"], 0) + 1
    return out


def test_a_poisoner_that_stalled_the_fleet_is_left_out_struck_and_quarantined(tmp_path):
    """Honest until round 5, then 10^6 samples claimed and sign-flipped updates just inside the norm bound: the
    commit the guard refuses is made without it (every round commits, at most 2 abandoned attempts each), the
    round table says so, and the strikes quarantine it."""
    bus = make_poison_bus(tmp_path, poisoners={"d3"}, start=5, lie=10**6, frac=0.95, rounds=10,
                          admission=R.AdmissionRules(max_weight_factor=None))  # the guard alone, no weight cap
    run(bus)
    assert bus.m.state.round == 10
    assert all(v <= 2 for v in abandoned(bus).values()), abandoned(bus)
    left_out = [s for s in bus.committed if s.get("excluded")]
    assert left_out and all(s["excluded"] == ["d3"] and "d3" not in s["accepted"] for s in left_out)
    strikes = [p.data for p in bus.persisted if p.what == "rejection" and p.data["device_id"] == "d3"]
    assert strikes and all(s["strike"] for s in strikes) and "left out of the commit" in strikes[0]["reason"]
    assert bus.m.registry.devices["d3"].quarantines >= 1
    assert bus.committed[-1]["accuracy"] > 0.8


def test_with_the_guard_unable_to_leave_reports_out_the_same_poisoner_stalls(tmp_path):
    """The control: without the kept contributions (guard_memory_mb = 0) the refused commit is abandoned and the
    round retried with the same devices, as before."""
    bus = make_poison_bus(tmp_path, poisoners={"d3"}, start=5, lie=10**6, frac=0.95, rounds=10,
                          admission=R.AdmissionRules(max_weight_factor=None, guard_memory_mb=0))
    run(bus, max_ticks=30)
    assert bus.m.state.round < 10 and max(abandoned(bus).values()) > 2


def test_three_poisoners_are_left_out_of_a_refused_commit(tmp_path):
    bus = make_poison_bus(tmp_path, poisoners={"d1", "d4", "d7"}, start=5, frac=0.95, rounds=8)
    run(bus)
    assert bus.m.state.round == 8
    assert all(v <= 2 for v in abandoned(bus).values()), abandoned(bus)
    excluded = {d for s in bus.committed for d in s.get("excluded", [])}
    assert excluded and excluded <= {"d1", "d4", "d7"}


def test_a_declared_sample_count_cannot_buy_the_mean(tmp_path):
    """One device of ten declares 10^6 samples (its update otherwise honest, from its label-skewed shard): without
    the cap the mean is its model; with it, it weighs max_weight_factor x the median count and the run ends as a
    clean one does."""
    from coordinator.admission import AdmissionRules, weight_cap
    assert weight_cap(AdmissionRules(), [100, 120, 90, 10**6]) == 2 * 110
    assert weight_cap(AdmissionRules(max_weight_factor=None), [100, 10**6]) is None
    final = {}
    for name, poisoners, rules in [("clean", (), None), ("capped", {"d2"}, None),
                                   ("uncapped", {"d2"}, AdmissionRules(max_weight_factor=None))]:
        bus = make_poison_bus(tmp_path / name, poisoners=poisoners, start=1, lie=10**6, frac=None, rounds=6,
                              admission=rules)
        run(bus)
        assert bus.m.state.round == 6
        final[name] = bus.committed[-1]["accuracy"]
    assert final["uncapped"] < final["clean"] - 0.1, final  # the liar owns the mean
    assert final["capped"] > final["clean"] - 0.03, final


def test_the_cap_changes_nothing_for_counts_under_it(tmp_path):
    from coordinator.admission import capped
    r = Report("t", "d0", 50, {}, {})
    assert capped(r, 100) is r and capped(r, None) is r and capped(r, 20).n_samples == 20
