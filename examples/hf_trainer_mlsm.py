"""Pre-train an encoder with MLSM from an ordinary Hugging Face `Trainer` script.

This is the shape of transformers' `run_mlm.py` (tokenise a text file, concatenate, cut into
blocks, train with `Trainer`); the lines marked `# MLSM` are all that changes (docs/huggingface.md).

    python examples/hf_trainer_mlsm.py --train-file corpus.txt --tokenizer TEACHER \
        --dictionary dict.safetensors --output-dir out/ --max-steps 1000

The tokenizer must be the teacher's (the codes are computed on the same tokens); the default
teacher is mlsm's packaged all-MiniLM-L6-v2. `out/` is then an mlsm checkpoint:
`mlsm probe out/ --store STORE`, `mlsm finetune mine=out/ --tasks sst2`, `mlsm export out/ ...`.
"""

from __future__ import annotations

import argparse
from itertools import chain

from datasets import load_dataset
from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer, TrainingArguments

from mlsm.integrations.transformers import MLSMTrainer  # MLSM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-file", required=True, help="plain text, one document per line")
    p.add_argument("--tokenizer", default=None, help="the teacher's tokenizer (default: MiniLM)")
    p.add_argument("--model", default=None, help="continue pre-training this masked LM folder")
    p.add_argument("--objective", default="mlsm", choices=["mlsm", "mtl", "kd", "mlm"])
    p.add_argument("--dictionary", default="", help="mlsm dictionary (mlsm, mtl)")
    p.add_argument("--teacher", default="", help="teacher folder (kd: a masked LM; "
                   "mlsm/mtl: empty = the packaged MiniLM)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tiny", action="store_true", help="a 2-layer 32-wide student (smoke test)")
    p.add_argument("--report-to", default="none", help="the Trainer's trackers (tensorboard, "
                   "wandb, ...): the loss and the objective's metrics (kl, nnz, ...)")
    a = p.parse_args()

    from mlsm.teacher.teacher import default_teacher_path

    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or default_teacher_path())
    raw = load_dataset("text", data_files={"train": a.train_file})["train"]
    tokenized = raw.map(lambda ex: tokenizer(ex["text"]), batched=True, remove_columns=["text"])

    def group_texts(examples: dict) -> dict:  # run_mlm.py's: concatenate, cut into blocks
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // a.max_len * a.max_len
        return {k: [v[i: i + a.max_len] for i in range(0, total, a.max_len)]
                for k, v in joined.items()}

    train = tokenized.map(group_texts, batched=True)

    if a.model:
        model = AutoModelForMaskedLM.from_pretrained(a.model)
    else:
        sizes = ({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "intermediate_size": 64} if a.tiny else {})
        config = AutoConfig.for_model("bert", vocab_size=len(tokenizer),
                                      max_position_embeddings=max(512, a.max_len), **sizes)
        model = AutoModelForMaskedLM.from_config(config)

    args = TrainingArguments(output_dir=a.output_dir, max_steps=a.max_steps,
                             per_device_train_batch_size=a.batch_size, learning_rate=a.lr,
                             weight_decay=0.01, warmup_steps=0.02, lr_scheduler_type="linear",
                             logging_steps=10, save_steps=max(1, a.max_steps // 4),
                             report_to=a.report_to)
    objective = {"name": a.objective}  # MLSM
    if a.objective in ("mlsm", "mtl"):  # MLSM
        objective.update(dictionary=a.dictionary, teacher=a.teacher)  # MLSM
    if a.objective == "kd":  # MLSM
        objective.update(teacher=a.teacher)  # MLSM
    # was: Trainer(..., data_collator=DataCollatorForLanguageModeling(tokenizer))
    trainer = MLSMTrainer(model=model, args=args, train_dataset=train,  # MLSM
                          processing_class=tokenizer, objective=objective)  # MLSM
    trainer.train()
    trainer.save_model()  # an mlsm checkpoint: HF folder + heads + checkpoint.json
    # run_mlm.py's last step; `trainer.push_to_hub()` would upload this folder with its card
    trainer.create_model_card()


if __name__ == "__main__":
    main()
