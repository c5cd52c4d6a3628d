"""QA fine-tuning speed: mlsm's `train_cell` on SQuAD windows against the HF `Trainer` with
`BertForQuestionAnswering` doing the same steps on the same model and the same windows.

Both sides: one BERT built from a config with the same seed (no hub), the packaged MiniLM
tokenizer, the windows of `mlsm.evaluate.finetune.qa.encode_windows` (start/end labels included),
batch size, AdamW with weight decay 0.01, linear decay, gradient clipping 1.0, CPU. The rounds
alternate the sides; each prints seconds per step, and the last line the median ratio
(HF seconds / mlsm seconds: > 1 means mlsm is faster) and the machine.

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/bench_qa.py --steps 12 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CORPUS  # noqa: E402  (the shared data folder beside the repository)

SQUAD = CORPUS.parents[2] / "squad_v1.1/dev-v1.1.json.gz"


def windows(args: argparse.Namespace, tok) -> list[dict]:
    """Training windows of the protocol's training part, as many as the steps need."""
    from mlsm.evaluate.finetune.qa import encode_windows
    from mlsm.evaluate.finetune.qa_data import read_squad_json, split_by_article

    examples = split_by_article(read_squad_json(SQUAD), "train")[: args.steps * args.batch]
    return encode_windows(tok, examples, args.max_len)[: args.steps * args.batch]


def make_model(args: argparse.Namespace, vocab: int, folder: Path) -> None:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab, hidden_size=args.d, num_hidden_layers=args.layers,
                     num_attention_heads=args.d // 64, intermediate_size=4 * args.d)
    BertModel(cfg).save_pretrained(folder)


def time_mlsm(folder: Path, tok, feats: list[dict], args: argparse.Namespace) -> float:
    from mlsm.evaluate.finetune.cell import load_backbone as _load_backbone
    from mlsm.evaluate.finetune.task_cell import build_head, train_cell
    from mlsm.evaluate.finetune.tasks import get_task

    spec = get_task("squad")
    backbone = _load_backbone(str(folder))
    head = build_head(spec, args.d, 0)
    cfg = {"lr": 3e-5, "epochs": 1, "batch_size": args.batch, "warmup_ratio": 0.0,
           "weight_decay": 0.01, "clip": 1.0, "fixed_order": True}
    start = time.perf_counter()
    steps = train_cell(backbone, head, tok, spec, feats, 0, cfg, torch.device("cpu"))
    return (time.perf_counter() - start) / steps


def time_hf(folder: Path, tok, feats: list[dict], args: argparse.Namespace, out: Path) -> float:
    from datasets import Dataset
    from transformers import (
        BertForQuestionAnswering,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    from mlsm.hf import quiet

    rows = [{**f["inputs"], "start_positions": f["label"][0], "end_positions": f["label"][1]}
            for f in feats]
    with quiet():
        model = BertForQuestionAnswering.from_pretrained(folder)
    targs = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.batch, num_train_epochs=1,
        learning_rate=3e-5, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="linear",
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=targs, train_dataset=Dataset.from_list(rows),
                      data_collator=DataCollatorWithPadding(tok))
    start = time.perf_counter()
    result = trainer.train()
    return (time.perf_counter() - start) / result.global_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not SQUAD.is_file():
        print(f"skipped: {SQUAD} is absent")
        return
    from mlsm import hf
    from mlsm.provenance import machine_description
    from mlsm.teacher.teacher import default_teacher_path

    torch.set_num_threads(args.threads)
    tok = hf.load_tokenizer(str(default_teacher_path()))
    feats = windows(args, tok)
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bert"
        make_model(args, len(tok), folder)
        for r in range(args.rounds):
            ours = time_mlsm(folder, tok, feats, args)
            theirs = time_hf(folder, tok, feats, args, Path(tmp) / "trainer")
            ratios.append(theirs / ours)
            print(f"round {r}: mlsm {ours:.3f} s/step, HF Trainer {theirs:.3f} s/step, "
                  f"ratio {theirs / ours:.2f}x", flush=True)
    print(f"QA fine-tuning, BERT {args.layers}x{args.d}, batch {args.batch} x {args.max_len} "
          f"windows, {len(feats)} windows, {args.threads} threads: median speed ratio "
          f"(HF Trainer / mlsm) {statistics.median(ratios):.2f}x on {machine_description()}")


if __name__ == "__main__":
    main()
