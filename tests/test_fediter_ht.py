"""FedIter-HT's per-tensor hard thresholding (docs/flops.md, "The baselines"): the counts and the operator
against independent references written here (exact rationals for the largest-remainder shares, a sort by
(-|theta|, index) per tensor, with ties), and a network whose layers have very different magnitudes keeping
weights in every layer and training through the strategy's client and server halves."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from coordinator.daemon import Evaluator
from coordinator.datasets import digits_federated
from coordinator.inprocess import Loop
from coordinator.strategies.base import ReportRejected, ServerState
from coordinator.strategies.fediter_ht import FedIterHT
from edge import flops as F
from edge.algorithms import fediter_ht as HT
from edge.model import mlp
from edge.protocol.wire import Report


def ref_counts(shapes: dict, k: int) -> list[int]:
    """Written out independently: 1-d tensors whole; each weight tensor 1 + its Hamilton share (exact
    rationals) of what is left, in proportion to size - 1, remainders to the largest fractions, earlier first."""
    names = list(shapes)
    size = {n: math.prod(shapes[n]) for n in names}
    dense = [n for n in names if len(shapes[n]) <= 1]
    w = [n for n in names if len(shapes[n]) > 1]
    left = k - sum(size[n] for n in dense) - len(w)
    total = sum(size[n] - 1 for n in w)
    quota = {n: Fraction(left * (size[n] - 1), total) for n in w}
    share = {n: int(quota[n]) for n in w}
    for n in sorted(w, key=lambda n: (-(quota[n] - share[n]), names.index(n)))[:left - sum(share.values())]:
        share[n] += 1
    return [size[n] if n in dense else 1 + share[n] for n in names]


def ref_threshold(theta: np.ndarray, shapes: dict, counts: list[int]) -> np.ndarray:
    out, i = np.zeros_like(theta), 0
    for s, c in zip(shapes.values(), counts):
        n = math.prod(s)
        keep = sorted(range(n), key=lambda j: (-abs(float(theta[i + j])), j))[:c]
        for j in keep:
            out[i + j] = theta[i + j]
        i += n
    return out


SHAPES = {"a.weight": (3, 4), "a.bias": (3,), "b.weight": (2, 3), "b.bias": (2,), "c.weight": (5, 2)}


def test_keep_counts_match_the_hamilton_reference_and_a_hand_count():
    # k = 14 of 33: biases 5 whole, 3 weight tensors 1 each, 6 left over sizes-1 (11, 5, 9) of 25:
    # quotas 2.64, 1.2, 2.16 -> floors 2, 1, 2 (5), the last one to the largest fraction (0.64: a)
    assert HT.keep_counts(SHAPES, 14).tolist() == [4, 3, 2, 2, 3] == ref_counts(SHAPES, 14)
    assert sum(ref_counts(SHAPES, 14)) == 14
    for k in range(8, 34):  # every budget from the least that gives each weight tensor one entry to all 33
        c = HT.keep_counts(SHAPES, k)
        assert c.tolist() == ref_counts(SHAPES, k) and c.sum() == k
        assert all(1 <= x <= math.prod(s) for x, s in zip(c, SHAPES.values()))
    with pytest.raises(ValueError, match="raise rho"):
        HT.keep_counts(SHAPES, 7)
    rng = np.random.default_rng(1)
    for _ in range(30):
        shapes = {f"l{i}.weight": tuple(int(d) for d in rng.integers(1, 9, 2)) for i in range(4)}
        shapes |= {"l0.bias": (int(shapes["l0.weight"][0]),)}
        n = sum(math.prod(s) for s in shapes.values())
        k = int(rng.integers(shapes["l0.bias"][0] + 4, n + 1))
        assert HT.keep_counts(shapes, k).tolist() == ref_counts(shapes, k)


def test_per_tensor_threshold_matches_the_reference_with_ties():
    counts = HT.keep_counts(SHAPES, 14)
    # a.weight keeps 4: -0.9 and 0.9, then 2 of a four-way tie at |0.5| (the lower indices)
    theta = np.array([0.5, -0.5, 0.5, 0.2, -0.9, 0.9, 0.1, 0.0, -0.5, 0.3, 0.3, -0.3,
                      0.0, 0.0, 0.7,  # a.bias: kept whole, zeros included
                      -2.0, 2.0, 2.0, 1.0, -1.0, 0.5,  # b.weight: 2 of a three-way tie at 2
                      3.0, -3.0,
                      1e-3, -1e-3, 1e-3, 0, 0, 0, 0, 0, 0, 0], np.float32)  # c.weight, tiny: a global H_k drops it
    assert len(theta) == 33
    want = ref_threshold(theta, SHAPES, counts.tolist())
    np.testing.assert_array_equal(HT.threshold(theta, SHAPES, counts), want)
    np.testing.assert_array_equal(want[:12], np.float32([0.5, -0.5, 0, 0, -0.9, 0.9, 0, 0, 0, 0, 0, 0]))
    np.testing.assert_array_equal(want[15:21], [-2, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(want[23:26], np.float32([1e-3, -1e-3, 1e-3]))
    idx = HT.support(theta, SHAPES, counts)
    assert idx.dtype == np.int32 and (np.diff(idx) > 0).all() and HT.counts_of(idx, SHAPES).tolist() == counts.tolist()
    assert 12 in idx and 13 in idx  # a zero bias is still in the message: the counts travel as the indices
    assert not F.hard_threshold(theta, 14)[23:].any()  # the global operator keeps nothing of c.weight
    # one weight tensor and no bias (paper 002's linear models): per-tensor H_k is the global one
    lin = {"fc0.weight": (1, 33)}
    np.testing.assert_array_equal(HT.threshold(theta, lin, HT.keep_counts(lin, 7)), F.hard_threshold(theta, 7))


def test_the_server_refuses_a_report_with_the_right_k_in_the_wrong_tensors():
    s = FedIterHT(spec=mlp([4, 3, 2]), rho=0.5, loss="ce")
    st = s.init(0)
    dp = s.plan(st, "d0", {})
    idx = dp.weights["idx"]
    assert HT.counts_of(idx, s.shapes).tolist() == s.counts.tolist() and len(idx) == s.k
    ok = Report("t", "d0", 5, {}, {}, {"idx": idx, "theta": np.ones(s.k, np.float32)})
    s.accumulate(st, s.begin(st), dp, ok)
    moved = np.arange(s.k, dtype=np.int32)  # k indices, all in the first tensors
    assert HT.counts_of(moved, s.shapes).tolist() != s.counts.tolist()
    with pytest.raises(ReportRejected, match="count in each tensor"):
        bad = Report("t", "d0", 5, {}, {}, {"idx": moved, "theta": np.ones(s.k, np.float32)})
        s.accumulate(st, s.begin(st), dp, bad)


def test_layers_of_very_different_magnitudes_keep_weights_everywhere_and_train():
    """The first layer x 30, the second / 30 (the same function: ReLU is positively homogeneous): a global H_k
    keeps no weight of the output layer; per-tensor H_k keeps each tensor's count, and 15 rounds through the
    client and server halves (the wire codec, the coordinator's admission) train the digits well above chance."""
    s = FedIterHT(spec=mlp([64, 32, 10]), rho=0.2, lr=0.05, epochs=1, batch_size=20)
    data = digits_federated(10, alpha=0.5, seed=0)
    loop = Loop(s, data.shards, seed=0, threads=1)
    w = F.unflatten(s.initial(0), s.shapes)
    w["fc0.weight"] *= 30
    w["fc0.bias"] *= 30
    w["fc1.weight"] /= 30
    theta = F.flatten(w, s.shapes)
    spans = HT.spans(s.shapes)
    assert not F.hard_threshold(theta, s.k)[spans[2][0]:spans[2][1]].any()  # the global form: a dead network
    loop.state = ServerState(0, {"theta": s.threshold(theta)})
    ev = Evaluator(data.x_test, data.y_test)
    before = ev(*s.global_model(loop.state))[1]
    for _ in range(15):
        loop.round_as_coordinator(10, 1.0)
    loop.close()
    th = loop.state.weights["theta"]
    nnz = [int(np.count_nonzero(th[a:b])) for a, b in spans]
    assert nnz == s.counts.tolist() and s.counts[2] >= 1 and sum(nnz) == s.k
    acc = ev(*s.global_model(loop.state))[1]
    assert acc > 0.5 and acc > before + 0.3, (before, acc)  # chance is 0.1
