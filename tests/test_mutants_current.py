"""benchmarks/mutants.py stays current (issue 28): every mutant's original text occurs exactly once in its file,
so the mutation harness can run and its figure can be reproduced. A change to the source that moves or
duplicates a mutated line fails here, naming the entry, instead of stopping the harness months later.

When this fails: read the named entry's target in today's source and change the entry's ``old``/``new`` so it
makes the same slip in the code that is there now (benchmarks/mutants.py's header)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks import mutants as MU

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutant_matches_the_source_exactly_once():
    found = MU.problems(MU.MUTANTS, MU.EQUIVALENT)
    assert not found, (f"{len(found)} of {len(MU.MUTANTS)} mutant entries in benchmarks/mutants.py no longer match "
                       "the source:\n  " + "\n  ".join(found))


def test_the_check_names_stale_entries(tmp_path, monkeypatch):
    """The check above can fail: text gone, text twice, a test renamed, a file gone, a repeated id."""
    (tmp_path / "src.py").write_text("a = 1\nb = a + 1\nc = a + 1\n")
    (tmp_path / "test_x.py").write_text("def test_one():\n    pass\n")
    monkeypatch.setattr(MU, "ROOT", tmp_path)
    M = MU.Mutant
    entries = [M("ok", "src.py", "b = a", "b = -a", ["test_x.py::test_one"]),
               M("gone", "src.py", "d = a", "d = -a", ["test_x.py"]),
               M("twice", "src.py", "= a + 1", "= a - 1", ["test_x.py"]),
               M("renamed-test", "src.py", "a = 1", "a = 2", ["test_x.py::test_two"]),
               M("no-file", "moved.py", "x", "y", ["test_x.py"]),
               M("ok", "src.py", "c = a", "c = -a", ["test_x.py"])]
    found = MU.problems(entries, [{"file": "src.py", "old": "e = 0", "new": "", "why": ""}])
    assert found == ["gone: old text found 0 times in src.py (must be exactly once)",
                     "twice: old text found 2 times in src.py (must be exactly once)",
                     "renamed-test: no test test_two in test_x.py",
                     "no-file: no file moved.py",
                     "ok: duplicate mutant id",
                     "equivalent 'e = 0': not found in src.py"]
    assert MU.problems(entries[:1]) == []


def test_list_runs_the_check_and_lists_every_mutant():
    p = subprocess.run([sys.executable, "benchmarks/mutants.py", "--list"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.splitlines()) == len(MU.MUTANTS)


def test_an_unknown_id_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, "benchmarks/mutants.py", "--list", "--only", "no.such-mutant"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "no.such-mutant" in p.stderr


def test_random_mutants_areas_and_equivalents_match_the_source():
    """benchmarks/random_mutants.py: every area's files and tests exist, every area has lines to mutate, a seed
    draws the same mutants twice, and each recorded equivalent mutant still names a line of its file (else
    its reason no longer covers anything, and a survivor of that line would be hidden under a stale excuse)."""
    from benchmarks import random_mutants as RM
    for area, (files, tests) in RM.AREAS.items():
        for f in [*files, *tests]:
            assert (ROOT / f).is_file(), (area, f)
        assert len([c for f in files for c in RM.candidates(f)]) >= 20, area
    ids = [(m.id, m.new) for m in RM.draw(sorted(RM.AREAS), 3, seed=7)]
    assert ids == [(m.id, m.new) for m in RM.draw(sorted(RM.AREAS), 3, seed=7)] and len(ids) == 3 * len(RM.AREAS)
    for (f, old, new), why in RM.EQUIVALENT.items():
        lines = [ln.strip() for ln in (ROOT / f).read_text().splitlines()]
        assert lines.count(old) == 1 and old != new and why, (f, old)
