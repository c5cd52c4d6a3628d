"""The conventions of a released package: licence, citation, version, changelog, a wheel that
carries every module (the installed `mlsm demo` needs nothing from the source tree)."""

from __future__ import annotations

import os
import re
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
    every module of src/mlsm, the `mlsm` entry point, the licence and the PEP 561 marker
    (py.typed), at this version; src/mlsm holds nothing but modules and the package data
    pyproject declares."""
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
    stem = re.sub(r"[-_.]+", "_", mlsm.DISTRIBUTION)  # the wheel's spelling of the name
    assert wheel.name == f"{stem}-{mlsm.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    src = tmp_path / "src"
    modules = {p.relative_to(src).as_posix() for p in src.rglob("*.py")}
    assert modules and modules <= names, sorted(modules - names)[:5]
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["mlsm"]
    other = [p.relative_to(src / "mlsm").as_posix() for p in (src / "mlsm").rglob("*")
             if p.is_file() and p.suffix != ".py"]
    assert set(other) == set(declared), f"package data not declared in pyproject: {other[:3]}"
    assert {f"mlsm/{name}" for name in declared} <= names and "mlsm/py.typed" in names
    dist_info = f"{stem}-{mlsm.__version__}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    entry = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "mlsm = mlsm.cli:main" in entry


def _pep503(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# `pip install ...` up to the end of its command (a backtick, a quote-free separator, a line end)
PIP_INSTALL = re.compile(r"pip3? install\b([^`\n;&|)]*)")


def test_installs_are_from_the_clone_under_the_name_the_docs_give() -> None:
    """`mlsm` on PyPI is an unrelated 2016 project: no page, citation or message tells a user to
    `pip install` it (`mlsm`, `"mlsm[hf]"`), nor this project's own distribution name, which is
    not published yet; installs are from the clone (`pip install -e ".[hf]"`). The name the
    README gives is pyproject's and `mlsm.DISTRIBUTION` (what `mlsm --version` looks up)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert name == mlsm.DISTRIBUTION and _pep503(name) != "mlsm"
    assert re.findall(r"distribution is named `([^`]+)`", (ROOT / "README.md").read_text()) \
        == [name]
    files = [ROOT / "README.md", ROOT / "CITATION.cff", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "src").rglob("*.py"))]
    from_index = []
    for path in files:
        for words in PIP_INSTALL.findall(path.read_text(encoding="utf-8")):
            names = [re.split(r"[\[<>=!~@ ]", w.strip("'\""))[0] for w in words.split()]
            if {_pep503(n) for n in names} & {"mlsm", _pep503(name)}:
                from_index.append(f"{path.relative_to(ROOT)}: pip install{words}")
    assert not from_index, from_index
    assert name in yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))["message"]


# the repository's own output folders, which no shipped test may expect to find
_OUTPUTS = {"runs"}
_CHAIN = re.compile(r'(?:ROOT|parents\[1\])((?:\s*/\s*"[^"]+")+)')


def test_sdist_ships_what_its_tests_read_and_no_study_results(tmp_path: Path) -> None:
    """`python -m build --sdist` (no isolation: offline) on a copy of the tree: the metadata has
    authors, keywords and classifiers; the published study results (megabytes) stay out, the
    package's type marker is in; and every repository path a shipped test names (ROOT / NAME /
    ...) is in the sdist, so its tests run from it (tests of the repository itself, which read
    benchmarks/ or the study pages, are not shipped)."""
    pytest.importorskip("build")
    import tarfile

    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", "runs", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache",
        "dist", "build"))
    done = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation",
                           "--outdir", str(tmp_path / "dist"), str(tree)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    (top,) = (tmp_path / "x").iterdir()
    meta = (top / "PKG-INFO").read_text()
    assert "Author: the mlsm developers" in meta and "Keywords:" in meta
    assert "Classifier: Typing :: Typed" in meta and (top / "src" / "mlsm" / "py.typed").is_file()
    results = [p for p in (top / "docs" / "results").rglob("*") if p.is_file()]
    assert all(p.relative_to(top / "docs" / "results").parts[0] == "demo" for p in results)
    docs = sum(p.stat().st_size for p in (top / "docs").rglob("*") if p.is_file())
    assert docs < 2_000_000, f"docs/ weighs {docs:,} bytes in the sdist"
    missing = []
    for test in sorted((top / "tests").glob("*.py")):
        for chain in _CHAIN.findall(test.read_text(encoding="utf-8")):
            parts = re.findall(r'"([^"]+)"', chain)
            if parts[0] not in _OUTPUTS and not (top.joinpath(*parts)).exists():
                missing.append(f"{test.name}: {'/'.join(parts)}")
    assert not missing, missing
    assert (top / "tests" / "test_hf_trainer_hub.py").is_file()  # the package's tests ship
    # from the unpacked sdist: every shipped test module imports, and the docs' links resolve
    env = {**os.environ, "PYTHONPATH": str(top / "src")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_docs_truth.py", "-k", "relative_links"],
                         cwd=top, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:]
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--collect-only"], cwd=top, env=env, capture_output=True,
                            text=True, timeout=600)
    assert listed.returncode == 0, listed.stdout[-2000:]
