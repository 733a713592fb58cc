"""FedMix's client objective (paper 004, Eq. 5/6 without H(q), the Eq. 9 gate), and with ``gated`` FedMix x
FedSparse's: FedSparse's group gates inside every expert (paper 000).

A program holds ``k`` expert *slots* (the experts a device was sent, whatever their ids: the client maps
``e{id}`` to ``s{slot}``), each an MLP of its own sizes (FedSparse slices experts differently). Per batch, a
minimisation of the negative MAP bound:

    loss = -sum_i w_i sum_j q_ij [ log p_wj(y_i|x_i) + log p_theta(z=j|x_i, s) ]  (+ sum_j active_j penalty_j)

- ``q_ij`` is q_phi(z|y) = softmax over the active slots of ``phi[y_i]`` (label variant, Alg. 1), or the
  input ``pi`` (App. B's clustering variant, q_pi(z|s), zero off the active slots).
- ``log p_theta(z|x, s)`` is the device's private gate (Eq. 9): log-softmax over the active slots of
  ``sum_j qs_j h_j(x) A_j + b``, with h_j the features entering expert j's last linear layer, pooled with
  the q(z|s) weights ``qs``, and detached: the gate does not train the experts' features (docs/fedmix.md).
  ONNX has no stop-gradient, so the detachment is written as features computed from *copies* of the hidden
  weights that come in as inputs (``c{j}_fc{i}_weight``, ...); the client feeds the current values.
- ``A_j`` [H_j, k] holds the rows of the device's gate A [H, K] that expert j's last hidden units occupy,
  restricted to the held experts' columns: the client slices it and scatter-adds its gradient back (so a
  pruned expert's units keep fixed gate coordinates, FedMix x FedSparse's ``units``).
- ``active`` (0/1 per slot) masks experts pruned for this batch (Alg. 2): they get probability exactly 0
  (an additive -1e4 before the softmaxes) and no penalty.

Aux outputs (detached): ``ll`` = log p_wj(y_i|x_i) and ``lg`` = log p_theta(z=j|x_i) [B, k], which Eq. 13
needs, and every expert's ``logits`` [B, k, C] for prediction.

With a person's module (a module spec; layout ``{"experts": k, "variant", "gated": false}``) every slot is a copy
of the module (parameters ``s{j}.<the module's names>``), the gate reads the features entering its classifier
(its last Linear), and the stop-gradient copies are every parameter but the classifier's. Dropout runs as
identity in the mixture (no masks), and BatchNorm with running statistics is refused (docs/your-model.md).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from ...model import buffer_shapes, input_size, is_module, mlp, num_classes, param_shapes
from . import nets
from .objective import Input, Objective, batch_inputs, log_likelihood, one_hot
from .gates import gate, relaxed

INACTIVE = 1e4  # subtracted from inactive slots' logits: exp(-1e4) is exactly 0 in float32


class Mixture(Objective):
    """layout: ``slots`` (each slot's MLP sizes), ``variant`` ("label" | "cluster"), ``gated`` (bool)."""

    name = "mixture"
    aux = ("ll", "lg", "logits")

    def __init__(self, spec, layout=None):
        super().__init__(spec, layout)
        self.user = None
        if is_module(spec):
            self._module_init(spec)
            return
        if spec["arch"] != "mlp":
            raise ValueError("FedMix experts are MLP specs or a person's module")
        self.slots = [[int(v) for v in s] for s in self.layout["slots"]]
        self.variant = self.layout.get("variant", "label")
        self.gated = bool(self.layout.get("gated", False))
        if self.variant not in ("label", "cluster"):
            raise ValueError(f"variant must be label or cluster, not {self.variant!r}")
        k, C = len(self.slots), int(spec["sizes"][-1])
        if k < 1 or any(s[0] != spec["sizes"][0] or s[-1] != C for s in self.slots):
            raise ValueError(f"slots {self.slots} do not fit the spec {spec['sizes']}")
        self.k, self.C = k, C
        for j, s in enumerate(self.slots):
            for i in range(len(s) - 1):
                self.param(f"s{j}.fc{i}.weight", (s[i + 1], s[i]))
                self.param(f"s{j}.fc{i}.bias", (s[i + 1],))
            if self.gated:
                for i in range(len(s) - 2):
                    self.param(f"s{j}.fc{i}.v", (s[i + 1],))
        for j, s in enumerate(self.slots):
            self.param(f"gate.A{j}", (s[-2], k))
        self.param("gate.b", (k,))
        if self.variant == "label":
            self.param("phi", (C, k))

    # ---------------------------------------------------------------- a person's module as the experts
    def _module_init(self, spec) -> None:
        from .usermodel import network
        if buffer_shapes(spec):
            raise ValueError("FedMix experts with BatchNorm running statistics are not supported")
        self.user = network(spec)
        self.variant = self.layout.get("variant", "label")
        self.gated = bool(self.layout.get("gated", False))
        if self.gated:
            raise ValueError("FedMix x FedSparse takes the zoo MLP only")
        if self.variant not in ("label", "cluster"):
            raise ValueError(f"variant must be label or cluster, not {self.variant!r}")
        k, C = int(self.layout["experts"]), num_classes(spec)
        if k < 1:
            raise ValueError("a mixture needs at least one expert")
        self.k, self.C = k, C
        shapes = param_shapes(spec)
        cls = spec["classifier"]
        if len(shapes[f"{cls}.weight"]) != 2:
            raise ValueError("FedMix's gate reads the input of the classifier, which must be a Linear layer")
        self.copies = [n for n in shapes if n.rsplit(".", 1)[0] != cls]
        self.shapes = shapes
        self.slots = [None] * k
        for j in range(k):
            for n, s in shapes.items():
                self.param(f"s{j}.{n}", s)
        H = shapes[f"{cls}.weight"][1]
        for j in range(k):
            self.param(f"gate.A{j}", (H, k))
        self.param("gate.b", (k,))
        if self.variant == "label":
            self.param("phi", (C, k))

    def _module_inputs(self) -> list[Input]:
        k = self.k
        ins = batch_inputs(input_size(self.spec)) + [Input("active", (k,)), Input("qs", (k,))]
        if self.variant == "cluster":
            ins.append(Input("pi", (k,)))
        for j in range(k):
            ins += [Input(f"c{j}_{n.replace('.', '_')}", self.shapes[n]) for n in self.copies]
        return ins

    def _module_forward(self, x, y, w, active, qs, *rest):
        named = dict(zip([i.name for i in self._module_inputs()][5:], rest))
        p = self.params()
        mask = (active - 1.0) * INACTIVE
        ll, feats, logits = [], [], []
        cls = self.spec["classifier"]
        for j in range(self.k):
            out, _, _ = self.user.run(p, x, w=w, prefix=f"s{j}.")
            logits.append(out)
            ll.append(log_likelihood(out, y))
            # the gate's features: the same network from input copies of its hidden weights (a stop-gradient)
            cp = {f"c.{n}": named[f"c{j}_{n.replace('.', '_')}"] for n in self.copies}
            cp |= {f"c.{cls}.{t}": p[f"s{j}.{cls}.{t}"] for t in ("weight", "bias") if f"s{j}.{cls}.{t}" in p}
            _, feat, _ = self.user.run(cp, x, w=w, prefix="c.")
            feats.append(feat)
        loss, ll_t, lg = self._mix(ll, feats, qs, p, named, x, y, w, mask)
        return loss, ll_t.detach(), lg.detach(), torch.stack(logits, dim=1).detach()

    def _mix(self, ll, feats, qs, p, named, x, y, w, mask):
        """The mixture's loss from the experts' log-likelihoods and the gate's features, both layouts: the
        gate's log-probabilities and the experts' log-likelihoods weighted by q(z|.) (label variant: from phi
        and y; cluster variant: the device's pi)."""
        ll_t = torch.stack(ll, dim=1)
        z = sum(qs[j] * (feats[j] @ p[f"gate.A{j}"]) for j in range(self.k)) + p["gate.b"]
        lg = torch.log_softmax(z + mask, dim=1)
        if self.variant == "label":
            q = torch.softmax(one_hot(y, self.C, x.dtype) @ p["phi"] + mask, dim=1)
        else:
            q = named["pi"].unsqueeze(0).expand(x.shape[0], self.k)
        return -((q * (ll_t + lg)).sum(1) * w).sum(), ll_t, lg

    def _hidden_names(self, j: int) -> list[str]:
        s = self.slots[j]
        names = [f"fc{i}.{p}" for i in range(len(s) - 2) for p in ("weight", "bias")]
        if self.gated:
            names += [f"fc{i}.v" for i in range(len(s) - 2)]
        return names

    def padding(self):
        """A program of more slots, or of wider slots, serves fewer experts, or narrower ones (zoo MLPs): a padded
        slot has zero weights and ``active`` 0, so the -1e4 mask gives it probability exactly 0 in both softmaxes
        (no loss, no gradient, no penalty), and its gate column and ``qs`` are 0; padded units of a slot are zero
        rows and columns (gated: noise 0.5 and a norm and server logit of -1e4, z = pi = 0, as in fedsparse.py).
        The auxiliary outputs are cut to the fed slots."""
        if self.user is not None:
            return None
        pads: dict[str, float] = {}
        if self.gated:
            for j, s in enumerate(self.slots):
                for i in range(len(s) - 2):
                    pads |= {f"u{j}_{i}": 0.5, f"theta_logit{j}_{i}": -1e4, f"norm{j}_{i}": -1e4}
        return {"inputs": pads, "aux": {a: [[1, "active"]] for a in self.aux}}

    def inputs(self):
        if self.user is not None:
            return self._module_inputs()
        k = self.k
        ins = batch_inputs(self.spec["sizes"][0]) + [Input("active", (k,)), Input("qs", (k,))]
        if self.variant == "cluster":
            ins.append(Input("pi", (k,)))
        for j, s in enumerate(self.slots):
            shapes = {f"fc{i}.weight": (s[i + 1], s[i]) for i in range(len(s) - 2)}
            shapes |= {f"fc{i}.bias": (s[i + 1],) for i in range(len(s) - 2)}
            shapes |= {f"fc{i}.v": (s[i + 1],) for i in range(len(s) - 2)}
            ins += [Input(f"c{j}_{n.replace('.', '_')}", shapes[n]) for n in self._hidden_names(j)]
        if self.gated:
            for kind in ("u", "theta_logit", "norm"):
                ins += [Input(f"{kind}{j}_{i}", (s[i + 1],)) for j, s in enumerate(self.slots)
                        for i in range(len(s) - 2)]
            ins += [Input("lambda0", ()), Input("ce_scale", ()), Input("T", ())]
        return ins

    def forward(self, x, y, w, active, qs, *rest):
        if self.user is not None:
            return self._module_forward(x, y, w, active, qs, *rest)
        named = dict(zip([i.name for i in self.inputs()][5:], rest))
        p = self.params()
        mask = (active - 1.0) * INACTIVE
        ll, feats, logits, pens = [], [], [], []
        for j, s in enumerate(self.slots):
            spec_j = mlp(s)
            gate_in = {}
            if self.gated:
                gate_in = {i: (named[f"u{j}_{i}"], named[f"theta_logit{j}_{i}"], named[f"norm{j}_{i}"])
                           for i in range(len(s) - 2)}
                pen_j = []

                def hidden(i, h, W, b, j=j, gate_in=gate_in, pen_j=pen_j):
                    u, th, norm = gate_in[i]
                    h, pen = gate(h, p[f"s{j}.fc{i}.v"], norm, u, th, named["lambda0"], named["ce_scale"],
                                  named["T"])
                    pen_j.append(pen)
                    return h
            else:
                hidden = None
            out, _ = nets.forward(spec_j, p, x, prefix=f"s{j}.", hidden=hidden)
            logits.append(out)
            ll.append(log_likelihood(out, y))
            if self.gated:
                pens.append(sum(pen_j))
            # the gate's features: the same network from copies of the hidden weights (a stop-gradient)
            copies = {n: named[f"c{j}_{n.replace('.', '_')}"] for n in self._hidden_names(j)}
            feats.append(self._features(len(s) - 1, copies, x, gate_in, named.get("T")))
        loss, ll_t, lg = self._mix(ll, feats, qs, p, named, x, y, w, mask)
        for j, pen in enumerate(pens):
            loss = loss + active[j] * pen
        return loss, ll_t.detach(), lg.detach(), torch.stack(logits, dim=1).detach()

    def _features(self, n: int, copies: dict, x: torch.Tensor, gate_in: dict, T) -> torch.Tensor:
        """h_j(x) from the copied hidden weights (when gated, through the same gates with the copied v)."""
        h = x
        for i in range(n - 1):
            h = torch.relu(F.linear(h, copies[f"fc{i}.weight"], copies[f"fc{i}.bias"]))
            if self.gated:
                u, _th, norm = gate_in[i]
                h = relaxed(h, copies[f"fc{i}.v"], norm, u, T)
        return h
