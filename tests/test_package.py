"""The conventions of a released package: licence, citation, version, changelog, a wheel that
carries every module (the installed `mlsm demo` needs nothing from the source tree)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

import mlsm
from mlsm.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ["Masked Latent Semantic Modeling: an Efficient",  # Berend 2023
          "Hitchhikers' Guide to Masked Latent Semantic Modeling",
          "Should We Still Pretrain Encoders with Masked Language Modeling?",
          "Representation Deficiency in Masked Language Modeling",  # MAE-LM
          "Masked Language Model Scoring"]  # PLL


def test_version_flag(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mlsm {mlsm.__version__}"


def test_license_and_citation_agree_with_the_package() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "MIT" and "version" in meta["dynamic"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert {"message", "title", "authors"} <= cff.keys()
    assert (cff["version"], cff["license"]) == (mlsm.__version__, meta["license"])
    titles = [ref["title"] for ref in cff["references"]]
    assert all(ref.get("authors") and ref.get("type") for ref in cff["references"])
    for paper in PAPERS:
        assert any(t.startswith(paper) for t in titles), paper


def test_changelog_has_this_version() -> None:
    assert f"## [{mlsm.__version__}]" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def test_wheel_carries_every_module(tmp_path: Path) -> None:
    """`python -m build --wheel` (no isolation: offline) on a copy of the tree: the wheel holds
    every module of src/mlsm, the `mlsm` entry point and the licence, at this version; src/mlsm
    holds nothing but modules (package data would need declaring)."""
    pytest.importorskip("build")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy2(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "src", tmp_path / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                           "--outdir", str(tmp_path / "dist"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name == f"mlsm-{mlsm.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    src = tmp_path / "src"
    modules = {p.relative_to(src).as_posix() for p in src.rglob("*.py")}
    assert modules and modules <= names, sorted(modules - names)[:5]
    other = [p for p in (src / "mlsm").rglob("*") if p.is_file() and p.suffix != ".py"]
    assert not other, f"package data not declared in pyproject: {other[:3]}"
    dist_info = f"mlsm-{mlsm.__version__}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    entry = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "mlsm = mlsm.cli:main" in entry
