"""Nothing stale or torn at the edges (#52): a content digest is kept only under the file's full
stat key and read again after any rewrite, and outputs of several files land as one unit (a kill
between their writes is seen by their readers and repaired by a rerun)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from mlsm.artifacts import fingerprint
from mlsm.errors import UserError


def _counting_open(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every file content_digest opens (the module's `open`, shadowing the builtin)."""
    opened: list[str] = []

    def counting(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        opened.append(str(path))
        return open(path, *args, **kwargs)  # noqa: SIM115 - the caller's `with` closes it

    monkeypatch.setattr(fingerprint, "open", counting, raising=False)
    return opened


def test_a_digest_is_reused_by_stat_key_and_a_rewrite_is_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLSM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)  # the files here are seconds old at most
    monkeypatch.setattr(fingerprint, "CACHE_FROM", 0)  # keep every digest on disk
    monkeypatch.setattr(fingerprint, "_MEMO", {})
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 1000)
    opened = _counting_open(monkeypatch)
    first = fingerprint.content_digest(path)
    assert first == hashlib.sha256(b"a" * 1000).hexdigest() and len(opened) == 1
    assert fingerprint.content_digest(path) == first and len(opened) == 1  # this process
    monkeypatch.setattr(fingerprint, "_MEMO", {})
    assert fingerprint.content_digest(path) == first and len(opened) == 1  # another process
    stat = path.stat()
    time.sleep(0.05)  # past a timestamp tick, as any later edit is
    path.write_bytes(b"b" * 1000)  # same inode, same size ...
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and the old mtime
    assert fingerprint.content_digest(path) == hashlib.sha256(b"b" * 1000).hexdigest()
    assert len(opened) == 2


def test_a_digest_cache_that_cannot_be_written_costs_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")  # every cache write fails
    monkeypatch.setenv("MLSM_CACHE_DIR", str(blocker))
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)
    monkeypatch.setattr(fingerprint, "CACHE_FROM", 0)
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    assert fingerprint.content_digest(path) == hashlib.sha256(b"abc").hexdigest()


def test_a_subfolder_link_is_walked_and_a_loop_once(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "q.tsv").write_text("q1\td1\n")
    task = tmp_path / "task"
    task.mkdir()
    (task / "qrels").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (task / "loop").symlink_to(task, target_is_directory=True)
    assert sorted(fingerprint.tree_files(task)) == ["qrels/q.tsv"]


# --------------------------------------------------------------------------- mlsm score


def _scored(rows: int):  # noqa: ANN202
    from mlsm.evaluate.zeroshot.score import ScoreResult

    return ScoreResult([{"line": i, "text": f"s{i}", "pll": -1.0 * i, "n_tokens": 2,
                         "truncated": False} for i in range(rows)],
                       {"input": "in.txt", "pppl": 2.0, "n_sentences": rows})


def test_score_rows_and_summary_land_as_one_unit(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill after the rows and before the summary left the new rows beside the old summary,
    which nothing could tell apart. The summary is the manifest: written last, naming the rows'
    digest; the reader refuses a mix in one line, and writing again repairs."""
    from mlsm.evaluate.zeroshot import score

    out = tmp_path / "scores.jsonl"
    score.write_scores(_scored(3), out)
    assert len(score.read_scores(out).rows) == 3
    real = score.atomic_write_json

    def killed(path, payload):  # noqa: ANN001
        raise KeyboardInterrupt  # the process dies between the rows and the summary

    monkeypatch.setattr(score, "atomic_write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        score.write_scores(_scored(5), out)
    with pytest.raises(UserError, match="run the same `mlsm score") as info:
        score.read_scores(out)
    assert "\n" not in str(info.value)
    # the old summary beside new rows (its removal skipped: an older mlsm) is refused too
    monkeypatch.setattr(score, "atomic_write_json", real)
    score.write_scores(_scored(3), out)
    summary = json.loads(score.summary_path(out).read_text())
    score.write_scores(_scored(4), out)
    score.summary_path(out).write_text(json.dumps(summary))
    with pytest.raises(UserError, match="are of different runs"):
        score.read_scores(out)
    score.write_scores(_scored(5), out)  # the rerun repairs
    assert len(score.read_scores(out).rows) == 5


def test_score_rows_are_read_back_one_bounded_line_at_a_time(tmp_path: Path) -> None:
    """A scores file whose summary names its digest but one of whose rows is longer than
    MAX_ROW_BYTES (hand-made, both files edited) was read whole; it is hashed as a stream and
    refused at that line now, which is read that far only."""
    from mlsm.evaluate.zeroshot import score
    from mlsm.limits import MAX_ROW_BYTES

    out = tmp_path / "scores.jsonl"
    score.write_scores(_scored(2), out)
    data = out.read_bytes() + b'{"text": "' + b"a" * MAX_ROW_BYTES + b'"}\n'
    out.write_bytes(data)
    summary = json.loads(score.summary_path(out).read_text())
    summary["rows_sha256"] = hashlib.sha256(data).hexdigest()
    score.summary_path(out).write_text(json.dumps(summary))
    with pytest.raises(UserError, match=f"scores.jsonl:3 is longer than {MAX_ROW_BYTES:,} bytes"):
        score.read_scores(out)


# --------------------------------------------------------------------------- a full disk

_FULL_DISK_SAVE = """
import resource, signal, sys, torch
from safetensors.torch import save_file
from mlsm.fileio import atomic_write
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
try:
    atomic_write(sys.argv[1], lambda tmp: save_file({"e": torch.zeros(10_000)}, tmp))
except OSError as exc:
    print(exc.errno, exc.filename)
"""


def test_a_full_disk_under_safetensors_meets_the_os_error_edge(tmp_path: Path) -> None:
    """The retrieval cache (and every .safetensors written through atomic_write) on a full
    disk: safetensors raises its own SafetensorError ("... (os error 28)"), which reached the
    CLI as a bug's traceback; it is read back as the OSError it carries, naming the file."""
    import errno
    import subprocess
    import sys

    target = tmp_path / "cache" / "key.safetensors"
    done = subprocess.run([sys.executable, "-c", _FULL_DISK_SAVE, str(target)],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == [str(errno.EFBIG), str(target)], done.stderr[-800:]
    assert not list((tmp_path / "cache").iterdir())  # no temporary left


def test_rank_cuts_a_long_sentence_at_the_models_positions(teacher_dir: Path,
                                                           tmp_path: Path) -> None:
    """No --max-length: a sentence longer than the model's positions is cut there (the default
    was 128 whatever the model took)."""
    from mlsm.evaluate.zeroshot.rank import layerwise_effective_rank, load_encoder

    model, tokenizer = load_encoder(str(teacher_dir))
    model.config.max_position_embeddings = 40  # a model of 40 positions (its table is longer)
    table = layerwise_effective_rank(model, tokenizer, [" ".join(["the cat sees"] * 50)],
                                     mask_rate=0.0)
    assert table.meta["max_length"] == 40 and table.counts["unmasked"] == 38



def test_a_score_row_that_is_not_json_is_one_line_even_when_the_digest_agrees(
        tmp_path: Path) -> None:
    """Rows edited together with the summary's digest (so the unit check passes) and holding a
    line that is not a JSON object raised a JSONDecodeError traceback; it is one line naming the
    file and line now."""
    import hashlib

    from mlsm.evaluate.zeroshot import score

    out = tmp_path / "scores.jsonl"
    score.write_scores(_scored(2), out)
    out.write_bytes(out.read_bytes() + b'{"line": 9, "pll"\n')
    summary = json.loads(score.summary_path(out).read_text())
    summary["rows_sha256"] = hashlib.sha256(out.read_bytes()).hexdigest()
    score.summary_path(out).write_text(json.dumps(summary))
    with pytest.raises(UserError, match=r"scores\.jsonl:3 is not a row of scores"):
        score.read_scores(out)
