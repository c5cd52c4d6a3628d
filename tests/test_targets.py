"""Target store: stored codes equal online codes; resume; mismatch errors; training from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mlsm.artifacts.legacy import FORMS
from mlsm.config import DataConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore, prepare_corpus
from mlsm.errors import UserError
from mlsm.objectives import Context, build_objective
from mlsm.teacher.dictionary import load_dictionary, save_dictionary
from mlsm.teacher.targets import TargetStore, build_target_store
from mlsm.teacher.teacher import load_teacher

from .helpers import check_resume, make_text, overfit_losses


def _objective(store_dir: Path, spec: dict, max_len: int = 32):
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    obj = build_objective(spec, Context(tok, torch.device("cpu"), 10, str(store_dir), max_len))
    source = BatchSource(store, DataConfig(store=str(store_dir), max_len=32, seed=3), tok)
    return obj, source


def test_stored_codes_equal_online_codes(
    store_dir, teacher_dir, dictionary_path, target_dir
) -> None:
    meta = TargetStore.open(target_dir).meta
    assert meta["truncated"] == 0 and meta["nnz"] is None and meta["layer"] == 1
    stored, source = _objective(store_dir, {"name": "mlsm", "targets": str(target_dir)})
    online, _ = _objective(
        store_dir, {"name": "mlsm", "dictionary": str(dictionary_path), "teacher": str(teacher_dir)}
    )
    assert not hasattr(stored.coder, "teacher")  # the teacher is never loaded
    for step in (0, 5):  # a shuffled data order: rows come from arbitrary chunks
        batch = source.batch(np.arange(step * 8, step * 8 + 8), step)
        a, b = stored.coder.codes(batch), online.coder.codes(batch)  # (N, k)
        assert a.shape == b.shape == (int(batch.selected.sum()), 64)
        # fp16 storage: ~5e-4 relative error; the solver's own tolerance is 1e-5
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-5)
        assert torch.equal(a > 0, b > 0)  # lossless: the same support, not only close values
        keep = a.sum(1) > 0
        torch.testing.assert_close(
            (a[keep] / a[keep].sum(1, keepdim=True)).sum(1), torch.ones(int(keep.sum()))
        )


def _counting_teacher(teacher_dir: Path) -> tuple[object, list[int]]:
    """The real teacher, recording how many chunks each forward reads (a spy, not a stand-in)."""
    teacher = load_teacher(str(teacher_dir), layer=1)
    seen: list[int] = []
    forward = teacher.hidden_states

    def spy(ids, mask):
        seen.append(len(ids))
        return forward(ids, mask)

    teacher.hidden_states = spy
    return teacher, seen


def _assert_same_store(a_dir: Path, b_dir: Path) -> None:
    a, b = TargetStore.open(a_dir), TargetStore.open(b_dir)
    for name in ("counts", "chunk_ptr", "indices"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_allclose(
        a.values.astype(np.float32), b.values.astype(np.float32), rtol=2e-3, atol=2e-5
    )


def test_build_resumes_after_a_kill(
    store_dir, teacher_dir, dictionary_path, target_dir, tmp_path
) -> None:
    out = tmp_path / "t"
    shutil.copytree(target_dir, out)
    n_chunks = TargetStore.open(out).meta["n_chunks"]
    # a build killed after 16 chunks: no completion marker, garbage after the 16th chunk's entries
    (out / "meta.json").unlink()
    (out / "progress.json").write_text(json.dumps({"done": 16, "truncated": 0}))
    end = int(np.memmap(out / "chunk_ptr.bin", dtype=np.int64, mode="r")[16])
    values = np.memmap(out / "values.bin", dtype=np.float16, mode="r+")
    values[end:] = 7.0
    values.flush()
    del values
    with pytest.raises(UserError, match="not a complete target store"):
        TargetStore.open(out)
    teacher, seen = _counting_teacher(teacher_dir)
    build_target_store(store_dir, dictionary_path, teacher, 32, out, batch_size=16)
    assert sum(seen) == n_chunks - 16  # finished chunks are not recomputed
    _assert_same_store(out, target_dir)
    with pytest.raises(UserError, match="other settings"):  # same folder, other nnz
        build_target_store(store_dir, dictionary_path, teacher, 32, out, nnz=16)


def test_a_build_begun_before_teacher_weights_were_recorded_continues_and_records_them(
    store_dir, teacher_dir, dictionary_path, target_dir, tmp_path, capsys, monkeypatch
) -> None:
    """An interrupted build of an older mlsm (build.json without `teacher_weights`) resumes, as
    an older run does, with a note; its teacher is checked from then on. Once its form leaves
    `legacy.FORMS`, it is a build of other settings."""
    out = tmp_path / "t"
    shutil.copytree(target_dir, out)
    (out / "meta.json").unlink()
    (out / "progress.json").write_text(json.dumps({"done": 16, "truncated": 0}))
    build = json.loads((out / "build.json").read_text())
    recorded = build.pop("teacher_weights")
    (out / "build.json").write_text(json.dumps(build))
    teacher, seen = _counting_teacher(teacher_dir)
    build_target_store(store_dir, dictionary_path, teacher, 32, out, batch_size=16)
    assert "continuing without checking them" in capsys.readouterr().err
    assert json.loads((out / "build.json").read_text())["teacher_weights"] == recorded
    assert sum(seen) == TargetStore.open(out).meta["n_chunks"] - 16
    _assert_same_store(out, target_dir)

    (out / "meta.json").unlink()
    (out / "build.json").write_text(json.dumps(build))
    monkeypatch.delitem(FORMS, "targets-teacher-unrecorded")
    with pytest.raises(UserError, match=r"other settings or inputs \(teacher_weights\)"):
        build_target_store(store_dir, dictionary_path, teacher, 32, out, batch_size=16)


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_resume_recomputes_what_a_damaged_file_lost(
    store_dir, teacher_dir, dictionary_path, target_dir, tmp_path, damage
) -> None:
    out = tmp_path / "t"
    shutil.copytree(target_dir, out)
    meta = TargetStore.open(out).meta
    (out / "meta.json").unlink()  # killed just before the completion marker
    (out / "progress.json").write_text(json.dumps({"done": meta["n_chunks"], "truncated": 0}))
    if damage == "delete":
        (out / "indices.bin").unlink()
    else:
        with open(out / "values.bin", "r+b") as fh:
            fh.truncate(fh.seek(0, 2) // 2)
    teacher, seen = _counting_teacher(teacher_dir)
    build_target_store(store_dir, dictionary_path, teacher, 32, out, batch_size=16)
    assert 0 < sum(seen) <= meta["n_chunks"]
    _assert_same_store(out, target_dir)


def test_a_cap_keeps_the_largest_entries_and_records_the_truncation(
    store_dir, teacher_dir, dictionary_path, target_dir, tmp_path
) -> None:
    teacher = load_teacher(str(teacher_dir), layer=1)
    capped = TargetStore.open(
        build_target_store(store_dir, dictionary_path, teacher, 32, tmp_path / "c", nnz=2,
                           batch_size=16)  # as the fixture: the same sums in the same order
    )
    whole = TargetStore.open(target_dir)
    chunks = np.repeat(np.arange(4), 30)
    positions = np.tile(np.arange(1, 31), 4)
    a, b = capped.dense(chunks, positions), whole.dense(chunks, positions)  # (120, k)
    support = (b > 0).sum(1)
    assert int((a > 0).sum(1).max()) <= 2
    top2 = b.topk(2, dim=1)
    kept = a.topk(2, dim=1)
    # the two largest entries kept, at their values. Compared by value, not index: two nearly
    # equal entries may swap ranks between two builds (another thread count sums the teacher's
    # states in another order), and either one is "the largest two"
    torch.testing.assert_close(b.gather(1, kept.indices), top2.values, atol=1e-3, rtol=0)
    torch.testing.assert_close(kept.values, top2.values, atol=1e-3, rtol=0)
    n_cut = int((whole.counts.astype(np.int64) > 2).sum())
    assert capped.meta["truncated"] == n_cut > 0 and int((support > 2).sum()) > 0


def test_mismatches_are_one_line_errors(
    store_dir, corpus_dir, tokenizer_dir, dictionary_path, target_dir, tmp_path
) -> None:
    spec = {"name": "mlsm", "targets": str(target_dir)}
    with pytest.raises(UserError, match="max_len=32 but data.max_len=64"):
        _objective(store_dir, spec, max_len=64)
    other_dict = load_dictionary(dictionary_path)
    other_dict.atoms = other_dict.atoms.flip(1)
    save_dictionary(other_dict, tmp_path / "other.safetensors")
    with pytest.raises(UserError, match="another dictionary"):
        _objective(store_dir, {**spec, "dictionary": str(tmp_path / "other.safetensors")})
    _objective(
        store_dir, {**spec, "dictionary": str(dictionary_path), "layer": 1}
    )  # consistent: fine
    with pytest.raises(UserError, match="layer-1 codes"):
        _objective(store_dir, {**spec, "layer": 2})
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.txt").write_text("\n\n".join(make_text(5, seed=9)) + "\n")
    other_store = prepare_corpus(str(tmp_path / "c"), str(tokenizer_dir), tmp_path / "store")
    with pytest.raises(UserError, match="another token store") as err:
        _objective(other_store.path, spec)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="not a complete target store"):
        _objective(store_dir, {"name": "mlsm", "targets": str(tmp_path)})


def test_mlsm_trains_from_the_store(store_dir, target_dir) -> None:
    losses = overfit_losses({"name": "mlsm", "targets": str(target_dir)}, store_dir, steps=25)
    assert losses[-1] < 0.6 * losses[0]


def test_mlsm_run_from_the_store_resumes(store_dir, target_dir, tmp_path) -> None:
    check_resume(
        store_dir,
        tmp_path,
        at=2,
        steps=4,
        files=("model.safetensors", "heads.safetensors"),
        **{"objective.name": "mlsm", "objective.targets": str(target_dir)},
    )
