"""What a run minimizes (`train.objective`): each objective is an object with `usaf.registry.Objective`'s members,
registered in `OBJECTIVES` (the config offers its names), so the loop names none of them.

- `name`: the value of `train.objective`; `pairs`: whether it trains on preference pairs (a batch's chosen rows,
  then its rejected rows, in the same order); `reference_forward`: whether each step runs one more forward without
  gradients (what `usaf plan` counts of its time).
- `check(train)`: refuses the `train` settings it cannot run with (a UsafError that says what to set).
- `loss_sum(model, batch, train)`: a micro-batch's summed loss (a tensor the loop divides by the step's
  supervised units and backpropagates) and what the step's metrics need of it (None: nothing).
- `supervised_units(batch)`: what a batch's summed loss is a sum over (tokens, pairs).
- `step_metrics(extras, supervised, total)`: the metrics row's entries for the step, from every micro-batch's
  extra and the step's supervised units over all ranks; `total(*values)` sums values over the ranks.

A new objective is one object registered here or anywhere before the run starts (`OBJECTIVES.register(...)`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from usaf.engine.loss import causal_lm_loss
from usaf.engine.preference import preference_loss
from usaf.errors import ConfigError
from usaf.registry import OBJECTIVES
from usaf.train.evaluate import supervised_units


class NextToken:
    """sft: next-token cross entropy over the supervised tokens."""

    name, pairs, reference_forward = "sft", False, False

    def check(self, train) -> None:
        pass

    def loss_sum(self, model, batch: dict, train) -> tuple[torch.Tensor, None]:
        loss = causal_lm_loss(
            model,
            batch["input_ids"],
            batch["labels"],
            position_ids=batch["position_ids"],
            chunk_tokens=train.logits_chunk_tokens,
            reduction="sum",
        )
        return loss, None

    def supervised_units(self, batch: dict) -> int:
        return supervised_units(batch, pairs=False)

    def step_metrics(self, extras: list, supervised: int, total: Callable) -> dict:
        return {}


class Preference:
    """dpo: DPO over preference pairs, the base itself the reference (`usaf.engine.preference`); its extra is each
    pair's reward margin."""

    name, pairs, reference_forward = "dpo", True, True

    def check(self, train) -> None:
        if train.prefix_cache != "off":
            raise ConfigError(
                "train.prefix_cache caches one forward per row; train.objective=dpo needs it off."
            )

    def loss_sum(self, model, batch: dict, train) -> tuple[torch.Tensor, torch.Tensor]:
        result = preference_loss(
            model,
            batch["input_ids"],
            batch["labels"],
            train.dpo_beta,
            position_ids=batch["position_ids"],
            chunk_tokens=train.logits_chunk_tokens,
        )
        return result.loss_sum, result.margins

    def supervised_units(self, batch: dict) -> int:
        return supervised_units(batch, pairs=True)

    def step_metrics(self, extras: list, supervised: int, total: Callable) -> dict:
        """The step's pairs over all ranks: the mean reward margin and the share whose chosen answer leads."""
        margin = torch.cat(extras).float()
        margin_sum, ahead = total(float(margin.sum()), float((margin > 0).sum()))
        return {"rewards/margins": margin_sum / supervised, "rewards/accuracies": ahead / supervised}


OBJECTIVES.register(NextToken())
OBJECTIVES.register(Preference())
