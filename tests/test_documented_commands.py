"""Every command in a ```sh / ```bash block of README.md and docs/*.md runs as written, or is checked (issue 29).

A newcomer types them in a fresh shell after ``make demo`` and the one setup line the README states
(``. .venv/bin/activate``). For every line this test:

- ``fedge ...``, ``fedge-device ...``: parses it with the real argparse parsers (the subcommand exists, every
  flag exists, values have their type and are among the choices);
- ``python -m MODULE ...``, ``python path/to/script.py ...``: the module or script exists and its own argparse
  parser accepts the arguments (the script runs up to its ``parse_args``, not further);
- ``make TARGET``: the Makefile has the target; ``bash script``, ``node file``: the file exists;
- runs the cheap ones (``--help``, ``--list``);
- checks that every file of the repository a line names exists.

Lines that cannot be checked here (system administration, other programs, placeholders such as ``<fedge>``)
are listed in ``UNCHECKED`` with the reason; a line that is neither checkable nor listed fails, and so does a
listed line that is no longer in the docs.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_DIRS = {"examples", "scripts", "benchmarks", "deploy", "clients", "docs", "coordinator", "edge", "export",
             "firmware_tests", "tests"}

# Exact command, as a shell reads it (continuation lines joined, no comment, no trailing &) -> why it is not checked.
_UNCHECKED = {
    "useradd --system --home-dir /var/lib/fedge --shell /usr/sbin/nologin fedge": "system administration (root)",
    "useradd --system --home-dir /var/lib/fedge-device --shell /usr/sbin/nologin fedge": "system administration",
    "git clone '<fedge>' /opt/fedge/src": "placeholder: where the reader's copy of fedge is",
    "python3 -m venv /opt/fedge/venv": "creates a venv outside the repository",
    "/opt/fedge/venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu":
        "installs into a system venv from the network",
    "/opt/fedge/venv/bin/pip install '/opt/fedge/src[coordinator]'": "installs into a system venv",
    "install -d -m 0750 -o root -g fedge /etc/fedge": "system administration (root)",
    "install -m 0640 -o root -g fedge fleet.toml test.npz /etc/fedge/": "system administration; the reader's files",
    "install -m 0640 -o root -g fedge device.toml ca.pem local.npz /etc/fedge/":
        "system administration; the reader's files",
    "install -m 644 /opt/fedge/src/deploy/systemd/fedge-coordinator.service /etc/systemd/system/":
        "system administration (the unit file itself is checked: deploy/systemd)",
    "install -m 644 deploy/systemd/fedge-device.service /etc/systemd/system/": "system administration (root)",
    "systemctl daemon-reload": "systemd",
    "systemctl enable --now fedge-coordinator": "systemd",
    "systemctl enable --now fedge-device": "systemd",
    "systemctl status fedge-coordinator": "systemd",
    "journalctl -u fedge-coordinator -f": "systemd",
    "journalctl -u fedge-device -f": "systemd",
    "python3 -m venv /opt/fedge/venv": "creates a venv outside the repository",
    "/opt/fedge/venv/bin/pip install 'fedge[device-torch]'": "installs on a device, from a package index",
    "python3 -m venv ~/fedge": "creates a venv on a Raspberry Pi",
    ". ~/fedge/bin/activate": "activates the Pi's venv",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": "installs on a Pi from the network",
    "pip install 'fedge[device-executorch]'": "installs on a Pi from a package index",
    "mosquitto -p 1883": "another program (tests/test_your_model.py runs it with this page's other commands)",
    "build/native/fedge-native --broker mqtt://127.0.0.1:18830 --fleet conf --id nat-1 --data data.npz":
        "built by scripts/build_native.sh (tests/test_native_device.py runs it)",
}
UNCHECKED = {shlex.join(shlex.split(k)): why for k, why in _UNCHECKED.items()}


def documented_blocks() -> list[tuple[Path, int, str]]:
    """(file, line of the block's first command, text) of every sh/bash block."""
    out = []
    for f in DOCS:
        text = f.read_text()
        for m in re.finditer(r"^```(?:sh|bash)\n(.*?)^```", text, re.M | re.S):
            out.append((f, text[:m.start()].count("\n") + 2, m.group(1)))
    return out


def commands_of(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and a trailing ``&`` dropped, ``&&`` split."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        part: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", ";"):
                if part:
                    out.append(shlex.join(part))
                part = []
            elif w != "&":  # (in the background: the same command)
                part.append(w)
    return out


COMMANDS = [(f"{f.relative_to(ROOT)}:{line}", c) for f, line, block in documented_blocks() for c in commands_of(block)]


def test_the_docs_have_commands():
    assert len(COMMANDS) > 40
    assert any(c.startswith("fedge simulate") for _, c in COMMANDS)


def test_unchecked_lines_are_still_in_the_docs():
    documented = {c for _, c in COMMANDS}
    stale = [c for c in UNCHECKED if c not in documented]
    assert not stale, f"listed as unchecked but no longer documented: {stale}"


def test_the_readme_states_the_setup_line():
    """The docs' bare ``fedge`` and ``python`` are the venv's: the README says so once, beside the first commands."""
    readme = (ROOT / "README.md").read_text()
    first = readme[:readme.index("## What it is")]
    assert ". .venv/bin/activate" in first
    f, _line, block = documented_blocks()[0]
    assert f.name == "README.md" and commands_of(block) == ["make demo", "make test"]  # the first screen: two


def _argparse_error(fn) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            fn()
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip() or f"exit {e.code}"
    return None


# Runs a script or module up to its argparse parse_args, and stops there: exit 0 if its arguments parse.
_PARSE_ONLY = r"""
import argparse, runpy, sys
class Parsed(BaseException):
    pass
plain = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    plain(self, args, namespace)
    raise Parsed()
argparse.ArgumentParser.parse_args = parse_args
kind, target, *rest = sys.argv[1:]
sys.argv = [target, *rest]
try:
    if kind == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, __import__("os").path.dirname(target))
        runpy.run_path(target, run_name="__main__")
except Parsed:
    sys.exit(0)
print("it ran without parsing arguments", file=sys.stderr)
sys.exit(3)
"""


def _python_parses(kind: str, target: str, args: list[str]) -> str | None:
    p = subprocess.run([sys.executable, "-c", _PARSE_ONLY, kind, target, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]


def _repo_files(argv: list[str]) -> list[str]:
    """Arguments that name a file or directory of the repository (examples/..., scripts/..., ...)."""
    out = []
    for a in argv:
        a = a.partition("=")[2] if a.startswith("--") and "=" in a else a
        path = re.sub(r"\.py:\w+$", ".py", a)  # a model factory: the file
        if "/" in path and path.split("/")[0] in REPO_DIRS:
            out.append(path)
    return out


def check(cmd: str) -> str | None:
    """Why ``cmd`` is wrong, or None."""
    argv = shlex.split(cmd)
    missing = [p for p in _repo_files(argv) if not (ROOT / p).exists()]
    if missing:
        return f"no such file in the repository: {missing}"
    prog, args = argv[0], argv[1:]
    if prog == "fedge":
        from coordinator.cli import parser
        return _argparse_error(lambda: parser().parse_args(args))
    if prog == "fedge-device":
        from edge.cli import parser
        return _argparse_error(lambda: parser().parse_args(["device", *args]))
    if prog in ("python", "python3") and args[:1] == ["-m"]:
        import importlib.util
        if importlib.util.find_spec(args[1]) is None:
            return f"no module {args[1]}"
        if args[1] in ("venv", "pip"):
            return None
        return _python_parses("-m", args[1], args[2:])
    if prog in ("python", "python3") and args and args[0].endswith(".py"):
        return _python_parses("path", str(ROOT / args[0]), args[1:])
    if prog == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        return None if set(args) <= targets else f"no make target {sorted(set(args) - targets)}"
    if prog in ("bash", "node"):
        return None if (ROOT / args[0]).is_file() else f"no such file {args[0]}"
    if prog.startswith("scripts/"):
        return None if (ROOT / prog).is_file() else f"no such script {prog}"
    return "not checked: add it to UNCHECKED with the reason"


@pytest.mark.parametrize("where,cmd", [(w, c) for w, c in COMMANDS if c not in UNCHECKED],
                         ids=[f"{w} {c[:50]}" for w, c in COMMANDS if c not in UNCHECKED])
def test_a_documented_command_parses(where, cmd):
    problem = check(cmd)
    assert problem is None, f"{where}: `{cmd}`: {problem}"


CHEAP = [(w, c) for w, c in COMMANDS if c not in UNCHECKED and re.search(r"(^|\s)--(help|list)(\s|$)", c)]


@pytest.mark.parametrize("where,cmd", CHEAP, ids=[c for _, c in CHEAP])
def test_a_cheap_documented_command_runs(where, cmd):
    argv = shlex.split(cmd)
    exe = Path(sys.executable).parent / argv[0]
    argv = [str(exe), *argv[1:]] if exe.exists() else [sys.executable, "-m", "coordinator.cli", *argv[1:]]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0 and p.stdout.strip(), f"{where}: `{cmd}`: {p.stderr[-2000:]}"


def test_the_checker_catches_mistakes():
    """The check above fails what a reader would trip on."""
    assert "simulate" in (check("fedge simulat --rounds 3") or "")
    assert "--epohcs" in (check("fedge simulate --epohcs 3") or "")
    assert "invalid choice" in (check("fedge export --runtime tflite") or "")
    assert "no such file" in (check("python examples/your_model/make_dta.py --out x.npz") or "")
    assert check("python examples/your_model/make_data.py --outt x.npz") is not None
    assert "no make target" in (check("make dmeo") or "")
    assert "not checked" in (check("rm -rf /") or "")
    assert check("fedge simulate --rounds 3 --broker mosquitto") is None
    assert commands_of("a --x 1 \\\n  --y 2   # c\nb && c &\n") == ["a --x 1 --y 2", "b", "c"]


def test_the_readme_fleet_example_runs_on_the_data_its_recipe_makes(tmp_path):
    """README: the data recipe, then its fleet.toml loads (the MLP fits the test data) and its device.toml names a
    file the recipe wrote, with x and y."""
    import tomllib

    from coordinator.config import load_fleet
    from edge.runtime.data import load_npz
    readme = (ROOT / "README.md").read_text()
    recipe = [c for _, c in COMMANDS if "make_data.py" in c and "--flat" in c]
    assert len(recipe) == 1
    argv = shlex.split(recipe[0])
    p = subprocess.run([sys.executable, str(ROOT / argv[1]), *argv[2:]], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    fleet, device = re.findall(r"```toml\n(.*?)```", readme, re.S)[:2]
    (tmp_path / "fleet.toml").write_text(fleet)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        fc = load_fleet("fleet.toml")
        x, y = load_npz(tomllib.loads(device)["device"]["data"])
    finally:
        os.chdir(cwd)
    assert fc.test == "test.npz" and x.shape[1:] == (64,) and fc.sizes[0] == 64 and y.max() < fc.sizes[-1]
