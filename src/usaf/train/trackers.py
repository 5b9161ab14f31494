"""Experiment trackers beside metrics.jsonl: `log.report_to`, with the names and behaviour of transformers'
`report_to`: every tracker `accelerate.tracking` knows (LOGGER_TYPE_TO_CLASS: tensorboard, wandb, mlflow, aim,
comet_ml, clearml, dvclive, swanlab, trackio), driven through accelerate's own tracker classes (`OnAccelerate`;
MLflow through its client, see `MLflow`), and any registered from outside; "none". Each gets the scalars
metrics.jsonl gets, at the same steps, and the run's configuration once.

A tracker is a class in `TRACKERS` (`usaf.registry.TRACKERS`, whose names are log.report_to's choices: a name
that is not registered is refused when the config is read), with the protocol `usaf.registry.Tracker`:

    @register_tracker
    class MyTracker(Tracker):           # the base class: `available`, `check`, `hint` and `close` by default
        name, package, install = "mine", "mypackage", "pip install mypackage"   # log.report_to's value
        def start(self, run_dir, config, start_step) -> None: ...    # config: the run's, as nested dicts
        def log(self, step, scalars) -> None: ...                     # a row of metrics.jsonl's numbers

(a tracker of accelerate's, such as one registered with `accelerate.tracking.register_tracker_class`, is an
`OnAccelerate` subclass naming it: `arguments` says what its class is constructed with).

`available()` says whether its package is installed and `check()` whether it can start (credentials, a server
that answers), both before anything is written; `start`, `log` and `close` do the rest. A tracker never hangs or
ends a run: its start and close are given START_TIMEOUT_S, a start that fails is one line naming the setting to
fix (before training), and a log or close that fails mid-run is one warning, after which the run goes on without
it (metrics.jsonl keeps every row). Nothing a tracker writes locally leaves the run folder unless the user points
it elsewhere through the tracker's own environment (WANDB_DIR, MLFLOW_TRACKING_URI, ...); the services' own
trackers (comet_ml, clearml; trackio, whose store is TRACKIO_DIR's) keep their runs where their settings say.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from accelerate.tracking import LOGGER_TYPE_TO_CLASS

from usaf.errors import ConfigError, UsafError, first_line
from usaf.registry import TRACKERS

NONE = "none"
# A tracker's start or close past this is given up: the trackers' own network timeouts run to minutes (a server
# that does not answer is found sooner, by PROBE_TIMEOUT_S); MLflow's first sqlite:/// start migrates for seconds.
START_TIMEOUT_S = 120.0
# An MLflow server that does not answer within this is unreachable (per connect, per read).
PROBE_TIMEOUT_S = 5.0


class Tracker:
    """The base of a tracker (`usaf.registry.Tracker`, the protocol): `package` is what `available` looks for,
    `install` what to tell a user without it; `check` and `close` do nothing unless a tracker needs them to."""

    name: str
    package: str
    install: str

    @classmethod
    def available(cls) -> bool:
        return importlib.util.find_spec(cls.package) is not None

    @classmethod
    def check(cls) -> None:
        """Raise the one-line UsafError that says what to set when the tracker cannot start (no credentials, a
        server that does not answer); quick, run before anything is written."""

    @classmethod
    def hint(cls) -> str:
        """What a user whose tracker failed to start can do: the settings to fix, named."""
        return f"leave {cls.name} out of log.report_to"

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


class OnAccelerate(Tracker):
    """A tracker of `accelerate.tracking` (LOGGER_TYPE_TO_CLASS[name]), driven through its own API: constructed
    with `arguments` (where the tracker writes files: the run folder), started, given the configuration once (a
    resume continues the tracker's run), each row, finished. A subclass gives only what differs."""

    def arguments(self, run_dir: Path, start_step: int) -> dict:
        return {"run_name": run_dir.name}

    def start(self, run_dir: Path, config: dict, start_step: int) -> None:
        self.tracker = LOGGER_TYPE_TO_CLASS[self.name](**self.arguments(Path(run_dir), start_step))
        self.tracker.start()
        if not start_step:
            self.configure(_flat(config))

    def configure(self, values: dict) -> None:
        self.tracker.store_init_configuration(values)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.tracker.log(scalars, step=step)

    def close(self) -> None:
        self.tracker.finish()


class TensorBoard(OnAccelerate):
    name, package, install = "tensorboard", "tensorboard", "pip install tensorboard"

    def arguments(self, run_dir: Path, start_step: int) -> dict:
        # run_dir/tensorboard; a resume continues after its checkpoint's step: events written past it (by a
        # killed process) are dropped, those at it kept, as metrics.jsonl keeps its rows up to that step
        purge = start_step + 1 if start_step else None
        return {"run_name": "tensorboard", "logging_dir": str(run_dir), "purge_step": purge}

    def configure(self, values: dict) -> None:
        # a text, not accelerate's add_hparams: that writes a second event folder and an hparams.yml each start,
        # and its table shows scalars only (the config has lists and paths)
        text = "\n".join(f"    {k}: {v}" for k, v in values.items())  # indented: markdown code
        self.tracker.tracker.add_text("config", text, 0)


class WandB(OnAccelerate):
    name, package, install = "wandb", "wandb", "pip install 'usaf[wandb]'"

    @classmethod
    def check(cls) -> None:
        if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
            return
        import wandb

        if not os.environ.get("WANDB_API_KEY"):
            try:  # a key saved by `wandb login` (.netrc) or an identity token file, found without prompting
                found = wandb.login(prompt=False, verify=False)
            except TypeError:  # a wandb whose login always prompts: its init says what is missing
                found = True
            if not found:
                raise ConfigError(f"log.report_to=wandb, but W&B has no API key: {cls.hint()}.")
        variable = "WANDB_BASE_URL"
        _probe(os.environ.get(variable) or wandb.Settings().base_url, variable, cls)

    @classmethod
    def hint(cls) -> str:
        return (
            "run `wandb login` or set WANDB_API_KEY (and WANDB_BASE_URL for a server of your own), set "
            "WANDB_MODE=offline to keep the run in the run folder, or leave wandb out of log.report_to"
        )

    def arguments(self, run_dir: Path, start_step: int) -> dict:
        return {
            "run_name": os.environ.get("WANDB_PROJECT", "usaf"),  # accelerate's run_name is W&B's project
            # read now, not from the settings W&B kept when `check` first asked it (a process may change it since)
            "mode": os.environ.get("WANDB_MODE") or None,
            "name": run_dir.name,
            "id": run_id(run_dir),
            "resume": "allow",
            "dir": os.environ.get("WANDB_DIR", str(run_dir)),
        }


class Aim(OnAccelerate):
    name, package, install = "aim", "aim", "pip install aim"

    def arguments(self, run_dir: Path, start_step: int) -> dict:
        return {"run_name": run_dir.name, "logging_dir": str(run_dir)}  # the Aim repository: run_dir/.aim


class CometML(OnAccelerate):
    """Comet's own settings (COMET_API_KEY, COMET_MODE=offline, ...) apply; its project is usaf's."""

    name, package, install = "comet_ml", "comet_ml", "pip install comet_ml"

    def arguments(self, run_dir: Path, start_step: int) -> dict:
        return {"run_name": os.environ.get("COMET_PROJECT_NAME", "usaf")}


class ClearML(OnAccelerate):
    """ClearML's own settings (clearml.conf, CLEARML_PROJECT, CLEARML_TASK) apply."""

    name, package, install = "clearml", "clearml", "pip install clearml"


class DVCLive(OnAccelerate):
    name, package, install = "dvclive", "dvclive", "pip install dvclive"

    def arguments(self, run_dir: Path, start_step: int) -> dict:
        return {"dir": str(run_dir / "dvclive"), "resume": bool(start_step)}


class SwanLab(OnAccelerate):
    name, package, install = "swanlab", "swanlab", "pip install swanlab"

    def arguments(self, run_dir: Path, start_step: int) -> dict:
        return {"run_name": "usaf", "experiment_name": run_dir.name, "logdir": str(run_dir / "swanlog")}


class Trackio(OnAccelerate):
    """Trackio keeps its runs where TRACKIO_DIR says (its default: the Hugging Face cache), not the run folder."""

    name, package, install = "trackio", "trackio", "pip install trackio"

    def arguments(self, run_dir: Path, start_step: int) -> dict:
        return {"run_name": "usaf", "name": run_dir.name, "resume": "allow"}


# MLflow's URI schemes of a database store (SQLAlchemy's dialects): SQLAlchemy and Alembic are needed for them
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


class MLflow(Tracker):
    """MLflow through its client (no process-wide active run or tracking URI is set): the store of
    MLFLOW_TRACKING_URI (a server, sqlite:///..., file:///...), else a file store in the run folder. Not on
    accelerate's MLflowTracker: that drives MLflow's fluent API, whose active run belongs to the thread that
    started it (usaf starts a tracker in a thread bounded by START_TIMEOUT_S, and logs from the loop's) and whose
    tracking URI is the process's (the run folder's store would be set for the whole process)."""

    name, package, install = "mlflow", "mlflow", "pip install 'usaf[mlflow]'"

    @classmethod
    def check(cls) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        scheme = urllib.parse.urlparse(uri).scheme.split("+")[0]
        if scheme in _DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
            raise UsafError(
                f"MLFLOW_TRACKING_URI={uri} is a database store, which needs SQLAlchemy and Alembic: "
                f"{cls.install}, or {cls.hint()}."
            )
        if scheme in ("http", "https"):
            _probe(uri.rstrip("/") + "/health", "MLFLOW_TRACKING_URI", cls)

    @classmethod
    def hint(cls) -> str:
        return (
            "set MLFLOW_TRACKING_URI to a server that answers, sqlite:///PATH or file:///PATH, unset it to keep "
            "the store in the run folder, or leave mlflow out of log.report_to"
        )

    def start(self, run_dir: Path, config: dict, start_step: int) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow's default store is in the working directory; the run folder is the only place usaf writes.
            uri = (Path(run_dir).resolve() / "mlruns").as_uri()
        if urllib.parse.urlparse(uri).scheme in ("", "file"):
            # MLflow's file store is in maintenance mode but needs no database package; asked for, it is allowed
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        else:
            # a server that stops answering mid-run costs tens of seconds once, not MLflow's minutes of retries
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "usaf")
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        found = client.search_runs([experiment_id], f"tags.usaf_run_id = '{run_id(run_dir)}'")
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            from mlflow.entities import Param

            run = client.create_run(
                experiment_id,
                run_name=Path(run_dir).name,
                tags={"usaf_run_id": run_id(run_dir)},
            )
            self.run_id = run.info.run_id
            params = [Param(k, str(v)) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                client.log_batch(self.run_id, params=params[i : i + 100])
        self.client = client

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _probe(url: str, variable: str, tracker: type[Tracker]) -> None:
    """One request to a tracker's server at `url` (any answer will do, an HTTP error included), bounded by
    PROBE_TIMEOUT_S: a server that refuses or never answers is one line, naming `variable`, before the run
    starts, not minutes of the tracker's own retries later."""
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S):
            pass
    except urllib.error.HTTPError:
        pass  # it answered
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", err)  # urllib wraps the socket's error
        said = (
            f"no answer in {PROBE_TIMEOUT_S:g} s"
            if isinstance(reason, TimeoutError)
            else first_line(reason)
            if isinstance(reason, BaseException)
            else str(reason)
        )
        shown = os.environ.get(variable) or url
        raise UsafError(
            f"log.report_to={tracker.name}, but {variable}={shown} does not answer ({said}): {tracker.hint()}."
        ) from None


def register_tracker(tracker: type[Tracker]) -> type[Tracker]:
    """Add a tracker under its `name` (usable in log.report_to); returns it, so it can decorate the class."""
    return TRACKERS.register(tracker)


for _tracker in (TensorBoard, WandB, MLflow):
    register_tracker(_tracker)
for _tracker in (Aim, CometML, ClearML, DVCLive, SwanLab, Trackio):  # the rest of what accelerate knows
    if _tracker.name in LOGGER_TYPE_TO_CLASS:  # an older accelerate knows fewer
        register_tracker(_tracker)


def report_to(log) -> list[str]:
    """log.report_to (of the `log` section), less tensorboard where the older switch log.tensorboard=false says
    so."""
    names = list(log.report_to)
    if not log.tensorboard:
        names = [n for n in names if n != TensorBoard.name] or [NONE]
    return names


def check_report_to(names: list[str]) -> list[type[Tracker]]:
    """The trackers of `log.report_to`, each installed and able to start (its `check`: credentials, a server that
    answers); else the one-line error that says what to install or set. `usaf train` calls it before anything is
    written; the run's `Trackers` then start what it chose without asking the servers again."""
    chosen = chosen_trackers(names)
    for tracker in chosen:
        _started(tracker, "check", tracker.check)
    return chosen


def chosen_trackers(names: list[str]) -> list[type[Tracker]]:
    """The trackers of `log.report_to`, each known and installed; else the one-line error that says what to
    install."""
    if NONE in names:
        if len(names) > 1:
            raise ConfigError(
                f"log.report_to lists 'none' with {[n for n in names if n != NONE]}: give one or the other."
            )
        return []
    chosen = []
    for name in names:
        tracker = TRACKERS[name]  # the config has checked the name against the registry's choices
        if not tracker.available():
            raise UsafError(
                f"log.report_to={name}, but {tracker.package} is not installed: {tracker.install}, or leave "
                f"{name} out of log.report_to."
            )
        chosen.append(tracker)
    return chosen


def _within(seconds: float, what: str, call, *args):
    """`call(*args)` given `seconds`: its result or its exception, else TimeoutError. It runs in a daemon thread,
    which a call that never returns is left in (nothing can stop it; it holds nothing of the run's)."""
    box: dict = {}

    def target():
        try:
            box["value"] = call(*args)
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name=f"usaf-tracker-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _started(tracker, what: str, call, *args) -> None:
    """A tracker's check or start, within START_TIMEOUT_S; any failure is the one line that names the tracker
    and the settings to fix."""
    try:
        _within(START_TIMEOUT_S, f"{tracker.name}-{what}", call, *args)
    except UsafError:
        raise
    except Exception as err:
        raise UsafError(
            f"log.report_to={tracker.name} did not start ({type(err).__name__}: {first_line(err)}): "
            f"{tracker.hint()}."
        ) from None


def print_warning(text: str) -> None:
    """A warning line on stderr (MetricsLog.warn draws it clear of the progress bar)."""
    print(f"usaf: warning: {text}", file=sys.stderr, flush=True)


class Trackers:
    """The run's trackers together: started once (each within START_TIMEOUT_S, or a one-line error), fed every
    logged row's numbers, closed with the run. A tracker that fails mid-run is one warning through `warn` and is
    dropped for the rest of the run: retrying would repeat the warning, and the wait, at every row, and
    metrics.jsonl keeps every row anyway."""

    def __init__(self, names: list[str], run_dir: Path, config: dict, start_step: int, warn=print_warning):
        self.trackers: list[Tracker] = []
        self.warn = warn
        try:
            for tracker in chosen_trackers(names):  # checked when the run began (check_report_to)
                started = tracker()
                _started(started, "start", started.start, Path(run_dir), config, start_step)
                self.trackers.append(started)
        except BaseException:
            self.warn = lambda text: None  # the error says what went wrong; closing the others says nothing
            self.close()
            raise

    def log(self, step: int, record: dict) -> None:
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in list(self.trackers):
            try:
                tracker.log(step, scalars)
            except Exception as err:
                self.trackers.remove(tracker)
                self.warn(
                    f"log.report_to={tracker.name} failed at step {step} ({type(err).__name__}: "
                    f"{first_line(err)}); the run goes on without it, and metrics.jsonl has every row."
                )

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                _within(START_TIMEOUT_S, f"{tracker.name}-close", tracker.close)
            except Exception as err:
                self.warn(
                    f"log.report_to={tracker.name} did not close ({type(err).__name__}: {first_line(err)}); "
                    "the run's own files are complete."
                )
        self.trackers = []
