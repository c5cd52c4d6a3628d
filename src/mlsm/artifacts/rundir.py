"""A run directory (``train.out``): the one module that writes, reads and checks it.

  run.json          the marker (written first: a folder holding it is an mlsm run), the git
                    revision of each training segment, and the content fingerprints of the run's
                    inputs (token store, dictionary, target store)
  config.yaml       the resolved config
  metrics.jsonl     one JSON line per logged step (a crash may tear the last one)
  checkpoints/      step-NNNNNNN folders (`mlsm.artifacts.checkpoint`)

A run is continued only with --resume, only with a config that gives the same weights (the one
same-run check) and only on the inputs it was started with (their fingerprints, recorded here and in
each checkpoint, are compared: a store rebuilt in place by `prepare --overwrite` or a re-learned
dictionary is refused in one line). The trainer hands this module plain dicts, so it never imports
the config schema or the objectives.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from mlsm.artifacts import checkpoint as ckpt
from mlsm.artifacts.fingerprint import require_same
from mlsm.artifacts.jsonl import read_jsonl
from mlsm.artifacts.legacy import tolerated
from mlsm.artifacts.outputs import OutputKind, Rule, guard_output
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text
from mlsm.inputs import bounded_byte_lines, field_problem, parse_yaml, read_json
from mlsm.limits import MAX_ROW_BYTES

RUN_MARKER = "run.json"
_METRICS_ROW = {"step": "number", "loss": "number", "tokens": "number?", "tokens_per_s": "number?"}
"""What a reader of the metrics log uses of each row."""
_TAIL_BYTES = 1 << 16  # far more than a few metrics rows (each well under 1 KiB)
# What makes two configs the same run: everything that changes the weights. Device, threads,
# precision, micro-batching, logging and checkpoint cadence may change on resume.
SAME_RUN = {"data": None, "model": None, "objective": None, "optim": None,
            "train": ("steps", "batch_size", "seed")}
Picked = tuple[Path, dict[str, Any], dict[str, Any]]  # (folder, checkpoint.json, training state)


def _note(text: str) -> None:
    print(f"mlsm: {text}", file=sys.stderr, flush=True)


class RunDir:
    """The run directory at `path` (it may not exist yet)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metrics = self.path / "metrics.jsonl"

    # ------------------------------------------------------------------ before anything is written

    def marker(self) -> dict[str, Any] | None:
        """run.json, or None when missing, torn or not ours."""
        try:
            marker = json.loads((self.path / RUN_MARKER).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return marker if isinstance(marker, dict) and "started" in marker else None

    def segment_values(self, key: str) -> list[Any]:
        """`key` (e.g. "precision") as the run's start and each resumed segment recorded it, in
        order; None for a segment that recorded none (written before the key existed). [] without
        a readable run.json: a figure for reports, not a check."""
        marker = self.marker()
        return [] if marker is None else [seg.get(key) for seg in _segments(marker)]

    def revision_at(self, step: Any) -> str | None:
        """The mlsm revision that trained up to `step`: the run's start, or the last segment
        resumed before that step (run.json `resumed`); None without a run.json. A torn one is
        one line naming it (an export must not state a revision it could not read)."""
        path = self.path / RUN_MARKER
        if not path.is_file():
            return None
        marker = read_json(path, "run file", "restore it from a copy of the run (it records the "
                           "git revision of each training segment)",
                           fields={"git_revision": "text?", "resumed": "list?"})
        # a segment of the wrong shape is skipped: the revision is a figure, not a check
        segments = [marker, *[r for r in _segments(marker)[1:] if isinstance(step, int)
                              and isinstance(r.get("from_step"), int) and r["from_step"] < step]]
        revision = segments[-1].get("git_revision")
        return revision if isinstance(revision, str) else None

    def check_folder(self, resume: str | None) -> None:
        """Any content of train.out counts: only an mlsm run is continued, and only with
        --resume (the one output guard, `mlsm.artifacts.outputs`)."""
        guard_output(self.path, OutputKind("mlsm run", ours=lambda _: self.marker() is not None),
                     Rule.SAME_KIND if resume else Rule.NEW, flag="train.out",
                     fix_existing="pass --resume auto to continue it or choose another train.out")

    def pick(self, resume: str, announce: bool = True) -> Picked | None:
        """The checkpoint to resume from: the named folder, or for "auto" the newest intact one
        (damaged newer ones are skipped with one line on stderr); None for "auto" without any."""
        if resume != "auto":
            folder = Path(resume)
            if not (folder / ckpt.COMPLETE).is_file():
                raise UserError(f"{folder} is not a complete checkpoint; pass --resume auto or a "
                                "checkpoints/step-* folder")
            try:
                return (folder, *ckpt.verify(folder))
            except ckpt.DamagedCheckpoint as exc:
                raise UserError(f"checkpoint {folder} is damaged ({exc}); pass --resume auto to "
                                "use the newest intact one") from None
        damaged = []
        for _, folder in reversed(ckpt.list_checkpoints(self.path)):
            try:
                picked = (folder, *ckpt.verify(folder))
            except ckpt.DamagedCheckpoint as exc:
                damaged.append(f"{folder.name}: {exc}")
                continue
            if damaged and announce:
                _note(f"resuming from {folder.name}, the newest intact checkpoint; "
                      f"skipped damaged {'; '.join(damaged)}")
            return picked
        if damaged:
            raise UserError(f"no intact checkpoint in {self.path / 'checkpoints'} "
                            f"({'; '.join(damaged)}); choose another train.out or delete the "
                            "damaged folders")
        return None

    def check_same_run(self, now: dict[str, Any], picked: Picked | None,
                       resolve: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Refuse to continue a run (or a checkpoint) with a config that changes the weights.
        `now` is the resolved config as plain data; `resolve` fills an old saved config's
        defaults (one written before objectives were saved in full)."""
        refs = []
        config_yaml = self.path / "config.yaml"
        if config_yaml.is_file():
            # a damaged config.yaml is rewritten; the checkpoint's copy still decides
            with contextlib.suppress(OSError, UnicodeDecodeError, yaml.YAMLError):
                refs.append((config_yaml, parse_yaml(config_yaml.read_text(encoding="utf-8"))))
        if picked is not None:
            refs.append((picked[0] / ckpt.COMPLETE, picked[1]["config"]))
        for where, old in refs:
            diff = same_run_diff(now, resolve(old)) if isinstance(old, dict) else []
            if diff:
                raise UserError(f"this config differs from the run in {self.path} ({where.name}) "
                                f"in {', '.join(diff[:4])}; use the run's own config to resume "
                                "it, or choose another train.out for a new run")

    def check_inputs(self, current: dict[str, str], picked: Picked | None,
                     announce: bool = True) -> None:
        """Refuse to resume on inputs rebuilt in place: the content fingerprints recorded by the
        checkpoint (else by run.json) must equal `current`. A run that recorded none (written
        before they were) resumes as before, with one note."""
        recorded = picked[1].get("inputs") if picked is not None else None
        if not isinstance(recorded, dict):
            recorded = (self.marker() or {}).get("inputs")
        if not isinstance(recorded, dict):
            if picked is not None and not tolerated("run-inputs-unrecorded"):
                raise UserError(f"{self.path} records no fingerprints of its inputs (mlsm 0.1 "
                                "wrote none), and this version no longer resumes such a run; "
                                "start a new run with another train.out")
            if announce and picked is not None:
                _note(f"{self.path} records no fingerprints of its inputs (written by an older "
                      "mlsm), so they cannot be checked; resuming as before")
            return
        require_same(recorded, current, f"the run in {self.path}",
                     "an input was rebuilt in place since the run started; restore it, or start a "
                     "new run with another train.out")

    def check_metrics(self) -> None:
        """Refuse, before anything is written, a metrics.jsonl line a resume would silently drop
        that is not a line torn by a crash (`read_jsonl`'s rule): a row without an integer step,
        or other text."""
        fix = "fix or remove that line, then resume (the resume would drop it)"
        for number, row in read_jsonl(self.metrics, "metrics log", fix,
                                        torn_only_ok=True).rows:
            wrong = field_problem(row, {"step": "int"})
            if wrong:
                raise UserError(f"{self.metrics}:{number} is not a row mlsm logged ({wrong}); "
                                f"{fix}")

    def metric_rows(self, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
        """The logged rows of metrics.jsonl (none before the first), each checked to carry what
        readers plot: a numeric step and loss (tokens, tokens_per_s numeric where present). A
        line torn by a crash is skipped and named to `warn`; any other row is one line naming
        the file and line."""
        fix = "fix or remove that line"
        found = read_jsonl(self.metrics, "metrics log", fix, warn=warn, torn_only_ok=True)
        for number, row in found.rows:
            wrong = field_problem(row, _METRICS_ROW)
            if wrong:
                raise UserError(f"{self.metrics}:{number} is not a row mlsm logged ({wrong}); "
                                f"{fix}")
        return [row for _, row in found.rows]

    # ------------------------------------------------------------------ writing

    def start(self, config: dict[str, Any], step: int, segment: dict[str, Any],
              inputs: dict[str, str]) -> None:
        """Write run.json (a new run, or one more resumed segment), config.yaml, and metrics
        truncated to `step`; remove temporary folders a killed process left."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            segment = {**segment, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            marker = self.marker()
            if marker is None:  # the marker first: a folder with any of our files is a run
                marker = {"format": "mlsm-run", **segment, "inputs": inputs}
            else:  # a resume, maybe by other code or on another machine: its provenance too
                earlier = marker.get("resumed")
                marker["resumed"] = [*(earlier if isinstance(earlier, list) else []),
                                     {"from_step": step, **segment}]
                marker.setdefault("inputs", inputs)  # an older run: checked from now on
            atomic_write_text(self.path / RUN_MARKER, json.dumps(marker, indent=2))
            self.remove_stale()
            atomic_write_text(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))
            self._truncate_metrics(step)
        except OSError as exc:
            raise UserError(f"cannot write to run directory {self.path} "
                            f"({exc.strerror or exc}); check space and permissions, then "
                            "rerun") from None

    def remove_stale(self) -> None:
        """Remove temporary folders a killed process left in checkpoints/ (names start with
        '.')."""
        root = self.path / "checkpoints"
        for folder in root.glob(".*") if root.is_dir() else []:
            shutil.rmtree(folder, ignore_errors=True)

    def _truncate_metrics(self, step: int) -> None:
        """Keep one line per step up to the step we resume from (later lines will be logged
        again; a step logged twice by an earlier crash keeps its last line)."""
        if self.metrics.exists():
            kept = {}
            for _, raw in bounded_byte_lines(self.metrics, "a metrics.jsonl row", MAX_ROW_BYTES,
                                             "mlsm.limits.MAX_ROW_BYTES"):
                ln = raw.decode("utf-8", errors="replace")
                s = _logged_step(ln)
                if s <= step:
                    kept[s] = ln
            atomic_write_text(self.metrics, "".join(kept[s] + "\n" for s in sorted(kept)))

    def log(self, record: dict[str, Any]) -> None:
        """Append one metrics.jsonl line."""
        try:
            with open(self.metrics, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError as exc:
            raise UserError(f"cannot append to {self.metrics} ({exc.strerror or exc}); free "
                            "space and rerun with --resume auto") from None

    def last_logged(self) -> dict[str, Any] | None:
        """The newest whole metrics.jsonl row (a progress figure for a watcher of a run another
        process trains; a torn last line is skipped), or None before the first. Only the file's
        tail is read: a watcher asks every few seconds, and a long run's file keeps growing."""
        try:
            with open(self.metrics, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - _TAIL_BYTES))
                lines = fh.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                return row
        return None

    def checkpoint_folder(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step-{step:07d}"

    def prune(self, keep: set[int], keep_last: int) -> None:
        """Delete periodic checkpoints but the last `keep_last`; steps in `keep` (readiness, final)
        stay."""
        periodic = [(s, f) for s, f in ckpt.list_checkpoints(self.path) if s not in keep]
        for _, folder in periodic[: max(0, len(periodic) - keep_last)]:
            ckpt.remove_checkpoint(folder)


def _segments(marker: dict[str, Any]) -> list[dict[str, Any]]:
    """run.json's segments in order: the start (the marker itself), then each resumed one of the
    right shape."""
    resumed = marker.get("resumed")
    return [marker, *(r for r in (resumed if isinstance(resumed, list) else [])
                      if isinstance(r, dict))]


def same_run_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted keys of `SAME_RUN` on which configs a and b differ."""
    diff = []
    for group, keys in SAME_RUN.items():
        ga, gb = (g if isinstance(g, dict) else {} for g in (a.get(group), b.get(group)))
        for key in keys or sorted(set(ga) | set(gb)):
            if json.dumps(ga.get(key), sort_keys=True) != json.dumps(gb.get(key), sort_keys=True):
                diff.append(f"{group}.{key}")
    return diff


def _logged_step(line: str) -> float:
    """Step of a metrics line; a line torn by a crash counts as after every checkpoint."""
    try:
        step = json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf
    return step if isinstance(step, int) else math.inf
