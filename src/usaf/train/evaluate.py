"""Held-out loss and perplexity: the same tokens and masking before and after training."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from usaf.config import RunConfig
from usaf.data import Batches, TokenizedDataset
from usaf.engine.loss import IGNORE_INDEX, causal_lm_loss
from usaf.engine.preference import preference_loss
from usaf.errors import RunStateError
from usaf.files import CONFIG_FILE, SELECTION_FILE
from usaf.io.model_source import model_source
from usaf.registry import OBJECTIVES
from usaf.train import checkpoint, runtime
from usaf.train.checkpoint import restore_trainable
from usaf.train.session import open_session, run_data


class Evaluator:
    """The run's held-out evaluation: `should_evaluate(step)` every `log.eval_every_steps` when there is held-out
    data, and `evaluate()` on it (the same batches every time)."""

    def __init__(
        self, model: torch.nn.Module, dataset: TokenizedDataset | None, config: RunConfig, device, autocast
    ):
        self.model, self.dataset, self.config, self.device, self.autocast = (
            model,
            dataset,
            config,
            device,
            autocast,
        )

    @property
    def available(self) -> bool:
        return self.dataset is not None

    def should_evaluate(self, step: int) -> bool:
        every = self.config.log.eval_every_steps
        return self.available and bool(every) and step % every == 0

    def evaluate(self) -> dict:
        config = self.config
        objective = OBJECTIVES[config.train.objective]
        if objective.name != "dpo" and (objective.pairs or objective.reference_forward):
            # preference objectives but DPO (whose loss, margin and accuracy rows came first) are held out by
            # their own loss: what checkpoint.best_metric and early stopping rank, and what the run minimizes
            return evaluate_objective(
                self.model,
                self.dataset,
                objective,
                config.train,
                config.data.batch_size,
                self.device,
                self.autocast,
                config.data.eval_batches,
            )
        return evaluate(
            self.model,
            self.dataset,
            config.data.batch_size,
            self.device,
            self.autocast,
            config.data.eval_batches,
            config.train.logits_chunk_tokens,
            config.train.dpo_beta if OBJECTIVES[config.train.objective].pairs else None,
        )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset: TokenizedDataset,
    batch_size: int,
    device: torch.device,
    autocast_ctx=None,
    max_batches: int = 0,
    chunk_tokens: int = 1024,
    dpo_beta: float | None = None,
) -> dict:
    """Mean next-token loss over every supervised token of `dataset` (or its first `max_batches` batches); with
    `dpo_beta` (preference pairs), the mean DPO loss per pair, the mean reward margin and the share of pairs whose
    chosen answer is ahead."""
    total, count, margins = 0.0, 0, []
    for batch in held_out_batches(model, dataset, batch_size, device, max_batches):
        with autocast_ctx or torch.autocast(device.type, enabled=False):
            if dpo_beta is not None:
                result = preference_loss(
                    model,
                    batch["input_ids"],
                    batch["labels"],
                    dpo_beta,
                    position_ids=batch["position_ids"],
                    chunk_tokens=chunk_tokens,
                )
                loss_sum = result.loss_sum
                margins.append(result.margins.float().cpu())
            else:
                loss_sum = causal_lm_loss(
                    model,
                    batch["input_ids"],
                    batch["labels"],
                    position_ids=batch["position_ids"],
                    chunk_tokens=chunk_tokens,
                    reduction="sum",
                )
        total += float(loss_sum)
        count += supervised_units(batch, dpo_beta is not None)
    loss = total / max(count, 1)
    if dpo_beta is not None:
        margin = torch.cat(margins)
        return {
            "loss": loss,
            "margin": float(margin.mean()),
            "accuracy": float((margin > 0).float().mean()),
            "pairs": count,
        }
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


@torch.no_grad()
def evaluate_objective(
    model: torch.nn.Module,
    dataset: TokenizedDataset,
    objective,
    train,
    batch_size: int,
    device: torch.device,
    autocast_ctx=None,
    max_batches: int = 0,
) -> dict:
    """The objective's own loss per unit over `dataset` (or its first `max_batches` batches), its step metrics over
    the same batches (TRL's names: rewards/margins, ...) and the units counted."""
    total, count, extras = 0.0, 0, []
    for batch in held_out_batches(model, dataset, batch_size, device, max_batches):
        with autocast_ctx or torch.autocast(device.type, enabled=False):
            loss_sum, extra = objective.loss_sum(model, batch, train)
        total += float(loss_sum)
        count += objective.supervised_units(batch)
        extras.append(extra)
    metrics = objective.step_metrics(extras, count, lambda *values: values)  # one process's held-out data
    return {"loss": total / max(count, 1), **metrics, "units": count}


def held_out_batches(model: torch.nn.Module, dataset, batch_size: int, device, max_batches: int = 0):
    """`dataset`'s batches in order on `device` (its first `max_batches`; 0: all), the model in eval mode while they
    are read."""
    was_training = model.training
    model.eval()
    try:
        for index, batch in enumerate(Batches(dataset, batch_size, shuffle=False, epochs=1)):
            if max_batches and index >= max_batches:
                break
            yield {k: v.to(device) for k, v in batch.items()}
    finally:
        model.train(was_training)


def supervised_units(batch: dict, pairs: bool) -> int:
    """What a batch's summed loss is divided by: its supervised next tokens, or (preference pairs) its pairs."""
    if pairs:
        return batch["input_ids"].shape[0] // 2
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def evaluate_target(target: str, data_files: list[str], overrides: list[str]) -> dict:
    """`usaf eval`: a model directory as it is, or a run directory with its latest checkpoint applied."""
    source = model_source(target)
    run_dir, is_run = Path(source.path), source.is_run
    if is_run:
        config = RunConfig.load_saved(str(run_dir / CONFIG_FILE), overrides)
        saved = checkpoint.latest(run_dir)
        if saved is None:
            raise RunStateError(f"{run_dir} has no finished checkpoint to evaluate.")
    else:
        config = RunConfig.load(None, [("model.path", target), *overrides])
    session = open_session(  # no backward here: nothing to recompute; the run's own selection, or none
        config,
        lambda config, tokenizer, pack: run_data(config, tokenizer, pack, data_files, held_out=False),
        calibrate=False,
        selection_file=run_dir / SELECTION_FILE if is_run else None,
        recompute=False,
    )
    model, config, device, data, stats = (
        session.model,
        session.config,
        session.device,
        session.train_data,
        session.data_stats,
    )
    if is_run:
        restore_trainable(model, checkpoint.load(saved)["trainable"], saved)
    result = evaluate(
        model,
        data,
        config.data.batch_size,
        device,
        runtime.autocast(config.train.precision, device, session.dtype),
        0,
        config.train.logits_chunk_tokens,
    )
    return {
        "target": str(target),
        "checkpoint": str(saved) if is_run else None,
        **result,
        "data": stats.summary(),
        **({"notes": session.notes} if session.notes else {}),
    }
