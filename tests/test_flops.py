"""FLOPs formulas against torch's FlopCounterMode on tiny models, and the table itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from mlsm.config import load_config
from mlsm.evaluate.flops import flops_for_run, flops_table, format_table
from mlsm.models.backbone import Student
from mlsm.models.heads import LatentHead
from mlsm.teacher.teacher import Teacher

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


def test_table_orders_and_formats(rows) -> None:
    assert rows["MLSM_l"].total < rows["MLSM_L"].total < rows["MLSM"].total
    assert rows["MLSM"].coding > 10 * rows["MLSM_l"].coding  # FISTA-100 vs exact active set
    text = format_table(list(rows.values()))
    assert text.splitlines()[2].startswith("| MLM |") and "100.0 %" in text.splitlines()[2]
    assert len(text.splitlines()) == 2 + 6


def test_flops_for_a_recipe(tmp_path) -> None:
    cfg = load_config(None, ["model.arch=deberta-v2", "objective.name=mlsm", "objective.teacher=bert-base-cased",
                             "objective.layer=10", "train.batch_size=1024", "data.max_len=128",
                             "model.overrides={hidden_size: 768, num_hidden_layers: 12, num_attention_heads: 12, intermediate_size: 3072}"])
    table = {r.objective: r for r in flops_for_run(cfg, k=3072)}
    # one BERT-base layer forward on 1024 × 128 tokens: 8·N·d² + 4·B·T²·d + 4·N·d·f
    n_tok = 1024 * 128
    layer = 8 * n_tok * 768**2 + 4 * 1024 * 128**2 * 768 + 4 * n_tok * 768 * 3072
    assert table["MLSM_l (l=10)"].teacher == 10 * layer
    assert table["MLSM_L (l=12)"].teacher == 12 * layer
