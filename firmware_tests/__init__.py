"""Firmware acceptance tests: does a device's runtime reproduce the torch reference?

Run ``python -m firmware_tests [--runtime ort|executorch|torch|all]`` on the device. It needs only the
fedge package (``edge``), numpy and that runtime (the ORT run never imports torch): the torch reference
results and the exported programs ship in ``firmware_tests/golden/``. Regenerate them with
``python -m export.golden`` on a machine with the export toolchain; this package imports nothing from
``export`` or ``coordinator``.

:data:`PROGRAMS` is the registry of what is checked. A new objective is one line there (its objective
name, spec, layout and the builder of its test points in ``cases.py``) plus its golden files.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.model import lenet, mlp

GOLDEN = Path(__file__).resolve().parent / "golden"
RUNTIMES = ("torch", "ort", "executorch")
PROGRAM_SUFFIX = {"torch": "torch.json", "ort": "ort", "executorch": "pte"}
# How far a runtime's loss, gradients, auxiliary outputs and one-step weights may be from the golden ones, relative
# to each tensor's largest entry. Both are float32 results of the same step, so the limit is set by the step's
# float32 error (against float64; tests/test_firmware.py measures it for every program and requires each
# ``rel_tol`` to be at least 4x it, so the golden's error plus the runtime's fits twice over, and below 1e-3, so a
# real bug of that size still fails): 1e-4 where the error is ~1e-6; more for FedSparse at T = 1e-3 (``gated``).
REL_TOL = 1e-4
BATCH = 20
LR = 0.1


@dataclass(frozen=True)
class Golden:
    """One program the suite checks: ``objective`` (edge/trainers/torch_objectives) for ``spec`` and ``layout``.

    ``cases`` names a builder in :mod:`firmware_tests.cases`: the program is checked through
    ``loss_and_grads`` (loss, every gradient, auxiliary outputs, one numpy SGD step of ``lr``) at each of
    its test points. Without ``cases`` it is a plain cross-entropy program, checked through the runtime's
    own SGD ``step``.
    """

    objective: str
    spec: dict[str, Any]
    layout: dict[str, Any] = field(default_factory=dict)
    cases: str | None = None
    lr: float = LR
    rel_tol: float = REL_TOL


SMALL = [64, 32, 16, 10]
PROGRAMS: dict[str, Golden] = {
    "mlp": Golden("ce", mlp([64, 200, 200, 10])),
    "cnn": Golden("ce", lenet((1, 8, 8), 10)),
    # FedSparse: T = 1e-3 with saturated and unsaturated groups, and T = 1. At T = 1e-3 one float32 ulp of
    # softplus(v) moves logit(pi) by ~3e-5: torch's float32 gradients are 2.4e-5 of their tensor from float64's,
    # ExecuTorch's 6.6e-5 from torch's (docs/trainers.md, trap 10), so 3e-4 (12x the float32 error)
    "gated": Golden("fedsparse", mlp(SMALL), cases="gated", rel_tol=3e-4),
    # FedMix, label variant: 3 expert slots; all active, and slot 1 inactive
    "mixture": Golden("mixture", mlp(SMALL), {"slots": [SMALL] * 3, "variant": "label", "gated": False},
                      cases="mixture"),
    # FedMix x FedSparse: gated slots of different sliced shapes, clustering variant
    "mixture_sparse": Golden("mixture", mlp(SMALL), {"slots": [SMALL, [64, 21, 11, 10], [64, 27, 7, 10]],
                                                     "variant": "cluster", "gated": True}, cases="mixture"),
    # FedProx: the proximal term about half the cross-entropy
    "prox": Golden("fedprox", mlp(SMALL), cases="prox"),
    # FLoPS: the gated Lagrangian (gates clamped at 0, at 1 and between; the constraint term visible), and its
    # baselines' plain objective on a linear model without bias (the paper's regression)
    "flops": Golden("flops", mlp(SMALL), {"loss": "ce", "bias": True}, cases="flops"),
    "flops_dense": Golden("flops_dense", mlp([64, 1]), {"loss": "mse", "bias": False}, cases="flops_dense"),
    # SFVI (paper 003): the logistic random-intercept model, full L_G and L_j, C_j, a device-side theta
    "sfvi": Golden("sfvi", {"arch": "ranef", "p": 2, "groups": 3, "lik": "bernoulli", "re_sd": "theta",
                            "beta_sd": "theta"}, {"family": {"G": "full", "L": "full", "C": True}}, cases="sfvi"),
}


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
