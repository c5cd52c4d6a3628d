"""Progress of long jobs: a tqdm bar on a terminal, plain timed lines anywhere else."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from mlsm.progress import Progress, interval_seconds

LINE = re.compile(
    r"^job: (\d+)/5 step \((\d+\.\d)%\) \S+ (step/s|s/step) ETA \S+ elapsed \S+ loss=(\S+)$"
)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_carry_step_total_rate_eta_and_last_loss() -> None:
    out = io.StringIO()
    with Progress(5, "job", "step", stream=out, interval=1e-9) as bar:
        for i in range(5):
            bar.update(1, loss=2.0 - i / 4)
    lines = out.getvalue().splitlines()
    parsed = [LINE.match(ln) for ln in lines]
    assert all(parsed), lines
    steps = [int(m.group(1)) for m in parsed]
    assert steps == [1, 2, 3, 4, 5]  # one per update; close adds no second "5/5" line
    assert [m.group(2) for m in parsed][:5] == ["20.0", "40.0", "60.0", "80.0", "100.0"]
    assert [float(m.group(4)) for m in parsed][:5] == [2.0, 1.75, 1.5, 1.25, 1.0]
    assert "\r" not in out.getvalue()  # a log file gets whole lines, never bar fragments


def test_close_prints_the_final_count_only_when_no_line_showed_it(monkeypatch) -> None:
    """A job whose last updates fell inside the interval ends with its final count; one whose
    last line showed it already prints nothing more (the same line twice reads as stuck)."""
    import itertools

    # readings: start; update 1 (check, line, its time); update 2 (check); then close
    clock = itertools.chain([0.0, 11.0, 11.0, 11.0, 12.0], itertools.repeat(13.0))
    monkeypatch.setattr("mlsm.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    with Progress(5, "job", "step", stream=out, interval=10) as bar:
        bar.update(1, loss=1.0)  # t = 11: a line (1/5)
        bar.update(1, loss=1.0)  # t = 12: inside the interval, no line
    counts = [int(LINE.match(ln).group(1)) for ln in out.getvalue().splitlines()]
    assert counts == [1, 2]


def test_no_line_before_the_interval_has_passed() -> None:
    out = io.StringIO()
    with Progress(5, "job", "step", stream=out, interval=3600) as bar:
        bar.update(5)
    assert out.getvalue() == ""  # a short job stays quiet; a long one prints every interval


def test_resumed_job_counts_from_its_initial_step_and_unknown_total() -> None:
    out = io.StringIO()
    with Progress(10, "job", "step", initial=7, stream=out, interval=1e-9) as bar:
        bar.update(1)
    assert out.getvalue().startswith("job: 8/10 step (80.0%)")
    out = io.StringIO()
    with Progress(None, "tokenising", "doc", stream=out, interval=1e-9) as bar:
        bar.update(64, tokens=1000)
    assert re.match(
        r"tokenising: 64 doc \S+ doc/s elapsed \S+ tokens=1000$", out.getvalue().splitlines()[0]
    )


def test_terminal_gets_a_tqdm_bar() -> None:
    from tqdm import tqdm

    out = _Terminal()
    with Progress(5, "job", "step", stream=out, interval=1e-9) as bar:
        assert isinstance(bar.bar, tqdm)
        bar.update(3, loss=1.5)
    text = out.getvalue()
    assert "\r" in text and "3/5" in text and "loss=1.5" in text
    assert not LINE.search(text)  # no plain lines on a terminal


def test_disabled_progress_writes_nothing() -> None:
    for out in (io.StringIO(), _Terminal()):
        with Progress(5, "job", "step", stream=out, interval=1e-9, enabled=False) as bar:
            bar.update(5)
        assert out.getvalue() == ""


def test_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLSM_PROGRESS_SECONDS", raising=False)
    assert interval_seconds() == 30.0
    monkeypatch.setenv("MLSM_PROGRESS_SECONDS", "0.5")
    assert interval_seconds() == 0.5 and interval_seconds(2) == 2.0


def test_long_jobs_report_through_progress(
    store_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pretrain and dictionary learning print their lines on a redirected stderr."""
    from mlsm.run_config import load_config
    from mlsm.teacher.online_dictionary import learn_atoms
    from mlsm.train.loop import pretrain

    from .helpers import tiny_overrides

    monkeypatch.setenv("MLSM_PROGRESS_SECONDS", "1e-9")
    pretrain(load_config(None, tiny_overrides(store_dir, tmp_path / "r")))
    err = capsys.readouterr().err
    steps = [int(m) for m in re.findall(r"^pretrain: (\d+)/6 step .* loss=\S+", err, re.M)]
    assert steps[:6] == [1, 2, 3, 4, 5, 6], err[-2000:]
    learn_atoms(torch.randn(64, 8, generator=torch.Generator().manual_seed(0)), k=16, batch_size=16)
    err = capsys.readouterr().err
    assert re.findall(r"^dictionary: (\d+)/4 batch", err, re.M)[:4] == ["1", "2", "3", "4"]


def test_a_study_stage_names_its_model_in_every_progress_line(tmp_path: Path) -> None:
    """The library's bars know their task ("PLL"), not the model a study scores: the stage that
    runs them names itself and its model first, also for two stages running at once in threads."""
    import threading

    from mlsm.demo import demo_study
    from mlsm.study.folder import Study

    spec = demo_study(tmp_path / "out", "c.txt", tmp_path / "p", tmp_path / "h", None, None,
                      8, 4, 1, 3)
    study = Study(spec, log=lambda s: None)
    outs = {m: io.StringIO() for m in ("mlsm@100%", "mlm@100%")}
    barrier = threading.Barrier(2)

    def score(model: str) -> None:
        barrier.wait()  # both stages are inside their scope at once
        with Progress(2, "PLL", "copy", stream=outs[model], interval=1e-9) as bar:
            bar.update(2)

    threads = [threading.Thread(target=study.stage, args=("blimp", lambda m=m: score(m), m))
               for m in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for model, out in outs.items():
        lines = out.getvalue().splitlines()
        assert lines and all(ln.startswith(f"blimp:{model} PLL: ") for ln in lines), lines
    with Progress(1, "PLL", stream=(after := io.StringIO()), interval=1e-9) as bar:
        bar.update(1)
    assert after.getvalue().startswith("PLL: ")  # outside a stage: the bar's own name
