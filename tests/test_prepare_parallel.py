"""`prepare --num-proc`: the same store byte for byte on any number of processes, bounded
read-ahead; and the content fingerprint (issue 21: a re-mounted corpus is not "other inputs")."""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mlsm.artifacts import fingerprint
from mlsm.artifacts.legacy import FORMS
from mlsm.cli import main
from mlsm.data import shards, sources
from mlsm.data.corpus import TokenStore, prepare_corpus
from mlsm.errors import UserError

from .helpers import make_text


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Uneven shards of every file kind (.txt, .txt.gz, .jsonl, .jsonl.gz), blank lines of
    spaces, tabs and CRLF, and the documents they hold in reading order."""
    root = tmp_path_factory.mktemp("shards")
    docs: list[str] = []
    for i, n in enumerate((23, 1, 57, 9, 14, 11)):
        texts = make_text(n, seed=10 + i, sentences=2 + i)  # 3- to 7-line periods
        if i % 2:
            records = "".join(json.dumps({"text": t}) + "\n" for t in texts)
            if i == 5:
                (root / f"s{i}.jsonl").write_text(records)
            else:
                with gzip.open(root / f"s{i}.jsonl.gz", "wt", encoding="utf-8") as fh:
                    fh.write(records)
            docs += texts
            continue
        blocks = [t.replace(". ", ".\n") for t in texts]  # multi-line documents
        if i == 4:  # Windows line ends, gzipped: the same documents without the "\r"
            raw = "\r\n\r\n".join(b.replace("\n", "\r\n") for b in blocks) + "\r\n"
            (root / f"s{i}.txt.gz").write_bytes(gzip.compress(raw.encode()))
        else:  # blank lines holding only spaces or a tab
            (root / f"s{i}.txt").write_text(("\n\t \n" if i else "\n \n").join(blocks) + "\n")
        docs += blocks
    return root, docs


def _store_bytes(store: Path) -> dict[str, object]:
    meta = json.loads((store / "meta.json").read_text())
    meta.pop("created")
    return {"tokens": (store / "tokens.bin").read_bytes(),
            "offsets": (store / "offsets.bin").read_bytes(), "meta": meta}


def test_any_num_proc_writes_the_same_store(shards_dir, tokenizer_dir: Path,
                                            tmp_path: Path) -> None:
    root, docs = shards_dir
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    stores = {}
    for n in (1, 2, 3):  # chunk_docs=4: many units of uneven size per shard
        out = tmp_path / f"p{n}"
        store = prepare_corpus(str(root), str(tokenizer_dir), out, chunk_docs=4, num_proc=n)
        assert [store.document(j).tolist() for j in range(store.n_docs)] == expected
        stores[n] = _store_bytes(out)
    assert stores[1] == stores[2] == stores[3]


def test_cli_num_proc(shards_dir, tokenizer_dir: Path, tmp_path: Path) -> None:
    root, _ = shards_dir
    argv = ["prepare", str(root), "--tokenizer", str(tokenizer_dir), "--num-proc"]
    assert main([*argv, "1", "--out", str(tmp_path / "a")]) == 0
    assert main([*argv, "2", "--out", str(tmp_path / "b")]) == 0
    assert _store_bytes(tmp_path / "a") == _store_bytes(tmp_path / "b")


def test_tiny_units_blocks_and_batches_change_nothing(shards_dir, tokenizer_dir: Path,
                                                       tmp_path: Path, monkeypatch) -> None:
    """Units cut every few hundred bytes (mid-line: the cut moves to the next document start),
    reads of a few bytes, and tokenizer batches of one document, several per unit: the same
    store as the defaults (a unit per file), on one process and on two."""
    root, docs = shards_dir
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    prepare_corpus(str(root), str(tokenizer_dir), tmp_path / "default", num_proc=1)
    monkeypatch.setattr(sources, "UNIT_BYTES", 397)  # the reader (main process) ...
    monkeypatch.setattr(sources, "READ_BYTES", 13)
    monkeypatch.setattr(shards, "ENCODE_CHARS", 40)  # ... and the workers, forked after this
    units = list(sources.iter_units([str(root)], "text", 512))
    assert len(units) > 3 * len(list(root.iterdir()))
    assert sum(len(list(shards.unit_documents(u, "text"))) > 1 for u in units) > 10
    for n in (1, 2):
        store = prepare_corpus(str(root), str(tokenizer_dir), tmp_path / f"p{n}", num_proc=n)
        assert [store.document(j).tolist() for j in range(store.n_docs)] == expected
        assert _store_bytes(tmp_path / f"p{n}") == _store_bytes(tmp_path / "default")


def test_units_hold_whole_lines_numbered_from_their_first(shards_dir, monkeypatch) -> None:
    root, _ = shards_dir
    monkeypatch.setattr(sources, "UNIT_BYTES", 61)
    monkeypatch.setattr(sources, "READ_BYTES", 7)
    for path in sorted(root.iterdir()):
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        lines = raw.splitlines(keepends=True)
        units = list(sources.iter_units([str(path)], "text", 3))
        assert b"".join(u[3] for u in units) == raw
        for _, label, first, payload in units:
            assert label == str(path) and payload.endswith(b"\n")
            assert payload.startswith(lines[first - 1])
            if path.name.endswith((".txt", ".txt.gz")) and first > 1:
                assert not lines[first - 1].strip(), (path, first)  # cut before a blank line


def test_parts_of_workers_are_not_left_in_the_store(shards_dir, tokenizer_dir: Path,
                                                    tmp_path: Path) -> None:
    root, _ = shards_dir
    prepare_corpus(str(root), str(tokenizer_dir), tmp_path / "s", chunk_docs=4, num_proc=2)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "meta.json", "offsets.bin", "tokenizer", "tokens.bin"]


def test_bad_utf8_in_a_later_unit_names_line_and_column(tokenizer_dir: Path, tmp_path: Path,
                                                         monkeypatch) -> None:
    monkeypatch.setattr(sources, "UNIT_BYTES", 40)
    lines = [f"line {i} of some text".encode() for i in range(60)]
    lines[43] = "caf\u00e9 au lait".encode("latin-1")  # \xe9 alone: column 4
    (tmp_path / "latin.txt").write_bytes(b"\n\n".join(lines) + b"\n")  # line 87 of the file
    bad = r"latin\.txt:87 is not UTF-8 text \(bad byte at column 4\)"
    with pytest.raises(UserError, match=bad):
        prepare_corpus(str(tmp_path / "latin.txt"), str(tokenizer_dir), tmp_path / "s",
                       num_proc=2)


@pytest.mark.parametrize("num_proc", [1, 2])
def test_read_ahead_is_bounded(tokenizer_dir: Path, tmp_path: Path, num_proc: int) -> None:
    """At most 2 x num_proc units are in flight: the corpus is streamed, never read ahead."""
    pulled = []

    def units():
        for i in range(40):
            pulled.append(i)
            yield "docs", "mem", 0, [f"document number {i}"]

    tok_json = AutoTokenizer.from_pretrained(tokenizer_dir).backend_tokenizer.to_str()
    with open(tmp_path / "ids.bin", "wb", buffering=0) as ids:
        out = shards.tokenise_units(units(), tok_json, "text", "uint16", num_proc, ids, tmp_path)
        first = next(out)
        assert len(first[1]) == 1 and len(pulled) <= 2 * num_proc + 2
        assert sum(len(lengths) for _, lengths in out) == 39
        out.close()


def test_worker_errors_name_the_right_line(tokenizer_dir: Path, tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(30)]
    lines[21] = '{"text": "broken'
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"c\.jsonl:22 is not valid JSON") as info:
        prepare_corpus(str(tmp_path / "c.jsonl"), str(tokenizer_dir), tmp_path / "s",
                       chunk_docs=4, num_proc=2)
    assert "\n" not in str(info.value) and not (tmp_path / "s").exists()


# --------------------------------------------------------------------------- fingerprints


def _small_corpus(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "a.txt").write_text("\n\n".join(make_text(30, seed=3)) + "\n")
    return path


def test_same_bytes_new_mtime_and_new_path_are_the_same_input(tokenizer_dir: Path,
                                                              tmp_path: Path) -> None:
    corpus = _small_corpus(tmp_path / "corpus")
    out = tmp_path / "store"
    prepare_corpus(str(corpus), str(tokenizer_dir), out, num_proc=1)
    stamp = (out / "meta.json").stat().st_mtime_ns
    os.utime(corpus / "a.txt", ns=(1_000_000_000, 1_000_000_000))  # a re-mount: new mtime
    moved = Path(shutil.copytree(corpus, tmp_path / "elsewhere" / "corpus"))  # and a new path
    for src in (corpus, moved):
        prepare_corpus(str(src), str(tokenizer_dir), out, num_proc=1)
        assert (out / "meta.json").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_one_changed_byte_is_another_input(tokenizer_dir: Path, tmp_path: Path) -> None:
    corpus = _small_corpus(tmp_path / "corpus")
    out = tmp_path / "store"
    prepare_corpus(str(corpus), str(tokenizer_dir), out, num_proc=1)
    data = bytearray((corpus / "a.txt").read_bytes())
    st = (corpus / "a.txt").stat()
    middle = len(data) // 2
    data[middle] = ord("x") if data[middle] != ord("x") else ord("y")
    (corpus / "a.txt").write_bytes(bytes(data))
    os.utime(corpus / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    argv = ["prepare", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out)]
    with pytest.raises(UserError, match="already holds a token store of other inputs"):
        prepare_corpus(str(corpus), str(tokenizer_dir), out, num_proc=1)
    assert main(argv) == 2


def test_source_order_matters(tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first document here\n")
    (tmp_path / "b.txt").write_text("second document there\n")
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    prepare_corpus([a, b], str(tokenizer_dir), tmp_path / "s", num_proc=1)
    with pytest.raises(UserError, match="other inputs"):
        prepare_corpus([b, a], str(tokenizer_dir), tmp_path / "s", num_proc=1)


def test_legacy_store_is_reused_and_upgraded(tokenizer_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A store written with the (path, size, mtime) fingerprint is reused when that still
    matches, and from then on survives a new mtime; its `fingerprint` (which target stores
    reference) is kept. Once its form leaves `legacy.FORMS`, such a store is one of other inputs."""
    corpus = _small_corpus(tmp_path / "corpus")
    out = tmp_path / "store"
    store = prepare_corpus(str(corpus), str(tokenizer_dir), out, num_proc=1)
    legacy = sources.legacy_fingerprint([str(corpus)], store.tokenizer_hash, "text")
    meta = {**store.meta, "fingerprint": legacy}
    del meta["input_fingerprint"]
    (out / "meta.json").write_text(json.dumps(meta, indent=2))  # as an older mlsm wrote it
    tokens = (out / "tokens.bin").stat().st_mtime_ns
    again = prepare_corpus(str(corpus), str(tokenizer_dir), out, num_proc=1)
    assert again.meta["fingerprint"] == legacy and again.meta["input_fingerprint"] != legacy
    os.utime(corpus / "a.txt", ns=(1_000_000_000, 1_000_000_000))
    prepare_corpus(str(corpus), str(tokenizer_dir), out, num_proc=1)
    assert (out / "tokens.bin").stat().st_mtime_ns == tokens  # never rebuilt
    assert TokenStore.open(out).meta["fingerprint"] == legacy

    now = sources.legacy_fingerprint([str(corpus)], store.tokenizer_hash, "text")  # new mtime
    (out / "meta.json").write_text(json.dumps({**meta, "fingerprint": now}, indent=2))
    monkeypatch.delitem(FORMS, "store-path-fingerprint")
    with pytest.raises(UserError, match="other inputs"):
        prepare_corpus(str(corpus), str(tokenizer_dir), out, num_proc=1)


def test_large_files_are_read_whole(tmp_path: Path) -> None:
    """A file over 64 MiB was fingerprinted by head, tail and 62 sampled blocks: one byte changed
    between them, with size and mtime kept, reused the old store. Every byte is read now."""
    path = tmp_path / "big.txt"
    size = (64 << 20) + 12_345
    with open(path, "wb") as fh:
        fh.truncate(size)  # sparse: cheap to write, every byte still read
    stat = path.stat()
    base = fingerprint.content_digest(path)
    assert base == hashlib.sha256(path.read_bytes()).hexdigest()
    for at in (size // 2 + 7, (1 << 20) + 100):  # between the old samples
        with open(path, "r+b") as fh:
            fh.seek(at)
            fh.write(b"x")
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime
        assert fingerprint.content_digest(path) != base, at
        with open(path, "r+b") as fh:
            fh.seek(at)
            fh.write(b"\0")


def test_a_script_without_main_guard_can_prepare(shards_dir, tokenizer_dir: Path,
                                                 tmp_path: Path) -> None:
    """Users call `prepare_corpus` from plain scripts; a "spawn" pool would re-run the script in
    every worker and fail (RuntimeError: "...before the current process has finished its
    bootstrapping phase")."""
    import subprocess
    import sys

    root, docs = shards_dir
    script = tmp_path / "make_store.py"
    script.write_text(
        "from mlsm.data.corpus import prepare_corpus\n"
        f"store = prepare_corpus({str(root)!r}, {str(tokenizer_dir)!r}, {str(tmp_path / 's')!r},"
        " chunk_docs=4, num_proc=2)\n"
        "print(store.n_docs)\n"
    )
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == [str(len(docs))], proc.stderr[-2000:]


# --------------------------------------------------------------------------- worker lifecycle
# multiprocessing.Pool hung the command twice in this class: a SIGTERM during its teardown
# (terminate() joined its task thread forever, seen in CI) and a worker killed by the OS (its
# unit is lost, the result never comes). The workers are now our own processes, fed by pipes.


def _doc_units(n: int, chars: int = 20_000):
    text = " ".join(make_text(400, seed=5))[:chars]
    for i in range(n):
        yield "docs", "mem", 0, [f"{i} {text}"]


def _tokenise(tokenizer_dir: Path, tmp_path: Path, units, out):
    tok_json = AutoTokenizer.from_pretrained(tokenizer_dir).backend_tokenizer.to_str()
    return shards.tokenise_units(units, tok_json, "text", "uint16", 2, out, tmp_path)


@pytest.fixture
def alarm():
    """Fail a test that would hang: SIGALRM raises in the main thread after `seconds`."""
    def ring(*_):
        raise TimeoutError("hung")
    old = signal.signal(signal.SIGALRM, ring)
    yield lambda seconds: signal.alarm(seconds)
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_tokenising_starts_no_thread_here(tokenizer_dir: Path, tmp_path: Path) -> None:
    """No helper thread in the command's process, so a stop never waits to join one."""
    before = threading.active_count()
    with open(tmp_path / "ids.bin", "wb", buffering=0) as ids:
        out = _tokenise(tokenizer_dir, tmp_path, _doc_units(12), ids)
        next(out)
        assert threading.active_count() == before
        assert len(list(out)) == 11


def test_a_stop_mid_corpus_ends_every_worker(tokenizer_dir: Path, tmp_path: Path, alarm) -> None:
    alarm(60)
    with open(tmp_path / "ids.bin", "wb", buffering=0) as ids:
        out = _tokenise(tokenizer_dir, tmp_path, _doc_units(40), ids)
        next(out)
        assert len(mp.active_children()) == 2
        out.close()
    assert mp.active_children() == []


def test_a_killed_worker_is_one_clear_error(tokenizer_dir: Path, tmp_path: Path, alarm) -> None:
    alarm(60)
    with open(tmp_path / "ids.bin", "wb", buffering=0) as ids:
        out = _tokenise(tokenizer_dir, tmp_path, _doc_units(40), ids)
        next(out)
        os.kill(mp.active_children()[0].pid, signal.SIGKILL)  # what the OOM killer does
        with pytest.raises(UserError, match=r"exit code -9 .*--num-proc 1") as info:
            list(out)
    assert "\n" not in str(info.value) and mp.active_children() == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_while_tokenising_ends_prepare_and_its_workers(tokenizer_dir: Path,
                                                               tmp_path: Path) -> None:
    corpus = tmp_path / "big.txt"
    corpus.write_text("\n\n".join(make_text(15000, seed=2)) + "\n")  # ~6 MB: units of 1 MB
    cmd = [sys.executable, "-m", "mlsm", "prepare", str(corpus), "--tokenizer",
           str(tokenizer_dir), "--out", str(tmp_path / "s"), "--num-proc", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not _spooled(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.02)  # until units are spooled to the workers: tokenising on 2 processes
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 128 + signal.SIGTERM, err
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _sid(pid) == proc.pid]
    assert left == [] and not (tmp_path / "s").exists()


def _spooled(folder: Path) -> bool:
    """A spool file in the (hidden) folder the store is built in."""
    return any(f.name.startswith(("in-", "part-")) for d in folder.iterdir() if d.is_dir()
               for f in d.iterdir())


def _sid(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[4])  # fields after "(comm)": state ppid pgrp sid


def test_a_worker_s_unexpected_error_reaches_the_command(tokenizer_dir: Path, tmp_path: Path,
                                                         alarm) -> None:
    """Not bad input but a failure inside a worker (here the tokenizer given a number): raised in
    the command with its type and text, whatever its class, and no worker is left."""
    alarm(60)
    units = iter([("docs", "mem", 0, ["fine"]), ("docs", "mem", 0, [123]),
                  ("docs", "mem", 0, ["fine"])])
    with (open(tmp_path / "ids.bin", "wb", buffering=0) as ids,
          pytest.raises(RuntimeError, match="worker: TypeError")):
        list(_tokenise(tokenizer_dir, tmp_path, units, ids))
    assert mp.active_children() == []
