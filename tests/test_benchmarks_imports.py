"""Every import in benchmarks/ and scripts/, including those inside functions (benchmarks import lazily, so a
module moved by a re-lay breaks them only when that scenario runs), resolves against the package."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("edge", "coordinator", "export", "firmware_tests", "benchmarks")
FILES = sorted(p for d in ("benchmarks", "scripts") for p in (ROOT / d).glob("*.py"))


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in OURS:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in OURS:
                    yield node.lineno, a.name, []


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_import_resolves(path):
    missing = []
    for line, module, names in _imports(path):
        try:
            m = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{path.name}:{line}: {module} ({e})")
            continue
        for n in names:
            if n != "*" and not hasattr(m, n):
                try:
                    importlib.import_module(f"{module}.{n}")
                except ImportError:
                    missing.append(f"{path.name}:{line}: {module}.{n}")
    assert not missing, "\n".join(missing)
