"""Mutants nobody wrote: single-point operator changes drawn at random from each area's maths files.

``python benchmarks/random_mutants.py [--per-area 8] [--seed S] [--areas sfvi flops ...]``
writes ``runs/bench/random_mutants.json`` and prints each mutant's fate and a kill table per area.

``benchmarks/mutants.py`` holds the mutants someone thought of, each with the tests meant to kill it; they
rot into a list of what the suite already catches. This draws the ones nobody listed, the way a held-out set
would: for each area (issue 28's: SFVI, FLoPS, FedSparse, codec, server steps, admission; FedMix's own
mutants are in mutants.py) ``--per-area`` lines of its source files, each with one operator swapped (+ and -,
* and /, < and <=, > and >=, max and min, float64 and float32, += and -=, a constant halved), in code only
(no docstrings, comments or strings). Each runs against the area's test files in a copy of the tree (the
mutants.py harness: never in the repository), and is killed when a test fails.

A survivor is either a gap (write the test that checks that term, then add the mutant to mutants.py) or an
equivalent mutant (no result can change: a boundary only a performance branch reads, a dead branch, a
precision change below every tolerance). Known equivalents are in ``EQUIVALENT`` with the reason, and are
counted apart. The seed makes a draw repeatable; ``--seed`` with a new value draws new mutants.
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import mutants as MU  # noqa: E402  (the harness: copies, one mutant at a time, pytest)

OUT = ROOT / "runs" / "bench" / "random_mutants.json"
_MATHS = ["tests/test_maths_clients.py", "tests/test_maths_server.py", "tests/test_maths_objectives.py"]
AREAS: dict[str, tuple[list[str], list[str]]] = {  # area: (source files, test files)
    "sfvi": (["edge/algorithms/sfvi.py", "edge/vi.py", "coordinator/strategies/sfvi.py"],
             ["tests/test_gaps_sfvi.py", *_MATHS, "tests/test_sfvi.py", "tests/test_sfvi_admission.py"]),
    "flops": (["edge/algorithms/flops.py", "edge/flops.py", "edge/algorithms/fediter_ht.py",
               "coordinator/strategies/flops.py", "coordinator/strategies/fediter_ht.py"],
              ["tests/test_gaps_flops.py", *_MATHS, "tests/test_flops.py", "tests/test_fediter_ht.py"]),
    "fedsparse": (["edge/algorithms/fedsparse.py", "edge/gates.py", "coordinator/strategies/fedsparse.py",
                   "edge/algorithms/fedl1.py"],
                  ["tests/test_gaps_fedsparse.py", *_MATHS, "tests/test_fedsparse.py", "tests/test_fedsparse_earned.py",
                   "tests/test_padded.py"]),
    "codec": (["edge/protocol/codec.py"],
              ["tests/test_gaps_codec.py", "tests/test_codec.py", "tests/test_links.py", "tests/test_wire.py",
               "tests/test_protocol_vectors.py"]),
    "server": (["coordinator/strategies/fedavg.py", "coordinator/strategies/base.py", "edge/optim.py"],
               ["tests/test_gaps_server.py", "tests/test_maths_server.py", "tests/test_fedprox.py", "tests/test_links.py",
                "tests/test_flops.py", "tests/test_plain_ingest.py"]),
    "admission": (["coordinator/admission.py"],
                  ["tests/test_gaps_admission.py", "tests/test_untrusted.py", "tests/test_plain_ingest.py",
                   "tests/test_sfvi_admission.py", "tests/test_links.py", "tests/test_first_bound.py",
                   "tests/test_maths_server.py"]),
}
SWAPS = [(" + ", " - "), (" - ", " + "), (" * ", " / "), (" / ", " * "), (" < ", " <= "), (" <= ", " < "),
         (" > ", " >= "), (" >= ", " > "), ("0.5", "0.25"), ("2.0", "3.0"), (" ** 2", " ** 3"), ("axis=0", "axis=1"),
         ("max(", "min("), ("min(", "max("), ("np.float64", "np.float32"), ("+= ", "-= "), (" // ", " / "),
         ("sqrt(", "abs(")]
# (file, old line stripped, new line stripped): why no result can change
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("coordinator/strategies/flops.py",
     "epoch = 0 if round_ == 0 else (round_ - 1) // self.steps_per_epoch + 1",
     "epoch = 0 if round_ == 0 else (round_ - 1) / self.steps_per_epoch + 1"):
        "epoch is only compared with the integer prune_start: (r-1)/s + 1 >= p iff floor((r-1)/s) + 1 >= p",
    ("edge/flops.py", "return rng.uniform(U_EPS, 1 - U_EPS, shape).astype(np.float32)",
     "return rng.uniform(U_EPS, 1 + U_EPS, shape).astype(np.float32)"):
        "a draw above 1 - U_EPS has probability 2 U_EPS per unit (1e-6 scale), never in a test's draws",
    ("edge/gates.py", "return rng.random(pi.shape) < pi", "return rng.random(pi.shape) <= pi"):
        "random() equals pi exactly with probability 2^-53",
    ("edge/protocol/codec.py", "if v > rank:", "if v >= rank:"):
        "at C(c, j) == rank the search steps down and back up, then its bisection returns the same c",
    ("coordinator/strategies/fedavg.py", "if extra > 0:", "if extra >= 0:"):
        "choosing 0 groups to remove removes none",
    ("coordinator/strategies/fedavg.py", "if blob[:m] != SUMS_MAGIC or len(blob) < m + 4:",
     "if blob[:m] != SUMS_MAGIC or len(blob) <= m + 4:"):
        "a blob of exactly m + 4 bytes has an empty header, refused one line later with the same ValueError",
    ("coordinator/admission.py", "if math.sqrt(sq) > max_abs_value:", "if math.sqrt(sq) >= max_abs_value:"):
        "the branch only decides whether the values are scanned; the scan accepts values at the bound",
    ("coordinator/admission.py", "if w_max + math.sqrt(sq) > max_abs_value:",
     "if w_max + math.sqrt(sq) >= max_abs_value:"):
        "the branch only decides whether the values are scanned; the scan accepts values at the bound",
    ("coordinator/admission.py",
     "if not math.isfinite(sq) or w_max[k] + math.sqrt(sq) > rules.max_abs_value:",
     "if not math.isfinite(sq) or w_max[k] + math.sqrt(sq) >= rules.max_abs_value:"):
        "the plain path hands a report at the bound to the general path, which decides the same",
    ("edge/protocol/codec.py", "sd = s.astype(np.float64)[:, None]", "sd = s.astype(np.float32)[:, None]"):
        "s is float32 already, and dividing the float64 values by it promotes it to float64 either way",
    ("coordinator/admission.py", "ns = [int(n) for n in declared if n and n > 0]",
     "ns = [int(n) for n in declared if n and n >= 0]"):
        "a count of 0 is already left out by `n and`",
    ("coordinator/strategies/fedsparse.py", "newly = alive[key] & (theta < prune_below)",
     "newly = alive[key] & (theta <= prune_below)"):
        "theta is a float64 sigmoid of float32 data: equal to the threshold with probability 0 (mutants.py too)",
    ("coordinator/strategies/fedsparse.py",
     "tau = gates.softplus(v[n].astype(np.float64)) - (before[n] - norms(n))",
     "tau = gates.softplus(v[n].astype(np.float32)) - (before[n] - norms(n))"):
        "v is stored in float32; softplus of it in float32 moves tau by an ulp, and v is stored in float32 again",
    ("edge/protocol/codec.py", "c = min(hi, max(lo, int(est)))", "c = min(hi, min(lo, int(est)))"):
        "the estimate only seeds the search: from a wrong start its bounded steps end in the bisection, same c",
    ("edge/protocol/codec.py",
     "gvv = 1 if p >= 0.5 else math.ceil(math.log(2 - p) / -math.log1p(-p))  # Gallager and Van Voorhis",
     "gvv = 1 if p >= 0.25 else math.ceil(math.log(2 - p) / -math.log1p(-p))  # Gallager and Van Voorhis"):
        "for p in [0.25, 0.5) the formula gives 1 or 2; the mutant's set lacks only M = 3 where it gave 2, and at "
        "that density M = 3 was never strictly cheapest (tests/test_gaps_codec.py checks the choice against every M)",
    ("edge/algorithms/fedl1.py", "masks[name] = np.repeat(keep, span[name]) if span[name] > 1 else keep",
     "masks[name] = np.repeat(keep, span[name]) if span[name] >= 1 else keep"):
        "repeating each entry once is the array itself",
    ("coordinator/strategies/fediter_ht.py", "return t.dense().astype(np.float64)",
     "return t.dense().astype(np.float32)"):
        "the report is float32 already; only its product with the sample weight is rounded once more, an ulp",
    ("coordinator/strategies/sfvi.py", "if np.abs(new - S).max() <= tol * max(1.0, np.abs(S).max()):",
     "if np.abs(new - S).max() < tol * max(1.0, np.abs(S).max()):"):
        "the change equals the tolerance exactly with probability 0",
    ("coordinator/strategies/sfvi.py", "if np.abs(new - S).max() <= tol * max(1.0, np.abs(S).max()):",
     "if np.abs(new - S).max() <= tol * min(1.0, np.abs(S).max()):"):
        "a stricter stop (the same or a later iteration) of a fixed point iteration that has converged to 1e-14",
    ("coordinator/strategies/sfvi.py", "if np.abs(new - S).max() <= tol * max(1.0, np.abs(S).max()):",
     "if np.abs(new - S).min() <= tol * max(1.0, np.abs(S).max()):"):
        "the iteration contracts about tenfold a step: stopping one step early leaves a fixed-point residual of "
        "5e-14 (measured), at float64 sqrtm's own accuracy",
    ("coordinator/admission.py", "if len(pool) < NORM_WINDOW:", "if len(pool) <= NORM_WINDOW:"):
        "a pool of exactly NORM_WINDOW norms topped up and cut to the last NORM_WINDOW is itself (mutants.py too)",
    ("edge/protocol/codec.py", "if K > nbits:  # every row costs at least its terminating zero bit",
     "if K >= nbits:  # every row costs at least its terminating zero bit"):
        "a stream of exactly K bits has no room for M's code either: a later check refuses it the same way",
    ("edge/protocol/codec.py", "est = math.exp((logr + math.lgamma(j + 1)) / j) + (j - 1) / 2",
     "est = math.exp((logr + math.lgamma(j + 1)) / j) + (j - 1) * 2"):
        "the estimate only seeds the search, which ends at the same c (its bisection when the seed is far)",
    ("coordinator/strategies/sfvi.py", "for it in range(1, max_iter + 1):", "for it in range(1, max_iter - 1):"):
        "the iteration converges in about 12 steps; the 500th is never reached",
    ("edge/algorithms/sfvi.py", "gl = {k: -g[k].astype(np.float64) for k in self.loc}",
     "gl = {k: -g[k].astype(np.float32) for k in self.loc}"):
        "the runtime's gradient is float32 already; Adam's step on it rounds once more, far below its tolerance",
    ("coordinator/strategies/fedsparse.py", "acc.count += 1", "acc.count -= 1"):
        "FedSparse's step is Alg. 1's sum over the reports (lines 7-8): its finish never reads the count",
    ("coordinator/strategies/fedavg.py",
     "full = w.astype(np.float64).copy()  # rows and columns no device trained keep their value",
     "full = w.astype(np.float32).copy()  # rows and columns no device trained keep their value"):
        "the robust centre is rounded to float32 once more before the step, within an ulp of the float32 weights "
        "it is stored as",
}


def candidates(path: str) -> list[tuple[str, str, int]]:
    """(old line, new line, line number) for every swap on a code line that occurs once in the file."""
    src = (ROOT / path).read_text()
    lines = src.splitlines(keepends=True)
    skip: set[int] = set()
    for node in ast.walk(ast.parse(src)):  # docstrings
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            skip.update(range(node.lineno, node.end_lineno + 1))
    out = []
    for i, line in enumerate(lines, 1):
        code = line.split("#")[0]
        s = code.strip()
        if (i in skip or not s or s.startswith(("def ", "class ", "import ", "from ", "log.", "raise ", "@"))
                or '"' in code or "'" in code or src.count(line) != 1):
            continue
        for a, b in SWAPS:
            for m in re.finditer(re.escape(a), code):
                out.append((line, code[:m.start()] + b + code[m.end():] + line[len(code):], i))
    return out


def draw(areas: list[str], per_area: int, seed: int) -> list[MU.Mutant]:
    rng = random.Random(seed)
    out = []
    for area in areas:
        files, tests = AREAS[area]
        pool = [(f, *c) for f in files for c in candidates(f)]
        for f, old, new, line in rng.sample(pool, min(per_area, len(pool))):
            out.append(MU.Mutant(f"{area}.{Path(f).stem}:{line}", f, old, new, list(tests),
                                 f"{old.strip()} -> {new.strip()}"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/random_mutants.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-area", type=int, default=8, help="mutants drawn per area (default 8)")
    ap.add_argument("--seed", type=int, default=0, help="the draw (default 0); a new seed draws new mutants")
    ap.add_argument("--areas", nargs="*", choices=sorted(AREAS), default=sorted(AREAS))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant's tests (default 900)")
    ap.add_argument("--list", action="store_true", help="print the draw, run nothing")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.per_area < 1:
        ap.error("--per-area must be at least 1")
    mutants = draw(a.areas, a.per_area, a.seed)
    if a.list:
        for m in mutants:
            print(f"{m.id:32s} {m.what}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="fedge-random-mutants-"))
    results = []
    t0 = time.monotonic()
    try:
        copy = tmp / "w"
        shutil.copytree(ROOT, copy, ignore=MU.IGNORE)
        for m in mutants:
            r = MU.run_one(m, copy, a.timeout)
            why = EQUIVALENT.get((m.file, m.old.strip(), m.new.strip()))
            status = "equivalent" if r["status"] == "survived" and why else r["status"]
            print(f"  {status:10s} {m.id:32s} {r['seconds']:6.1f}s  {m.what[:110]}", flush=True)
            results.append({"id": m.id, "area": m.id.split(".")[0], "file": m.file, "old": m.old, "new": m.new,
                            "status": status, "by": r["by"], "equivalent_because": why or "",
                            "seconds": r["seconds"]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = {}
    for area in a.areas:
        rs = [r for r in results if r["area"] == area]
        live = [r for r in rs if r["status"] != "equivalent"]
        killed = sum(r["status"] == "killed" for r in live)
        table[area] = {"drawn": len(rs), "equivalent": len(rs) - len(live), "killed": killed, "of": len(live)}
    report = {"seed": a.seed, "per_area": a.per_area, "seconds": round(time.monotonic() - t0, 1),
              "areas": table, "mutants": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'area':12s} {'killed':>8s} {'equivalent':>11s}")
    for area, t in table.items():
        print(f"{area:12s} {t['killed']:>3d} of {t['of']:<3d} {t['equivalent']:>8d}")
    survivors = [r for r in results if r["status"] == "survived"]
    if survivors:
        print("survivors (a gap, or an equivalent mutant to record in EQUIVALENT with its reason):")
        for r in survivors:
            print(f"  {r['id']}: {r['old'].strip()} -> {r['new'].strip()}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
