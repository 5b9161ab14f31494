"""`usaf train`: one run, top to bottom.

set up the run dir -> load and prepare the model -> load the data -> optimizer and schedule -> (resume) ->
evaluate -> loop { micro-batches, backward, skip bad steps, clip, step, log, checkpoint } -> evaluate -> summary.

The loop names no optional part: reselection, the prefix cache, the routers, evaluation, the best checkpoint and
early stopping, stop requests, the metrics log and checkpoints are `usaf.train.parts`, called at their hooks, each
deciding its own cadence and doing its own sync across ranks (as do the gradient reducer and StepShare): nothing
below calls usaf.train.distributed but joining the job. What the run minimizes is its objective's
(`usaf.train.objectives`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from pathlib import Path

import torch

from usaf.config import RunConfig
from usaf.data.load import fit_context
from usaf.data.stream import batches_for
from usaf.engine import expert_parallel
from usaf.engine.state import streamed_bytes
from usaf.errors import UsafError
from usaf.files import CONFIG_FILE, SELECTION_FILE
from usaf.prepare import trainable_summary
from usaf.train import (
    checkpoint,
    distributed,
    grpo,  # noqa: F401  (registers train.objective=grpo and its rollouts part)
    runtime,
)
from usaf.train.best import check_evaluations
from usaf.train.checkpoint import Checkpointer, restore_trainable
from usaf.train.distributed import StepShare, gradient_reducer
from usaf.train.evaluate import Evaluator
from usaf.train.memory_plan import effective_settings, resolve_auto
from usaf.train.metrics import eval_record, open_metrics
from usaf.train.objectives import OBJECTIVES  # with the built-in objectives registered
from usaf.train.optim import (
    apply_resumed_schedule,
    build_optimizer,
    build_scheduler,
    clip_gradients,
    schedule_notes,
    with_peak_lr,
)
from usaf.train.parts import LOOP_PARTS, Checkpoint, Log, StepDone, Stop, StopRun
from usaf.train.recompute import choose_recompute
from usaf.train.run_dir import (
    NewRunFolder,
    RunLock,
    check_moved_base,
    check_new_run,
    check_resume_folder,
    check_run_paths,
    finished_run,
    open_run_dir,
    record_start,
    remove_run_files,
    write_summary,
)
from usaf.train.session import (
    absolute_paths,
    calibration_line,
    check_finite_base,
    check_trainable_entries,
    open_session,
    run_data,
)
from usaf.train.shard_dense import choose_shard_dense, frozen_parameter_bytes, shard_dense
from usaf.train.state import TrainState, target_entries
from usaf.train.stop import StopRequest
from usaf.train.trackers import check_report_to, report_to
from usaf.version import __version__


def train(config: RunConfig, run_dir: str | Path, resume: bool = False, force: bool = False) -> dict:
    """Run (or, with `resume`, continue) a training into `run_dir`, holding the folder's lock throughout.
    `force`: start a new run in an existing folder that is not a usaf run."""
    run_dir = Path(run_dir)
    config.check()  # a config built or changed in Python gets the same range checks as a file
    check_report_to(report_to(config.log))  # a tracker that is not installed is said now, not after loading
    OBJECTIVES[config.train.objective].check(config.train)  # what it cannot train with, before anything loads
    check_evaluations(config)  # keep_best and early stopping rank evaluations: there must be some
    config = absolute_paths(config)  # the run's config.yaml must not depend on the working directory
    # [usaf.distributed] join torchrun's job; a rank > 0 neither checks, locks nor cleans the folder (rank 0 does)
    if distributed.init(config) and not distributed.is_main():
        return _train(config, run_dir, resume)
    if resume:
        check_resume_folder(run_dir)
        check_run_paths(config, run_dir)
    else:
        check_new_run(config, run_dir, force)  # before anything is written, lock file included
    with RunLock(run_dir) as lock:
        # again under the lock (another start may have got here first); a dead start is cleared
        if not resume and check_new_run(config, run_dir, force) is NewRunFolder.DEAD_START:
            remove_run_files(run_dir, keep=set())
        present = set(os.listdir(run_dir))
        progress = _Progress()
        try:
            return _train(config, run_dir, resume, progress)
        except BaseException:
            # a start that failed before its first step leaves nothing that looks like a run; once a step is
            # taken its metrics and data stay (a later start into the folder is told it holds a dead start)
            if not resume and checkpoint.latest(run_dir) is None and not progress.stepped:
                with contextlib.suppress(OSError):  # a second error must not hide the first
                    if lock.made_folder:
                        shutil.rmtree(run_dir)
                    else:
                        remove_run_files(run_dir, keep=present)
            raise


class _Progress:
    """Whether the run took a step (set by the TrainingRun): what a failed start may no longer remove."""

    stepped = False


def resolved_run(config: RunConfig, resume: bool = False) -> tuple[RunConfig, list[str]]:
    """The run's settings as its config.yaml records them, and the lines saying what its autos chose: the data's
    windows fit to the model's context, then (a new run; a resume takes the recorded ones) the memory plan's autos
    on this rank's device (`resolve_auto`: what `usaf plan` prints for the same run) and the objective's rate."""
    # the data's windows fit the model's context before the memory plan sizes them and config.yaml records them
    data, context_line = fit_context(config.data, config.model.path)
    config = config.replace({"data.max_seq_len": data.max_seq_len})
    lines = [context_line] if context_line else []
    if not resume:  # auto becomes a number before config.yaml records it
        device = distributed.local_device(runtime.resolve_device(config.model.device))
        config, chosen = resolve_auto(config, device, runtime.resolve_dtype(config.model.dtype, device))
        config = with_peak_lr(config)
        lines += chosen
    return config, lines


def _train(config: RunConfig, run_dir: Path, resume: bool, progress: _Progress | None = None) -> dict:
    config, auto_lines = resolved_run(config, resume)
    config, changes = open_run_dir(config, run_dir, resume)
    if resume:
        if (finished := finished_run(run_dir, config)) is not None:
            return finished  # nothing to do, and nothing written: the run's files stay as they are
        if any(c.startswith("model.path ") for c in changes):
            check_moved_base(run_dir, config.model.path)
    run = TrainingRun(config, run_dir, resume, changes, progress or _Progress(), auto_lines)
    run.setup()
    return run.train()


class TrainingRun:
    """One run in its folder (new, or resumed from its latest checkpoint): built cheaply from its settings,
    loaded by `setup()` (writing nothing), trained by `train()`, which records a new run's start in the folder and
    reads top to bottom. Each step is `forward_backward`, `optimizer_step` (with its skip policy) and `after_step`;
    everything else a step does is a part's (`usaf.train.parts`: reselection, prefix cache, routers, evaluation,
    stop requests, the metrics log, checkpoints), called at its hooks."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        resume: bool,
        changes: list[str],
        progress: _Progress,
        auto_lines: list[str] | None = None,  # what the memory plan's autos chose, for the first lines
    ):
        self.given, self.run_dir, self.resume, self.changes, self.progress = (
            config,
            run_dir,
            resume,
            changes,
            progress,
        )
        self.auto_lines, self.notes = auto_lines or [], []

    def setup(self) -> None:
        """Seed, load the model and the data, resolve the run's length once into the effective config, then build
        the parts and (resuming) put the checkpoint back: the trained values and the parts' state first, since
        the optimizer is built on what they leave trainable."""
        given = self.given
        device = distributed.local_device(runtime.resolve_device(given.model.device))  # this rank's device
        dtype = runtime.resolve_dtype(given.model.dtype, device)
        # the settings as given (a note may turn packing off for this process only): what config.yaml states and
        # every checkpoint records, for a resume to compare with
        self.run_config, run_yaml = given.to_dict(), given.to_yaml()
        runtime.seed_everything(given.train.seed)
        # decided before loading: calibration recomputes as training does
        self.recompute = choose_recompute(given, device, dtype)
        self.session = session = open_session(
            given,
            run_data,
            # a resumed run starts from the selection it saved (the checkpoint then restores the current one)
            selection_file=self.run_dir / SELECTION_FILE if self.resume else None,
            recompute=self.recompute.recompute,
        )
        self.model, self.device, self.dtype = session.model, session.device, session.dtype
        check_trainable_entries(self.model, session.config)
        self.data_stats, self.notes = session.data_stats, self.notes + session.notes
        self.batches = batches_for(session.train_data, session.config.data.batch_size, seed=given.train.seed)
        self.share = StepShare(self.batches, session.config.schedule.grad_accum)
        self.checkpointer = Checkpointer(self.run_dir, session.config.checkpoint, self.checkpoint_parts)
        self.config = config = self._resolve_length(session.config)  # not changed after this
        self.objective = OBJECTIVES[config.train.objective]
        # gradients summed across ranks, overlapped with the last backward of each step
        self.reducer = gradient_reducer(self.model)
        self.autocast = runtime.autocast(config.train.precision, device, self.dtype)
        self.scaler = runtime.loss_scaler(config.train.precision, device, self.dtype)
        self.evaluator = Evaluator(self.model, session.eval_data, config, self.device, self.autocast)
        self.parts = [part for _, kind in LOOP_PARTS.items() if (part := kind.build(self)) is not None]
        restored = self.restore_values(*self.checkpointer.load_latest()) if self.resume else None
        # after the selection and the restored values, which read and write the whole weights
        self.shard_dense = choose_shard_dense(config, device, dtype)
        if self.shard_dense.shard:
            shard_dense(self.model)
        self.optimizer = build_optimizer(self.model, config)
        self.scheduler = build_scheduler(self.optimizer, config)
        self.notes += schedule_notes(config)
        self.state = TrainState()
        if restored is not None:
            self._resume_from(restored, run_yaml)
        self.entries = trainable_summary(self.model)

    def _resume_from(self, restored, run_yaml: str) -> None:
        """The loop's state from the latest checkpoint; config.yaml states the run as resumed (changes, or a --set
        that put an edit back) from the next checkpoint on, which records the same settings: the two never
        disagree for a later resume."""
        self.restore_loop(restored)
        if self.changes:
            self.notes.append("resumed with " + ", ".join(self.changes))
        if (self.run_dir / CONFIG_FILE).read_text(errors="replace") != run_yaml:
            self.checkpointer.write_with_next(self.run_dir / CONFIG_FILE, run_yaml)

    def _resolve_length(self, config: RunConfig) -> RunConfig:
        """The effective config of the run's length: schedule.epochs gives max_steps from the batches an epoch and
        the micro-batches a step (all ranks); the run's config.yaml states the steps with the next checkpoint, so
        that a resume finds the same length. `config` itself is left as it is."""
        self.length = f"{config.schedule.max_steps} steps"  # what the first line says (schedule.epochs: how)
        if not config.schedule.epochs:
            return config
        per_step = self.share.micro_batches
        steps = max(1, math.ceil(config.schedule.epochs * len(self.batches) / per_step))
        self.length = (
            f"{steps} steps (schedule.epochs={config.schedule.epochs:g}: {len(self.batches)} batches of "
            f"{config.data.batch_size} an epoch, {per_step} a step)"
        )
        if steps == config.schedule.max_steps:
            return config
        given = RunConfig.from_dict(self.run_config).replace({"schedule.max_steps": steps})
        self.run_config = given.to_dict()
        self.checkpointer.write_with_next(self.run_dir / CONFIG_FILE, given.to_yaml())
        return config.replace({"schedule.max_steps": steps})

    # ---- the run ----------------------------------------------------------------------------------------------

    def train(self) -> dict:
        if not self.resume:
            self.notes += record_start(self.run_dir, self.config, self.model)
        self.announce()
        config, state = self.config, self.state
        self.log = open_metrics(
            self.run_dir, config.log, config.schedule.max_steps, state.step, self.resume, self.run_config
        )
        stop = Stop(StopRequest(), self.run_dir)
        # the frame's parts: a stop request is seen before anything else of a step; the row is logged, then saved
        self.parts = [stop, *self.parts, Log(self.log), Checkpoint(self.checkpointer)]
        try:
            self.evaluate_before()
            self.model.train()
            ended = None
            try:
                while state.step < config.schedule.max_steps and (ended := self.ends_training()) is None:
                    self.step()
                if stop.request.requested:  # asked during the last step
                    stop.stop(state.step)
            except StopRun as stopped:
                self.log.message(stopped.message(self.checkpointer.save(state.step, force=True)))
                return stopped.summary
            stop.request.restore()  # a signal while finishing acts as it did after the loop (restoring again is harmless)
            state.stop_reason = ended
            return self.finish()  # while the log is open: the final evaluation is a row of it
        finally:
            stop.request.restore()
            self.log.close()

    def ends_training(self) -> str | None:
        """Why a part ends the training before the next step (early stopping), or None."""
        return next((reason for part in self.parts if (reason := part.ends_training()) is not None), None)

    def step(self) -> None:
        """One optimizer step and what follows it (nothing follows a skipped one)."""
        started, streamed_before = time.perf_counter(), streamed_bytes(self.model)
        loss, tokens = self.forward_backward()
        grad_norm = self.optimizer_step(loss)
        if grad_norm is not None:
            self.after_step(loss, tokens, grad_norm, started, streamed_before)

    def announce(self) -> None:
        """The run's first lines, flushed before the progress bar starts drawing on stderr, so that a terminal (or
        one log file for both streams) shows them whole."""
        entries = self.entries
        print(
            f"usaf {__version__}: training {entries['expert_entries']:,} expert entries"
            + "".join(f" + {n:,} {t.replace('_', ' ')}" for t, n in target_entries(entries).items())
            + f" + {entries['routers']:,} router weights on {self.device} ({self.dtype}) for "
            + self.length
            + "; "
            + self.data_stats.summary(),
            flush=True,
        )
        for line in self.auto_lines:
            print(line, flush=True)
        print(self.recompute.line, flush=True)
        print(effective_settings(self.config, self.device, self.dtype, self.recompute.recompute), flush=True)
        if self.shard_dense.line is not None:  # under torchrun
            print(self.shard_dense.line, flush=True)
        if (line := calibration_line(self.model, self.config.select)) is not None:
            print(line, flush=True)
        for note in self.notes:
            print(f"note: {note}", flush=True)

    def evaluate_before(self) -> None:
        if self.evaluator.available and self.state.eval_before is None:
            self.state.eval_before = self.evaluator.evaluate()
            self.log.log(self.state.step, eval_record(self.state.eval_before))

    def forward_backward(self) -> tuple[float, int]:
        """Forward and backward over this rank's micro-batches of the step; the loss is the mean over all
        supervised units of the step (every rank's), read from the device once."""
        step, parts, objective = self.state.step + 1, self.parts, self.objective
        for part in parts:
            part.start_step(step)
        micro = self.share.take()
        for part in parts:
            micro = part.step_batches(micro)  # e.g. GRPO: prompts become prompt + generated completion rows
        (supervised,) = self.share.total(sum(objective.supervised_units(b) for b, _ in micro))
        sums, tokens, extras = [], 0, []
        for index, (batch, rows) in enumerate(micro):
            if index == len(micro) - 1:
                self.reducer.arm()  # the last backward sends gradients as they complete
            batch = {k: v.to(self.device) for k, v in batch.items()}
            for part in parts:
                part.begin_batch(batch, rows)
            with self.autocast:
                loss_sum, extra = objective.loss_sum(self.model, batch, self.config.train)
                added = sum(part.end_forward(step) for part in parts)  # e.g. the routers' balancing loss
            if extra is not None:
                extras.append(extra)
            self.scaler.scale(loss_sum / max(supervised, 1) + added / self.share.micro_batches).backward()
            for part in parts:
                part.end_batch()
            sums.append(loss_sum.detach())
            tokens += batch["input_ids"].numel()
        self.reducer.finish()
        for part in parts:
            part.after_backward()
        # one read from the device, summed in float64 on the host (MPS has no float64)
        total = sum(torch.stack(sums).cpu().tolist())
        total, tokens = self.share.total(total, tokens)
        self.objective_metrics = objective.step_metrics(extras, supervised, self.share.total)
        return total / max(supervised, 1), tokens

    def optimizer_step(self, loss: float) -> float | None:
        """Unscale, clip and step; the gradient norm, or None for a skipped step: a NaN/Inf loss or gradient is
        counted and skipped (an fp16 overflow only lowers the loss scale and retries), and too many of them stop
        the run with a checkpoint."""
        config, state, scaler, optimizer = self.config, self.state, self.scaler, self.optimizer
        scaler.unscale_(optimizer)
        grad_norm = clip_gradients(self.model, config.optim.clip_grad_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            # a skipped step still closes the scaler's step (it lowers the fp16 loss scale on inf gradients)
            scaler.update()
            state.loss_scale = scaler.state_dict()
            optimizer.zero_grad(set_to_none=True)
            if scaler.is_enabled() and math.isfinite(loss):  # fp16 overflow: retry at the lower scale
                state.overflow_steps += 1
                return None
            if state.step == 0 and state.bad_steps == 0:
                # before any update the learning rate is not the cause: a damaged base is named, not retried
                check_finite_base(self.model, f"the loss at step 1, before any update, is {loss}")
            state.bad_steps += 1
            self.log.message(f"step {state.step + 1}: loss {loss} / grad norm {grad_norm}: skipped")
            if state.bad_steps > config.train.max_bad_steps:
                self.checkpointer.save(state.step, force=True)
                raise UsafError(
                    f"{state.bad_steps} steps had NaN/Inf loss or gradients (limit train.max_bad_steps="
                    f"{config.train.max_bad_steps}); stopped with a checkpoint. Lower optim.lr, check the data, "
                    "or use train.precision=bf16 instead of fp16."
                )
            return None
        for part in self.parts:
            part.before_update(state.step + 1)
        scaler.step(optimizer)
        scaler.update()
        state.loss_scale = scaler.state_dict()
        self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        self.progress.stepped = True
        return grad_norm

    def after_step(
        self, loss: float, tokens: int, grad_norm: float, started: float, streamed_before: int
    ) -> None:
        """The step's metrics row, then each part due at this step (reselection, router health, evaluation, the
        log, the checkpoint, in that order) adds to it or acts on it."""
        state = self.state
        elapsed = time.perf_counter() - started
        state.record_step(loss, tokens, elapsed)
        record = {
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "tokens": state.tokens,
            "tokens_per_s": tokens / elapsed,
            "peak_memory_mb": runtime.peak_memory_bytes(self.device) / 2**20,
            # host -> device bytes of expert data this step (0: resident on the device)
            "streamed_bytes": streamed_bytes(self.model) - streamed_before,
            "skipped_steps": state.bad_steps,
            **({"loss_scale": self.scaler.get_scale()} if self.scaler.is_enabled() else {}),
            **self.objective_metrics,
        }
        shown = {
            "loss": f"{loss:.4f}",
            "lr": f"{record['lr']:.2e}",
            "tok/s": f"{record['tokens_per_s']:.0f}",
            "mem": f"{record['peak_memory_mb']:.0f}MB",
        }
        done = StepDone(state.step, loss, grad_norm, self.optimizer, record, shown)
        for part in self.parts:
            if part.due(state.step):
                record.update(part.after_step(done))

    def finish(self) -> dict:
        eval_after = self.evaluator.evaluate() if self.evaluator.available else None
        if eval_after is not None:  # before the summary that marks the run finished (a resume rewrites it)
            self.log.log(self.state.step, eval_record(eval_after, final=True))
        self.checkpointer.save(self.state.step, force=True)
        for part in self.parts:
            part.finish(self.state)
        summary = self.state.summary(eval_after, self.entries, self.data_stats)
        # what each rank held and peaked at: the planner's per-rank figures
        held = {
            "peak_memory_mb": runtime.peak_memory_bytes(self.device) / 2**20,
            "frozen_expert_bytes": expert_parallel.frozen_expert_bytes(self.model),
            "frozen_parameter_bytes": frozen_parameter_bytes(self.model),
        }
        write_summary(self.run_dir, summary, held)
        return summary

    # ---- its state ------------------------------------------------------------------------------------------

    def checkpoint_parts(self) -> dict:
        """What a checkpoint holds, everything a resume needs: the trained values, optimizer, schedule, data
        position, RNG, the TrainState and each part's state."""
        return {
            "model": self.model,  # the trained values (the forward writes them into resident weights)
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "state": {
                **self.state.to_dict(),
                **{k: v for part in self.parts for k, v in part.state_dict().items()},
                "data": self.batches.state_dict(),
                "rng": runtime.rng_state(),
                "config": self.config.to_dict(),
                checkpoint.RUN_CONFIG_KEY: self.run_config,
            },
            "extra_tensors": {k: v for part in self.parts for k, v in part.tensor_state().items()},
            # expert parallelism: each rank's own, in its shard
            "shard_tensors": {k: v for part in self.parts for k, v in part.shard_tensor_state().items()},
        }

    def restore_values(self, saved: Path, restored: dict) -> dict:
        """The checkpoint `saved` (read as `restored`), with its trained values put back in the model and each
        part's state in its part."""
        restore_trainable(self.model, restored["trainable"], saved)
        for part in self.parts:
            part.load_state(restored, restored["extra"])
        return restored

    def restore_loop(self, restored: dict) -> None:
        """The rest of what a checkpoint holds: the run continues as if it had never stopped."""
        checkpoint.restore_optimizer(self.optimizer, restored)
        self.scheduler.load_state_dict(restored["scheduler"])
        apply_resumed_schedule(self.optimizer, self.scheduler, self.config, restored["config"])
        self.batches.load_state_dict(restored["data"])
        runtime.set_rng_state(restored["rng"])
        self.state = TrainState.from_checkpoint(restored)
        if self.scaler.is_enabled() and self.state.loss_scale:
            self.scaler.load_state_dict(self.state.loss_scale)
