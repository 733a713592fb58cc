"""The browser device's core (clients/web/src) in Node, and the gradient graph it runs (issue 25).

- ``gradient_model.onnx`` in every ``fedge-ort/2`` program (export/ort.py) gives the loss and gradients of
  ``OrtTrainer.loss_and_grads`` and of an independent float64 reference; programs without it still load.
- The JS client halves (FedAvg, FedProx, FedSparse over ONNX Runtime Web) against a float64 torch reference written
  out here, at points where everything moves (several epochs, uneven batches, non-unit scales), replaying the JS
  device's own random draws (batches, noise, mask uniforms); their reports decode with the Python receiver.
- One full-batch FedAvg step equals the Python ORT device's within 1e-5.
- ``fedge conformance`` passes every step against ``clients/web/node.mjs`` over MQTT over WebSockets (Mosquitto).
"""
from __future__ import annotations

import base64
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "clients" / "web"
NODE = shutil.which("node")
ORT_WEB = WEB / "node_modules" / "onnxruntime-web" / "dist" / "ort.training.wasm.mjs"
needs_node = pytest.mark.skipif(NODE is None or not ORT_WEB.exists() and not os.environ.get("CI"),
                                reason="node or clients/web's npm packages are absent (npm ci --prefix clients/web)")
BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1  # Louizos et al. 2018's hard-concrete constants, as numbers


def program(sizes, objective):
    from edge.model import mlp
    from export.build import build_program
    return build_program(mlp(sizes), "ort", objective=objective).data


# ------------------------------------------------------------------------------------------ the reference (torch, f64)
def ref_loss(P, x, y, sizes, objective, hp, inputs):
    """The objective of docs/trainers.md written out again: ReLU MLP, softmax cross-entropy (batch mean); FedProx adds
    (mu / 2) ||w - w_global||^2; FedSparse gates each hidden layer with hard-concrete gates (Eq. 23, 41 with
    lambda = 0)."""
    import torch
    h = torch.tensor(np.asarray(x, np.float64))
    L = len(sizes) - 1
    pen = 0.0
    for i in range(L):
        h = h @ P[f"fc{i}.weight"].T + P[f"fc{i}.bias"]
        if i < L - 1:
            h = torch.relu(h)
            if objective == "fedsparse":
                T = hp["T"]
                logit_pi = (torch.tensor(inputs[f"norm{i}"], dtype=torch.float64) - torch.nn.functional.softplus(P[f"fc{i}.v"])) / T
                u = torch.tensor(inputs[f"u{i}"], dtype=torch.float64)
                s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + logit_pi + BETA * math.log(-GAMMA / ZETA)) / BETA)
                z = torch.clamp(s * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)
                pi = torch.sigmoid(logit_pi)
                th = torch.tensor(inputs[f"theta_logit{i}"], dtype=torch.float64)
                ls = torch.nn.functional.logsigmoid
                pen = pen + hp["lambda0"] * pi.sum() - hp["ce_scale"] * (pi * ls(th) + (1 - pi) * ls(-th)).sum()
                h = h * z
    loss = torch.nn.functional.cross_entropy(h, torch.tensor(np.asarray(y, np.int64))) + pen
    if objective == "fedprox":
        loss = loss + 0.5 * hp["mu"] * sum(((P[k] - torch.tensor(inputs["g"][k], dtype=torch.float64)) ** 2).sum() for k in P)
    return loss


def ref_grads(params, x, y, sizes, objective, hp, inputs):
    import torch
    P = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in params.items()}
    loss = ref_loss(P, x, y, sizes, objective, hp, inputs)
    g = torch.autograd.grad(loss, list(P.values()))
    return float(loss), {k: gi.numpy() for k, gi in zip(P, g)}


def norms(p, L):
    return np.sqrt((p[f"{L}.weight"].astype(np.float64) ** 2).sum(1) + p[f"{L}.bias"].astype(np.float64) ** 2)


def softplus(v):
    return np.maximum(v, 0) + np.log1p(np.exp(-np.abs(v)))


def reference_training(weights, x, y, sizes, strategy, hp, trace):
    """The client half of ``strategy`` in float64 with the JS device's draws: SGD on the weights, torch's Adamax on
    FedSparse's thresholds, the mask z ~ Bern(pi) from the recorded uniforms."""
    objective = {"fedavg": "ce", "fedprox": "fedprox", "fedsparse": "fedsparse"}[strategy]
    p = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    layers = [f"fc{i}" for i in range(len(sizes) - 2) if f"fc{i}.v" in p]
    theta = {L: (norms(p, L) - softplus(p[f"{L}.v"])) / hp.get("T", 1) for L in layers}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    u = {k: np.zeros_like(v) for k, v in p.items()}
    t = 0
    for step, idx in enumerate(trace["batches"]):
        inputs = {"g": weights}
        for i, L in enumerate(layers):
            inputs |= {f"u{i}": np.asarray(trace["noise"][step][f"u{i}"], np.float64), f"norm{i}": norms(p, L),
                       f"theta_logit{i}": theta[L]}
        _, g = ref_grads(p, x[idx], y[idx], sizes, objective, hp, inputs)
        t += 1
        for k in p:
            if k.endswith(".v"):
                m[k] = 0.9 * m[k] + 0.1 * g[k]
                u[k] = np.maximum(0.999 * u[k], np.abs(g[k]) + 1e-8)
                p[k] = p[k] - hp["v_lr"] / (1 - 0.9 ** t) * m[k] / u[k]
            else:
                p[k] = p[k] - hp["lr"] * g[k]
    masks = {}
    for L in layers:
        pi = 1 / (1 + np.exp(-(norms(p, L) - softplus(p[f"{L}.v"])) / hp["T"]))
        masks[L] = np.asarray(trace["mask_uniforms"][L]) < pi
    return p, masks


# ------------------------------------------------------------------------------------------ running the JS core
def run_js(tmp_path, prog: bytes, x, y, plan: dict, *, sampled=False, repeat=1) -> dict:
    from edge.runtime.data import save_npz
    (tmp_path / "p.fedge").write_bytes(prog)
    save_npz(tmp_path / "d.npz", x, y)
    plan = {"task_id": "t-r1a1", "device_id": "web-1", "round": 1, **plan,
            "weights": {k: {"shape": list(v.shape), "values": np.asarray(v, np.float64).ravel().tolist()}
                        for k, v in plan["weights"].items()}}
    (tmp_path / "in.json").write_text(json.dumps({"program": str(tmp_path / "p.fedge"), "data": str(tmp_path / "d.npz"),
                                                  "plan": plan, "sampled": sampled, "repeat": repeat}))
    r = subprocess.run([NODE, str(WEB / "tools.mjs"), "run-plan", str(tmp_path / "in.json"), str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    out["report_bytes"] = base64.b64decode(out["report"])
    return out


def gated_weights(sizes, rng, T, scale=0.7):
    w = {}
    for i in range(len(sizes) - 1):
        W, b = rng.normal(size=(sizes[i + 1], sizes[i])) * scale, rng.normal(size=sizes[i + 1]) * scale * 0.5
        w[f"fc{i}.weight"], w[f"fc{i}.bias"] = W.astype(np.float32), b.astype(np.float32)
        if i < len(sizes) - 2:
            norm = np.sqrt((W.astype(np.float32).astype(np.float64) ** 2).sum(1) + b.astype(np.float32).astype(np.float64) ** 2)
            logit_pi = np.minimum(rng.uniform(-1.5, 1.5, len(b)), 0.8 * norm / T)
            tau = norm - T * logit_pi
            w[f"fc{i}.v"] = (tau + np.log(-np.expm1(-tau))).astype(np.float32)
    return w


# ------------------------------------------------------------------------------------------ the gradient graph
@pytest.mark.parametrize("objective", ["ce", "fedprox", "fedsparse"])
def test_gradient_model_equals_the_training_api_and_a_reference(objective):
    import onnxruntime as ort

    from edge.trainers.base import feeds
    from edge.trainers.ort_backend import GRADIENT_FILE, OrtTrainer, unpack_program

    sizes, T = [5, 6, 4, 3], 0.7
    data = program(sizes, objective)
    body = unpack_program(data)
    rng = np.random.default_rng(3)
    w = gated_weights(sizes, rng, T) if objective == "fedsparse" else \
        {k: (rng.normal(size=s) * 0.6).astype(np.float32) for k, s in body["shapes"].items()}
    x, y = rng.normal(size=(7, 5)).astype(np.float32), rng.integers(0, 3, 7)
    hp = {"mu": 0.9, "T": T, "lambda0": 0.3, "ce_scale": 0.4}
    glob = {k: (v + rng.normal(size=v.shape) * 0.4).astype(np.float32) for k, v in w.items()}
    given = {"x": x, "y": y}
    if objective == "fedprox":
        given |= {"mu": np.float32(hp["mu"])} | {f"g.{k}": v for k, v in glob.items()}
    if objective == "fedsparse":
        given |= {k: np.float32(hp[k]) for k in ("lambda0", "ce_scale", "T")}
        for i in range(2):
            L = f"fc{i}"
            given |= {f"u{i}": rng.uniform(0.05, 0.95, sizes[i + 1]).astype(np.float32),
                      f"theta_logit{i}": rng.normal(size=sizes[i + 1]).astype(np.float32),
                      f"norm{i}": norms({k: v.astype(np.float64) for k, v in w.items()}, L).astype(np.float32)}
    t = OrtTrainer(threads=1)
    t.load(data)
    t.set_weights(w)
    loss, grads, _ = t.loss_and_grads(given)
    arrays, _ = feeds(t.inputs, given)
    s = ort.InferenceSession(body["files"][GRADIENT_FILE], providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    got = [i.name for i in s.get_inputs()]  # the program's inputs, then the parameters (fed by name)
    assert got[:len(t.inputs)] == [i.name for i in t.inputs] and sorted(got[len(t.inputs):]) == sorted(body["params"])
    out = dict(zip(names, s.run(None, {i.name: a for i, a in zip(t.inputs, arrays)} | w)))
    assert float(out["loss"]) == pytest.approx(loss, rel=1e-6)
    inputs = {"g": glob} | {k: np.asarray(v, np.float64) for k, v in given.items() if k not in ("x", "y")}
    rloss, rgrads = ref_grads(w, x, y, sizes, objective, hp, inputs)
    assert float(out["loss"]) == pytest.approx(rloss, rel=1e-5)
    for k in body["params"]:
        np.testing.assert_allclose(out[f"{k}_grad"], grads[k], rtol=1e-5, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(out[f"{k}_grad"], rgrads[k], rtol=1e-4, atol=1e-6, err_msg=k)
        assert np.abs(rgrads[k]).max() > 1e-3, f"{k}: no gradient at this point (a bad test point)"


def test_a_program_without_the_gradient_model_still_loads_and_pack_keeps_it():
    from edge.trainers.ort_backend import GRADIENT_FILE, OrtTrainer, pack_program, unpack_program
    from export.store import EXPORTER_VERSION

    old = ROOT / "firmware_tests" / "golden" / "mlp.ort"
    if not old.exists():
        old = next((ROOT / "firmware_tests" / "golden").glob("*.ort"))
    body = unpack_program(old.read_bytes())
    files = {k: v for k, v in body["files"].items() if k != GRADIENT_FILE}
    meta = {k: v for k, v in body.items() if k not in ("format", "files", "checkpoint")}
    bare = pack_program(meta, files, nominal=body["checkpoint"] == "nominal")
    t = OrtTrainer(threads=1)
    t.load(bare)  # an old program (no gradient graph) loads as before
    assert GRADIENT_FILE not in unpack_program(bare)["files"]
    kept = unpack_program(pack_program(meta, files | {GRADIENT_FILE: b"graph"}, nominal=True))["files"]
    assert kept[GRADIENT_FILE] == b"graph"
    assert EXPORTER_VERSION >= 7  # the program store's keys changed with the format: no cached old program is served


# ------------------------------------------------------------------------------------------ the JS client halves
@needs_node
def test_js_device_reads_the_vectors():
    r = subprocess.run([NODE, str(WEB / "tools.mjs"), "check-vectors", str(ROOT / "firmware_tests" / "protocol")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "27/27 vectors as expected" in r.stdout


def js_sha256(data: bytes) -> str:
    script = (f"import {{ sha256hex }} from {json.dumps(str(WEB / 'src' / 'sha256.mjs'))};"
              "const c=[];process.stdin.on('data',d=>c.push(d));process.stdin.on('end',()=>"
              "console.log(sha256hex(new Uint8Array(Buffer.concat(c)))));")
    return subprocess.run([NODE, "--input-type=module", "-e", script], input=data, capture_output=True,
                          timeout=60).stdout.decode().strip()


@needs_node
def test_js_sha256_is_hashlibs():
    import hashlib
    for n in (0, 1, 55, 56, 63, 64, 65, 1000, 70001):
        data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
        assert js_sha256(data) == hashlib.sha256(data).hexdigest(), n


CASES = {  # several epochs, uneven batches (23 rows in 10s), non-unit scales
    "fedavg": {"lr": 0.3, "epochs": 3, "batch_size": 10},
    "fedprox": {"lr": 0.25, "epochs": 3, "batch_size": 10, "mu": 0.8},
    "fedsparse": {"lr": 0.2, "epochs": 3, "batch_size": 10, "v_lr": 0.05, "lambda0": 0.3, "ce_scale": 0.5, "T": 0.7},
}


@needs_node
@pytest.mark.parametrize("strategy", list(CASES))
def test_js_client_half_against_the_reference(tmp_path, strategy):
    from edge.protocol import wire

    sizes = [5, 6, 4, 3]
    hp = CASES[strategy]
    objective = {"fedavg": "ce", "fedprox": "fedprox", "fedsparse": "fedsparse"}[strategy]
    rng = np.random.default_rng({"fedavg": 1, "fedprox": 2, "fedsparse": 3}[strategy])
    w = gated_weights(sizes, rng, hp.get("T", 1.0), scale=0.8)
    if strategy != "fedsparse":
        w = {k: v for k, v in w.items() if not k.endswith(".v")}
    x, y = (rng.normal(size=(23, 5)) * 1.5).astype(np.float32), rng.integers(0, 3, 23)
    out = run_js(tmp_path, program(sizes, objective), x, y,
                 {"strategy": strategy, "seed": 11, "hparams": hp, "floats": [k for k in hp if k not in ("epochs", "batch_size")],
                  "upload": {}, "weights": w})
    trace = out["trace"]
    assert [len(b) for b in trace["batches"]] == [10, 10, 3] * 3
    ref, ref_masks = reference_training(w, x.astype(np.float64), y, sizes, strategy, hp | {"T": hp.get("T", 1.0)}, trace)
    for k, v in out["weights"].items():
        want = ref[k].ravel()
        assert np.abs(want - w[k].ravel()).max() > 0.01, f"{k} barely moves: a bad test point"
        np.testing.assert_allclose(v, want, rtol=2e-4, atol=2e-5, err_msg=k)
    assert set(out["weights"]) == {k for k in w if not k.endswith(".v")}
    if strategy == "fedsparse":
        for L, m in ref_masks.items():
            assert out["masks"][f"{L}.weight"] == np.flatnonzero(m).tolist(), L
        assert 0 < sum(map(len, out["masks"].values())) < 2 * (6 + 4), "every unit kept or none: a bad test point"
    rep = wire.decode(out["report_bytes"])  # the Python receiver reads the report strictly
    assert isinstance(rep, wire.Report) and rep.n_samples == 23 and rep.metrics["steps"] == 9
    for k, t in rep.tensors.items():
        full = np.asarray(out["weights"][k], np.float32).reshape(w[k].shape)
        if strategy == "fedsparse" and k.split(".")[0] in ("fc0", "fc1"):
            rows = np.flatnonzero(ref_masks[k.split(".")[0]])
            assert t.mask is not None and np.flatnonzero(t.mask).tolist() == rows.tolist()
            np.testing.assert_array_equal(t.values, full[rows])
        else:
            assert t.mask is None
            np.testing.assert_array_equal(t.dense(), full)


@needs_node
def test_js_full_batch_step_equals_the_python_ort_device(tmp_path):
    """One full-batch FedAvg step of the JS core and of the Python ORT device on the same plan, within 1e-5; both
    against the step written out in numpy."""
    from edge.algorithms.driver import run_plan
    from edge.model import init_weights, mlp
    from edge.protocol import wire
    from edge.runtime.program import program_hash
    from edge.trainers.ort_backend import OrtTrainer

    sizes = [64, 16, 10]
    prog = program(sizes, "ce")
    rng = np.random.default_rng(5)
    x, y = rng.uniform(0, 1, size=(60, 64)).astype(np.float32), rng.integers(0, 10, 60)
    w = {k: v * 2 for k, v in init_weights(mlp(sizes), 0).items()}
    hp = {"lr": 0.5, "epochs": 1, "batch_size": 60}
    out = run_js(tmp_path, prog, x, y, {"strategy": "fedavg", "seed": 3, "hparams": hp, "floats": ["lr"], "upload": {},
                                        "weights": w})
    t = OrtTrainer(threads=1)
    t.load(prog)
    plan = wire.Plan("t-r1a1", 1, "web-1", 1e12, "fedavg", "ort", program_hash(prog), w, hp, 3, {}, None)
    py = run_plan(plan, t, x, y)
    h = x.astype(np.float64) @ w["fc0.weight"].T.astype(np.float64) + w["fc0.bias"]
    a = np.maximum(h, 0)
    z = a @ w["fc1.weight"].T.astype(np.float64) + w["fc1.bias"]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dz = (p - np.eye(10)[y]) / 60
    da = (dz @ w["fc1.weight"].astype(np.float64)) * (h > 0)
    ref = {"fc1.weight": w["fc1.weight"] - 0.5 * dz.T @ a, "fc1.bias": w["fc1.bias"] - 0.5 * dz.sum(0),
           "fc0.weight": w["fc0.weight"] - 0.5 * da.T @ x, "fc0.bias": w["fc0.bias"] - 0.5 * da.sum(0)}
    for k, v in out["weights"].items():
        js = np.asarray(v).reshape(w[k].shape)
        assert np.abs(js - py.tensors[k].dense()).max() <= 1e-5, k
        assert np.abs(js - ref[k]).max() <= 1e-5, k
        assert np.abs(ref[k] - w[k]).max() > 1e-2, f"{k} barely moves"


@needs_node
def test_js_sampled_q8r_update_decodes_and_estimates_the_change(tmp_path):
    """FedSparse with the 'max' preset's upload (q8r differences, f4 vectors, a norm-proportional sample of rows):
    the Python receiver reads it; sent rows are the trained change within one q8r step, probabilities >= p_min."""
    from edge.protocol import wire

    sizes = [20, 30, 3]
    rng = np.random.default_rng(8)
    w = gated_weights(sizes, rng, 0.5)
    x, y = rng.normal(size=(40, 20)).astype(np.float32), rng.integers(0, 3, 40)
    hp = {"lr": 0.2, "epochs": 2, "batch_size": 16, "v_lr": 0.01, "T": 0.5}
    up = {"dtype": "q8r", "dtype_1d": "f4", "delta": True, "sample": "norm", "keep": 0.4, "p_min": 0.2}
    out = run_js(tmp_path, program(sizes, "fedsparse"), x, y, {"strategy": "fedsparse", "seed": 4, "hparams": hp,
                                                                "floats": ["lr", "v_lr", "T"], "upload": up, "weights": w},
                 sampled=True)
    rep = wire.decode(out["report_bytes"])
    t = rep.tensors["fc0.weight"]
    assert t.sampled and 0 < t.n_sent < t.n_active
    assert (np.asarray(t.pcodes) >= 0.2 * 255 - 1).all()
    change = np.asarray(out["weights"]["fc0.weight"]).reshape(30, 20) - w["fc0.weight"].astype(np.float64)
    rows = t.sent_rows()
    step = np.abs(change[rows]).max(1, keepdims=True) / 127
    assert (np.abs(np.asarray(t.values, np.float64) - change[rows]) <= step * 1.0001).all()
    assert rep.tensors["fc0.bias"].values.dtype == np.float32 and not rep.tensors["fc0.bias"].sampled
    sent = len(out["report_bytes"])
    dense = 4 * sum(np.prod(v.shape) for k, v in w.items() if not k.endswith(".v"))
    assert sent < 0.6 * dense, (sent, dense)


# ------------------------------------------------------------------------------------------ conformance over WebSockets
@needs_node
@pytest.mark.mosquitto
@pytest.mark.slow
def test_node_entry_passes_fedge_conformance_over_websockets(tmp_path, mosquitto_ws):
    from coordinator import conformance as C
    from edge.runtime.data import save_npz
    from edge.runtime.mqtt import BrokerAddress

    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(int)
    save_npz(tmp_path / "data.npz", x, y)
    b = mosquitto_ws
    proxy = C.Proxy("127.0.0.1:0", BrokerAddress.parse(b.url), ("127.0.0.1", b.ws_port))
    dev = subprocess.Popen([NODE, str(WEB / "node.mjs"), "--broker", f"ws://127.0.0.1:{proxy.address[1]}", "--fleet",
                            "conf", "--id", "web-1", "--data", str(tmp_path / "data.npz"), "--ack-timeout", "0.5",
                            "--heartbeat", "30"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        o = C.Options(b.url, "web-1", "conf", timeout_s=20.0, resend_within_s=3.0, quiet_s=0.6, pace_s=1.0,
                      first_wait_s=30.0, data=(x, y))
        verdicts = C.run(o, lines.append, proxy)
    finally:
        dev.terminate()
        out = dev.communicate(timeout=10)[0]
        proxy.close()
    print("\n".join(lines), file=sys.stderr)
    assert verdicts == {k: "PASS" for k in C.STEPS}, "\n".join(lines) + "\n--- device:\n" + out[-3000:]


@needs_node
def test_node_entry_refuses_a_persons_mistakes_in_one_line(tmp_path):
    for args, says in [(["--id", "a b", "--data", str(tmp_path / "none.npz")], "--data"),
                       (["--id", "w1", "--data", "x.npz", "--bogus", "1"], "unknown option --bogus"),
                       (["--id", "w1"], "--id and --data are required"),
                       (["--id", "w1", "--data", "x.npz", "--broker", "http://h:1"], "ws://, wss://")]:
        r = subprocess.run([NODE, str(WEB / "node.mjs"), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
