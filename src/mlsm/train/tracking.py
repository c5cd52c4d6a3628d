"""Experiment trackers: TensorBoard, Weights & Biases, MLflow and Trackio, as HF Trainer users
expect from `report_to`.

`open_tracker(["tensorboard", "wandb"], folder, config, name)` starts one run per backend; every
`log(metrics, step)` goes to all of them; `close()` ends them. Each backend is the library itself,
installed with the `tracking` extra (`pip install -e ".[tracking]"`), and works offline:

- tensorboard: event files in FOLDER/tensorboard/NAME (`tensorboard --logdir FOLDER/tensorboard`);
- wandb: a run in FOLDER/wandb; offline unless WANDB_MODE says otherwise or an API key is set
  (`wandb sync FOLDER/wandb/offline-run-*` uploads it later); project $WANDB_PROJECT or "mlsm";
- mlflow: a file store in FOLDER/mlruns unless $MLFLOW_TRACKING_URI names a server
  (`mlflow ui --backend-store-uri FOLDER/mlruns`); experiment $MLFLOW_EXPERIMENT_NAME or "mlsm";
- trackio: Hugging Face's local tracker (a SQLite database under $TRACKIO_DIR, default
  ~/.cache/huggingface/trackio; `trackio show`); project $TRACKIO_PROJECT or "mlsm".

Every run records the resolved config and the git revision of mlsm. A tracker that fails while
logging is switched off with one line on stderr: the training itself never stops for it.

Resuming (`open_tracker(..., resume_step=N)`, N = the step of the checkpoint the run continues
from) continues the SAME tracker run, never a second one of the same name. The ids are kept in
FOLDER/tracking.json. TensorBoard purges the points after step N (`purge_step`), so the steps
replayed after the checkpoint are plotted once, with their new values. MLflow reopens the stored
run_id and trackio the run name; neither can erase a point, so the steps they already hold are not
sent again and keep their first values (equal to the new ones on an exact resume, except the
wall-clock rates tokens_per_s, flops_per_s, mfu). W&B resumes the stored run id
(`resume="allow"`); the replayed steps are sent again and W&B's server decides which values it
keeps (offline, both segments wait in FOLDER/wandb for `wandb sync`; not checked without a server).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlsm.errors import UserError
from mlsm.fileio import atomic_write_json
from mlsm.inputs import read_json

BACKENDS = ("tensorboard", "wandb", "mlflow", "trackio")
EXTRA = 'pip install -e ".[tracking]"'
# backend -> package that must be importable (torch.utils.tensorboard needs tensorboard)
_PACKAGES = {name: name for name in BACKENDS}
STATE = "tracking.json"
"""FOLDER/STATE: {run name: {backend: id}}, what a resumed run reopens."""


def check_names(names: list[str], where: str) -> None:
    """Unknown backend names are one line listing the valid ones."""
    for name in names:
        if name not in BACKENDS:
            raise UserError(f"{where} lists unknown tracker {name!r}; valid: {', '.join(BACKENDS)}")


def require(names: list[str], where: str) -> None:
    """Fail before any work when a requested tracker's library is not installed."""
    check_names(names, where)
    for name in names:
        package = _PACKAGES[name]
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # a parent package missing, or a stubbed module
            found = False
        if not found:
            raise UserError(f"{where} asks for {name}, but the {package} package is not installed; "
                            f"install the tracking extra: {EXTRA}")


@dataclass(frozen=True)
class _Resume:
    """How a backend starts: step = the checkpoint step a resumed run continues from (None for a
    fresh run); id = this backend's stored run id for it (None: start a new tracker run)."""

    step: int | None = None
    id: str | None = None


FIX_STATE = ("delete it to start new tracker runs (it holds nothing else: checkpoints and results "
             "are kept), or restore it from a copy to continue the same ones")


def read_state(folder: str | Path) -> dict[str, Any]:
    """FOLDER/STATE ({} when there is none). A torn or foreign file is one UserError naming it:
    opening fresh tracker runs instead would split a resumed run in two without a word."""
    path = Path(folder) / STATE
    if not path.exists():
        return {}
    state = read_json(path, "tracker state", FIX_STATE)
    bad = [k for k, v in state.items() if not isinstance(v, dict)]
    if bad:
        raise UserError(f"tracker state {path} maps run {bad[0]!r} to no tracker ids; {FIX_STATE}")
    return state


def _write_state(folder: Path, state: dict[str, Any], name: str, ids: dict[str, str]) -> None:
    """Record the run ids of `name` (kept beside those of other runs in `state`, the folder's)."""
    state = {**state, name: ids}
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / STATE, state)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"steps": 3}} -> {"train.steps": 3}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _config_yaml(config: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(config, default=str)), sort_keys=False)


class _TensorBoard:
    def __init__(self, folder: Path, name: str, config: dict[str, Any], revision: str,
                 resume: _Resume) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # one sub-folder per run: `tensorboard --logdir FOLDER/tensorboard` compares them
        log_dir = folder / "tensorboard" / name
        earlier = resume.step is not None and any(log_dir.glob("events.out.tfevents.*"))
        # On resume from step N the steps after N are logged again: purge_step writes a
        # SessionLog.START at N + 1, and TensorBoard's readers drop every earlier-written point
        # at or after it, so each step keeps one point, the new one.
        purge = None if resume.step is None else resume.step + 1
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)
        if earlier:  # the first segment's texts (step 0) stay
            return
        # 4-space indent: TensorBoard renders text as Markdown, this keeps the YAML a code block
        self.writer.add_text("config", "    " + _config_yaml(config).replace("\n", "\n    "))
        self.writer.add_text("git_revision", revision)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_mode() -> str:
    """$WANDB_MODE if set; else online only with credentials (API key or netrc), else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import netrc

    try:  # $NETRC is honoured by wandb (via requests) as well
        hosts = netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc")).hosts
    except (OSError, netrc.NetrcParseError):
        return "offline"
    return "online" if any("wandb" in host for host in hosts) else "offline"


class _WandB:
    def __init__(self, folder: Path, name: str, config: dict[str, Any], revision: str,
                 resume: _Resume) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        # a stored id is resumed ("allow": a run the server never saw, e.g. offline, is created)
        reopen = {"id": resume.id, "resume": "allow"} if resume.id else {}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mlsm"), name=name,
                              dir=str(folder), config={**config, "git_revision": revision},
                              mode=wandb_mode(), **reopen,
                              settings=wandb.Settings(console="off", silent=True))
        self.id = self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, folder: Path, name: str, config: dict[str, Any], revision: str,
                 resume: _Resume) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps its file store only on request; it is the backend that needs no server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (folder / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        self.held = -1  # steps up to this one are in the run already (a resumed run)
        if resume.id and self._reopen(resume.id):
            return
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "mlsm")
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        tags = {"mlflow.source.git.commit": revision}
        run = self.client.create_run(exp_id, run_name=name, tags=tags)
        self.id = run.info.run_id
        self._log_config(config)

    def _reopen(self, run_id: str) -> bool:
        """Continue the stored run (False when the store no longer has it)."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return False
        self.id = run_id
        self.client.update_run(run_id, status="RUNNING")
        # params are write-once in MLflow (and device/threads may change on resume): kept as logged
        steps = [m.step for key in run.data.metrics
                 for m in self.client.get_metric_history(run_id, key)]
        self.held = max(steps, default=-1)
        return True

    def _log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.id, params=params[i:i + 100])
        self.client.log_text(self.id, _config_yaml(config), "config.yaml")

    @property
    def run_id(self) -> str:
        return self.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self.held:  # MLflow cannot replace a point: a replayed step would be doubled
            return
        now = int(time.time() * 1000)
        rows = [Metric(k, v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.id, metrics=rows)

    def close(self) -> None:
        self.client.set_terminated(self.id)


class _Trackio:
    def __init__(self, folder: Path, name: str, config: dict[str, Any], revision: str,
                 resume: _Resume) -> None:
        import trackio

        project = os.environ.get("TRACKIO_PROJECT", "mlsm")
        # trackio prints its news ("* Created new run: ...") on stdout, which carries mlsm's results
        with contextlib.redirect_stdout(sys.stderr):
            self.run = trackio.init(project=project, name=name,
                                    config={**config, "git_revision": revision}, embed=False,
                                    auto_log_gpu=False, auto_log_cpu=False,
                                    resume="allow" if resume.id else "never")
        self.id = self.run.id  # recorded; trackio itself resumes a run by its name
        self.held = -1
        if resume.id:
            from trackio.sqlite_storage import SQLiteStorage

            with contextlib.suppress(Exception):  # unknown: replayed steps are sent again
                held = SQLiteStorage.get_max_step_for_run(project, name, run_id=self.run.id)
                self.held = -1 if held is None else held

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step > self.held:  # trackio cannot replace a point: a replayed step would be doubled
            with contextlib.redirect_stdout(sys.stderr):
                self.run.log(metrics, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(sys.stderr):  # "* Run finished. ..."
            self.run.finish()
        # trackio finishes its current run again at exit, printing once more, outside this redirect
        with contextlib.suppress(ImportError, AttributeError):
            from trackio import context_vars

            if context_vars.current_run.get() is self.run:
                context_vars.current_run.set(None)


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow, "trackio": _Trackio}


class Tracker:
    """The trackers of one run (possibly none): `log(metrics, step)`, then `close()`."""

    def __init__(self, backends: dict[str, Any] | None = None) -> None:
        self.backends = dict(backends or {})

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Log the numeric entries of `metrics` (bools and strings are left out) at `step`."""
        numbers = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        for name, backend in list(self.backends.items()):
            try:
                backend.log(numbers, step)
            except Exception as exc:  # a tracker must never end a long run
                self._drop(name, "logging", exc)

    def close(self) -> None:
        for name, backend in list(self.backends.items()):
            try:
                backend.close()
            except Exception as exc:
                self._drop(name, "closing", exc)
        self.backends.clear()

    def _drop(self, name: str, what: str, exc: Exception) -> None:
        self.backends.pop(name, None)
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"mlsm: the {name} tracker failed while {what} ({type(exc).__name__}: {first}); "
              "it is off for the rest of this run", file=sys.stderr, flush=True)


def open_tracker(names: list[str], folder: str | Path, config: dict[str, Any], name: str,
                 where: str = "train.report_to", resume_step: int | None = None) -> Tracker:
    """Start a run in every backend of `names`; folder holds the local files of those that write
    any. resume_step: the step a resumed run continues from; the tracker runs started for `name`
    in `folder` are then continued (module docstring). A backend that cannot start is one
    UserError naming it (nothing of the run is lost)."""
    require(names, where)
    if not names:
        return Tracker()
    from mlsm.provenance import git_revision

    revision = git_revision()
    folder = Path(folder)
    state = read_state(folder)  # before any tracker starts
    stored = state.get(name, {}) if resume_step is not None else {}
    started: dict[str, Any] = {}
    for backend in names:
        known = stored.get(backend)
        resume = _Resume(resume_step, str(known) if known else None)
        try:
            started[backend] = _CLASSES[backend](folder, name, config, revision, resume)
        except Exception as exc:
            Tracker(started).close()
            first = (str(exc).strip().splitlines() or [""])[0]
            raise UserError(f"cannot start the {backend} tracker ({type(exc).__name__}: {first}); "
                            f"fix its setup or drop it from {where}") from None
    ids = {k: b.id for k, b in started.items() if getattr(b, "id", None)}
    if ids:
        _write_state(folder, state, name, ids)
    return Tracker(started)
