"""SFVI under the coordinator's default admission with unequal silos (docs/sfvi.md, "Admission"): silos of 10
and 2,000 samples through the round machine and the wire codec stay on centralised VI's trajectory, within the
tolerance of tests/test_sfvi.py::test_invariance_over_the_wire. A device reports g_j / N_j, so the norm bound (a
median over the fleet) sees every silo on one scale; the summed gradient g_j of the large silo is far beyond the
bound (the test checks that it would be refused), which is what clipped or refused it before."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.admission import AdmissionRules
from coordinator.strategies.sfvi import SFVI
from edge.protocol import wire
from edge.vi import init_global

from test_sfvi import FULL, INV_SPEC, assert_centralised, f32, sfvi_bus

ROUNDS, LR = 4, 0.05


def silo(n: int, groups: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """INV_SPEC's data (Gaussian random-intercept model): group id, intercept, covariate, response."""
    g = np.arange(n) % groups
    X = np.c_[np.ones(n), rng.normal(size=n)]
    eta = X @ np.array([0.5, -1.0]) + rng.normal(size=groups)[g]
    return np.c_[g, X, eta + rng.normal(size=n)].astype(np.float32), np.zeros(n, np.int64)


@pytest.mark.parametrize("sizes", [(10, 10, 10, 10, 2000), (10, 10, 10, 10, 400)])
def test_unequal_silos_through_the_round_machine_equal_centralised_vi(tmp_path, sizes):
    """With g_j on the wire, the silo of 2,000 was refused from round 2 on (and quarantined), and the silo of
    400 clipped to 0.32-0.46 of its size every round (0.017 to 0.053 off the centralised run)."""
    rng = np.random.default_rng(0)
    shards = [silo(n, 2 if n < 100 else 3, rng) for n in sizes]
    s = SFVI(spec=INV_SPEC, layout=FULL, lr=LR)
    bus = sfvi_bus(tmp_path, s, shards, rounds=ROUNDS)
    assert bus.m.cfg.admission == AdmissionRules()  # the coordinator's default rules
    for _ in range(ROUNDS):
        bus.tick(0.1)
    assert len(bus.committed) == ROUNDS
    assert all(c["reports"] == len(sizes) and c["dropped"] == 0 for c in bus.committed)
    acks = [wire.decode(p) for t, p in bus.log if t.split("/")[3] == "ack"]
    assert acks and all(a.status == "accepted" for a in acks)

    # the parameters matter: had the devices sent g_j (N_j times their reports), the bound of the last round
    # (norm_factor x the median of the earlier rounds' norms, admission.next_history) would have clipped the
    # large silo's g_j, and refused the silo of 2,000's
    reps = [wire.decode(p) for t, p in bus.log if t.split("/")[3] == "report"]
    assert len(reps) == ROUNDS * len(sizes)

    def g_norm(r) -> float:
        return r.n_samples * float(np.sqrt(sum(np.sum(t.values.astype(np.float64) ** 2) for t in r.tensors.values())))

    rules = AdmissionRules()
    bound = rules.norm_factor * float(np.median([g_norm(r) for r in reps if r.task_id != f"r{ROUNDS}a1"]))
    big = g_norm(next(r for r in reps if r.task_id == f"r{ROUNDS}a1" and r.device_id == f"d{len(sizes) - 1}"))
    if sizes[-1] == 2000:
        assert big > rules.refuse_factor * bound, (big, bound)
    else:
        assert bound < big <= rules.refuse_factor * bound, (big, bound)

    assert_centralised(bus, s, shards, ROUNDS, LR)
    w0 = init_global(s.model, s.fam, 0)
    assert max(float(np.abs(bus.m.state.weights[k] - f32(w0[k])).max()) for k in w0) > 0.1
