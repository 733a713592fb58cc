"""The firmware acceptance suite (``python -m firmware_tests``): passes on every runtime here, fails on wrong
numbers in the rows they belong to, needs neither ``export`` nor ``coordinator`` (nor torch, on ORT), and its
golden vectors are what the torch reference computes now (else run ``python -m export.golden``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from edge.runtime.program import torch_program
from edge.trainers.torch_backend import TorchTrainer
from firmware_tests import GOLDEN, PROGRAMS
from firmware_tests.__main__ import _rel, aux_rel, load_golden, load_objective_golden

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OBJECTIVE_PROGRAMS = [n for n, g in PROGRAMS.items() if g.cases]
# A device has only edge, numpy and its runtime: the suite must run with these made unimportable.
DEVICE_ONLY = "import sys; sys.modules.update(dict.fromkeys(['export', 'coordinator'{torch}]))\n" \
              "from firmware_tests.__main__ import main; sys.exit(main(sys.argv[1:]))"


def _run(*args: str, torch_blocked: bool = False) -> subprocess.CompletedProcess:
    code = DEVICE_ONLY.format(torch=", 'torch'" if torch_blocked else "")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})


def _results(r: subprocess.CompletedProcess) -> dict:
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))


def test_registry_covers_every_objective():
    from edge.trainers.torch_objectives import OBJECTIVES
    assert {g.objective for g in PROGRAMS.values()} == set(OBJECTIVES)
    assert list(PROGRAMS)[:2] == ["mlp", "cnn"] and all(PROGRAMS[n].cases is None for n in ("mlp", "cnn"))
    lay = PROGRAMS["mixture_sparse"].layout
    assert lay["gated"] and lay["variant"] == "cluster" and len({tuple(s) for s in lay["slots"]}) == len(lay["slots"])
    assert PROGRAMS["mixture"].layout["variant"] == "label" and len(PROGRAMS["mixture"].layout["slots"]) == 3


def _check_results(res: dict, runtime: str) -> None:
    assert res["ok"] and [x["model"] for x in res["results"]] == list(PROGRAMS)
    for x in res["results"]:
        assert x["runtime"] == runtime and x["step_ms"] > 0 and x["peak_mb"] > 0
        assert all(x["checks"].values()) and len(x["checks"]) >= 4
        if PROGRAMS[x["model"]].cases:  # loss, every gradient, the auxiliary outputs and one numpy step
            assert max(x["grad_rel_err"], x["aux_rel_err"], x["weight_rel_err"], x["loss_rel_err"]) \
                <= PROGRAMS[x["model"]].rel_tol
        else:
            assert x["weight_rel_err"] <= 1e-5


def test_ort_passes_golden_without_torch_export_or_coordinator():
    r = _run("--runtime", "ort", "--threads", "1", "--json", "-", torch_blocked=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = _results(r)
    _check_results(res, "ort")
    assert not any(x["torch_imported"] for x in res["results"])  # a torch-free device can run it


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["executorch", "torch"])
def test_runtime_passes_golden(runtime):
    r = _run("--runtime", runtime, "--threads", "1", "--json", "-")  # one thread: no stalls on a loaded machine
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    _check_results(_results(r), runtime)


def test_firmware_package_imports_nothing_from_export_or_coordinator():
    import ast
    from pathlib import Path
    for p in Path(ROOT, "firmware_tests").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for m in mods:
                assert m.split(".")[0] not in ("export", "coordinator", "torch", "tests"), (p.name, m)


@pytest.mark.slow
def test_table_and_exit_code_on_tampered_golden(tmp_path):
    """A golden value 1e-3 off (a weight, a threshold gradient, an auxiliary output, a gradient of a slot of
    another shape, the proximal gradient) fails exactly its row; the others pass; exit code 1."""
    gold = tmp_path / "golden"
    shutil.copytree(GOLDEN, gold)
    tamper = {"mlp": "w1/fc1.weight", "gated": "c0/g/fc0.v", "mixture": "c1/aux/lg",
              "mixture_sparse": "c0/g/s2.fc0.v"}
    for name, key in tamper.items():
        with np.load(gold / f"{name}.npz") as f:
            arrays = {k: f[k] for k in f.files}
        assert key in arrays, key
        arrays[key] = arrays[key] * np.float32(1.001)
        np.savez(gold / f"{name}.npz", **arrays)
    r = _run("--runtime", "ort", "--threads", "1", "--golden", str(gold))
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["runtime", "model"]
    row = {ln.split()[1]: ln for ln in lines if ln.startswith("ort")}
    assert set(row) == set(PROGRAMS)
    for name in PROGRAMS:
        assert ("FAIL" in row[name]) == (name in tamper), row[name]
        if name not in tamper:
            assert row[name].rstrip().endswith("PASS")
    assert lines[-1] == "FAILED"
    r = _run("--runtime", "ort", "--threads", "1", "--golden", str(gold), "--only", "cnn,prox")
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "ALL PASS"


@pytest.mark.parametrize("name", OBJECTIVE_PROGRAMS)
def test_golden_points_are_where_every_term_contributes(name):
    from firmware_tests import cases
    from trainer_programs import check_point
    g = PROGRAMS[name]
    t = TorchTrainer(threads=1)
    t.load(torch_program(g.spec, g.objective, g.layout).data)
    w, points = getattr(cases, g.cases)(g.spec, g.layout, 0)
    for c in points:
        check_point(t, w, c)
    if name in ("mixture", "mixture_sparse"):  # the registry's promise: a case with a slot switched off
        assert any(not c["active"].all() for c in points)


BUG = 1e-3  # a real bug's size: one tensor off by 1e-3 of its largest entry must fail every comparison below


def _close(a, b, tol: float) -> bool:
    return bool(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max(initial=0.0) <= tol)


def _bug_is_caught(now, gold, tol: float) -> bool:
    """The same comparison fails when ``now`` is moved by BUG of its largest entry (at its largest entry)."""
    moved = np.array(now, np.float64, copy=True, ndmin=1)
    j = np.unravel_index(np.argmax(np.abs(moved)), moved.shape)
    moved[j] += BUG * np.abs(moved).max()
    return not _close(moved, np.asarray(gold).reshape(moved.shape), tol)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_golden_is_current_torch_reference(name):
    """The shipped vectors still equal what the torch reference computes now at the registered test points,
    and the shipped torch program is the registry's.

    "Equal" is within the step's own float32 error, not a fixed relative limit: a CPU with other BLAS kernels or
    another libm rounds differently (FedSparse at T = 1e-3 turns one ulp of softplus(v) into ~3e-5 of a
    gradient), so each tolerance is export.golden.tolerance: SAFETY (10) times this float32 result's largest
    deviation from the same step in float64, per tensor. Each comparison also checks that it still fails when
    the tensor is off by BUG = 1e-3 of its largest entry, the size of a real bug."""
    from export.golden import EPS32, SAFETY, float64_reference, tolerance
    g = PROGRAMS[name]
    assert (GOLDEN / f"{name}.torch.json").read_bytes() == torch_program(g.spec, g.objective, g.layout).data
    t = TorchTrainer(threads=1)
    t.load(torch_program(g.spec, g.objective, g.layout).data)
    if g.cases is None:
        gold = load_golden(GOLDEN, name)
        t.set_weights(gold["w0"])
        loss = t.step(gold["x"], gold["y"], g.lr)
        w1 = t.get_weights()
        l64, g64, _ = float64_reference(g, gold["w0"], {"x": gold["x"], "y": gold["y"]})
        tol = tolerance(loss, l64)
        assert _close(loss, gold["loss1"], tol) and _bug_is_caught(loss, gold["loss1"], tol), (loss, gold["loss1"], tol)
        for k in gold["names"]:
            w64 = gold["w0"][k].astype(np.float64) - g.lr * g64[k]
            tol = tolerance(w1[k], w64)
            assert _close(w1[k], gold["w1"][k], tol), (k, np.abs(w1[k] - gold["w1"][k]).max(), tol)
            assert _bug_is_caught(w1[k], gold["w1"][k], tol), k
        return
    from firmware_tests import cases
    gold = load_objective_golden(GOLDEN, name)
    w0, points = getattr(cases, g.cases)(g.spec, g.layout, 0)
    assert gold["objective"] == g.objective and gold["lr"] == g.lr and gold["aux"] == t.outputs[1:]
    assert list(w0) == gold["names"] and all(np.array_equal(w0[k], gold["w0"][k]) for k in w0)
    assert len(points) == len(gold["cases"])
    for j, (case, gc) in enumerate(zip(points, gold["cases"])):
        assert set(case) == set(gc["in"]) and all(np.array_equal(np.asarray(case[k]), gc["in"][k]) for k in case)
        t.set_weights(gold["w0"])
        loss, grads, aux = t.loss_and_grads(gc["in"])
        l64, g64, a64 = float64_reference(g, gold["w0"], gc["in"])
        tol = tolerance(loss, l64)
        assert _close(loss, gc["loss"], tol) and _bug_is_caught(loss, gc["loss"], tol), (j, loss, gc["loss"], tol)
        for k in gold["names"]:
            tol = tolerance(grads[k], g64[k])
            assert _close(grads[k], gc["g"][k], tol), (j, k, np.abs(grads[k] - gc["g"][k]).max(), tol)
            if np.abs(g64[k]).max() > 0:  # (a gradient that is exactly zero stays exactly zero)
                assert _bug_is_caught(grads[k], gc["g"][k], tol), (j, k)
        for k in gold["aux"]:  # per column of axis 1, as the suite compares them (aux_rel)
            tol = SAFETY * max(aux_rel(aux[k], a64[k]), EPS32)
            assert aux_rel(aux[k], gc["aux"][k]) <= tol, (j, k, aux_rel(aux[k], gc["aux"][k]), tol)
        assert gc["losses10"][-1] < gc["losses10"][0]


@pytest.mark.parametrize("name", OBJECTIVE_PROGRAMS)
def test_each_programs_runtime_tolerance_covers_its_float32_error(name):
    """A runtime's result and the golden one are two float32 runs of one step, each off from the exact step by
    its rounding, so the suite's limit (the program's ``rel_tol``, relative to each tensor's largest entry) is
    at least 4x the torch step's float32 error against float64 (the golden's error plus the runtime's, twice
    over; ExecuTorch measured 2.7x torch's at T = 1e-3), and below BUG, so a real bug still fails on a device."""
    from export.golden import float64_reference
    g = PROGRAMS[name]
    gold = load_objective_golden(GOLDEN, name)
    t = TorchTrainer(threads=1)
    t.load(torch_program(g.spec, g.objective, g.layout).data)
    lr = np.float32(g.lr)
    worst = 0.0
    for gc in gold["cases"]:
        t.set_weights(gold["w0"])
        loss, grads, aux = t.loss_and_grads(gc["in"])
        l64, g64, a64 = float64_reference(g, gold["w0"], gc["in"])
        worst = max([worst, abs(loss - l64) / abs(l64)] + [_rel(grads[k], g64[k]) for k in grads]
                    + [aux_rel(aux[k], a64[k]) for k in aux]
                    + [_rel((gold["w0"][k] - lr * grads[k]).astype(np.float32),
                            gold["w0"][k].astype(np.float64) - g.lr * g64[k]) for k in grads])
    assert 4 * worst <= g.rel_tol < BUG, f"{name}: float32 error {worst:.2g} of a tensor, rel_tol {g.rel_tol:g}"


def test_another_machines_rounding_passes_the_golden_comparison():
    """What failed on another 2-core x86_64 machine (issue 28): there ``gated``'s gradients at T = 1e-3 differed
    from the golden by 3.1e-5 relative, against a fixed 1e-5. A float32 ulp of difference in v, as another
    libm's or kernel's softplus rounds, gives that; the float32-derived tolerance accepts it (the fixed one
    failed 14 of 20 such draws) while a BUG-sized change still fails (test_golden_is_current_torch_reference)."""
    from export.golden import float64_reference, tolerance
    g = PROGRAMS["gated"]
    gold = load_objective_golden(GOLDEN, "gated")
    gc = gold["cases"][0]  # T = 1e-3
    t = TorchTrainer(threads=1)
    t.load(torch_program(g.spec, g.objective, g.layout).data)
    t.set_weights(gold["w0"])
    _, g32, _ = t.loss_and_grads(gc["in"])
    _, g64, _ = float64_reference(g, gold["w0"], gc["in"])
    rng = np.random.default_rng(1)
    fixed_failed = 0
    for _ in range(5):
        w = {k: np.where(rng.random(v.shape) < 0.5, np.nextafter(v, np.float32(np.inf)), v).astype(np.float32)
             if k.endswith(".v") else v for k, v in gold["w0"].items()}
        t.set_weights(w)
        _, other, _ = t.loss_and_grads(gc["in"])
        for k in gold["names"]:
            assert np.abs(other[k] - gc["g"][k]).max() <= tolerance(g32[k], g64[k]), k
        fixed_failed += any(not np.allclose(other[k], gc["g"][k], rtol=1e-5, atol=1e-6 * np.abs(gc["g"][k]).max())
                            for k in gold["names"])
    assert fixed_failed  # the draws are the failure: the old fixed tolerance rejects some of them
