"""Training FLOPs per batch of MLM, KD, naive MLSM, MLSM_L, MLSM_l and MTL, by formula.

Counting rules (the usual matmul-only convention, Kaplan et al. 2020 §2.1; what
`torch.utils.flop_counter.FlopCounterMode` counts): a (m × n)·(n × p) product costs 2mnp; norms,
softmax, activations and embedding look-ups are free. One encoder layer on B sequences of T tokens
with hidden size d and FFN size f costs

    Q, K, V and output projections   4 · 2BTd²
    scores QKᵀ and weighted sum V    2 · 2BT²d
    feed-forward (two matmuls)       2 · 2BTdf

Training a part costs forward + backward ≈ 3 × forward (the backward has two matmuls per forward
matmul); a frozen teacher costs one forward. Heads: ours run at the N selected positions only
(N = mask_rate · B · (T − 2)); the HF-style heads of the naive recipe run at all B·T positions.
The vocabulary head is BERT's (d × d transform + d × |V| decoder), the latent head d × d + d × k,
the naive head one d × (|V| + k) linear map. DeBERTa's relative-position attention terms are not
counted: they cost every objective the same.

Sparse coding is reported separately (the paper leaves it out): per target with s non-zeros
the active-set solver costs Dᵀx (2dk), about s/4 steps that each compute the KKT gradient of
every atom from the support (2k·|A|) and rank-one updates of G_AA⁻¹ (≈ 4|A|² per entering or
leaving atom) — ≈ k·s²/4 + 4s³ in all — and the final KKT check (2ks); FISTA-n costs
2dk + n · 4dk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KNOWN_SHAPES: dict[str, dict[str, int]] = {  # hub teachers, so the table works offline
    "bert-base-cased": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072, "vocab_size": 28996},
    "bert-base-uncased": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072, "vocab_size": 30522},
    "bert-large-cased": {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 4096, "vocab_size": 28996},
}


@dataclass(frozen=True)
class Shape:
    d: int  # hidden size
    layers: int  # transformer blocks
    ffn: int  # intermediate (feed-forward) size
    vocab: int  # vocabulary size


def shape_of(config: Any) -> Shape:
    """Shape from an HF PretrainedConfig or a dict with the same field names."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key)
    return Shape(int(get("hidden_size")), int(get("num_hidden_layers")), int(get("intermediate_size")), int(get("vocab_size")))


def encoder_flops(s: Shape, batch: int, seq: int, layers: int | None = None) -> int:
    """Forward FLOPs of `layers` (default all) encoder blocks on (batch, seq) tokens."""
    n_layers = s.layers if layers is None else layers
    tokens = batch * seq
    per_layer = 8 * tokens * s.d**2 + 4 * batch * seq**2 * s.d + 4 * tokens * s.d * s.ffn
    return n_layers * per_layer


def vocab_head_flops(s: Shape, n: int) -> int:
    """BERT-style MLM head on n rows: transform d × d, decoder d × |V|."""
    return 2 * n * (s.d * s.d + s.d * s.vocab)


def latent_head_flops(d: int, k: int, n: int) -> int:
    """MLSM's latent head on n rows: transform d × d, projection d × k."""
    return 2 * n * (d * d + d * k)


def sparse_coding_flops(d: int, k: int, n: int, support: int = 32) -> int:
    """Estimate of the exact solver per batch of n targets (see the module docstring)."""
    s = support
    per_target = 2 * d * k + k * s * s // 4 + 4 * s**3 + 2 * k * s
    return n * per_target


def fista_flops(d: int, k: int, n: int, iters: int = 100) -> int:
    """FISTA-`iters` on n targets: Dᵀx once, then y·Dᵀ and (·)·D per iteration."""
    return n * (2 * d * k + iters * 4 * d * k)


@dataclass
class FlopRow:
    objective: str
    student: int  # training FLOPs of the student and its heads (forward + backward)
    teacher: int  # forward FLOPs of the frozen teacher
    coding: int  # sparse-coding FLOPs (not in `total`)
    note: str = ""

    @property
    def total(self) -> int:
        return self.student + self.teacher


def flops_table(student_config: Any, teacher_config: Any, seq_len: int, batch: int, mask_rate: float,
                k: int, layer: int, fista_iters: int = 100, teacher_mlm_head: bool = True) -> list[FlopRow]:
    """FLOPs per training batch of every objective; `total` excludes sparse coding.

    student_config / teacher_config: HF configs or dicts (hidden_size, num_hidden_layers,
    intermediate_size, vocab_size). layer: MLSM_l's early-exit layer. teacher_mlm_head: whether
    the naive recipe's full teacher forward includes vocabulary logits (BERT checkpoints do).
    """
    S, T = shape_of(student_config), shape_of(teacher_config)
    n = round(mask_rate * batch * (seq_len - 2))  # selected positions ([CLS]/[SEP] never)
    enc = encoder_flops(S, batch, seq_len)
    mlm = 3 * (enc + vocab_head_flops(S, n))
    latent = 3 * (enc + latent_head_flops(S.d, k, n))
    naive_head = 3 * (enc + 2 * batch * seq_len * S.d * (S.vocab + k))
    t_full = encoder_flops(T, batch, seq_len)
    t_early = encoder_flops(T, batch, seq_len, layers=layer)
    t_logits = vocab_head_flops(T, batch * seq_len) if teacher_mlm_head else 0
    coding = sparse_coding_flops(T.d, k, n)
    return [
        FlopRow("MLM", mlm, 0, 0),
        FlopRow("KD", mlm, t_full + vocab_head_flops(T, n), 0, "teacher logits at selected positions"),
        FlopRow("MLSM (naive)", naive_head, t_full + t_logits, fista_flops(T.d, k, n, fista_iters),
                f"full teacher, head d×(|V|+k) at all positions, FISTA-{fista_iters}"),
        FlopRow(f"MLSM_L (l={T.layers})", latent, t_full, coding, "teacher to its last layer"),
        FlopRow(f"MLSM_l (l={layer})", latent, t_early, coding, "early exit"),
        FlopRow(f"MTL (l={layer})", 3 * (enc + latent_head_flops(S.d, k, n) + vocab_head_flops(S, n)),
                t_early, coding, "both heads at selected positions"),
    ]


def _fmt(x: int) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x} FLOP"


def format_table(rows: list[FlopRow]) -> str:
    """Markdown table: absolute FLOPs per batch and % of MLM (first row named MLM)."""
    base = next(r.total for r in rows if r.objective == "MLM")
    lines = [
        "| Objective | Student (fwd+bwd) | Teacher (fwd) | Total | % of MLM | Sparse coding (not in total) | Note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        coding = _fmt(r.coding) if r.coding else "–"
        lines.append(f"| {r.objective} | {_fmt(r.student)} | {_fmt(r.teacher) if r.teacher else '–'} | "
                     f"{_fmt(r.total)} | {100 * r.total / base:.1f} % | {coding} | {r.note} |")
    return "\n".join(lines)


def teacher_shape_config(name: str) -> Any:
    """HF config of a teacher: packaged MiniLM for '', a known hub shape, or AutoConfig."""
    from mlsm.errors import UserError
    from mlsm.hf import first_line, load_config
    from mlsm.teacher.teacher import default_teacher_path

    if not name:
        return load_config(default_teacher_path())
    if name in KNOWN_SHAPES:
        return {**KNOWN_SHAPES[name], "architectures": ["BertForMaskedLM"]}
    try:
        return load_config(name)
    except Exception as exc:  # OSError, ValueError, HTTP errors
        raise UserError(f"cannot read the config of teacher {name!r} ({first_line(exc)}); pass --teacher PATH to a local model folder") from None


def flops_for_run(cfg: Any, *, teacher: str | None = None, k: int | None = None, layer: int | None = None,
                  vocab_size: int | None = None) -> list[FlopRow]:
    """`flops_table` for a RunConfig: student from model.*, teacher/k/layer from objective.*.

    The student's vocabulary is the teacher's (they must tokenise identically) unless vocab_size
    is given. k defaults to objective.k, the dictionary's k, or 4 × the teacher's hidden size.
    """
    from transformers import AutoConfig

    from mlsm.hf import load_config

    obj = cfg.objective
    t_cfg = teacher_shape_config(teacher if teacher is not None else str(obj.get("teacher", "")))
    t = shape_of(t_cfg)
    meta = _dictionary_meta(str(obj.get("dictionary", "")))
    k = k or int(obj.get("k", 0) or meta.get("k", 0) or 4 * t.d)
    layer = layer if layer is not None else int(obj.get("layer", -1))
    layer = layer if layer >= 0 else int(meta.get("layer", t.layers))
    m = cfg.model
    student = load_config(m.config) if m.config else AutoConfig.for_model(m.arch, **m.overrides)
    student_shape = {"hidden_size": student.hidden_size, "num_hidden_layers": student.num_hidden_layers,
                     "intermediate_size": student.intermediate_size, "vocab_size": vocab_size or t.vocab}
    archs = (t_cfg.get("architectures") if isinstance(t_cfg, dict) else getattr(t_cfg, "architectures", None)) or []
    has_head = any(a.endswith(("ForMaskedLM", "ForPreTraining")) for a in archs)
    mask = cfg.data.mask_rate
    return flops_table(student_shape, t_cfg, cfg.data.max_len, cfg.train.batch_size, mask, k, layer,
                       teacher_mlm_head=has_head)


def _dictionary_meta(path: str) -> dict[str, Any]:
    import json
    from pathlib import Path

    if not path:
        return {}
    meta = Path(path).with_suffix(".json") if path.endswith(".safetensors") else Path(path + ".json")
    return json.loads(meta.read_text()) if meta.is_file() else {}
