"""ORPO, SimPO and KTO on a batch of usaf's rows, their losses computed by TRL's own definitions.

TRL 1.16 has ORPO's odds-ratio loss and CPO's (SimPO's) loss only as methods of its trainers, reading their
settings from `self` (`ORPOTrainer.odds_ratio_loss`, `CPOTrainer.cpo_loss`): they are called unbound here with a
namespace holding exactly those settings. KTO's loss is written inline in `KTOTrainer._compute_loss`, with no
function to call: `kto_losses` restates its lines (see there).

The batches are those of `usaf.engine.preference`: chosen rows then rejected rows, right-padded, labels -100
outside the answers (KTO's: rows each with its "label", `usaf.data.pairs.LabelledRows`). Every function returns the batch's summed loss over its units (pairs; KTO: rows), which the
loop divides by the step's units, and `metrics`: {TRL's metric name: (sum, count)} over the batch, detached.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from usaf.engine.base_weights import base_weights
from usaf.engine.loss import IGNORE_INDEX
from usaf.engine.preference import sequence_logps, token_logps


@functools.cache
def _trl_trainers() -> SimpleNamespace:
    """TRL's ORPOTrainer and CPOTrainer, imported on first use: importing them takes seconds (peft, the Trainer),
    which only the runs that train with them should pay. TRL keeps them under trl.experimental, whose import warns
    on every run; TRL's own helper silences it."""
    from trl.import_utils import suppress_experimental_warning

    with suppress_experimental_warning():
        from trl.experimental.cpo.cpo_trainer import CPOTrainer
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    return SimpleNamespace(orpo=ORPOTrainer, cpo=CPOTrainer)


Metrics = dict[str, tuple[torch.Tensor, int]]


def _trainer_self(device: torch.device, **settings) -> SimpleNamespace:
    """What TRL's loss methods read of their trainer: its settings and the device the rewards go to."""
    return SimpleNamespace(accelerator=SimpleNamespace(device=device), **settings)


def answer_bounds(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: where its answer (the labelled tokens) starts and ends; a row's answer is its last part."""
    labelled = labels != IGNORE_INDEX
    positions = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
    start = torch.where(labelled, positions, labels.shape[1]).min(1).values
    end = torch.where(labelled, positions + 1, 0).max(1).values
    return start, end


def _row_logps(model, batch: dict, chunk_tokens: int, whole_rows: bool):
    """One forward: per row, the summed log p of its answer tokens and their count, and (`whole_rows`) the same
    over every real token after the first, prompt included (what ORPO's NLL term covers)."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    targets = labels
    if whole_rows:
        _, end = answer_bounds(labels)
        real = torch.arange(labels.shape[1], device=labels.device) < end.unsqueeze(1)
        targets = torch.where(real, input_ids, IGNORE_INDEX)
    per_token, rows, keep = token_logps(model, input_ids, targets, batch["position_ids"], chunk_tokens)
    in_answer = (labels[:, 1:] != IGNORE_INDEX)[keep]
    count = labels.shape[0]
    answer_sum = per_token.new_zeros(count).index_add_(0, rows[in_answer], per_token[in_answer])
    all_sum = per_token.new_zeros(count).index_add_(0, rows, per_token)
    return (
        answer_sum,
        torch.bincount(rows[in_answer], minlength=count),
        all_sum,
        torch.bincount(rows, minlength=count),
    )


def _reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor, logps: torch.Tensor) -> Metrics:
    """TRL's per-pair rows: rewards/{chosen,rejected,accuracies,margins}, logps/{chosen,rejected}."""
    pairs = chosen.shape[0]
    logp_chosen, logp_rejected = logps.detach().float().chunk(2)
    values = {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracies": (chosen > rejected).float(),
        "rewards/margins": chosen - rejected,
        "logps/chosen": logp_chosen,
        "logps/rejected": logp_rejected,
    }
    return {name: (value.sum(), pairs) for name, value in values.items()}


def orpo_loss(model, batch: dict, beta: float, chunk_tokens: int = 1024) -> tuple[torch.Tensor, Metrics]:
    """ORPO (TRL's ORPOTrainer): the chosen rows' mean next-token loss over prompt and answer, less β times the
    mean log-sigmoid of the log odds ratio of the answers' mean log-probabilities; no reference."""
    answer_sum, answer_tokens, all_sum, all_tokens = _row_logps(model, batch, chunk_tokens, whole_rows=True)
    mean_logps = answer_sum / answer_tokens
    chosen, rejected = mean_logps.chunk(2)
    pairs = chosen.shape[0]
    nll = -all_sum[:pairs].sum() / all_tokens[:pairs].sum()
    trainer = _trainer_self(chosen.device, beta=beta)
    ratio_losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen = (
        _trl_trainers().orpo.odds_ratio_loss(trainer, chosen, rejected)
    )
    metrics = _reward_metrics(chosen_rewards, rejected_rewards, mean_logps)
    metrics["nll_loss"] = (nll.detach() * pairs, pairs)
    metrics["log_odds_ratio"] = (log_odds_ratio.detach() * pairs, pairs)
    metrics["log_odds_chosen"] = (log_odds_chosen.detach() * pairs, pairs)
    return nll * pairs - ratio_losses.sum(), metrics


def simpo_loss(
    model, batch: dict, beta: float, gamma: float, cpo_alpha: float, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, Metrics]:
    """SimPO (TRL's CPOTrainer, loss_type="simpo"): -log σ(β(mean log p(chosen) − mean log p(rejected)) − γ) per
    pair, plus cpo_alpha times the chosen answers' mean next-token loss; no reference."""
    answer_sum, answer_tokens, _, _ = _row_logps(model, batch, chunk_tokens, whole_rows=False)
    mean_logps = answer_sum / answer_tokens
    chosen, rejected = mean_logps.chunk(2)
    pairs = chosen.shape[0]
    trainer = _trainer_self(
        chosen.device, alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=0.0
    )
    losses, chosen_rewards, rejected_rewards = _trl_trainers().cpo.cpo_loss(trainer, chosen, rejected)
    loss_sum = losses.sum()
    metrics = _reward_metrics(chosen_rewards, rejected_rewards, mean_logps)
    if cpo_alpha:
        # CPO's NLL term: the chosen answers' tokens only, averaged over the batch's tokens
        nll = -answer_sum[:pairs].sum() / answer_tokens[:pairs].sum()
        loss_sum = loss_sum + cpo_alpha * nll * pairs
        metrics["nll_loss"] = (nll.detach() * pairs, pairs)
    return loss_sum, metrics


def mismatched_rows(batch: dict) -> dict:
    """KTO's KL sample as TRL builds it: each row's prompt followed by the answer of the row before it (the first
    row's by the last row's), so the answers are the batch's own, paired with other prompts. TRL rotates within
    chunks of a batch's size in the data set's order, before shuffling; here within the batch itself, which is
    what TRL's comment asks of the sample (the same answers as the batch's) and equal to it on unshuffled data."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    start, end = answer_bounds(labels)
    rows, answers = [], []
    for i in range(input_ids.shape[0]):
        j = i - 1 if i else input_ids.shape[0] - 1
        answer = input_ids[j, start[j] : end[j]]
        rows.append(torch.cat([input_ids[i, : start[i]], answer]))
        answers.append((int(start[i]), answer.numel()))
    width = max(row.numel() for row in rows)
    out_ids = input_ids.new_zeros(
        len(rows), width
    )  # right padding: the pad id is never attended to or a target
    out_labels = torch.full_like(out_ids, IGNORE_INDEX)
    for i, (row, (prompt, answer)) in enumerate(zip(rows, answers, strict=True)):
        out_ids[i, : row.numel()] = row
        out_labels[i, prompt : prompt + answer] = row[prompt:]
    positions = torch.arange(width, device=input_ids.device).expand_as(out_ids).contiguous()
    return {"input_ids": out_ids, "labels": out_labels, "position_ids": positions}


def kto_losses(
    policy: torch.Tensor,
    reference: torch.Tensor,
    kl_policy: torch.Tensor,
    kl_reference: torch.Tensor,
    desirable: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO's loss per row (desirable rows first), the rewards β(π − ref) of the desirable and the undesirable
    rows, and the KL estimate, from summed answer log-probabilities. The lines of `KTOTrainer._compute_loss`
    (loss_type="kto", TRL 1.16), which has them inline and no function to call."""
    kl = (kl_policy - kl_reference).mean().detach().clamp(min=0)
    chosen_ratio = policy[desirable] - reference[desirable]
    rejected_ratio = policy[~desirable] - reference[~desirable]
    chosen_losses = 1 - F.sigmoid(beta * (chosen_ratio - kl))
    rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_ratio))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses))
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), kl


def kto_loss(
    model,
    batch: dict,
    desirable: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, Metrics]:
    """KTO on rows each marked desirable or not (`desirable`: [rows] bool), the base itself the reference; the KL
    term from `mismatched_rows`, without gradients, as TRL computes it."""
    kl_batch = mismatched_rows(batch)

    def logps(rows: dict) -> torch.Tensor:
        return sequence_logps(model, rows["input_ids"], rows["labels"], rows["position_ids"], chunk_tokens)

    with torch.no_grad():
        kl_policy = logps(kl_batch)
        with base_weights(model):
            reference, kl_reference = logps(batch), logps(kl_batch)
    policy = logps(batch)
    losses, chosen, rejected, kl = kto_losses(
        policy, reference, kl_policy, kl_reference, desirable, beta, desirable_weight, undesirable_weight
    )
    rows, detached = policy.shape[0], policy.detach()
    metrics = {
        "kl": (kl * rows, rows),
        "rewards/chosen": (chosen.sum(), chosen.numel()),
        "rewards/rejected": (rejected.sum(), rejected.numel()),
        "logps/chosen": (detached[desirable].sum(), chosen.numel()),
        "logps/rejected": (detached[~desirable].sum(), rejected.numel()),
    }
    return losses.sum(), metrics
