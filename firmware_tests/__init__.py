"""Firmware acceptance tests: does a device's runtime reproduce the torch reference?

Run ``python -m firmware_tests [--runtime ort|executorch|torch|all]`` on the device. It needs only the
fedge package, numpy and that runtime (the ORT run never imports torch): the torch reference results
and the exported programs ship in ``firmware_tests/golden/`` (regenerate with
``python -m firmware_tests.regen`` on a machine with the export toolchain).
"""
from __future__ import annotations

from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "golden"
MODELS = ("mlp", "cnn")
# The FedSparse gated MLP (hard-concrete gates with a noise input, trainable thresholds v, L0 penalty):
# checked through ``loss_and_grads`` (its optimisers run in numpy on the device) at T = 1e-3 and T = 1.
GATED = "gated"
GATED_SIZES = [64, 32, 16, 10]
ALL_MODELS = MODELS + (GATED,)
RUNTIMES = ("torch", "ort", "executorch")
PROGRAM_SUFFIX = {"torch": "torch.json", "ort": "ort", "executorch": "pte"}
REL_TOL = 1e-4
BATCH = 20
LR = 0.1


def peak_rss_mb() -> float:
    """This process's peak resident set (MiB).

    Reads ``VmHWM`` (per address space, reset by exec) rather than ``ru_maxrss``, which Linux carries
    over from the parent across fork+exec and so reports the parent's peak for a small child.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
