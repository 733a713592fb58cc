"""A person's own model and data (issue 10): three model families fedge does not ship (tests/user_models.py),
read from their graphs, run functionally, sliced, federated, exported to ONNX Runtime and ExecuTorch."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.cli import main
from coordinator.daemon import Evaluator
from coordinator.datasets import from_dir, from_file, partition
from coordinator.inprocess import Loop
from coordinator.strategies import make_strategy
from coordinator.strategies.running_stats import RunningStats
from edge import subnet
from edge.model import buffer_shapes, init_buffers, init_weights, input_size, num_classes, param_shapes
from edge.runtime.config import ConfigError
from edge.runtime.program import torch_program
from edge.trainers import make_trainer
from edge.trainers.module_state import ModuleTrainer
from edge.trainers.torch_objectives.usermodel import ModelError, describe, make_module, network

MODELS = str(Path(__file__).parent / "user_models.py")
FAMILIES = {"conv1d_net": (2, 16), "bn_cnn": (1, 8, 8), "gelu_mlp": (20,)}
TOL = 1e-4


def spec_of(name: str) -> dict:
    return describe(f"{MODELS}:{name}", FAMILIES.get(name, (1, 8, 8)))


def batch(spec: dict, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *spec["input"])).astype(np.float32)
    return x, rng.integers(0, num_classes(spec), n)


def rel(got: dict, want: dict) -> float:
    """max |got - want| over all tensors, relative to the largest |want| of them all (a gradient that is zero in
    exact arithmetic, a conv bias before BatchNorm, is compared at the scale of the others)."""
    scale = max(float(np.abs(v).max()) for v in want.values())
    return max(float(np.abs(got[k] - want[k]).max()) for k in want) / scale


# ------------------------------------------------------------------------------------------- the graph
def test_groups_are_read_from_the_graph():
    s = spec_of("bn_cnn")
    assert s["classes"] == 4 and s["input"] == [1, 8, 8] and s["classifier"] == "out" and s["dropout"] == [0.25]
    g = {x["layer"]: x for x in s["groups"]}
    assert list(g) == ["block1.0", "block2.0", "fc"]  # the classifier is never gated
    # a conv channel: its filter and bias, its BatchNorm's parameters and running statistics, the next conv's
    # input channel; the last conv's channel feeds 2 x 2 flattened columns of fc
    assert g["block1.0"]["members"] == [["block1.0.weight", 0, 1, 0], ["block1.0.bias", 0, 1, 0],
                                        ["block1.1.weight", 0, 1, 0], ["block1.1.bias", 0, 1, 0],
                                        ["block1.1.running_mean", 0, 1, 0], ["block1.1.running_var", 0, 1, 0],
                                        ["block2.0.weight", 1, 1, 0]]
    assert ["fc.weight", 1, 4, 0] in g["block2.0"]["members"] and g["block2.0"]["size"] == 8
    assert g["block1.0"]["norm"] == ["block1.0.weight", "block1.0.bias"]
    mlp = {x["layer"]: x for x in spec_of("gelu_mlp")["groups"]}
    assert set(mlp) == {"fc1", "fc2"} and not mlp["fc1"]["exact"]  # a LayerNorm renormalises the survivors
    c1 = spec_of("conv1d_net")
    assert [(x["layer"], x["size"]) for x in c1["groups"]] == [("0", 8), ("3", 12), ("7", 16)]
    assert ["7.weight", 1, 2, 0] in c1["groups"][1]["members"]  # AdaptiveAvgPool1d(2): 2 columns per channel


def test_residual_adds_tie_groups_and_group_norm_ties_channels():
    s = spec_of("residual")
    g, side = s["groups"]  # stem and a are tied by the add, and GroupNorm(4, 8) ties channel pairs: 4 groups
    assert g["layer"] == "stem" and g["size"] == 4
    assert side["layer"] == "side" and side["members"][-1] == ["fc.weight", 1, 1, 8]  # after the cat's 8 columns
    members = {(t, a): (sp, off) for t, a, sp, off in g["members"]}
    assert members[("stem.weight", 0)] == (2, 0) and members[("a.weight", 0)] == (2, 0)
    assert members[("gn.weight", 0)] == (2, 0) and members[("a.weight", 1)] == (2, 0)
    assert members[("fc.weight", 1)] == (2, 0)  # cat: the side branch's 4 columns come after
    assert set(g["norm"]) == {"stem.weight", "stem.bias", "a.weight", "a.bias"}
    sub = subnet.plan_subnet(s, {"stem": [0, 3], "side": [1, 2, 3]})
    shapes = sub.shapes()
    assert shapes["stem.weight"] == (4, 1, 3, 3) and shapes["a.weight"] == (4, 4, 3, 3)
    assert shapes["fc.weight"] == (6, 7) and shapes["gn.weight"] == (4,)
    assert sub.spec["groups"][1]["members"][-1] == ["fc.weight", 1, 1, 4]  # the cat's offset moves down
    _check_slice_exact(s, {"stem": [0, 3], "side": [1, 2, 3]})


@pytest.mark.parametrize("factory, says", [
    ("with_lstm", "LSTM 'rnn' is not supported"),
    ("grouped_conv", "Conv2d '0' has groups=2"),
    ("loose_parameter", "uses the tensor 'scale' directly"),
    ("shared_layer", "Linear 'fc' is called twice"),
    ("data_dependent", "torch.fx cannot trace the model"),
    ("not_a_module", "returned str, not a torch.nn.Module"),
    ("nowhere", "has no callable 'nowhere'"),
])
def test_unsupported_models_are_one_line_naming_the_layer(factory, says):
    with pytest.raises(ModelError) as e:
        describe(f"{MODELS}:{factory}", (4, 8, 8) if factory == "grouped_conv" else (5,) if factory != "with_lstm"
                 else (3, 4))
    assert says in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ConfigError)


def test_export_command_refuses_before_exporting(tmp_path, capsys):
    rc = main(["export", "--model", f"{MODELS}:with_lstm", "--input", "3,4", "--cache", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "LSTM 'rnn' is not supported" in err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("name", list(FAMILIES) + ["residual"])
def test_the_functional_network_is_the_module(name):
    """Eval mode (running statistics) and train mode (batch statistics, dropout as a mask of ones) against the
    module's own forward."""
    s = spec_of(name)
    m = make_module(s["factory"], seed=3)
    for b in m.modules():
        if isinstance(b, torch.nn.BatchNorm2d):
            b.running_mean.uniform_(-0.2, 0.2)
            b.running_var.uniform_(0.5, 1.5)
        if isinstance(b, torch.nn.Dropout):
            b.p = 0.0
    p = dict(m.state_dict())
    x = torch.from_numpy(batch(s, 7, 0)[0])
    net = network(s)
    with torch.no_grad():
        for mode in ("eval", "train"):
            m.train(mode == "train")
            masks = [torch.ones(7, *shape) for shape in net.dropout_shapes()]
            got = net.run(p, x.reshape(7, -1), mode=mode, masks=masks)[0]
            assert float((got - m(x)).abs().max()) < 1e-5


def _check_slice_exact(s: dict, keep: dict) -> None:
    """The sliced network computes what the full one computes with the dropped groups switched off."""
    w = init_weights(s, 1) | init_buffers(s)
    rng = np.random.default_rng(0)
    for k in w:
        if "running" in k:
            w[k] = (rng.uniform(0.5, 1.5, w[k].shape) if k.endswith("var") else rng.normal(size=w[k].shape) * 0.1
                    ).astype(np.float32)
    sub = subnet.plan_subnet(s, keep)
    x = torch.from_numpy(batch(s, 6, 2)[0].reshape(6, -1))
    t = {k: torch.from_numpy(v) for k, v in subnet.masked_weights(sub, w).items()}
    small = {k: torch.from_numpy(v) for k, v in subnet.slice_weights(sub, w).items()}
    with torch.no_grad():
        for mode in ("eval", "train"):
            full = network(s).run(t, x, mode=mode)[0]
            got = network(sub.spec).run(small, x, mode=mode)[0]
            assert float((full - got).abs().max()) < 1e-5, mode


@pytest.mark.parametrize("name", ["conv1d_net", "bn_cnn"])
def test_slicing_is_exact(name):
    s = spec_of(name)
    keep = {g["layer"]: sorted(np.random.default_rng(5).choice(g["size"], g["size"] // 2 + 1, replace=False))
            for g in s["groups"]}
    _check_slice_exact(s, keep)
    sub = subnet.plan_subnet(s, keep)
    assert sum(math.prod(v) for v in param_shapes(sub.spec).values()) < sum(math.prod(v) for v in
                                                                               param_shapes(s).values())


def test_layernorm_slicing_renormalises_over_the_survivors():
    s = spec_of("gelu_mlp")
    sub = subnet.plan_subnet(s, {"fc1": [0, 2, 5], "fc2": list(range(8))})
    assert param_shapes(sub.spec)["ln1.weight"] == (3,) and param_shapes(sub.spec)["fc2.weight"] == (8, 3)
    w = subnet.slice_weights(sub, init_weights(s, 0))
    out = network(sub.spec).run({k: torch.from_numpy(v) for k, v in w.items()},
                                torch.from_numpy(batch(s, 4, 0)[0]), mode="eval")[0]
    assert out.shape == (4, 3) and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------- BatchNorm statistics
def test_device_statistics_and_server_pooling_are_population_statistics():
    """One device step: the batch's statistics as torch's BatchNorm computes them; two devices pooled by the
    server: the statistics of all their rows together."""
    s = spec_of("bn_cnn")
    t = make_trainer("torch")
    t.load(torch_program(s).data)
    w = init_weights(s, 0)
    dev = ModuleTrainer(t, np.random.default_rng(0))
    assert [i.name for i in dev.inputs] == ["x", "y", "w"] and dev.outputs == ["loss", "logits"]
    x, y = batch(s, 10, 1)
    dev.set_weights(w)
    dev.loss_and_grads({"x": x, "y": y})
    got = dev.running_stats()
    m = make_module(s["factory"], seed=0)
    m.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=False)
    m.block1[1].momentum = 1.0  # running statistics = this batch's (unbiased variance: torch's choice)
    m.train()
    with torch.no_grad():
        m(torch.from_numpy(x))
    np.testing.assert_allclose(got["block1.1.running_mean"], m.block1[1].running_mean.numpy(), rtol=1e-5, atol=1e-6)
    n = 10 * 8 * 8
    np.testing.assert_allclose(got["block1.1.running_var"], m.block1[1].running_var.numpy() * (n - 1) / n, rtol=1e-4)

    fed = make_strategy("fedavg", spec=s, lr=0.0, batch_size=100)
    assert isinstance(fed, RunningStats) and set(fed.plan(fed.init(0), "d0", {}).extras) == set(buffer_shapes(s))
    xs = [batch(s, n, 10 + n) for n in (6, 14)]
    loop = Loop(fed, xs, seed=0, threads=1)
    loop.round([0, 1])
    _, gw = fed.global_model(loop.state)
    feats = []
    with torch.no_grad():  # lr = 0: the weights are the initial ones; the first conv's outputs over both devices
        conv = m.block1[0]
        conv.load_state_dict({"weight": torch.from_numpy(w["block1.0.weight"]), "bias": torch.from_numpy(w["block1.0.bias"])})
        for xx, _ in xs:
            feats.append(conv(torch.from_numpy(xx)).numpy())
    allf = np.concatenate(feats).transpose(1, 0, 2, 3).reshape(6, -1).astype(np.float64)
    np.testing.assert_allclose(gw["block1.1.running_mean"], allf.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw["block1.1.running_var"], allf.var(1), rtol=1e-4, atol=1e-6)


def test_dropout_masks_come_from_the_plan_seed():
    s = spec_of("bn_cnn")
    t = make_trainer("torch")
    t.load(torch_program(s).data)
    t.set_weights(init_weights(s, 0))
    x, y = batch(s, 8, 0)
    a = ModuleTrainer(t, np.random.default_rng([5, 101])).loss_and_grads({"x": x, "y": y})[0]
    b = ModuleTrainer(t, np.random.default_rng([5, 101])).loss_and_grads({"x": x, "y": y})[0]
    c = ModuleTrainer(t, np.random.default_rng([6, 101])).loss_and_grads({"x": x, "y": y})[0]
    assert a == b and a != c


# ------------------------------------------------------------------------------------------- strategies
def _shards(s: dict, n_dev: int = 6, n: int = 30, seed: int = 0):
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(num_classes(s), input_size(s))).astype(np.float32)
    out = []
    for _ in range(n_dev + 1):
        y = rng.integers(0, num_classes(s), n)
        x = protos[y] + 0.7 * rng.normal(size=(n, input_size(s))).astype(np.float32)
        out.append((x.reshape(n, *s["input"]), y))
    return out[:-1], out[-1]


@pytest.mark.parametrize("strategy, kw", [
    ("fedsparse", {"preset": "high"}),
    ("fedl1", {"l1": 0.3}),
    ("fedavg", {"prune_random": {0: 0.5, 1: 0.25}}),
])
def test_pruning_strategies_slice_a_module(strategy, kw):
    s = spec_of("bn_cnn")
    shards, (xt, yt) = _shards(s)
    fs = make_strategy(strategy, spec=s, lr=0.1, batch_size=10, **kw)
    loop = Loop(fs, shards, seed=0, threads=1)
    dens = [loop.round_as_coordinator(4, 1.0)["density"] for _ in range(4)]
    spec, w = fs.global_model(loop.state)
    assert dens[-1] < 1.0 and dens == sorted(dens, reverse=True)
    full, small = param_shapes(s), param_shapes(spec)
    assert sum(math.prod(v) for v in small.values()) < sum(math.prod(v) for v in full.values())
    assert {k: v.shape for k, v in w.items()} == param_shapes(spec) | buffer_shapes(spec)
    loss, acc = Evaluator(xt, yt)(spec, w)
    assert np.isfinite(loss) and 0 <= acc <= 1


@pytest.mark.parametrize("variant", ["label", "cluster"])
def test_fedmix_experts_are_copies_of_the_module(variant):
    s = spec_of("conv1d_net")
    shards, (xt, yt) = _shards(s, seed=1)
    fm = make_strategy("fedmix", spec=s, K=2, variant=variant, lr=0.1, batch_size=10)
    loop = Loop(fm, shards, seed=0, threads=1)
    before = {k: v.copy() for k, v in loop.state.weights.items()}
    for _ in range(2):
        loop.round_as_coordinator(4, 1.0)
    assert set(loop.state.weights) >= {f"e{k}.{n}" for k in range(2) for n in param_shapes(s)}
    assert any(not np.array_equal(before[k], v) for k, v in loop.state.weights.items())
    dp = fm.plan(loop.state, "d0", {})
    assert dp.layout == {"experts": 2, "variant": variant, "gated": False}
    spec, w = fm.global_model(loop.state)
    assert Evaluator(xt, yt)(spec, w)[1] >= 0


# ------------------------------------------------------------------------------------------- data
def test_partitions():
    y = np.repeat(np.arange(10), 30)
    rng = np.random.default_rng(0)
    iid = partition(y, 10, "iid", rng)
    assert sorted(np.concatenate(iid).tolist()) == list(range(300)) and {len(p) for p in iid} == {30}
    shards = partition(y, 10, "shards:2", rng)
    assert all(len(np.unique(y[p])) <= 2 for p in shards) and sorted(np.concatenate(shards).tolist()) == list(range(300))
    skew = partition(y, 10, "dirichlet:0.1", rng)
    assert sum(len(p) for p in skew) == 300 and np.mean([len(np.unique(y[p])) for p in skew]) < 6
    for bad in ("dirichlet:0", "shards:x", "random", "iid:3"):
        with pytest.raises(ConfigError):
            partition(y, 10, bad, rng)


def test_data_files_and_directories(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, 100)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    fd = from_file(tmp_path / "a.npz", 5, "iid", seed=0, test_frac=0.2)
    assert len(fd.x_test) == 20 and sum(len(s[1]) for s in fd.shards) == 80 and fd.shards[0][0].shape[1:] == (1, 8, 8)
    np.savez(tmp_path / "b.npz", x=x, y=y, x_test=x[:7], y_test=y[:7])
    assert len(from_file(tmp_path / "b.npz", 5, "shards:2").x_test) == 7
    d = tmp_path / "fleet"
    d.mkdir()
    for i in range(3):
        np.savez(d / f"pi-{i}.npz", x=x[i * 30:(i + 1) * 30], y=y[i * 30:(i + 1) * 30])
    np.savez(d / "test.npz", x=x[90:], y=y[90:])
    ids, fd = from_dir(d)
    assert ids == ["pi-0", "pi-1", "pi-2"] and len(fd.shards) == 3 and len(fd.x_test) == 10
    for name, arrays, says in [("c.npz", {"x": x}, "no array 'y'"), ("d.npz", {"x": x, "y": y[:5]}, "one label per"),
                               ("e.npz", {"x": x, "y": y - 1}, "labels must be 0..C-1"),
                               ("f.npz", {"x": x, "y": y + 0.5}, "integer class labels")]:
        np.savez(tmp_path / name, **arrays)
        with pytest.raises(ConfigError, match=says):
            from_file(tmp_path / name, 5, "iid")


def test_simulate_refuses_person_facing_mistakes_in_one_line(tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(60, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 9, 60))
    np.savez(tmp_path / "d4.npz", x=rng.normal(size=(60, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 4, 60))
    base = ["simulate", "--no-progress", "--workdir", str(tmp_path / "w"), "--data", str(tmp_path / "d.npz")]
    for args, says in [
        (["--model", f"{MODELS}:bn_cnn"], "its last layer has 4 outputs, the labels go up to 8"),
        (["--model", f"{MODELS}:gelu_mlp"], "does not run on examples of shape [1, 8, 8]"),
        (["--model", f"{MODELS}:not_a_module"], "returned str, not a torch.nn.Module"),
        (["--model", "nothing"], "expected mlp or cnn"),
        (["--model", f"{MODELS}:bn_cnn", "--strategy", "flops-pa", "--data", str(tmp_path / "d4.npz")],
         "flops-pa takes the zoo's MLP and CNN"),
        (["--partition", "shards:0"], "--partition = 'shards:0'"),
        (["--runtimes", "torch,tflite"], "--runtimes = 'torch,tflite'"),
        (["--data", str(tmp_path / "none.npz")], "none.npz: no such file"),
    ]:
        assert main(base + args) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (args, err)


def test_fleet_config_names_the_model_and_the_data(tmp_path):
    from coordinator.config import load_fleet
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "test.npz", x=rng.normal(size=(10, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 4, 10))
    f = tmp_path / "fleet.toml"
    f.write_text(f"[model]\nname = '{MODELS}:bn_cnn'\n[data]\ntest = '{tmp_path / 'test.npz'}'\n")
    fc = load_fleet(str(f))
    assert fc.model()["arch"] == "module" and fc.model()["input"] == [1, 8, 8] and fc.run()["model"] == fc.model()
    f.write_text(f"[model]\nname = '{MODELS}:gelu_mlp'\n[data]\ntest = '{tmp_path / 'test.npz'}'\n")
    with pytest.raises(ConfigError, match=r"\[model\] name = .*does not run on examples of shape \[1, 8, 8\]"):
        load_fleet(str(f))
    f.write_text(f"[model]\nname = '{MODELS}:bn_cnn'\n")
    with pytest.raises(ConfigError, match=r"\[model\] input"):
        load_fleet(str(f))


# ------------------------------------------------------------------------------------------- exported runtimes
RUNTIMES = ("ort", "executorch")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Programs exported once per session (FEDGE_PROGRAM_CACHE, when set, keeps them across sessions)."""
    from export.store import ProgramStore
    return ProgramStore(os.environ.get("FEDGE_PROGRAM_CACHE") or tmp_path_factory.mktemp("programs"))


def _trainer(runtime: str, data: bytes):
    t = make_trainer(runtime, threads=1)
    t.load(data)
    return t


def _feeds(t, s: dict, n: int, seed: int) -> dict:
    x, y = batch(s, n, seed)
    rng = np.random.default_rng(seed + 1)
    out = {"x": x, "y": y}
    for i, p in zip([i for i in t.inputs if i.name.startswith("drop")], s.get("dropout", [])):
        out[i.name] = ((rng.random((n, *i.shape[1:])) >= p) / (1 - p)).astype(np.float32)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_exported_step_equals_torch(name, runtime, store):
    """The module's cross-entropy program on ORT and ExecuTorch (XNNPACK): loss, every gradient, the logits and
    the BatchNorm statistics of one batch, then one SGD step, all equal torch's (rel <= 1e-4)."""
    s = spec_of(name)
    ref = _trainer("torch", torch_program(s).data)
    prog, _ = store.get(s, runtime)
    t = _trainer(runtime, prog.data)
    w = init_weights(s, 1)
    feeds = _feeds(ref, s, 20, 0)
    steps = []  # one SGD step each (through the device's wrapper when the model has BatchNorm statistics)
    for tr in (ref, t):
        tr.set_weights(w)
        m = ModuleTrainer(tr, np.random.default_rng(7)) if name == "bn_cnn" else tr
        m.step(feeds["x"], feeds["y"], 0.1)
        steps.append(tr.get_weights())
    assert rel(steps[1], steps[0]) <= TOL
    assert any(not np.array_equal(steps[0][k], w[k]) for k in w)  # it moved
    for tr in (ref, t):
        tr.set_weights(w)
    l0, g0, a0 = ref.loss_and_grads(feeds)
    l1, g1, a1 = t.loss_and_grads(feeds)
    assert abs(l1 - l0) <= TOL * abs(l0)
    assert rel(g1, g0) <= TOL and rel(a1, a0) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fedsparse_prunes_into_a_smaller_program_that_trains_and_matches_torch(name, runtime, store):
    """The server prunes groups (every gated layer loses about half); the plan's network is physically smaller,
    its FedSparse program exports, and a client round on the runtime reports what the torch client reports."""
    from coordinator.strategies import groups as G
    from edge.algorithms.driver import run_plan
    from edge.protocol.wire import Plan
    s = spec_of(name)
    fs = make_strategy("fedsparse", spec=s, lr=0.05, batch_size=20)
    st = fs.init(0)
    rng = np.random.default_rng(3)
    alive = {}
    for L, g in G.groups(s).items():
        keep = np.zeros(g.size, bool)
        keep[rng.choice(g.size, max(1, g.size // 2), replace=False)] = True
        alive[L] = keep
        st.opt[f"alive/{L}"] = keep.astype(np.uint8)
    G.zero_dead(st.weights, alive, s)
    dp = fs.plan(st, "d0", {})
    n_small = sum(math.prod(v) for v in param_shapes(dp.spec).values())
    assert n_small < 0.75 * sum(math.prod(v) for v in param_shapes(s).values())
    prog, _ = store.get(dp.spec, runtime, objective="fedsparse")
    x, y = batch(s, 20, 5)
    reports = {}
    for rt, data in (("torch", torch_program(dp.spec, "fedsparse").data), (runtime, prog.data)):
        plan = Plan("r1", 1, "d0", 1e18, "fedsparse", rt, "0" * 64, dp.weights, dp.hparams, 11, dp.upload)
        reports[rt] = run_plan(plan, _trainer(rt, data), x, y)
    ref, got = reports["torch"], reports[runtime]
    assert set(got.tensors) == set(ref.tensors)
    for k, t in ref.tensors.items():
        assert (t.mask is None) == (got.tensors[k].mask is None)
        if t.mask is not None:
            assert np.array_equal(t.mask, got.tensors[k].mask)
    dense = {k: t.dense() for k, t in ref.tensors.items()}
    assert rel({k: t.dense() for k, t in got.tensors.items()}, dense) <= TOL
    assert any(not np.allclose(dense[k], dp.weights[k]) for k in dense)  # it trained
    assert set(got.extras) == set(ref.extras) == set(buffer_shapes(s))
    if ref.extras:
        assert rel(got.extras, ref.extras) <= TOL


# ------------------------------------------------------------------------------------------- docs/your-model.md
def _documented_commands() -> list[str]:
    import re
    doc = (Path(__file__).resolve().parent.parent / "docs" / "your-model.md").read_text()
    lines = [ln.strip() for block in re.findall(r"```sh\n(.*?)```", doc, re.S) for ln in block.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


@pytest.mark.slow
def test_the_documented_commands_run(tmp_path):
    """Every command in docs/your-model.md's sh blocks, in order, from a copy of examples/your_model (another
    broker port): the export, the simulated run's report and plot, and the deployed coordinator with three
    devices, which must finish its rounds and write its report."""
    import shlex
    import shutil
    import socket
    import subprocess
    import sys
    import time

    if not Path("/usr/sbin/mosquitto").exists() and shutil.which("mosquitto") is None:
        pytest.skip("needs mosquitto")
    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "examples" / "your_model", tmp_path / "examples" / "your_model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(root), FEDGE_LOG="WARNING")
    # the ORT + ExecuTorch FedSparse run: tests/test_quiet_libraries.py runs it (scaled down, its output checked)
    commands = [c for c in _documented_commands() if "--runtimes ort,executorch" not in c]
    assert [c.split()[0] for c in commands] == ["python", "fedge", "fedge", "python", "mosquitto", "fedge", "fedge",
                                                "fedge", "fedge"]
    background: list[tuple[str, subprocess.Popen]] = []
    try:
        for line in commands:
            line = line.replace("1883", str(port))
            bg = line.endswith("&")
            argv = shlex.split(line.rstrip("&"))
            if argv[0] == "fedge":
                argv = [sys.executable, "-m", "coordinator.cli", *argv[1:]]
            elif argv[0] == "python":
                argv = [sys.executable, *argv[1:]]
            elif argv[0] == "mosquitto":
                argv = [shutil.which("mosquitto") or "/usr/sbin/mosquitto", *argv[1:]]
            if bg:
                background.append((line, subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                                          stderr=subprocess.STDOUT, text=True)))
                if argv[0].endswith("mosquitto"):
                    time.sleep(0.5)
            else:
                p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
                assert p.returncode == 0, f"{line}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
        coord = next(p for line, p in background if " coordinator " in line)
        out, _ = coord.communicate(timeout=600)
        assert coord.returncode == 0, out[-3000:]
    finally:
        for _, p in background:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    work = tmp_path / "runs" / "your-model"
    assert any((work / "programs").iterdir())
    sim = json.loads((work / "report.json").read_text())
    assert len(sim["rounds"]) == 10 and sim["model"] == "examples/your_model/model.py:make"
    assert sim["final_accuracy"] > 0.2  # ten classes: chance is 0.1
    fleet = json.loads((work / "fleet-report.json").read_text())
    assert [r["round"] for r in fleet["rounds"]] == [1, 2, 3, 4, 5]
    assert all(r["accuracy"] is not None and r["reports"] == 3 for r in fleet["rounds"])
    assert (work / "report.png").stat().st_size > 0 and (work / "fleet-report.png").stat().st_size > 0
    assert "run finished: 5 rounds" in out


def test_a_strategy_with_running_statistics_copies_and_plans_as_the_original():
    """Coordinator.prefetch plans from a deep copy of the strategy; a BatchNorm model's strategy (RunningStats)
    recursed without end in the copy (its attribute lookup asked the inner strategy before it was set)."""
    import copy
    s = spec_of("bn_cnn")
    fed = make_strategy("fedavg", spec=s, lr=0.1, batch_size=10)
    twin = copy.deepcopy(fed)
    assert isinstance(twin, RunningStats) and twin.inner is not fed.inner
    a, b = fed.plan(fed.init(0), "d0", {}), twin.plan(twin.init(0), "d0", {})
    assert set(a.weights) == set(b.weights) and set(a.extras) == set(b.extras) == set(buffer_shapes(s))
    assert all(np.array_equal(a.weights[k], b.weights[k]) for k in a.weights)
