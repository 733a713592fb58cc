"""The daemon's program catalog in the background (coordinator/daemon.py: ProgramCatalog(background=True)): exports
run in a separate process, and closing the catalog does not wait for one under way."""
from __future__ import annotations

import time

from coordinator.daemon import ProgramCatalog
from edge.model import mlp


def test_closing_the_catalog_stops_an_export_under_way(tmp_path):
    """A run that ends while a program it asked for ahead is still exporting (an ExecuTorch export: 10-45 s) exits
    at once: close() stops the exporter process (cleanly, on SIGTERM) instead of waiting for it, and stores
    nothing half-written. Before, `fedge simulate` waited at its end for the export it no longer needed."""
    cat = ProgramCatalog(tmp_path / "store", background=True)
    spec = mlp([64, 48, 10])
    cat.request(spec, "executorch", "ce", None)
    fut = next(iter(cat._building.values()))
    end = time.time() + 120
    while not fut.running() and time.time() < end:  # the exporter process started and took the export
        time.sleep(0.05)
    assert fut.running() and not cat.ready(spec, "executorch", "ce", None)
    time.sleep(1.0)  # inside the export (its imports alone take seconds)
    workers = list(cat._pool._processes.values())
    assert workers and all(w.is_alive() for w in workers)
    t0 = time.time()
    cat.close()
    assert time.time() - t0 < 10  # the export itself takes 10 s or more
    assert not any(w.is_alive() for w in workers)
    assert all(w.exitcode == 0 for w in workers)  # SIGTERM ended it as an exit, so it released what it held
    keys = tmp_path / "store" / "keys"
    assert not keys.exists() or not [p for p in keys.iterdir() if p.suffix == ".json"]
