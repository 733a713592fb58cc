"""Attacks from inside the rules, each against a real fleet over Mosquitto and a clean run of the same seed.

``python benchmarks/attacks.py [--only poison,flood] [--seed 0] [--quick]`` writes ``runs/bench/attacks.json``:
a list with one entry per family (``family``, ``holds``, and that family's figures). The families live in
``benchmarks/attack_families/<name>.py`` (each module's docstring says what it sends and what "holds" means).
Exit status 0 when every family run holds.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import pkgutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/attacks.py` from anywhere
    sys.path.insert(0, str(ROOT))

from coordinator.broker import Mosquitto  # noqa: E402

OUT = ROOT / "runs" / "bench" / "attacks.json"
log = logging.getLogger("bench.attacks")


def families() -> dict[str, object]:
    from benchmarks import attack_families as pkg
    mods = [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]
    return {m.FAMILY: m for m in mods if hasattr(m, "FAMILY")}


def main(argv: list[str] | None = None) -> int:
    fams = families()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help=f"comma list of families (known: {', '.join(sorted(fams))})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run, not the figures")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    only = [f for f in a.only.split(",") if f]
    unknown = [f for f in only if f not in fams]
    if unknown:
        print(f"attacks.py: unknown families {unknown} (known: {', '.join(sorted(fams))})", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results = []
    with tempfile.TemporaryDirectory(prefix="fedge-attacks-") as tmp, Mosquitto() as broker:
        for name in only or sorted(fams):
            t0 = time.time()
            res = fams[name].run(Path(tmp) / name, broker.url, a.seed, a.quick)
            res = {"family": name, **res, "wall_s": round(time.time() - t0, 1)}
            log.info("%s: holds=%s %s", name, res.get("holds"), {k: v for k, v in res.items() if k not in ("family", "holds")})
            results.append(res)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(json.dumps([{"family": r["family"], "holds": r.get("holds")} for r in results], indent=2))
    return 0 if all(r.get("holds") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
