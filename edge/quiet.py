"""Other libraries' noise, kept out of a person's terminal where fedge calls them (issue 29).

Importing and calling torch.export, ONNX Runtime training's artifact generation and ExecuTorch prints dozens of
lines that are not fedge's and say nothing a person can act on: torchao's "Failed to load ...so" and "Detected
no triton", pytree FutureWarnings, torch's glog-style warnings, and the ExecuTorch runtime's C++ log
(``[cpuinfo_utils.cpp:71] Reading file ...``, ``[threadpool.cpp:66] Resetting threadpool ...``) written
straight to the process's stderr. :func:`quiet` wraps those calls: at default verbosity their warnings are
ignored, log records below ERROR are dropped while the call runs, and (``native=True``) what C++ writes to file
descriptor 2 is taken aside, the runtime's own log lines logged at DEBUG and anything else written back. With
``-v`` (the root logger at INFO or below) nothing is filtered: every line shows as the library wrote it.

Errors are never hidden: an exception propagates, and ERROR records pass.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

log = logging.getLogger("fedge.quiet")

NATIVE_LOG_LINE = re.compile(r"^\[[\w./-]+\.(?:cpp|cc|c|h|hpp):\d+\]")  # ExecuTorch's ET_LOG: [file.cpp:71] ...


def verbose() -> bool:
    """``-v`` or more: the person asked to see everything."""
    return logging.getLogger().isEnabledFor(logging.INFO)


@contextlib.contextmanager
def quiet(*, native: bool = False) -> Iterator[None]:
    """Other libraries' warnings and log lines (and, ``native``, their C++ stderr) silenced for the block,
    unless :func:`verbose`."""
    if verbose():
        yield
        return
    before = logging.root.manager.disable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(max(before, logging.WARNING))
        try:
            if native:
                with _native_stderr():
                    yield
            else:
                yield
        finally:
            logging.disable(before)


@contextlib.contextmanager
def _native_stderr() -> Iterator[None]:
    """File descriptor 2 into a temporary file for the block; then the native runtime's log lines go to DEBUG and
    every other line (another thread's, say) back to stderr, in order."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (captured, closed): nothing to take aside
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            other = []
            for line in tmp.read().decode(errors="replace").splitlines():
                if NATIVE_LOG_LINE.match(line):
                    log.debug("native: %s", line)
                else:
                    other.append(line)
            if other:
                os.write(fd, ("\n".join(other) + "\n").encode())
