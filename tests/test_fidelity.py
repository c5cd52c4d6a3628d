"""Paper-fidelity switches (docs/fidelity.md): MLSM's FISTA targets and batchmean denominator,
KD on the original text, the official MTL head, MAE-LM decoder defaults."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from mlsm.errors import UserError
from mlsm.objectives import forward_step
from mlsm.teacher.dictionary import load_dictionary
from mlsm.teacher.sparse_coding import fista, sparse_encode

from .test_objectives_teacher import _mlsm_spec, _setup


def _reference_x(teacher_dir, batch, layer: int) -> torch.Tensor:
    """ℓ2-normalised teacher states at the selected positions, from HF's own forward (N, d)."""
    model = AutoModel.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        h = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  output_hidden_states=True).hidden_states[layer]
    return F.normalize(h[batch.selected].float(), dim=-1)


def test_fista_solver_gives_the_official_targets(store_dir, teacher_dir, dictionary_path) -> None:
    obj, _, batch = _setup(store_dir,
                           _mlsm_spec("mlsm", teacher_dir, dictionary_path, solver="fista",
                                      fista_iters=7))
    d = load_dictionary(str(dictionary_path))
    x = _reference_x(teacher_dir, batch, 1)
    got = obj.coder.codes(batch)
    torch.testing.assert_close(got, fista(x, d.atoms.float(), d.lam, n_iter=7), rtol=1e-4,
                               atol=1e-5)
    exact, _, _ = _setup(store_dir, _mlsm_spec("mlsm", teacher_dir, dictionary_path))
    torch.testing.assert_close(exact.coder.codes(batch), sparse_encode(x, d.atoms.float(), d.lam),
                               rtol=1e-4, atol=1e-5)
    # 7 iterations are not exact
    assert not torch.allclose(got, exact.coder.codes(batch), atol=1e-4)


def test_zero_codes_count_in_the_denominator(store_dir, teacher_dir, dictionary_path) -> None:
    drop, student, batch = _setup(store_dir, _mlsm_spec("mlsm", teacher_dir, dictionary_path))
    count, _, _ = _setup(store_dir,
                         _mlsm_spec("mlsm", teacher_dir, dictionary_path, zero_codes="count"))
    codes = drop.coder.codes(batch)
    codes[::3] = 0  # force all-zero codes at a third of the positions
    hidden = student.encode(batch.corrupted_ids, batch.attention_mask)[batch.selected]
    from mlsm.objectives.mlsm import latent_kl

    a = latent_kl(drop.heads["latent"], hidden, codes, drop.count_zero)
    b = latent_kl(drop.heads["latent"], hidden, codes, count.count_zero)
    n, zero = len(codes), int((codes.sum(1) == 0).sum())
    assert zero >= n // 3 and int(a.n_targets) == n - zero and int(b.n_targets) == n
    # the official batchmean: same sum, over all N
    torch.testing.assert_close(a.loss_sum, b.loss_sum)


@pytest.mark.parametrize("bad",
                         [{"solver": "spams"}, {"zero_codes": "keep"},
                          {"solver": "fista", "fista_iters": 0}])
def test_mlsm_switches_are_checked(store_dir, teacher_dir, dictionary_path, bad) -> None:
    with pytest.raises(UserError, match="objective."):
        _setup(store_dir, _mlsm_spec("mlsm", teacher_dir, dictionary_path, **bad))


def _student(hidden: int, heads: int):
    from transformers import BertConfig, BertForMaskedLM

    from mlsm.models.backbone import Student

    cfg = BertConfig(vocab_size=100, hidden_size=hidden, num_hidden_layers=1,
                     num_attention_heads=heads, intermediate_size=64, max_position_embeddings=64)
    return Student(BertForMaskedLM(cfg))


def test_mae_decoder_depth_and_dropout_defaults() -> None:
    """Meng et al. 2024: a 4-layer decoder for base-size encoders (2 for small ones), dropout 0."""
    from mlsm.models.mae import build_decoder
    from mlsm.objectives.mae_lm import MAELMConfig

    cfg = MAELMConfig()
    for hidden, heads, depth in ((768, 12, 4), (64, 4, 2)):
        student = _student(hidden, heads)
        decoder, meta = build_decoder(student, cfg.decoder_layers, cfg.decoder_width,
                                      cfg.decoder_heads, 32, 0, cfg.decoder_dropout)
        layers = decoder.layers
        assert len(layers) == depth and meta["layers"] == depth
        assert all(m.p == 0.0 for m in layers.modules() if isinstance(m, torch.nn.Dropout))
    student = _student(64, 4)
    decoder, _ = build_decoder(student, 2, 0, 0, 32, 0, dropout=0.1)  # both stay options
    assert len(decoder.layers) == 2
    assert {m.p for m in decoder.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}


def test_mtl_shared_head_is_one_transform_and_a_concatenated_decoder(store_dir, teacher_dir,
                                                                     dictionary_path) -> None:
    """objective.head=shared (the official MTL): one transform, decoder d × (|V| + k), two
    softmaxes."""
    obj, student, batch = _setup(store_dir,
                                 _mlsm_spec("mtl", teacher_dir, dictionary_path, kappa=0.5,
                                            head="shared"))
    latent = obj.exported_heads()["latent"]
    # no own transform
    assert sorted(n for n, _ in latent.named_parameters()) == ["proj.bias", "proj.weight"]
    pred = student.hf.cls.predictions
    hidden = student.encode(batch.corrupted_ids, batch.attention_mask)[batch.selected]  # (N, d)
    t = pred.transform(hidden)
    weight = torch.cat([pred.decoder.weight, latent.proj.weight])  # (|V| + k, d): one decoder
    bias = torch.cat([pred.decoder.bias, latent.proj.bias])
    joint = t @ weight.T + bias  # (N, |V| + k)
    vocab = student.vocab_logits(hidden)
    torch.testing.assert_close(torch.cat([vocab, latent(hidden)], 1), joint, rtol=1e-5, atol=1e-5)
    # loss: mean KL on the last k (own softmax) + κ · mean CE on the first |V| (own softmax)
    codes = obj.mlsm.coder.codes(batch)
    keep = codes.sum(1) > 0
    p = codes[keep] / codes[keep].sum(1, keepdim=True)
    log_q = F.log_softmax(joint[keep, vocab.shape[1]:], -1)
    kl = (torch.xlogy(p, p) - p * log_q).sum(1).mean()
    ce = F.cross_entropy(joint[:, :vocab.shape[1]], batch.input_ids[batch.selected])
    out = forward_step(student, obj, batch)
    torch.testing.assert_close(out.loss_sum / out.n_targets, kl + 0.5 * ce, rtol=1e-4, atol=1e-4)
    (out.loss_sum / out.n_targets).backward()
    assert pred.transform.dense.weight.grad is not None and latent.proj.weight.grad is not None
    with pytest.raises(UserError, match="objective.head"):
        _setup(store_dir, _mlsm_spec("mtl", teacher_dir, dictionary_path, head="both"))


def test_hitchhiker_recipes_are_the_papers_setting() -> None:
    """DeBERTa-base v1's shape (~8.3M parameters per layer: the Hitchhikers' Guide to Masked Latent
    Semantic Modeling, §4.1), the official code's masking (its pretrainer.py: Bernoulli(0.15) over
    non-special tokens, 100 % [MASK]), torch's AdamW epsilon and a KD teacher on the original
    text."""
    from pathlib import Path

    from transformers import AutoConfig

    from mlsm.run_config import load_config

    root = Path(__file__).resolve().parents[1] / "configs" / "hitchhiker"
    for name in ("mlm", "kd", "mlsm", "mtl"):
        cfg = load_config(root / f"{name}.yaml")
        assert not cfg.data.exact_count and cfg.data.mask_split == [1.0, 0.0, 0.0], name
        assert cfg.optim.eps == 1e-8, name
    assert load_config(root / "kd.yaml").objective.teacher_input == "original"
    m = load_config(root / "mlsm.yaml").model
    config = AutoConfig.for_model(m.arch,
                                  **{**m.overrides, "num_hidden_layers": 1, "vocab_size": 28996})
    layer = AutoModel.from_config(config).encoder.layer[0]
    assert 8.2e6 < sum(p.numel() for p in layer.parameters()) < 8.4e6
