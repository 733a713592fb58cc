"""A device in another language, written from docs/protocol.md alone (clients/node/device.js: its own MQTT client,
msgpack codec and MLP trainer, no packages), against the conformance vectors and ``fedge conformance``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator import conformance as C
from coordinator.broker import Mosquitto, mosquitto_binary
from edge.runtime.mqtt import BrokerAddress

ROOT = Path(__file__).resolve().parents[1]
DEVICE_JS = ROOT / "clients" / "node" / "device.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def test_node_device_reads_the_vectors():
    r = subprocess.run([NODE, str(DEVICE_JS), "--check-vectors", str(ROOT / "firmware_tests" / "protocol")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "27/27 vectors as expected (1 of extensions skipped)" in r.stdout


def test_node_float16_is_numpys():
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.normal(0, 1e-2, 200), rng.normal(0, 1e-6, 50), rng.normal(0, 100, 50),
                         [0.0, 1 / 256, 65504.0, 70000.0, -1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 1 + 2.0**-11,
                          1 + 3 * 2.0**-11]])
    r = subprocess.run([NODE, str(DEVICE_JS), "--f16", ",".join(repr(float(x)) for x in xs)],
                       capture_output=True, text=True, timeout=60)
    got = [int(v) for v in r.stdout.strip().split(",")]
    want = np.clip(xs, -65504, 65504).astype(np.float16).view(np.uint16).tolist()  # nearest even, saturating
    assert got == want


@pytest.mark.slow
@pytest.mark.mosquitto
@pytest.mark.skipif(mosquitto_binary() is None and not os.environ.get("CI"), reason="mosquitto not installed")
def test_node_device_passes_fedge_conformance(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 4))
    (tmp_path / "data.json").write_text(json.dumps({"x": x.round(4).tolist(), "y": (x[:, 0] > 0).astype(int).tolist()}))
    b = Mosquitto()
    proxy = C.Proxy("127.0.0.1:0", BrokerAddress.parse(f"mqtt://127.0.0.1:{b.port}"))
    dev = subprocess.Popen([NODE, str(DEVICE_JS), "--broker", f"mqtt://127.0.0.1:{proxy.address[1]}", "--fleet", "conf",
                            "--id", "js-1", "--data", str(tmp_path / "data.json"), "--ack-timeout", "0.5",
                            "--heartbeat", "30"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        o = C.Options(f"mqtt://127.0.0.1:{b.port}", "js-1", "conf", timeout_s=10.0, resend_within_s=3.0, quiet_s=0.6,
                      pace_s=1.0, first_wait_s=15.0, data=(x.round(4), (x[:, 0] > 0).astype(int)))  # train_maths
        verdicts = C.run(o, lines.append, proxy)
    finally:
        dev.terminate()
        out = dev.communicate(timeout=10)[0]
        proxy.close()
        b.stop()
    print("\n".join(lines), file=sys.stderr)
    assert verdicts == {k: "PASS" for k in C.STEPS}, "\n".join(lines) + "\n--- device:\n" + out[-3000:]


def test_node_trainer_equals_torch_autograd(tmp_path):
    """Two full-batch SGD steps of the JS trainer (batch = all rows, so the batch order cannot matter) against
    torch autograd on the cross-entropy of the same ReLU MLP: every term (both layers' weights and biases) moves."""
    import torch

    from edge.model import init_weights, mlp

    spec = mlp([4, 8, 3])
    w = init_weights(spec, 3)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(30, 4)).astype(np.float32)
    y = rng.integers(0, 3, 30)
    lr = 0.5
    script = f"""
const d = require({json.dumps(str(DEVICE_JS))});
const inp = JSON.parse(require('fs').readFileSync({json.dumps(str(tmp_path / 'in.json'))}, 'utf8'));
const weights = {{}};
for (const [k, v] of Object.entries(inp.w)) weights[k] = {{shape: v.shape, values: Float64Array.from(v.values)}};
const plan = {{strategy: 'fedavg', seed: 1, upload: {{dtype: 'f4'}}, weights,
  hparams: {{lr: new d.F64({lr}), epochs: 2, batch_size: 30}}}};
const r = d.train(plan, {{format: 'fedge-torch/1', objective: 'ce', model: {json.dumps(spec)}}}, {{x: inp.x, y: inp.y}});
const out = {{}};
for (const [k, t] of Object.entries(r.tensors)) {{
  const vals = []; for (let i = 0; i < t.x.b.length / 4; i++) vals.push(t.x.b.readFloatLE(4 * i)); out[k] = vals; }}
console.log(JSON.stringify(out));
"""
    (tmp_path / "in.json").write_text(json.dumps({"w": {k: {"shape": list(v.shape), "values": v.ravel().tolist()}
                                                        for k, v in w.items()},
                                                  "x": x.tolist(), "y": y.tolist()}))
    r = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = {k: np.array(v) for k, v in json.loads(r.stdout).items()}

    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}
    xt, yt = torch.tensor(x, dtype=torch.float64), torch.tensor(y)
    for _ in range(2):
        h = torch.relu(xt @ p["fc0.weight"].T + p["fc0.bias"])
        loss = torch.nn.functional.cross_entropy(h @ p["fc1.weight"].T + p["fc1.bias"], yt)
        grads = torch.autograd.grad(loss, list(p.values()))
        with torch.no_grad():
            p = {k: (v - lr * g).requires_grad_() for (k, v), g in zip(p.items(), grads)}
    for k, v in p.items():
        want = v.detach().numpy().ravel()
        assert np.abs(want - w[k].ravel()).max() > 1e-3, f"{k} does not move: a bad test point"
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.mosquitto
@pytest.mark.slow  # ~30 s
@pytest.mark.skipif(mosquitto_binary() is None and not os.environ.get("CI"), reason="mosquitto not installed")
def test_node_devices_train_with_the_real_coordinator(tmp_path):
    """Three Node devices and the coordinator daemon (FedAvg, digits, MLP 64-16-10, reproducible mode): every round
    commits with all three reports admitted, and the global model learns."""
    from coordinator.simulate import SimConfig, build_coordinator, prepare
    from edge.runtime.data import load_npz

    cfg = SimConfig(devices=3, clients_per_round=3, over_selection=1.0, rounds=3, epochs=1, lr=0.1, hidden=(16,),
                    seed=0, fleet="nodefleet", workdir=str(tmp_path / "sim"), round_timeout_s=60.0)
    specs, data = prepare(cfg)
    rows: list[dict] = []
    with Mosquitto() as b:
        coord = build_coordinator(cfg, b.url, (data.x_test, data.y_test), rows.append).start()
        procs = []
        try:
            assert coord.link.connected.wait(30)
            for s in specs:
                x, y = load_npz(s["data"])
                (Path(s["state"]) / "data.json").write_text(json.dumps({"x": x.tolist(), "y": y.tolist()}))
                procs.append(subprocess.Popen(
                    [NODE, str(DEVICE_JS), "--broker", b.url, "--fleet", cfg.fleet, "--id", s["id"],
                     "--data", str(Path(s["state"]) / "data.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True))
            assert coord.wait(120), f"not finished: {rows}"
            assert coord.error is None
        finally:
            coord.stop()
            for p in procs:
                p.terminate()
            logs = [p.communicate(timeout=10)[0] for p in procs]
    print([(r["round"], r["reports"], round(r["accuracy"], 4), r["bytes_down"], r["bytes_up"], round(r["wall_s"], 2)) for r in rows])
    assert [r["reports"] for r in rows] == [3, 3, 3], (rows, logs)
    assert rows[-1]["accuracy"] > 0.3, rows  # 10 classes: chance is 0.1
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] - 0.02
