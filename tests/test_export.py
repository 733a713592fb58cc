"""Program building and caching (export/build.py, export/store.py, ``fedge export``), the zoo, the inference
export, and structured slicing (edge/subnet.py, the one implementation the coordinator and exporters share)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import export.build as build_mod
from edge import subnet
from edge.model import init_weights, input_size, lenet, mlp, param_shapes
from edge.runtime.program import program_hash, torch_program
from edge.trainers.torch_backend import TorchTrainer
from edge.trainers.torch_objectives import OBJECTIVES
from export.models import ZOO, build
from export.store import ProgramStore
from trainer_programs import ZOO as TEST_ZOO, batch, rel, trainer


# ------------------------------------------------------------------------------------------ store and build
def test_store_never_exports_a_request_twice(tmp_path, monkeypatch):
    spec = mlp([64, 32, 10])
    s1 = ProgramStore(tmp_path)
    p1, i1 = s1.get(spec, "ort")
    assert not i1.cached and i1.export_seconds > 0 and i1.size == len(p1.data)
    assert i1.hash == program_hash(p1.data) == p1.hash
    # a new store on the same directory (a restarted coordinator) must not export again
    monkeypatch.setattr(build_mod, "build_program", lambda *a, **k: pytest.fail("exported again"))
    s2 = ProgramStore(tmp_path)
    p2, i2 = s2.get(spec, "ort")
    assert i2.cached and s2.exports == 0
    assert p2.data == p1.data and i2.hash == i1.hash
    assert i2.export_seconds == pytest.approx(i1.export_seconds)
    monkeypatch.undo()
    # another shape, objective or layout is another program
    p3, i3 = s2.get(mlp([64, 31, 10]), "ort")
    p4, i4 = s2.get(spec, "ort", objective="fedprox")
    assert not i3.cached and not i4.cached and len({i1.hash, i3.hash, i4.hash}) == 3 and s2.exports == 2
    from edge.trainers.ort_backend import unpack_program
    assert unpack_program(p4.data)["objective"] == "fedprox"
    layouts = [{"slots": [[64, 32, 10]] * k, "variant": "label", "gated": False} for k in (1, 2)]
    h = [s2.get(spec, "torch", objective="mixture", layout=lay)[1].hash for lay in layouts]
    assert h[0] != h[1]


def test_store_rebuilds_when_program_file_is_missing(tmp_path):
    spec = mlp([8, 4, 3])
    s = ProgramStore(tmp_path)
    p, info = s.get(spec, "torch")
    (tmp_path / "programs" / info.hash).unlink()
    p2, info2 = s.get(spec, "torch")
    assert not info2.cached and p2.data == p.data


def test_build_program_dispatch():
    spec = mlp([64, 16, 10])
    with pytest.raises(ValueError, match="runtime"):
        build_mod.build_program(spec, "tflite")
    with pytest.raises(ValueError, match="unknown objective"):
        build_mod.build_program(spec, "ort", objective="fedmagic")
    with pytest.raises(ValueError, match="MLP"):
        build_mod.build_program(ZOO["cnn"], "ort", objective="fedsparse")
    lay = {"slots": [[64, 16, 10]] * 2, "variant": "cluster", "gated": True}
    for obj in OBJECTIVES:  # the torch program names the objective and its layout, nothing else
        layout = lay if obj == "mixture" else None
        assert build_mod.build_program(spec, "torch", objective=obj, layout=layout) == torch_program(spec, obj, layout)
    assert set(build_mod.EXPORTERS) == {"ort", "executorch"}


def test_daemon_style_build_program_uses_the_cache(tmp_path, monkeypatch):
    """coordinator.daemon builds through export.store.cached_program(spec, runtime, cache_dir, objective=...,
    layout=...): a request seen before is not exported again."""
    from coordinator.daemon import _build
    spec = mlp([64, 16, 10])
    p1 = _build(spec, "ort", "ce", None, tmp_path)
    g1 = _build(spec, "ort", "fedsparse", None, tmp_path)
    monkeypatch.setitem(build_mod.EXPORTERS, "ort", lambda *a, **k: pytest.fail("exported again"))
    assert _build(spec, "ort", "ce", None, tmp_path).data == p1.data
    assert _build(spec, "ort", "fedsparse", None, tmp_path).data == g1.data != p1.data
    with pytest.raises(BaseException, match="exported again"):  # no cache: exported now
        _build(spec, "ort", "ce", None, None)


def test_export_cli(tmp_path, capsys):
    import argparse
    from export.cli import add_parser
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    argv = ["export", "--model", '{"arch": "mlp", "sizes": [8, 4, 3]}', "--runtime", "ort",
            "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "o")]
    for state in ("exported", "cached"):
        a = ap.parse_args(argv)
        assert a.fn(a) == 0
        assert state in capsys.readouterr().out
    from edge.trainers.ort_backend import unpack_program
    body = unpack_program((tmp_path / "o" / "mlp.ort").read_bytes())
    assert body["model"]["sizes"] == [8, 4, 3] and body["format"] == "fedge-ort/2"


# ------------------------------------------------------------------------------------------ the zoo
def test_zoo():
    assert ZOO == TEST_ZOO  # the tests' copy (tests/trainer_programs.py) and the firmware suite's programs
    from firmware_tests import PROGRAMS
    assert PROGRAMS["mlp"].spec == ZOO["mlp"] and PROGRAMS["cnn"].spec == ZOO["cnn"]


def test_zoo_network_is_the_objectives_network():
    """export.models.Network (the inference export's module) computes the logits the training objective does."""
    for spec in (ZOO["mlp"], ZOO["cnn"], lenet((1, 28, 28))):
        w = init_weights(spec, 4)
        x, y = batch(spec, 3, seed=0)
        t = TorchTrainer(threads=1)
        t.load(torch_program(spec).data)
        t.set_weights(w)
        _, _, aux = t.loss_and_grads({"x": x, "y": y})
        with torch.no_grad():
            assert torch.equal(build(spec, w)(torch.from_numpy(x)), torch.from_numpy(aux["logits"]))


def test_init_weights_fan_in():
    w = init_weights(ZOO["cnn"], 0)
    assert np.abs(w["conv0.weight"]).max() <= 1 / 3 and np.abs(w["conv0.weight"]).max() > 0.3  # fan_in 9
    assert np.abs(w["conv1.weight"]).max() <= 1 / np.sqrt(54)
    assert np.abs(w["fc0.weight"]).max() <= 1 / 16


@pytest.mark.slow
def test_final_export_matches_torch(tmp_path):
    import onnxruntime as ort
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
    from export.final import export_final

    spec = ZOO["mlp"]
    w = init_weights(spec, 9)  # not the export-time default weights
    res = export_final(spec, w, tmp_path, "mlp")
    assert res["onnx"].max_abs_err < 1e-5 and res["pte"].max_abs_err < 1e-5
    x, _ = batch(spec, 5, seed=3)
    with torch.no_grad():
        want = build(spec, w)(torch.from_numpy(x)).numpy()
    got = ort.InferenceSession(str(tmp_path / "mlp.onnx")).run(["logits"], {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    data = (tmp_path / "mlp.pte").read_bytes()
    m = _load_for_executorch_from_buffer(data)
    np.testing.assert_allclose(m.forward((torch.from_numpy(x),))[0].numpy(), want, rtol=1e-5, atol=1e-6)
    assert res["pte"].min_batch == 1 and res["pte"].max_batch >= 64


# ------------------------------------------------------------------------------------------ slicing
def test_gate_groups_mlp():
    g = subnet.gate_groups(ZOO["mlp"])
    assert [(x.layer, x.size, x.consumer, x.span) for x in g] == [("fc0", 200, "fc1", 1), ("fc1", 200, "fc2", 1)]
    assert all("fc2" not in x.params[0] for x in g)  # the classifier is never gated


def test_gate_groups_cnn():
    spec = ZOO["cnn"]
    g = {x.layer: x for x in subnet.gate_groups(spec)}
    assert list(g) == ["conv0", "conv1", "fc0", "fc1"]
    assert g["conv0"].size == 6 and g["conv0"].consumer == "conv1" and g["conv0"].span == 1
    # conv1 (16 channels, 4x4 maps after the stride-2 conv) feeds fc0's 256 flattened inputs
    assert g["conv1"].size == 16 and g["conv1"].consumer == "fc0" and g["conv1"].span == 16
    assert param_shapes(spec)["fc0.weight"] == (120, 256)


def test_conv1_span_matches_flatten_order():
    """Switching conv1 channel c off must change exactly fc0's input columns [c*span, (c+1)*span)."""
    spec = ZOO["cnn"]
    span = subnet.gate_groups(spec)[1].span
    w = {k: torch.from_numpy(v) for k, v in init_weights(spec, 0).items()}
    x = torch.from_numpy(batch(spec, 4, 0)[0]).reshape(4, 1, 8, 8)

    def features(w):
        h = torch.relu(F.conv2d(x, w["conv0.weight"], w["conv0.bias"], stride=1, padding=1))
        return torch.relu(F.conv2d(h, w["conv1.weight"], w["conv1.bias"], stride=2, padding=1)).flatten(1)

    h = features(w)
    w2 = dict(w, **{"conv1.weight": w["conv1.weight"].clone(), "conv1.bias": w["conv1.bias"].clone()})
    w2["conv1.weight"][5] = 0
    w2["conv1.bias"][5] = -1.0  # relu output of channel 5 becomes exactly 0
    changed = (h != features(w2)).any(0).nonzero().flatten().tolist()
    assert h.shape[1] == param_shapes(spec)["fc0.weight"][1]
    assert changed and set(changed) <= set(range(5 * span, 6 * span))


def _random_keep(spec, seed):
    rng = np.random.default_rng(seed)
    return {g.layer: np.sort(rng.choice(g.size, size=max(1, g.size // 3), replace=False))
            for g in subnet.gate_groups(spec)}


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_slice_scatter_round_trip(model):
    spec = ZOO[model]
    sub = subnet.plan_subnet(spec, _random_keep(spec, 1))
    w = init_weights(spec, 0)
    small = subnet.slice_weights(sub, w)
    assert {k: v.shape for k, v in small.items()} == param_shapes(sub.spec) == sub.shapes()
    assert sum(v.size for v in small.values()) < sum(v.size for v in w.values()) / 2
    back = subnet.scatter(sub, small, w)
    assert all(np.array_equal(back[k], w[k]) for k in w)
    zeros = {k: np.zeros_like(v) for k, v in w.items()}
    s2 = {k: np.random.default_rng(2).normal(size=v.shape).astype(np.float32) for k, v in small.items()}
    g = subnet.scatter(sub, s2, zeros)
    assert all(np.array_equal(subnet.slice_weights(sub, g)[k], s2[k]) for k in s2)
    m = subnet.masks(sub)
    assert all(int(m[k].sum()) == s2[k].size for k in s2)
    assert all(not g[k][~m[k]].any() for k in g)  # nothing written outside the subnet
    acc = subnet.scatter(sub, s2, g, add=True)
    assert all(np.array_equal(acc[k][m[k]], 2 * g[k][m[k]]) for k in g)
    for k in w:  # scatter_add and take, the coordinator's in-place forms, agree with scatter and slicing
        t = zeros[k].copy()
        subnet.scatter_add(sub, k, t, s2[k])
        assert np.array_equal(t, g[k]) and np.array_equal(subnet.take(sub, k, g[k]), s2[k])


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_sliced_model_equals_masked_full_model(model):
    spec = ZOO[model]
    sub = subnet.plan_subnet(spec, _random_keep(spec, 3))
    w = init_weights(spec, 5)
    x, _ = batch(spec, 16, seed=0)
    with torch.no_grad():
        a = build(sub.spec, subnet.slice_weights(sub, w))(torch.from_numpy(x))
        b = build(spec, subnet.masked_weights(sub, w))(torch.from_numpy(x))
        c = build(spec, w)(torch.from_numpy(x))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (a - c).abs().max() > 1e-3  # masking matters, so the comparison above is not vacuous


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_sliced_sgd_step_scatters_to_masked_full_step(model):
    """Training the small dense model and scattering the update back equals training the masked model."""
    spec = ZOO[model]
    sub = subnet.plan_subnet(spec, _random_keep(spec, 4))
    w = subnet.masked_weights(sub, init_weights(spec, 6))
    x, y = batch(spec, 20, seed=1)
    small_t, full_t = trainer("torch", sub.spec), trainer("torch", spec)
    small_t.set_weights(subnet.slice_weights(sub, w))
    full_t.set_weights(w)
    for _ in range(3):
        assert small_t.step(x, y, 0.3) == pytest.approx(full_t.step(x, y, 0.3), rel=1e-5)
    merged = subnet.scatter(sub, small_t.get_weights(), w)
    full = full_t.get_weights()
    for k in w:
        np.testing.assert_allclose(merged[k], full[k], rtol=1e-5, atol=1e-6)


def test_plan_subnet_rejects_bad_keeps():
    spec = ZOO["cnn"]
    with pytest.raises(ValueError):
        subnet.plan_subnet(spec, {"fc0": []})
    with pytest.raises(ValueError):
        subnet.plan_subnet(spec, {"fc1": [84]})
    with pytest.raises(ValueError):
        subnet.plan_subnet(spec, {"fc2": [0]})  # the classifier is not gated
    sub = subnet.plan_subnet(spec, {"conv1": [3, 1, 3]})
    assert sub.spec["convs"][1][0] == 2 and sub.spec["sizes"][0] == 32 and sub.spec["sizes"][1:] == [120, 84, 10]


def test_coordinator_slices_with_edge_subnet():
    """The FedSparse family's index maps (coordinator/strategies/groups.py) are edge.subnet's."""
    from coordinator.strategies import groups as G
    spec = mlp([64, 30, 20, 10])
    alive = {0: np.arange(30) % 3 != 0, 1: np.arange(20) % 4 != 1}
    idx = G.index_maps(spec, alive)
    sub = subnet.plan_subnet(spec, {"fc0": np.flatnonzero(alive[0]), "fc1": np.flatnonzero(alive[1])})
    assert isinstance(idx, subnet.Subnet) and idx.spec == sub.spec == G.sliced_spec(spec, alive)
    assert all(all(np.array_equal(a, b) for a, b in zip(idx.index[k], sub.index[k])) for k in sub.index)


def test_sliced_subnet_trains_on_exported_program():
    """A physically smaller subnetwork gets its own program; training it on ORT and scattering back equals
    training the masked full model in torch."""
    spec = ZOO["cnn"]
    sub = subnet.plan_subnet(spec, _random_keep(spec, 8))
    dev = trainer("ort", sub.spec)
    w = subnet.masked_weights(sub, init_weights(spec, 2))
    dev.set_weights(subnet.slice_weights(sub, w))
    full = trainer("torch", spec)
    full.set_weights(w)
    for i in range(3):
        x, y = batch(spec, 20, seed=i)
        assert dev.step(x, y, 0.3) == pytest.approx(full.step(x, y, 0.3), rel=1e-5)
    merged, want = subnet.scatter(sub, dev.get_weights(), w), full.get_weights()
    for k in want:
        assert rel(merged[k], want[k]) <= 1e-5, k
    assert input_size(sub.spec) == input_size(spec)
