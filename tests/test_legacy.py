"""The compatibility code for mlsm 0.1.0's artifacts has one list and an end (`artifacts/legacy`).

Every older form a reader accepts is named in `FORMS` with the module that reads it; each is read
behind `tolerated(FORM)`, called in that module and nowhere else; no call names a form the list
lacks; and this version is before `SUNSET`, so the release that reaches it fails here until the
branches are deleted. What each branch does once its form is struck from the list (refuse, or
treat the folder as one of other inputs) is tested beside the branch's own test
(test_prepare_parallel, test_dictionary, test_targets, test_artifacts_checkpoint, test_study).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from mlsm import __version__
from mlsm.artifacts import legacy
from mlsm.errors import UserError

SRC = Path(__file__).resolve().parents[1] / "src"


def _calls() -> dict[str, set[str]]:
    """{form: modules whose code calls tolerated("form")} over the package's source."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted((SRC / "mlsm").rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "tolerated":
                arg = node.args[0] if node.args else None
                assert isinstance(arg, ast.Constant), f"{module}: tolerated() takes a literal form"
                found[arg.value].add(module)
    return found


def test_every_form_is_read_in_the_module_it_names_and_nowhere_else() -> None:
    calls = _calls()
    assert set(calls) == set(legacy.FORMS), (
        f"forms called but not listed: {sorted(set(calls) - set(legacy.FORMS))}; "
        f"listed but never called (delete them): {sorted(set(legacy.FORMS) - set(calls))}")
    for form, (module, _) in legacy.FORMS.items():
        assert calls[form] == {module}, f"{form}: read in {sorted(calls[form])}, listed in {module}"


def test_this_version_reads_them_only_before_the_sunset() -> None:
    where = sorted({module for module, _ in legacy.FORMS.values()})
    assert not legacy.past_sunset(__version__), (
        f"mlsm {__version__} reached legacy.SUNSET ({legacy.SUNSET}): delete the branches behind "
        f"tolerated(...) in {', '.join(where)}, their tests' older folders, and the forms")
    assert all(legacy.tolerated(form) for form in legacy.FORMS)
    assert not legacy.tolerated("no-such-form")


@pytest.mark.parametrize(("version", "past"), [
    ("0.1.0", False), ("0.2.9", False), ("0.2.10", False), ("0.3.0", True), ("0.3.0rc1", True),
    ("0.3.0.dev2", True), ("0.10.0", True), ("1.0", True), ("0.2", False),
])
def test_the_sunset_compares_release_numbers(version: str, past: bool) -> None:
    """Numbers, not text ('0.10' is after '0.3'); a pre-release of the sunset is already past it."""
    assert legacy.past_sunset(version) is past


def test_migrate_without_its_form_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    from mlsm.migrate import migrate

    monkeypatch.delitem(legacy.FORMS, "checkpoint-facts-unrecorded")
    with pytest.raises(UserError, match="no longer migrates checkpoints of mlsm 0.1"):
        migrate(tmp_path)
