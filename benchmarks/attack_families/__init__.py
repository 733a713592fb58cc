"""One module per attack family of benchmarks/attacks.py. Each exposes ``FAMILY`` (its name) and
``run(work: Path, broker_url: str, seed: int, quick: bool) -> dict``: the attacked run in a real fleet over
Mosquitto against a clean run of the same seed, returning at least ``family`` and ``holds`` (bool) plus the
family's own figures."""
