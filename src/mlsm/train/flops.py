"""Training FLOPs per batch of MLM, KD, naive MLSM, MLSM_L, MLSM_l, MTL and FeatureKD_l, by formula.

Counting rules (the usual matmul-only convention, Kaplan et al. 2020 §2.1; what
`torch.utils.flop_counter.FlopCounterMode` counts): a (m × n)·(n × p) product costs 2mnp; norms,
softmax, activations and embedding look-ups are free. One encoder layer on B sequences of T tokens
with hidden size d and FFN size f costs

    Q, K, V and output projections   4 · 2BTd²
    scores QKᵀ and weighted sum V    2 · 2BT²d
    feed-forward (two matmuls)       2 · 2BTdf

Training a part costs forward + backward ≈ 3 × forward (the backward has two matmuls per forward
matmul); a frozen teacher costs one forward. The vocabulary head is BERT's (d × d transform +
d × |V| decoder), the latent head d × d + d × k, the naive head one d × (|V| + k) linear map
(`mlsm_naive`) — in the paper accounting the official code's HF MLM head resized to |V| + k, its
d × d transform included; feature distillation's head (`feature_kd`) has the latent head's shape
with k = d_t, the teacher's hidden size (d × d + d × d_t), after the teacher's early exit at l.

Two accountings (``accounting=``):

- ``"paper"`` — what reproduces Table 3 of the *Hitchhikers' Guide to Masked Latent Semantic
  Modeling* (anonymous, under review; MLSM itself is Berend 2023), which gives FLOPs per batch
  without stating the batch's size or where the heads run; our inference, from its numbers: one
  batch of 128 sequences, every head
  (student and teacher) at all B·T positions as the official HF-model code computes them, and the
  student's DeBERTa relative attention counted: per layer and attention type (c2p, p2c) a
  (B·T × d)·(d × 2s) score product against 2s relative positions, s = min(T,
  max_relative_positions) as DeBERTa v1 computes it, plus the 2s-row position projections. With
  the DeBERTa-base student, bert-base-cased teacher and k = 3072 this gives MLM 1.13e13
  FLOPs/batch, KD 131.9 %, naive MLSM 134.0 %, MLSM_12 108.0 %, MLSM_10 103.8 % (Table 3:
  1.13e13, 131.9, 132.7, 107.1, 102.7).
- ``"mlsm"`` — ours: the recipe's global batch, heads only at the N = mask_rate · B · (T − 2)
  selected positions (mlsm's sparse prediction; the naive recipe's head still at all B·T), relative
  attention not counted (it costs every objective the same).

Sparse coding is reported separately (Table 3 leaves it out): per target with s non-zeros the
active-set solver costs Dᵀx (2dk), about s/4 steps that each compute the KKT gradient of
every atom from the support (2k·|A|) and rank-one updates of G_AA⁻¹ (≈ 4|A|² per entering or
leaving atom) — ≈ k·s²/4 + 4s³ in all — and the final KKT check (2ks); FISTA-n costs
2dk + n · 4dk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlsm.defaults import default_k
from mlsm.errors import UserError

# Hub teachers built from transformers' BertConfig defaults (BERT-base) so the table works
# offline; only what differs from the defaults is listed (Devlin et al. 2019, Table/appendix).
KNOWN_SHAPES: dict[str, dict[str, int]] = {
    "bert-base-cased": {"vocab_size": 28996},
    "bert-base-uncased": {},  # BertConfig's default vocabulary is bert-base-uncased's 30522
    "bert-large-cased": {"vocab_size": 28996, "hidden_size": 1024, "num_hidden_layers": 24,
                         "num_attention_heads": 16, "intermediate_size": 4096},
}
PAPER_BATCH = 128  # the Hitchhikers' Guide's Table 3 counts one batch of 128 sequences
ACCOUNTINGS = ("paper", "mlsm")


@dataclass(frozen=True)
class Shape:
    d: int  # hidden size
    layers: int  # transformer blocks
    ffn: int  # intermediate (feed-forward) size
    vocab: int  # vocabulary size


def shape_of(config: Any) -> Shape:
    """Shape from an HF PretrainedConfig or a dict with the same field names."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key)
    return Shape(int(get("hidden_size")), int(get("num_hidden_layers")),
                 int(get("intermediate_size")), int(get("vocab_size")))


def encoder_flops(s: Shape, batch: int, seq: int, layers: int | None = None) -> int:
    """Forward FLOPs of `layers` (default all) encoder blocks on (batch, seq) tokens."""
    n_layers = s.layers if layers is None else layers
    tokens = batch * seq
    per_layer = 8 * tokens * s.d**2 + 4 * batch * seq**2 * s.d + 4 * tokens * s.d * s.ffn
    return n_layers * per_layer


def relative_attention_flops(config: Any, batch: int, seq: int) -> int:
    """Forward FLOPs of DeBERTa's disentangled attention terms (He et al. 2021), all layers.

    Per layer and type in pos_att_type (c2p, p2c): scores of the (B·T × d) queries (or keys)
    against 2s relative-position keys (or queries), 2·B·T·2s·d, plus projecting the 2s relative
    embeddings, 2·2s·d². s = min(T, max_relative_positions) as DeBERTa v1 computes it. 0 for
    models without relative attention.
    """
    get = (config.get if isinstance(config, dict)
           else lambda key, default=None: getattr(config, key, default))
    if not get("relative_attention", False):
        return 0
    types = get("pos_att_type", None) or []
    types = types.split("|") if isinstance(types, str) else list(types)
    n_types = sum(t in ("c2p", "p2c") for t in types)
    max_rel = int(get("max_relative_positions", -1) or -1)
    span = min(seq, max_rel if max_rel > 0 else int(get("max_position_embeddings", 512)))
    d = int(get("hidden_size"))
    per_type = 2 * batch * seq * (2 * span) * d + 2 * (2 * span) * d * d
    return int(get("num_hidden_layers")) * n_types * per_type


def vocab_head_flops(s: Shape, n: int) -> int:
    """BERT-style MLM head on n rows: transform d × d, decoder d × |V|."""
    return 2 * n * (s.d * s.d + s.d * s.vocab)


def naive_head_flops(d: int, out: int, n: int, transform: bool) -> int:
    """The naive MLSM head on n rows: d × out (out = |V| + k); with `transform`, the d × d dense
    layer before it that the official code's HF MLM head has (BertOnlyMLMHead, DeBERTa's)."""
    return 2 * n * ((d * d if transform else 0) + d * out)


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


def flops_table(student_config: Any, teacher_config: Any, seq_len: int, batch: int,
                mask_rate: float, k: int, layer: int, fista_iters: int = 100,
                teacher_mlm_head: bool = True, accounting: str = "mlsm") -> list[FlopRow]:
    """FLOPs per training batch of every objective; `total` excludes sparse coding.

    student_config / teacher_config: HF configs or dicts (hidden_size, num_hidden_layers,
    intermediate_size, vocab_size; the student's relative-attention fields are read in the paper
    accounting). layer: MLSM_l's early-exit layer. teacher_mlm_head: whether the teacher's full
    forward includes vocabulary logits (BERT checkpoints do). accounting: "paper" or "mlsm" (see
    the module docstring); "paper" ignores `batch` and uses PAPER_BATCH sequences.
    """
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting must be one of {ACCOUNTINGS}, got {accounting!r}")
    paper = accounting == "paper"
    batch = PAPER_BATCH if paper else batch
    S, T = shape_of(student_config), shape_of(teacher_config)
    n = round(mask_rate * batch * (seq_len - 2))  # selected positions ([CLS]/[SEP] never)
    heads_at = batch * seq_len if paper else n  # rows the student's and KD teacher's heads run on
    rel = relative_attention_flops(student_config, batch, seq_len) if paper else 0
    enc = encoder_flops(S, batch, seq_len) + rel
    latent_head = latent_head_flops(S.d, k, heads_at)
    mlm = 3 * (enc + vocab_head_flops(S, heads_at))
    t_full = encoder_flops(T, batch, seq_len)
    t_early = encoder_flops(T, batch, seq_len, layers=layer)
    t_logits = vocab_head_flops(T, batch * seq_len) if teacher_mlm_head else 0
    coding = sparse_coding_flops(T.d, k, n)
    where = "all positions" if paper else "selected positions"
    if paper:  # the official MTL: one shared transform, decoder d × (|V| + k), two softmaxes
        mtl = FlopRow(f"MTL (l={layer})",
                      3 * (enc + 2 * heads_at * (S.d * S.d + S.d * (S.vocab + k))), t_early, coding,
                      "official head: shared transform + d×(|V|+k) at all positions")
    else:
        mtl = FlopRow(f"MTL (l={layer})", 3 * (enc + latent_head + vocab_head_flops(S, n)), t_early,
                      coding, "both heads at selected positions")
    return [
        FlopRow("MLM", mlm, 0, 0, f"vocabulary head at {where}"),
        FlopRow("KD", mlm, t_full + vocab_head_flops(T, heads_at), 0, f"teacher logits at {where}"),
        FlopRow("MLSM (naive)", 3 * (enc + naive_head_flops(S.d, S.vocab + k, batch * seq_len,
                                                            transform=paper)),
                t_full + t_logits, fista_flops(T.d, k, n, fista_iters),
                f"full teacher, head {'d×d + ' if paper else ''}d×(|V|+k) at all positions, "
                f"FISTA-{fista_iters}"),
        FlopRow(f"MLSM_L (l={T.layers})", 3 * (enc + latent_head), t_full, coding,
                "teacher to its last layer"),
        FlopRow(f"MLSM_l (l={layer})", 3 * (enc + latent_head), t_early, coding, "early exit"),
        mtl,
        FlopRow(f"FeatureKD_l (l={layer})", 3 * (enc + latent_head_flops(S.d, T.d, heads_at)),
                t_early, 0, "early exit, head d×d + d×d_t (dense target, no coding)"),
    ]


def _fmt(x: int) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x} FLOP"


ACCOUNTING_LABELS = {
    "paper": "accounting: paper (reproduces the Hitchhikers' Guide's Table 3; inferred from its "
             "numbers: one batch of 128 sequences, heads at all positions, DeBERTa relative "
             "attention counted)",
    "mlsm": "accounting: mlsm (ours: the recipe's global batch, heads at the selected "
            "positions only, relative attention not counted)",
}


def format_table(rows: list[FlopRow], accounting: str | None = None) -> str:
    """Markdown table: absolute FLOPs per batch and % of MLM (first row named MLM); with
    `accounting`, a first line saying which accounting it is."""
    base = next(r.total for r in rows if r.objective == "MLM")
    lines = [ACCOUNTING_LABELS[accounting], ""] if accounting else []
    lines += [
        "| Objective | Student (fwd+bwd) | Teacher (fwd) | Total | % of MLM | Sparse coding (not "
        "in total) | Note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        coding = _fmt(r.coding) if r.coding else "–"
        note = r.note.replace("|", "\\|")  # a bare | would split the Markdown cell
        lines.append(f"| {r.objective} | {_fmt(r.student)} | "
                     f"{_fmt(r.teacher) if r.teacher else '–'} | {_fmt(r.total)} | "
                     f"{100 * r.total / base:.1f} % | {coding} | {note} |")
    return "\n".join(lines)


def teacher_shape_config(name: str) -> Any:
    """HF config of a teacher: packaged MiniLM for '', a known hub shape, or AutoConfig."""
    from mlsm.hf import first_line, load_config
    from mlsm.teacher.teacher import default_teacher_path

    if not name:
        return load_config(default_teacher_path())
    if name in KNOWN_SHAPES:
        from transformers import BertConfig

        return BertConfig(**KNOWN_SHAPES[name], architectures=["BertForMaskedLM"])
    try:
        return load_config(name)
    except Exception as exc:  # OSError, ValueError, HTTP errors
        raise UserError(f"cannot read the config of teacher {name!r} ({first_line(exc)}); pass "
                        "--teacher PATH to a local model folder") from None


def flops_for_run(cfg: Any, *, teacher: str | None = None, k: int | None = None,
                  layer: int | None = None, vocab_size: int | None = None, accounting: str = "mlsm",
                  student_config: Any = None) -> list[FlopRow]:
    """`flops_table` for a RunConfig: student from model.* (or the built model's `student_config`,
    e.g. when model.init_from is set), teacher/k/layer from objective.*.

    The student's vocabulary is the teacher's (they must tokenise identically) unless vocab_size
    is given. k defaults to objective.k, the dictionary's k, or 4 × the teacher's hidden size.
    """
    import dataclasses

    from transformers import AutoConfig

    from mlsm.hf import load_config

    obj = dataclasses.asdict(cfg.objective)  # options of its objective (not every one has them)
    t_cfg = teacher_shape_config(teacher if teacher is not None else str(obj.get("teacher", "")))
    t = shape_of(t_cfg)
    meta = _latent_meta(str(obj.get("dictionary") or ""), str(obj.get("targets") or ""))
    k = k or int(obj.get("k", 0) or meta.get("k", 0) or default_k(t.d))
    layer = layer if layer is not None else int(obj.get("layer", -1))
    layer = layer if layer >= 0 else int(meta.get("layer", t.layers))
    if not 0 <= layer <= t.layers:
        raise UserError(f"teacher layer {layer} does not exist: the teacher has layers "
                        f"0..{t.layers}; pass --layer (or objective.layer) from 0 to {t.layers}")
    m = cfg.model
    student = student_config
    if student is None:
        student = load_config(m.config) if m.config else AutoConfig.for_model(m.arch, **m.overrides)
    student_shape = {**student.to_dict(), "vocab_size": vocab_size or t.vocab}
    archs = (t_cfg.get("architectures") if isinstance(t_cfg, dict)
             else getattr(t_cfg, "architectures", None)) or []
    has_head = any(a.endswith(("ForMaskedLM", "ForPreTraining")) for a in archs)
    mask = cfg.data.mask_rate
    return flops_table(student_shape, t_cfg, cfg.data.max_len, cfg.train.batch_size, mask, k, layer,
                       teacher_mlm_head=has_head, accounting=accounting)


def _latent_meta(dictionary: str, targets: str) -> dict[str, Any]:
    """k and layer of a latent run as its dictionary records them, else as its target store
    does (a run that reads only a target store names no dictionary); {} for neither."""
    from mlsm.teacher.dictionary import dictionary_meta
    from mlsm.teacher.targets import recorded_inputs

    meta = dictionary_meta(dictionary) if dictionary else {}
    return meta or (recorded_inputs(targets) or {} if targets else {})
