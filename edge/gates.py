"""Group gates of FedSparse (paper 000, Sec. 3 and App. H), in numpy.

Probabilities come from learned thresholds (Eq. 23): pi_g = sigmoid((||w_g|| - softplus(v_g)) / T), with
the weight norm treated as a constant (detached). Local training relaxes the Bernoulli gates to
hard-concrete ones (Louizos et al. 2018); the paper does not give the hard-concrete constants, so we use
that paper's defaults (beta 2/3, gamma -0.1, zeta 1.1) and place the location so that P(z > 0) = pi:
log_alpha = logit(pi) + beta * log(-gamma / zeta). The noise is drawn here and fed to every runtime as an
input tensor, so all runtimes compute the same numbers.

A group is one output unit of a hidden layer: its weight row and its bias (pruning removes both).
"""
from __future__ import annotations

import math

import numpy as np

BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1
LOG_RATIO = BETA * math.log(-GAMMA / ZETA)  # the shift between logit(pi) and log_alpha
U_EPS = 1e-6
L0_READINGS = ("group", "weight")  # how FedSparse charges L0: once per group, or per weight (App. G)


def softplus(v: np.ndarray) -> np.ndarray:
    """log(1 + exp(v)), written as max(v, 0) + log1p(exp(-|v|)): ORT has no Softplus gradient, so every
    runtime's graph uses this form."""
    return np.maximum(v, 0) + np.log1p(np.exp(-np.abs(v)))


def softplus_inv(tau: np.ndarray) -> np.ndarray:
    tau = np.maximum(tau, 1e-12)
    return tau + np.log(-np.expm1(-tau))


def group_norms(w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """||w_g|| over a unit's weight row and its bias."""
    return np.sqrt((w.astype(np.float64) ** 2).sum(axis=tuple(range(1, w.ndim))) + b.astype(np.float64) ** 2)


def scaled_norms(w: np.ndarray, b: np.ndarray, relative: bool = False, alive: np.ndarray | None = None) -> np.ndarray:
    """The norms the gates compare with their thresholds: ||w_g||, or with ``relative`` ||w_g|| divided by the
    mean norm of the layer's alive groups (``alive``: a mask; None: every group), so that a layer whose weights
    all grow keeps its gates where they were (docs/fedsparse.md, "Sparsity earned over rounds")."""
    n = group_norms(w, b)
    return relative_norms(n, alive) if relative else n


def relative_norms(n: np.ndarray, alive: np.ndarray | None = None) -> np.ndarray:
    """Group norms ``n`` divided by the mean of the alive ones (any gate group: rows, channels, ties)."""
    m = n if alive is None else n[alive]
    s = float(m.mean()) if m.size else 0.0
    return n / s if s > 0 else n


def logits(w: np.ndarray, b: np.ndarray, v: np.ndarray, T: float, relative: bool = False,
           alive: np.ndarray | None = None) -> np.ndarray:
    """logit(pi) = (||w_g|| - softplus(v_g)) / T, Eq. 23 (``relative``: see :func:`scaled_norms`)."""
    return (scaled_norms(w, b, relative, alive) - softplus(v.astype(np.float64))) / T


def sigmoid(a: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * a))  # stable for |a| in the thousands, which T = 1e-3 produces


def v_for_theta(w: np.ndarray, b: np.ndarray, theta: float, T: float, relative: bool = False) -> np.ndarray:
    """Thresholds that give initial probability ``theta`` (theta0 = 0.99 in the paper, App. A)."""
    tau = scaled_norms(w, b, relative) - T * math.log(theta / (1 - theta))
    return softplus_inv(tau).astype(np.float32)


def noise(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(U_EPS, 1 - U_EPS, n).astype(np.float32)


def sample_mask(pi: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Exact Bernoulli sample z ~ Bern(pi) (Alg. 2's last step)."""
    return rng.random(pi.shape) < pi
