"""A mixed fleet over a private Mosquitto: FedAvg with torch, ORT and ExecuTorch devices (round-robin) ends
where an all-torch fleet with the same seed ends. Every device runs every round (no over-selection), so
the two runs differ only in the runtimes that computed the local SGD steps."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from coordinator.broker import Mosquitto, mosquitto_binary
from coordinator.simulate import SimConfig, simulate

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow,  # exports ExecuTorch programs; two fleets: minutes
              pytest.mark.skipif(mosquitto_binary() is None and not os.environ.get("CI"),
                                 reason="mosquitto not installed")]


def test_mixed_runtime_fleet_matches_all_torch(tmp_path, monkeypatch):
    # Exported programs are kept between test runs (the ExecuTorch export is the slow part).
    cache = ROOT / "runs" / "programs"
    monkeypatch.setenv("FEDGE_PROGRAM_CACHE", str(cache))
    base = dict(devices=6, clients_per_round=6, over_selection=1.0, rounds=4, epochs=2, lr=0.1, hidden=(32,),
                seed=3, processes=2, round_timeout_s=600)  # an ExecuTorch device loads its program in its first round
    reps = {}
    with Mosquitto() as broker:
        for name, runtimes in [("torch", ("torch",)), ("mixed", ("torch", "ort", "executorch"))]:
            cfg = SimConfig(**base, runtimes=runtimes, broker=broker.url, workdir=str(tmp_path / name))
            reps[name] = simulate(cfg, progress=False)
    torch_rows, mixed_rows = reps["torch"]["rounds"], reps["mixed"]["rounds"]
    assert [r["reports"] for r in mixed_rows] == [6] * 4
    # the coordinator really exported an ORT and an ExecuTorch program for this shape
    keys = [json.loads(p.read_text()) for p in (cache / "keys").glob("*.json")]
    exported = {k["runtime"] for k in keys if k["spec"].get("sizes") == [64, 32, 10] and k.get("objective", "ce") == "ce"}
    assert {"ort", "executorch"} <= exported
    acc_t, acc_m = torch_rows[-1]["accuracy"], mixed_rows[-1]["accuracy"]
    assert acc_t > 0.5  # it learned something (10 classes)
    assert abs(acc_m - acc_t) <= 0.005, (acc_m, acc_t)
    # and not just the accuracy: the global weights agree to float32 rounding of a few SGD steps
    wt, wm = reps["torch"]["_state"].weights, reps["mixed"]["_state"].weights
    diff = max(float(np.abs(wt[k] - wm[k]).max()) for k in wt)
    assert diff <= 1e-4, diff
