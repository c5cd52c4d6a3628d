"""The house keeps its layer order: every import of an mlsm module (lazy ones inside functions
included: a lazy import is still a circle) points to the same layer or one below, and no set of
modules imports each other in a loop. The order is the one docs/architecture.md states, so the page
and the code cannot part: a new top-level module fails here until the page places it."""

from __future__ import annotations

import ast
import re
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def stated_layers() -> dict[str, int]:
    """{top-level name: floor} from the ```layers block of docs/architecture.md (top floor
    first, one floor a line: `N name name ...`)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md lost its ```layers block"
    floors: dict[str, int] = {}
    for line in block.group(1).splitlines():
        number, *names = line.split()
        floors.update({name: int(number) for name in names})
    return floors


def modules() -> dict[str, Path]:
    """{dotted module name: file} of the package (a package is its __init__.py)."""
    found = {}
    for path in sorted((SRC / "mlsm").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(found: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) for every `import mlsm...` / `from mlsm... import` anywhere in a file
    (names imported from a package resolve to the submodule when one exists)."""
    def resolve(name: str) -> str:
        while name not in found and "." in name:
            name = name.rsplit(".", 1)[0]
        return name
    edges = set()
    for module, path in found.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x / from .a import b
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1],
                                     *([base] if base else [])])
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "mlsm" and resolve(name) != module:
                    edges.add((module, resolve(name)))
    return edges


def top(module: str, floors: dict[str, int] | None = None) -> str:
    """The stated name a module stands under: the longest dotted prefix (below `mlsm`) that the
    layers block names, so a wing of a package (`evaluate.compare`) can be a floor of its own;
    else the top-level name."""
    parts = module.split(".")[1:]
    if not parts:
        return "mlsm"
    floors = stated_layers() if floors is None else floors
    return next((".".join(parts[:n]) for n in range(len(parts), 1, -1)
                 if ".".join(parts[:n]) in floors), parts[0])


def test_every_module_has_a_stated_layer() -> None:
    floors = stated_layers()
    missing = sorted({top(m, floors) for m in modules()} - set(floors))
    assert not missing, f"place these in docs/architecture.md's layers block: {missing}"


def test_no_import_runs_back_up() -> None:
    floors = stated_layers()
    upward = sorted(f"{a} (floor {floors[top(a, floors)]}) -> {b} (floor {floors[top(b, floors)]})"
                    for a, b in imports(modules())
                    if floors.get(top(a, floors), 0) < floors.get(top(b, floors), 0))
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_no_import_circle() -> None:
    graph: dict[str, set[str]] = {}
    for a, b in imports(modules()):
        graph.setdefault(a, set()).add(b)
    circle = None
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as err:
        circle = err.args[1]
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path, monkeypatch) -> None:
    """The checker itself can fail: a lazy import inside a function is an arrow."""
    pkg = tmp_path / "mlsm"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from . import deep\n")
    (pkg / "low" / "deep.py").write_text("def f():\n    from mlsm.high import g\n")
    (pkg / "high.py").write_text("from mlsm.low.deep import f\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    edges = imports(modules())
    assert ("mlsm.low.deep", "mlsm.high") in edges and ("mlsm.high", "mlsm.low.deep") in edges
    assert ("mlsm.low", "mlsm.low.deep") in edges


def test_a_wing_stated_as_a_floor_is_held_to_it() -> None:
    """A dotted name in the layers block (a package's wing) is a floor of its own: its modules
    stand there, the package's other modules on the package's floor."""
    floors = {"evaluate": 3, "evaluate.low": 1, "evaluate.low.inner": 2}
    assert top("mlsm.evaluate.low.x", floors) == "evaluate.low"
    assert top("mlsm.evaluate.low", floors) == "evaluate.low"
    assert top("mlsm.evaluate.low.inner.y", floors) == "evaluate.low.inner"
    assert top("mlsm.evaluate.readouts", floors) == "evaluate"
    assert top("mlsm.evaluate", floors) == "evaluate" and top("mlsm", floors) == "mlsm"
