"""`usaf train`: one run, top to bottom.

set up the run dir -> load and prepare the model -> load the data -> optimizer and schedule -> (resume) ->
evaluate -> loop { micro-batches, backward, skip bad steps, clip, step, log, checkpoint } -> evaluate -> summary.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from . import __version__, checkpoint, runtime
from .arch import find_moe_layers
from .atomic import atomic_file, atomic_json
from .config import RunConfig
from .data import Batches, collate, load_dataset
from .errors import UsafError, first_line
from .evaluate import evaluate
from .loss import IGNORE_INDEX, causal_lm_loss
from .metrics import MetricsLog
from .offload import streamed_bytes
from .optim import CompactAdamW
from .prefix_cache import FrozenPrefixCache
from .prepare import current_selection, enable_recomputation, prepare_model, sparse_modules, trainable_summary
from .recompute import choose_recompute
from .report import write_router_load
from .reselect import Reselector
from .router import RouterCollapse, RouterTraining
from .select import save_selection
from .source import check_model_files
from .tokenizer import has_tokenizer_files, model_vocabulary

CONFIG_FILE = "config.yaml"
# What a resume may change (applied from the resumed step on, and recorded in the run's config.yaml): settings
# only the loop reads, and the peak learning rate (the schedule's base rates are rescaled). Everything else is
# fixed by the checkpoint (selection, data order, optimizer state, seeds) and refused.
RESUME_MAY_CHANGE = (
    "schedule.max_steps",
    "optim.lr",
    "optim.clip_grad_norm",
    "train.max_bad_steps",
    "log",
    "checkpoint",
    # where the base and the data are (a moved folder): the base is checked against base.json and the checkpoint's
    # base values, the training data against the data position's fingerprint
    "model.path",
    "data.train",
    "data.eval",
)


def train(config: RunConfig, run_dir: str | Path, resume: bool = False, force: bool = False) -> dict:
    """Run (or, with `resume`, continue) a training into `run_dir`, holding the folder's lock throughout.
    `force`: start a new run in an existing folder that is not a usaf run."""
    run_dir = Path(run_dir)
    config.check()  # a config built or changed in Python gets the same range checks as a file
    config = absolute_paths(config)  # the run's config.yaml must not depend on the working directory
    if resume:
        _check_resume_folder(run_dir)
        _check_run_paths(config, run_dir)
    else:
        _check_new_run(config, run_dir, force)  # before anything is written, lock file included
    with RunLock(run_dir) as lock:
        # again under the lock (another start may have got here first); a dead start is cleared
        if not resume and _check_new_run(config, run_dir, force) == "dead start":
            _remove_run_files(run_dir, keep=set())
        present = set(os.listdir(run_dir))
        try:
            return _train(config, run_dir, resume)
        except BaseException:
            # a start that failed before its first checkpoint leaves nothing that looks like a run
            if not resume and checkpoint.latest(run_dir) is None:
                with contextlib.suppress(OSError):  # a second error must not hide the first
                    if lock.made_folder:
                        shutil.rmtree(run_dir)
                    else:
                        _remove_run_files(run_dir, keep=present)
            raise


def _train(config: RunConfig, run_dir: Path, resume: bool) -> dict:
    config, changes = _prepare_run_dir(config, run_dir, resume)
    notes: list[str] = []
    if resume:
        if (finished := _finished_run(run_dir, config)) is not None:
            return finished  # nothing to do, and nothing written: the run's files stay as they are
        if any(c.startswith("model.path ") for c in changes):
            _check_moved_base(run_dir, config.model.path)
        resumed_yaml = config.to_yaml()  # as given (a note may turn packing off for this process only)
    device = runtime.resolve_device(config.model.device)
    dtype = runtime.resolve_dtype(config.model.dtype, device)
    runtime.seed_everything(config.train.seed)

    tokenizer = load_tokenizer(config.model.path)
    train_data, eval_data, data_stats = _load_data(config, tokenizer, config.data.pack)
    if (folder := Path(config.model.path).expanduser()).is_dir() and (folder / "config.json").is_file():
        from transformers import AutoConfig

        # (its files were checked by load_tokenizer) before the model is loaded and calibrated; again on the
        # loaded model's config for other sources
        _check_positions(AutoConfig.from_pretrained(folder), config, train_data, eval_data)
    batches = Batches(train_data, config.data.batch_size, seed=config.train.seed)
    calibration = Batches(train_data, config.data.batch_size, seed=config.train.seed + 1)  # its own order
    # a resumed run starts from the selection it saved (the checkpoint then restores the current one)
    saved_selection = run_dir / "selection.safetensors" if resume else None
    # decided before loading: calibration recomputes as training does
    recompute = choose_recompute(config, device, dtype)
    model = load_model(
        config,
        device,
        dtype,
        calibration_batches=calibration,
        selection_file=saved_selection,
        recompute=recompute.recompute,
    )
    _check_positions(model.config, config, train_data, eval_data)
    if config.data.pack and not packed_documents_are_isolated(model, device):
        # this family's attention ignores restarting position_ids (gpt-oss in transformers 5.24): packed
        # documents would attend to each other, so each document gets its own row instead
        notes.append("this model lets packed documents attend to each other: packing is off for this run")
        config = copy.deepcopy(config)
        config.data.pack = False
        train_data, eval_data, data_stats = _load_data(config, tokenizer, pack=False)
        batches = Batches(train_data, config.data.batch_size, seed=config.train.seed)
    if not resume:
        save_selection(
            run_dir / "selection.safetensors", current_selection(model), selection_summary(model, config)
        )
        if (unrecorded := _record_base(config, run_dir, trained_parameters(model))) is not None:
            notes.append(unrecorded)
    prefix_cache = _prefix_cache(model, config, run_dir)

    state = {
        "step": 0,
        "bad_steps": 0,
        "overflow_steps": 0,  # fp16 steps whose gradients overflowed: the loss scale is lowered, the step skipped
        "loss_scale": {},
        "tokens": 0,
        "train_seconds": 0.0,
        "eval_before": None,
        "first_loss": None,
        "last_loss": None,  # restored too: a resume that only writes the summary still knows it
    }
    probe_rows = eval_data if eval_data is not None else train_data
    probe_batch = collate([probe_rows[i] for i in range(min(4, len(probe_rows)))], probe_rows.pad_id)
    routers = RouterTraining(
        model, config.router, _router_params(model), {k: v.to(device) for k, v in probe_batch.items()}
    )
    saved = checkpoint.latest(run_dir) if resume else None
    if saved is not None:
        restored = checkpoint.load(saved)
        restore_trainable(model, restored["trainable"], saved)
        routers.load_state_dict(restored["router"])
        routers.load_tensor_state(restored["extra"])
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    if saved is not None:
        checkpoint.restore_optimizer(optimizer, restored)
        scheduler.load_state_dict(restored["scheduler"])
        _apply_resumed_schedule(optimizer, scheduler, config, restored["config"])
        batches.load_state_dict(restored["data"])
        runtime.set_rng_state(restored["rng"])
        state.update({k: restored[k] for k in state if k in restored})
    if resume and changes:  # recorded once the checkpoint is restored, so a later resume or export reads them
        atomic_file(run_dir / CONFIG_FILE, lambda tmp: tmp.write_text(resumed_yaml))
        notes.append("resumed with " + ", ".join(changes))

    autocast = runtime.autocast(config.train.precision, device, dtype)
    scaler = runtime.loss_scaler(config.train.precision, device, dtype)
    if scaler.is_enabled() and state["loss_scale"]:
        scaler.load_state_dict(state["loss_scale"])
    summary_entries = trainable_summary(model)
    if resume:
        _truncate_metrics(run_dir / "metrics.jsonl", state["step"])
    # the run's first lines are out (flushed) before the progress bar starts drawing on stderr, so that a terminal
    # (or one log file for both streams) shows them whole, not broken into by the bar
    print(
        f"usaf {__version__}: training {summary_entries['expert_entries']:,} expert entries"
        + "".join(f" + {n:,} {t.replace('_', ' ')}" for t, n in _target_entries(summary_entries).items())
        + f" + {summary_entries['routers']:,} router weights on {device} ({dtype}); {data_stats.summary()}",
        flush=True,
    )
    print(recompute.line, flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)
    log = MetricsLog(
        run_dir, config.schedule.max_steps, state["step"], config.log.progress, config.log.tensorboard
    )
    if eval_data is not None and state["eval_before"] is None:
        state["eval_before"] = _evaluate(model, eval_data, config, device, autocast)
        log.log(state["step"], {f"eval/{k}": v for k, v in state["eval_before"].items()})

    reselector = None
    if config.select.reselect_every:
        reselector = Reselector(model, config.select, config.schedule.max_steps, config.optim.eight_bit)
        if saved is not None:
            reselector.load_state_dict(restored["extra"])
    stop = _StopRequest()
    model.train()
    try:
        while state["step"] < config.schedule.max_steps and not stop.requested:
            started, streamed_before = time.perf_counter(), streamed_bytes(model)
            if reselector is not None:
                reselector.before_step(state["step"] + 1)
            loss, tokens = _accumulate_gradients(
                model,
                batches,
                config,
                device,
                autocast,
                scaler,
                prefix_cache,
                reselector,
                routers,
                state["step"],
            )
            scaler.unscale_(optimizer)
            grad_norm = _clip(model, config.optim.clip_grad_norm)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                # a skipped step still closes the scaler's step (it lowers the fp16 loss scale on inf gradients)
                scaler.update()
                state["loss_scale"] = scaler.state_dict()
                optimizer.zero_grad(set_to_none=True)
                if scaler.is_enabled() and math.isfinite(loss):  # fp16 overflow: retry at the lower scale
                    state["overflow_steps"] += 1
                    continue
                state["bad_steps"] += 1
                log.message(f"step {state['step'] + 1}: loss {loss} / grad norm {grad_norm}: skipped")
                if state["bad_steps"] > config.train.max_bad_steps:
                    _save(run_dir, model, optimizer, scheduler, batches, state, config, reselector, routers)
                    raise UsafError(
                        f"{state['bad_steps']} steps had NaN/Inf loss or gradients (limit train.max_bad_steps="
                        f"{config.train.max_bad_steps}); stopped with a checkpoint. Lower optim.lr, check the "
                        "data, or use train.precision=bf16 instead of fp16."
                    )
                continue
            if not routers.training_routers(state["step"]):
                for param in routers.router_params:
                    param.grad = None  # AdamW skips parameters without gradients
            scaler.step(optimizer)
            scaler.update()
            state["loss_scale"] = scaler.state_dict()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            reselected = reselector.after_step(state["step"], optimizer) if reselector is not None else None
            try:
                router_record, router_show, router_message = routers.after_step(
                    state["step"], config.schedule.grad_accum
                )
            except RouterCollapse as err:
                path = _save(
                    run_dir, model, optimizer, scheduler, batches, state, config, reselector, routers
                )
                log.message(f"{err}\ncheckpoint: {path}")
                return {"stopped": True, "step": state["step"], "reason": "router collapse"}
            if router_message:
                log.message(router_message)
            state["tokens"] += tokens
            elapsed = time.perf_counter() - started
            state["train_seconds"] += elapsed
            if state["first_loss"] is None:
                state["first_loss"] = loss
            state["last_loss"] = loss

            record = {
                "loss": loss,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": grad_norm,
                "tokens": state["tokens"],
                "tokens_per_s": tokens / elapsed,
                "peak_memory_mb": runtime.peak_memory_bytes(device) / 2**20,
                # host -> device bytes of expert data this step (0: resident on the device)
                "streamed_bytes": streamed_bytes(model) - streamed_before,
                "skipped_steps": state["bad_steps"],
                **({"loss_scale": scaler.get_scale()} if scaler.is_enabled() else {}),
                **(reselected or {}),
                **router_record,
            }
            every_eval = config.log.eval_every_steps
            if eval_data is not None and every_eval and state["step"] % every_eval == 0:
                record.update(
                    {f"eval/{k}": v for k, v in _evaluate(model, eval_data, config, device, autocast).items()}
                )
            every_log = config.log.every_steps  # 0: no step rows; evaluations are still written
            if (every_log and state["step"] % every_log == 0) or any(k.startswith("eval/") for k in record):
                log.log(
                    state["step"],
                    record,
                    {
                        "loss": f"{loss:.4f}",
                        "lr": f"{record['lr']:.2e}",
                        "tok/s": f"{record['tokens_per_s']:.0f}",
                        "mem": f"{record['peak_memory_mb']:.0f}MB",
                        **router_show,
                    },
                )
            log.advance()
            every_save = config.checkpoint.every_steps  # 0: only the final (and a signal's) checkpoint
            if every_save and state["step"] % every_save == 0:
                _save(run_dir, model, optimizer, scheduler, batches, state, config, reselector, routers)
        if stop.requested:
            path = _save(run_dir, model, optimizer, scheduler, batches, state, config, reselector, routers)
            log.message(
                f"stopped at step {state['step']} ({stop.signal_name}); checkpoint {path}. "
                f"Resume with: usaf train --resume {run_dir}"
            )
            return {"stopped": True, "step": state["step"], "signal": stop.signal_number}
    finally:
        stop.restore()
        log.close()

    eval_after = _evaluate(model, eval_data, config, device, autocast) if eval_data is not None else None
    _save(run_dir, model, optimizer, scheduler, batches, state, config, reselector, routers)
    write_router_load(run_dir, *routers.load_before_after())
    summary = _summary(state, eval_after, summary_entries, data_stats, prefix_cache)
    atomic_json(run_dir / "summary.json", summary)
    return summary


# ----------------------------------------------------------------------------------------------------------
# the steps above, in order
# ----------------------------------------------------------------------------------------------------------


def _prepare_run_dir(config: RunConfig, run_dir: Path, resume: bool) -> tuple[RunConfig, list[str]]:
    """The run's config, and (resuming) the changes it makes to the saved one; a new run's folder is marked."""
    saved_config = run_dir / CONFIG_FILE
    if resume:
        if checkpoint.latest(run_dir) is None:
            raise UsafError(
                f"--resume {run_dir}: the run has no finished checkpoint to resume from; start it again with "
                f"--out {run_dir}."
            )
        original = absolute_paths(RunConfig.load(str(saved_config)))
        return config, _check_resumable(original, config)
    # the marker first: from here on the folder is usaf's, whatever else fails
    atomic_json(run_dir / RUN_MARKER, {"usaf_version": __version__})
    atomic_file(saved_config, lambda tmp: tmp.write_text(config.to_yaml()))
    return config, []


# ----------------------------------------------------------------------------------------------------------
# the run folder: whose it is, and who writes it
# ----------------------------------------------------------------------------------------------------------

RUN_MARKER = ".usaf-run"  # written first by every new run: the folder (and its config.yaml) is usaf's
LOCK_FILE = ".usaf-lock"
# what a run writes at the top of its folder: removed when a start fails before its first checkpoint
RUN_FILES = (
    RUN_MARKER,
    CONFIG_FILE,
    "selection.safetensors",
    "selection.json",
    "base.json",
    "metrics.jsonl",
    "tensorboard",
    "prefix_cache",
    "checkpoints",
    "summary.json",
    "router_load.json",
    "report.png",
    "router_load.png",
)


def absolute_paths(config: RunConfig) -> RunConfig:
    """A copy of `config` with its local paths absolute (model.path unless a hub id, data files, select.file)."""
    config = copy.deepcopy(config)
    if config.model.path and _is_local_path(config.model.path):
        config.model.path = os.path.abspath(os.path.expanduser(config.model.path))
    config.data.train = [os.path.abspath(os.path.expanduser(str(f))) for f in config.data.train]
    config.data.eval = [os.path.abspath(os.path.expanduser(str(f))) for f in config.data.eval]
    if config.select.file:
        config.select.file = os.path.abspath(os.path.expanduser(config.select.file))
    return config


def _is_local_path(path: str) -> bool:
    """Anything but a hub id: an existing path, or a name not of the hub's `org/name` form."""
    return Path(path).expanduser().exists() or not (
        path.count("/") == 1 and not path.startswith((".", "/", "~"))
    )


def _check_run_paths(config: RunConfig, run_dir: Path) -> None:
    """A resume whose base or data is no longer where the run's config.yaml says: which path, and how to go on."""
    missing = []
    if _is_local_path(config.model.path) and not Path(config.model.path).is_dir():
        missing.append(("model.path", config.model.path, "--model NEW_DIR"))
    for key, files, flag in (
        ("data.train", config.data.train, "--data"),
        ("data.eval", config.data.eval, None),
    ):
        for file in files:
            if not Path(file).exists():
                missing.append((key, file, f"{flag} NEW_FILES" if flag else f"--set {key}=[NEW_FILES]"))
                break
    if missing:
        key, path, fix = missing[0]
        raise UsafError(
            f"--resume {run_dir}: {key} {path} does not exist (has it moved?); give its new place with {fix}."
        )


def _check_moved_base(run_dir: Path, model_dir: str) -> None:
    """A resume from a base at a new place: it must be the base the run recorded (what base.json holds: the sha256
    of the tensors that can hold trained entries, cheap facts of the rest)."""
    from .export import RUN_BASE_FILE, base_difference, read_run_base_record

    recorded = read_run_base_record(run_dir)
    if recorded is None:
        return  # nothing recorded: the checkpoint's base values are still compared on restore
    differs = base_difference(recorded, model_dir)
    if differs is not None:
        raise UsafError(
            f"--resume {run_dir}: the model at {model_dir} is not the base the run started from ({differs}, "
            f"against {run_dir / RUN_BASE_FILE}); give the folder the run was trained on."
        )


def _check_resume_folder(run_dir: Path) -> None:
    if not (run_dir / CONFIG_FILE).is_file():
        raise UsafError(f"--resume {run_dir}: no {CONFIG_FILE} there; is it a usaf run directory?")


def _check_new_run(config: RunConfig, run_dir: Path, force: bool) -> str:
    """What `run_dir` is for a new run: "new", "empty", "dead start" (usaf's, without a checkpoint: a start
    that was killed; only under the lock is it known to be dead), or "forced"; refuses anything else."""
    if not config.data.train:
        raise UsafError("no training data: give --data FILE (or data.train in the config file).")
    if not config.model.path:
        raise UsafError("no model: give --model DIR (or model.path in the config file).")
    if not run_dir.exists():
        return "new"
    if not run_dir.is_dir():
        raise UsafError(f"--out {run_dir} is a file, not a folder; choose another --out.")
    if checkpoint.latest(run_dir) is not None:
        raise UsafError(f"{run_dir} already holds a run; resume it with --resume or choose another --out.")
    # usaf's own temporaries of its run files (a start in its first instant, or one killed then) are not the
    # user's files: such a folder is a start's, and the lock then says whether it is alive
    temporaries = tuple(f".{name}.usaf-tmp-" for name in RUN_FILES)
    entries = sorted(e for e in set(os.listdir(run_dir)) - {LOCK_FILE} if not e.startswith(temporaries))
    if not entries:
        return "empty"
    if RUN_MARKER in entries:
        return "dead start"
    if force:
        return "forced"
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    raise UsafError(
        f"--out {run_dir} is not empty and not a usaf run (it holds {shown}); choose a new or empty folder, or "
        f"give --force to write the run into it (files named like usaf's, e.g. {CONFIG_FILE}, are replaced)."
    )


def _remove_run_files(run_dir: Path, keep: set[str]) -> None:
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
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise UsafError(
                f"cannot write into {self.run_dir}: {err.strerror}; choose another --out."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsafError(
                f"{self.run_dir} is in use by another usaf train (process {holder}); wait for it to end, or "
                "choose another --out."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # closing releases the lock; the file stays (removing it would race a new locker)


def _finished_run(run_dir: Path, config: RunConfig) -> dict | None:
    """The saved summary (marked `already_finished`) when the run being resumed has reached max_steps and
    written its summary; None when there is training (or the summary) left to do."""
    step = checkpoint.step_of(checkpoint.latest(run_dir))
    max_steps = config.schedule.max_steps
    summary_path = run_dir / "summary.json"
    if step >= max_steps and summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, ValueError) as err:
            raise UsafError(
                f"--resume {run_dir}: the run is finished but {summary_path} is unreadable ({err}); delete it "
                "and resume again to rewrite it."
            ) from None
        return {**summary, "already_finished": True, "step": step}
    if step > max_steps:
        raise UsafError(
            f"--resume {run_dir}: the run is at step {step}, beyond schedule.max_steps={max_steps}; give "
            f"--set schedule.max_steps={step} or more."
        )
    return None


def _check_resumable(original: RunConfig, now: RunConfig) -> list[str]:
    """The changes a resume makes ("optim.lr 0.01 -> 0.02"); refuses any outside RESUME_MAY_CHANGE."""
    old, new = original.to_dict(), now.to_dict()
    changes = []
    for section, values in old.items():
        for name, a in values.items():
            b, key = new[section][name], f"{section}.{name}"
            if a == b:
                continue
            if section not in RESUME_MAY_CHANGE and key not in RESUME_MAY_CHANGE:
                allowed = ", ".join(k if "." in k else f"{k}.*" for k in RESUME_MAY_CHANGE)
                raise UsafError(
                    f"cannot resume: '{key}' differs from the original run ({a!r} there, {b!r} now). Resume with "
                    f"the original value; a resume may change only {allowed}."
                )
            changes.append(f"{key} {a!r} -> {b!r}")
    return changes


def _apply_resumed_schedule(optimizer, scheduler, config: RunConfig, saved: dict) -> None:
    """A resume with a new peak lr or length: the schedule's base rates take the new peak and the current rates
    follow the new curve at once (the checkpoint's param groups hold the old ones)."""
    ratio = config.optim.lr / saved["optim"]["lr"]
    if ratio == 1 and config.schedule.max_steps == saved["schedule"]["max_steps"]:
        return  # unchanged: the restored rates stand, bit for bit
    scheduler.base_lrs = [base * ratio for base in scheduler.base_lrs]
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _load_data(config: RunConfig, tokenizer, pack: bool):
    return load_dataset(
        config.data.train,
        tokenizer,
        config.data.max_seq_len,
        pack=pack,
        skip_bad_records=config.data.skip_bad_records,
        eval_paths=config.data.eval or None,
        eval_fraction=config.data.eval_fraction,
        seed=config.train.seed,
    )


def load_tokenizer(path: str):
    """The model's tokenizer; for a model folder without tokenizer files, a NoTokenizer (pre-tokenized data
    only, ids checked against config.vocab_size) instead of transformers' empty one."""
    check_model_path(path)
    if (Path(path).expanduser() / "config.json").is_file():
        check_model_files(path)  # an unreadable config.json is named as such, not as a tokenizer that failed
    if Path(path).expanduser().is_dir() and not has_tokenizer_files(Path(path).expanduser()):
        return model_vocabulary(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UsafError(f"cannot load the tokenizer of {path!r}: {err}") from None


def check_model_path(path: str) -> None:
    """A path that is not a directory is taken for a hub id only when it looks like one (`org/name`); anything
    else (`./run`, `models/x/y`, a typo) is a missing directory, said plainly instead of as a failed download."""
    p = Path(path).expanduser()
    if p.is_dir():
        return
    if _is_local_path(path):
        raise UsafError(
            f"{path}: no such model directory (expected a folder with config.json and weights, or a "
            "hub id like Qwen/Qwen3-30B-A3B)."
        )
    _check_hub_reachable(path)


def _check_hub_reachable(repo_id: str, timeout_s: float = 3.0) -> None:
    """A hub id that is not in the local cache needs the hub: say so at once when it cannot be reached, instead
    of after the minute of retries transformers spends (a cached model loads offline as usual)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise UsafError(
            f"{repo_id}: not in the local hub cache and HF_HUB_OFFLINE is set; download it first "
            f"(huggingface-cli download {repo_id}) or pass a local folder."
        )
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # through a proxy a direct connection says nothing: transformers finds out
    host = urlparse(os.environ.get("HF_ENDPOINT", constants.ENDPOINT)).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError as err:
        raise UsafError(
            f"{repo_id}: not in the local hub cache and {host} cannot be reached ({err.strerror or err}); "
            "connect to the network, download it elsewhere and copy the folder, or pass a local folder."
        ) from None


def load_model(
    config: RunConfig,
    device: torch.device,
    dtype: torch.dtype,
    calibration_batches=None,
    selection_file=None,
    recompute: bool | None = None,
):
    """The base model (from a directory or the hub), prepared for sparse training (with the selection in
    `selection_file` instead of choosing one, when given). `recompute`: per-layer recomputation, switched on
    before calibration so that calibration recomputes as training does (None: `train.recompute`, auto resolved by
    the planner)."""
    path = config.model.path
    if recompute is None:
        recompute = choose_recompute(config, device, dtype).recompute
    if selection_file is not None:
        config = copy.deepcopy(config)
        config.select.strategy, config.select.file = "file", str(selection_file)
    if config.model.quant != "none":
        from .load import load_for_training

        model = load_for_training(
            config, device, dtype, calibration_batches=calibration_batches, recompute=recompute
        )
    else:
        check_model_files(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError) as err:
            raise UsafError(f"cannot load the model at {path!r}: {first_line(err)}") from None
        model.to(device)
        if recompute:
            enable_recomputation(model)
        prepare_model(model, config.select, calibration_batches=calibration_batches)
    return model


@torch.no_grad()
def packed_documents_are_isolated(model, device) -> bool:
    """Whether the model keeps packed documents apart: the second of two packed documents must give the same
    logits as alone. Six tokens through the model, once per run."""
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.arange(1, 7, device=device).remainder(vocab).unsqueeze(0)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    packed = body(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[:, 3:]
    alone = body(input_ids=ids[:, 3:], position_ids=positions[:, 3:], use_cache=False).last_hidden_state
    return bool(torch.allclose(packed.float(), alone.float(), atol=1e-3, rtol=1e-3))


def selection_summary(model, config: RunConfig) -> dict:
    from .select import resolved_selection

    calibration = getattr(model, "usaf_calibration", None)
    return {
        "strategy": config.select.strategy,
        "selection": resolved_selection(config.select, has_data=True),
        "granularity": config.select.granularity,
        "entries": {key: int(c.indices.numel()) for key, c in current_selection(model).items()},
        "calibration": calibration.summary() if calibration is not None else None,
    }


def _truncate_metrics(path: Path, step: int) -> None:
    """A resume continues the log from its checkpoint: rows a killed process wrote after it (steps the resume
    trains again) are dropped, and so is a torn last line."""
    if not path.exists():
        return
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            keep = int(row["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_file(path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8"))


def _check_positions(model_config, config: RunConfig, *datasets) -> None:
    """Refuse documents longer than the model's max_position_embeddings (positions it never saw in training);
    a larger data.max_seq_len alone is harmless, since packed documents restart their positions at 0."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0 or config.data.max_seq_len <= limit:
        return
    longest = max(int(d.position_ids.max()) + 1 for d in datasets if d is not None and len(d))
    if longest > limit:
        raise UsafError(
            f"data.max_seq_len={config.data.max_seq_len} is above the model's max_position_embeddings={limit} "
            f"(config.json), and documents reach {longest} tokens, positions the model has never seen; set "
            f"data.max_seq_len={limit} or less (longer records are truncated and counted)."
        )


def trained_parameters(model: torch.nn.Module) -> list[str]:
    """The model parameters that can hold trained entries in this run (whatever a reselection moves): the
    tensors with a selection, and the parameters trained whole (routers)."""
    return [
        *checkpoint.selection_layout(model),
        *(name for name, p in model.named_parameters() if p.requires_grad and ".usaf." not in name),
    ]


def _record_base(config: RunConfig, run_dir: Path, trained: list[str]) -> str | None:
    """RUN/base.json: the identity of the base, which `usaf export` checks a base against (as `usaf apply` checks
    a delta's): the sha256 of the checkpoint tensors behind `trained` (the rest of the base is not read whole),
    cheap facts of the others. A note when the base is not a local folder, None when recorded."""
    from .export import RUN_BASE_FILE, STORE_FILE, base_record

    model_dir = Path(config.model.path).expanduser()
    if not ((model_dir / "config.json").is_file() or (model_dir / STORE_FILE).is_file()):
        return f"the base {config.model.path} is not a local folder: usaf export cannot check a --base against it"
    try:
        record = base_record(model_dir, trained)
    except (UsafError, OSError, KeyError, ValueError) as err:  # e.g. a store whose source has moved
        return f"the base's identity was not recorded ({first_line(err)}): usaf export cannot check a --base"
    atomic_json(run_dir / RUN_BASE_FILE, record)
    return None


def _prefix_cache(model, config: RunConfig, run_dir: Path) -> FrozenPrefixCache | None:
    if config.train.prefix_cache == "off":
        return None
    trained = config.select.layers
    lowest = min(trained) if trained else 0
    if lowest < 1:
        raise UsafError(
            "train.prefix_cache needs select.layers to leave the lowest layers frozen (e.g. [2, 3])."
        )
    for layer in find_moe_layers(model):
        if layer.layer_index < lowest and any(p.requires_grad for p in layer.router.parameters()):
            raise UsafError("train.prefix_cache: a router below the lowest trained layer is trainable.")
    return FrozenPrefixCache(model, lowest, config.train.prefix_cache, run_dir / "prefix_cache")


def restore_trainable(model: torch.nn.Module, saved: dict[str, torch.Tensor], where: Path) -> None:
    """Load trained values, routers and the selection from a checkpoint; refuse a different base model."""
    for path, state in sparse_modules(model):
        for name, entries in state.items():
            prefix = f"{path}.usaf.{name}."
            selection = saved.get(prefix + entries.selection_name)
            if selection is None:
                raise UsafError(
                    f"checkpoint {where} has no selection for {path}.{name}: different model or config."
                )
            current = getattr(entries, entries.selection_name)
            saved_base = saved.get(prefix + "base_values")
            if entries.keeps_base != (saved_base is not None):
                raise UsafError(
                    f"checkpoint {where} keeps the base values of {path}.{name} differently from this run (a "
                    "quantized base against an unquantized one): resume with the run's own configuration."
                )
            if entries.keeps_base:  # a different base shows in the original weights at the shared entries
                same = torch.isin(selection, current.cpu())
                base_now = entries.base_values.cpu()[torch.isin(current.cpu(), selection)]
                if not torch.equal(base_now, saved_base[same].to(base_now.dtype)):
                    raise UsafError(
                        f"checkpoint {where} was trained on a different base model: the original weights of "
                        f"{path}.{name} differ. Resume with the model the run started from."
                    )
            if not torch.equal(selection, current.cpu()):
                entries.set_selection(selection, saved_base, saved[prefix + "values"])
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if param.requires_grad:
                if name not in saved:
                    raise UsafError(
                        f"checkpoint {where} lacks '{name}': it was made with another configuration."
                    )
                param.copy_(saved[name])


def build_optimizer(model: torch.nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    routers = {id(p) for p in _router_params(model)}
    values = [p for p in model.parameters() if p.requires_grad and id(p) not in routers]
    compact = config.optim.moments == "bf16"
    groups = [
        {
            "params": values,
            "lr": config.optim.lr,
            "weight_decay": config.optim.weight_decay,
            "compact": compact,
        }
    ]
    router_list = [p for p in model.parameters() if p.requires_grad and id(p) in routers]
    if router_list:
        groups.append(
            {"params": router_list, "lr": config.optim.lr * config.router.lr_multiplier, "weight_decay": 0.0}
        )
    kwargs = {"betas": (config.optim.beta1, config.optim.beta2), "eps": config.optim.eps}
    if config.optim.eight_bit:
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(groups, **kwargs)
        except (ImportError, RuntimeError) as err:
            raise UsafError(
                f"optim.eight_bit needs bitsandbytes with kernels for this device: {err}"
            ) from None
    return CompactAdamW(groups, seed=config.train.seed, **kwargs)


def build_scheduler(optimizer, config: RunConfig):
    warmup, total = config.schedule.warmup_steps, max(1, config.schedule.max_steps)
    floor = config.schedule.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _router_params(model) -> list[torch.nn.Parameter]:
    return [
        p
        for layer in find_moe_layers(model)
        if layer.router is not None
        for p in layer.router.parameters()
        if p.requires_grad
    ]


def _accumulate_gradients(
    model, batches, config, device, autocast, scaler, prefix_cache, reselector, routers, step
) -> tuple[float, int]:
    """Forward and backward over grad_accum micro-batches; the loss is the mean over all supervised tokens."""
    micro = []
    for _ in range(config.schedule.grad_accum):
        micro.append((next(batches), list(batches.last_indices)))
    supervised = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b, _ in micro)
    total, tokens = 0.0, 0
    for batch, rows in micro:
        batch = {k: v.to(device) for k, v in batch.items()}
        if prefix_cache is not None:
            lengths = [
                int((r != IGNORE_INDEX).nonzero().max()) + 1 if (r != IGNORE_INDEX).any() else r.numel()
                for r in batch["labels"]
            ]
            prefix_cache.begin_batch(rows, lengths, batch["input_ids"])
        if reselector is not None:
            reselector.set_observing(True)
        with autocast, routers.capture():
            loss_sum = causal_lm_loss(
                model,
                batch["input_ids"],
                batch["labels"],
                position_ids=batch["position_ids"],
                chunk_tokens=config.train.logits_chunk_tokens,
                reduction="sum",
            )
            aux = routers.aux_loss(step)  # balancing + z-loss from the raw router logits of this forward
        if reselector is not None:
            reselector.set_observing(False)  # recomputation in backward re-runs forwards: count them once
        scaler.scale(loss_sum / max(supervised, 1) + aux / len(micro)).backward()
        routers.after_micro_batch()
        if prefix_cache is not None:
            prefix_cache.end_batch()
        total += float(loss_sum.detach())
        tokens += batch["input_ids"].numel()
    return total / max(supervised, 1), tokens


def _clip(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    if not params:
        return 0.0
    if max_norm and max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))


def _evaluate(model, dataset, config: RunConfig, device, autocast) -> dict:
    return evaluate(
        model,
        dataset,
        config.data.batch_size,
        device,
        autocast,
        config.data.eval_batches,
        config.train.logits_chunk_tokens,
    )


def _save(
    run_dir, model, optimizer, scheduler, batches, state, config, reselector=None, routers=None
) -> Path:
    # the forward writes trained values into resident weights; the checkpoint needs only the values
    return checkpoint.save(
        run_dir,
        state["step"],
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state={
            **state,
            "data": batches.state_dict(),
            "rng": runtime.rng_state(),
            "config": config.to_dict(),
            "router": routers.state_dict() if routers is not None else None,
        },
        keep_last=config.checkpoint.keep_last,
        extra_tensors={
            **(reselector.state_dict() if reselector is not None else {}),
            **(routers.tensor_state() if routers is not None else {}),
        },
    )


def _summary(state, eval_after, entries, data_stats, prefix_cache) -> dict:
    before = state.get("eval_before") or {}
    return {
        "steps": state["step"],
        "tokens": state["tokens"],
        "train_seconds": round(state["train_seconds"], 2),
        "first_loss": state.get("first_loss"),
        "last_loss": state.get("last_loss"),
        "eval_loss_before": before.get("loss"),
        "eval_loss_after": (eval_after or {}).get("loss"),
        "eval_perplexity_before": before.get("perplexity"),
        "eval_perplexity_after": (eval_after or {}).get("perplexity"),
        "trained_expert_entries": entries["expert_entries"],
        "trained_router_weights": entries["routers"],
        "trained_entries_beyond_experts": _target_entries(entries),
        "skipped_steps": state["bad_steps"],
        "fp16_overflow_steps": state["overflow_steps"],
        "prefix_cache_hits": prefix_cache.hits if prefix_cache else 0,
        "data": data_stats.summary(),
    }


def _target_entries(entries: dict) -> dict[str, int]:
    """{"attention_entries": n, ...} of `trainable_summary`: the entries of targets beyond the experts."""
    return {k: v for k, v in entries.items() if k.endswith("_entries") and k != "expert_entries"}


def stopped_exit_code(summary: dict) -> int | None:
    """The exit status of a run that stopped before its end (128 + the signal; 1 for a router-collapse stop), so
    that `usaf train ... && usaf export ...` does not go on with a half-trained run; None when it finished."""
    if not summary.get("stopped"):
        return None
    return 128 + summary["signal"] if summary.get("signal") else 1


def format_summary(summary: dict) -> str:
    rows = [
        ("steps", summary["steps"]),
        ("tokens", f"{summary['tokens']:,}"),
        ("time", f"{summary['train_seconds']:.1f} s"),
        ("train loss first → last", _pair(summary["first_loss"], summary["last_loss"])),
        ("eval loss before → after", _pair(summary["eval_loss_before"], summary["eval_loss_after"])),
        (
            "eval perplexity before → after",
            _pair(summary["eval_perplexity_before"], summary["eval_perplexity_after"]),
        ),
        ("trained expert entries", f"{summary['trained_expert_entries']:,}"),
        *[
            (f"trained {target.replace('_', ' ')}", f"{n:,}")
            for target, n in (summary.get("trained_entries_beyond_experts") or {}).items()
        ],
        ("trained router weights", f"{summary['trained_router_weights']:,}"),
        ("skipped steps", summary["skipped_steps"]),
    ]
    if summary.get("fp16_overflow_steps"):
        rows.append(("fp16 overflow steps (loss scale lowered)", summary["fp16_overflow_steps"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _pair(a, b) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    return f"{fmt(a)} → {fmt(b)}"


class _StopRequest:
    """SIGINT/SIGTERM ask the loop to checkpoint and stop after the current step."""

    def __init__(self):
        self.requested, self.signal_name, self.signal_number = False, "", 0
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: no handler
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested, self.signal_name, self.signal_number = True, signal.Signals(signum).name, signum

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
