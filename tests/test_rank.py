"""tau-effective rank: constructed spectra, Gram path, layer-wise table on a tiny encoder."""

from __future__ import annotations

import csv
import io

import pytest
import torch
from transformers import BertConfig, BertModel

from mlsm.errors import UserError
from mlsm.evaluate.zeroshot.rank import (
    effective_rank,
    effective_rank_from_gram,
    layerwise_effective_rank,
    read_sentences,
    write_rank_report,
)
from tests.helpers import (
    SENTENCES,
    VOCAB,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


def with_spectrum(s: list[float], n: int = 60, d: int = 24, seed: int = 0) -> torch.Tensor:
    """U diag(s) V^T with random orthonormal U (n, r), V (d, r): singular values exactly s."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n, len(s), generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, len(s), generator=gen, dtype=torch.float64))
    return u @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ v.T


# energies (sigma^2) 40, 30, 15, 8, 4, 2, 1 of 100: cumulative .40 .70 .85 .93 .97 .99 1.0
ENERGY = [40.0, 30.0, 15.0, 8.0, 4.0, 2.0, 1.0]


@pytest.mark.parametrize("tau,want", [(0.9, 4), (0.3, 1), (0.5, 2), (0.85, 3), (0.95, 5),
                                      (0.99, 6), (1.0, 7)])
def test_known_spectrum(tau, want):
    x = with_spectrum([e**0.5 for e in ENERGY])
    assert effective_rank(x, tau) == want
    assert effective_rank_from_gram(x.T @ x, tau) == want


@pytest.mark.parametrize("tau,want", [(0.9, 4), (0.6, 2), (0.8, 3), (0.98, 6)])
def test_scale_free_and_float32(tau, want):
    # taus strictly between two cumulative ratios: float32 rounding cannot move the answer
    x = with_spectrum([e**0.5 for e in ENERGY]).float()
    assert effective_rank(x * 1e3, tau) == want == effective_rank(x * 1e-3, tau)


def test_degenerate_and_orientation():
    assert effective_rank(torch.zeros(5, 4)) == 0
    assert effective_rank(torch.ones(7, 3)) == 1  # rank one
    x = with_spectrum([1.0] * 10, n=30, d=12)  # flat spectrum: ceil(0.9 * 10) = 9
    assert effective_rank(x) == 9 and effective_rank(x.T) == 9


def test_centering_removes_the_common_direction():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200, 16, generator=gen, dtype=torch.float64) * 0.01 + 5.0  # big shared mean
    assert effective_rank(x) == 1
    centred = x - x.mean(0)
    assert effective_rank(centred) > 8
    assert effective_rank_from_gram(centred.T @ centred) == effective_rank(centred)


def test_gram_matches_svd_on_random_spectra():
    gen = torch.Generator().manual_seed(2)
    for trial in range(5):
        s = torch.rand(12, generator=gen, dtype=torch.float64).pow(3 + trial).tolist()
        x = with_spectrum(s, seed=trial)
        assert effective_rank_from_gram(x.T @ x) == effective_rank(x)


def test_bad_arguments(tmp_path):
    with pytest.raises(UserError, match="tau"):
        effective_rank(torch.ones(3, 3), tau=0)
    with pytest.raises(UserError, match="2-D"):
        effective_rank(torch.ones(3))
    with pytest.raises(UserError, match="not found"):
        read_sentences(tmp_path / "none.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(UserError, match="no non-empty"):
        read_sentences(tmp_path / "empty.txt")


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=3,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    return BertModel(config).eval()


def test_layerwise_table(encoder, tok):
    table = layerwise_effective_rank(encoder, tok, SENTENCES, mask_rate=0.15, seed=0, batch_size=3)
    assert table.layers == [0, 1, 2, 3]
    n_real = [len(tok.tokenize(s)) for s in SENTENCES]
    n_mask = [max(1, round(0.15 * n)) for n in n_real]
    assert table.counts == {"unmasked": sum(n_real), "masked_all": sum(n_real),
                            "masked_mask": sum(n_mask), "masked_real": sum(n_real) - sum(n_mask)}
    for cond, ranks in table.ranks.items():
        assert all(1 <= r <= min(table.counts[cond], 32) for r in ranks), cond
    # same seed, other batching: the same masks, hence the same table
    again = layerwise_effective_rank(encoder, tok, SENTENCES, mask_rate=0.15, seed=0, batch_size=8)
    assert again.ranks == table.ranks


def test_unmasked_column_equals_direct_svd(encoder, tok):
    """Reference: one unpadded forward per sentence, stack the non-special rows, SVD."""
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(4)]
    for s in SENTENCES:
        ids = torch.tensor([tok(s)["input_ids"]])
        with torch.no_grad():
            states = encoder(input_ids=ids, output_hidden_states=True).hidden_states
        for layer, h in enumerate(states):
            per_layer[layer].append(h[0, 1:-1])  # drop [CLS] and [SEP]
    for tau in (0.9, 0.5):
        want = [effective_rank(torch.cat(rows), tau) for rows in per_layer]
        table = layerwise_effective_rank(encoder, tok, SENTENCES, mask_rate=0.0, tau=tau)
        assert list(table.ranks) == ["unmasked"]
        assert table.ranks["unmasked"] == want


def test_report_files(encoder, tok, tmp_path):
    table = layerwise_effective_rank(encoder, tok, SENTENCES[:4], mask_rate=0.3, seed=1)
    paths = write_rank_report(table, tmp_path / "rank")
    rows = list(csv.DictReader(io.StringIO(paths["csv"].read_text())))
    assert [int(r["layer"]) for r in rows] == table.layers
    assert [int(r["masked_real"]) for r in rows] == table.ranks["masked_real"]
    assert "| layer |" in paths["markdown"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = tmp_path / "s.txt"
    text.write_text("the cat\n\n  a dog  \n")
    assert read_sentences(text) == ["the cat", "a dog"]


def test_load_encoder(encoder, tok, tmp_path):
    from mlsm.evaluate.zeroshot.rank import load_encoder

    encoder.save_pretrained(tmp_path / "enc")
    tok.save_pretrained(tmp_path / "enc")
    model, tokenizer = load_encoder(str(tmp_path / "enc"))
    a = layerwise_effective_rank(model, tokenizer, SENTENCES, seed=3)
    assert a.ranks == layerwise_effective_rank(encoder, tok, SENTENCES, seed=3).ranks
    with pytest.raises(UserError, match="missing does not exist"):
        load_encoder(str(tmp_path / "missing"))


def test_sentences_beyond_the_model_positions_are_cut_there(tok):
    """A model of 16 positions and a sentence of more tokens (#52 item 7: an IndexError from the
    position embeddings before): without --max-length, sentences are cut at the model's positions,
    and the table counts exactly the tokens kept."""
    torch.manual_seed(0)
    short = BertModel(BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=64,
                                 max_position_embeddings=16)).eval()
    long = " ".join(SENTENCES)
    assert len(tok(long)["input_ids"]) > 16
    table = layerwise_effective_rank(short, tok, [long, SENTENCES[0]], mask_rate=0.0)
    assert table.meta["max_length"] == 16 and table.meta["n_cut"] == 1
    kept = [min(len(tok.tokenize(s)), 16 - 2) for s in (long, SENTENCES[0])]
    assert table.counts["unmasked"] == sum(kept)


def test_rank_cli_says_how_many_sentences_it_cut(tok, tmp_path, capsys):
    """`mlsm rank` on a model of 16 positions: exit 0, no transformers warning, and one note."""
    from transformers import BertForMaskedLM

    from mlsm.cli import main

    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64,
                               max_position_embeddings=16)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "s.txt").write_text(" ".join(SENTENCES) + "\n" + SENTENCES[0] + "\n")
    capsys.readouterr()
    assert main(["rank", str(tmp_path / "m"), "--text", str(tmp_path / "s.txt"), "--out",
                 str(tmp_path / "r"), "--mask-rate", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["mlsm rank: note: 1 of 2 sentences were longer than 16 tokens and were cut "
                   "there"], err
