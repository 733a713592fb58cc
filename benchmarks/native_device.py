"""The native device (clients/native: C++ on the executorch wheel's runtime, no Python, no torch) measured whole.

``python benchmarks/native_device.py [--seeds 0 1 2] [--rounds 20] [--devices 6]`` builds it
(scripts/build_native.sh) and writes ``runs/bench/native_device.json``::

    {"conformance": "pass"|"fail", "conformance_steps": {step: verdict},
     "wrong_function_caught": true|false, "wrong_function_steps": {step: verdict},
     "mixed_fleet": {"rounds", "rounds_with_native_reports", "accuracy", "accuracy_all_python", "seeds",
                     "accuracy_by_seed", "accuracy_all_python_by_seed", "spread"},
     "binary_bytes", "binary_stripped_bytes", "install_bytes", "install_files", "python_device_install_bytes",
     "peak_rss_mb", "python_peak_rss_mb",
     "step_ms": {model: {"native", "python_executorch", "torch"}}, ...}

1. ``conformance``: ``fedge conformance`` (every step, the numeric ``train_maths`` included, with the ExecuTorch
   program the driver exports itself) against the native device over a private Mosquitto. ``peak_rss_mb`` is
   that device process's peak resident memory (VmHWM) at the end of the session, which trained four plans;
   ``python_peak_rss_mb`` the same for the Python device (``fedge device --runtime executorch``) on the same
   session.
2. ``wrong_function_caught``: a copy of the device's source whose loss is twice the batch mean (row weights
   2/N) is built and judged the same way: true when ``train_maths`` fails it.
3. ``mixed_fleet``: FedSparse at its ``max`` preset (coded q8r downlink as differences, sampled q8r uploads) on
   digits over Mosquitto, every device in every round, reproducible mode: half the devices native, half the
   Python ExecuTorch device, against a fleet of the same size that is all Python, for each seed.
   ``accuracy`` and ``accuracy_all_python`` are the means of the final accuracies over the seeds; ``spread``
   the largest difference between two seeds of the all-Python fleet.
4. ``install_bytes``: what a device needs on disk: the binary plus every shared library it loads from the
   wheel and libmosquitto (``ldd``; the C and C++ runtimes every Linux has are left out), against the Python
   device's installed packages (numpy, msgpack, paho-mqtt, executorch and torch, which the ExecuTorch
   Python bindings import).
5. ``step_ms``: one FedAvg SGD step (batch 32; 1 thread) for each model, timed over a whole plan, for the native
   trainer (``fedge-native-train``), the Python device's ExecuTorch trainer and its torch trainer, in this one
   run, on the same exported program.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/native_device.py` from anywhere
    sys.path.insert(0, str(ROOT))

from coordinator import conformance as C  # noqa: E402
from coordinator.datasets import digits_sample
from coordinator.broker import Mosquitto  # noqa: E402
from edge.runtime.data import save_npz  # noqa: E402

OUT = ROOT / "runs" / "bench" / "native_device.json"
BUILD = ROOT / "build" / "native"
# the wrong-function copy: the row weights that make the loss the batch mean, doubled
WRONG = ("clients/native/src/algorithms.cpp", "1.0f / static_cast<float>(N)", "2.0f / static_cast<float>(N)")
MODELS = {"mlp-64-32-10": [64, 32, 10], "mlp-784-256-128-10": [784, 256, 128, 10]}
PY_DEVICE_DISTS = ("numpy", "msgpack", "paho-mqtt", "executorch", "torch")
SYSTEM_LIBS = re.compile(r"/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*|libpthread|libdl|librt)\.so")

log = logging.getLogger("bench.native")


def build(out: Path, source: Path = ROOT) -> Path:
    r = subprocess.run(["bash", str(source / "scripts" / "build_native.sh"), str(out)], capture_output=True,
                       text=True, env={**os.environ, "PYTHON": sys.executable})
    if r.returncode != 0:
        raise SystemExit(f"build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return out


def conformance(argv: list[str], data: Path, device: str, resend_within_s: float = 3.0
                ) -> tuple[dict[str, str], float, str]:
    """Every step of ``fedge conformance`` against the device started with ``argv`` (plus its broker); the
    verdicts, the device's peak RSS in MiB, and its output. ``resend_within_s``: the native device is started
    with a 0.5 s ack timeout; ``fedge device`` has the default 5 s (the driver's own default allows 20 s)."""
    with Mosquitto() as b:
        o = C.Options(f"mqtt://127.0.0.1:{b.port}", device, "conf", timeout_s=60.0, resend_within_s=resend_within_s,
                      quiet_s=0.6, pace_s=1.0, first_wait_s=60.0, data=str(data))
        lines: list[str] = []
        verdicts, peak, out = C.run_device(argv, o, lines.append)
    log.info("conformance of %s:\n%s", argv[0], "\n".join(lines))
    return verdicts, peak, out


def install_bytes(binary: Path) -> tuple[int, list[str]]:
    """The binary and the shared libraries it loads that a device must be given (not libc / libstdc++)."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    libs = sorted({m.group(1) for m in re.finditer(r"=> (/\S+)", out)})
    mine = [p for p in libs if not SYSTEM_LIBS.search(p)]
    files = [str(binary), *mine]
    return sum(os.path.getsize(os.path.realpath(f)) for f in files), files


def dist_bytes(names: tuple[str, ...]) -> dict[str, int]:
    out = {}
    for n in names:
        try:
            files = metadata.distribution(n).files or []
        except metadata.PackageNotFoundError:
            continue
        out[n] = sum(f.locate().stat().st_size for f in files if f.locate().is_file())
    return out


def step_ms(native_cli: Path, work: Path, steps: int = 60) -> dict[str, dict[str, float]]:
    """Median ms per FedAvg step (batch 32, 1 thread) over three plans of ``steps`` steps each."""
    import torch

    from edge.algorithms.base import Context
    from edge.algorithms.fedavg import FedAvgClient, Hparams
    from edge.model import init_weights, mlp
    from edge.protocol.wire import Plan
    from edge.trainers import make_trainer
    from export.build import build_program
    from export.store import cached_program

    torch.set_num_threads(1)
    res: dict[str, dict[str, float]] = {}
    for name, sizes in MODELS.items():
        spec = mlp(sizes)
        prog = cached_program(spec, "executorch", ROOT / "runs" / "programs")
        tprog = build_program(spec, "torch")
        w = {k: np.asarray(v, np.float32) for k, v in init_weights(spec, 0).items()}
        rng = np.random.default_rng(0)
        n = 32 * steps
        x = rng.normal(size=(n, sizes[0])).astype(np.float32)
        y = rng.integers(0, sizes[-1], n)
        d = work / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "p.pte").write_bytes(prog.data)
        np.savez(d / "w.npz", **w)
        save_npz(d / "data.npz", x, y)
        hp = {"lr": 0.01, "epochs": 1, "batch_size": 32}
        nat = []
        for _ in range(3):
            r = subprocess.run([str(native_cli), "--program", str(d / "p.pte"), "--weights", str(d / "w.npz"),
                                "--data", str(d / "data.npz"), "--strategy", "fedavg", "--hparams", json.dumps(hp),
                                "--seed", "0", "--steps-only", "--threads", "1"],
                               capture_output=True, text=True, check=True)
            nat.append(json.loads(r.stdout.strip().splitlines()[-1])["ms_per_step"])
        row = {"native": statistics.median(nat)}
        for label, rt, p in (("python_executorch", "executorch", prog.data), ("torch", "torch", tprog.data)):
            t = make_trainer(rt, threads=1) if rt == "executorch" else make_trainer(rt)
            t.load(p)
            times = []
            for _ in range(3):
                plan = Plan("bench", 0, "d", time.time() + 60, "fedavg", rt, "0" * 64, w, hp, 0, {})
                algo = FedAvgClient(Context(plan, Hparams(**hp), t, x, y, None))
                algo.begin()
                perm = np.random.default_rng(0).permutation(n)
                t0 = time.perf_counter()
                for i in range(0, n, 32):
                    algo.step(perm[i:i + 32])
                times.append(1000 * (time.perf_counter() - t0) / steps)
            row[label] = statistics.median(times)
        res[name] = {k: round(v, 4) for k, v in row.items()}
        log.info("step ms %s: %s", name, res[name])
    return res


def mixed_fleet(binary: Path, seeds: list[int], rounds: int, devices: int, work: Path) -> dict:
    from coordinator.simulate import SimConfig, simulate

    base = dict(strategy="fedsparse", devices=devices, clients_per_round=devices, over_selection=1.0, rounds=rounds,
                epochs=2, lr=0.1, hidden=(32,), processes=1, round_timeout_s=600, strategy_kw={"preset": "max"},
                native_binary=str(binary))
    acc: dict[str, list[float]] = {"mixed": [], "python": []}
    native_rounds, all_rounds, bytes_up = 0, 0, {"mixed": 0, "python": 0}
    with Mosquitto() as broker:
        for seed in seeds:
            for name, runtimes in (("python", ("executorch",)), ("mixed", ("native", "executorch"))):
                cfg = SimConfig(**base, seed=seed, runtimes=runtimes, broker=broker.url,
                                workdir=str(work / f"{name}-{seed}"))
                rep = simulate(cfg, progress=False)
                acc[name].append(rep["final_accuracy"])
                bytes_up[name] += sum(r["bytes_up"] for r in rep["rounds"])
                if name == "mixed":
                    all_rounds += len(rep["rounds"])
                    half = (devices + 1) // 2
                    native_rounds += sum(1 for r in rep["rounds"] if r.get("native_reports") == half)
                log.info("seed %d %s: final accuracy %.4f", seed, name, rep["final_accuracy"])
    py = acc["python"]
    return {"strategy": "fedsparse preset=max", "devices": devices, "native_devices": (devices + 1) // 2,
            "seeds": seeds, "rounds": all_rounds, "rounds_with_native_reports": native_rounds,
            "accuracy": round(float(np.mean(acc["mixed"])), 4), "accuracy_all_python": round(float(np.mean(py)), 4),
            "accuracy_by_seed": acc["mixed"], "accuracy_all_python_by_seed": py,
            "spread": round(max(py) - min(py), 4) if len(py) > 1 else None,
            "bytes_up": bytes_up}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--devices", type=int, default=6)
    ap.add_argument("--skip-fleet", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("FEDGE_PROGRAM_CACHE", str(ROOT / "runs" / "programs"))
    t0 = time.time()
    res: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    binary = build(BUILD) / "fedge-native"
    with tempfile.TemporaryDirectory(prefix="fedge-native-bench-") as tmp:
        work = Path(tmp)
        data = digits_sample(work / "data.npz")
        steps, peak, out = conformance([str(binary), "--id", "nat-1", "--data", str(data), "--state-dir",
                                        str(work / "nat-state"), "--ack-timeout", "0.5", "--heartbeat", "30"],
                                       data, "nat-1")
        res["conformance"] = "pass" if all(v == "PASS" for v in steps.values()) else "fail"
        res["conformance_steps"], res["peak_rss_mb"] = steps, round(peak, 1)
        py_steps, py_peak, _ = conformance([sys.executable, "-m", "coordinator.cli", "device", "--id", "py-1",
                                            "--data", str(data), "--state-dir", str(work / "py-state"),
                                            "--runtime", "executorch"], data, "py-1", resend_within_s=20.0)
        res["python_conformance"] = "pass" if all(v == "PASS" for v in py_steps.values()) else "fail"
        res["python_peak_rss_mb"] = round(py_peak, 1)

        src = work / "wrong"
        shutil.copytree(ROOT / "clients", src / "clients")
        shutil.copytree(ROOT / "scripts", src / "scripts")
        f = src / WRONG[0]
        f.write_text(f.read_text().replace(WRONG[1], WRONG[2]))
        wrong = build(work / "wrong-build", src) / "fedge-native"
        w_steps, _, _ = conformance([str(wrong), "--id", "nat-2", "--data", str(data), "--state-dir",
                                     str(work / "wrong-state"), "--ack-timeout", "0.5", "--heartbeat", "30"],
                                    data, "nat-2")
        res["wrong_function_caught"] = w_steps.get("train_maths") == "FAIL"
        res["wrong_function_steps"] = w_steps

        res["binary_bytes"] = binary.stat().st_size
        stripped = work / "stripped"
        subprocess.run(["strip", "-o", str(stripped), str(binary)], check=True)
        res["binary_stripped_bytes"] = stripped.stat().st_size
        res["install_bytes"], res["install_files"] = install_bytes(binary)
        py = dist_bytes(PY_DEVICE_DISTS)
        res["python_device_install_bytes"], res["python_device_install_by_package"] = sum(py.values()), py

        res["step_ms"] = step_ms(BUILD / "fedge-native-train", work / "step")
        if not a.skip_fleet:
            res["mixed_fleet"] = mixed_fleet(binary, a.seeds, a.rounds, a.devices, work / "fleet")
    res["wall_s"] = round(time.time() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_steps") and k != "install_files"}, indent=2))
    return 0 if res["conformance"] == "pass" and res["wrong_function_caught"] else 1


if __name__ == "__main__":
    sys.exit(main())
