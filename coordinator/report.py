"""The run report every benchmark and issue uses, and the project's signature plot (accuracy vs MB)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def run_report(*, strategy: str, runtime: str, devices: int, clients_per_round: int, rounds: list[dict],
               wall_s: float, **extra: Any) -> dict[str, Any]:
    keys = ("round", "accuracy", "loss", "bytes_down", "bytes_up", "reports", "dropped", "wall_s")
    rows = [{k: r.get(k) for k in keys} | {k: v for k, v in r.items() if k not in keys and k not in
                                            ("attempts", "selected", "accepted", "task_id")} for r in rounds]
    return {"strategy": strategy, "runtime": runtime, "devices": devices, "clients_per_round": clients_per_round,
            "rounds": rows, "final_accuracy": rows[-1]["accuracy"] if rows else None,
            "total_bytes": sum(r["bytes_down"] + r["bytes_up"] for r in rows), "wall_s": wall_s, **extra}


def write_json(path: str | Path, data: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2))


def plot_accuracy_vs_bytes(runs: list[tuple[str, list[dict]]], path: str | Path, title: str = "", *,
                           logx: bool = False, ylim: tuple[float, float] | None = None, smooth: int = 1) -> None:
    """Test accuracy against cumulative MB on the wire (both directions), one line per run.

    ``logx`` and ``ylim`` zoom on where runs differ: near the top, across orders of magnitude of bytes;
    ``smooth`` averages accuracy over that many rounds (round-to-round noise hides the ordering)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    left = None
    for i, (label, rows) in enumerate(runs):
        mb = np.cumsum([r["bytes_down"] + r["bytes_up"] for r in rows]) / 1e6
        acc = np.array([r["accuracy"] for r in rows], float)
        if smooth > 1 and len(acc) >= smooth:
            acc = np.convolve(acc, np.ones(smooth) / smooth, mode="valid")
            mb = mb[smooth - 1:]
        # past the ten colours of the cycle, a dashed line: two runs must never look alike
        ax.plot(mb, acc, marker="." if len(rows) <= 60 else None, lw=1.4, label=label, ls="-" if i < 10 else "--")
        if ylim is not None and (acc >= ylim[0]).any():
            first = mb[np.argmax(acc >= ylim[0])]
            left = first if left is None else min(left, first)
    if logx:
        ax.set_xscale("log")
    if ylim:
        ax.set_ylim(*ylim)
        if left is not None:
            ax.set_xlim(left=left * 0.8)
    ax.set_xlabel("cumulative MB on the wire (plans + reports)")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
