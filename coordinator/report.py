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
                           logx: bool = False, ylim: tuple[float, float] | None = None) -> None:
    """Test accuracy against cumulative MB on the wire (both directions), one line per run.

    ``logx`` and ``ylim`` zoom on where runs differ: near the top, across orders of magnitude of bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in runs:
        mb, total = [], 0
        for r in rows:
            total += r["bytes_down"] + r["bytes_up"]
            mb.append(total / 1e6)
        ax.plot(mb, [r["accuracy"] for r in rows], marker="." if len(rows) <= 60 else None, lw=1.2, label=label)
    if logx:
        ax.set_xscale("log")
    if ylim:
        ax.set_ylim(*ylim)
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
