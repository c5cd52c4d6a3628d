"""What README.md and docs/*.md tell a user stays what the code does.

Every `mlsm VERB --flag` written in the pages is an option of that verb's argparse parser (the
parser `mlsm.cli.build_parser` builds, not a subprocess per flag); every `group.key` a page names
is a field of the config dataclasses; every ```python block compiles, each name it imports from
mlsm and each dotted `mlsm.x.y` name any page writes resolves (module imported, attribute read),
and its keyword arguments are parameters of the mlsm function it calls. Counts and tables quoted
from the code (test case counts, checkpoint folder names, study keys, token-store meta fields,
dictionary options, the power table) are checked against it; measured numbers carry machine, date
and commit; relative links resolve; docs/study-reference.md regenerates identically; the worked
examples of docs/extending.md and docs/python-api.md run.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
from functools import cache
from pathlib import Path

import pytest

from mlsm.config import GROUPS
from mlsm.objectives import INTERNAL, OBJECTIVES

from .helpers import cli_verbs

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^[ \t]*```([a-z]*)[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
# a command: `mlsm VERB ...` or `python -m mlsm VERB ...`, up to a shell separator or a comment
COMMAND = re.compile(r"(?:^|[\s(`$])(?:-m\s+)?mlsm\s+([a-z][a-z-]*)((?:[^|;&#`\n]|\\\n)*)")
# `group.key` not followed by `(` (a method call, e.g. `objective.loss(...)`) nor a file suffix
FILE_SUFFIX = r"\.(?:py|md|ya?ml|json|jsonl|safetensors|bin|png|pt|txt|csv|tsv|gz)\b"
GROUP_KEY = re.compile(r"(?<![\w./-])(data|model|optim|train|objective)\.([a-z_][a-z0-9_]*)\b"
                       r"(?![(.\w])")
# names that only the worked example of docs/extending.md defines (its test imports the example)
EXAMPLE_ONLY = {"objective.smoothing", "mlsm.objectives.mlm_ls"}
DOTTED = re.compile(r"(?<![\w./])mlsm(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def _code_spans(text: str) -> list[str]:
    """Fenced bodies (shell-like ones) and inline code spans: where commands are written."""
    spans = [body for lang, body in _blocks(text) if lang in ("", "bash", "sh", "console")]
    prose = FENCE.sub("", text)
    return spans + INLINE.findall(prose)


def _code_text(text: str) -> str:
    """Every fenced block and inline code span of a page, one after another."""
    return "\n".join([*(body for _, body in _blocks(text)), *INLINE.findall(FENCE.sub("", text))])


@cache
def _commands(page: Path) -> list[tuple[str, list[str]]]:
    """(verb, flags) of every `mlsm VERB ...` command written in a page."""
    found = []
    for span in _code_spans(page.read_text()):
        for m in COMMAND.finditer(span):
            words = m.group(2).replace("\\\n", " ")
            flags = [w.split("=")[0] for w in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*(?:=\S*)?",
                                                          words)]
            found.append((m.group(1), flags))
    return found


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_written_command_is_a_verb_with_those_options(page: Path) -> None:
    verbs = cli_verbs()
    wrong = []
    for verb, flags in _commands(page):
        if verb not in verbs:
            if flags and verb not in ("demo",):  # prose like "mlsm is ..." carries no flags
                wrong.append(f"no verb `mlsm {verb}`")
            continue
        options = {s for a in verbs[verb]._actions for s in a.option_strings}
        wrong += [f"`mlsm {verb} {f}`: no such option" for f in flags if f not in options]
    assert not wrong, f"{_rel(page)}: " + "; ".join(sorted(set(wrong)))


def _config_fields() -> dict[str, set[str]]:
    fields = {g: {f.name for f in dataclasses.fields(c)} for g, c in GROUPS.items()}
    configs = [cls.Config for cls in {**OBJECTIVES, **INTERNAL}.values()]
    fields["objective"] = {"name"}.union(*({f.name for f in dataclasses.fields(c)}
                                           for c in configs))
    return fields


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_config_key_named_exists(page: Path) -> None:
    if page.name == "configuration.md":
        return  # generated from the dataclasses themselves (tests/test_docs.py)
    fields = _config_fields()
    text = page.read_text()
    code = re.sub(r"[\w.-]+" + FILE_SUFFIX, "", _code_text(text))
    wrong = sorted({f"{g}.{k}" for g, k in GROUP_KEY.findall(code) if k not in fields[g]}
                   - EXAMPLE_ONLY)
    assert not wrong, f"{_rel(page)} names config keys that do not exist: {wrong}"


def _resolve(dotted: str) -> bool:
    """True when `dotted` is a module, or an attribute chain under the longest importable one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def _python_blocks(page: Path) -> list[str]:
    return [body for lang, body in _blocks(page.read_text()) if lang == "python"]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_python_snippets_compile_and_their_mlsm_names_resolve(page: Path) -> None:
    wrong = []
    for i, body in enumerate(_python_blocks(page)):
        try:
            compile(body, f"{_rel(page)}[python block {i}]", "exec")
        except SyntaxError as exc:
            wrong.append(f"block {i} does not compile: {exc}")
        for m in re.finditer(r"^\s*from\s+(mlsm[\w.]*)\s+import\s+\(?([^)\n]+)\)?", body, re.M):
            names = m.group(2).split("#")[0].split(",")
            for name in (n.split(" as ")[0].strip() for n in names):
                if name and not _resolve(f"{m.group(1)}.{name}"):
                    wrong.append(f"block {i}: `from {m.group(1)} import {name}` fails")
        for m in re.finditer(r"^\s*import\s+(mlsm[\w.]*)", body, re.M):
            if not _resolve(m.group(1)):
                wrong.append(f"block {i}: `import {m.group(1)}` fails")
    assert not wrong, f"{_rel(page)}: " + "; ".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_dotted_mlsm_name_resolves(page: Path) -> None:
    code = re.sub(r"[\w.-]+" + FILE_SUFFIX, "", _code_text(page.read_text()))
    names = {n.rstrip(".") for n in DOTTED.findall(code)}
    wrong = sorted(n for n in names - EXAMPLE_ONLY if not _resolve(n))
    assert not wrong, f"{_rel(page)} names what mlsm does not have: {wrong}"


def test_the_checks_read_something() -> None:
    # a regex that silently matches nothing would pass every test above
    assert sum(len(_commands(p)) for p in PAGES) > 50
    assert sum(len(_python_blocks(p)) for p in PAGES) >= 5


CASES_QUOTED = re.compile(r"`(test_\w+)(?:\[[^`]*\])?`(?:,\s*|\s*\()(\d+) cases")


def _cases(test_name: str) -> int | None:
    """How many cases pytest makes of a parametrised test in tests/ (product of its marks)."""
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if f"def {test_name}(" in path.read_text():
            fn = getattr(importlib.import_module(f"tests.{path.stem}"), test_name)
            n = 1
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "parametrize":
                    n *= len(list(mark.args[1]))
            return n
    return None


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_quoted_case_counts_are_the_tests_own(page: Path) -> None:
    text = " ".join(page.read_text().split())  # a quote may break across lines
    wrong = [f"`{name}` ({quoted} cases): the test has {_cases(name)}"
             for name, quoted in CASES_QUOTED.findall(text) if _cases(name) != int(quoted)]
    assert not wrong, f"{_rel(page)}: " + "; ".join(wrong)


def test_readme_lists_every_objective() -> None:
    from mlsm.objectives import user_objectives

    line = next(x for x in (ROOT / "README.md").read_text().splitlines()
                if x.startswith("| `mlsm pretrain`"))
    listed = re.findall(r"`([a-z_]+)`", line.split("objective:")[1])
    assert sorted(listed) == sorted(user_objectives()), "README's pretrain row: objectives"


def test_dictionary_options_table_matches_function_and_verb() -> None:
    import inspect

    from mlsm.teacher.dictionary import learn_dictionary
    from mlsm.teacher.dictionary_config import DictionaryConfig
    from mlsm.teacher.teacher import load_teacher

    params = {*inspect.signature(learn_dictionary).parameters,  # store, teacher, config, out
              *(f.name for f in dataclasses.fields(DictionaryConfig)),  # its **settings
              *inspect.signature(load_teacher).parameters}  # layer, device: the teacher's
    flags = {s for a in cli_verbs()["dictionary"]._actions for s in a.option_strings}
    text = (ROOT / "docs" / "dictionary.md").read_text()
    rows = [r.split("|")[1:3] for r in text.split("## Options")[1].split("##")[0].splitlines()
            if r.startswith("| `") or r.startswith("| (")]
    assert len(rows) >= 10
    for names, flag_cell in rows:
        for name in re.findall(r"`(\w+)`", names):
            assert name in params, f"dictionary.md: `{name}` is not a parameter"
        for flag in re.findall(r"--[a-z-]+", flag_cell):
            assert flag in flags, f"dictionary.md: `mlsm dictionary {flag}` does not exist"
        if "Python only" in flag_cell:  # then there must be no such flag
            name = names.strip().strip("`")
            assert f"--{name.replace('_', '-')}" not in flags, f"dictionary.md: {name} has a flag"


def _named_in(text: str) -> set[str]:
    """Words inside code spans and fenced blocks, and YAML keys (`key:`) of a page."""
    return set(re.findall(r"\w+", _code_text(text)))


def test_study_page_names_every_study_key() -> None:
    import typing

    from mlsm.study import spec

    named = _named_in((ROOT / "docs" / "study.md").read_text())
    hints = typing.get_type_hints(spec.StudySpec)
    missing = []
    for f in dataclasses.fields(spec.StudySpec):
        missing += [f.name] if f.name not in named else []
        for group in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(group):
                missing += [f"{f.name}.{g.name}" for g in dataclasses.fields(group)
                            if g.name not in named]
    assert not missing, f"docs/study.md never names these study keys: {missing}"


def test_conventions_lists_every_token_store_meta_field() -> None:
    import ast

    source = (ROOT / "src" / "mlsm" / "data" / "corpus.py").read_text()
    fill = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef) and n.name == "_fill_store")
    meta = next(n.value for n in ast.walk(fill) if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", "") == "meta")
    written = {k.value for k in meta.keys}  # type: ignore[union-attr]
    text = " ".join((ROOT / "docs" / "CONVENTIONS.md").read_text().split())
    listed = set(re.search(r"`meta.json`.*?\): ([^.]+)\.", text).group(1).replace(" ", "")
                 .split(","))
    assert listed == written, f"CONVENTIONS.md meta.json: lists {sorted(listed - written)} " \
        f"that are not written, omits {sorted(written - listed)}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_checkpoint_folders_are_named_as_the_loop_names_them(page: Path) -> None:
    from mlsm.artifacts.rundir import RunDir

    width = len(RunDir("r").checkpoint_folder(1).name) - len("step-")
    wrong = [m for m in re.findall(r"checkpoints/step-(\d+)\b", page.read_text())
             if len(m) != width]
    assert not wrong, f"{_rel(page)}: checkpoints/step-N folders have {width} digits: {wrong}"


# A measured number carries where, when and on what code it was measured (docs/CONVENTIONS.md):
# the machine as `mlsm.provenance.machine_description()` prints it (arch, CPU, "N CPUs", memory,
# GPU), a date and a commit, in its section (under one heading) or in the page's footer (after the
# last `---`).
MEASURED = re.compile(r"\b(?:[Mm]easured\b(?! (?:exactly|per|against|by|as|ratios|SD))|took \S*\d)")
WITH_UNIT = re.compile(r"\d[\d,.]*\s?(?:s|ms|min|h|GiB|MiB|GB|MB|tokens/s|it/s)(?![\w/])")
MACHINE = re.compile(r"(?:x86_64|aarch64|arm64)\b[^;]*?\d+ CPUs?\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"\bcommits? `?[0-9a-f]{7,40}\b|\bat `[0-9a-f]{7,40}`")
LEAD_OWNS: set[str] = set()  # pages a test must not hold to the footer rule (none now)


def _has_provenance(text: str) -> bool:
    return all(r.search(text) for r in (MACHINE, DATE, COMMIT))


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", FENCE.sub("", text))]


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in LEAD_OWNS], ids=_rel)
def test_measured_numbers_carry_machine_date_and_commit(page: Path) -> None:
    text = page.read_text()
    footer = text.rsplit("\n---\n", 1)[1] if "\n---\n" in text else ""
    footer_ok = _has_provenance(" ".join(footer.split()))
    bare = [p[:80] for section in re.split(r"^#+ ", text, flags=re.M)
            if not _has_provenance(" ".join(section.split()))  # a section may carry it once
            for p in _paragraphs(section) if MEASURED.search(p) and WITH_UNIT.search(p)]
    assert footer_ok or not bare, (
        f"{_rel(page)}: measured numbers without machine, date and commit (add the footer "
        f"`Measured on MACHINE; YYYY-MM-DD; commit SHA`): {bare}")


def test_study_reference_is_current() -> None:
    from mlsm.study.reference import study_reference

    written = (ROOT / "docs" / "study-reference.md").read_text()
    assert written.strip() == study_reference().strip(), \
        "regenerate with: python -m mlsm.study.reference > docs/study-reference.md"


def test_every_study_field_has_a_docstring() -> None:
    from mlsm.config import field_docs
    from mlsm.study.reference import GROUPS
    from mlsm.study.spec import StudySpec

    for cls in (StudySpec, *(c for _, _, c in GROUPS)):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: {missing}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_and_their_anchors_resolve(page: Path) -> None:
    wrong = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        missing_anchor = (anchor and dest.suffix == ".md" and dest.exists()
                          and anchor not in _anchors(dest))
        # the sdist (PKG-INFO at its root) leaves the benchmarks, scripts and study results out
        # (MANIFEST.in): links to them go to the repository's pages
        unshipped = (ROOT / "PKG-INFO").is_file() and any(
            ROOT / folder in dest.parents for folder in ("benchmarks", "scripts", "docs/results"))
        if (not dest.exists() and not unshipped) or missing_anchor:
            wrong.append(target)
    assert not wrong, f"{_rel(page)}: links that go nowhere: {wrong}"


def test_extending_objective_example_trains_and_equals_mlm_at_zero_smoothing(
        store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import numpy as np
    import torch

    from mlsm.config import DataConfig, ModelConfig
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore
    from mlsm.models.backbone import build_student
    from mlsm.objectives import Context, forward_step
    from mlsm.objectives.mlm import MLM, MLMConfig

    from .helpers import TINY_MODEL

    # the module block is imported as a file, as it would be in the package
    (tmp_path / "mlm_ls_example.py").write_text(_python_blocks(ROOT / "docs" / "extending.md")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mlm_ls_example", raising=False)
    example = importlib.import_module("mlm_ls_example")
    from mlsm.config import field_docs

    cfg_cls = example.MLMLS.Config
    assert set(field_docs(cfg_cls)) == {f.name for f in dataclasses.fields(cfg_cls)}
    assert {f"objective.{f.name}" for f in dataclasses.fields(cfg_cls)} >= EXAMPLE_ONLY - {
        "mlsm.objectives.mlm_ls"}
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    ctx = Context(tok, torch.device("cpu"), 10, str(store_dir), 32)
    batch = BatchSource(store, DataConfig(store=str(store_dir), max_len=32), tok).batch(
        np.arange(8), 0)
    torch.manual_seed(0)
    student = build_student(ModelConfig(overrides=dict(TINY_MODEL)), tok, 32, 0)

    def loss(objective) -> torch.Tensor:
        objective.attach(student)
        return forward_step(student, objective, batch).loss_sum

    student.eval()  # no dropout: the same hidden states for every objective
    mlm = loss(MLM(MLMConfig(), ctx))
    assert torch.allclose(loss(example.MLMLS(cfg_cls(smoothing=0.0), ctx)), mlm)
    eps = 0.1
    logits = student.vocab_logits(student(**MLM(MLMConfig(), ctx).student_inputs(
        student, batch, None))[batch.selected]).float()
    logp = torch.log_softmax(logits, -1)
    labels = batch.input_ids[batch.selected]
    by_hand = ((1 - eps) * -logp.gather(1, labels[:, None]).squeeze(1) - eps * logp.mean(-1)).sum()
    smoothed = loss(example.MLMLS(cfg_cls(smoothing=eps), ctx))
    assert torch.allclose(smoothed, by_hand, rtol=1e-5)
    smoothed.backward()  # it trains: gradients reach the student
    assert any(p.grad is not None for p in student.parameters())


def test_extending_task_example_reads_its_files(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from mlsm.evaluate.finetune import tasks

    monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))  # the example adds to the registry
    exec(compile(_python_blocks(ROOT / "docs" / "extending.md")[1], "extending.md", "exec"), {})
    spec = tasks.get_task("boolq")
    folder = tmp_path / "BoolQ"
    folder.mkdir()
    rows = [{"question": "is it?", "passage": "It is.", "label": True},
            {"question": "is it not?", "passage": "It is.", "label": False}]
    for name in ("train.jsonl", "val.jsonl"):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = spec.read(tasks.task_folder(spec, tmp_path), "dev")
    assert [(e.text, e.text_pair, e.label) for e in examples] == [
        ("is it?", "It is.", 1), ("is it not?", "It is.", 0)]
    assert spec.metric([1, 1], [1, 0]) == {"acc": 0.5}


def test_python_api_page_runs_on_a_tiny_mlsm_run(mlsm_run: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from mlsm.evaluate.probe.probe import run_probe

    monkeypatch.chdir(tmp_path)  # the page names runs/tiny-mlsm
    shutil.copytree(mlsm_run, "runs/tiny-mlsm")  # the session's run, copied: a probe is written
    run_probe("runs/tiny-mlsm", steps=3)  # a few loop steps: the page needs a probe, not a good one
    scope: dict = {}
    exec(compile(_python_blocks(ROOT / "docs" / "python-api.md")[0], "python-api.md", "exec"),
         scope)
    assert scope["codes"].shape == (scope["hidden"].shape[1], scope["entry"]["k"])
    assert scope["logits"].shape == (1, len(scope["tok"]))
    assert len(scope["plls"]) == 2 and all(p < 0 for p in scope["plls"])


def test_power_table_is_what_detectable_dz_computes() -> None:
    from mlsm.evaluate.compare.paired import detectable_dz

    text = (ROOT / "docs" / "how-much-pretraining.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    assert len(rows) == 4
    for n, at_alpha, at_holm in rows:
        assert f"{detectable_dz(int(n), 0.05, 'greater'):.2f}" == at_alpha, n
        assert f"{detectable_dz(int(n), 0.05 / 3, 'greater'):.2f}" == at_holm, n


def _imported_callables(tree: ast.AST) -> dict[str, object]:
    """name -> object of every `from mlsm... import name` in a snippet that resolves."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlsm"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(module, alias.name):
                    found[alias.asname or alias.name] = getattr(module, alias.name)
    return found


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_python_snippets_call_mlsm_with_its_keywords(page: Path) -> None:
    import inspect

    wrong = []
    for i, body in enumerate(_python_blocks(page)):
        tree = ast.parse(body)
        names = _imported_callables(tree)
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            fn = names.get(call.func.id) if isinstance(call.func, ast.Name) else None
            if fn is None or not callable(fn):
                continue
            try:
                params = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            wrong += [f"block {i}: {call.func.id}({k.arg}=...) has no such parameter"
                      for k in call.keywords if k.arg and k.arg not in params]
    assert not wrong, f"{_rel(page)}: " + "; ".join(wrong)
