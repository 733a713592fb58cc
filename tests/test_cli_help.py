"""``--help`` of every subcommand (``fedge <sub> --help``, ``fedge-device --help``): a description, every option
with its help text, its default when it has one, and its choices."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from coordinator.cli import parser as fedge_parser
from edge.cli import parser as device_parser


def subcommands(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    out = {}
    for act in ap._actions:
        if isinstance(act, argparse._SubParsersAction):
            out.update(act.choices)
    return out


FEDGE = subcommands(fedge_parser())
ALL = {f"fedge {k}": p for k, p in FEDGE.items()} | {"fedge-device": subcommands(device_parser())["device"]}


def test_every_subcommand_is_walked():
    assert {"broker", "coordinator", "device", "simulate", "export", "conformance", "fleetsim", "status",
            "credentials", "ingest", "devices"} <= set(FEDGE)


@pytest.mark.parametrize("name", sorted(ALL))
def test_help_describes_every_option(name):
    p = ALL[name]
    assert p.description and "\n" not in p.description.strip(), f"{name}: no one-line description"
    text = p.format_help()
    assert p.description.split()[0] in text
    for act in p._actions:
        if isinstance(act, argparse._HelpAction):
            continue
        flag = "/".join(act.option_strings) or act.dest
        assert act.help and act.help is not argparse.SUPPRESS and len(act.help) > 3, f"{name} {flag}: no help"
        shown = HelpText(p, act)
        has_default = act.default not in (None, False, [], "", argparse.SUPPRESS) and act.nargs != 0
        if has_default:
            assert "default" in shown.lower(), f"{name} {flag}: default {act.default!r} not in its help: {shown!r}"
            assert str(act.default if not isinstance(act.default, list) else act.default[0]) in shown or \
                "default:" in shown.lower(), f"{name} {flag}: {shown!r}"
        if act.choices is not None and act.metavar is not None:  # the metavar hides argparse's {a,b,c}
            missing = [c for c in act.choices if str(c) not in shown]
            assert not missing, f"{name} {flag}: choices {missing} not listed"


def HelpText(p: argparse.ArgumentParser, act: argparse.Action) -> str:
    """The help line of ``act`` as ``--help`` prints it (defaults expanded), with its metavar's choices."""
    f = p._get_formatter()
    h = f._expand_help(act) if act.help else ""
    if act.choices is not None and act.metavar is None and act.option_strings:
        h += " {" + ",".join(map(str, act.choices)) + "}"
    return h


def test_simulate_help_lists_strategies_and_defaults():
    text = FEDGE["simulate"].format_help()
    for s in ("fedavg", "fedsparse", "fedprox", "sfvi"):
        assert s in text
    for flag, default in (("--rounds", "30"), ("--lr", "0.05"), ("--epochs", "1")):
        line = text[text.index("\n  " + flag + " "):]  # its line under options:, not the usage's
        assert f"default: {default}" in " ".join(line[:400].split()), flag


@pytest.mark.parametrize("argv", [["fedge", "coordinator", "--help"], ["fedge", "simulate", "--help"],
                                  ["fedge-device", "--help"]])
def test_help_runs(argv):
    from pathlib import Path
    exe = Path(sys.executable).parent / argv[0]
    p = subprocess.run([str(exe), *argv[1:]], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "" and "options:" in p.stdout, p.stderr
