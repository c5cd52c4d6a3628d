"""`mlsm export`: the folder loads with from_pretrained (no missing keys, same outputs), ships the
heads and the probe, and carries a model card whose YAML header the Hub can parse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForMaskedLM

from mlsm.cli import main
from mlsm.errors import UserError
from mlsm.evaluate.probe.probe import ProbeScorer, run_probe
from mlsm.integrations.export import export_checkpoint, push_to_hub
from mlsm.integrations.model_card import model_card
from mlsm.run_config import load_config
from mlsm.teacher.dictionary import load_dictionary
from mlsm.teacher.targets import dictionary_hash
from mlsm.train.loop import pretrain

from .helpers import tiny_overrides

IDS = torch.tensor([[2, 10, 11, 12, 13, 3], [2, 20, 21, 3, 0, 0]])
MASK = (IDS != 0).long()


def _load(cls: type, folder: Path) -> tuple[torch.nn.Module, dict]:
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    return model.eval(), info


def _card(folder: Path) -> tuple[dict, str]:
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def _results(path: Path, ckpt: Path) -> None:
    info = json.loads((ckpt / "checkpoint.json").read_text())
    rows = [
        {
            "model": name,
            "path": str(ckpt),
            "step": step,
            "readiness": 1.0,
            "objective": "mlm",
            "run": info["run"],
            "task": "cola",
            "metric": "mcc",
            "value": v,
            "seed": s,
            "lr": 2e-5,
            "epochs": 1,
            "batch_size": 8,
            "max_len": 32,
            "n_train": 10,
        }
        for name, step, v in (("ours", info["step"], 0.3), ("other", 99, 0.2))
        for s in (0, 1)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_mlm_export_loads_with_same_logits_and_a_parsable_card(store_dir, tmp_path, capsys) -> None:
    run = pretrain(
        load_config(
            None,
            tiny_overrides(
                store_dir, tmp_path / "run", **{"train.steps": 3, "train.readiness": "[1.0]"}
            ),
        )
    )
    ckpt = run / "checkpoints" / "step-0000003"
    _results(tmp_path / "results.jsonl", ckpt)
    out = tmp_path / "export"
    assert (
        main(
            [
                "export",
                str(ckpt),
                "--out",
                str(out),
                "--results",
                str(tmp_path / "results.jsonl"),
                "--license",
                "mit",
            ]
        )
        == 0
    )
    assert not (out / "training_state.pt").exists() and (out / "config.yaml").is_file()
    mlm, info = _load(AutoModelForMaskedLM, out)  # the pipeline's class: nothing to report
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    reference, _ = _load(AutoModelForMaskedLM, ckpt)
    with torch.no_grad():
        assert torch.equal(
            mlm(input_ids=IDS, attention_mask=MASK).logits,
            reference(input_ids=IDS, attention_mask=MASK).logits,
        )
    encoder, info = _load(AutoModel, out)  # BertModel: only its (never trained) pooler is new
    assert {k.split(".")[0] for k in info["missing_keys"]} <= {"pooler"}
    with torch.no_grad():
        assert torch.equal(
            encoder(input_ids=IDS, attention_mask=MASK).last_hidden_state,
            reference.base_model(input_ids=IDS, attention_mask=MASK).last_hidden_state,
        )
    header, body = _card(out)
    assert header["library_name"] == "transformers" and header["license"] == "mit"
    assert header["pipeline_tag"] == "fill-mask" and "mlsm" in header["tags"]
    store_fp = json.loads((store_dir / "meta.json").read_text())["fingerprint"]
    assert store_fp in body
    table = body.split("## Fine-tuning results")[1].split("##")[0]
    assert "**ours** (this model) | 30.00 ± 0.00" in table and "| other | 20.00 ± 0.00" in table
    # a second export replaces the first; a foreign folder is refused
    export_checkpoint(ckpt, out)
    shipped = load_file(out / "model.safetensors")
    assert shipped.keys() == load_file(ckpt / "model.safetensors").keys()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not an mlsm export"):
        export_checkpoint(ckpt, tmp_path / "foreign")
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


def test_push_offline_is_one_line_and_keeps_the_export(
    store_dir, tmp_path, monkeypatch, capsys
) -> None:
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    run = pretrain(
        load_config(
            None,
            tiny_overrides(
                store_dir, tmp_path / "run", **{"train.steps": 1, "train.readiness": "[1.0]"}
            ),
        )
    )
    out = tmp_path / "export"
    assert (
        main(
            [
                "export",
                str(run / "checkpoints" / "step-0000001"),
                "--out",
                str(out),
                "--push-to-hub",
                "someone/model",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("mlsm export: error: could not push")
        and "\n" not in err
        and "--push-to-hub" in err
    )
    assert (out / "README.md").is_file()
    with pytest.raises(UserError):
        push_to_hub(out, "someone/model")


def test_mlsm_export_ships_heads_probe_and_fingerprints(
    store_dir, teacher_dir, dictionary_path, tmp_path
) -> None:
    run = pretrain(load_config(None, tiny_overrides(store_dir, tmp_path / "run", **{
        "objective.name": "mlsm", "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "train.steps": 3, "train.readiness": "[1.0]"})))
    ckpt = run / "checkpoints" / "step-0000003"
    probe_run = run_probe(
        ckpt, steps=2, overrides=["optim.lr=0.1"]
    )  # default out: <run>/probe-step-0000003
    probe_ckpt = probe_run / "checkpoints" / "step-0000002"
    out = export_checkpoint(ckpt, tmp_path / "export")
    heads, probe_heads = (
        load_file(out / "heads.safetensors"),
        load_file(probe_ckpt / "heads.safetensors"),
    )
    assert heads.keys() == probe_heads.keys() and all(
        torch.equal(heads[k], probe_heads[k]) for k in heads
    )
    assert {"latent", "probe"} <= json.loads((out / "heads.json").read_text()).keys()
    encoder, info = _load(AutoModel, out)
    assert info["missing_keys"] == set()
    reference, _ = _load(AutoModel, ckpt)
    with torch.no_grad():
        assert torch.equal(encoder(input_ids=IDS, attention_mask=MASK).last_hidden_state,
                           reference(input_ids=IDS, attention_mask=MASK).last_hidden_state)
        select = MASK.bool()
        assert torch.equal(
            ProbeScorer(out).logits_at(IDS, MASK, select),
            ProbeScorer(probe_ckpt).logits_at(IDS, MASK, select),
        )
    header, body = _card(out)
    assert (
        header["pipeline_tag"] == "feature-extraction" and "base_model" not in header
    )  # a local teacher is no Hub id
    assert dictionary_hash(load_dictionary(dictionary_path)) in body and str(teacher_dir) in body
    # the card's warning is true: AutoModelForMaskedLM (what fill-mask loads) finds no MLM head
    assert 'no masked-LM head: `pipeline("fill-mask")` would run a randomly initialised' in body
    _, info = _load(AutoModelForMaskedLM, out)
    assert any(k.startswith("cls.predictions") for k in info["missing_keys"])
    provenance = json.loads((out / "mlsm.json").read_text())
    assert provenance["probe"] == str(probe_ckpt) and provenance["dictionary"]["k"] == 64
    # the card says what the records say: the title names the objective once, the teacher's
    # layer is the dictionary's (objective.layer -1), nothing reads "None", the run's
    # hyperparameters are listed, and a teacher is never the base model, Hub id or not
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert body.lstrip().startswith("# MLSM encoder\n") and "None" not in body
    assert f"{teacher_dir} (layer {provenance['dictionary']['layer']})" in body
    assert f"- `optim.lr`: {cfg['optim']['lr']}" in body and "- `train.steps`: 3" in body
    hub_teacher = {**provenance, "teacher": {"name": "sentence-transformers/all-MiniLM-L6-v2",
                                             "layer": 3}}
    assert "base_model" not in yaml.safe_load(model_card(hub_teacher, out).split("---\n")[1])
    started = {**hub_teacher, "base_model": "bert-base-cased"}
    assert yaml.safe_load(model_card(started, out).split("---\n")[1])["base_model"] \
        == "bert-base-cased"
    with pytest.raises(UserError, match="not a probe of"):
        export_checkpoint(ckpt, tmp_path / "x", probe=ckpt)


def test_card_names_the_revision_that_trained_up_to_the_checkpoint(store_dir, tmp_path) -> None:
    """A run started by older code and resumed by this one: the step-2 checkpoint was trained by
    the start's revision, the final one by the resumed segment's (run.json `resumed`)."""
    from mlsm.provenance import git_revision

    cfg = load_config(None, tiny_overrides(store_dir, tmp_path / "run",
                                           **{"train.steps": 4, "train.readiness": "[0.5, 1.0]"}))
    run = pretrain(cfg)
    shutil.rmtree(run / "checkpoints" / "step-0000004")
    marker = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**marker, "git_revision": "started-elsewhere"}))
    pretrain(cfg, resume=str(run / "checkpoints" / "step-0000002"))
    for step, revision in ((2, "started-elsewhere"), (4, git_revision())):
        out = tmp_path / f"export-{step}"
        assert main(["export", str(run / "checkpoints" / f"step-{step:07d}"), "--out",
                     str(out)]) == 0
        assert json.loads((out / "mlsm.json").read_text())["git_revision"] == revision, step
