"""scripts/emulated_pi.sh on a fresh machine (issue 28): every failure is one "[emulated-pi] error:" line, bad
input exits 2, and a missing qemu-aarch64 registration is registered or named, never a silent exit. Runs
against a temporary directory standing in for binfmt_misc (FEDGE_BINFMT_DIR): nothing on the machine changes."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "emulated_pi.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("[emulated-pi] error: "), p.stderr
    return lines[0]


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.parametrize("args,env,says", [(["frobnicate"], {}, "unknown command 'frobnicate'"),
                                           (["info"], {"FEDGE_PI_CPUS": "two"}, "FEDGE_PI_CPUS=two"),
                                           (["info"], {"FEDGE_PI_CPU": "a99"}, "FEDGE_PI_CPU=a99")])
def test_bad_input_is_one_line_and_exit_2(args, env, says):
    p = _run(*args, **env)
    assert p.returncode == 2 and says in _one_error_line(p)


def _stub_qemu(tmp_path: Path) -> dict[str, str]:
    """PATH with a stand-in qemu-aarch64-static first, so that the registration steps run the same whether or not
    this machine has qemu-user-static (a fresh machine has not)."""
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir()
    qemu = bin_dir / "qemu-aarch64-static"
    qemu.write_text("#!/bin/sh\nexit 0\n")
    qemu.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def _binfmt_dir(tmp_path: Path, register: bool) -> Path:
    """A stand-in for a mounted binfmt_misc where qemu-aarch64 was never registered: a status file, the kernel's
    register file if ``register``, no qemu-aarch64 entry."""
    d = tmp_path / "binfmt_misc"
    d.mkdir()
    (d / "status").write_text("enabled\n")
    if register:
        (d / "register").write_text("")
    return d


def test_missing_registration_is_registered_or_named(tmp_path):
    """What ended the script with status 2 and no word: qemu-aarch64 not yet registered with binfmt_misc."""
    env = _stub_qemu(tmp_path)
    tmp_path = _binfmt_dir(tmp_path, register=False)
    p = _run("binfmt", FEDGE_BINFMT_DIR=str(tmp_path), **env)
    assert p.returncode == 1
    line = _one_error_line(p)
    if os.geteuid() != 0:  # says what to do
        assert "not registered" in line and "as root" in line
        return
    assert f"no {tmp_path}/register" in line  # no way to register: named
    (tmp_path / "register").write_text("")
    p = _run("binfmt", FEDGE_BINFMT_DIR=str(tmp_path), **env)
    # registered through the kernel's interface (here a plain file, so the entry never appears: named)
    assert (tmp_path / "register").read_text().startswith(":qemu-aarch64:M::\\x7fELF\\x02")
    assert p.returncode == 1 and "still not registered" in _one_error_line(p)


def test_mounted_but_never_registered_is_one_line(tmp_path):
    """binfmt_misc mounted (status and register files) and qemu-aarch64 never registered, the fresh machine's
    case: not root, one line saying so and what to run, nothing written; root, the registration is written to
    the register file (qemu's aarch64 magic, this qemu-aarch64-static, flag F) and, as the entry does not appear
    in a plain directory, one line saying it is still not registered. Never the silent exit 2."""
    env = _stub_qemu(tmp_path)
    d = _binfmt_dir(tmp_path, register=True)
    p = _run("binfmt", FEDGE_BINFMT_DIR=str(d), **env)
    assert p.returncode == 1, p.stderr
    line = _one_error_line(p)
    assert not (d / "qemu-aarch64").exists()
    if os.geteuid() != 0:
        assert "qemu-aarch64 is not registered in binfmt_misc" in line and "as root" in line
        assert (d / "register").read_text() == ""
        return
    written = (d / "register").read_text()
    assert written.startswith(":qemu-aarch64:M::\\x7fELF\\x02") and written.endswith(
        f":{tmp_path}/stub-bin/qemu-aarch64-static:F\n"), written
    assert f"qemu-aarch64 is still not registered in {d}" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="the registration steps run as root only")
def test_a_refused_registration_is_one_line_with_the_reason(tmp_path):
    """The kernel refusing the write to register (here: register is a directory) is one line with its reason,
    not the shell's message and then the script's."""
    env = _stub_qemu(tmp_path)
    d = _binfmt_dir(tmp_path, register=False)
    (d / "register").mkdir()
    p = _run("binfmt", FEDGE_BINFMT_DIR=str(d), **env)
    assert p.returncode == 1
    line = _one_error_line(p)
    assert "refused the qemu-aarch64 registration" in line and "Is a directory" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="the registration steps run as root only")
def test_no_qemu_to_register_is_one_line(tmp_path):
    """Root, qemu-aarch64 never registered and no qemu-aarch64-static on PATH (qemu-user-static not installed):
    one line naming the package. PATH holds only the tools the step uses."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for t in ("bash", "sed", "grep", "seq", "dirname", "cat", "date", "awk"):
        if (w := shutil.which(t)) and "qemu" not in w:
            (tools / t).symlink_to(w)
    d = _binfmt_dir(tmp_path, register=True)
    p = subprocess.run([str(tools / "bash"), str(SCRIPT), "binfmt"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": str(tools), "FEDGE_BINFMT_DIR": str(d)})
    assert p.returncode == 1
    assert "no qemu-aarch64-static: apt-get install qemu-user-static" in _one_error_line(p)
    assert (d / "register").read_text() == ""


def test_a_registration_whose_interpreter_is_gone_is_named_and_a_good_one_passes(tmp_path):
    (tmp_path / "status").write_text("enabled\n")
    reg = tmp_path / "qemu-aarch64"
    reg.write_text("enabled\ninterpreter /nonexistent/qemu-aarch64\nflags: F\n")
    p = _run("binfmt", FEDGE_BINFMT_DIR=str(tmp_path))
    assert p.returncode == 1 and _one_error_line(p)
    reg.write_text(f"enabled\ninterpreter {shutil.which('true')}\nflags: F\n")
    p = _run("binfmt", FEDGE_BINFMT_DIR=str(tmp_path))
    assert p.returncode == 0, p.stderr


def test_no_binfmt_misc_at_the_given_dir_is_one_line(tmp_path):
    p = _run("binfmt", FEDGE_BINFMT_DIR=str(tmp_path))
    assert p.returncode == 1 and "no binfmt_misc there" in _one_error_line(p)


def test_run_before_setup_is_one_line(tmp_path):
    p = _run("run", "true", FEDGE_PI_DIR=str(tmp_path / "pi"))
    assert p.returncode == 1 and "run" in _one_error_line(p) and "setup" in p.stderr


def test_the_benchmark_reports_the_scripts_error_line_and_last_lines(tmp_path):
    from benchmarks import emulated_pi as E
    env = {**os.environ, "FEDGE_BINFMT_DIR": str(tmp_path)}
    with pytest.raises(E.SetupFailed) as e:
        E.setup("cortex-a76", "binfmt", env=env)
    assert "binfmt exited 1: FEDGE_BINFMT_DIR=" in str(e.value) and e.value.tail
    silent = tmp_path / "silent.sh"  # a step that dies without a word: its last lines are what is shown
    silent.write_text("echo 'sed: cannot read /proc/sys/fs/binfmt_misc/qemu-aarch64' >&2\nexit 2\n")
    with pytest.raises(E.SetupFailed) as e:
        E.setup("cortex-a76", "setup", script=silent, env=env)
    assert "exited 2 with no error line" in str(e.value) and e.value.tail == [
        "sed: cannot read /proc/sys/fs/binfmt_misc/qemu-aarch64"]
