"""FLOPs formulas against torch's FlopCounterMode on tiny models, and the table itself."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from mlsm.models.backbone import Student
from mlsm.models.heads import LatentHead
from mlsm.run_config import load_config
from mlsm.teacher.teacher import Teacher
from mlsm.train.flops import flops_for_run, flops_table, format_table

B, T, K, RATE = 4, 32, 96, 0.15
STUDENT = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 200}
TEACHER = {"hidden_size": 48, "num_hidden_layers": 4, "intermediate_size": 192, "vocab_size": 200}


def _mlm(shape: dict) -> BertForMaskedLM:
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(num_attention_heads=4, **shape))
    model.set_attn_implementation("eager")  # FlopCounterMode does not count CPU SDPA kernels
    return model


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def rows() -> dict[str, object]:
    table = flops_table(STUDENT, TEACHER, T, B, RATE, K, layer=2)
    return {r.objective.split(" (")[0]: r for r in table}


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (B, T), generator=gen)
    n = round(RATE * B * (T - 2))
    body = torch.zeros(B * (T - 2), dtype=torch.bool)
    body[torch.randperm(B * (T - 2), generator=gen)[:n]] = True
    selected = F.pad(body.view(B, T - 2), (1, 1))  # (B, T), exactly n body positions
    return ids, selected


def _close(measured: int, formula: int) -> None:
    # exact: the formulas count every matmul FlopCounterMode counts, forward and backward
    assert measured == formula, (measured, formula)


def test_student_training_flops_match_the_counter(rows, batch) -> None:
    ids, sel = batch
    student = Student(_mlm(STUDENT))
    mask = torch.ones_like(ids)

    def mlm_step() -> None:
        logits = student.vocab_logits(student.encode(ids, mask)[sel])  # (N, V)
        F.cross_entropy(logits, ids[sel]).backward()

    head = LatentHead(64, K)

    def mlsm_step() -> None:
        z = head(student.encode(ids, mask)[sel])  # (N, k)
        F.log_softmax(z, -1).mean().backward()

    naive = torch.nn.Linear(64, 200 + K)

    def naive_step() -> None:
        z = naive(student.encode(ids, mask))[sel][:, -K:]  # head at all positions
        F.log_softmax(z, -1).mean().backward()

    _close(_count(mlm_step), rows["MLM"].student)
    _close(_count(mlsm_step), rows["MLSM_l"].student)
    _close(_count(naive_step), rows["MLSM"].student)


def test_teacher_forward_flops_match_the_counter(rows, batch, tokenizer_dir) -> None:
    ids, sel = batch
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    early = Teacher(_mlm(TEACHER).bert, tok, layer=2)
    full = Teacher(_mlm(TEACHER).bert, tok, layer=4)
    _close(_count(lambda: early.hidden_states(ids)), rows["MLSM_l"].teacher)
    _close(_count(lambda: full.hidden_states(ids)), rows["MLSM_L"].teacher)
    teacher = _mlm(TEACHER).eval()

    def kd_teacher() -> None:
        with torch.no_grad():
            teacher.cls(teacher.bert(input_ids=ids).last_hidden_state[sel])

    def naive_teacher() -> None:
        with torch.no_grad():
            teacher(input_ids=ids, output_hidden_states=True)  # logits at every position

    _close(_count(kd_teacher), rows["KD"].teacher)
    _close(_count(naive_teacher), rows["MLSM"].teacher)


def test_feature_kd_row_matches_the_counter(rows, batch, tokenizer_dir) -> None:
    """feature_kd: the student with a d × d + d × d_t head at the selected positions (k = the
    teacher's hidden size, not the dictionary's), the teacher to layer l, no sparse coding."""
    ids, sel = batch
    student = Student(_mlm(STUDENT))
    mask = torch.ones_like(ids)
    head = LatentHead(STUDENT["hidden_size"], TEACHER["hidden_size"])

    def step() -> None:
        y = head(student.encode(ids, mask)[sel])  # (N, d_t)
        (1 - F.cosine_similarity(y, torch.ones_like(y), dim=-1)).sum().backward()

    early = Teacher(_mlm(TEACHER).bert, AutoTokenizer.from_pretrained(tokenizer_dir), layer=2)
    _close(_count(step), rows["FeatureKD_l"].student)
    _close(_count(lambda: early.hidden_states(ids)), rows["FeatureKD_l"].teacher)
    assert rows["FeatureKD_l"].coding == 0


def test_table_orders_and_formats(rows) -> None:
    assert rows["MLSM_l"].total < rows["MLSM_L"].total < rows["MLSM"].total
    assert rows["MLSM"].coding > 10 * rows["MLSM_l"].coding  # FISTA-100 vs exact active set
    text = format_table(list(rows.values()))
    assert text.splitlines()[2].startswith("| MLM |") and "100.0 %" in text.splitlines()[2]
    assert len(text.splitlines()) == 2 + 7


def test_flops_for_a_recipe(tmp_path) -> None:
    cfg = load_config(
        None,
        [
            "model.arch=deberta-v2", "objective.name=mlsm", "objective.teacher=bert-base-cased",
            "objective.layer=10", "train.batch_size=1024", "data.max_len=128",
            "model.overrides={hidden_size: 768, num_hidden_layers: 12, num_attention_heads: 12, "
            "intermediate_size: 3072}",
        ],
    )
    table = {r.objective: r for r in flops_for_run(cfg, k=3072)}
    # one BERT-base layer forward on 1024 × 128 tokens: 8·N·d² + 4·B·T²·d + 4·N·d·f
    n_tok = 1024 * 128
    layer = 8 * n_tok * 768**2 + 4 * 1024 * 128**2 * 768 + 4 * n_tok * 768 * 3072
    assert table["MLSM_l (l=10)"].teacher == 10 * layer
    assert table["MLSM_L (l=12)"].teacher == 12 * layer


def test_relative_attention_flops_match_the_counter() -> None:
    """DeBERTa's c2p + p2c terms (counted in the paper accounting) against FlopCounterMode."""
    from transformers import DebertaV2Config, DebertaV2Model

    from mlsm.train.flops import encoder_flops, relative_attention_flops, shape_of

    cfg = DebertaV2Config(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        relative_attention=True,
        max_relative_positions=T,
        pos_att_type=["c2p", "p2c"],
        position_biased_input=False,
        max_position_embeddings=64,
    )
    model = DebertaV2Model(cfg).eval()
    ids = torch.randint(5, 100, (B, T), generator=torch.Generator().manual_seed(0))
    measured = _count(lambda: model(input_ids=ids))
    shape = cfg.to_dict()
    assert relative_attention_flops(shape, B, T) > 0
    assert measured == encoder_flops(shape_of(shape), B, T) + relative_attention_flops(shape, B, T)
    assert relative_attention_flops({**shape, "relative_attention": False}, B, T) == 0


# Table 3 of the Hitchhikers' Guide to Masked Latent Semantic Modeling: MLM FLOPs per batch, then %
# of MLM
PAPER_MLM = 1.13e13
PAPER_PERCENT = {"KD": 131.9, "MLSM (naive)": 132.7, "MLSM_L (l=12)": 107.1, "MLSM_l (l=10)": 102.7}
_UNITS = {"PFLOP": 1e15, "TFLOP": 1e12, "GFLOP": 1e9, "MFLOP": 1e6}


def test_paper_accounting_reproduces_table_3(capsys) -> None:
    """`mlsm flops --config configs/hitchhiker/mlsm.yaml --accounting paper` prints Table 3:
    every ratio within ±1.5 percentage points, MLM within ±5 % (offline: bert-base-cased's
    config is built from BertConfig)."""
    from pathlib import Path

    from mlsm.cli import main

    recipe = Path(__file__).resolve().parent.parent / "configs" / "hitchhiker" / "mlsm.yaml"
    assert main(["flops", "--config", str(recipe), "--accounting", "paper", "--k", "3072"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("accounting: paper")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]
        if len(cells) == 7 and cells[4].endswith("%"):
            value, unit = cells[3].split()
            rows[cells[0]] = (float(value) * _UNITS[unit], float(cells[4].rstrip(" %")))
    assert abs(rows["MLM"][0] - PAPER_MLM) <= 0.05 * PAPER_MLM, rows["MLM"]
    for name, percent in PAPER_PERCENT.items():  # naive MLSM is the farthest: 134.0 vs 132.7
        assert abs(rows[name][1] - percent) <= 1.3 + 1e-9, (name, rows[name][1], percent)


def test_paper_naive_head_is_the_hf_mlm_head_resized() -> None:
    """--accounting paper: the naive row's head is the official code's, HF's MLM head resized to
    |V| + k (its d × d transform included) at every position, counted by torch against the
    vocabulary head of the MLM row."""
    from mlsm.train.flops import PAPER_BATCH

    table = flops_table(STUDENT, TEACHER, T, B, RATE, K, layer=2, accounting="paper")
    paper = {r.objective.split(" (")[0]: r for r in table}
    hidden = torch.randn(PAPER_BATCH, T, STUDENT["hidden_size"], requires_grad=True)

    def head_step(vocab: int) -> int:  # forward + backward of BertOnlyMLMHead at every position
        head = _mlm({**STUDENT, "vocab_size": vocab}).cls
        return _count(lambda: head(hidden).sum().backward())

    measured = head_step(STUDENT["vocab_size"] + K) - head_step(STUDENT["vocab_size"])
    _close(measured, paper["MLSM"].student - paper["MLM"].student)


def test_mlsm_accounting_is_labelled_and_teacher_config_offline(capsys) -> None:
    from transformers import BertConfig

    from mlsm.cli import main
    from mlsm.train.flops import teacher_shape_config

    cfg = teacher_shape_config("bert-base-cased")
    assert (
        cfg.to_dict() == BertConfig(vocab_size=28996, architectures=["BertForMaskedLM"]).to_dict()
    )
    assert (
        main(
            [
                "flops", "model.arch=bert", "--teacher", "bert-base-cased", "--k", "3072",
                "--layer", "10",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("accounting: mlsm (ours")


def test_k_and_layer_come_from_the_target_store_when_no_dictionary_is_named(
        tmp_path, teacher_dir) -> None:
    """A run that reads only a target store (objective.targets, no objective.dictionary): its
    FLOPs per batch use the store's k and layer, as if they were passed (they used to fall back
    to 4 d and the teacher's last layer, so FLOP/s and MFU were wrong)."""
    import json

    store = tmp_path / "targets"
    store.mkdir()
    # what a target store records while it is built (meta.json repeats it when complete)
    (store / "build.json").write_text(json.dumps({"k": 96, "layer": 1, "lam": 0.05}))
    cfg = load_config(None, ["objective.name=mlsm", f"objective.teacher={teacher_dir}",
                             f"objective.targets={store}", "train.batch_size=4",
                             "data.max_len=32"])
    got = flops_for_run(cfg)
    assert got == flops_for_run(cfg, k=96, layer=1)
    assert got != flops_for_run(load_config(None, ["objective.name=mlsm",
                                                   f"objective.teacher={teacher_dir}",
                                                   "train.batch_size=4", "data.max_len=32"]))
