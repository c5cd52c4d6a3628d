"""`mlsm export --format sentence-transformers`: a folder `SentenceTransformer(path)` loads offline,
whose embeddings are the masked mean of the encoder's last hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModel, AutoTokenizer

from mlsm.cli import main
from tests.helpers import last_checkpoint

st = pytest.importorskip("sentence_transformers")

SENTENCES = ["the cat sees a dog.", "a big red house near the river and the old tree.",
             "music plays."]  # unequal lengths: padding must not count in the mean


def _reference(folder: Path, normalize: bool) -> torch.Tensor:
    """Masked mean of last hidden states, written out here (no sentence-transformers)."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state  # (B, T, d)
    m = enc["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
    mean = (h * m).sum(1) / m.sum(1)  # (B, d)
    return torch.nn.functional.normalize(mean, dim=-1) if normalize else mean


@pytest.fixture
def mlm_checkpoint(mlm_run: Path) -> Path:
    """The final checkpoint of the session's tiny MLM run (conftest.py)."""
    return last_checkpoint(mlm_run)


@pytest.mark.parametrize("normalize", [False, True])
def test_sentence_transformers_export_embeds_as_masked_mean(mlm_checkpoint, tmp_path,
                                                            normalize) -> None:
    out = tmp_path / "st"
    flags = ["--normalize"] if normalize else []
    assert main(["export", str(mlm_checkpoint), "--out", str(out), "--format",
                 "sentence-transformers", *flags]) == 0
    model = st.SentenceTransformer(str(out), device="cpu", local_files_only=True)
    got = torch.from_numpy(model.encode(SENTENCES, batch_size=3))
    torch.testing.assert_close(got, _reference(out, normalize), rtol=1e-5, atol=1e-6)
    assert model.max_seq_length == 32  # the length the checkpoint was trained on
    modules = json.loads((out / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", *(["2_Normalize"] * normalize)]
    card = (out / "README.md").read_text()
    header = yaml.safe_load(card.split("---")[1])
    assert header["library_name"] == "sentence-transformers" and "mteb" in card
    assert json.loads((out / "mlsm.json").read_text())["sentence_transformers"]["normalize"] \
        == normalize


def test_normalize_needs_the_format(mlm_checkpoint, tmp_path, capsys) -> None:
    assert main(["export", str(mlm_checkpoint), "--out", str(tmp_path / "x"),
                 "--normalize"]) == 2
    assert "--format sentence-transformers" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
