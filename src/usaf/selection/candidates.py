"""Where gradient selection looks: the lines (neurons of the experts, rows of other weights) whose entries are
scored exactly, chosen from cheap first-order statistics. Shared by the first selection (`scorers.Gradient`, from
calibration) and by reselection (`reselect.Reselector`, from the run's own steps), so both rank alike.

The statistic of an expert neuron is sum over its tokens of (h * dL/dh)^2 (`NeuronImportance`), of another
weight's row `SparseWeight.row_score`; the candidates are the best of them, `oversample` times as many entries
as will be chosen (nothing dense is ever scored).
"""

from __future__ import annotations

import math

import torch


class NeuronImportance:
    """Observer of an experts module (see `SparseExperts.observers`) accumulating (h * dL/dh)^2 per expert neuron
    into `score` [E, I] while `active`: during forwards that count, not during recomputation."""

    def __init__(self):
        self.active = False
        self.score: torch.Tensor | None = None

    def __call__(self, state, plan, top_k_weights, h):
        if not (self.active and h.requires_grad):
            return None
        experts = plan.expert_of_row

        # called in backward with the activation autograd saved (recomputed with its layer under recomputation):
        # nothing here holds `h` from the forward to the backward
        def accumulate(values, grad_h):
            if self.score is None:
                self.score = torch.zeros(state.num_experts, values.shape[1], device=values.device)
            self.score.index_add_(0, experts, (values.detach() * grad_h).float().pow(2))

        return accumulate


def lines_wanted(oversample: float, count: int, line_length: int, available: int) -> int:
    """How many lines to probe for `count` entries: `oversample` x the entries, in lines of `line_length`."""
    return min(available, math.ceil(oversample * count / max(1, line_length)) + 1)


def best_rows(row_score: torch.Tensor | None, rows: int, wanted: int) -> torch.Tensor:
    """The `wanted` rows of highest score, sorted (every row without a score or when all are wanted)."""
    if row_score is None or wanted >= rows:
        return torch.arange(rows)
    return torch.topk(row_score.cpu(), wanted, sorted=False).indices.sort().values


def best_neurons(score: torch.Tensor, wanted: int) -> torch.Tensor:
    """Flat ids (expert * I + j) of the `wanted` neurons of highest score ([E, I], -inf: excluded)."""
    flat = score.reshape(-1).cpu()
    best = torch.topk(flat, min(wanted, flat.numel()), sorted=False).indices
    return best[flat[best] > float("-inf")]
