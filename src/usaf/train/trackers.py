"""Experiment trackers beside metrics.jsonl: `log.report_to`, with the names and behaviour of transformers'
`report_to` (TensorBoard, Weights & Biases, MLflow; "none"). Each gets the scalars metrics.jsonl gets, at the same
steps, and the run's configuration once.

A tracker is a class in `TRACKERS` (a plug-in point: `register_tracker`): `available()` says whether its package
is installed, checked when the run starts (a requested tracker that is missing is a one-line error then, not
silence); `start`, `log` and `close` do the rest. Nothing a tracker writes leaves the run folder unless the user
points it elsewhere through the tracker's own environment (WANDB_DIR, MLFLOW_TRACKING_URI, ...).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from usaf.errors import UsafError

NONE = "none"


class Tracker:
    """One tracker of a run. `package`: what `available` looks for; `install`: what to tell a user without it."""

    name: str
    package: str
    install: str

    @classmethod
    def available(cls) -> bool:
        return importlib.util.find_spec(cls.package) is not None

    def start(self, run_dir: Path, config: dict, start_step: int) -> None:
        raise NotImplementedError

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _flat(config: dict, prefix: str = "") -> dict:
    """A nested configuration as "section.key" -> value (lists as text), what trackers' config tables show."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = (
                value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
            )
    return out


def run_id(run_dir: Path) -> str:
    """A stable id per run folder: a resumed run continues the same tracker run."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class TensorBoard(Tracker):
    name, package, install = "tensorboard", "tensorboard", "pip install tensorboard"

    def start(self, run_dir: Path, config: dict, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start_step or None)
        if not start_step:
            text = "\n".join(f"    {k}: {v}" for k, v in _flat(config).items())  # indented: markdown code
            self.writer.add_text("config", text, 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB(Tracker):
    name, package, install = "wandb", "wandb", "pip install 'usaf[wandb]'"

    def start(self, run_dir: Path, config: dict, start_step: int) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "usaf"),
            name=Path(run_dir).name,
            id=run_id(run_dir),
            resume="allow",
            dir=os.environ.get("WANDB_DIR", str(run_dir)),
            config=_flat(config),
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow(Tracker):
    name, package, install = "mlflow", "mlflow", "pip install 'usaf[mlflow]'"

    def start(self, run_dir: Path, config: dict, start_step: int) -> None:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow's default store is in the working directory; the run folder is the only place usaf writes.
            # Its file store is in maintenance mode but needs no database package: allowed for this default only.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((Path(run_dir).resolve() / "mlruns").as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "usaf"))
        found = mlflow.search_runs(
            filter_string=f"tags.usaf_run_id = '{run_id(run_dir)}'", output_format="list"
        )
        if found:
            self.run = mlflow.start_run(run_id=found[0].info.run_id)
        else:
            self.run = mlflow.start_run(run_name=Path(run_dir).name, tags={"usaf_run_id": run_id(run_dir)})
            mlflow.log_params(_flat(config))
        self.mlflow = mlflow

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoard, WandB, MLflow)}


def register_tracker(tracker: type[Tracker]) -> type[Tracker]:
    """Add a tracker under its `name` (usable in log.report_to); returns it, so it can decorate the class."""
    TRACKERS[tracker.name] = tracker
    return tracker


def report_to(log) -> list[str]:
    """log.report_to (of the `log` section), less tensorboard where the older switch log.tensorboard=false says
    so."""
    names = list(log.report_to)
    if not log.tensorboard:
        names = [n for n in names if n != TensorBoard.name] or [NONE]
    return names


def check_report_to(names: list[str]) -> list[type[Tracker]]:
    """The trackers of `log.report_to`, each installed; else the one-line error that says what to install."""
    if NONE in names:
        if len(names) > 1:
            raise UsafError(
                f"log.report_to lists 'none' with {[n for n in names if n != NONE]}: give one or the other."
            )
        return []
    chosen = []
    for name in names:
        tracker = TRACKERS.get(name)
        if tracker is None:
            raise UsafError(
                f"log.report_to: unknown tracker {name!r}; known: {', '.join([*TRACKERS, NONE])}."
            )
        if not tracker.available():
            raise UsafError(
                f"log.report_to={name}, but {tracker.package} is not installed: {tracker.install}, or leave "
                f"{name} out of log.report_to."
            )
        chosen.append(tracker)
    return chosen


class Trackers:
    """The run's trackers together: started once, fed every logged row's numbers, closed with the run."""

    def __init__(self, names: list[str], run_dir: Path, config: dict, start_step: int):
        self.trackers = []
        for tracker in check_report_to(names):
            started = tracker()
            started.start(Path(run_dir), config, start_step)
            self.trackers.append(started)

    def log(self, step: int, record: dict) -> None:
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self.trackers:
            tracker.log(step, scalars)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
