"""The MLSM dictionary as an artifact and a verb: D ∈ R^{d×k} whose sparse codes are the
student's targets (Berend 2023). `learn_dictionary` (what `mlsm dictionary` and a study run)
collects ℓ2-normalised layer-l teacher states of a token-store sample and learns D with
`mlsm.teacher.online_dictionary.learn_atoms`; `save_dictionary` / `load_dictionary` are the one
door of a dictionary file pair (DICT.safetensors + DICT.json), `Dictionary` what they hold.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mlsm import locking
from mlsm.artifacts.legacy import tolerated
from mlsm.artifacts.outputs import guard_output_file
from mlsm.defaults import LAM, TEACHER_LAYER, default_k
from mlsm.errors import UserError
from mlsm.fileio import atomic_write, atomic_write_text
from mlsm.hf import first_line
from mlsm.inputs import read_json
from mlsm.teacher.dictionary_config import DictionaryConfig
from mlsm.teacher.online_dictionary import dictionary_objective, learn_atoms
from mlsm.teacher.states import collect_vectors
from mlsm.teacher.teacher import INIT_SETTING, LAYER_SETTING, TEACHER_SETTING, Teacher

DICT_FORMAT = "mlsm-dictionary"


_WARNED_UNRECORDED: set[tuple[str, Any]] = set()  # (teacher, atoms digest) warned about once


@dataclass
class Dictionary:
    """Atoms (d, k) as columns plus the meta that says how they were made."""

    atoms: torch.Tensor  # (d, k)
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = field(default=None, compare=False, repr=False)
    """The .safetensors it was loaded from (None when built in memory): named by refusals."""

    @property
    def d(self) -> int:
        return int(self.atoms.shape[0])

    @property
    def k(self) -> int:
        return int(self.atoms.shape[1])

    @property
    def lam(self) -> float:
        """The sparsity penalty the atoms were learned with, which the codes must use too."""
        if self.meta.get("lam") is None:  # a dictionary from elsewhere, or meta edited by hand
            raise UserError("the dictionary's meta does not say the lambda it was learned with; "
                            'add "lam": VALUE to its .json meta, or set objective.lam in the run '
                            f"config (mlsm learns with {LAM} by default)")
        return float(self.meta["lam"])

    @property
    def layer(self) -> int:
        """The teacher layer the dictionary was learned on (`defaults.TEACHER_LAYER` if unsaid)."""
        return int(self.meta.get("layer", TEACHER_LAYER))

    def check_teacher(self, teacher: Teacher) -> None:
        """The dictionary must live in the teacher's hidden space (same d, same layer) and, where
        its meta records them, come from the same teacher: its init (pre-trained or random, and
        the random one's seed) and the fingerprint of its weights up to the layer."""
        if self.d != teacher.hidden_size:
            raise UserError(f"the dictionary has d={self.d} but the teacher's hidden size is "
                            f"{teacher.hidden_size}; learn a dictionary with this teacher (`mlsm "
                            "dictionary --teacher ...`)")
        layer = self.meta.get("layer")
        if layer is not None and int(layer) != teacher.layer:
            raise UserError(f"the dictionary was learned on layer {layer} but the teacher stops at "
                            f"layer {teacher.layer}; use layer {layer} ({LAYER_SETTING}) or learn "
                            "a new dictionary")
        self._check_init(teacher)
        weights = self.meta.get("teacher_weights")
        if weights is None:
            self._check_unrecorded(teacher)
        elif weights != teacher.weights_fingerprint():
            raise UserError(f"the dictionary was learned on another teacher of this shape (weights "
                            f"fingerprint {weights}, this teacher's {teacher.weights_fingerprint()}"
                            f"); use the teacher it names ({self.meta.get('teacher')!r}, "
                            f"{TEACHER_SETTING}) or learn a dictionary with this one")

    def _check_unrecorded(self, teacher: Teacher) -> None:
        """A dictionary whose meta records no fingerprint of its teacher's weights. One that names
        its teacher is one mlsm wrote before it recorded the fingerprint (0.1.0 did not): used,
        with one warning per process, since nothing shows it is another teacher's. One that names
        no teacher at all (a .json written by hand, atoms from elsewhere) cannot be checked
        against any: refused."""
        rebuild = (f"`mlsm dictionary --store STORE --teacher {shlex.quote(teacher.name)} --out "
                   "NEW_DICT`")
        named = self.meta.get("teacher")
        if named is None or not tolerated("dictionary-teacher-unrecorded"):
            which = f"dictionary {self.path}" if self.path else "the dictionary"
            what = "no teacher and no" if named is None else f"its teacher ({named}) but no"
            raise UserError(f"{which} names {what} fingerprint of its teacher's "
                            "weights in its meta, so nothing shows it was learned on this teacher "
                            f"({teacher.name}); learn one on it with {rebuild} (the token store "
                            "prepared with its tokenizer)")
        key = (str(self.meta["teacher"]), self.meta.get("atoms_sha256"))
        if key not in _WARNED_UNRECORDED:
            _WARNED_UNRECORDED.add(key)
            print(f"mlsm: warning: the dictionary of teacher {self.meta['teacher']} records no "
                  "fingerprint of its weights (mlsm 0.1.0 wrote none), so another teacher of "
                  "this name and shape would pass; learn it again to record one: "
                  f"{rebuild[1:-1]}", file=sys.stderr, flush=True)

    def _check_init(self, teacher: Teacher) -> None:
        """A dictionary of the pre-trained teacher used with the random one, or the reverse, or
        of a random teacher of another seed: refused, naming the switch to set."""
        init = self.meta.get("teacher_init", "pretrained")  # older metas: the teacher's own
        if init != teacher.init:
            raise UserError(f"the dictionary was learned on the {init} teacher but this teacher "
                            f"is {teacher.init}; set teacher_init={init} ({INIT_SETTING}) or "
                            f"learn a dictionary with teacher_init={teacher.init}")
        seed = self.meta.get("teacher_seed", 0)
        if init == "random" and seed != teacher.seed:
            raise UserError(f"the dictionary was learned on the random teacher of seed {seed} but "
                            f"this one has seed {teacher.seed}; set teacher_seed={seed} "
                            f"({INIT_SETTING}) or learn a dictionary with this seed")


def _check_sizes(c: DictionaryConfig) -> None:
    """Refuse more atoms than vectors (it would learn nonsense) before the slow collection of
    teacher states starts; each setting's own range is checked beside its field."""
    if c.k is not None and c.n_vectors < c.k:
        raise UserError(f"--n-vectors {c.n_vectors} is fewer than the {c.k} atoms to learn (--k); "
                        "collect at least k vectors (a dictionary is usually learned on >= 100 x "
                        "k), or lower --k")


FLOAT32_BYTES = 4  # the states are collected as float32 (`states.collect_vectors`)


def check_vector_memory(n_vectors: int, d: int) -> None:
    """Refuse, before collecting, more teacher states than this machine's memory holds: the
    n x d float32 matrix is held whole (and copied once while it is gathered), so
    `--n-vectors 2000000000` collected for minutes before failing."""
    need = 2 * n_vectors * d * FLOAT32_BYTES
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this system: nothing to compare
        return
    if need > have:
        most = max(1, have // (2 * d * FLOAT32_BYTES))
        raise UserError(f"--n-vectors {n_vectors:,} needs about {need / 2**30:,.1f} GiB for the "
                        f"teacher states ({d} floats each, gathered then joined), more than this "
                        f"machine's {have / 2**30:,.1f} GiB; use --n-vectors {most:,} or fewer")


def learn_dictionary(store: Any, teacher: Teacher, config: DictionaryConfig | None = None, *,
                     out: str | Path | None = None, **settings: Any) -> Dictionary:
    """Collect `n_vectors` teacher states from a token store and learn a dictionary on them.

    The settings are `config`'s (a `DictionaryConfig`, default: its defaults) with the keyword
    `settings` on top (k, lam, n_vectors, max_len, batch_size, n_iter, forget, eval_vectors,
    seed, sampling, atoms, teacher_init, teacher_seed: each documented beside its field there).
    k defaults to 4 × the teacher's hidden size; the final objective is the mean over up to
    eval_vectors of the collected vectors. atoms="random" (or "random_nonneg") collects no states:
    the atoms are `random_atoms(d, k, seed)`, the meta that of the teacher and settings as for a
    learned one. When `out` is given the result is saved there.
    """
    c = DictionaryConfig.over(config, settings, "learn_dictionary()")
    if isinstance(store, str | Path):  # a path is opened (and checked) here
        from mlsm.data.corpus import TokenStore

        store = TokenStore.open(store)
    if not isinstance(teacher, Teacher):
        raise UserError(f"learn_dictionary() takes a Teacher, got a {type(teacher).__name__}; "
                        "load one with mlsm.load_teacher(PATH, layer)")
    _check_teacher_init(teacher, c)
    c = dataclasses.replace(c, k=default_k(teacher.hidden_size) if c.k is None else c.k)
    make = _learn if c.atoms == "learned" else _random
    if c.atoms == "learned":
        _check_sizes(c)
        check_vector_memory(c.n_vectors, teacher.hidden_size)
    if out is None:
        return make(store, teacher, c, None)
    check_dictionary_out(out)
    # one writer: two at once left the atoms of one beside the meta of the other
    with locking.hold(_paths(out)[0], "dictionary"):
        return make(store, teacher, c, out)


def _check_teacher_init(teacher: Teacher, c: DictionaryConfig) -> None:
    """The teacher given must be the one the settings name (teacher_init, teacher_seed)."""
    if teacher.init != c.teacher_init or (c.teacher_init == "random"
                                          and teacher.seed != c.teacher_seed):
        given = teacher.init + (f" (seed {teacher.seed})" if teacher.init == "random" else "")
        raise UserError(f"learn_dictionary(): teacher_init={c.teacher_init} teacher_seed="
                        f"{c.teacher_seed} but the teacher given is {given}; load it with "
                        f"load_teacher(PATH, layer, init={c.teacher_init!r}, seed="
                        f"{c.teacher_seed}) or set teacher_init / teacher_seed to match it")


def _learn(store: Any, teacher: Teacher, c: DictionaryConfig,
           out: str | Path | None) -> Dictionary:
    X = collect_vectors(teacher, store, c.n_vectors, max_len=c.max_len, seed=c.seed,
                        sampling=c.sampling).to(teacher.device)
    _check_distinct(X, c.k)
    start = time.perf_counter()
    D = learn_atoms(X, c.k, c.lam, n_iter=c.n_iter, batch_size=c.batch_size, forget=c.forget,
                    seed=c.seed)
    seconds = time.perf_counter() - start
    eval_gen = torch.Generator().manual_seed(c.seed + 1)
    sample = X[torch.randperm(X.shape[0], generator=eval_gen)[:c.eval_vectors]]
    meta = _meta(teacher, store, k=c.k, lam=c.lam, n=X.shape[0], max_len=c.max_len,
                 batch_size=c.batch_size, n_iter=c.n_iter or math.ceil(X.shape[0] / c.batch_size),
                 seed=c.seed, seconds=seconds, objective=dictionary_objective(sample, D, c.lam),
                 n_eval=sample.shape[0], sampling=c.sampling, atoms="learned")
    return _result(Dictionary(D.cpu(), meta), out)


def _check_distinct(X: torch.Tensor, k: int) -> None:
    """Refuse k atoms learned on fewer distinct states than k (a store of 5 tokens gives the same
    few states again and again: the atoms past them are resampled duplicates, not a dictionary).
    Rows are told apart by a random projection (identical rows always collide, others almost
    never), which costs one matrix-vector product, not a sort of the whole matrix."""
    direction = torch.randn(X.shape[1], dtype=torch.float64,
                            generator=torch.Generator().manual_seed(0)).to(X.device)
    distinct = int(torch.unique(X.double() @ direction).numel())
    if distinct < k:
        raise UserError(f"the teacher states collected hold only {distinct:,} distinct vectors, "
                        f"fewer than the {k:,} atoms to learn (--k): the store is too small; "
                        "prepare a larger store or lower --k")


def _random(store: Any, teacher: Teacher, c: DictionaryConfig,
            out: str | Path | None) -> Dictionary:
    """The random-atoms control: no states collected; the meta says random, and the teacher,
    layer, d, λ, k and seed, so that nothing else in mlsm takes it for a learned one."""
    D = random_atoms(teacher.hidden_size, c.k, c.seed, nonneg=c.atoms == "random_nonneg")
    meta = _meta(teacher, store, k=c.k, lam=c.lam, seed=c.seed, atoms=c.atoms)
    return _result(Dictionary(D, meta), out)


def _result(dictionary: Dictionary, out: str | Path | None) -> Dictionary:
    if out is not None:
        save_dictionary(dictionary, out)
    return dictionary


def random_atoms(d: int, k: int, seed: int, nonneg: bool = False) -> torch.Tensor:
    """k random unit-norm atoms (d, k), float32: Gaussian directions (uniform on the sphere), or
    with `nonneg` their absolute values normalised again; the same seed gives the same atoms on
    every machine (a CPU generator of its own: the caller's RNG is untouched)."""
    gen = torch.Generator().manual_seed(seed)
    atoms = torch.randn(d, k, generator=gen, dtype=torch.float32)
    return torch.nn.functional.normalize(atoms.abs() if nonneg else atoms, dim=0)


def _meta(teacher: Teacher, store: Any, **values: Any) -> dict[str, Any]:
    from mlsm.data.corpus import tokenizer_hash  # corpus pulls in the tokenizers stack

    return {
        "format": DICT_FORMAT, "version": 1, **teacher.identity(),
        "teacher_tokenizer_hash": tokenizer_hash(teacher.tokenizer), "d": teacher.hidden_size,
        "store": str(getattr(store, "path", "")), **values,
    }


# --------------------------------------------------------------------------- files


def _paths(path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    return path, path.with_suffix(".json")


def learned_with(path: str | Path, inputs: dict[str, Any]) -> bool:
    """Whether the dictionary at `path` exists and its inputs record (PATH.inputs.json, written by
    `record_inputs` once the dictionary is complete) holds exactly `inputs`: what a caller that
    reuses dictionaries by their inputs (`mlsm pretrain --text`) compares. A missing, torn or
    foreign record is no match: the dictionary is learned again."""
    weights, _ = _paths(path)
    record = _inputs_record(weights)
    if not weights.is_file() or not record.is_file():
        return False
    try:
        return json.loads(record.read_text(encoding="utf-8")) == inputs
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False


def record_inputs(path: str | Path, inputs: dict[str, Any]) -> None:
    """Record beside the dictionary at `path` the inputs it was learned from (`learned_with`),
    after it is saved: `save_dictionary` removes an earlier record first, so a kill between the
    save and this leaves no record, never one of the dictionary that was replaced."""
    weights, _ = _paths(path)
    atomic_write_text(_inputs_record(weights), json.dumps(inputs, indent=2) + "\n")


def _inputs_record(weights: Path) -> Path:
    return weights.with_suffix(".inputs.json")


def check_dictionary_out(path: str | Path) -> None:
    """Refuse an --out whose PATH.safetensors / PATH.json exist but are not an mlsm dictionary
    (checked before minutes of learning; a dictionary of ours may be replaced)."""
    given = Path(path)
    if given.exists() and not given.is_file() and not given.is_dir():
        # /dev/null, a FIFO: the .safetensors/.json suffixes would add two files beside it
        guard_output_file(given, "mlsm dictionary", lambda _: False, example="dict.safetensors")
    weights, meta_path = _paths(path)
    guard_output_file(weights, "mlsm dictionary", _ours_weights, example="dict.safetensors")
    guard_output_file(meta_path, "mlsm dictionary's meta", _ours_meta, example="dict.safetensors")


def _ours_weights(weights: Path) -> bool:
    try:
        with safe_open(str(weights), "pt") as fh:
            return set(fh.keys()) == {"atoms"} and "meta" in (fh.metadata() or {})
    except Exception:  # safetensors raises its own error types for a non-safetensors file
        return False


def _ours_meta(meta_path: Path) -> bool:
    try:
        return json.loads(meta_path.read_text(encoding="utf-8")).get("format") == DICT_FORMAT
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, RecursionError):
        return False


def save_dictionary(dictionary: Dictionary, path: str | Path) -> Path:
    """Write atoms to PATH.safetensors and meta to PATH.json, each atomically; returns the
    former."""
    check_dictionary_out(path)  # before the lock: a device path cannot hold a lock file beside it
    weights, meta_path = _paths(path)
    atoms = dictionary.atoms.detach().cpu().float().contiguous()
    # the atoms' digest in both metas: a .json beside the weights of another write (a kill
    # between the two renames) never agrees with them, even when every setting is the same
    meta = {"format": DICT_FORMAT, **dictionary.meta, "d": dictionary.d, "k": dictionary.k,
            "atoms_sha256": hashlib.sha256(atoms.numpy().tobytes()).hexdigest()}
    text = json.dumps(meta, indent=2, sort_keys=True)
    try:
        with locking.hold(weights, "dictionary"):  # one writer for the pair (re-entrant)
            check_dictionary_out(path)
            _inputs_record(weights).unlink(missing_ok=True)  # it described the atoms replaced
            atomic_write(weights, lambda p: save_file({"atoms": atoms}, p, metadata={"meta": text}))
            atomic_write(meta_path, lambda p: Path(p).write_text(text + "\n"))
    except (OSError, SafetensorError) as exc:
        reason = (getattr(exc, "strerror", None) or str(exc)).splitlines()[0]
        raise UserError(f"could not write dictionary {weights} ({reason}); free "
                        "space and re-run") from None
    return weights


def load_dictionary(path: str | Path, device: str | torch.device = "cpu") -> Dictionary:
    """Read a dictionary written by `save_dictionary` (PATH or PATH.safetensors)."""
    weights, meta_path = _paths(path)
    if not weights.is_file():
        raise UserError(f"no dictionary at {weights}; learn one with `mlsm dictionary --store "
                        f"STORE --out {weights}`")
    # the command must work as written: --store is required, and a damaged file is not ours
    fix = (f"delete it and learn it again with `mlsm dictionary --store STORE --out {weights}` "
           "(the token store prepared with the teacher's tokenizer)")
    try:
        tensors = load_file(str(weights), device=str(device))
    except (SafetensorError, OSError, ValueError) as exc:  # binary, truncated, torn header
        raise UserError(f"dictionary {weights} is damaged or not a safetensors file "
                        f"({first_line(exc)}); {fix}") from None
    atoms = tensors.get("atoms")
    if atoms is None or atoms.dim() != 2 or not atoms.is_floating_point():
        raise UserError(f"{weights} is not an mlsm dictionary (no 2-D float tensor `atoms`; it "
                        f"holds {', '.join(sorted(tensors)) or 'nothing'}); {fix}")
    embedded = _embedded_meta(weights)
    meta = (read_json(meta_path, "dictionary meta", fix, fields=META_FIELDS)
            if meta_path.exists() else embedded)
    if meta.get("k") is not None and meta["k"] != atoms.shape[1]:
        raise UserError(f"dictionary {weights} holds {atoms.shape[1]} atoms but its meta "
                        f"{meta_path.name} says k = {meta['k']}: the two files are of different "
                        f"dictionaries; {fix}")
    # the weights carry the meta they were written with: a value of the .json that differs
    # from it, or an atoms digest the .json lacks (a .json of an older write), is another write;
    # another key removed by hand is not (its reader says what is missing), but the teacher's
    # identity is: a .json stripped of it would pass the teacher check of any teacher
    keys = (set(meta) & set(embedded)) | ({"atoms_sha256", *IDENTITY} & set(embedded))
    differ = sorted(key for key in keys if meta.get(key) != embedded.get(key))
    if differ:  # a write killed between the two files, or two writers: not one dictionary
        raise UserError(f"dictionary {weights} and its meta {meta_path.name} are of different "
                        f"dictionaries ({', '.join(differ[:3])} differ from the meta the weights "
                        f"carry; a write was interrupted, or another one wrote one of them); "
                        f"{fix}")
    if not bool(atoms.any()):  # every sparse code against it would be zero
        raise UserError(f"dictionary {weights} has only zero atoms; {fix}")
    return Dictionary(atoms, meta, weights)


IDENTITY = ("teacher", "layer", "teacher_init", "teacher_seed", "teacher_weights")
"""The meta keys that say which teacher a dictionary belongs to (`Teacher.identity`)."""


def dictionary_meta(path: str | Path) -> dict[str, Any]:
    """How the dictionary at PATH was made (k, layer, lam, teacher, ...) without loading its
    atoms: its DICT.json, else the meta in its safetensors header; {} when there is no dictionary
    there (e.g. a run that reads only a target store)."""
    weights, meta_path = _paths(path)
    if meta_path.exists():
        return read_json(meta_path, "dictionary meta", "restore it or drop objective.dictionary",
                         fields=META_FIELDS)
    return _embedded_meta(weights) if weights.is_file() else {}


def _embedded_meta(weights: Path) -> dict[str, Any]:
    """The meta `save_dictionary` puts in the safetensors header ({} for an older or foreign file
    whose header holds none, or none that parses as a JSON object)."""
    try:
        with safe_open(str(weights), "pt") as fh:
            text = (fh.metadata() or {}).get("meta")
        meta = json.loads(text) if text else {}
    except (SafetensorError, OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


# what readers use of a dictionary's meta (Dictionary.lam / .layer, the export card, `mlsm flops`)
# and what `check_teacher` compares with the teacher
META_FIELDS = {"lam": "number?", "layer": "int?", "k": "int?", "objective": "number?",
               "teacher": "text?", "atoms": "text?", "teacher_init": "text?",
               "teacher_seed": "int?", "teacher_weights": "text?"}
