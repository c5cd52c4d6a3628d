"""Train an MLSM model's k -> |V| probe until its held-out loss stops improving.

The *Hitchhikers' Guide to Masked Latent Semantic Modeling* (anonymous, under review; §4.3.1) trains
the probe for ~10 % of the pre-training steps. On short CPU runs that leaves it untrained (10.30
nats ≈ ln |V| after a 500-step run), so here its length is set by the data: the probe starts *at*
the unigram distribution (weights 0, bias = log unigram frequencies), is trained with Adam at a
constant lr on the pre-training batches, and stops when the loss on held-out chunks (the batches
right after the pre-training run, which neither the student nor the probe ever saw) has not improved
by `min_delta` (relative) for `patience` evaluations. The result records held-out loss, top-1 and
the unigram loss on the same targets, so every score made through the probe can be read next to how
good the probe is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mlsm.artifacts.checkpoint import COMPLETE, Checkpoint, list_checkpoints, remove_checkpoint
from mlsm.artifacts.fingerprint import folder_fingerprint
from mlsm.artifacts.probe_record import drop_probe_record, write_probe_record
from mlsm.config import merge, parse_overrides
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.errors import UserError
from mlsm.evaluate.probe.probe_fit_config import ProbeFitConfig
from mlsm.evaluate.zeroshot.heldout import heldout_steps
from mlsm.evaluate.zeroshot.unigram import unigram_log_probs
from mlsm.inputs import field_problem
from mlsm.models.backbone import build_student
from mlsm.models.heads import check_scored_by_pll
from mlsm.objectives.base import Context, TrainModule
from mlsm.objectives.probe import Probe, ProbeConfig, probe_input
from mlsm.progress import Progress
from mlsm.run_config import config_from_dict
from mlsm.train import checkpoint as ckpt


def probe_config(checkpoint: str | Path, *, store: str = "", steps: int = 0, out: str = "",
                 overrides: list[str] | None = None) -> Any:
    """The RunConfig of a probe run on `checkpoint` (an MLSM checkpoint folder, or a run directory /
    ``RUN@50%`` / ``RUN@step-N``: `mlsm.artifacts.checkpoint`)."""
    ck = Checkpoint.open(checkpoint)
    folder = ck.folder
    if not ck.is_checkpoint:
        raise UserError(f"{folder} is not an mlsm checkpoint (no checkpoint.json); "
                        "pass a checkpoints/step-* folder of an mlsm run")
    check_scored_by_pll(ck)  # MAE: its latent head reads the decoder, not these states
    wrong = field_problem(ck.info, {"config.model": "object", "config.data": "object",
                                    "config.train.steps": "number"})
    if wrong:
        raise UserError(f"checkpoint file {folder / COMPLETE} is not one mlsm wrote ({wrong}); "
                        "pass another checkpoints/step-* folder")
    raw = dict(ck.config)
    default_steps = max(1, round(0.1 * float(raw["train"]["steps"])))
    raw["objective"] = {"name": "probe", "checkpoint": str(folder)}
    raw["model"] = {**raw["model"], "init_from": str(folder)}
    raw["train"] = {**raw["train"], "steps": steps or default_steps,
                    "out": out or str(ck.probe_run), "save_every": 0,
                    "readiness": [0.1, 0.25, 0.5, 1.0]}
    if store:
        raw["data"] = {**raw["data"], "store": store}
    return config_from_dict(merge(raw, parse_overrides(overrides or [])))


class _Features:
    """Frozen student (+ its frozen latent head for a `latent` probe): batch -> (features, labels):
    latent logits z (N, k), or the hidden states (N, d) that a fresh head reads."""

    def __init__(self, module: TrainModule):
        objective = module.objective
        self.student = module.student
        self.latent = objective.heads["latent"] if objective.head == "latent" else None

    @torch.no_grad()
    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.student.eval()
        hidden = self.student(batch.corrupted_ids, batch.attention_mask)[batch.selected]  # (N, d)
        labels = batch.input_ids[batch.selected]
        if self.latent is None:
            return hidden.float(), labels
        self.latent.eval()
        return self.latent(hidden).float(), labels


class _Candidate:
    """One probe trained on one input kind, with its own plateau bookkeeping.

    It trains on standardised inputs (x - mu) / sigma, with mu, sigma from the first batch, and an
    Adam lr divided by the mean L1 norm of those inputs, so that `lr` bounds how far one step moves
    a logit whatever the input's scale (softmax probabilities sum to 1; log-probabilities are
    ~ -8 each over k = 1536 atoms). The normalisation is folded into the weights when exported.
    """

    def __init__(self, kind: str, like: torch.nn.Linear, unigram: torch.Tensor, lr: float,
                 z0: torch.Tensor):
        self.kind = kind
        x0 = probe_input(z0, kind)
        self.mu, self.sigma = x0.mean(0), x0.std(0).clamp(min=1e-6)  # (k,)
        self.probe = torch.nn.Linear(like.in_features, like.out_features)
        with torch.no_grad():  # start at the unigram distribution: anything learned must beat it
            self.probe.weight.zero_()
            self.probe.bias.copy_(unigram)
        scale = float(((x0 - self.mu) / self.sigma).abs().sum(-1).mean())
        # fused: one pass over the k x |V| weights per step instead of ~10 (torch's default on
        # CPU), the same Adam; with k = 512 that pass was a third of the fit's time
        self.opt = torch.optim.Adam(self.probe.parameters(), lr=lr / max(scale, 1.0), fused=True)
        self.best, self.best_top1, self.stale, self.steps, self.curve = math.inf, 0.0, 0, 0, []
        self.trained: torch.nn.Module = self.probe  # what learns (its state is the best kept)

    def logits(self, z: torch.Tensor, train: bool = False) -> torch.Tensor:
        return self.probe((probe_input(z, self.kind) - self.mu) / self.sigma)

    def exported(self) -> dict[str, dict[str, torch.Tensor]]:
        """head name -> weights of the equivalent head on raw inputs: W' = W / sigma,
        b' = b - W' mu."""
        return {"probe": _fold(self.probe, self.mu, self.sigma)}

    def step(self, z: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(self.logits(z, train=True), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return loss.item()

    def evaluate(self, held: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """Mean cross-entropy (nats) and top-1 accuracy on the held-out targets."""
        loss, correct, n = 0.0, 0, 0
        with torch.no_grad():
            for z, y in held:
                logits = self.logits(z)
                loss += F.cross_entropy(logits, y, reduction="sum").item()
                correct += int((logits.argmax(-1) == y).sum())
                n += y.numel()
        return loss / n, correct / n

    def check(self, step: int, train_loss: float, held: list, min_delta: float,
              patience: int) -> None:
        held_loss, top1 = self.evaluate(held)
        self.curve.append({"step": step, "train_loss": train_loss, "heldout_loss": held_loss,
                           "heldout_top1": top1})
        if not math.isfinite(held_loss):
            self.stale = patience  # diverged: stop this one
            return
        self.stale = 0 if held_loss < self.best * (1 - min_delta) else self.stale + 1
        if held_loss < self.best:  # early stopping keeps the best weights, not the last ones
            self.best, self.best_top1, self.best_steps = held_loss, top1, self.steps
            self.best_state = {k: v.clone() for k, v in self.trained.state_dict().items()}

    def start_from(self, held_loss: float, top1: float) -> None:
        """Record the starting point (the unigram distribution) as the best so far."""
        self.best, self.best_top1, self.best_steps = held_loss, top1, 0
        self.best_state = {k: v.clone() for k, v in self.trained.state_dict().items()}

    def restore_best(self) -> None:
        """Back to the weights of the lowest held-out loss seen (the start included), whose
        held-out loss and top-1 are `best` and `best_top1`: measured then, not again."""
        self.trained.load_state_dict(self.best_state)
        self.steps = self.best_steps

    def done(self, patience: int) -> bool:
        return self.stale >= patience


def _fold(linear: torch.nn.Linear, mu: torch.Tensor,
          sigma: torch.Tensor) -> dict[str, torch.Tensor]:
    """Weights of `linear` applied to (x - mu) / sigma, as a linear map of x itself."""
    w = linear.weight.detach() / sigma
    return {"weight": w, "bias": linear.bias.detach() - w @ mu}


class _FactoredCandidate(_Candidate):
    """The rank-k readout control: a fresh d -> k -> |V| head on the frozen hidden states,
    LatentHead(d, k) -> input kind -> k -> |V|, both parts trained (MLSM's probe trains only the
    last). The hidden states are standardised as `_Candidate` standardises its inputs; the k-side
    input, which moves as the LatentHead learns, by a batch norm without affine parameters (its
    running statistics at evaluation). Both are folded into the exported weights, so the saved
    head is exactly MLSM's readout shape. Adam's lr per unit of input L1 norm, as `_Candidate`.
    """

    def __init__(self, kind: str, like: torch.nn.Linear, unigram: torch.Tensor, lr: float,
                 h0: torch.Tensor, pre: torch.nn.Module):
        self.mu_h, self.sigma_h = h0.mean(0), h0.std(0).clamp(min=1e-6)  # (d,)
        self.pre, self.norm = pre, torch.nn.BatchNorm1d(like.in_features, affine=False)
        with torch.no_grad():  # the k-side input at initialisation (N, k), for the probe's lr
            super().__init__(kind, like, unigram, lr, self.pre(self._standard(h0)))
        scale_h = float(self._standard(h0).abs().sum(-1).mean())
        self.opt.add_param_group({"params": list(self.pre.parameters()),
                                  "lr": lr / max(scale_h, 1.0)})
        self.trained = torch.nn.ModuleDict({"pre": self.pre, "norm": self.norm,
                                            "probe": self.probe})

    def _standard(self, h: torch.Tensor) -> torch.Tensor:
        return (h - self.mu_h) / self.sigma_h

    def logits(self, z: torch.Tensor, train: bool = False) -> torch.Tensor:
        self.norm.train(train)
        return self.probe(self.norm(probe_input(self.pre(self._standard(z)), self.kind)))

    def exported(self) -> dict[str, dict[str, torch.Tensor]]:
        pre = {k: v.detach().clone() for k, v in self.pre.state_dict().items()}
        pre.update({f"dense.{k}": v for k, v in
                    _fold(self.pre.dense, self.mu_h, self.sigma_h).items()})
        sd = (self.norm.running_var + self.norm.eps).sqrt()
        return {"latent": pre, "probe": _fold(self.probe, self.norm.running_mean, sd)}


def _candidates(head: str, inputs: list[str], module: TrainModule, unigram: torch.Tensor,
                lr: float, x0: torch.Tensor) -> list[_Candidate]:
    """One candidate per input kind (a `vocab` head has one: it reads the states as they are);
    every `factored` candidate starts from the same fresh LatentHead."""
    import copy

    probe = module.objective.heads["probe"]
    if head == "vocab":
        return [_Candidate("logits", probe, unigram, lr, x0)]
    if head == "factored":
        pre = module.objective.heads["latent"]
        return [_FactoredCandidate(kind, probe, unigram, lr, x0, copy.deepcopy(pre).train())
                for kind in inputs]
    return [_Candidate(kind, probe, unigram, lr, x0) for kind in inputs]


def _setup(checkpoint: Path, kind: str, batch_size: int | None, threads: int | None,
           head: str = "latent", rank: int = 0) -> tuple[Any, TrainModule, Any, BatchSource, Any]:
    cfg = probe_config(checkpoint, overrides=[f"objective.input={kind}", f"objective.head={head}",
                                              f"objective.rank={rank}"])
    if batch_size:
        cfg.train.batch_size = batch_size
    if threads:
        torch.set_num_threads(threads)
    store = TokenStore.open(cfg.data.store)
    tokenizer = store.load_tokenizer()
    student = build_student(cfg.model, tokenizer, cfg.data.max_len, cfg.train.seed)
    ctx = Context(tokenizer, torch.device("cpu"), 1, str(store.path), cfg.data.max_len, store=store)
    objective = Probe(ProbeConfig(checkpoint=str(checkpoint), input=kind, head=head, rank=rank),
                      ctx)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed + 1)
        objective.attach(student)
    source = BatchSource(store, cfg.data, tokenizer)
    return cfg, TrainModule(student, objective), tokenizer, source, store


def train_probe_to_plateau(checkpoint: str | Path, out: str | Path,
                           config: ProbeFitConfig | None = None, *, threads: int | None = None,
                           **settings: Any) -> dict[str, Any]:
    """Train the probe of an MLSM checkpoint to a held-out plateau; write OUT/probe.json and a
    checkpoint folder that `load_scorer` reads.

    `config` (default: `ProbeFitConfig()`) with `settings` (any of its fields as keywords, e.g.
    max_steps=300) on top. One probe per input kind in `inputs` is trained on the same batches for
    `select_steps`; the one with the lowest held-out loss then continues alone until its plateau
    (or max_steps).
    """
    fit = ProbeFitConfig.over(config, settings, "train_probe_to_plateau()")
    checkpoint, out = Path(checkpoint), Path(out)
    inputs, lr, min_delta = fit.inputs, fit.lr, fit.min_delta
    select_steps = min(fit.select_steps, fit.max_steps)  # a short budget still compares input kinds
    cfg, module, tokenizer, source, store = _setup(checkpoint, inputs[0], fit.batch_size, threads,
                                                   fit.head, fit.rank)
    probe = module.objective.heads["probe"]
    features, G = _Features(module), cfg.train.batch_size

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:  # (z (N, k), labels (N,))
        return features(source.micro_batches(step, G, G, 0, 1)[0])

    held = [batch(s) for s in heldout_steps(checkpoint, G, fit.heldout_batches)]
    unigram = unigram_log_probs(checkpoint, probe.out_features)  # the run's own tokens
    first = batch(0)  # the standardisation and step 1
    cands = _candidates(fit.head, inputs, module, unigram, lr, first[0])
    start = cands[0].evaluate(held)  # W = 0: the unigram distribution itself (loss, top-1)
    for c in cands:
        c.start_from(*start)
    kept = _train(cands, held, first, batch, max_steps=fit.max_steps, select_steps=select_steps,
                  eval_every=fit.eval_every, patience=fit.patience, min_delta=min_delta)
    # a tie (every candidate still at the unigram start) goes to the one selection kept, so the
    # input reported is the one that was trained on, not the first in `inputs`
    best = min(cands, key=lambda c: (c.best, c is not kept))
    if not math.isfinite(best.best):
        raise UserError(f"every probe of {checkpoint} diverged (non-finite held-out loss); lower "
                        f"probe.lr (now {lr:g})")
    drop_probe_record(out)  # an earlier fit's record, written again last (the manifest)
    saved = _save_probe(out, module, tokenizer, best)
    info = {"checkpoint": str(saved), "source": str(checkpoint), "head": fit.head,
            "width": int(probe.in_features), "input": best.kind, "lr": lr,
            "steps": best.steps, "batch_size": G, "heldout_loss": best.best,
            "heldout_top1": best.best_top1, "unigram_loss": start[0], "unigram_top1": start[1],
            "better_than_unigram": best.best < start[0] * (1 - min_delta),
            "n_heldout_targets": sum(int(y.numel()) for _, y in held),
            "candidates": {c.kind: {"steps": c.steps, "heldout_loss": c.best,
                                    "curve": c.curve} for c in cands}}
    write_probe_record(out, info)
    _drop_other_checkpoints(out, saved)
    return info


def _drop_other_checkpoints(out: Path, saved: Path) -> None:
    """A probe run trained again keeps only the checkpoint its new record names: an earlier fit's
    step-N (a later step than this fit's best) would otherwise be what `load_scorer(RUN)` and
    `mlsm export` resolve as the probe run's final checkpoint. Pruned after the record is written,
    so a crash midway never leaves a record without its checkpoint."""
    for _, folder in list_checkpoints(out):
        if folder.resolve() != saved.resolve():
            remove_checkpoint(folder)


def _train(cands: list[_Candidate], held: list, first: tuple[torch.Tensor, torch.Tensor],
           batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]], *, max_steps: int,
           select_steps: int, eval_every: int, patience: int, min_delta: float) -> _Candidate:
    """Train every candidate on the same batches for `select_steps`, then the best one alone until
    its plateau (or max_steps); every candidate ends at its best weights (`restore_best`).
    Returns the candidate selection kept (the first, when there was no selection)."""
    live = list(cands)
    kept = cands[0]
    bar = Progress(max_steps, "probe", "step")  # plateau stops may end it early
    for step in range(1, max_steps + 1):
        if step == select_steps + 1 and len(live) > 1:  # keep the best candidate only
            live = [min(live, key=lambda c: c.evaluate(held)[0])]
            kept = live[0]
        live = [c for c in live if not c.done(patience)]
        if not live:
            break
        # the student is frozen: each batch's features are computed once, for every candidate
        z, y = first if step == 1 else batch(step - 1)
        for c in live:
            train_loss = c.step(z, y)
            if step % eval_every == 0 or step == max_steps:
                c.check(step, train_loss, held, min_delta, patience)
        bar.update(1, loss=train_loss)
    bar.close()
    for c in cands:
        c.restore_best()
    return kept


def _save_probe(out: Path, module: TrainModule, tokenizer: Any, best: _Candidate) -> Path:
    """The probe checkpoint (OUT/checkpoints/step-N) of the best candidate, on raw inputs."""
    for name, weights in best.exported().items():
        module.objective.heads[name].load_state_dict(weights)
    module.objective.input = best.kind
    objective = {"name": "probe", "input": best.kind, "head": module.objective.head,
                 "rank": module.objective.rank, "checkpoint": str(module.objective.folder)}
    return ckpt.save_checkpoint(out / "checkpoints" / f"step-{best.steps:07d}", module, tokenizer,
                                {"step": best.steps},
                                {"step": best.steps, "readiness": 1.0, "objective": "probe",
                                 "run": str(out),
                                 # what it probed, by content (`pretrain`'s probes record it
                                 # too): a scorer refuses it once that checkpoint is replaced
                                 "inputs": {"objective.checkpoint": folder_fingerprint(
                                     module.objective.folder)},
                                 "config": {"train": {"steps": best.steps, "readiness": [1.0]},
                                            # the probed checkpoint: what decides its scoring
                                            "objective": objective}})
