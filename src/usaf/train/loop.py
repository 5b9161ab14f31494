"""`usaf train`: one run, top to bottom.

set up the run dir -> load and prepare the model -> load the data -> optimizer and schedule -> (resume) ->
evaluate -> loop { micro-batches, backward, skip bad steps, clip, step, log, checkpoint } -> evaluate -> summary.

The loop's components decide their own cadence and do their own sync across ranks (the Checkpointer, Evaluator,
metrics log, RouterTraining, Reselector, prefix cache, gradient reducer, StepShare, StopRequest): nothing below
calls usaf.train.distributed but joining the job.
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
from usaf.data import Batches, collate
from usaf.data.load import fit_context
from usaf.engine.loss import IGNORE_INDEX, causal_lm_loss
from usaf.engine.preference import preference_loss
from usaf.engine.state import streamed_bytes
from usaf.errors import UsafError
from usaf.files import CONFIG_FILE, SELECTION_FILE
from usaf.prepare import trainable_summary
from usaf.selection.reselect import Reselector
from usaf.train import checkpoint, distributed, runtime
from usaf.train.checkpoint import Checkpointer, restore_trainable
from usaf.train.distributed import StepShare, gradient_reducer
from usaf.train.evaluate import Evaluator, supervised_units
from usaf.train.memory_plan import resolve_auto
from usaf.train.metrics import eval_record, open_metrics
from usaf.train.optim import (
    apply_resumed_schedule,
    build_optimizer,
    build_scheduler,
    clip_gradients,
    router_params,
    schedule_notes,
)
from usaf.train.prefix_cache import FrozenPrefixCache
from usaf.train.recompute import choose_recompute
from usaf.train.router_health import RouterCollapse
from usaf.train.router_training import RouterTraining
from usaf.train.run_dir import (
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
    check_finite_base,
    check_trainable_entries,
    open_session,
    run_data,
)
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
    if config.train.objective == "dpo" and config.train.prefix_cache != "off":
        raise UsafError("train.prefix_cache caches one forward per row; train.objective=dpo needs it off.")
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
        if not resume and check_new_run(config, run_dir, force) == "dead start":
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


def _train(config: RunConfig, run_dir: Path, resume: bool, progress: _Progress | None = None) -> dict:
    # the data's windows fit the model's context before the memory plan sizes them and config.yaml records them
    data, context_line = fit_context(config.data, config.model.path)
    config = config.replace({"data.max_seq_len": data.max_seq_len})
    auto_lines = [context_line] if context_line else []
    if not resume:  # auto becomes a number before config.yaml records it (a resume takes the recorded one)
        device = distributed.local_device(runtime.resolve_device(config.model.device))
        config, lines = resolve_auto(config, device, runtime.resolve_dtype(config.model.dtype, device))
        auto_lines += lines
    config, changes = open_run_dir(config, run_dir, resume)
    if resume:
        if (finished := finished_run(run_dir, config)) is not None:
            return finished  # nothing to do, and nothing written: the run's files stay as they are
        if any(c.startswith("model.path ") for c in changes):
            check_moved_base(run_dir, config.model.path)
    return TrainingRun(config, run_dir, resume, changes, progress or _Progress(), auto_lines).train()


def _router_training(model, config: RunConfig, session, device, micro_batches: int) -> RouterTraining:
    """The routers' losses, health and guard; their drift is measured on a fixed reference batch, the first rows
    of the eval data (else of the training data)."""
    rows = session.eval_data if session.eval_data is not None else session.train_data
    reference = collate([rows[i] for i in range(min(4, len(rows)))], rows.pad_id)
    return RouterTraining(
        model,
        config.router,
        router_params(model),
        {k: v.to(device) for k, v in reference.items()},
        micro_batches,
    )


class TrainingRun:
    """One run, built from its folder (new, or resumed from its latest checkpoint) and trained step by step.
    Building it writes nothing; `train` records a new run's start in the folder, then reads top to bottom; each
    step is `forward_backward`, `optimizer_step` (with its skip policy) and `after_step` (reselection, router
    health, logging, evaluation, checkpoint, each at its own cadence)."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        resume: bool,
        changes: list[str],
        progress: _Progress,
        auto_lines: list[str] | None = None,  # what the memory plan's autos chose, for the first lines
    ):
        self.run_dir, self.resume, self.notes, self.progress = run_dir, resume, [], progress
        self.auto_lines = auto_lines or []
        device = distributed.local_device(runtime.resolve_device(config.model.device))  # this rank's device
        dtype = runtime.resolve_dtype(config.model.dtype, device)
        # the settings as given (a note may turn packing off for this process only): what config.yaml states and
        # every checkpoint records, for a resume to compare with
        self.run_config, run_yaml = config.to_dict(), config.to_yaml()
        runtime.seed_everything(config.train.seed)
        # decided before loading: calibration recomputes as training does
        self.recompute = choose_recompute(config, device, dtype)
        session = open_session(
            config,
            run_data,
            # a resumed run starts from the selection it saved (the checkpoint then restores the current one)
            selection_file=run_dir / SELECTION_FILE if resume else None,
            recompute=self.recompute.recompute,
        )
        self.config, self.model, self.device, self.dtype = (
            session.config,
            session.model,
            session.device,
            session.dtype,
        )
        config = self.config
        check_trainable_entries(self.model, config)
        self.data_stats = session.data_stats
        self.notes += session.notes
        self.batches = Batches(session.train_data, config.data.batch_size, seed=config.train.seed)
        self.share = StepShare(self.batches, config.schedule.grad_accum)
        self.prefix_cache = FrozenPrefixCache.for_run(self.model, config, run_dir)
        # gradients summed across ranks, overlapped with the last backward of each step
        self.reducer = gradient_reducer(self.model)

        self.routers = _router_training(self.model, config, session, device, self.share.micro_batches)
        self.checkpointer = Checkpointer(run_dir, config.checkpoint, self.checkpoint_parts)
        self.length = f"{config.schedule.max_steps} steps"  # what the first line says (schedule.epochs: how)
        if config.schedule.epochs:
            self._steps_from_epochs(config)
            config = self.config
        # a resume restores the trained values and routers first: the optimizer is built on what they now are
        restored = self.restore_values(*self.checkpointer.load_latest()) if resume else None
        self.optimizer = build_optimizer(self.model, config)
        self.scheduler = build_scheduler(self.optimizer, config)
        self.notes += schedule_notes(config)
        self.autocast = runtime.autocast(config.train.precision, device, self.dtype)
        self.scaler = runtime.loss_scaler(config.train.precision, device, self.dtype)
        self.evaluator = Evaluator(self.model, session.eval_data, config, self.device, self.autocast)
        self.reselector = None
        if config.select.reselect_every:
            self.reselector = Reselector(
                self.model, config.select, config.schedule.max_steps, config.optim.eight_bit
            )
        self.state = TrainState()
        if restored is not None:
            self._resume_from(restored, changes, run_yaml)
        self.entries = trainable_summary(self.model)

    def _resume_from(self, restored, changes: list[str], run_yaml: str) -> None:
        """The loop's state from the latest checkpoint; config.yaml states the run as resumed (changes, or a --set
        that put an edit back) from the next checkpoint on, which records the same settings: the two never
        disagree for a later resume."""
        self.restore_loop(restored)
        if changes:
            self.notes.append("resumed with " + ", ".join(changes))
        if (self.run_dir / CONFIG_FILE).read_text(errors="replace") != run_yaml:
            self.checkpointer.write_with_next(self.run_dir / CONFIG_FILE, run_yaml)

    def _steps_from_epochs(self, config: RunConfig) -> None:
        """schedule.epochs: max_steps from the batches an epoch and the micro-batches a step (all ranks); the run's
        config.yaml states the steps with the next checkpoint, so that a resume finds the same length."""
        per_step = self.share.micro_batches
        steps = max(1, math.ceil(config.schedule.epochs * len(self.batches) / per_step))
        self.length = (
            f"{steps} steps (schedule.epochs={config.schedule.epochs:g}: {len(self.batches)} batches of "
            f"{config.data.batch_size} an epoch, {per_step} a step)"
        )
        if steps != config.schedule.max_steps:
            self.config = config.replace({"schedule.max_steps": steps})
            given = RunConfig.from_dict(self.run_config).replace({"schedule.max_steps": steps})
            self.run_config = given.to_dict()
            self.checkpointer.write_with_next(self.run_dir / CONFIG_FILE, given.to_yaml())

    # ---- the run ----------------------------------------------------------------------------------------------

    def train(self) -> dict:
        if not self.resume:
            self.notes += record_start(self.run_dir, self.config, self.model)
        self.announce()
        config, state = self.config, self.state
        self.log = open_metrics(
            self.run_dir, config.log, config.schedule.max_steps, state.step, self.resume, self.run_config
        )
        stop = StopRequest()
        try:
            self.evaluate_before()
            self.model.train()
            while state.step < config.schedule.max_steps and not stop.agreed():
                started, streamed_before = time.perf_counter(), streamed_bytes(self.model)
                loss, tokens = self.forward_backward()
                grad_norm = self.optimizer_step(loss)
                if grad_norm is None:
                    continue  # skipped: no step taken
                if (
                    stopped := self.after_step(loss, tokens, grad_norm, started, streamed_before)
                ) is not None:
                    return stopped
            if stop.requested:
                path = self.checkpointer.save(state.step, force=True)
                self.log.message(
                    f"stopped at step {state.step} ({stop.signal_name}); checkpoint {path}. "
                    f"Resume with: usaf train --resume {self.run_dir}"
                )
                return {"stopped": True, "step": state.step, "signal": stop.signal_number}
            stop.restore()  # a signal while finishing acts as it did after the loop (restoring again is harmless)
            return self.finish()  # while the log is open: the final evaluation is a row of it
        finally:
            stop.restore()
            self.log.close()

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
        for note in self.notes:
            print(f"note: {note}", flush=True)

    def evaluate_before(self) -> None:
        if self.evaluator.available and self.state.eval_before is None:
            self.state.eval_before = self.evaluator.evaluate()
            self.log.log(self.state.step, eval_record(self.state.eval_before))

    def forward_backward(self) -> tuple[float, int]:
        """Forward and backward over this rank's micro-batches of the step; the loss is the mean over all
        supervised tokens of the step (every rank's)."""
        config, routers, reselector, prefix_cache = (
            self.config,
            self.routers,
            self.reselector,
            self.prefix_cache,
        )
        if reselector is not None:
            reselector.before_step(self.state.step + 1)
        micro = self.share.take()
        dpo = config.train.objective == "dpo"
        supervised = self.share.total(
            sum(supervised_units(b, dpo) for b, _ in micro)
        )  # tokens, or (dpo) pairs
        total, tokens, margins = 0.0, 0, []
        for index, (batch, rows) in enumerate(micro):
            if index == len(micro) - 1:
                self.reducer.arm()  # the last backward sends gradients as they complete
            batch = {k: v.to(self.device) for k, v in batch.items()}
            if prefix_cache is not None:
                lengths = [
                    int((r != IGNORE_INDEX).nonzero().max()) + 1 if (r != IGNORE_INDEX).any() else r.numel()
                    for r in batch["labels"]
                ]
                prefix_cache.begin_batch(rows, lengths, batch["input_ids"])
            if reselector is not None:
                reselector.set_observing(True)
            with self.autocast, routers.capture():
                loss_sum, margin = self.loss_sum(batch)
                if margin is not None:
                    margins.append(margin)
                aux = routers.aux_loss(self.state.step)  # balancing + z-loss from this forward's raw logits
            if reselector is not None:
                reselector.set_observing(False)  # recomputation in backward re-runs forwards: count them once
            self.scaler.scale(loss_sum / max(supervised, 1) + aux / self.share.micro_batches).backward()
            routers.after_micro_batch()
            if prefix_cache is not None:
                prefix_cache.end_batch()
            total += float(loss_sum.detach())
            tokens += batch["input_ids"].numel()
        self.reducer.finish()
        if reselector is not None:
            reselector.after_backward()
        total, tokens = self.share.total(total, tokens)
        self.preference = None
        if dpo:  # the step's pairs over all ranks: the margin sum and the pairs whose chosen answer leads
            margin = torch.cat(margins).float()
            margin_sum, ahead = self.share.total(float(margin.sum()), float((margin > 0).sum()))
            self.preference = {
                "rewards/margins": margin_sum / supervised,
                "rewards/accuracies": ahead / supervised,
            }
        return total / max(supervised, 1), tokens

    def loss_sum(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A micro-batch's summed loss under the run's objective, and (dpo) its pairs' reward margins: next-token
        cross entropy over the supervised tokens, or DPO over the pairs, whose reference forward runs first,
        without gradients, on the base (`usaf.base_weights`)."""
        config = self.config
        if config.train.objective == "dpo":
            result = preference_loss(
                self.model,
                batch["input_ids"],
                batch["labels"],
                config.train.dpo_beta,
                position_ids=batch["position_ids"],
                chunk_tokens=config.train.logits_chunk_tokens,
            )
            return result.loss_sum, result.margins
        loss = causal_lm_loss(
            self.model,
            batch["input_ids"],
            batch["labels"],
            position_ids=batch["position_ids"],
            chunk_tokens=config.train.logits_chunk_tokens,
            reduction="sum",
        )
        return loss, None

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
        if not self.routers.training_routers(state.step):
            for param in self.routers.router_params:
                param.grad = None  # AdamW skips parameters without gradients
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
    ) -> dict | None:
        """Reselection, router health, the metrics row, evaluation and checkpoint of the step just taken; a
        summary when the router guard stops the run, else None."""
        state, reselector, routers = self.state, self.reselector, self.routers
        reselected = reselector.after_step(state.step, self.optimizer) if reselector is not None else None
        try:
            router_record, router_show, router_message = routers.after_step(state.step)
        except RouterCollapse as err:
            self.log.message(f"{err}\ncheckpoint: {self.checkpointer.save(state.step, force=True)}")
            return {"stopped": True, "step": state.step, "reason": "router collapse"}
        if router_message:
            self.log.message(router_message)
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
            **(self.preference or {}),
            **(reselected or {}),
            **router_record,
        }
        if self.evaluator.should_evaluate(state.step):
            record.update(eval_record(self.evaluator.evaluate()))
        if self.log.should_log(state.step, record):
            shown = {
                "loss": f"{loss:.4f}",
                "lr": f"{record['lr']:.2e}",
                "tok/s": f"{record['tokens_per_s']:.0f}",
                "mem": f"{record['peak_memory_mb']:.0f}MB",
                **router_show,
            }
            self.log.log(state.step, record, shown)
        self.log.advance()
        self.checkpointer.save(state.step)  # when due
        return None

    def finish(self) -> dict:
        eval_after = self.evaluator.evaluate() if self.evaluator.available else None
        if eval_after is not None:  # before the summary that marks the run finished (a resume rewrites it)
            self.log.log(self.state.step, eval_record(eval_after, final=True))
        self.checkpointer.save(self.state.step, force=True)
        if self.prefix_cache is not None:
            self.state.prefix_cache_hits = self.prefix_cache.hits
        summary = self.state.summary(eval_after, self.entries, self.data_stats)
        write_summary(self.run_dir, summary, self.routers)
        return summary

    # ---- its state ------------------------------------------------------------------------------------------

    def checkpoint_parts(self) -> dict:
        """What a checkpoint holds, everything a resume needs: the trained values, optimizer, schedule, data
        position, RNG, the TrainState, router, prefix cache and reselection state."""
        return {
            "model": self.model,  # the trained values (the forward writes them into resident weights)
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "state": {
                **self.state.to_dict(),
                **(self.prefix_cache.state_dict() if self.prefix_cache is not None else {}),
                "data": self.batches.state_dict(),
                "rng": runtime.rng_state(),
                "config": self.config.to_dict(),
                checkpoint.RUN_CONFIG_KEY: self.run_config,
                "router": self.routers.state_dict(),
            },
            "extra_tensors": {
                **(self.reselector.state_dict() if self.reselector is not None else {}),
                **self.routers.tensor_state(),
            },
        }

    def restore_values(self, saved: Path, restored: dict) -> dict:
        """The checkpoint `saved` (read as `restored`), with its trained values and router state put back in the
        model."""
        restore_trainable(self.model, restored["trainable"], saved)
        self.routers.load_state_dict(restored["router"])
        self.routers.load_tensor_state(restored["extra"])
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
        if self.reselector is not None:
            self.reselector.load_state_dict(restored["extra"])
        if self.prefix_cache is not None:
            self.prefix_cache.load_state_dict(restored)
