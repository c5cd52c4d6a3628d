"""One fine-tuning cell of a classification, regression, token or QA task, in pieces the grid
(`finetune`) and the benchmarks put together: the task head drawn from (seed, task, d) alone,
the task's tokenised features and batches, the training loop, predictions and the task metric.
Retrieval cells are `retrieval_cell`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mlsm.errors import UserError
from mlsm.evaluate.finetune import protocol, qa
from mlsm.evaluate.finetune.cell import (
    LOG_EVERY,
    linear_schedule,
    optimizer,
    stable_seed,
    step_budget,
    training_order,
)
from mlsm.evaluate.finetune.tasks import Example, TaskSpec
from mlsm.progress import Progress


class TaskHead(nn.Module):
    """Head on the backbone output: first token → dense+tanh → linear (cls/reg), or per-token
    linear; pooling="mean": mean of the unpadded tokens → linear (Gisserot-Boukhlef et al. 2025).

    The dense+tanh layer plays the role of BERT's pooler, built by us so that it is the same for
    every backbone (some have no pooler, others a pretrained one).
    """

    def __init__(self, d: int, n_out: int, per_token: bool, dropout: float = 0.1,
                 pooling: str = "cls") -> None:
        super().__init__()
        self.per_token, self.pooling = per_token, pooling
        self.drop = nn.Dropout(dropout)
        self.dense = None if per_token or pooling == "mean" else nn.Linear(d, d)
        self.out = nn.Linear(d, n_out)

    def forward(self, hidden: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: (B, T, d) -> logits (B, T, n_out) per token, or (B, n_out) from position 0
        # or (pooling="mean") from the mean of the tokens the (B, T) attention mask keeps
        x = (hidden if self.per_token else protocol.mean_pool(hidden, attention_mask)
             if self.pooling == "mean" else hidden[:, 0])
        if self.dense is not None:
            x = torch.tanh(self.dense(self.drop(x)))
        return self.out(self.drop(x))


def build_head(spec: TaskSpec, d: int, seed: int, pooling: str = "cls") -> TaskHead:
    """The head for (task, seed): weights ~ N(0, 0.02²), biases 0, drawn on CPU from a generator
    seeded by (seed, task, d) alone — identical for every backbone with hidden size d."""
    head = TaskHead(d, spec.num_outputs, per_token=spec.kind in ("token", "qa"), pooling=pooling)
    gen = torch.Generator().manual_seed(stable_seed("head", seed, spec.name, d))
    with torch.no_grad():
        for module in (head.dense, head.out):
            if module is not None:
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
                module.bias.zero_()
    return head


# ----------------------------------------------------------------------------- encoding


def load_tokenizer(path: str, spec: TaskSpec) -> Any:
    from mlsm import hf

    if spec.kind != "token":  # QA: `qa.encode_windows` refuses a slow tokenizer
        return hf.load_tokenizer(path)
    # Pre-split words need add_prefix_space for byte-level BPE tokenizers (RoBERTa, GPT-2);
    # WordPiece tokenizers ignore it.
    tok = hf.load_tokenizer(path, add_prefix_space=True)
    if not tok.is_fast:
        raise UserError(f"{path}: token tasks need a fast tokenizer (tokenizer.json) "
                        "for word alignment")
    return tok


def encode(tokenizer: Any, spec: TaskSpec, examples: Sequence[Example],
           max_len: int) -> list[dict[str, Any]]:
    """Tokenised features: {"inputs": tokenizer fields, "label": ...,
    "words": word index per labelled token}.

    Token tasks label the first sub-token of each word and put -100 on every other position.
    QA tasks give one feature per context window (`qa.encode_windows`).
    """
    if spec.kind == "qa":
        return qa.encode_windows(tokenizer, examples, max_len)
    feats = []
    for ex in examples:
        if spec.kind != "token":
            enc = tokenizer(ex.text, ex.text_pair, truncation=True, max_length=max_len)
            feats.append({"inputs": dict(enc), "label": ex.label, "words": None})
            continue
        enc = tokenizer(ex.text, is_split_into_words=True, truncation=True, max_length=max_len)
        labels, words, prev = [], [], None
        for w in enc.word_ids():
            first = w is not None and w != prev
            labels.append(ex.label[w] if first else -100)
            if first:
                words.append(w)
            prev = w
        feats.append({"inputs": dict(enc), "label": labels, "words": words})
    return feats


def collate(tokenizer: Any, spec: TaskSpec, feats: Sequence[dict[str, Any]],
            device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Pad a batch: model inputs (B, T) and labels (B,) or (B, T) with -100 padding; QA:
    (B, 2) start/end positions."""
    if spec.kind == "qa":
        return qa.collate(tokenizer, feats, device)
    batch = tokenizer.pad([f["inputs"] for f in feats], return_tensors="pt")
    if spec.kind == "token":
        width = batch["input_ids"].shape[1]
        labels = torch.tensor([f["label"] + [-100] * (width - len(f["label"])) for f in feats])
    else:
        labels = torch.tensor([f["label"] for f in feats],
                              dtype=torch.float32 if spec.kind == "reg" else torch.long)
    return {k: v.to(device) for k, v in batch.items()}, labels.to(device)


# ----------------------------------------------------------------------------- train / eval


def _loss(spec: TaskSpec, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if spec.kind == "reg":
        return nn.functional.mse_loss(logits.squeeze(-1), labels)
    # (B, C) vs (B,) or (B, T, C) vs (B, T); -100 marks non-first sub-tokens and padding
    return nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)


def train_cell(backbone: nn.Module, head: TaskHead, tokenizer: Any, spec: TaskSpec,
               feats: list[dict[str, Any]], seed: int, cfg: dict[str, Any], device: torch.device,
               tracker: Any = None) -> int:
    """Fine-tune backbone + head in place: AdamW, linear schedule, ``cfg["epochs"]`` epochs.
    Returns the number of optimizer steps.

    cfg["fixed_order"]: every seed trains on seed 0's data order (the Hitchhikers' Guide §4.2: seeds
    differ in the head only); cfg["clip"]: gradient-norm clipping, 0 = none. tracker: an
    `mlsm.train.tracking.Tracker` that gets the training loss and lr every LOG_EVERY steps."""
    torch.manual_seed(seed)  # dropout masks; the data order has its own generator
    order = training_order(len(feats), 0 if cfg.get("fixed_order") else seed, spec.name,
                           cfg["epochs"])
    clip = float(cfg.get("clip", 1.0))
    bs = cfg["batch_size"]
    total = step_budget(len(feats), cfg)  # epochs, or max_steps when that ends first
    warm = int(cfg["warmup_ratio"] * total)
    opt = optimizer([*backbone.parameters(), *head.parameters()], cfg["lr"], cfg["weight_decay"])
    sched = linear_schedule(opt, total, warm)
    backbone.train()
    head.train()
    step = 0
    # a cell can take many minutes on a CPU: its own progress under the grid's
    bar = Progress(total, f"{spec.name} seed {seed}", "step", leave=False)
    for perm in order:
        for i in range(0, len(perm) if step < total else 0, bs):
            inputs, labels = collate(tokenizer, spec, [feats[j] for j in perm[i:i + bs]], device)
            hidden = backbone(**inputs).last_hidden_state
            logits = head(hidden, inputs.get("attention_mask"))
            loss = (qa.loss(logits, labels, inputs["attention_mask"]) if spec.kind == "qa"
                    else _loss(spec, logits, labels))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_([*backbone.parameters(), *head.parameters()], clip)
            opt.step()
            sched.step()
            step += 1
            if step % LOG_EVERY == 0:  # .item() waits for the device: not every step
                value = loss.item()
                bar.set_postfix(loss=value)
                if tracker is not None:
                    tracker.log({"train/loss": value, "train/lr": sched.get_last_lr()[0]}, step)
            bar.update(1)
            if step == total:
                break
    bar.close()
    return step


@torch.no_grad()
def predict(backbone: nn.Module, head: TaskHead, tokenizer: Any, spec: TaskSpec,
            feats: list[dict[str, Any]], examples: Sequence[Example], device: torch.device,
            batch_size: int = 64) -> list[Any]:
    """Predictions per example: class ids, floats, or one tag name per word (truncated words
    → "O").

    Batches are formed from length-sorted examples (less padding); results come back in input
    order.
    """
    if spec.kind == "qa":  # windows -> one decoded answer per example
        return qa.predict(backbone, head, tokenizer, feats, examples, device, batch_size,
                          unanswerable=spec.unanswerable)
    backbone.eval()
    head.eval()
    order = sorted(range(len(feats)), key=lambda k: len(feats[k]["inputs"]["input_ids"]))
    preds: list[Any] = [None] * len(feats)
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        inputs, _ = collate(tokenizer, spec, [feats[k] for k in idx], device)
        hidden = backbone(**inputs).last_hidden_state
        out = head(hidden, inputs.get("attention_mask")).float().cpu()  # (B, C) or (B, T, C)
        for row, k in zip(out, idx, strict=True):
            preds[k] = _decode(spec, row, feats[k], examples[k])
    return preds


def _decode(spec: TaskSpec, row: torch.Tensor, feat: dict[str, Any], ex: Example) -> Any:
    if spec.kind == "reg":
        return float(row[0])
    if spec.kind == "cls":
        return int(row.argmax())
    tags = ["O"] * len(ex.text)
    positions = [t for t, lab in enumerate(feat["label"]) if lab != -100]
    for t, w in zip(positions, feat["words"], strict=True):
        tags[w] = spec.labels[int(row[t].argmax())]
    return tags


def score(spec: TaskSpec, preds: list[Any], examples: Sequence[Example]) -> dict[str, float]:
    """The task metric(s) of predictions against the examples' gold labels."""
    if spec.kind == "qa":
        return spec.metric(preds, examples)
    if spec.kind == "token":
        gold = [[spec.labels[t] for t in ex.label] for ex in examples]
        return spec.metric(preds, gold)
    return spec.metric(preds, [ex.label for ex in examples])
