"""The run folder: whose it is (the marker, the lock), what a new run may start in, what a resume may change, and
the record of the base a run trains on."""

from __future__ import annotations

import enum
import fcntl
import json
import os
import shutil
from pathlib import Path

import torch

from usaf.base.record import base_difference, base_record, read_run_base_record
from usaf.config import AUTO, RESOLVED_AT_START, RunConfig
from usaf.data.sources import is_missing
from usaf.errors import ConfigError, RunStateError, UsafError, first_line
from usaf.files import (
    CONFIG_FILE,
    LOCK_FILE,
    METRICS_FILE,
    ROUTER_LOAD_FILE,
    RUN_BASE_FILE,
    RUN_MARKER,
    SELECTION_AXES_FILE,
    SELECTION_FILE,
    STORE_FILE,
    SUMMARY_FILE,
)
from usaf.io.atomic import atomic_file, atomic_json, open_unfollowed, refuse_link
from usaf.io.guard import check_placement, what_is
from usaf.prepare import current_selection
from usaf.selection.saved import save_selection
from usaf.train import checkpoint, distributed
from usaf.train.session import (
    absolute_paths,
    check_something_to_train,
    is_local_path,
    selection_summary,
)
from usaf.version import __version__

# What a resume may change (applied from the resumed step on, and recorded in the run's config.yaml): settings
# only the loop reads, and the peak learning rate (the schedule's base rates are rescaled). Everything else is
# fixed by the checkpoint (selection, data order, optimizer state, seeds) and refused.
RESUME_MAY_CHANGE = (
    "schedule.max_steps",
    "optim.lr",
    "optim.clip_grad_norm",
    "train.max_bad_steps",
    # a run that stopped early goes on when its patience is raised (or early stopping turned off)
    "schedule.early_stopping_patience",
    "schedule.early_stopping_threshold",
    "log",
    "checkpoint",
    # where the base and the data are (a moved folder): the base is checked against base.json and the checkpoint's
    # base values, the training data against the data position's fingerprint
    "model.path",
    "data.train",
    "data.eval",
    "train.distributed_backend",
    "distributed.timeout_s",  # how long a collective waits: no effect on what is trained
    "train.kernels",  # the same sums, in another order: equal within rounding
    # the checkpoint's expert shards are re-sharded to the new EP size (indices are global); the world size, which
    # fixes the data each step takes, is still checked against the checkpoint's
    "distributed.expert_parallel",
)


def open_run_dir(config: RunConfig, run_dir: Path, resume: bool) -> tuple[RunConfig, list[str]]:
    """The run's config, and (resuming) the changes it makes to the saved one; a new run's folder is marked."""
    saved_config = run_dir / CONFIG_FILE
    if resume:
        latest = checkpoint.latest(run_dir)
        if latest is None:
            raise RunStateError(
                f"--resume {run_dir}: the run has no finished checkpoint to resume from; start it again with "
                f"--out {run_dir}."
            )
        found = absolute_paths(RunConfig.load_saved(str(saved_config))).to_dict()
        # the settings the run last trained with, from its (checksummed) checkpoint; a checkpoint of a usaf
        # that did not record them is compared with config.yaml as found
        recorded = checkpoint.read_state(latest).get(checkpoint.RUN_CONFIG_KEY)
        resolved = {  # what an auto resolved to when the run started
            f"{section}.{key}": (recorded or found)[section][key]
            for section, key in (name.split(".") for name in RESOLVED_AT_START)
            if getattr(getattr(config, section), key) == AUTO  # a number option's AUTO, or a choice's "auto"
        }
        config = config.replace(resolved)
        return config, check_resumable(recorded or found, config, found, saved_config)
    if not distributed.is_main():  # [usaf.distributed] rank 0 marks and writes the folder
        return config, []
    # the marker first: from here on the folder is usaf's, whatever else fails
    atomic_json(run_dir / RUN_MARKER, {"usaf_version": __version__})
    atomic_file(saved_config, lambda tmp: tmp.write_text(config.to_yaml()))
    return config, []


# what a run writes at the top of its folder: removed when a start fails before its first checkpoint
RUN_FILES = (
    RUN_MARKER,
    CONFIG_FILE,
    SELECTION_FILE,
    SELECTION_AXES_FILE,
    RUN_BASE_FILE,
    METRICS_FILE,
    "tensorboard",
    "wandb",
    "mlruns",
    "prefix_cache",
    "checkpoints",
    SUMMARY_FILE,
    ROUTER_LOAD_FILE,
    "report.png",
    "router_load.png",
)


def check_run_paths(config: RunConfig, run_dir: Path) -> None:
    """A resume whose base or data is no longer where the run's config.yaml says: which path, and how to go on."""
    missing = []
    if is_local_path(config.model.path) and not Path(config.model.path).is_dir():
        missing.append(("model.path", config.model.path, "--model NEW_DIR"))
    for key, files, flag in (
        ("data.train", config.data.train, "--data"),
        ("data.eval", config.data.eval, None),
    ):
        for file in files:
            if is_missing(file):
                missing.append((key, file, f"{flag} NEW_FILES" if flag else f"--set {key}=[NEW_FILES]"))
                break
    if missing:
        key, path, fix = missing[0]
        raise RunStateError(
            f"--resume {run_dir}: {key} {path} does not exist (has it moved?); give its new place with {fix}."
        )


def check_moved_base(run_dir: Path, model_dir: str) -> None:
    """A resume from a base at a new place: it must be the base the run recorded (what base.json holds: the sha256
    of the tensors that can hold trained entries, cheap facts of the rest)."""

    recorded = read_run_base_record(run_dir)
    if recorded is None:
        return  # nothing recorded: the checkpoint's base values are still compared on restore
    differs = base_difference(recorded, model_dir)
    if differs is not None:
        raise RunStateError(
            f"--resume {run_dir}: the model at {model_dir} is not the base the run started from ({differs}, "
            f"against {run_dir / RUN_BASE_FILE}); give the folder the run was trained on."
        )


def check_resume_folder(run_dir: Path) -> None:
    if not (run_dir / CONFIG_FILE).is_file():
        raise RunStateError(f"--resume {run_dir}: no {CONFIG_FILE} there; is it a usaf run directory?")
    refuse_links_in_run(run_dir)


def refuse_links_in_run(run_dir: Path) -> None:
    """Every file a run writes, appends to or rewrites (and its lock, and its checkpoints) is its own: a symbolic
    link in its place is refused, never written through."""
    for name in (*RUN_FILES, LOCK_FILE, SELECTION_AXES_FILE):
        refuse_link(run_dir / name)
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        for entry in sorted(checkpoints.iterdir()):
            refuse_link(entry)


def run_inputs(config: RunConfig) -> list[tuple[str, str | None]]:
    """What a run reads: its folder may never be, hold or lie inside them."""
    return [
        ("the model folder", config.model.path),
        *(("the data file", path) for path in config.data.train),
        *(("the eval data file", path) for path in config.data.eval),
        ("the selection file", config.select.file),
    ]


class NewRunFolder(enum.Enum):
    """What a folder is for a new run (`check_new_run`)."""

    NEW = "new"  # not there yet
    EMPTY = "empty"
    # usaf's, without a checkpoint: a start that was killed (only under the lock is it known to be dead)
    DEAD_START = "dead start"
    FORCED = "forced"  # other files, and --force


def check_new_run(config: RunConfig, run_dir: Path, force: bool) -> NewRunFolder:
    """What `run_dir` is for a new run; refuses a folder a new run may not start in."""
    if not config.data.train:
        raise ConfigError("no training data: give --data FILE (or data.train in the config file).")
    if not config.model.path:
        raise ConfigError("no model: give --model DIR (or model.path in the config file).")
    check_something_to_train(config)
    if run_dir.is_file():
        raise UsafError(f"--out {run_dir} is a file, not a folder; choose another --out.")
    check_placement(run_dir, "--out", run_inputs(config))
    if not run_dir.exists():
        return NewRunFolder.NEW
    if not run_dir.is_dir():
        raise UsafError(f"--out {run_dir} is a file, not a folder; choose another --out.")
    refuse_links_in_run(run_dir)
    if checkpoint.latest(run_dir) is not None:
        raise RunStateError(
            f"{run_dir} already holds a run; resume it with --resume or choose another --out."
        )
    # usaf's own temporaries of its run files (a start in its first instant, or one killed then) are not the
    # user's files: such a folder is a start's, and the lock then says whether it is alive
    temporaries = tuple(f".{name}.usaf-tmp-" for name in RUN_FILES)
    entries = sorted(e for e in set(os.listdir(run_dir)) - {LOCK_FILE} if not e.startswith(temporaries))
    if not entries:
        return NewRunFolder.EMPTY
    if RUN_MARKER in entries:
        return NewRunFolder.DEAD_START
    if force:
        if (what := what_is(run_dir)) is not None:
            raise UsafError(
                f"--out {run_dir} is {what.replace('the ', 'a ', 1)}; --force writes a run into a folder of other "
                "files, never into a run, a model folder or a prepared store: choose another --out."
            )
        return NewRunFolder.FORCED
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    raise UsafError(
        f"--out {run_dir} is not empty and not a usaf run (it holds {shown}); choose a new or empty folder, or "
        f"give --force to write the run into it (files named like usaf's, e.g. {CONFIG_FILE}, are replaced)."
    )


def remove_run_files(run_dir: Path, keep: set[str]) -> None:
    for name in RUN_FILES:
        path = run_dir / name
        if name in keep or not (path.exists() or path.is_symlink()):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


class RunLock:
    """An advisory lock on a run folder (flock on RUN_DIR/.usaf-lock): one writer at a time. The kernel drops
    it when the process ends, however it ends, so a killed run never leaves the folder locked."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.fd, self.made_folder = Path(run_dir), None, False

    def __enter__(self) -> RunLock:
        self.made_folder = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = open_unfollowed(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise UsafError(
                f"cannot write into {self.run_dir}: {err.strerror}; choose another --out."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunStateError(
                f"{self.run_dir} is in use by another usaf train (process {holder}); wait for it to end, or "
                "choose another --out."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # closing releases the lock; the file stays (removing it would race a new locker)


def finished_run(run_dir: Path, config: RunConfig) -> dict | None:
    """The saved summary (marked `already_finished`) when the run being resumed has reached max_steps, or stopped
    early and would again at once, and written its summary; None when there is training (or the summary) left to
    do."""
    latest = checkpoint.latest(run_dir)
    step = checkpoint.step_of(latest)
    max_steps = config.schedule.max_steps
    summary_path = run_dir / SUMMARY_FILE
    if (step >= max_steps or _stops_early_at_once(latest, config)) and summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, ValueError) as err:
            raise RunStateError(
                f"--resume {run_dir}: the run is finished but {summary_path} is unreadable ({err}); delete it "
                "and resume again to rewrite it."
            ) from None
        return {**summary, "already_finished": True, "step": step}
    if step > max_steps:
        raise RunStateError(
            f"--resume {run_dir}: the run is at step {step}, beyond schedule.max_steps={max_steps}; give "
            f"--set schedule.max_steps={step} or more."
        )
    return None


def _stops_early_at_once(latest: Path, config: RunConfig) -> bool:
    """Whether early stopping ends the training before its first resumed step: the evaluations without
    improvement that the latest checkpoint counted reach schedule.early_stopping_patience."""
    patience = config.schedule.early_stopping_patience
    if not patience:
        return False
    return (checkpoint.read_state(latest).get(checkpoint.BEST_KEY) or {}).get("since", 0) >= patience


def may_change_on_resume(key: str) -> bool:
    return key in RESUME_MAY_CHANGE or key.split(".", 1)[0] in RESUME_MAY_CHANGE


def check_resumable(
    recorded: dict, now: RunConfig, found: dict | None = None, config_file: Path | None = None
) -> list[str]:
    """The changes a resume makes ("optim.lr 0.01 -> 0.02") to the settings the run `recorded`; refuses any
    outside RESUME_MAY_CHANGE, and any edit of the run's config.yaml (`found`) that the command line does not
    set back: a resume changes settings with --set, so that config.yaml always states the run."""
    old, new = _plain(recorded), _plain(now.to_dict())
    found = _plain(found) if found is not None else new
    allowed = ", ".join(k if "." in k else f"{k}.*" for k in RESUME_MAY_CHANGE)
    changes = []
    for section, values in old.items():
        for name, a in values.items():
            b, key = new.get(section, {}).get(name), f"{section}.{name}"
            if a == b:
                continue
            edited = found.get(section, {}).get(name, a)
            if edited != a and edited == b:  # the value comes from config.yaml, not from the command line
                how = (
                    f"to change it on resume, give --set {key}=VALUE"
                    if may_change_on_resume(key)
                    else f"it is fixed by the checkpoint (a resume may change only {allowed}, with --set)"
                )
                raise RunStateError(
                    f"cannot resume: {config_file} was edited: '{key}' is {b!r} there, but the run recorded "
                    f"{a!r}; put {a!r} back (or resume with --set {key}={_shown(a)}); {how}."
                )
            if not may_change_on_resume(key):
                raise RunStateError(
                    f"cannot resume: '{key}' differs from the original run ({a!r} there, {b!r} now). Resume with "
                    f"the original value; a resume may change only {allowed}."
                )
            changes.append(f"{key} {a!r} -> {b!r}")
    return changes


def _plain(config: dict) -> dict:
    """A config's sections as JSON reads them back (tuples as lists), so a recorded copy compares equal."""
    return json.loads(json.dumps(config))


def _shown(value) -> str:
    """A value as --set takes it."""
    return json.dumps(value) if isinstance(value, list | dict | bool) or value is None else str(value)


def trained_parameters(model: torch.nn.Module) -> list[str]:
    """The model parameters that can hold trained entries in this run (whatever a reselection moves): the
    tensors with a selection, and the parameters trained whole (routers)."""
    return [
        *checkpoint.selection_layout(model),
        *(name for name, p in model.named_parameters() if p.requires_grad and ".usaf." not in name),
    ]


def record_base(config: RunConfig, run_dir: Path, trained: list[str]) -> str | None:
    """RUN/base.json: the identity of the base, which `usaf export` checks a base against (as `usaf apply` checks
    a delta's): the sha256 of the checkpoint tensors behind `trained` (the rest of the base is not read whole),
    cheap facts of the others. A note when the base is not a local folder, None when recorded."""

    model_dir = Path(config.model.path).expanduser()
    if not ((model_dir / "config.json").is_file() or (model_dir / STORE_FILE).is_file()):
        return f"the base {config.model.path} is not a local folder: usaf export cannot check a --base against it"
    try:
        record = base_record(model_dir, trained)
    except (UsafError, OSError, KeyError, ValueError) as err:  # e.g. a store whose source has moved
        return f"the base's identity was not recorded ({first_line(err)}): usaf export cannot check a --base"
    atomic_json(run_dir / RUN_BASE_FILE, record)
    return None


def record_start(run_dir: Path, config: RunConfig, model: torch.nn.Module) -> list[str]:
    """A new run's writes once its model is prepared (rank 0 only): the selection it starts from
    (selection.safetensors, which a resume starts from again) and the base's identity (base.json). Notes to show."""
    # every rank gathers (under expert parallelism each holds its experts' share); rank 0 writes
    chosen = current_selection(model)
    summary = selection_summary(model, config, chosen)
    if not distributed.is_main():  # [usaf.distributed] only rank 0 writes
        return []
    save_selection(run_dir / SELECTION_FILE, chosen, summary)
    unrecorded = record_base(config, run_dir, trained_parameters(model))
    return [unrecorded] if unrecorded is not None else []


def write_summary(run_dir: Path, summary: dict, held: dict[str, float] | None = None) -> None:
    """A finished run's summary.json (rank 0 only): written last, it marks the run finished. `held`: this rank's
    figures by name (peak memory, frozen bytes); under torchrun every rank's go in as `ranks` (each rank must
    call)."""
    if held is not None and distributed.active():
        summary["ranks"] = [
            {"rank": r, **{k: v if k.endswith("_mb") else int(v) for k, v in zip(held, values, strict=True)}}
            for r, values in enumerate(distributed.per_rank(list(held.values())))
        ]
    if distributed.is_main():  # [usaf.distributed] only rank 0 writes
        atomic_json(run_dir / SUMMARY_FILE, summary)
