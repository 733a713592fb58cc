"""benchmarks/flops_zoo.py's output: a smoke run (two rounds, two seeds, the MLP) writes the keys that
docs/flops.md's zoo tables come from, and the paired differences are the per-seed differences of ``runs``."""
from __future__ import annotations

import json

import pytest

from benchmarks import flops_zoo


def test_flops_zoo_writes_per_seed_runs_and_paired_seed_spreads(tmp_path, monkeypatch):
    monkeypatch.setattr(flops_zoo, "ROUNDS", flops_zoo.ROUNDS)  # main() sets the module's ROUNDS: restore it
    out = tmp_path / "zoo.json"
    assert flops_zoo.main(["--models", "mlp", "--rounds", "2", "--seeds", "0", "1", "--candidates", "0.05", "0.2",
                           "--no-export", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    # the keys of before, still there
    for k in ("rho", "devices", "per_round", "rounds", "candidates", "runs"):
        assert k in res
    assert res["rounds"] == 2 and res["seeds"] == [0, 1] and res["tune"] == "per seed"
    methods = list(flops_zoo.METHODS)
    runs = [(r["model"], r["method"], r["seed"]) for r in res["runs"]]
    assert runs == [("mlp", m, s) for m in methods for s in (0, 1)]
    for r in res["runs"]:
        for k in ("val_accuracy", "accuracy", "density", "bytes", "wall_s", "hparams", "curve", "candidates"):
            assert k in r
        assert [c["lr"] for c in r["candidates"]] == [0.05, 0.2]
        best = max(r["candidates"], key=lambda c: c["val_accuracy"])  # the first on ties, as the benchmark
        assert r["hparams"]["lr"] == best["lr"] and r["val_accuracy"] == best["val_accuracy"]
        assert len(r["curve"]) == 2
    acc = {(r["method"], r["seed"]): r["accuracy"] for r in res["runs"]}
    summary = {r["method"]: r for r in res["summary"]}
    assert list(summary) == methods
    for m, row in summary.items():
        assert row["seeds"] == [0, 1] and len(row["lr"]) == 2
        for k in ("accuracy", "val_accuracy", "density", "bytes"):
            assert set(row[k]) >= {"mean", "sd", "n", "values"} and row[k]["n"] == 2
        assert row["accuracy"]["values"] == [acc[m, 0], acc[m, 1]]
        assert row["accuracy"]["mean"] == pytest.approx((acc[m, 0] + acc[m, 1]) / 2)
        for key, base in flops_zoo.BASELINES.items():
            if m == base:
                assert key not in row
                continue
            c = row[key]
            assert c["diffs"] == pytest.approx([acc[m, s] - acc[base, s] for s in (0, 1)])
            assert c["mean"] == pytest.approx(sum(c["diffs"]) / 2)
            assert c["se"] == pytest.approx(c["sd"] / 2 ** 0.5)
            assert c["beyond_2se"] == (abs(c["mean"]) > 2 * c["se"])
            assert c["beyond_t95"] == (abs(c["mean"]) > c["t95_half"])
    # the doc's table renders from the file
    md = flops_zoo.table(res)
    assert md.count("\n") == 2 + len(methods) - 1 and "| MLP | flops-pa |" in md


def test_paired_flags_against_the_seed_noise():
    c = flops_zoo.paired([0.9, 0.91, 0.92], [0.8, 0.8, 0.8], [0, 1, 2])
    assert c["mean"] == pytest.approx(0.11) and c["sd"] == pytest.approx(0.01)
    assert c["beyond_2se"] and c["beyond_t95"]
    c = flops_zoo.paired([0.9, 0.7, 0.95], [0.8, 0.8, 0.8], [0, 1, 2])  # mean 0.05, sd 0.13: within the noise
    assert not c["beyond_2se"] and not c["beyond_t95"]
    c = flops_zoo.paired([0.9], [0.8], [0])  # one seed: no noise estimate, never "beyond"
    assert c["sd"] is None and not c["beyond_2se"]
