"""Other libraries' warnings are filtered where fedge calls them (edge/quiet.py), and shown again with -v.

The run of docs/your-model.md's section 3 on ONNX Runtime and ExecuTorch devices (FedSparse on the person's CNN,
scaled down to 4 devices and 2 rounds, with a fresh program cache so that every program is exported) prints
nothing but fedge's own table at default verbosity: no torchao, pytree, cpuinfo or threadpool line.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Prints what the libraries' noise is made of, inside and outside quiet(); "-v" sets the root logger to INFO.
_NOISE = r"""
import logging, os, sys, warnings
logging.basicConfig(level=logging.INFO if "-v" in sys.argv else logging.WARNING, format="%(name)s %(message)s")
from edge.quiet import quiet

def noise(tag):
    warnings.warn(f"pytree FutureWarning {tag}", FutureWarning)
    logging.getLogger("torchao").warning(f"Failed to load .so {tag}")
    logging.getLogger("torch.utils._pytree").warning(f"Enum subclass {tag}")
    os.write(2, f"[cpuinfo_utils.cpp:71] Reading file {tag}\n".encode())
    os.write(2, f"another thread's line {tag}\n".encode())
    logging.getLogger("fedge.x").error(f"an error {tag}")

with quiet(native=True):
    noise("inside")
noise("outside")
"""


def _noise(*args: str) -> str:
    p = subprocess.run([sys.executable, "-c", _NOISE, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    return p.stderr


def test_quiet_filters_other_libraries_and_keeps_errors_and_other_lines():
    err = _noise()
    inside = [ln for ln in err.splitlines() if "inside" in ln]
    assert inside == ["another thread's line inside", "fedge.x an error inside"], err
    assert len([ln for ln in err.splitlines() if "outside" in ln]) >= 5  # outside the block: all of it


def test_verbose_shows_them_again():
    err = _noise("-v")
    for what in ("pytree FutureWarning inside", "Failed to load .so inside", "Enum subclass inside",
                 "[cpuinfo_utils.cpp:71] Reading file inside", "another thread's line inside"):
        assert what in err, (what, err)


FEDGE_LINE = re.compile(r"^(round +accuracy .*|\s*\d+\s+\d\.\d{4}\s.*|unused: selected devices .*|final accuracy .*)$")


def _ort_executorch_command() -> str:
    doc = (ROOT / "docs" / "your-model.md").read_text()
    block = doc[doc.index("## 3. Simulate a fleet"):doc.index("## 4.")]
    cmds = [c for c in re.findall(r"```sh\n(.*?)```", block, re.S) if "--runtimes ort,executorch" in c]
    assert len(cmds) == 1, "docs/your-model.md section 3 has one ORT + ExecuTorch command"
    return cmds[0].strip()


@pytest.mark.slow
def test_the_ort_and_executorch_run_prints_only_fedge(tmp_path):
    argv = shlex.split(_ort_executorch_command())
    assert argv[:2] == ["fedge", "simulate"] and "..." not in argv
    small = {"--devices": "4", "--clients-per-round": "2", "--rounds": "2"}
    for i, a in enumerate(argv):
        if a in small:
            argv[i + 1] = small[a]
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    subprocess.run([sys.executable, "examples/your_model/make_data.py", "--out", "runs/your-model/digits.npz"],
                   cwd=tmp_path, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    exe = Path(sys.executable).parent / "fedge"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "coordinator.cli"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), FEDGE_PROGRAM_CACHE=str(tmp_path / "programs"))
    env.pop("FEDGE_LOG", None)
    p = subprocess.run([*cmd, *argv[1:], "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr == "", "lines on stderr at default verbosity:\n" + p.stderr[-3000:]
    other = [ln for ln in p.stdout.splitlines() if not FEDGE_LINE.match(ln)]
    assert not other, f"lines that are not fedge's: {other}"
    assert "density" in p.stdout and (tmp_path / "runs" / "your-model" / "fedsparse.json").is_file()
