"""Mutation testing of the maths (issue 9: "changing any single term, sign, weight or constant of an objective
must make a test fail").

Each mutant is one textual change to one source file (an exact ``old`` text that must occur exactly once, and
its ``new`` text) and the tests that should kill it. The harness copies the working tree to a temporary
directory per worker, applies one mutant at a time there (never in the repository), runs the named tests with
``pytest -x -q -p no:cacheprovider`` and records the mutant as killed (the tests fail) or survived (they pass).
It first runs every named test on the unmutated copy: a suite that fails without a mutation kills nothing.

    python benchmarks/mutants.py                 # all mutants, 2 workers -> runs/bench/mutants.json
    python benchmarks/mutants.py --only fedmix.damping-constant objective.ce-row-weights
    python benchmarks/mutants.py --list          # check every entry against the source, then list them

A mutant that cannot change any result (an equivalent mutant) is listed in EQUIVALENT with the reason, and
not run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OBJ = "tests/test_maths_objectives.py"
SRV = "tests/test_maths_server.py"
CLI = "tests/test_maths_clients.py"
GAP_FLOPS = "tests/test_gaps_flops.py"
GAP_SFVI = "tests/test_gaps_sfvi.py"
GAP_SPARSE = "tests/test_gaps_fedsparse.py"
GAP_CODEC = "tests/test_gaps_codec.py"
GAP_SERVER = "tests/test_gaps_server.py"
GAP_ADMIT = "tests/test_gaps_admission.py"
GAP_FEDMIX = "tests/test_gaps_fedmix.py"
GAP_PATHS = "tests/test_gaps_fedmix_paths.py"
FEDMIX_WIRE = "tests/test_fedmix.py::test_cluster_variant_sends_pi_only_as_its_reported_q_and_never_the_gate"

TORCH_OBJ = "edge/trainers/torch_objectives/"
# FedSparse's server computes line 8 from the groups' norms (threshold_grad_norms); threshold_grad, FedMix x
# FedSparse's, ends in the same return line, so the FedSparse mutants name the line before it too.
LINE8_NORMS = "theta = gates.sigmoid((norms - gates.softplus(v)) / T)\n    "


@dataclass
class Mutant:
    id: str
    file: str
    old: str
    new: str
    tests: list[str]
    what: str = ""


M = Mutant
MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ the six FedMix client mutants of issue 9
    M("fedmix.q-phi-uniform", TORCH_OBJ + "mixture.py",
      'q = torch.softmax(one_hot(y, self.C, x.dtype) @ p["phi"] + mask, dim=1)',
      'q = torch.softmax(mask.expand(x.shape[0], self.k), dim=1)', [OBJ], "q_phi(z|y) made uniform"),
    M("fedmix.gate-term-sign", TORCH_OBJ + "mixture.py", "(q * (ll_t + lg))", "(q * (ll_t - lg))", [OBJ],
      "the sign of the gate term log p_theta(z|x, s)"),
    M("fedmix.label-histogram", "edge/algorithms/fedmix.py",
      "hist = np.bincount(y, minlength=phi.shape[0]).astype(np.float64) / len(y)",
      "hist = np.full(phi.shape[0], 1.0 / phi.shape[0])", [CLI], "the label histogram in q(z|s) (Sec. 3)"),
    M("fedmix.eq9-pooling-weights", "edge/algorithms/fedmix.py", '"qs": qa[held].astype(np.float32)}',
      '"qs": np.full(len(held), 1.0 / len(held), np.float32)}', [CLI], "Eq. 9's pooling weights q(z|s)"),
    M("fedmix.eq13-gate-term", "edge/algorithms/fedmix.py",
      '(aux["lg"][:, cols] if hp.eq13_gate else 0.0)', "0.0", [CLI], "Eq. 13's gate term"),
    M("fedmix.damping-constant", "edge/algorithms/fedmix.py",
      'damping: float = field(default=0.75,', 'damping: float = field(default=0.5,', [CLI],
      "the damping constant a = 0.75 (App. B), client default"),
    # ------------------------------------------------------------------ more of FedMix's client half
    M("fedmix.damping-swapped", "edge/algorithms/fedmix.py",
      "self.pi = hp.damping * self.pi + (1 - hp.damping) * new",
      "self.pi = (1 - hp.damping) * self.pi + hp.damping * new", [CLI], "damping applied the wrong way round"),
    M("fedmix.eq13-sum-not-mean", "edge/algorithms/fedmix.py", "new[act] = softmax(joint.mean(0))",
      "new[act] = softmax(joint.sum(0))", [CLI], "Eq. 13's batch mean (1/M)"),
    M("fedmix.q-phi-uniform-client", "edge/algorithms/fedmix.py", "return hist @ softmax(phi.astype(np.float64), 1)",
      "return hist @ softmax(0 * phi.astype(np.float64), 1)", [CLI], "q_phi(z|y) uniform in q(z|s)"),
    M("fedmix.alg2-threshold", "edge/algorithms/fedmix.py", "q[k] >= eta / K]", "q[k] >= 0.9 * eta / K]", [CLI],
      "Alg. 2's client threshold eta / K"),
    M("fedmix.alg2-fallback", "edge/algorithms/fedmix.py", "[max(allowed, key=lambda k: q[k])]",
      "[min(allowed, key=lambda k: q[k])]", [CLI], "no expert passes: keep the best held one"),
    M("fedmix.alg2-renormalise", "edge/algorithms/fedmix.py", "return out / out.sum()", "return out", [CLI],
      "Alg. 2's renormalisation of q'"),
    M("fedmix.cluster-pi-restricted", "edge/algorithms/fedmix.py",
      'inputs["pi"] = restricted(self.pi, act)[held].astype(np.float32)',
      'inputs["pi"] = self.pi[held].astype(np.float32)', [CLI], "pi restricted to the active experts"),
    M("fedmix.gate-lr", "edge/algorithms/fedmix.py", 'sgd(gate, {"A": gA, "b": gb}, hp.gate_lr)',
      'sgd(gate, {"A": gA, "b": gb}, hp.lr)', [CLI], "the gate's learning rate"),
    M("fedmix.gate-grad-sign", "edge/algorithms/fedmix.py", "gA[np.ix_(self.unit_idx[k], held)] += a",
      "gA[np.ix_(self.unit_idx[k], held)] -= a", [CLI], "the gate's gradient scattered with the wrong sign"),
    M("fedmix.phi-grad-columns", "edge/algorithms/fedmix.py", "gp[:, held] = a", "gp[:, held[::-1]] = a", [CLI],
      "phi's gradient scattered to the held experts' columns"),
    M("fedmix.expert-lr", "edge/algorithms/fedmix.py", "sgd(self.params, grads, hp.lr)",
      "sgd(self.params, grads, hp.gate_lr)", [CLI], "the experts' and phi's learning rate"),
    M("fedmix.server-damping-constant", "coordinator/strategies/fedmix.py", "damping: float = 0.75",
      "damping: float = 0.5", [SRV], "the damping constant, server default sent in the plan"),
    # ------------------------------------------------------------------ ce (objective.py: shared by every objective)
    M("objective.ce-row-weights", TORCH_OBJ + "objective.py", "return -(log_likelihood(logits, y) * w).sum()",
      "return -log_likelihood(logits, y).mean()", [OBJ], "the row weights w_i of the data term"),
    M("objective.log-softmax-axis", TORCH_OBJ + "objective.py", "(torch.log_softmax(logits, dim=1)",
      "(torch.log_softmax(logits, dim=0)", [OBJ], "the softmax normaliser over classes"),
    M("objective.softplus", TORCH_OBJ + "objective.py", "torch.log(1 + torch.exp(-torch.abs(v)))",
      "torch.log(1 + torch.exp(-v))", [OBJ], "the stable softplus form"),
    M("nets.relu", TORCH_OBJ + "nets.py", "            h = torch.relu(h)\n", "            h = h\n", [OBJ],
      "the hidden ReLU"),
    # ------------------------------------------------------------------ gates.py (torch) and edge/gates.py constants
    M("gates.hc-beta-divide", TORCH_OBJ + "gates.py", "+ log_alpha) / BETA)", "+ log_alpha) * BETA)", [OBJ],
      "the hard-concrete temperature beta"),
    M("gates.hc-stretch", TORCH_OBJ + "gates.py", "s * (ZETA - GAMMA) + GAMMA", "s * (ZETA - GAMMA) - GAMMA",
      [OBJ], "the hard-concrete stretch to (gamma, zeta)"),
    M("gates.log-ratio-sign", TORCH_OBJ + "gates.py", "hard_concrete(logit_pi + LOG_RATIO, u)",
      "hard_concrete(logit_pi - LOG_RATIO, u)", [OBJ], "the placement shift P(z > 0) = pi"),
    M("gates.lambda0-term", TORCH_OBJ + "gates.py", "return lambda0 * pi.sum() + ce_scale * h_ce.sum()",
      "return lambda0 * (1 - pi).sum() + ce_scale * h_ce.sum()", [OBJ], "the L0 term lambda0 sum pi"),
    M("gates.cross-entropy-pos", TORCH_OBJ + "gates.py", "pi * -softplus(-theta_logit)", "pi * softplus(-theta_logit)",
      [OBJ], "pi log theta in H(pi, theta)"),
    M("gates.cross-entropy-neg", TORCH_OBJ + "gates.py", "(1 - pi) * -softplus(theta_logit)",
      "(1 - pi) * -softplus(-theta_logit)", [OBJ], "(1 - pi) log(1 - theta) in H(pi, theta)"),
    M("gates.penalty-temperature", TORCH_OBJ + "gates.py", "pi = torch.sigmoid((norm - softplus(v)) / T)",
      "pi = torch.sigmoid(norm - softplus(v))", [OBJ], "T in the penalty's pi (Eq. 23)"),
    M("gates.const-zeta", "edge/gates.py", "BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1",
      "BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.2", [OBJ], "zeta = 1.1"),
    M("gates.const-gamma", "edge/gates.py", "BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1",
      "BETA, GAMMA, ZETA = 2.0 / 3.0, -0.2, 1.1", [OBJ], "gamma = -0.1"),
    M("gates.const-beta", "edge/gates.py", "BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1",
      "BETA, GAMMA, ZETA = 0.5, -0.1, 1.1", [OBJ], "beta = 2/3"),
    M("gates.log-ratio-beta", "edge/gates.py", "LOG_RATIO = BETA * math.log(-GAMMA / ZETA)",
      "LOG_RATIO = math.log(-GAMMA / ZETA)", [OBJ], "beta in the placement shift"),
    M("gates.logits-temperature", "edge/gates.py", "softplus(v.astype(np.float64))) / T",
      "softplus(v.astype(np.float64))) * T", [CLI, SRV], "Eq. 23's 1/T in numpy"),
    M("gates.group-norm-bias", "edge/gates.py",
      "sum(axis=tuple(range(1, w.ndim))) + b.astype(np.float64) ** 2)", "sum(axis=tuple(range(1, w.ndim))))",
      [CLI, SRV], "a group is a unit's weight row and its bias"),
    M("gates.v-for-theta", "edge/gates.py", "tau = scaled_norms(w, b, relative) - T * math.log(theta / (1 - theta))",
      "tau = scaled_norms(w, b, relative) + T * math.log(theta / (1 - theta))",
      ["tests/test_fedsparse.py::test_gate_probability_and_initial_thresholds"], "initial thresholds give theta0"),
    M("gates.bernoulli", "edge/gates.py", "return rng.random(pi.shape) < pi", "return rng.random(pi.shape) > pi",
      [CLI], "z ~ Bern(pi)"),
    M("gates.bernoulli-shared", "edge/gates.py", "return rng.random(pi.shape) < pi", "return rng.random() < pi",
      [CLI], "one draw shared by every unit"),
    M("gates.sigmoid", "edge/gates.py", "return 0.5 * (1 + np.tanh(0.5 * a))", "return 0.5 * (1 + np.tanh(a))",
      [CLI, SRV], "the numpy sigmoid"),
    # ------------------------------------------------------------------ FedSparse objective and client
    M("fedsparse.penalty-sign", TORCH_OBJ + "fedsparse.py", "for pen in penalties:\n            loss = loss + pen",
      "for pen in penalties:\n            loss = loss - pen", [OBJ], "the gate penalties' sign"),
    M("fedsparse.lambda0-ce-swapped", TORCH_OBJ + "fedsparse.py",
      "us[i], ths[i], lambda0 * self.l0_weight[i], ce_scale, T)",
      "us[i], ths[i], ce_scale, lambda0 * self.l0_weight[i], T)",
      [OBJ], "lambda0 and ce_scale swapped"),
    M("fedsparse.inputs-swapped", TORCH_OBJ + "fedsparse.py", "rest[nh:2 * nh], rest[2 * nh:3 * nh]",
      "rest[2 * nh:3 * nh], rest[nh:2 * nh]", [OBJ], "theta's logit and the norms swapped"),
    M("fedsparse.client-w-lr", "edge/algorithms/fedsparse.py", "if k not in self.v_names}, self.hp.lr)",
      "if k not in self.v_names}, self.hp.v_lr)", [CLI], "SGD's lr on w"),
    M("fedsparse.client-v-optimiser", "edge/algorithms/fedsparse.py", "self.vopt = Adamax(lr=self.hp.v_lr)",
      "self.vopt = Adamax(lr=self.hp.v_lr, maximize=True)", [CLI], "Adamax descends on v"),
    M("fedsparse.client-mask-pi", "edge/algorithms/fedsparse.py", "gates.sample_mask(gates.sigmoid(logit), rng_z)",
      "gates.sample_mask(np.full(logit.shape, 0.5), rng_z)", [CLI], "the mask is drawn with the unit's pi"),
    # ------------------------------------------------------------------ mixture objective
    M("mixture.pooling-weights", TORCH_OBJ + "mixture.py", "qs[j] * (feats[j] @ p[f\"gate.A{j}\"])",
      "(feats[j] @ p[f\"gate.A{j}\"]) / self.k", [OBJ], "Eq. 9's q(z|s) pooling in the program"),
    M("mixture.penalty-mask", TORCH_OBJ + "mixture.py", "loss = loss + active[j] * pen", "loss = loss + pen", [OBJ],
      "no penalty for an inactive expert"),
    M("mixture.inactive-constant", TORCH_OBJ + "mixture.py", "INACTIVE = 1e4", "INACTIVE = 1.0", [OBJ],
      "an inactive expert has probability 0"),
    M("mixture.features-not-detached", TORCH_OBJ + "mixture.py",
      "copies = {n: named[f\"c{j}_{n.replace('.', '_')}\"] for n in self._hidden_names(j)}",
      "copies = {n: p[f\"s{j}.{n}\"] for n in self._hidden_names(j)}", [OBJ],
      "the gate's features detached (docs/fedmix.md, choice 3)"),
    M("mixture.features-ungated", TORCH_OBJ + "mixture.py", "h = relaxed(h, copies[f\"fc{i}.v\"], norm, u, T)",
      "h = h", [OBJ], "the gate's features through the expert's gates"),
    M("mixture.cluster-q-is-qs", TORCH_OBJ + "mixture.py", "q = named[\"pi\"].unsqueeze(0)",
      "q = qs.unsqueeze(0)", [OBJ], "q_pi(z|s) is the pi input"),
    M("mixture.row-weights", TORCH_OBJ + "mixture.py", "return -((q * (ll_t + lg)).sum(1) * w).sum(), ll_t, lg",
      "return -((q * (ll_t + lg)).sum(1)).mean(), ll_t, lg", [OBJ], "the row weights w_i"),
    M("mixture.gate-softmax-axis", TORCH_OBJ + "mixture.py", "lg = torch.log_softmax(z + mask, dim=1)",
      "lg = torch.log_softmax(z + mask, dim=0)", [OBJ], "the gate is a softmax over experts"),
    M("mixture.gate-bias", TORCH_OBJ + "mixture.py", "for j in range(self.k)) + p[\"gate.b\"]",
      "for j in range(self.k))", [OBJ], "the gate's b"),
    # ------------------------------------------------------------------ prox objective and client
    M("prox.half", TORCH_OBJ + "prox.py", "0.5 * mu * prox", "mu * prox", [OBJ], "mu / 2"),
    M("prox.sum", TORCH_OBJ + "prox.py", "((t - g) ** 2).sum()", "((t - g) ** 2).mean()", [OBJ],
      "the squared norm is a sum"),
    M("prox.sign", TORCH_OBJ + "prox.py", "weighted_ce(logits, y, w) + 0.5", "weighted_ce(logits, y, w) - 0.5", [OBJ],
      "the proximal term's sign"),
    M("prox.client-global", "edge/algorithms/fedprox.py", "{f\"g.{k}\": np.array(v, np.float32) for k, v in w.items()}",
      "{f\"g.{k}\": self.params[k] for k, v in w.items()}", [CLI], "the proximal centre is the plan's w^t"),
    # ------------------------------------------------------------------ FedAvg / FedAdam / FedProx server
    M("fedavg.sample-weights", "coordinator/strategies/fedavg.py", "acc._sums[k], n * received_weights(plan, report, k))",
      "acc._sums[k], received_weights(plan, report, k))", [SRV], "N_s weights the mean"),
    M("fedavg.buffer-weights", "coordinator/strategies/fedavg.py", "acc.add_update(k, w, d, n)",
      "acc.add_update(k, w, d, 1.0)", [SRV], "N_s weights the mean (the float32 buffer's path)"),
    M("fedavg.fold-base", "coordinator/strategies/fedavg.py", "_daxpy(wide[1].reshape(-1), s.reshape(-1), a=tn)",
      "_daxpy(wide[1].reshape(-1), s.reshape(-1), a=tn + 1.0)", [SRV], "the buffer holds updates: W comes back "
      "n-weighted (the fold's BLAS daxpy, the path taken with scipy, a coordinator dependency)"),
    M("fedavg.total-n", "coordinator/strategies/fedavg.py", "acc.total_n += n\n", "acc.total_n += 1.0\n", [SRV],
      "the mean divides by sum N_s"),
    M("fedavg.server-lr", "coordinator/strategies/fedavg.py", "new[k] + self.server_lr * diff[k]",
      "new[k] + diff[k]", [SRV], "the server lr"),
    M("fedadam.ascent", "coordinator/strategies/fedavg.py", "adam = Adam(lr=self.server_lr, maximize=True)",
      "adam = Adam(lr=self.server_lr, maximize=False)", [SRV], "FedAdam ascends on mean - w"),
    M("optim.adam-b1", "edge/optim.py", "    b1: float = 0.9\n", "    b1: float = 0.8\n", [SRV], "Adam's b1"),
    M("optim.adam-b2", "edge/optim.py", "    b2: float = 0.999\n", "    b2: float = 0.99\n", [SRV], "Adam's b2"),
    M("optim.adam-bias-correction", "edge/optim.py", "c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t",
      "c1, c2 = 1 - self.b1 ** self.t, 1.0", [SRV], "Adam's second-moment bias correction"),
    M("optim.adamax-max", "edge/optim.py", "np.maximum(self.b2 * u, np.abs(g) + self.eps, out=u)",
      "np.maximum(u, np.abs(g) + self.eps, out=u)", [SRV], "Adamax's decay of u"),
    M("fedprox.mu", "coordinator/strategies/fedprox.py", "batch_size=self.batch_size, mu=self.mu)",
      "batch_size=self.batch_size, mu=0.0)", [SRV], "the plan carries mu"),
    # ------------------------------------------------------------------ FedSparse server (Alg. 1 lines 3, 7, 8)
    M("fedsparse.line7-mask", "coordinator/strategies/fedsparse.py", "                diff[~t.mask] = 0.0\n",
      "                pass\n", [SRV], "z_s masks the difference"),
    M("fedsparse.line7-ascent", "coordinator/strategies/fedsparse.py",
      "wopt = Adam(lr=self.server_lr, maximize=True)", "wopt = Adam(lr=self.server_lr, maximize=False)",
      [SRV], "Adam ascent on sum z (w_s - w)"),
    M("fedsparse.line8-sign", "coordinator/strategies/fedsparse.py",
      LINE8_NORMS + "return -(z - theta) * gates.sigmoid(v) / T",
      LINE8_NORMS + "return (z - theta) * gates.sigmoid(v) / T", [SRV], "line 8's sign"),
    M("fedsparse.line8-temperature", "coordinator/strategies/fedsparse.py",
      LINE8_NORMS + "return -(z - theta) * gates.sigmoid(v) / T",
      LINE8_NORMS + "return -(z - theta) * gates.sigmoid(v)",
      [SRV], "line 8's 1/T"),
    M("fedsparse.line8-theta", "coordinator/strategies/fedsparse.py",
      LINE8_NORMS + "return -(z - theta) * gates.sigmoid(v) / T",
      LINE8_NORMS + "return -(z - 0.5) * gates.sigmoid(v) / T", [SRV], "line 8's theta"),
    M("fedsparse.server-v-lr", "coordinator/strategies/fedsparse.py", "server_v_lr: float = 1e-2",
      "server_v_lr: float = 1e-3", [SRV], "the server Adamax lr 1e-2 (App. A)"),
    M("fedsparse.line8-ascent", "coordinator/strategies/fedsparse.py",
      "Adamax(lr=self.server_v_lr * self._v_scale(rnd), maximize=True)",
      "Adamax(lr=self.server_v_lr * self._v_scale(rnd), maximize=False)", [SRV], "Adamax ascent on line 8"),
    M("fedsparse.prune-rule", "coordinator/strategies/fedsparse.py", "newly = alive[key] & (theta < prune_below)",
      "newly = alive[key] & (theta > prune_below)", [SRV], "prune theta < epsilon"),
    M("fedsparse.prune-epsilon", "coordinator/strategies/fedsparse.py", "prune_below: float = 0.1",
      "prune_below: float = 0.15", [SRV], "epsilon = 0.1"),
    M("fedsparse.best-unit", "coordinator/strategies/fedsparse.py", "[np.argmax(theta[alive[key]])]",
      "[np.argmin(theta[alive[key]])]", [SRV], "a layer keeps its most probable unit"),
    M("fedsparse.cascade-guard", "coordinator/strategies/fedsparse.py",
      "tau = gates.softplus(v[n].astype(np.float64)) - (before[n] - norms(n))",
      "tau = gates.softplus(v[n].astype(np.float64)) + (before[n] - norms(n))", [SRV], "the cascade guard"),
    M("fedsparse.zero-dead-first", "coordinator/strategies/fedsparse.py",
      "    kill(alive)\n    for key in gated:", "    for key in gated:", [SRV],
      "dead rows zeroed before the prune (moments must not revive them)"),
    # ------------------------------------------------------------------ FedMix server (Eq. 8, line 8, Alg. 2)
    M("fedmix.eq8-q", "coordinator/strategies/fedmix.py", "wgt = q[k] * n  # Eq. 8 numerator, p(s)",
      "wgt = n  # Eq. 8 numerator, p(s)", [SRV], "q(z=k|s) in Eq. 8"),
    M("fedmix.eq8-n", "coordinator/strategies/fedmix.py", "wgt = q[k] * n  # Eq. 8 numerator, p(s)",
      "wgt = q[k]  # Eq. 8 numerator, p(s)", [SRV], "N_s in Eq. 8"),
    M("fedmix.delta-sign", "coordinator/strategies/fedmix.py",
      "delta[t] = state.weights[t] - acc.num[t] / acc.den[k]", "delta[t] = acc.num[t] / acc.den[k] - state.weights[t]",
      [SRV], "Delta = old - new"),
    M("fedmix.entropy-sign", "coordinator/strategies/fedmix.py",
      '- acc.phi / acc.total_n - self.entropy_weight * gh  # line 8', '- acc.phi / acc.total_n + self.entropy_weight * gh  # line 8',
      [SRV], "ascent on the marginal entropy"),
    M("fedmix.entropy-grad", "coordinator/strategies/fedmix.py",
      "g = -py[:, None] * q * (logm[None, :] - (q * logm[None, :]).sum(1, keepdims=True))",
      "g = -py[:, None] * q * logm[None, :]", [SRV], "dH/dphi through the softmax"),
    M("fedmix.entropy-py", "coordinator/strategies/fedmix.py", "_, gh = entropy_grad(state.weights[\"phi\"], np.full(self.C, 1.0 / self.C))\n            delta",
      "_, gh = entropy_grad(state.weights[\"phi\"], np.full(self.C, 1.0))\n            delta", [SRV], "p(y) uniform sums to 1"),
    M("fedmix.phi-mean", "coordinator/strategies/fedmix.py", "acc.phi += n * report.extras[\"phi\"].astype(np.float64)",
      "acc.phi += report.extras[\"phi\"].astype(np.float64)", [SRV], "phi averaged by N_s / N"),
    M("fedmix.adam-descent", "coordinator/strategies/fedmix.py", "adam = Adam(lr=self.server_lr)\n            adam.load",
      "adam = Adam(lr=self.server_lr, maximize=True)\n            adam.load", [SRV], "Adam descends on Delta"),
    M("fedmix.alg2-hysteresis", "coordinator/strategies/fedmix.py", "if q[k] >= 0.9 * eta / self.K]",
      "if q[k] >= eta / self.K]", [SRV], "the server's 0.9 eta / K"),
    M("fedmix.server-fallback", "coordinator/strategies/fedmix.py", "return keep or [int(np.argmax(q))]",
      "return keep or [int(np.argmin(q))]", [SRV], "nothing passes: the most probable expert"),
    M("fedmix.unused-expert", "coordinator/strategies/fedmix.py",
      "            if acc.den[k] <= 0:\n                continue", "            if acc.den[k] < 0:\n                continue",
      [SRV], "an expert no device used is not stepped"),
    # ------------------------------------------------------------------ FedMix x FedSparse server and client
    M("fedmix_sparse.eq8-weight", "coordinator/strategies/fedmix_sparse.py", "G.scatter_add(idx, name, acc.num[t], wgt * diff)",
      "G.scatter_add(idx, name, acc.num[t], n * diff)", [SRV], "Eq. 8 weights on the masked differences"),
    M("fedmix_sparse.mask", "coordinator/strategies/fedmix_sparse.py", "                    diff[~m] = 0.0  # z_s",
      "                    pass  # z_s", [SRV], "z_s masks the difference"),
    M("fedmix_sparse.step-sign", "coordinator/strategies/fedmix_sparse.py", "step = {f\"e{k}.{n}\": -acc.num",
      "step = {f\"e{k}.{n}\": acc.num", [SRV], "Adam ascent on g_k"),
    M("fedmix_sparse.v-ascent", "coordinator/strategies/fedmix_sparse.py", "vopt = Adamax(lr=self.server_v_lr, maximize=True)",
      "vopt = Adamax(lr=self.server_v_lr, maximize=False)", [SRV], "Adamax ascent on the thresholds"),
    M("fedmix_sparse.v-grad-sign", "coordinator/strategies/fedmix_sparse.py", "[idx.rows(f\"fc{i}.bias\")] += threshold_grad(",
      "[idx.rows(f\"fc{i}.bias\")] -= threshold_grad(", [SRV], "line 8 per expert"),
    M("fedmix_sparse.v-grad-unweighted", "coordinator/strategies/fedmix_sparse.py",
      "[idx.rows(f\"fc{i}.bias\")] += threshold_grad(", "[idx.rows(f\"fc{i}.bias\")] += wgt * threshold_grad(", [SRV],
      "line 8 per expert is unweighted (docs/fedmix_sparse.md, choice 2)"),
    M("fedmix_sparse.entropy-sign", "coordinator/strategies/fedmix_sparse.py",
      "- acc.phi / acc.total_n - self.entropy_weight * gh", "- acc.phi / acc.total_n + self.entropy_weight * gh",
      [SRV], "phi: ascent on the marginal entropy"),
    M("fedmix_sparse.prune-epsilon", "coordinator/strategies/fedmix_sparse.py", "prune_below: float = 0.1",
      "prune_below: float = 0.15", [SRV], "epsilon = 0.1 per expert"),
    M("fedmix_sparse.client-units", "edge/algorithms/fedmix_sparse.py",
      "return np.asarray(self.ctx.plan.weights[f\"e{k}.units\"], np.int64)", "return np.arange(len(self.ctx.plan.weights[f\"e{k}.units\"]))",
      [CLI], "a sliced expert's gate coordinates"),
    M("fedmix_sparse.client-v-lr", "edge/algorithms/fedmix_sparse.py", "self.vopt = Adamax(lr=self.hp.v_lr)",
      "self.vopt = Adamax(lr=self.hp.lr)", [CLI], "Adamax's lr on v"),
    M("fedmix_sparse.client-mask-pi", "edge/algorithms/fedmix_sparse.py", "z = gates.sample_mask(pi, rng_z)",
      "z = gates.sample_mask(1 - pi, rng_z)", [CLI], "the mask is drawn with the unit's pi"),
    # ================================================================== issue 28: the gap classes, per area
    # Each was let live by the suite before issue 28 (its maths and area tests, `-m "not slow"`) and is killed
    # by a reference test of tests/test_gaps_<area>.py.
    # ------------------------------------------------------------------ FLoPS (tests/test_gaps_flops.py)
    M("flops.client-la-lr", "edge/algorithms/flops.py", "sgd(self.la, {k: g[k] for k in self.la}, self.hp.la_lr)",
      "sgd(self.la, {k: g[k] for k in self.la}, self.hp.lr)", [GAP_FLOPS], "log_alpha steps with la_lr (gates 10x slower)"),
    M("flops.client-no-exact-density", "edge/algorithms/flops.py", "if self.hp.prune:", "if False:", [GAP_FLOPS],
      "the client's exact-density step before sending"),
    M("flops.client-lambda", "edge/algorithms/flops.py", '"lam": np.float32(self.hp.lam)', '"lam": np.float32(0.0)',
      [GAP_FLOPS], "the plan's lambda fed to the Lagrangian"),
    M("flops.client-steps-off-by-one", "edge/algorithms/flops.py", "if self.hp.steps and self.done >= self.hp.steps:",
      "if self.hp.steps and self.done > self.hp.steps:", [GAP_FLOPS], "FLoPS takes exactly `steps` local steps"),
    M("flops.keep-count-truncates", "edge/flops.py", "int(round(rho * n))", "int(rho * n)", [GAP_FLOPS],
      "k = round(rho n), not its floor"),
    M("flops.top-k-ties-high", "edge/flops.py",
      'order = np.argsort(-np.asarray(score, np.float64), kind="stable")[:k]',
      'order = (len(score) - 1 - np.argsort(-np.asarray(score, np.float64)[::-1], kind="stable"))[:k]',
      [GAP_FLOPS], "top-k ties go to the lower index"),
    M("flops.rest-mean-over-all", "edge/flops.py", "mean = float(log_alpha[rest].astype(np.float64).mean())",
      "mean = float(log_alpha.astype(np.float64).mean())", [GAP_FLOPS], "the message's mean is over the others only"),
    M("flops.server-lambda-old-phi", "coordinator/strategies/flops.py",
      "lam = F.dual_step(self.lam(state), F.constraint(la, self.rho), self.lam_lr)",
      'lam = F.dual_step(self.lam(state), F.constraint(state.weights["log_alpha"], self.rho), self.lam_lr)',
      [GAP_FLOPS], "lambda steps at the phi just committed"),
    M("flops.server-epoch-boundary", "coordinator/strategies/flops.py",
      "epoch = 0 if round_ == 0 else (round_ - 1) // self.steps_per_epoch + 1",
      "epoch = 0 if round_ == 0 else round_ // self.steps_per_epoch + 1", [GAP_FLOPS], "exchange r is in epoch (r-1)//spe + 1"),
    M("flops.client-noise-restarts", "edge/algorithms/flops.py", 'inputs[f"u.{k}"] = F.noise(self.rng_u, s)',
      'inputs[f"u.{k}"] = F.noise(self.ctx.rng(1), s)', [GAP_FLOPS], "fresh gate noise each step (stream 1 continues)"),
    M("flops.server-prune-flag-round", "coordinator/strategies/flops.py", "prune=self.pruning(state.round + 1), steps=0)",
      "prune=self.pruning(state.round), steps=0)", [GAP_FLOPS], "the plan of round r + 1 prunes from prune_start on"),
    M("flops.server-one-step", "coordinator/strategies/flops.py", "rho=self.rho, prune=False, steps=1)",
      "rho=self.rho, prune=False, steps=0)", [GAP_FLOPS], "FLoPS's plan asks for one local step"),
    # ------------------------------------------------------------------ SFVI (tests/test_gaps_sfvi.py)
    M("sfvi.avg-sigma-mean-of-logs", "coordinator/strategies/sfvi.py",
      'sig = np.mean([np.exp(e["qG.s"]) for e in etas], axis=0)', 'sig = np.exp(np.mean([e["qG.s"] for e in etas], axis=0))',
      [GAP_SFVI], "the diagonal barycenter averages sigma, not log sigma"),
    M("sfvi.avg-theta-summed", "coordinator/strategies/sfvi.py", "new[k] = acc.sums[k] / acc.count",
      "new[k] = acc.sums[k]", [GAP_SFVI], "SFVI-Avg's theta is the participants' mean"),
    M("sfvi.avg-N-precedence", "coordinator/strategies/sfvi.py", 'known = dict(state.meta.get("seen", {})) | self._fleet',
      'known = self._fleet | dict(state.meta.get("seen", {}))', [GAP_SFVI], "N: the registry's declared counts first"),
    M("sfvi.avg-client-short-batch", "edge/algorithms/sfvi.py", "len(self.ctx.x) * self.scale / len(idx)",
      "len(self.ctx.x) * self.scale / self.hp.batch_size", [GAP_SFVI], "rows weigh N / |B| for the batch as it is"),
    M("sfvi.avg-client-klw", "edge/algorithms/sfvi.py", '"klw": np.float32(self.scale)}', '"klw": np.float32(1.0)}',
      [GAP_SFVI], "the local prior and entropy weigh N / N_j"),
    M("sfvi.avg-client-l0-sign", "edge/algorithms/sfvi.py", "-g[k].astype(np.float64) + g0[k] if k in g else g0[k]",
      "-g[k].astype(np.float64) - g0[k] if k in g else g0[k]", [GAP_SFVI], "L_0's gradient is added (ascent)"),
    M("sfvi.avg-client-one-stream", "edge/algorithms/sfvi.py",
      "eps_L = randn.normal(self.salt, avg_stream(rnd, self.k, 1), m.n_L)",
      "eps_L = randn.normal(self.salt, avg_stream(rnd, self.k, 0), m.n_L)", [GAP_SFVI], "eps_L and eps_G independent"),
    M("sfvi.avg-client-same-noise", "edge/algorithms/sfvi.py", "self.k += 1", "self.k += 0", [GAP_SFVI],
      "fresh noise per local step"),
    M("sfvi.client-klw-epochs", "edge/algorithms/sfvi.py", '"klw": np.float32(1.0 / self.batches)}',
      '"klw": np.float32(1.0 / math.ceil(n / self.hp.batch_size))}', [GAP_SFVI],
      "the local term weighs 1 / (epochs x batches)"),
    M("sfvi.client-elbo-sign", "edge/algorithms/sfvi.py", "self.elbo -= loss", "self.elbo += loss", [GAP_SFVI],
      "the ELBO metric is minus the loss"),
    M("sfvi.client-local-descent", "edge/algorithms/sfvi.py", "self.adam.maximize = True", "self.adam.maximize = False",
      [GAP_SFVI], "eta_Lj ascends the ELBO"),
    M("sfvi.server-elbo-unscaled", "coordinator/strategies/sfvi.py", "return g, scale * acc.elbo + l0, J",
      "return g, acc.elbo + l0, J", [GAP_SFVI], "the ELBO estimate is scaled by J / |S|"),
    M("sfvi.server-silo-size", "coordinator/strategies/sfvi.py",
      "return int(self._fleet.get(report.device_id) or report.n_samples)", "return int(report.n_samples)",
      [GAP_SFVI], "N_j is the declared count"),
    M("sfvi.bnn-mu-prior-square", "edge/vi.py", "gZ = np.concatenate([-mu / self.mu_sd ** 2, -e2 / self.sigma_sd ** 2 + 1.0])",
      "gZ = np.concatenate([-mu / self.mu_sd, -e2 / self.sigma_sd ** 2 + 1.0])", [GAP_SFVI], "mu_sd^2 (hidden at 1)"),
    M("sfvi.bnn-sigma-prior-logsd", "edge/vi.py",
      "val += float((math.log(2.0) - 0.5 * e2 / self.sigma_sd ** 2 - math.log(self.sigma_sd)",
      "val += float((math.log(2.0) - 0.5 * e2 / self.sigma_sd ** 2", [GAP_SFVI], "log sigma_sd (hidden at 1)"),
    M("sfvi.bnn-head-prior-logsd", TORCH_OBJ + "sfvi.py",
      "lp_head = -0.5 * (head / m.head_sd) ** 2 - math.log(m.head_sd) - HALF_LOG2PI",
      "lp_head = -0.5 * (head / m.head_sd) ** 2 - HALF_LOG2PI", [GAP_SFVI], "the local head's log sd (hidden at 1)"),
    # ------------------------------------------------------------------ codec (tests/test_gaps_codec.py)
    M("wire.chunk-over-1mib", "edge/protocol/sizes.py", "DEFAULT_CHUNK_BYTES = 1020 * 1024",
      "DEFAULT_CHUNK_BYTES = 1024 * 1024", ["tests/test_wire.py"], "a default chunk that no longer fits a 1 MiB packet"),
    M("codec.minority-tie", "edge/protocol/codec.py", "if K < s.n - K or (K == s.n - K and not s.inactive):",
      "if K < s.n - K:", [GAP_CODEC], "k = n / 2: golomb and enum carry the active rows"),
    M("codec.index16-boundary", "edge/protocol/codec.py", 'elif kind == "index16" and s.n <= 65536:',
      'elif kind == "index16" and s.n < 65536:', [GAP_CODEC], "index16 codes n = 65536"),
    M("codec.enum-boundary", "edge/protocol/codec.py", 'elif kind == "enum" and K <= ENUM_MAX_K:',
      'elif kind == "enum" and K < ENUM_MAX_K:', [GAP_CODEC], "enum codes K = 64"),
    M("codec.golomb-estimate-floor", "edge/protocol/codec.py",
      "return max(1, (n * _LN2_Q31 + K * 2**30) // (K * 2**31))", "return max(1, (n * _LN2_Q31) // (K * 2**31))",
      [GAP_CODEC], "M0 = round(n ln2 / K), not its floor"),
    M("codec.bf16-ties-away", "edge/protocol/codec.py", "add = np.uint32(0x7FFF) + ((u >> 16) & 1)",
      "add = np.uint32(0x8000) + 0 * ((u >> 16) & 1)", [GAP_CODEC], "bf16 nearest: ties to even"),
    M("codec.q8-scale-128", "edge/protocol/codec.py", "s = _scale_up(a / 127.0)", "s = _scale_up(a / 128.0)",
      [GAP_CODEC], "the int8 scale puts max|x| at 127"),
    M("codec.bf16-saturate", "edge/protocol/codec.py", "r = np.minimum(r, 0x7F7F) |", "r = np.minimum(r, 0x7F80) |",
      [GAP_CODEC], "bf16 saturates at the largest finite value"),
    M("codec.f2-no-saturate", "edge/protocol/codec.py", 'return np.clip(x, -_F16_MAX, _F16_MAX).astype("<f2").tobytes()',
      'return x.astype("<f2").tobytes()', [GAP_CODEC], "f2 saturates at +-65504 instead of overflowing"),
    M("codec.downlink-shape", "edge/protocol/downlink.py",
      "return held is not None and name in held and tuple(held[name].shape) == tuple(shape)",
      "return held is not None and name in held", [GAP_CODEC], "a tensor whose shape changed goes absolute"),
    # ------------------------------------------------------------------ admission (tests/test_gaps_admission.py)
    M("admission.local-steps-floor", "coordinator/admission.py", "return e * -(-n // b)", "return e * max(1, n // b)",
      [GAP_ADMIT], "a short last batch is a step"),
    M("admission.refuse-edge", "coordinator/admission.py",
      "        if not rules.clip and norm > rules.refuse_factor * bound:",
      "        if not rules.clip and norm >= rules.refuse_factor * bound:", [GAP_ADMIT], "refused only beyond refuse_factor x"),
    M("admission.weight-cap-floor", "coordinator/admission.py",
      "return max(1, math.ceil(rules.max_weight_factor * float(np.median(ns))))",
      "return max(1, int(rules.max_weight_factor * float(np.median(ns))))", [GAP_ADMIT], "the cap is a ceiling"),
    M("admission.weight-cap-zeros", "coordinator/admission.py", "ns = [int(n) for n in declared if n and n > 0]",
      "ns = [int(n) for n in declared]", [GAP_ADMIT], "undeclared counts are not in the median"),
    M("admission.window-tail", "coordinator/admission.py",
      'pool = (list(history.get("recent_norms", [])) + per_step)[-NORM_WINDOW:]',
      'pool = (list(history.get("recent_norms", [])) + per_step)[:NORM_WINDOW]', [GAP_ADMIT],
      "a small round is pooled with the latest norms"),
    M("admission.clip-factor-inverted", "coordinator/admission.py", "return bound * rules.clip_factor / rules.norm_factor",
      "return bound * rules.norm_factor / rules.clip_factor", [GAP_ADMIT], "clip at clip_factor / norm_factor of the bound"),
    M("admission.screen-margin-edge", "coordinator/rounds.py", "if acc_a >= acc_b + SCREEN_MARGIN:",
      "if acc_a > acc_b + SCREEN_MARGIN:", [GAP_ADMIT], "a margin of exactly SCREEN_MARGIN is clearly better"),
    M("admission.screen-min-gain-edge", "coordinator/rounds.py",
      "    if gain_a < material:", "    if gain_a <= material:", [GAP_ADMIT],
      "a step of exactly SCREEN_MIN_GAIN of the first loss may decide"),
    M("admission.screen-rising", "coordinator/rounds.py", "if gain_b < 0:", "if gain_b <= 0:", [GAP_ADMIT],
      "a flat loss is not a rising one"),
    M("admission.screen-share-edge", "coordinator/rounds.py",
      "return acc_a >= acc_b - SCREEN_MARGIN and gain_b <= (1 - share) * gain_a",
      "return acc_a >= acc_b - SCREEN_MARGIN and gain_b < (1 - share) * gain_a", [GAP_ADMIT], "(1 - share) inclusive"),
    # ------------------------------------------------------------------ server steps (tests/test_gaps_server.py)
    M("server.median-upper", "coordinator/strategies/fedavg.py", "c = np.median(stack, axis=0)",
      "c = np.sort(stack, axis=0)[len(acc.kept) // 2]", [GAP_SERVER], "an even count's median is between the two"),
    M("server.trim-rounds", "coordinator/strategies/fedavg.py", "cut = int(self.trim * len(acc.kept))",
      "cut = int(round(self.trim * len(acc.kept)))", [GAP_SERVER], "the trim count rounds down"),
    M("server.fediter-uniform", "coordinator/strategies/fediter_ht.py",
      'w = float(report.n_samples) if self.weighting == "samples" else 1.0', "w = float(report.n_samples)",
      [GAP_SERVER], "uniform weighting weighs every report 1"),
    M("server.fedavg-prune-count", "coordinator/strategies/fediter_ht.py",
      '{"theta": (acc.theta / acc.total).astype(np.float32)}', '{"theta": (acc.theta / acc.count).astype(np.float32)}',
      [GAP_SERVER], "FedAvg-prune's mean divides by the weights' sum"),
    M("server.fedl1-threshold-edge", "coordinator/strategies/fedl1.py", "keep = a & (norms > self.l1)",
      "keep = a & (norms >= self.l1)", [GAP_SERVER], "a group at norm lambda is pruned"),
    M("server.fedl1-weakest", "coordinator/strategies/fedl1.py", "keep[np.argmax(np.where(a, norms, -1))] = True",
      "keep[np.argmin(np.where(a, norms, np.inf))] = True", [GAP_SERVER], "a layer keeps its strongest unit"),
    M("server.fediter-client-end-only", "edge/algorithms/fediter_ht.py",
      "if self.counts is not None:\n            flat = threshold(", "if False:\n            flat = threshold(",
      [GAP_SERVER], "FedIter-HT thresholds after every local step"),
    # ------------------------------------------------------------------ FedSparse and its baseline FedL1
    M("fedsparse.client-noise-restarts", "edge/algorithms/fedsparse.py",
      'inputs[f"u{i}"] = gates.noise(self.rng_u, len(p[f"{L}.v"]))',
      'inputs[f"u{i}"] = gates.noise(self.ctx.rng(1), len(p[f"{L}.v"]))', [GAP_SPARSE], "stream 1 continues across steps"),
    M("fedsparse.client-mask-stream", "edge/algorithms/fedsparse.py", "rng_z = self.ctx.rng(2)", "rng_z = self.ctx.rng(1)",
      [GAP_SPARSE], "z from its own stream"),
    M("fedsparse.client-noise-stream", "edge/algorithms/fedsparse.py", "self.rng_u = self.ctx.rng(1)",
      "self.rng_u = self.ctx.rng(0)", [GAP_SPARSE], "u not from the batch order's stream"),
    M("fedsparse.client-kept-metric", "edge/algorithms/fedsparse.py", "kept.append(z.mean())", "kept.append(pi_mean := 0.5)",
      [GAP_SPARSE], "kept is the mask's mean"),
    M("fedsparse.fedl1-client-post-step", "edge/algorithms/fedl1.py", "n = subnet.group_norms(g, pre)",
      "n = subnet.group_norms(g, w)", [GAP_SERVER], "the lasso gradient at the pre-step weights"),
    M("fedsparse.fedl1-client-no-lr", "edge/algorithms/fedl1.py",
      "scale = np.where(n > 0, lr * lam / np.maximum(n, 1e-12), 0.0)", "scale = np.where(n > 0, lam / np.maximum(n, 1e-12), 0.0)",
      [GAP_SERVER], "the lasso step has the lr"),
    # ------------------------------------------------------------------ FedMix, issue 28 gaps (tests/test_gaps_fedmix.py)
    M("fedmix.server-qzs-forgets-absent", "coordinator/strategies/fedmix.py",
      'meta["qzs"] = dict(meta.get("qzs", {})) | acc.q', 'meta["qzs"] = dict(acc.q)', [GAP_FEDMIX],
      "a device absent from a round keeps its stored q(z|s) (Alg. 2 selection, metrics, global model)"),
    M("fedmix.server-gate-lr-ignored", "coordinator/strategies/fedmix.py",
      "gate_lr=self.gate_lr if self.gate_lr is not None else self.lr", "gate_lr=self.lr", [GAP_FEDMIX],
      "the server's gate_lr travels in the plan"),
    M("fedmix.metric-experts-per-device", "coordinator/strategies/fedmix.py",
      'out["experts_per_device"] = float((q > 0).sum(1).mean())', 'out["experts_per_device"] = float((q > 0).sum(1).max())',
      [GAP_FEDMIX], "experts per device is the mean count"),
    M("fedmix.metric-qzy-entropy", "coordinator/strategies/fedmix.py",
      'out["qzy_entropy"] = float(-(qzy * np.log(qzy)).sum(1).mean())', 'out["qzy_entropy"] = float(-(qzy * np.log(qzy)).mean())',
      [GAP_FEDMIX], "q_phi(z|y)'s entropy per row, averaged"),
    M("fedmix.global-model-most-used", "coordinator/strategies/fedmix.py", "k = int(np.argmax(use))",
      "k = int(np.argmin(use))", [GAP_FEDMIX], "the global model is the most used expert"),
    M("fedmix.client-pi-init-ignored", "edge/algorithms/fedmix.py",
      'st["pi"] = np.asarray(plan.weights["pi_init"], np.float64)', 'st["pi"] = np.asarray(st["pi"], np.float64)',
      [GAP_FEDMIX], "a server restart's pi_init replaces the stored pi"),
    M("fedmix.client-experts-metric", "edge/algorithms/fedmix.py", '{"experts": len(keep)}',
      '{"experts": len(self.held)}', [GAP_FEDMIX], "the experts metric counts the kept experts"),
    M("fedmix.predict-pooling-uniform", "edge/algorithms/fedmix.py",
      'qs = restricted(np.asarray(st["qs"], np.float64), act)', 'qs = restricted(np.ones(len(st["qs"])), act)',
      [GAP_FEDMIX], "a known device's prediction pools Eq. 9's features with its stored q(z|s)"),
    M("fedmix.predict-gate-uniform", "edge/algorithms/fedmix.py",
      'np.exp(aux["lg"].astype(np.float64))[:, :, None]',
      'np.exp(0 * aux["lg"].astype(np.float64))[:, :, None] / aux["lg"].shape[1]',
      [GAP_FEDMIX], "a known device's prediction weighs the experts by its gate"),
    # ------------------------------------------------------------------ FedMix paths, issue 28 (tests/test_gaps_fedmix_paths.py)
    # restart remedy (server), docs/fedmix.md "Presets and remedies"
    M("fedmix.restart-every-off-by-one", "coordinator/strategies/fedmix.py",
      "if state.round % self.restart_every or len(acc.loss) < 2:",
      "if (state.round + 1) % self.restart_every or len(acc.loss) < 2:", [GAP_PATHS],
      "the remedy looks every restart_every-th committed round"),
    M("fedmix.restart-absent-loss-zero", "coordinator/strategies/fedmix.py",
      "mean = {k: float(np.mean([acc.loss[d] for d in by[k] if d in acc.loss]))",
      "mean = {k: float(np.mean([acc.loss.get(d, 0.0) for d in by[k]]))", [GAP_PATHS],
      "an expert's mean loss is over the devices that reported this round"),
    M("fedmix.restart-victim-tie-sign", "coordinator/strategies/fedmix.py",
      "key=lambda k: (len(by[k]), -mean.get(k, np.inf)))", "key=lambda k: (len(by[k]), mean.get(k, np.inf)))",
      [GAP_PATHS], "equally least used: the worse fitting expert is overwritten"),
    M("fedmix.restart-twice-inclusive", "coordinator/strategies/fedmix.py",
      "len(by[worst]) < 2 * max(1, len(by[victim]))", "len(by[worst]) <= 2 * max(1, len(by[victim]))",
      [GAP_PATHS], "exactly twice the devices of the least used expert fires"),
    M("fedmix.restart-unused-victim-floor", "coordinator/strategies/fedmix.py", "2 * max(1, len(by[victim]))",
      "2 * len(by[victim])", [GAP_PATHS], "an unused victim still needs a crowded expert of 2 devices"),
    M("fedmix.restart-median-strict", "coordinator/strategies/fedmix.py",
      "mean.get(worst, 0.0) <= float(np.median(", "mean.get(worst, 0.0) < float(np.median(", [GAP_PATHS],
      "a crowded expert at the median loss is left alone"),
    M("fedmix.restart-half-rounds-up", "coordinator/strategies/fedmix.py",
      "moved = set(ranked[: len(ranked) // 2])", "moved = set(ranked[: (len(ranked) + 1) // 2])", [GAP_PATHS],
      "the floor of half the crowded expert's devices move to the copy"),
    M("fedmix.restart-rank-ascending", "coordinator/strategies/fedmix.py",
      "key=lambda d: (-acc.loss.get(d, 0.0), d)", "key=lambda d: (acc.loss.get(d, 0.0), d)", [GAP_PATHS],
      "the worst fitted devices move"),
    M("fedmix.restart-moments-self-copy", "coordinator/strategies/fedmix.py",
      'state.opt[f"adam/{mv}/e{victim}.{n}"] = src.copy()', 'state.opt[f"adam/{mv}/e{worst}.{n}"] = src.copy()',
      [GAP_PATHS], "the copy takes the crowded expert's Adam moments"),
    M("fedmix.restart-pi-rest-constant", "coordinator/strategies/fedmix.py",
      "pi = np.full(self.K, 0.1 / (self.K - 1))", "pi = np.full(self.K, 0.1 / self.K)", [GAP_PATHS],
      "pi_init spreads 0.1 over the other K - 1 experts"),
    M("fedmix.restart-victim-devices-kept", "coordinator/strategies/fedmix.py",
      "for d in by[worst] + by[victim]:", "for d in by[worst]:", [GAP_PATHS],
      "the overwritten expert's devices restart from a uniform pi"),
    M("fedmix.restart-first-look-fires", "coordinator/strategies/fedmix.py",
      'stable = state.meta.get("owners") == owner', 'stable = state.meta.get("owners") in (None, owner)',
      [GAP_PATHS], "the first look only records the owners"),
    M("fedmix.restart-on-old-state", "coordinator/strategies/fedmix.py", "self._restart(st, acc)",
      "self._restart(state, acc)", [GAP_PATHS], "the remedy acts on the committed (stepped) state"),
    M("fedmix.restart-reset-kept", "coordinator/strategies/fedmix.py", 'meta.pop("reset", None)',
      'meta.get("reset", None)', [GAP_PATHS], "pi_init is one-off: the next commit drops it"),
    # a new device, clustering variant, no labels (docs/fedmix.md "A new device")
    M("fedmix.new-device-unnormalised", "edge/algorithms/fedmix.py", "    return restricted(q, held)\n",
      "    return q\n", [GAP_PATHS], "q(z|s*) is a distribution over the held experts"),
    M("fedmix.new-device-K-count", "edge/algorithms/fedmix.py", "else max(held) + 1", "else len(held)",
      [GAP_PATHS], "K without phi is the largest held id + 1"),
    M("fedmix.new-device-pi-over-held", "edge/algorithms/fedmix.py", '"pi": np.full(self.K, 1.0 / self.K), "qs"',
      '"pi": np.full(self.K, 1.0 / len(self.held)), "qs"', [GAP_PATHS], "a fresh pi is uniform over the K experts"),
    # FedMix x FedSparse: experts held but inactive on the device
    M("fedmix_sparse.client-masks-every-held", "edge/algorithms/fedmix_sparse.py", "for k in keep:",
      "for k in self.held:", [GAP_PATHS], "z is drawn (stream 2) for the kept experts only"),
    M("fedmix_sparse.client-noise-restarts", "edge/algorithms/fedmix_sparse.py",
      'out[f"u{j}_{i}"] = gates.noise(self.rng_u, len(p[f"e{k}.fc{i}.v"]))',
      'out[f"u{j}_{i}"] = gates.noise(self.ctx.rng(1), len(p[f"e{k}.fc{i}.v"]))', [GAP_PATHS],
      "stream 1 continues across steps"),
    M("fedmix_sparse.client-noise-slot-order", "edge/algorithms/fedmix_sparse.py",
      "for k in self.held:  # noise for every held expert", "for k in self.held[::-1]:  # noise for every held expert",
      [GAP_PATHS], "noise drawn in slot order, every held expert"),
    M("fedmix_sparse.eval-norm-constant", "edge/algorithms/fedmix_sparse.py",
      'out[f"norm{j}_{i}"] = np.full(n, 1e6, np.float32)', 'out[f"norm{j}_{i}"] = np.full(n, 1.0, np.float32)',
      [GAP_PATHS], "prediction switches every surviving unit on"),
    # a person's module as the experts
    M("mixture.module-features-not-detached", TORCH_OBJ + "mixture.py",
      "cp = {f\"c.{n}\": named[f\"c{j}_{n.replace('.', '_')}\"] for n in self.copies}",
      "cp = {f\"c.{n}\": p[f\"s{j}.{n}\"] for n in self.copies}", [GAP_PATHS],
      "a module's gate features are detached (stop-gradient copies)"),
    M("mixture.module-slot-prefix", TORCH_OBJ + "mixture.py",
      'out, _, _ = self.user.run(p, x, w=w, prefix=f"s{j}.")', 'out, _, _ = self.user.run(p, x, w=w, prefix="s0.")',
      [GAP_PATHS], "each slot runs its own copy of the module"),
    M("fedmix.module-gate-width-axis", "edge/algorithms/fedmix.py", "[f\"{spec['classifier']}.weight\"][1])",
      "[f\"{spec['classifier']}.weight\"][0])", [GAP_PATHS], "the gate's width is the classifier's input width"),
    M("fedmix.module-copies-no-biases", "edge/algorithms/fedmix.py",
      'if n.rsplit(".", 1)[0] != spec["classifier"]]',
      'if n.rsplit(".", 1)[0] != spec["classifier"] and not n.endswith(".bias")]', [GAP_PATHS],
      "the copies are every parameter but the classifier's"),
    M("fedmix.gate-copies-stale", "edge/algorithms/fedmix.py",
      "inputs[f\"c{j}_{n.replace('.', '_')}\"] = self.params[f\"e{k}.{n}\"]",
      "inputs[f\"c{j}_{n.replace('.', '_')}\"] = self.ctx.plan.weights[f\"e{k}.{n}\"]", [GAP_PATHS],
      "the stop-gradient copies are the current weights"),
    # the float32 underflow drop
    M("fedmix.underflow-float64", "edge/algorithms/fedmix.py",
      "keep = [k for k in keep if np.float32(restricted(q, keep)[k]) > 0]",
      "keep = [k for k in keep if restricted(q, keep)[k] > 0]", [GAP_PATHS], "underflow judged in float32"),
    M("fedmix.underflow-unrestricted", "edge/algorithms/fedmix.py",
      "keep = [k for k in keep if np.float32(restricted(q, keep)[k]) > 0]",
      "keep = [k for k in keep if np.float32(q[k]) > 0]", [GAP_PATHS], "underflow of the renormalised q'"),
    M("fedmix.underflow-inclusive", "edge/algorithms/fedmix.py",
      "keep = [k for k in keep if np.float32(restricted(q, keep)[k]) > 0]",
      "keep = [k for k in keep if np.float32(restricted(q, keep)[k]) >= 0]", [GAP_PATHS], "a zero weight is dropped"),
    # the gate reset when A changes shape
    M("fedmix.gate-reset-K-only", "edge/algorithms/fedmix.py", 'if st is None or st["A"].shape != (H, self.K):',
      'if st is None or st["A"].shape[1] != self.K:', [GAP_PATHS], "a gate of another H is reset"),
    M("fedmix.gate-reset-H-only", "edge/algorithms/fedmix.py", 'if st is None or st["A"].shape != (H, self.K):',
      'if st is None or st["A"].shape[0] != H:', [GAP_PATHS], "a gate of another K is reset"),
    M("fedmix.gate-reset-drops-pi-init", "edge/algorithms/fedmix.py", '        if "pi_init" in plan.weights:',
      '        elif "pi_init" in plan.weights:', [GAP_PATHS], "a reset gate still takes the server's pi_init"),
    # the product fix of this issue: a device restarted by the remedy is sent every expert (Alg. 2 would not
    # send it the copy its pi_init points to when eta > 0)
    M("fedmix.restart-reset-all-experts", "coordinator/strategies/fedmix.py",
      'if q is None or device_id in state.meta.get("reset", {}):', "if q is None:", [GAP_PATHS],
      "a restarted device is sent every expert"),
    # ---------------------------------- gaps that benchmarks/random_mutants.py found (seeds 0 and 1 of its draw)
    M("codec.support-rows-majority", "edge/protocol/codec.py", "    if len(rows) <= n - len(rows):",
      "    if len(rows) <= n + len(rows):", [GAP_CODEC], "a support given by its rows is kept by its majority"),
    M("codec.support-rows-repeats", "edge/protocol/codec.py",
      "rows[-1] >= n or np.any(np.diff(rows) <= 0)):\n        raise ValueError",
      "rows[-1] >= n or np.any(np.diff(rows) < 0)):\n        raise ValueError", [GAP_CODEC], "a repeated row passes"),
    M("codec.golomb-unary-past-n", "edge/protocol/codec.py", "if int(z[-1]) > n - 1:", "if int(z[-1]) > n:",
      [GAP_CODEC], "M = 1: a row at n is read"),
    M("codec.golomb-remainders-cut", "edge/protocol/codec.py", "if pos + e + K > nbits:", "if pos + K > nbits:",
      [GAP_CODEC], "a stream cut in its remainders escapes as a numpy error"),
    M("codec.golomb-M-at-n", "edge/protocol/codec.py", "if 1 <= m <= max(1, n)}", "if 1 <= m < max(1, n)}",
      [GAP_CODEC], "M = n is never a candidate (n = 1 has none)"),
    M("codec.enum-rank-at-total", "edge/protocol/codec.py", "if rank >= total:", "if rank > total:", [GAP_CODEC],
      "rank C(n, K) is decoded"),
    M("admission.range-low-exclusive", "coordinator/admission.py", "(-bound <= float(a.min())",
      "(-bound < float(a.min())", [GAP_ADMIT], "a value at -max_abs_value is refused"),
    M("flops.rho-zero-accepted", "coordinator/strategies/flops.py", "if not 0 < self.rho <= 1",
      "if not 0 <= self.rho <= 1", [GAP_FLOPS], "rho = 0 is accepted"),
    M("fedsparse.server-v-lr-scale-inverted", "coordinator/strategies/fedsparse.py",
      "vopt = Adamax(lr=self.server_v_lr * self._v_scale(rnd)", "vopt = Adamax(lr=self.server_v_lr / self._v_scale(rnd)",
      ["tests/test_fedsparse.py::test_server_threshold_step_follows_the_annealed_temperature"],
      "the server's threshold rate divides by T_r / T"),
    M("sfvi.predict-unnormalised", "edge/algorithms/sfvi.py", "probs = probs + p / p.sum(1, keepdims=True)",
      "probs = probs + p", [GAP_SFVI], "the predictive sums exp(logits - max)"),
    M("sfvi.predict-sum", "edge/algorithms/sfvi.py", "return probs / max(samples, 1)", "return probs", [GAP_SFVI],
      "the predictive sums its draws"),
    M("sfvi.group-id-min", "edge/algorithms/sfvi.py", "g.max() >= m.groups", "g.min() >= m.groups", [GAP_SFVI],
      "a group id past the model's groups passes"),
    M("sfvi.avg-loss-adds-L0", "edge/algorithms/sfvi.py", "        return loss - l0\n",
      "        return loss + l0\n", [GAP_SFVI], "SFVI-Avg's reported loss adds the server term"),
    M("fedsparse.line8-T-of-last-round", "coordinator/strategies/fedsparse.py", "zs[L], self.T_at(state.round + 1))",
      "zs[L], self.T_at(state.round - 1))", ["tests/test_fedsparse.py::test_server_threshold_step_follows_the_annealed_temperature"],
      "line 8's gradient at an earlier round's temperature"),
    M("fedsparse.fedl1-lr-over-lambda", "edge/algorithms/fedl1.py", "lr * lam / np.maximum(n, 1e-12)",
      "lr / lam / np.maximum(n, 1e-12)", [GAP_SPARSE], "FedL1's group-lasso step divides by lambda"),
    M("fedsparse.fedl1-lasso-after-step", "edge/algorithms/fedl1.py",
      "(scale[:, None] * subnet.own_rows(g, pre, name))", "(scale[:, None] * subnet.own_rows(g, w, name))",
      [GAP_SPARSE], "the lasso's direction read after the cross-entropy step"),
    M("sfvi.evaluate-argmin", "edge/algorithms/sfvi.py", "x, **kw).argmax(1) == y))", "x, **kw).argmin(1) == y))",
      [GAP_SFVI], "the device's accuracy counts its least probable class"),
    M("admission.masked-norm-sum", "coordinator/admission.py", "v = v - w.astype(v.dtype, copy=False)",
      "v = v + w.astype(v.dtype, copy=False)", [GAP_ADMIT], "a row-masked report's norm adds the weights"),
    M("server.upload-keep-all-sampled", "coordinator/strategies/base.py", "if sample is not None and keep < 1.0:",
      "if sample is not None and keep <= 1.0:", [GAP_SERVER], "keeping every row still sends probabilities"),
    M("admission.screen-rise-needs-no-distance", "coordinator/rounds.py", "        return gain_a - gain_b >= material\n",
      "        return True\n", ["tests/test_poison.py::test_clearly_better_reads_a_step_as_progress", GAP_ADMIT],
      "a step that falls a hair where the other rises decides"),
    M("admission.screen-rise-reads-own-step", "coordinator/rounds.py", "        return gain_a - gain_b >= material\n",
      "        return gain_a >= material\n", ["tests/test_poison.py::test_clearly_better_reads_a_step_as_progress", GAP_ADMIT],
      "the 2026-11-26 rule: FedSparse's small honest round-1 step never decides"),
    M("admission.local-steps-zero-epochs", "coordinator/admission.py", "b <= 0 or e <= 0 or n <= 0:",
      "b <= 0 or e < 0 or n <= 0:", [GAP_ADMIT], "a plan of 0 epochs counts 0 steps (a bound of 0)"),
]

# Changes that cannot alter any result, so no test can kill them; listed so nobody adds them unknowingly.
EQUIVALENT: list[dict[str, str]] = [
    {"file": "coordinator/admission.py", "old": "if len(pool) < NORM_WINDOW:", "new": "if len(pool) <= NORM_WINDOW:",
     "why": "a round of exactly NORM_WINDOW norms topped up and cut to the last NORM_WINDOW is itself again"},
    {"file": "coordinator/strategies/fedsparse.py", "old": "theta < prune_below", "new": "theta <= prune_below",
     "why": "differs only when theta equals epsilon exactly (the paper writes theta > epsilon for a survivor, "
            "the same rule); theta is a float64 sigmoid of float32 data, equality has probability 0"},
    {"file": "edge/optim.py", "old": "np.abs(g) + self.eps", "new": "np.abs(g)",
     "why": "Adamax's eps only matters for |g| ~ 1e-8; with it gone the step is unchanged to 1e-8 relative, "
            "and a gradient that is exactly 0 everywhere gives m = 0 (0/0 only where u = 0, never reached)"},
]


# ------------------------------------------------------------------------------------------------ harness
IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".hypothesis", "build",
                                "*.egg-info", ".ci")


def problems(mutants: list[Mutant], equivalent: list[dict[str, str]] | None = None) -> list[str]:
    """Why entries no longer fit today's source, one line each (empty: every entry is current). A mutant's old
    text must occur exactly once in its file and differ from its new text, and every test it names must exist
    (file, and function if named: pytest exits 4 on an unknown node id, which the harness would count as a kill).
    The EQUIVALENT entries' old text must still occur in their files."""
    out: list[str] = []
    for m in mutants:
        path = ROOT / m.file
        if not path.is_file():
            out.append(f"{m.id}: no file {m.file}")
            continue
        n = path.read_text().count(m.old)
        if n != 1:
            out.append(f"{m.id}: old text found {n} times in {m.file} (must be exactly once)")
        if m.old == m.new:
            out.append(f"{m.id}: new text is the old text")
        for t in m.tests:
            f, _, name = t.partition("::")
            if not (ROOT / f).is_file():
                out.append(f"{m.id}: no test file {f}")
            elif name and not re.search(rf"^\s*(async\s+)?def {re.escape(name.split('[')[0])}\(",
                                        (ROOT / f).read_text(), re.M):
                out.append(f"{m.id}: no test {name} in {f}")
    ids = [m.id for m in mutants]
    out += [f"{i}: duplicate mutant id" for i in sorted({i for i in ids if ids.count(i) > 1})]
    for e in equivalent or []:
        path = ROOT / e["file"]
        if not path.is_file() or e["old"] not in path.read_text():
            out.append(f"equivalent {e['old']!r}: not found in {e['file']}")
    return out


def check(mutants: list[Mutant]) -> None:
    """Stop, naming every entry that no longer fits the source (see :func:`problems`)."""
    found = problems(mutants, EQUIVALENT)
    if found:
        raise SystemExit(f"{len(found)} mutant entries no longer match the source (fix them in "
                         f"benchmarks/mutants.py):\n  " + "\n  ".join(found))


def pytest(copy: Path, tests: list[str], timeout: float) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
                            *tests], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -1, out + "\nTIMEOUT", time.monotonic() - t0


def first_failure(out: str) -> str:
    m = re.search(r"^(FAILED|ERROR) (\S+)", out, re.M)
    return m.group(2) if m else ""


def run_one(m: Mutant, copy: Path, timeout: float) -> dict:
    path = copy / m.file
    original = path.read_text()
    path.write_text(original.replace(m.old, m.new, 1))
    try:
        rc, out, secs = pytest(copy, m.tests, timeout)
    finally:
        path.write_text(original)
    # pytest exit codes: 0 passed, 1 some test failed, 2 interrupted/collection error, -1 our timeout
    status = "survived" if rc == 0 else "killed"
    how = {0: "", 1: "test failed", 2: "collection/import error", -1: "timeout"}.get(rc, f"exit {rc}")
    return asdict(m) | {"status": status, "how": how, "by": first_failure(out), "seconds": round(secs, 1),
                        "tail": "" if rc == 1 else out[-1500:]}


# The areas of issue 28's held-out mutants, by the id's prefix (the first match wins); the rest are "objectives".
AREAS = (("sfvi", ("sfvi.",)), ("flops", ("flops.",)), ("codec", ("codec.",)), ("admission", ("admission.",)),
         ("fedmix", ("fedmix.", "fedmix_sparse.", "mixture.")), ("fedsparse", ("fedsparse.", "gates.")),
         ("server", ("server.", "fedavg.", "fedadam.", "fedprox.", "optim.")))


def area(mutant_id: str) -> str:
    return next((name for name, prefixes in AREAS if mutant_id.startswith(prefixes)), "objectives")


def by_area(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(area(r["id"]), []).append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="mutant ids (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "mutants.json"))
    ap.add_argument("--tests", nargs="*", help="run these tests against every mutant instead of its own (e.g. to "
                                               "see which mutants an older suite misses)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    a = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if not a.only or m.id in a.only]
    if a.only and len(mutants) != len(set(a.only)):
        print(f"mutants.py: unknown mutant ids {sorted(set(a.only) - {m.id for m in MUTANTS})} (see --list)",
              file=sys.stderr)
        return 2
    if a.tests:
        mutants = [Mutant(m.id, m.file, m.old, m.new, list(a.tests), m.what) for m in mutants]
    check(mutants)
    if a.list:
        for m in mutants:
            print(f"{m.id:36s} {m.file:45s} {m.what}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="fedge-mutants-"))
    try:
        copies = []
        for j in range(max(1, a.jobs)):
            c = tmp / f"w{j}"
            shutil.copytree(ROOT, c, ignore=IGNORE)
            copies.append(c)
        tests = sorted({t for m in mutants for t in m.tests})
        t0 = time.monotonic()
        if not a.no_baseline:
            rc, out, secs = pytest(copies[0], tests, a.timeout)
            print(f"baseline (unmutated) {len(tests)} test targets: exit {rc} in {secs:.0f}s", flush=True)
            if rc != 0:
                print(out[-3000:])
                raise SystemExit("the named tests fail without any mutation: fix them first")
        free = list(copies)
        results: list[dict] = []

        def work(m: Mutant) -> dict:
            c = free.pop()
            try:
                r = run_one(m, c, a.timeout)
            finally:
                free.append(c)
            print(f"  {r['status']:8s} {m.id:36s} {r['seconds']:6.1f}s  {r['by'] or r['how']}", flush=True)
            return r

        with ThreadPoolExecutor(max_workers=len(copies)) as ex:
            results = list(ex.map(work, mutants))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    killed = sum(r["status"] == "killed" for r in results)
    report = {"killed": killed, "total": len(results), "seconds": round(time.monotonic() - t0, 1),
              "python": sys.version.split()[0], "mutants": results, "equivalent_excluded": EQUIVALENT}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print()
    print(f"{'mutant':36s} {'file':45s} {'status':8s} {'killed by'}")
    for r in results:
        print(f"{r['id']:36s} {r['file']:45s} {r['status']:8s} {r['by'] or r['how']}")
    print()
    for name, rs in by_area(results).items():
        print(f"{name:12s} killed {sum(r['status'] == 'killed' for r in rs):3d}/{len(rs):3d}")
    print(f"\nkilled {killed}/{len(results)}  ({len(EQUIVALENT)} equivalent mutants listed, not run) -> {out}")
    return 0 if killed == len(results) else 1


SIX = ["fedmix.q-phi-uniform", "fedmix.gate-term-sign", "fedmix.label-histogram", "fedmix.eq9-pooling-weights",
       "fedmix.eq13-gate-term", "fedmix.damping-constant"]  # the six of issue 9 that no test killed


if __name__ == "__main__":
    sys.exit(main())
