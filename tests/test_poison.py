"""Poisoning from inside the rules (issue #30): reports that are well formed, within the norm bound, from devices
that declare what they like. The accuracy guard must not stall the fleet (a refused commit leaves its culprits
out and strikes them), and a declared sample count must not buy the mean."""
from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.attack_families.poison import flipped_report
from coordinator.admission import update_norm

from coordinator import rounds as R
from coordinator.daemon import Evaluator, ProgramCatalog
from coordinator.datasets import digits_federated
from coordinator.rounds import RoundConfig, RoundMachine
from coordinator.strategies import make_strategy
from coordinator.strategies.fedavg import FedAvg
from edge import model as M
from edge.protocol import agent as A
from edge.protocol import wire
from edge.protocol.wire import Report

from conftest import Bus, make_trainer

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
        if dev not in self.poisoners:
            return super()._device_actions(dev, actions)
        for a in actions:  # in order: a plan's program is stored before it trains
            if isinstance(a, A.StartTraining) and a.plan.round >= self.start and self.frac is not None:
                self._device_actions(dev, self.agents[dev].training_done(self._poisoned(dev, a.plan), self.now))
            else:
                super()._device_actions(dev, [self._lying(a) if isinstance(a, A.Publish) and "/report/" in a.topic
                                              else a])

    def _lying(self, a):
        """Its honest update, with the count it declared (frac None)."""
        r = wire.decode(a.payload)
        o = self.m.open
        if not self.lie or o is None or r.task_id != o.task_id or o.round < self.start:
            return a
        return A.Publish(a.topic, wire.encode(Report(r.task_id, r.device_id, self.lie, r.metrics, r.tensors,
                                                     r.extras)))

    def _poisoned(self, dev, plan):
        """Its honest training, sent sign-flipped (frac < 0: boosted) at frac of the bound admission applies."""
        m, o = self.m, self.m.open
        t = self.trainers.get((dev, plan.program_hash))
        if t is None:
            t = self.trainers[(dev, plan.program_hash)] = make_trainer("torch")
            t.load(self.caches[dev].get(plan.program_hash))
        n = self.lie

        def scale(honest):
            dp = o.plans[dev]
            norm = update_norm(dp, wire.decode(wire.encode(honest)))
            bound = m.cfg.admission.bound(m.history, dp, min(n or honest.n_samples, o.n_cap or math.inf))
            return self.frac * bound / norm

        return flipped_report(plan, t, *self.data[dev], self.local[dev], scale, n)


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


# ---------------------------------------------------------------- poisoning from round 1 (the defaults that hold)

def test_clearly_better_reads_a_step_as_progress():
    """R.clearly_better, branch by branch, against the rule written out: a is clearly better than b (both one step
    from a state of test loss `before`) with SCREEN_MARGIN more accuracy; or with a loss that fell where b's rose
    (or is not finite); or, no less accurate than b by more than the margin, with a loss that fell and b's that
    fell at most (1 - share) as far; these two only when a's loss falls SCREEN_MIN_GAIN of the first loss further
    than b's."""
    m = R.SCREEN_MARGIN
    assert R.clearly_better({"accuracy": 0.30 + m, "loss": 9.0}, {"accuracy": 0.30, "loss": 1.0}, 2.0)
    assert not R.clearly_better({"accuracy": 0.30 + m / 2, "loss": 2.0}, {"accuracy": 0.30, "loss": 2.0}, 2.0)
    # the loss: before 2.3; a fell 0.08, b 0.01 (<= half of a's): better; b 0.05: not
    assert R.clearly_better({"accuracy": 0.15, "loss": 2.22}, {"accuracy": 0.19, "loss": 2.29}, 2.30)
    assert not R.clearly_better({"accuracy": 0.15, "loss": 2.22}, {"accuracy": 0.19, "loss": 2.25}, 2.30)
    assert R.clearly_better({"accuracy": 0.15, "loss": 2.22}, {"accuracy": 0.19, "loss": 2.25}, 2.30, share=0.0)
    # ... b a step back: better; a no step forward: never
    assert R.clearly_better({"accuracy": 0.2, "loss": 2.27}, {"accuracy": 0.2, "loss": 2.5}, 2.30)
    # ... the two steps less than SCREEN_MIN_GAIN of the first loss (`first`, else `before`) apart: the loss says
    # nothing, as at `make demo`'s round 30 (from 0.2356: 0.2294 without an honest outlier, 0.2340 with it; first 2.30)
    g = R.SCREEN_MIN_GAIN
    assert not R.clearly_better({"accuracy": 0.2, "loss": 2.30 * (1 - 0.9 * g)}, {"accuracy": 0.2, "loss": 2.30}, 2.30)
    assert R.clearly_better({"accuracy": 0.2, "loss": 2.30 * (1 - 1.1 * g)}, {"accuracy": 0.2, "loss": 2.30}, 2.30)
    # ... a small step down where b's goes up by more: apart by more than the share, whatever a's own size (FedSparse's
    # round 1 over Mosquitto: its honest step is under 1% of the first loss, three flippers' a rise)
    assert R.clearly_better({"accuracy": 0.2, "loss": 2.30 * (1 - 0.2 * g)}, {"accuracy": 0.2, "loss": 2.34}, 2.30)
    assert not R.clearly_better({"accuracy": 0.2, "loss": 2.30 * (1 - 0.2 * g)}, {"accuracy": 0.2, "loss": 2.30 * (1 + 0.7 * g)}, 2.30)
    demo = ({"accuracy": 0.9443, "loss": 0.2294}, {"accuracy": 0.9415, "loss": 0.2340}, 0.2356)
    assert R.clearly_better(*demo) and not R.clearly_better(*demo, first=2.30)
    assert R.clearly_better({"accuracy": 0.9, "loss": 0.2}, {"accuracy": 0.9, "loss": 0.26}, 0.25, first=2.30)
    assert not R.clearly_better({"accuracy": 0.2, "loss": 2.31}, {"accuracy": 0.2, "loss": 2.5}, 2.30)
    # less accurate by more than the margin: the loss's progress does not count, unless b's step went back
    assert not R.clearly_better({"accuracy": 0.14, "loss": 1.0}, {"accuracy": 0.14 + 1.01 * m, "loss": 2.29}, 2.30)
    assert R.clearly_better({"accuracy": 0.09, "loss": 2.20}, {"accuracy": 0.18, "loss": 2.49}, 2.31)
    # b's loss not finite: a finite one is better; a's not finite: never; no loss to start from: accuracy only
    assert R.clearly_better({"accuracy": 0.1, "loss": 2.3}, {"accuracy": 0.1, "loss": math.inf}, None)
    assert not R.clearly_better({"accuracy": 0.1, "loss": math.nan}, {"accuracy": 0.1, "loss": 2.0}, 2.3)
    assert not R.clearly_better({"accuracy": 0.1, "loss": 1.0}, {"accuracy": 0.1, "loss": 2.0}, None)
    assert not R.clearly_better({"loss": 1.0}, {"accuracy": 0.1, "loss": 2.0}, 2.3)


def _reports(bus, task_id):
    """The reports of a task as the coordinator received them (first delivery of each device)."""
    out = {}
    for topic, payload in bus.log:
        if "/report/" in topic:
            r = wire.decode(payload)
            if r.task_id == task_id:
                out.setdefault(r.device_id, r)
    return out


def test_round_one_bounds_each_report_by_the_rounds_own_median(tmp_path):
    """Round 1 has no committed round behind it: admission's bound is 10x the model's norm, which a device's report
    reaches easily. At the commit, every report is bounded by norm_factor x the round's median norm per local step,
    as later rounds are by the last rounds': the state is the weighted mean with the far report clipped there,
    computed here from the reports as they arrived."""
    rules = R.AdmissionRules(screen_factor=None)  # the bound alone
    bus = make_poison_bus(tmp_path, poisoners={"d2"}, start=1, frac=0.5, rounds=1, admission=rules,
                          strategy=FedAvg(spec=M.mlp([64, 32, 10]), lr=0.1, epochs=2, batch_size=16))
    w0 = {k: v.astype(np.float64) for k, v in bus.m.state.weights.items()}
    run(bus)
    (summary,) = bus.committed
    reps = _reports(bus, summary["task_id"])
    assert set(reps) == set(summary["accepted"]) and "d2" in reps
    cap = math.ceil(2 * np.median([r.n_samples for r in reps.values()]))  # 2 x the median declared count
    n = {d: min(r.n_samples, cap) for d, r in reps.items()}  # what a report weighs, and the steps it counts for
    steps = {d: 2 * -(-n[d] // 16) for d in reps}
    delta = {d: {k: t.values.astype(np.float64) - w0[k] for k, t in r.tensors.items()} for d, r in reps.items()}
    norm = {d: math.sqrt(sum(float((v * v).sum()) for v in dd.values())) for d, dd in delta.items()}
    bound = {d: 10.0 * float(np.median([norm[e] / steps[e] for e in reps])) * steps[d] for d in reps}
    assert bound["d2"] < norm["d2"] < 10 * bound["d2"]  # clipped, neither refused nor left alone
    assert all(norm[d] <= bound[d] for d in reps if d != "d2")
    assert any(r.n_samples > cap for r in reps.values())  # the cap's steps are the ones that count
    want = {k: w0[k] + sum(n[d] * min(1.0, bound[d] / norm[d]) * delta[d][k] for d in reps) / sum(n.values())
            for k in w0}
    for k, v in want.items():
        np.testing.assert_allclose(bus.m.state.weights[k], v, rtol=1e-5, atol=1e-6)


POISON_STRATEGIES = {
    "fedavg": lambda: make_strategy("fedavg", spec=M.mlp([64, 64, 10]), lr=0.1),
    "fedadam": lambda: make_strategy("fedadam", spec=M.mlp([64, 64, 10]), lr=0.1),
    "fedprox": lambda: make_strategy("fedprox", spec=M.mlp([64, 64, 10]), lr=0.1),
    "fedsparse-sampled": lambda: make_strategy("fedsparse", spec=M.mlp([64, 64, 10]), preset="max"),
}


def _poison_run(tmp_path, strategy, poisoners=(), absent=(), frac=0.95, rounds=12, admission=None):
    bus = make_poison_bus(tmp_path, poisoners=poisoners, start=1, frac=frac, rounds=rounds,
                          strategy=POISON_STRATEGIES[strategy](), admission=admission)
    bus.m.cfg.min_reports = 6  # a fleet of ten that quarantined three can still commit
    bus.dead = set(absent)
    run(bus, max_ticks=1500)
    assert bus.m.state.round == rounds
    assert all(v <= 2 for v in abandoned(bus).values()), abandoned(bus)
    return bus


@pytest.mark.parametrize("strategy", sorted(POISON_STRATEGIES))
def test_three_sign_flippers_from_round_one_are_left_out(tmp_path, strategy):
    """3 of 10 devices send their update sign-flipped at 0.95 of the bound admission applies, from round 1, at the
    default rules: every round commits, only they are left out (in round 1 too, where the guard has no accuracy
    to keep), and the run ends as the same fleet without them does (the most any defence that throws their
    reports away can reach). The honest fleet without them is never screened."""
    bad = {"d1", "d4", "d7"}
    bus = _poison_run(tmp_path / "p", strategy, poisoners=bad)
    left = {s["round"]: set(s.get("excluded", [])) for s in bus.committed}
    assert left[1] == bad, left
    assert set().union(*left.values()) == bad
    assert all(not (bad & set(s["accepted"])) for s in bus.committed)
    ref = _poison_run(tmp_path / "a", strategy, absent=bad)
    assert not any(s.get("excluded") for s in ref.committed)
    assert bus.committed[-1]["accuracy"] >= ref.committed[-1]["accuracy"] - 0.02


def test_without_the_screen_round_one_flippers_take_the_fleet(tmp_path):
    """The control: the same attack with screen_factor = none (the round-1 bound still on) ends near chance."""
    bus = _poison_run(tmp_path, "fedavg", poisoners={"d1", "d4", "d7"}, admission=R.AdmissionRules(screen_factor=None))
    assert bus.committed[-1]["accuracy"] < 0.5


SIDE_BY_SIDE_CASES = {
    # round 1: three flippers are the screen's suspects, asked about beside the commit's own state
    "screen": dict(poisoners={"d1", "d4", "d7"}, start=1, rounds=3, strategy=POISON_STRATEGIES["fedavg"]),
    # from round 5 a liar the guard refuses: the culprit search asks for its leave-one-out states two at a time
    "refused": dict(poisoners={"d3"}, start=5, lie=10**6, rounds=6,
                    admission=R.AdmissionRules(max_weight_factor=None)),
}


@pytest.mark.parametrize("case", sorted(SIDE_BY_SIDE_CASES))
def test_candidates_evaluated_side_by_side_decide_as_one_at_a_time(tmp_path, case):
    """The commit's candidate and the screen's state without its suspects are evaluated in one ``vet_all`` call
    (the daemon runs them side by side: coordinator/daemon.py Evaluator.many), and so are a refused commit's
    leave-one-out states, two at a time; the run decides exactly as with the evaluations one at a time: the same
    reports left out, the same metrics, the same weights."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the devices' training too: both runs on one thread, so they can agree to the bit
    try:
        (seq, _), (par, calls) = (_run_vetting(tmp_path / str(both), both, **SIDE_BY_SIDE_CASES[case])
                                  for both in (False, True))
    finally:
        torch.set_num_threads(threads)
    assert 2 in calls, calls
    key = ("round", "accepted", "excluded", "accuracy", "loss")
    assert [{k: s.get(k) for k in key} for s in par.committed] == [{k: s.get(k) for k in key} for s in seq.committed]
    left = [set(s["excluded"]) for s in par.committed if s.get("excluded")]
    assert left and left[0] == SIDE_BY_SIDE_CASES[case]["poisoners"], left
    for k, v in seq.m.state.weights.items():
        np.testing.assert_array_equal(par.m.state.weights[k], v)


def _run_vetting(tmp_path, side_by_side: bool, *, strategy=None, **kw):
    """A poison run, its candidates evaluated one at a time (``vet``) or side by side (``vet_all``: the sizes of
    the batches asked for are returned)."""
    bus = make_poison_bus(tmp_path, strategy=strategy() if strategy else None, **kw)
    bus.m.cfg.min_reports = 6
    calls: list[int] = []
    ev = None
    if side_by_side:
        data = digits_federated(10, 0.5, 0)  # make_poison_bus's test split
        ev = Evaluator(data.x_test, data.y_test, workers=2)
        st = bus.m.strategy

        def vet_all(states):
            calls.append(len(states))
            return [{"accuracy": a, "loss": lo} for lo, a in ev.many([st.global_model(s) for s in states])]

        bus.m.vet_all = vet_all
    try:
        run(bus, max_ticks=600)
    finally:
        if ev is not None:
            ev.close()
    assert bus.m.state.round == kw["rounds"]
    return bus, calls


def test_evaluator_many_equals_one_at_a_time():
    """Evaluator.many on two threads gives each model exactly the (loss, accuracy) it gets alone."""
    data = digits_federated(4, 0.5, 0)
    strategy = POISON_STRATEGIES["fedavg"]()
    models = [strategy.global_model(strategy.init(seed)) for seed in (0, 1, 2)]
    one = Evaluator(data.x_test, data.y_test, workers=1)
    two = Evaluator(data.x_test, data.y_test, workers=2)
    try:
        alone = [one(*m) for m in models]
        assert two.many(models) == alone
        assert len({a for _, a in alone}) > 1  # different models, different answers: the order is checked
    finally:
        two.close()


def test_evaluator_shards_give_the_whole_splits_loss_and_accuracy():
    """The evaluator's shards, one after another or side by side, give the mean cross-entropy and the accuracy
    of the whole test split: checked against a float64 forward written here, on an odd split (uneven shards),
    with weights scaled so that the loss is far from chance and the predictions are not all one class."""
    data = digits_federated(4, 0.5, 0)
    x, y = data.x_test[:359], data.y_test[:359]  # 359 rows: shards of 179 and 180
    spec = M.mlp([64, 32, 10])
    w = M.init_weights(spec, 5)
    h = np.maximum(x.astype(np.float64) @ w["fc0.weight"].T.astype(np.float64) + w["fc0.bias"], 0.0)
    means = np.stack([h[y == c].mean(0) for c in range(10)])  # a nearest-mean classifier on the hidden layer
    w["fc1.weight"] = (20.0 * means).astype(np.float32)
    w["fc1.bias"] = (-10.0 * (means ** 2).sum(1)).astype(np.float32)
    logits = h @ w["fc1.weight"].T.astype(np.float64) + w["fc1.bias"]
    z = logits - logits.max(1, keepdims=True)
    ce = -(z[np.arange(len(y)), y] - np.log(np.exp(z).sum(1)))
    ref_loss, ref_acc = ce.mean(), (logits.argmax(1) == y).mean()
    assert 0.3 < ref_acc < 0.9 and abs(ref_loss - np.log(10)) > 0.3  # every term moves the answer
    one = Evaluator(x, y, workers=1)
    two = Evaluator(x, y, workers=2)
    try:
        assert one.shards == [(0, 179), (179, 359)]
        loss, acc = one(spec, w)
        assert acc == ref_acc
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss  # float32 logits of 64 inputs: ~1e-7 relative each
        assert two.many([(spec, w)]) == [(loss, acc)]  # side by side: the same numbers to the bit
        assert one.many([(spec, w)]) == [(loss, acc)]
    finally:
        two.close()
