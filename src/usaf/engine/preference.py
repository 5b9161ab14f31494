"""Preference tuning (DPO) with the base as its own reference: the reference log-probabilities come from the same
model inside `base_weights`, so no second copy of the model exists (its cost is one extra forward, without
gradients).

A batch holds the chosen answers in its first half and the rejected ones, in the same order, in its second; labels
are -100 outside the answers. Each sequence's log-probability is the sum over its answer tokens, computed chunk by
chunk of tokens: a chunk's logits are recomputed in backward (`torch.utils.checkpoint`), so at most one chunk of
[tokens, vocab] logits is alive at a time, as in `usaf.engine.loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from usaf.engine.base_weights import base_weights
from usaf.engine.loss import IGNORE_INDEX, output_head
from usaf.model.hf import decoder_body


def _token_logps(
    hidden: torch.Tensor, targets: torch.Tensor, head: Callable, temperature: float
) -> torch.Tensor:
    logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return torch.gather(logits.log_softmax(-1), 1, targets.unsqueeze(1)).squeeze(1)


def token_logps(
    model: torch.nn.Module,
    input_ids,
    labels,
    position_ids=None,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(token) of every labelled token in row-major order, the row each is in, the [batch, seq - 1] mask of
    labelled targets), labels aligned with the inputs; `temperature` divides the logits first (GRPO scores its
    samples at the temperature they were drawn at)."""
    out = decoder_body(model)(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state[:, :-1, :]
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    rows = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(targets)[keep]
    hidden, targets, head = hidden[keep], targets[keep], output_head(model)
    pieces = []
    for start in range(0, targets.numel(), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled() and hidden.requires_grad:
            pieces.append(
                checkpoint(_token_logps, hidden[part], targets[part], head, temperature, use_reentrant=False)
            )
        else:
            pieces.append(_token_logps(hidden[part], targets[part], head, temperature))
    per_token = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
    return per_token, rows, keep


def sequence_logps(
    model: torch.nn.Module, input_ids, labels, position_ids=None, chunk_tokens: int = 1024
) -> torch.Tensor:
    """[batch] sums of log p(token) over each row's labelled tokens (labels aligned with the inputs)."""
    per_token, rows, _ = token_logps(model, input_ids, labels, position_ids, chunk_tokens)
    return per_token.new_zeros(labels.shape[0]).index_add_(0, rows, per_token)


@dataclass
class PreferenceResult:
    """The step's summed DPO loss over its pairs, and (detached) what a log reports per pair."""

    loss_sum: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards


def dpo_losses(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, ...]:
    """Per pair: the sigmoid DPO loss -log σ(β((π_c − ref_c) − (π_r − ref_r))) and the implicit rewards
    β(π − ref) of the chosen and the rejected answers (`policy`, `reference`: [chosen..., rejected...]).
    Written here: TRL 1.16 computes it inline in `DPOTrainer._compute_loss`, with no function to call
    (`usaf.engine.trl_preference` calls TRL's where it has one); tests/train/test_preference_trl.py checks it equals."""
    chosen, rejected = policy.chunk(2)
    ref_chosen, ref_rejected = reference.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def preference_loss(
    model: torch.nn.Module,
    input_ids,
    labels,
    beta: float,
    position_ids=None,
    chunk_tokens: int = 1024,
) -> PreferenceResult:
    """DPO on a batch of pairs (see the module), the reference being the model's own base."""
    if input_ids.shape[0] % 2:
        raise ValueError("a preference batch holds pairs: the chosen rows, then the rejected rows")
    with torch.no_grad(), base_weights(model):
        reference = sequence_logps(model, input_ids, labels, position_ids, chunk_tokens)
    policy = sequence_logps(model, input_ids, labels, position_ids, chunk_tokens)
    losses, chosen, rejected = dpo_losses(policy, reference, beta)
    return PreferenceResult(losses.sum(), chosen, rejected)
