"""`make demo` installs only what the demo runs (issue 29): torch and the [coordinator] extra, not the export
toolchain, scikit-learn or the test tools; `make test` installs everything ([dev])."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_FOR_THE_DEMO = ("onnx", "onnxruntime", "executorch", "sklearn", "scipy", "pytest", "hypothesis")


def test_the_makefile_installs_the_demo_apart():
    mk = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo: (.*)$", mk, re.M)[1].split()
    test = re.search(r"^test: (.*)$", mk, re.M)[1].split()
    assert demo == ["$(DEMO_STAMP)"] and test[0] == "$(STAMP)" and set(test[1:]) <= {"web-deps"}
    demo_rule = mk[mk.index("$(DEMO_STAMP): "):mk.index("\n\n", mk.index("$(DEMO_STAMP): "))]
    full_rule = mk[mk.index("$(STAMP): "):mk.index("\n\n", mk.index("$(STAMP): "))]
    assert '-e ".[coordinator]"' in demo_rule and "dev" not in demo_rule
    assert '-e ".[dev]"' in full_rule


def test_the_coordinator_extra_is_what_the_demo_needs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[=<>\[ ]", r)[0] for r in extras["coordinator"]}
    assert names == {"torch", "matplotlib", "tqdm", "amqtt"}
    assert any(r.startswith("scikit-learn") for r in extras["dev"])  # the benchmarks keep it


def test_the_demo_runs_without_the_rest(tmp_path):
    """The demo's command, at a small scale, with none of NOT_FOR_THE_DEMO importable."""
    code = (f"import sys\nfor m in {NOT_FOR_THE_DEMO!r}:\n    sys.modules[m] = None\n"
            "from coordinator.cli import main\n"
            "sys.exit(main(['simulate', '--devices', '4', '--clients-per-round', '2', '--rounds', '2', '--epochs', '1',"
            " '--processes', '1', '--no-progress', '--workdir', 'w', '--out', 'r.json', '--plot', 'r.png']))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "final accuracy" in p.stdout and (tmp_path / "r.png").stat().st_size > 5000


def test_the_shipped_digits_are_sklearns():
    datasets = pytest.importorskip("sklearn.datasets")
    from coordinator.datasets import load_digits_xy
    x, y = load_digits_xy()
    d = datasets.load_digits()
    assert x.dtype == np.float32 and np.array_equal(x, (d.data / 16.0).astype(np.float32))
    assert np.array_equal(y, d.target.astype(np.int64))
