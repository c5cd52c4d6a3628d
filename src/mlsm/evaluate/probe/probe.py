"""`mlsm probe`: train the k -> |V| linear probe of an MLSM checkpoint, and score text with it.

By default the probe is trained until its loss on held-out chunks stops improving
(`mlsm.evaluate.probe.probe_fit`: the 10 % of the pre-training steps of the *Hitchhikers' Guide to
Masked
Latent Semantic Modeling* (anonymous, under review; §4.3.1) leaves it untrained on short runs). With
a fixed number of steps it reuses `pretrain` with the `probe` objective, so it gets the same
batches, readiness checkpoints, resume and DDP as any run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel

from mlsm.artifacts.checkpoint import Checkpoint, is_run_dir, resolve_checkpoint
from mlsm.artifacts.outputs import OutputKind, writing
from mlsm.artifacts.probe_record import has_probe_record
from mlsm.config import build_dataclass
from mlsm.data.corpus import TokenStore, tokenizer_hash
from mlsm.errors import UserError
from mlsm.evaluate.probe import probe_fit
from mlsm.evaluate.probe.probe_fit import probe_config
from mlsm.evaluate.probe.probe_fit_config import ProbeFitConfig, ProbeRecipe
from mlsm.evaluate.zeroshot.pll import load_masked_lm
from mlsm.hf import load_model, load_tokenizer, quiet
from mlsm.inputs import check_apart, field_problem
from mlsm.models.heads import read_latent_head
from mlsm.objectives.probe import probe_input
from mlsm.train.loop import pretrain_run
from mlsm.train.signals import exit_status

PROBE_KIND = OutputKind("mlsm probe run",
                        ours=lambda out: has_probe_record(out) or is_run_dir(out))


def run_probe(checkpoint: str | Path, *, resume: str | None = None,
              config: ProbeFitConfig | None = None, **kw: Any) -> Path:
    """`probe_run`'s probe run directory (a loop stopped by a signal returns it too)."""
    return probe_run(checkpoint, resume=resume, config=config, **kw)[0]


def probe_run(checkpoint: str | Path, *, resume: str | None = None,
              config: ProbeFitConfig | None = None, **kw: Any) -> tuple[Path, int | None]:
    """Train the probe (kw: store, out, overrides, the `ProbeRecipe` fields recipe and steps, and
    any `ProbeFitConfig` field such as max_steps, on top of `config`); returns the probe run
    directory and, when a signal stopped the training loop after a checkpoint, the exit status
    `mlsm probe` ends with (`mlsm.train.signals.exit_status`), else None.

    recipe "plateau" (ours, the default) with no steps, overrides, store or resume: train to a
    held-out loss plateau (`mlsm.evaluate.probe.probe_fit`), which writes OUT/probe.json. With
    `steps`
    (or overrides): that many steps through the pre-training loop. recipe "paper": the
    Hitchhikers' Guide's probe, 10,000 steps (`PAPER_PROBE_STEPS`, unless `steps` says otherwise)
    through the loop, readiness checkpoints at 10/25/50/100 %, no plateau stop.
    """
    chosen = {f.name: kw.pop(f.name) for f in dataclasses.fields(ProbeRecipe)
              if kw.get(f.name) is not None}
    kw["steps"] = build_dataclass(ProbeRecipe, chosen, "run_probe()").loop_steps()
    names = {f.name for f in dataclasses.fields(ProbeFitConfig)}
    settings = {k: kw.pop(k) for k in list(kw) if k in names and kw[k] is not None}
    fit = ProbeFitConfig.over(config, settings, "run_probe()")  # one line for a bad setting
    loop = bool(kw.get("steps") or kw.get("overrides") or kw.get("store") or resume)
    if loop and (settings or config is not None):  # the loop's settings are its run config's
        given = ", ".join("--" + k.replace("_", "-") for k in settings) or "config"
        raise UserError(f"{given}: settings of the plateau probe, which --steps, --recipe paper, "
                        "--store, --resume and overrides replace by the training loop; drop "
                        f"{given}, or set the loop's own keys as overrides (e.g. optim.lr=1e-3)")
    if settings.get("rank") and fit.head != "factored":  # else silently the latent k or d
        raise UserError(f"--rank {fit.rank}: the width of a factored head; a {fit.head} head has "
                        "no width to set; drop --rank, or pass --head factored")
    folder = resolve_checkpoint(checkpoint)
    if fit.head != "latent" and not kw.get("out"):  # beside the latent probe, not over it
        kw["out"] = f"{Checkpoint.at(folder).probe_run}-{fit.head}"
    cfg = probe_config(folder, **kw)  # one line for a folder that is not an MLSM checkpoint
    check_probe_store(folder, cfg.data.store, given=bool(kw.get("store")))
    out = Path(cfg.train.out)  # --out, else <run>/probe-step-N
    # named by the flags of `mlsm probe` (the probe run's own check names config keys)
    check_apart(out, "--out", {"CHECKPOINT": folder, "--store": cfg.data.store})
    if loop:
        run, signum = pretrain_run(cfg, resume=resume)
        return run, (None if signum is None else exit_status(signum, cfg.train.signal_exit_zero))
    with writing(out, PROBE_KIND):  # only an earlier probe is replaced; one writer
        probe_fit.train_probe_to_plateau(folder, out, **dataclasses.asdict(fit))
    return out, None


def check_probe_store(folder: Path, store: str, given: bool) -> None:
    """The probe's token store must exist and hold the tokens of the checkpoint's tokenizer (the
    probe learns to predict them). The one-line errors name --store, the flag of `mlsm probe`."""
    what = f"--store {store}" if given else f"the token store {store} that {folder} was trained on"
    fix = ("pass --store with a token store prepared with the checkpoint's tokenizer "
           f"(mlsm prepare SOURCES --tokenizer {folder} --out STORE)")
    if not store:
        raise UserError(f"{folder / 'checkpoint.json'} names no token store; {fix}")
    if not Path(store).is_dir():
        raise UserError(f"{what} is not a folder; {fix}")
    if TokenStore.open(store).tokenizer_hash != tokenizer_hash(load_tokenizer(folder)):
        raise UserError(f"{what} was prepared with another tokenizer than {folder}; {fix}")


class ProbeScorer(torch.nn.Module):
    """`MaskedScorer` of a frozen model with a probe: logits = probe(f(latent_head(h))),
    f = softmax (default), log_softmax or identity as heads.json says; a `vocab` readout control
    (heads.json: "features": "hidden") reads the hidden state: logits = probe(h)."""

    def __init__(self, folder: str | Path | Checkpoint):
        super().__init__()
        ck = folder if isinstance(folder, Checkpoint) else Checkpoint.at(folder)
        wrong = field_problem(ck.heads_meta or {}, {"probe": "object", "probe.in": "int",
                                                    "probe.out": "int", "probe.input": "text?"})
        if wrong or ck.heads_meta is None:
            raise UserError(f"heads file {ck.folder / 'heads.json'} is not one mlsm wrote "
                            f"({wrong or 'missing'}); {_FIX_HEADS}")
        probe, state = ck.heads_meta["probe"], ck.head_tensors
        with quiet():  # our own export: the encoder without a pooler, which we never use
            self.backbone = load_model(AutoModel, ck.folder)
        reads_hidden = probe.get("features") == "hidden"
        self.latent = None if reads_hidden else read_latent_head(ck)[0]
        self.input = probe.get("input", "probs")  # probes saved before the option read softmax(z)
        self.probe = torch.nn.Linear(probe["in"], probe["out"])
        self.probe.load_state_dict({k[len("probe."):]: v for k, v in state.items()
                                    if k.startswith("probe.")})
        self.eval()

    def logits_at(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  select: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids,
                               attention_mask=attention_mask).last_hidden_state  # (B, T, d)
        if self.latent is None:
            return self.probe(hidden[select])  # (N, V)
        return self.probe(probe_input(self.latent(hidden[select]), self.input))  # (N, V)


_FIX_HEADS = "restore it from a copy of the checkpoint, or use another checkpoint"


def _probe_of(ck: Checkpoint, path: str | Path) -> Checkpoint:
    """The final checkpoint of `ck`'s probe run, which scores through its own copy of the probed
    weights: refused in one line when `ck` no longer holds the weights the probe was fitted on
    (re-trained or replaced in place since: its score would be the old model's)."""
    probe = Checkpoint.open(ck.probe_run)
    recorded = (probe.info.get("inputs") or {}).get("objective.checkpoint")
    if isinstance(recorded, str) and recorded != ck.fingerprint:
        raise UserError(f"the probe in {ck.probe_run} was fitted on other weights than "
                        f"{ck.folder} holds now (the checkpoint was re-trained or replaced "
                        f"since); fit its probe again: mlsm probe {path}")
    return probe


def load_scorer(path: str | Path, device: str | torch.device | None = None) -> tuple[Any, Any]:
    """(scorer, tokenizer) for PLL: an MLSM checkpoint with a probe, or any HF masked-LM folder.

    An MTL checkpoint (latent head + a trained vocabulary head, the Hitchhikers' Guide's Fig. 6
    "MLSM+MLM") is scored through its vocabulary head, like an MLM model; it needs no probe.
    ``path`` may name a run (a run spec); an MLSM checkpoint without a probe is scored through the
    final checkpoint of its probe run (``<run>/probe-step-N``, where `mlsm probe` puts it). A
    checkpoint whose objective is not `scored_by_pll` (MAE-LM, MAE-MLSM) is refused in one line.
    Each file of the folder is read once.
    """
    ck = Checkpoint.open(path)
    ck.require_pll()
    heads = ck.heads_meta
    latent_only = heads is not None and "probe" not in heads and not ck.exports_vocab_head
    if latent_only and is_run_dir(ck.probe_run):
        ck = _probe_of(ck, path)
        heads = ck.heads_meta
    if heads is not None and "probe" in heads:
        scorer = ProbeScorer(ck)
        return (scorer.to(device) if device else scorer), load_tokenizer(ck.folder)
    if heads is not None and ck.latent_head in heads and not ck.exports_vocab_head:
        raise UserError(f"{ck.folder} is an MLSM model without a vocabulary and "
                        f"{ck.probe_run} has no probe; "
                        f"train its probe first: mlsm probe {path}")
    return load_masked_lm(str(ck.folder), device)
