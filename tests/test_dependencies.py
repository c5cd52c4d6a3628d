"""Every third-party import is declared in pyproject.toml, and no runtime dependency goes unused.

deptry reads the imports and the declarations; two runs because the rules differ by folder:
`src/` may import only runtime dependencies (an import of a dev-only package is DEP004), while
`tests/` and `benchmarks/` may import anything declared, dev extra included. Configuration
(first-party names, the two justified ignores) lives in pyproject.toml's [tool.deptry].
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _deptry(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deptry", *args], cwd=root,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [("src",), ("tests", "benchmarks", "--ignore", "DEP002,DEP004")],
                         ids=["src-runtime", "tests-benchmarks"])
def test_every_import_is_declared(args) -> None:
    out = _deptry(*args)
    assert out.returncode == 0, out.stdout + out.stderr


def test_an_undeclared_import_fails_the_check(tmp_path) -> None:
    """The check can fail: a copy of the project whose src imports a package pyproject does not
    declare (and one that only the dev extra declares) is refused."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    shutil.copy(ROOT / "README.md", copy / "README.md")
    assert _deptry("src", root=copy).returncode == 0
    module = copy / "src" / "mlsm" / "_probe_import.py"
    module.write_text("import pytest  # dev-only\n")
    out = _deptry("src", root=copy)
    assert out.returncode != 0 and "DEP004" in out.stdout + out.stderr
    module.write_text("import requests_toolbelt_not_declared  # noqa: F401\n")
    out = _deptry("src", root=copy)
    assert out.returncode != 0 and "DEP001" in out.stdout + out.stderr
