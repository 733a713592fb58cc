"""FedSparse's client objective (paper 000, Eq. 41 with lambda = 0): cross-entropy of the network with
hard-concrete group gates on every hidden unit, plus the gate penalties (gates.py).

Parameters: the spec's, and ``fc{i}.v`` (one threshold per unit of hidden layer i; for a module spec,
``<layer>.v`` per group of each gated layer, in the spec's group order). Inputs per gated layer i: the noise
``u{i}``, the server's ``theta_logit{i}`` and the detached group norms ``norm{i}``;
and the scalars ``lambda0``, ``ce_scale``, ``T``. The batch term is a mean (w = 1/N); the penalties are
unscaled, as the reference implementation in the notes (the paper is silent on scaling).

The layout's ``l0`` says how the L0 term is charged: ``"weight"`` (App. G: lambda0 per parameter, so
lambda0 |g| pi_g for a group of |g| weights, |g| from edge/subnet.py: group_sizes, a constant of the program's
shape) or ``"group"`` (absent: lambda0 pi_g, once per group). The pi-theta cross-entropy is per gate either way
(Eq. 38 sums over the gates z).
"""
from __future__ import annotations

import torch

from ...gates import L0_READINGS, LOG_RATIO
from ...model import input_size, is_module, param_shapes
from ...subnet import gate_groups, group_sizes, pruned_groups
from . import nets
from .objective import Input, Objective, batch_inputs, softplus, weighted_ce
from .gates import gate, hard_concrete, penalty


class GatedCrossEntropy(Objective):
    name = "fedsparse"

    def __init__(self, spec, layout=None):
        super().__init__(spec, layout)
        if spec["arch"] not in ("mlp", "module"):
            raise ValueError("FedSparse's gated objective is defined for MLP and module specs")
        for n, s in param_shapes(spec).items():
            self.param(n, s)
        self.net = nets.Net(spec)
        if is_module(spec):  # a module's groups, read from its graph (edge/subnet.py), in order
            groups = pruned_groups(spec)
            self.layers = [g.layer for g in groups]
            self.units = [g.size for g in groups]
            self.graph_groups = [g.layer for g in gate_groups(spec)]  # the network's gate slots, gated or not
        else:
            self.units = [int(v) for v in spec["sizes"][1:-1]]
            self.layers = [f"fc{i}" for i in range(len(self.units))]
        for L, n in zip(self.layers, self.units):
            self.param(f"{L}.v", (n,))
        self.l0 = str(self.layout.get("l0", "group"))
        if self.l0 not in L0_READINGS:
            raise ValueError(f"layout l0 must be one of {', '.join(L0_READINGS)}, not {self.l0!r}")
        shapes = param_shapes(spec)
        grs = {g.layer: g for g in pruned_groups(spec)}
        # lambda0's multiplier per gated layer: its groups' weight count (App. G), or 1 (one charge per group)
        self.l0_weight = [float(group_sizes(grs[L], shapes)) if self.l0 == "weight" else 1.0 for L in self.layers]
        self.aux = self.net.aux()
        self.conv_as_gemm = False

    def padding(self):
        """Padded units (zero weights, bias and threshold) get the noise 0.5 and a group norm and server logit of
        -1e4: pi = sigmoid((-1e4 - softplus(v)) / T) and the gate z are exactly 0, so they feed nothing forward,
        pass no gradient back, and add exactly 0 to both penalties (lambda0 pi, and H(pi, theta) = softplus(
        theta logit) = 0). MLPs charged per group only: a per-weight L0 charge (``l0`` "weight") counts each
        unit's fan-in, which padding the layer before would change."""
        if self.net.user is not None or self.l0 == "weight":
            return None
        pads: dict[str, float] = {}
        for i in range(len(self.units)):
            pads |= {f"u{i}": 0.5, f"theta_logit{i}": -1e4, f"norm{i}": -1e4}
        return {"inputs": pads, "aux": {}}

    def inputs(self):
        ins = batch_inputs(input_size(self.spec)) + self.net.inputs()
        for kind in ("u", "theta_logit", "norm"):
            ins += [Input(f"{kind}{i}", (n,)) for i, n in enumerate(self.units)]
        return ins + [Input("lambda0", ()), Input("ce_scale", ()), Input("T", ())]

    def forward(self, x, y, w, *rest):
        k = len(self.net.inputs())
        masks, rest = rest[:k], rest[k:]
        nh = len(self.units)
        us, ths, norms = rest[:nh], rest[nh:2 * nh], rest[2 * nh:3 * nh]
        lambda0, ce_scale, T = rest[3 * nh:]
        p = self.params()
        if self.net.user is not None:  # the gates multiply what each group feeds (usermodel.Network)
            zs, loss = [], None
            for i, L in enumerate(self.layers):
                logit_pi = (norms[i] - softplus(p[f"{L}.v"])) / T
                zs.append(hard_concrete(logit_pi + LOG_RATIO, us[i]))
            by_layer = dict(zip(self.layers, zs))  # every group of the graph: None where it has no gate
            zs = [by_layer.get(L) for L in self.graph_groups]
            logits, _, stats = self.net.run(p, x, w, masks, gates=zs, conv_as_gemm=self.conv_as_gemm)
            loss = weighted_ce(logits, y, w)
            for i, L in enumerate(self.layers):
                loss = loss + penalty(p[f"{L}.v"], norms[i], ths[i], lambda0 * self.l0_weight[i], ce_scale, T)
            return (loss, *stats)
        penalties = []

        def hidden(i, h, W, b):
            h, pen = gate(h, p[f"fc{i}.v"], norms[i], us[i], ths[i], lambda0 * self.l0_weight[i], ce_scale, T)
            penalties.append(pen)
            return h

        logits, _ = nets.forward(self.spec, p, x, hidden=hidden)
        loss = weighted_ce(logits, y, w)
        for pen in penalties:
            loss = loss + pen
        return (loss,)
