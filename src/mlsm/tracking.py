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
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mlsm.errors import UserError

BACKENDS = ("tensorboard", "wandb", "mlflow", "trackio")
EXTRA = 'pip install -e ".[tracking]"'
# backend -> package that must be importable (torch.utils.tensorboard needs tensorboard)
_PACKAGES = {name: name for name in BACKENDS}


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
    def __init__(self, folder: Path, name: str, config: dict[str, Any], revision: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # one sub-folder per run: `tensorboard --logdir FOLDER/tensorboard` compares them
        self.writer = SummaryWriter(log_dir=str(folder / "tensorboard" / name))
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
    def __init__(self, folder: Path, name: str, config: dict[str, Any], revision: str) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mlsm"), name=name,
                              dir=str(folder), config={**config, "git_revision": revision},
                              mode=wandb_mode(),
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, folder: Path, name: str, config: dict[str, Any], revision: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps its file store only on request; it is the backend that needs no server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (folder / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "mlsm")
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        tags = {"mlflow.source.git.commit": revision}
        run = self.client.create_run(exp_id, run_name=name, tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:500]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, _config_yaml(config), "config.yaml")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=rows)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio:
    def __init__(self, folder: Path, name: str, config: dict[str, Any], revision: str) -> None:
        import trackio

        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "mlsm"), name=name,
                                config={**config, "git_revision": revision}, embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


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
                 where: str = "train.report_to") -> Tracker:
    """Start a run in every backend of `names`; folder holds the local files of those that write
    any. A backend that cannot start is one UserError naming it (nothing of the run is lost)."""
    require(names, where)
    if not names:
        return Tracker()
    from mlsm.config import git_revision

    revision = git_revision()
    folder = Path(folder)
    started: dict[str, Any] = {}
    for backend in names:
        try:
            started[backend] = _CLASSES[backend](folder, name, config, revision)
        except Exception as exc:
            Tracker(started).close()
            first = (str(exc).strip().splitlines() or [""])[0]
            raise UserError(f"cannot start the {backend} tracker ({type(exc).__name__}: {first}); "
                            f"fix its setup or drop it from {where}") from None
    return Tracker(started)

