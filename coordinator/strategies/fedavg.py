"""FedAvg (McMahan et al. 2017), read as hard-EM (paper 000, section 2): the M-step (Eq. 10-11) is the
sample-weighted mean of the clients' weights. Two server optimisers:

- ``server_opt="sgd"``: w <- w + server_lr * (mean - w); server_lr = 1 is plain FedAvg.
- ``server_opt="adam"``: Adam ascent on the mean difference, "the difference as gradient" of paper 000
  App. F and Reddi et al.'s FedAdam; paper 000 runs every baseline with this server.

``prune_random`` is the random structured pruning control of the FedSparse benchmark: per gated layer (the
i-th: ``fc{i}`` of the zoo, a module's groups in graph order), a fraction of groups removed at random before
round 1 and never sent. ``prune_schedule`` is the same control on a schedule: after round r, the i-th gated
layer keeps ``prune_schedule[r - 1][i]`` groups (random ones go), so the control can follow another run's
per-layer density round by round (and so its bytes).

The link options (``upload_*``, ``down_*``: coordinator/strategies/links.py) choose the value formats both ways,
sampled uploads and differences on the downlink; their defaults are float32 weights both ways.

``aggregate`` replaces the weighted mean by a robust centre for fleets that expect poisoned reports (Yin et
al. 2018): ``median`` (coordinate-wise) or ``trimmed_mean`` (drop the ``trim`` fraction of largest and of
smallest values per coordinate). Both are unweighted, as in that paper, and keep every report of the round
in memory (reports x parameters x 4 bytes), which is why the mean stays the default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from edge import model as M
from edge.algorithms.fedavg import Hparams
from edge.optim import Adam
from edge.protocol.wire import Report

from . import groups as G
from .base import DevicePlan, ReportRejected, ServerState, plan_difference, received_weights
from .links import LinkOptions, upload_for


FOLD = 32  # reports a tensor sums in float32 before they are folded into its float64 sum


class Accumulator:
    """sum_s n_s w_s per tensor in float64 (the numerator of Eq. 10-11), sum_s n_s and the count; robust
    aggregation keeps every report instead.

    The common case (a whole tensor, dense, float32, trained from the round's weights W) goes through a float32
    buffer first: sum_s n_s (w_s - W) over at most FOLD reports, one BLAS saxpy pass per tensor (a float64 sum
    of float32 values costs two passes over twice the bytes, and was ingest's largest cost), then folded into
    the float64 sum as buffer + (sum n_s) W. Its rounding error is relative to the updates, not the weights: at
    most ~FOLD float32 epsilons of the summed updates, below a float32 weight's own resolution. ``sums``
    folds what is pending before it answers.

    Ingest runs this for every report, so no pass is spent that the sum does not need: the first report after a
    fold is written into the (reused) buffer rather than added to a zeroed one, and W's term is one BLAS daxpy
    from a float64 copy of W kept for the round, not a temporary per fold."""

    def __init__(self, sums: dict[str, np.ndarray], total_n: float = 0.0, count: int = 0):
        self._sums = sums
        self.total_n, self.count = total_n, count
        self.kept: list[dict[str, np.ndarray]] = []
        self._pending: dict[str, list] = {}  # tensor -> [buffer (flat), W, sum n, reports]
        self._buffers: dict[str, np.ndarray] = {}  # float32 buffers, reused across folds
        self._wide: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # tensor -> (W, W in float64)

    @property
    def sums(self) -> dict[str, np.ndarray]:
        for k in list(self._pending):
            self._fold(k)
        return self._sums

    def add_update(self, k: str, base: np.ndarray, d: np.ndarray, n: float) -> None:
        """Add n (W + d) to tensor ``k``'s sum, with ``base`` = W (float32, as is ``d``, of the tensor's shape)."""
        if not base.size:  # a pruned tensor: nothing to add (and scipy's BLAS refuses an empty array)
            return
        x = d if d.ndim == 1 else d.reshape(-1)
        p = self._pending.get(k)
        if p is not None and p[1] is not base:
            self._fold(k)
            p = None
        if p is None:
            buf = self._buffers.get(k)
            if buf is None or buf.size != base.size:
                buf = self._buffers[k] = np.empty(base.size, np.float32)
            np.multiply(x, np.float32(n), out=buf)  # = saxpy into zeros, in one pass
            p = self._pending[k] = [buf, base, n, 1]
        else:
            if _saxpy is not None:
                _saxpy(x, p[0], a=n)  # one BLAS pass, y += a x in float32
            else:
                p[0] += np.float32(n) * x
            p[2] += n
            p[3] += 1
        if p[3] >= FOLD:
            self._fold(k)

    def _fold(self, k: str) -> None:
        buf, base, tn, _ = self._pending.pop(k)
        s = self._sums[k]
        s += buf.reshape(s.shape)
        wide = self._wide.get(k)
        if wide is None or wide[0] is not base:
            wide = self._wide[k] = (base, base.astype(np.float64))
        if _daxpy is not None and s.flags.c_contiguous:
            _daxpy(wide[1].reshape(-1), s.reshape(-1), a=tn)
        else:
            s += tn * wide[1]


try:  # scipy when installed (the [dev] extra brings it with scikit-learn); numpy does it in two passes otherwise
    from scipy.linalg.blas import daxpy as _daxpy, saxpy as _saxpy
except ImportError:  # the demo's venv ([coordinator] extra) has no scipy
    _daxpy = _saxpy = None


SUMS_MAGIC = b"fedge-sums/1\n"  # a snapshot: magic, header length (u32 LE), msgpack header, float64 LE sums


def pack_sums(acc: Accumulator) -> bytes:
    """The accumulator as written with every batch of reports (durable sums): its float64 sums as they lie in
    memory behind a small header, one copy (np.savez spent a zip CRC and three copies on the same bytes)."""
    sums = acc.sums
    head = msgpack.packb({"n": float(acc.total_n), "count": int(acc.count),
                          "tensors": [[k, list(v.shape)] for k, v in sums.items()]})
    parts = [np.ascontiguousarray(v, "<f8").reshape(-1).data for v in sums.values()]
    return b"".join([SUMS_MAGIC, len(head).to_bytes(4, "little"), head, *parts])


def unpack_sums(blob: bytes, acc: Accumulator) -> None:
    """Load a snapshot into ``acc`` (fresh from ``begin``), or ValueError if it is not one of this model's."""
    m = len(SUMS_MAGIC)
    if blob[:m] != SUMS_MAGIC or len(blob) < m + 4:
        raise ValueError("snapshot: not a fedge sums snapshot")
    hl = int.from_bytes(blob[m:m + 4], "little")
    try:
        head = msgpack.unpackb(blob[m + 4:m + 4 + hl], raw=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types on garbage
        raise ValueError(f"snapshot: unreadable header ({type(e).__name__})") from None
    want = [[k, list(v.shape)] for k, v in acc.sums.items()]
    got = head.get("tensors") if isinstance(head, dict) else head
    if got != want or not isinstance(head.get("n"), float) or not isinstance(head.get("count"), int):
        raise ValueError(f"snapshot: tensors {got!r:.200}, the model has {want!r:.200}")
    data = np.frombuffer(blob, "<f8", offset=m + 4 + hl)
    if data.size != sum(v.size for v in acc.sums.values()):
        raise ValueError(f"snapshot: {data.size} values, the model has {sum(v.size for v in acc.sums.values())}")
    at = 0
    for v in acc.sums.values():
        v[...] = data[at:at + v.size].reshape(v.shape)
        at += v.size
    acc.total_n, acc.count = float(head["n"]), int(head["count"])


@dataclass
class FedAvg(LinkOptions):  # the link options (-S upload_*, down_*) come from LinkOptions
    objective: ClassVar[str] = "ce"  # the training objective its clients run (a subclass may name another)

    spec: dict[str, Any] = field(default_factory=lambda: M.mlp([64, 200, 200, 10]))
    lr: float = 0.05
    epochs: int = 1
    batch_size: int = 20
    server_opt: str = "sgd"
    server_lr: float = 1.0
    prune_random: dict[int, float] | None = None
    prune_schedule: list[list[int]] | None = None
    aggregate: str = field(default="mean", metadata={"choices": ("mean", "median", "trimmed_mean")})
    trim: float = field(default=0.1, metadata={"min": 0.0, "max": 0.49})
    name: str = "fedavg"

    def __post_init__(self) -> None:
        if self.server_opt not in ("sgd", "adam"):
            raise ValueError(f"server_opt must be sgd or adam, not {self.server_opt!r}")
        if self.aggregate not in ("mean", "median", "trimmed_mean"):
            raise ValueError(f"aggregate must be mean, median or trimmed_mean, not {self.aggregate!r}")
        self._cache: tuple | None = None
        self._links = LinkOptions.of(self)
        self._down = self._links.downlink()

    def init(self, seed: int) -> ServerState:
        w = M.init_weights(self.spec, seed)
        opt = {}
        meta: dict[str, Any] = {}
        if self.prune_schedule:
            meta["prune_seed"] = seed
            for layer, g in G.groups(self.spec).items():
                opt[f"alive/{layer}"] = np.ones(g.size, np.uint8)
        if self.prune_random:  # keys: the i-th gated layer (fc{i} for the zoo; a module's groups in order)
            rng = np.random.default_rng([seed, 77])
            for i, (layer, g) in enumerate(G.groups(self.spec).items()):
                n = g.size
                keep = np.ones(n, bool)
                keep[rng.choice(n, int(round(self.prune_random.get(i, 0.0) * n)), replace=False)] = False
                opt[f"alive/{layer}"] = keep.astype(np.uint8)
            G.zero_dead(w, self._alive(ServerState(0, w, opt)), self.spec)
        return ServerState(0, w, opt, meta)

    def _alive(self, state: ServerState) -> dict[str, np.ndarray]:
        return {L: state.opt[f"alive/{L}"].astype(bool) for L in G.layers(self.spec) if f"alive/{L}" in state.opt}

    def _round(self, state: ServerState) -> tuple[DevicePlan, G.Subnet]:
        """Every device of a round gets the same plan, built once per state. The cache holds the state
        object itself, so a discarded candidate state can never alias a later one."""
        if self._cache is None or self._cache[0] is not state:
            alive = self._alive(state)
            idx = G.index_maps(self.spec, alive)
            dp = DevicePlan(G.slice_weights(idx, state.weights), self.hparams(state).to_wire(),
                            self._links.upload(), G.sliced_spec(self.spec, alive), objective=self.objective,
                            maskable=self._maskable())
            self._cache = (state, dp, idx)
        return self._cache[1], self._cache[2]

    def _maskable(self) -> frozenset[str]:
        """Tensors whose report may carry a row mask (none: FedAvg's update is dense)."""
        return frozenset()

    def hparams(self, state: ServerState) -> Hparams:
        return Hparams(lr=self.lr, epochs=self.epochs, batch_size=self.batch_size)

    def plan(self, state: ServerState, device_id: str, caps: dict[str, Any]) -> DevicePlan:
        """The round's plan, with this device's upload budget and downlink (links.py)."""
        return self._down.plan(upload_for(self._round(state)[0], caps, self.upload_s), device_id, caps=caps)

    def begin(self, state: ServerState) -> Accumulator:
        return Accumulator({k: np.zeros(v.shape, np.float64) for k, v in state.weights.items()})

    def check(self, plan: DevicePlan, report: Report) -> None:
        if report.tensors.keys() != plan.weights.keys():
            raise ReportRejected(f"tensors {sorted(report.tensors)[:4]}... do not match the plan")
        for k, t in report.tensors.items():
            if t.shape != plan.weights[k].shape:
                raise ReportRejected(f"{k}: shape {t.shape}, plan sent {plan.weights[k].shape}")
            if not t.dense_rows:
                raise ReportRejected(f"{k}: {self.name} expects a dense update")

    def accumulate(self, state: ServerState, acc: Accumulator, plan: DevicePlan, report: Report) -> None:
        self.check(plan, report)
        self._down.confirm(report.device_id, plan)
        common_plan, idx = self._round(state)
        n = float(report.n_samples)
        if self.aggregate != "mean":
            acc.kept.append({k: received_weights(plan, report, k).astype(np.float32) for k in report.tensors})
        else:
            delta = plan.upload.get("delta")
            common = common_plan.weights
            for k, t in report.tensors.items():
                w, v = plan.weights[k], t.values
                # the common case: the round's weights W, whole and dense, float32: a float32 buffer folded
                # into float64 (Accumulator); a delta upload is w_s - W already
                d = None
                if w is common.get(k) and idx.whole(k):
                    if not delta:
                        d = plan_difference(plan, report, k)
                    elif t.dense_rows and not t.sampled and v.dtype == np.float32 and v.shape == w.shape:
                        d = v
                if d is not None and w.dtype == np.float32:
                    acc.add_update(k, w, d, n)
                else:
                    G.scatter_add(idx, k, acc._sums[k], n * received_weights(plan, report, k))
        acc.total_n += n
        acc.count += 1

    def takes_plain(self, state: ServerState, plan: DevicePlan) -> bool:
        """Whether :meth:`accumulate_plain` may sum this plan's plain reports (the round machine's fast path,
        coordinator/admission.py's ``admit_plain``): the mean, each returned tensor the round's own whole float32
        array, sent back as weights. A subclass that changes ``accumulate`` or ``check`` gets the general path."""
        if (self.aggregate != "mean" or type(self).accumulate is not FedAvg.accumulate
                or type(self).check is not FedAvg.check or plan.upload.get("delta")
                or plan.returned().keys() != plan.weights.keys()):
            return False
        common, idx = self._round(state)
        return all(w is common.weights.get(k) and idx.whole(k) and w.dtype == np.float32
                   for k, w in plan.weights.items())

    def accumulate_plain(self, state: ServerState, acc: Accumulator, plan: DevicePlan, device_id: str, n: int,
                         differences: dict[str, np.ndarray]) -> None:
        """:meth:`accumulate` of a plain report of a plan :meth:`takes_plain` accepted, given w_s - W per tensor
        (flat float32): the same sums, from the same differences."""
        self._down.confirm(device_id, plan)
        nf = float(n)
        for k, d in differences.items():
            acc.add_update(k, plan.weights[k], d, nf)
        acc.total_n += nf
        acc.count += 1

    # Durable sums (coordinator/rounds.py): the round's accumulator is written once per batch of reports
    # instead of every report. Robust aggregation keeps every report, so it stores payloads as before.
    def can_snapshot(self) -> bool:
        return self.aggregate == "mean"

    def snapshot(self, acc: Accumulator) -> bytes:
        return pack_sums(acc)

    def restore_snapshot(self, state: ServerState, blob: bytes, plans: dict[str, DevicePlan]) -> Accumulator:
        """The accumulator a snapshot holds; ``plans`` are the devices whose reports it sums (the downlink learns
        they hold their plan's model, as accumulate told it before the restart)."""
        acc = self.begin(state)
        unpack_sums(blob, acc)
        for d, plan in plans.items():
            self._down.confirm(d, plan)
        return acc

    def _centre(self, state: ServerState, acc: Accumulator) -> dict[str, np.ndarray]:
        """The aggregate the server steps towards: the weighted mean, or a robust centre of the reports."""
        if self.aggregate == "mean":
            return {k: acc.sums[k] / acc.total_n for k in state.weights}
        idx = self._round(state)[1]
        out = {}
        for k, w in state.weights.items():
            stack = np.stack([r[k] for r in acc.kept]).astype(np.float64)
            if self.aggregate == "median":
                c = np.median(stack, axis=0)
            else:
                cut = int(self.trim * len(acc.kept))
                srt = np.sort(stack, axis=0)
                c = srt[cut:len(acc.kept) - cut].mean(axis=0)
            full = w.astype(np.float64).copy()  # rows and columns no device trained keep their value
            G.scatter_add(idx, k, full, c - G.take(idx, k, full))
            out[k] = full
        return out

    def finish(self, state: ServerState, acc: Accumulator) -> ServerState:
        centre = self._centre(state, acc)
        diff = {k: centre[k] - w for k, w in state.weights.items()}
        new = {k: w.copy() for k, w in state.weights.items()}
        opt = dict(state.opt)
        if self.server_opt == "adam":
            adam = Adam(lr=self.server_lr, maximize=True)
            adam.load(opt, "adam/")
            adam.step(new, diff)
            opt |= adam.state("adam/")
        else:
            for k in new:
                new[k] = (new[k] + self.server_lr * diff[k]).astype(np.float32)
        if self.prune_schedule:
            self._prune_on_schedule(state.round + 1, opt, int(state.meta.get("prune_seed", 0)))
        G.zero_dead(new, self._alive(ServerState(0, new, opt)), self.spec)
        return ServerState(state.round + 1, new, opt, state.meta)

    def _prune_on_schedule(self, rnd: int, opt: dict[str, np.ndarray], seed: int) -> None:
        """After round ``rnd``: random alive groups go until each gated layer has its scheduled count."""
        target = self.prune_schedule[min(rnd, len(self.prune_schedule)) - 1]
        rng = np.random.default_rng([seed, 78, rnd])
        for i, layer in enumerate(G.layers(self.spec)):
            alive = opt[f"alive/{layer}"].astype(bool)
            extra = int(alive.sum()) - max(1, int(target[i]))
            if extra > 0:
                alive[rng.choice(np.flatnonzero(alive), extra, replace=False)] = False
                opt[f"alive/{layer}"] = alive.astype(np.uint8)

    def global_model(self, state: ServerState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        dp = self._round(state)[0]
        return dp.spec, dp.weights

    def metrics(self, state: ServerState) -> dict[str, float]:
        alive = self._alive(state)
        return {"density": G.density(alive)} if alive else {}
