"""What both the container (wire.py) and the codec (codec.py) refuse with, and the size limit they share: a
module of its own, so that the two need not import each other."""
from __future__ import annotations

MAX_ELEMENTS = 2**40  # the most values one tensor may declare (its non-zero dimensions multiplied)


class WireError(ValueError):
    """A message that must be dropped; the text says why."""
