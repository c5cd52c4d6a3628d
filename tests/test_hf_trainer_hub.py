"""`MLSMTrainer` where HF users look: a run_mlm-style script (its own blocks, a model built from a
config, TensorBoard) ends with `create_model_card()` and the folder `push_to_hub` would upload;
TensorBoard holds the MLSM metrics; checkpoints record the block length trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("accelerate")  # transformers.Trainer needs it (the `hf` extra)
pytest.importorskip("tensorboard")

from datasets import Dataset  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from transformers import AutoConfig, AutoModelForMaskedLM, TrainingArguments  # noqa: E402

from mlsm.cli import main  # noqa: E402
from mlsm.data.corpus import TokenStore  # noqa: E402
from mlsm.integrations.transformers import MLSMTrainer  # noqa: E402

from .helpers import TINY_MODEL  # noqa: E402

BLOCK, STEPS, BATCH = 32, 2, 4
MLSM_METRICS = {"kl", "nnz", "target_entropy", "top1_agreement"}


def _blocks(store_dir: Path, n: int = 16) -> Dataset:
    """run_mlm.py's `group_texts` output: consecutive token blocks of BLOCK ids."""
    ids = TokenStore.open(store_dir).tokens[: n * BLOCK].astype("int64").tolist()
    rows = [ids[i: i + BLOCK] for i in range(0, n * BLOCK, BLOCK)]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * BLOCK] * n})


def _train(store_dir: Path, teacher_dir: Path, dictionary_path: Path, out: Path) -> MLSMTrainer:
    tok = TokenStore.open(store_dir).load_tokenizer()
    config = AutoConfig.for_model("bert", vocab_size=len(tok), **TINY_MODEL)
    model = AutoModelForMaskedLM.from_config(config)
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS,
                             per_device_train_batch_size=BATCH, learning_rate=1e-3,
                             logging_steps=1, report_to=["tensorboard"],
                             save_strategy="steps", save_steps=STEPS, use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = MLSMTrainer(model=model, args=args, train_dataset=_blocks(store_dir),
                          processing_class=tok,
                          objective={"name": "mlsm", "dictionary": str(dictionary_path),
                                     "teacher": str(teacher_dir)})
    trainer.train()
    return trainer


def _scalars(out: Path) -> dict[str, list[float]]:
    """Every scalar the Trainer's TensorBoard callback wrote under `out`, read back by
    TensorBoard's own reader."""
    found: dict[str, list[float]] = {}
    for events in out.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return found


def test_run_mlm_script_ends_with_a_model_card_and_tensorboard_holds_mlsm_metrics(
        store_dir, teacher_dir, dictionary_path, tmp_path) -> None:
    out = tmp_path / "out"
    trainer = _train(store_dir, teacher_dir, dictionary_path, out)
    # run_mlm.py's last lines; push_to_hub = save_model + create_model_card + upload of the folder
    trainer.save_model()
    trainer.create_model_card(model_name="tiny-mlsm")
    card = (out / "README.md").read_text()
    header = yaml.safe_load(card.split("---\n")[1])
    assert "generated_from_trainer" in header["tags"] and "tiny-mlsm" in card
    assert (out / "config.json").is_file() and (out / "checkpoint.json").is_file()
    assert trainer.state.total_flos > 0
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == STEPS and all(h.keys() >= MLSM_METRICS for h in logged)
    scalars = _scalars(out)
    for name in MLSM_METRICS:
        assert scalars.get(f"train/{name}") == pytest.approx([h[name] for h in logged]), name
    # `mlsm export` of the same folder: a card with no blanks ("None") and no base model (the
    # student started from a config; the teacher is no base model)
    assert main(["export", str(out), "--out", str(tmp_path / "hub")]) == 0
    text = (tmp_path / "hub" / "README.md").read_text()
    assert "None" not in text and "base_model" not in yaml.safe_load(text.split("---\n")[1])
    assert "- `trainer.lr_scheduler_type`: \"linear\"" in text


def test_trainer_checkpoint_records_the_block_length(store_dir, teacher_dir, dictionary_path,
                                                     tmp_path) -> None:
    """Blocks of 32 tokens: the checkpoint says max_len 32 and counts 32 tokens per row, and the
    sentence-transformers export sets max_seq_length 32."""
    out = tmp_path / "out"
    _train(store_dir, teacher_dir, dictionary_path, out)
    folder = out / f"checkpoint-{STEPS}"
    info = json.loads((folder / "checkpoint.json").read_text())
    assert info["config"]["data"]["max_len"] == BLOCK
    assert info["tokens"] == STEPS * BATCH * BLOCK
    export = tmp_path / "st"
    assert main(["export", str(folder), "--out", str(export),
                 "--format", "sentence-transformers"]) == 0
    st = json.loads((export / "sentence_bert_config.json").read_text())
    assert st["max_seq_length"] == BLOCK


def _cell_text(value: object) -> str:
    return str(getattr(value, "value", value))  # an Enum (SchedulerType) by its value


def test_docs_table_of_defaults_is_both_libraries_own(tmp_path) -> None:
    """docs/huggingface.md's table of the Trainer defaults that differ from mlsm's: every row
    names each side's real default (TrainingArguments' and OptimConfig's)."""
    from mlsm.config import OptimConfig

    doc = (Path(__file__).resolve().parents[1] / "docs" / "huggingface.md").read_text()
    section = doc.split("## Trainer defaults that differ from mlsm's")[1].split("\n## ")[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines()
            if line.startswith("| `") and "TrainingArguments" not in line]
    assert len(rows) >= 5
    hf, ours = TrainingArguments(output_dir=str(tmp_path)), OptimConfig()
    for row in rows:
        names, default, key, mine = (c.strip() for c in row[:4])
        fields = [n.strip(" `") for n in names.split(",")]
        assert default == ", ".join(_cell_text(getattr(hf, f)) for f in fields), names
        assert mine == _cell_text(getattr(ours, key.strip("`").split(".")[1])), key
    assert "adam_epsilon" in section and "warmup_steps" in section


def test_export_takes_a_folder_the_plain_trainer_saved(store_dir, tmp_path) -> None:
    """`mlsm export` of a checkpoint-N folder written by `transformers.Trainer` with its own MLM
    collator (no checkpoint.json): the export loads in AutoModelForMaskedLM with the folder's
    own logits, and the card states what the folder tells (its step) and nothing it does not."""
    import torch
    from transformers import DataCollatorForLanguageModeling, Trainer

    tok = TokenStore.open(store_dir).load_tokenizer()
    model = AutoModelForMaskedLM.from_config(
        AutoConfig.for_model("bert", vocab_size=len(tok), **TINY_MODEL))
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=1,
                             per_device_train_batch_size=BATCH, save_strategy="steps",
                             save_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=_blocks(store_dir), processing_class=tok,
            data_collator=DataCollatorForLanguageModeling(tok)).train()
    folder = tmp_path / "hf" / "checkpoint-1"
    assert not (folder / "checkpoint.json").exists()
    out = tmp_path / "hub"
    assert main(["export", str(folder), "--out", str(out)]) == 0
    ids = torch.tensor([tok("the cat sat on the mat.")["input_ids"]])
    mine, theirs = (AutoModelForMaskedLM.from_pretrained(f).eval() for f in (out, folder))
    with torch.no_grad():
        assert torch.equal(mine(input_ids=ids).logits, theirs(input_ids=ids).logits)
    text = (out / "README.md").read_text()
    assert "step 1" in text and "objective | unknown" in text and "None" not in text
    assert json.loads((out / "mlsm.json").read_text())["step"] == 1
    assert not (out / "config.yaml").exists()  # no mlsm run configuration to ship
