"""One BLAS thread for the coordinator's process.

The ingest path (admission's norms, FedAvg's float32 sums: BLAS dot and saxpy over each report) runs on the
network thread. A multi-threaded BLAS spreads each 0.8 MB call over every core, which costs more CPU than it
saves (measured by benchmarks/fedavg_mqtt.py --mode ingest: 2.2 CPU-s for 1.4 s of wall time on 2 cores) and
takes cores from the broker and the ingest workers; several ingest processes are how ingest scales instead.
"""
from __future__ import annotations

import logging

log = logging.getLogger("fedge.coordinator")


def one_blas_thread() -> None:
    """Limit the BLAS libraries loaded in this process (numpy's, scipy's) to one thread each; torch's own
    thread pool (the evaluator) is not affected. A no-op without threadpoolctl (it comes with scikit-learn)."""
    try:
        from threadpoolctl import threadpool_limits
        import scipy.linalg.blas  # noqa: F401 (loaded now, so its BLAS is limited too)
    except ImportError:  # pragma: no cover
        log.debug("threadpoolctl or scipy missing: BLAS keeps its default threads")
        return
    threadpool_limits(limits=1, user_api="blas")
