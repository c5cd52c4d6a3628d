"""The README's Quickstart and the commands of docs/*.md run as written (issue 19).

The Quickstart's ```bash blocks are run in order by one `bash` (``set -euo pipefail``) in a
temporary folder, exactly as the README shows them. Sizes come from the shell variables the README
documents (``STEPS``, ``N_VECTORS``, ...), set small here; ``CORPUS`` points at a slice of the
shared enwiki corpus (its first documents), since tokenising all of it takes long.
``../shared`` is a symlink to the real shared folder, so the README's default
``DATA=../shared/data`` resolves.

Every ```bash block of docs/*.md is either run here (``DOCS_RUN``: in the Quickstart's folder, after
it) or starts with a visible ``# not run by the tests: <why>`` line.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlsm.artifacts.results_file import read_results

from .helpers import SHARED

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN = "# not run by the tests:"
SMALL = {
    "STEPS": "2",
    "N_VECTORS": "2000",
    "TASKS": "cola",
    "SEEDS": "2",
    "MAX_TRAIN": "16",
    "BLIMP_PAIRS": "1",
    "PROBE_STEPS": "4",
}
CORPUS_DOCS = 30  # documents of the enwiki slice (~100k tokens)

# docs/*.md blocks that the tests run, by file and first line:
# they take seconds after the Quickstart.
DOCS_RUN = {
    ("finetune.md", "mlsm compare results.jsonl --out eval/compare"),
    ("readouts.md",
     "mlsm probe runs/tiny-mlm --head vocab --max-steps ${PROBE_STEPS:-2000}     "
     "# -> runs/tiny-mlm/probe-step-N-vocab"),
    (
        "pll.md",
        "mlsm blimp runs/tiny-mlm@50% --data ../shared/data/blimp --phenomena "
        "anaphor_gender_agreement --limit 20 --out runs/blimp-mlm-50",
    ),
    # the whole tutorial, text to exported model, with the Quickstart's small sizes
    ("tutorial.md", "TEXT=${TEXT:-my_text.txt}          # your text"),
}


def bash_blocks(markdown: str, section: str | None = None) -> list[str]:
    """The ```bash blocks of a Markdown text, or of its ``## section`` only."""
    if section is not None:
        start = markdown.index(f"\n## {section}\n")
        end = markdown.find("\n## ", start + 1)
        markdown = markdown[start:end if end >= 0 else None]
    return [m.group(1) for m in re.finditer(r"^```bash\n(.*?)^```", markdown, flags=re.S | re.M)]


def _first_line(block: str) -> str:
    return block.strip().splitlines()[0]


def _docs_blocks() -> list[tuple[str, str]]:
    return [
        (p.name, b)
        for p in sorted((ROOT / "docs").glob("*.md"))
        for b in bash_blocks(p.read_text())
    ]


def _run_bash(script: str, cwd: Path, env: dict[str, str], timeout: float) -> None:
    done = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=cwd,
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (
        f"exit {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n--- "
        f"stderr\n{done.stderr[-3000:]}"
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A folder laid out as the README assumes (repo root with ../shared beside it) and the env to
    run in."""
    if not all((SHARED / d).is_dir() for d in ("glue", "blimp", "corpus")):
        pytest.skip(f"shared data not found at {SHARED}")
    root = tmp_path_factory.mktemp("readme")
    work = root / "mlsm"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    (root / "shared").symlink_to(SHARED.parent, target_is_directory=True)
    corpus = root / "corpus.jsonl.gz"
    with (
        gzip.open(
            SHARED / "corpus" / "enwiki_2015_prefix" / "train.jsonl.gz", "rt", encoding="utf-8"
        ) as src,
        gzip.open(corpus, "wt", encoding="utf-8") as dst,
    ):
        dst.writelines(itertools.islice(src, CORPUS_DOCS))
    # the tutorial's "own text": the same documents as plain text, blank-line separated
    with gzip.open(corpus, "rt", encoding="utf-8") as src:
        text = "\n\n".join(json.loads(line)["text"].strip() for line in src)
    (root / "my_text.txt").write_text(text + "\n", encoding="utf-8")
    # `python` and `mlsm` as a reader has them after `pip install -e .`, running this checkout
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, args in (("python", ""), ("mlsm", " -m mlsm")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        **SMALL,
        "CORPUS": str(corpus),
        "TEXT": str(root / "my_text.txt"),
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])
        ),
    }
    env.pop("DATA", None)  # the README's default, not the caller's
    return work, env


@pytest.fixture(scope="module")
def quickstart(workspace: tuple[Path, dict[str, str]]) -> Path:
    work, env = workspace
    blocks = bash_blocks((ROOT / "README.md").read_text(), "Quickstart")
    assert len(blocks) >= 3, "the Quickstart lost its ```bash blocks"
    _run_bash("\n".join(blocks), work, env, timeout=1800)  # a hang guard, not a budget
    return work


def test_quickstart_runs_as_written(quickstart: Path) -> None:
    rows = read_results(quickstart / "results.jsonl")
    # --readiness all: steps 1 and 2 of the 2-step runs (10, 25 and 50 % all round to step 1)
    assert sorted({(r["model"], Path(r["run"]).name, r["step"], r["readiness"]) for r in rows}) == [
        ("mlm@step-1", "tiny-mlm", 1, 0.5), ("mlm@step-2", "tiny-mlm", 2, 1.0),
        ("mlsm@step-1", "tiny-mlsm", 1, 0.5), ("mlsm@step-2", "tiny-mlsm", 2, 1.0)]
    assert {r["seed"] for r in rows} == {0, 1} and {r["task"] for r in rows} == {"cola"}
    for path in ("runs/compare/comparison.md", "runs/report/readiness.png", "runs/report/report.md",
                 "runs/tiny-mlsm/probe-step-0000002/probe.json",
                 "runs/blimp-mlsm/blimp.json", "runs/blimp-mlm/blimp.json"):
        assert (quickstart / path).is_file(), path
    # the probe stopped within the README's PROBE_STEPS budget and left a checkpoint blimp used
    probe = json.loads((quickstart / "runs/tiny-mlsm/probe-step-0000002/probe.json").read_text())
    assert (
        1 <= probe["steps"] <= 4
        and (quickstart / probe["checkpoint"] / "heads.safetensors").is_file()
    )


def test_every_docs_command_block_is_run_or_marked() -> None:
    blocks = _docs_blocks()
    unmarked = [(f, _first_line(b)) for f, b in blocks
                if (f, _first_line(b)) not in DOCS_RUN and not _first_line(b).startswith(NOT_RUN)]
    assert not unmarked, f"run these in DOCS_RUN or start them with '{NOT_RUN} <why>': {unmarked}"
    assert {(f, _first_line(b)) for f, b in blocks} >= DOCS_RUN, (
        "a DOCS_RUN entry no longer matches a block"
    )


@pytest.mark.parametrize(("doc", "first"), sorted(DOCS_RUN))
def test_docs_commands_run(
    quickstart: Path, workspace: tuple[Path, dict[str, str]], doc: str, first: str
) -> None:
    (block,) = [b for f, b in _docs_blocks() if (f, _first_line(b)) == (doc, first)]
    _run_bash(block, quickstart, workspace[1], timeout=300)
    if doc == "tutorial.md":  # what the page says each step leaves
        _tutorial_outcome(quickstart)


def _tutorial_outcome(work: Path) -> None:
    from transformers import AutoModel

    log = (work / "runs/my-mlsm/metrics.jsonl").read_text()
    metrics = [json.loads(x) for x in log.splitlines()]
    assert "val_loss" in metrics[-1] and "val_top1_agreement" in metrics[-1]
    assert (work / "runs/my-mlsm-scores.jsonl").read_text().strip()
    export = work / "exports/my-mlsm"
    assert (export / "heads.safetensors").is_file() and "probe" in json.loads(
        (export / "heads.json").read_text())
    _, info = AutoModel.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"]
