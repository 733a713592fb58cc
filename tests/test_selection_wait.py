"""A production round that waits for over-selection says so, and how to change it (issue 29): the first time in
one line at WARNING (a fleet smaller than the over-selected target), then at INFO once per round."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from coordinator.daemon import Coordinator
from coordinator.selection import over_selection_wait


def test_the_note_says_what_waits_and_the_fix():
    note = over_selection_wait(3, 3, 1.3, 3, 10.0)
    assert note.startswith("3 devices eligible, fewer than the 4 that over-selection asks for")
    assert "waits up to 10 s" in note and "over_selection = 1.0 to open at once" in note
    assert "clients_per_round = 2 and over_selection = 1.0" in over_selection_wait(2, 3, 1.3, 2, 10.0)
    assert "over_selection = 1.2 " in over_selection_wait(12, 10, 1.3, 8, 10.0)


def test_no_note_when_nothing_waits_for_over_selection():
    assert over_selection_wait(13, 10, 1.3, 8, 10.0) is None  # enough
    assert over_selection_wait(2, 3, 1.3, 3, 10.0) is None  # too few to open at all: not over-selection's wait
    assert over_selection_wait(3, 3, 1.3, 3, 0.0) is None  # no selection timeout: it opens at once


def _machine(eligible: int, rnd: int = 0, attempt: int = 0, **kw):
    cfg = SimpleNamespace(clients_per_round=3, over_selection=1.3, min_needed=3, selection_timeout_s=10.0,
                          reproducible=False)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return SimpleNamespace(open=None, finished=False, cfg=cfg, _window=list(range(eligible)), idle_since=0.0,
                           state=SimpleNamespace(round=rnd), attempt=attempt)


def test_the_daemon_says_it_once_a_round_warning_first(caplog):
    me = SimpleNamespace(machine=_machine(3))
    say = Coordinator._say_selection_wait
    with caplog.at_level(logging.INFO, logger="fedge.coordinator"):
        say(me, 0.5)  # (not yet: devices may still be checking in)
        say(me, 2.0)
        say(me, 3.0)  # the same round: said already
        me.machine = _machine(3, rnd=1)
        say(me, 4.0)
        me.machine = _machine(13, rnd=2)  # enough devices: nothing to say
        say(me, 5.0)
        me.machine = _machine(3, rnd=3, reproducible=True)
        say(me, 6.0)
    recs = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "fedge.coordinator"]
    assert [lvl for lvl, _ in recs] == [logging.WARNING, logging.INFO]
    assert recs[0][1].startswith("round 1: 3 devices eligible") and recs[1][1].startswith("round 2: ")
