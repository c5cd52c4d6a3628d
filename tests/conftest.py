"""Shared fixtures (the plain functions tests share are in helpers.py): a small synthetic corpus,
a tokenizer trained on it, its token store, a tiny MLM teacher with its dictionary and targets,
the session's two shared runs (a tiny MLM run and a tiny MLSM run, read-only), the PLL tests'
tiny tokenizer and a tiny BLiMP folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .helpers import (
    MLM_RUN,
    MLSM_RUN,
    RIGHT,
    TIE,
    WRONG,
    blimp_row,
    last_checkpoint,
    make_text,
    make_tokenizer,
    snapshot,
    tiny_overrides,
    write_jsonl,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.txt").write_text("\n\n".join(make_text(40, seed=1)) + "\n")
    import gzip
    import json

    with gzip.open(root / "b.jsonl.gz", "wt") as fh:
        for doc in make_text(40, seed=2):
            fh.write(json.dumps({"text": doc, "id": 1}) + "\n")
    return root


@pytest.fixture(scope="session")
def tokenizer_dir(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlsm.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(str(corpus_dir), out, kind="wordpiece", vocab_size=200)
    return out


@pytest.fixture(scope="session")
def store_dir(corpus_dir: Path, tokenizer_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlsm.data.corpus import prepare_corpus

    out = tmp_path_factory.mktemp("stores") / "store"
    prepare_corpus(str(corpus_dir), str(tokenizer_dir), out)
    return out


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory: pytest.TempPathFactory):
    """The CPU peak cache (mlsm.train.throughput.cpu_peak) of the test session in a folder of its
    own,
    not the user's ~/.cache (subprocesses inherit it)."""
    import os

    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(autouse=True)
def user_errors_are_one_line(monkeypatch: pytest.MonkeyPatch):
    """Every UserError raised in any test has a one-line message (the CLI prints it as
    `mlsm <verb>: error: ...`): recorded where it is made, checked when the test ends."""
    from mlsm.errors import UserError

    made: list[str] = []
    init = UserError.__init__

    def recording_init(self: UserError, *args: object) -> None:
        made.append(str(args[0]) if args else "")
        init(self, *args)

    monkeypatch.setattr(UserError, "__init__", recording_init)
    yield made
    several = [m for m in made if "\n" in m]
    assert not several, f"UserError message is not one line: {several[0]!r}"


_SHARED_RUNS: dict[Path, list[tuple[str, int, int]]] = {}
"""The session's shared runs, each with its snapshot when it was trained."""


def _shared_run(out: Path, overrides: list[str]) -> Path:
    """Train a run shared by the session, with torch's thread count restored afterwards (the run's
    train.threads = 1 sets it for the process), and record its snapshot."""
    import torch

    from mlsm.run_config import load_config
    from mlsm.train.loop import pretrain

    before = torch.get_num_threads()
    try:
        run = pretrain(load_config(None, overrides))
    finally:
        torch.set_num_threads(before)
    _SHARED_RUNS[run] = snapshot(run)
    return run


@pytest.fixture(scope="session")
def teacher_dir(store_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT masked LM pre-trained by our own `pretrain` on the fixture store (read-only,
    like `mlm_run`; tests/test_readout_controls.py fits its readout controls on it)."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    overrides = {"train.steps": 30, "train.readiness": "[1.0]", "optim.lr": 3e-3}
    return _shared_run(out, tiny_overrides(store_dir, out, **overrides)) / "checkpoints" / \
        "step-0000030"


@pytest.fixture(scope="session")
def dictionary_path(store_dir: Path, teacher_dir: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A k=64 dictionary on layer 1 of the tiny teacher."""
    from mlsm.data.corpus import TokenStore
    from mlsm.teacher.dictionary import learn_dictionary
    from mlsm.teacher.teacher import load_teacher

    out = tmp_path_factory.mktemp("dict") / "dict.safetensors"
    teacher = load_teacher(str(teacher_dir), layer=1)
    learn_dictionary(TokenStore.open(store_dir), teacher, k=64, lam=0.05, n_vectors=3000,
                     max_len=32, out=out)
    return out


@pytest.fixture(scope="session")
def target_dir(store_dir: Path, teacher_dir: Path, dictionary_path: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Codes of every position, whole (the default: nothing is truncated)."""
    from mlsm.teacher.targets import build_target_store
    from mlsm.teacher.teacher import load_teacher

    out = tmp_path_factory.mktemp("targets") / "t"
    teacher = load_teacher(str(teacher_dir), layer=1)
    return build_target_store(store_dir, dictionary_path, teacher, 32, out, batch_size=16)


@pytest.fixture(scope="session")
def mlm_run(store_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny MLM run (helpers.MLM_RUN: checkpoints at steps 1, 2, 4, 8), folder name
    `tiny-mlm`. Read-only: a test that writes into a run (a probe, a resume, a damaged file)
    works on shutil.copytree(mlm_run, tmp_path / ...); `shared_runs_unchanged` fails one that
    does not, since what it wrote would change what later tests read."""
    out = tmp_path_factory.mktemp("shared") / "tiny-mlm"
    return _shared_run(out, tiny_overrides(store_dir, out, **MLM_RUN))


@pytest.fixture(scope="session")
def mlsm_run(store_dir: Path, teacher_dir: Path, dictionary_path: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny MLSM run (helpers.MLSM_RUN: 30 steps, checkpoints at 15 and 30) on the
    fixture teacher and dictionary, folder name `tiny-mlsm`; it has a latent head, so a probe can
    be fitted on it. Read-only, like `mlm_run`."""
    out = tmp_path_factory.mktemp("shared") / "tiny-mlsm"
    return _shared_run(out, tiny_overrides(store_dir, out, **{
        **MLSM_RUN, "objective.teacher": str(teacher_dir),
        "objective.dictionary": str(dictionary_path)}))


@pytest.fixture(scope="session")
def mlsm_ckpt(mlsm_run: Path) -> Path:
    """The final checkpoint of `mlsm_run` (read-only too)."""
    return last_checkpoint(mlsm_run)


@pytest.fixture(autouse=True)
def shared_runs_unchanged(request: pytest.FixtureRequest):
    """After each test, the shared runs it used are as they were trained."""
    yield
    for run, before in _SHARED_RUNS.items():
        if snapshot(run) != before:
            _SHARED_RUNS[run] = snapshot(run)  # report it once, in the test that wrote it
            pytest.fail(f"{request.node.nodeid} wrote into the shared run {run}; copy it "
                        "first (shutil.copytree(run, tmp_path / ...))", pytrace=False)


@pytest.fixture
def one_torch_thread():
    """Tiny models run faster on one torch thread, much faster when the CPU is shared; used by
    test modules as `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread_per_module():
    """`one_torch_thread` for a whole module, its module-scoped fixtures included (a brute-force
    PLL reference, say): `pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tok(tmp_path_factory: pytest.TempPathFactory):
    """The tiny WordPiece tokenizer of helpers.VOCAB (PLL, scoring, BLiMP and rank tests)."""
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def blimp_dir(tmp_path: Path) -> Path:
    """A tiny BLiMP folder, the test's own: a: 3 right + 1 wrong (0.75); b (gzip, field spelled
    with '/'): right + tie (0.75: a tie counts half); c: 1.0."""
    folder = tmp_path / "blimp"
    folder.mkdir()
    a = [RIGHT, RIGHT, WRONG, RIGHT]
    write_jsonl(folder / "par_a.jsonl",
                [blimp_row(*p, "par_a", "morphology", pid=i) for i, p in enumerate(a)])
    b = [RIGHT, TIE]
    write_jsonl(folder / "par_b.jsonl.gz",
                [blimp_row(*p, "par_b", "syntax/semantics", "binding", i) for i, p in enumerate(b)])
    write_jsonl(
        folder / "par_c.jsonl", [blimp_row(*RIGHT, "par_c", "morphology", pid=i) for i in range(2)]
    )
    (folder / "README.md").write_text("not data")  # ignored: not *.jsonl(.gz)
    return folder
