"""What a run minimizes (`train.objective`): each objective is an object with `usaf.registry.Objective`'s members,
registered in `OBJECTIVES` (the config offers its names), so the loop names none of them.

- `name`: the value of `train.objective`; `pairs`: whether it trains on preference pairs (a batch's chosen rows,
  then its rejected rows, in the same order); `reference_forward`: the forwards without gradients each step runs
  besides its own, over as many rows (True: one; what `usaf plan` counts of its time); `default_lr`: optim.lr when
  it is auto, the default (bench/quality.py and bench/preference.py measured them).
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
from usaf.engine.trl_preference import kto_loss, orpo_loss, simpo_loss
from usaf.errors import ConfigError
from usaf.registry import OBJECTIVES
from usaf.train.evaluate import supervised_units

# optim.lr=auto of next-token training: issue 26's sweeps on two tasks (bench/results/quality-defaults-2026-12-05)
NEXT_TOKEN_LR = 1e-2
# of DPO: at 1e-2 a DPO run forgets more than full DPO's frontier allows, at this rate it lies past it
# (bench/results/preference-*.md); TRL likewise defaults DPO to a far lower rate than SFT
PREFERENCE_LR = 3e-3


class NextToken:
    """sft: next-token cross entropy over the supervised tokens."""

    name, pairs, reference_forward, default_lr = "sft", False, False, NEXT_TOKEN_LR

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

    name, pairs, reference_forward, default_lr = "dpo", True, True, PREFERENCE_LR

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


def _no_prefix_cache(train, name: str) -> None:
    if train.prefix_cache != "off":
        raise ConfigError(
            f"train.prefix_cache caches one forward per row; train.objective={name} needs it off."
        )


def _means(extras: list, total: Callable) -> dict:
    """{TRL's metric name: its mean over the step's units on all ranks}, from each micro-batch's
    {name: (sum, count)}."""
    names = list(extras[0])
    # one copy from the device for the step, not one a metric
    sums = torch.stack([sum(extra[name][0] for extra in extras) for name in names]).tolist()
    counts = [sum(extra[name][1] for extra in extras) for name in names]
    totals = total(*sums, *counts)
    return {name: totals[i] / max(totals[len(names) + i], 1) for i, name in enumerate(names)}


class OddsRatio:
    """orpo: ORPO over preference pairs (TRL's ORPOTrainer loss), no reference: the chosen rows' next-token loss
    less train.orpo_beta times the log-sigmoid of the answers' log odds ratio."""

    name, pairs, reference_forward, default_lr = "orpo", True, False, NEXT_TOKEN_LR

    def check(self, train) -> None:
        _no_prefix_cache(train, self.name)

    def loss_sum(self, model, batch: dict, train) -> tuple[torch.Tensor, dict]:
        return orpo_loss(model, batch, train.orpo_beta, train.logits_chunk_tokens)

    def supervised_units(self, batch: dict) -> int:
        return supervised_units(batch, pairs=True)

    def step_metrics(self, extras: list, supervised: int, total: Callable) -> dict:
        return _means(extras, total)


class SimplePreference(OddsRatio):
    """simpo: SimPO over preference pairs (TRL's CPOTrainer with loss_type="simpo"), no reference: the answers'
    length-normalized log-probabilities against a margin train.simpo_gamma, plus train.cpo_alpha times the chosen
    answers' next-token loss."""

    name = "simpo"

    def loss_sum(self, model, batch: dict, train) -> tuple[torch.Tensor, dict]:
        return simpo_loss(
            model, batch, train.simpo_beta, train.simpo_gamma, train.cpo_alpha, train.logits_chunk_tokens
        )


class Unpaired:
    """kto: KTO (TRL's KTOTrainer loss), the base itself the reference, on rows labelled desirable or not
    (`usaf.data.pairs.LabelledRows`: {prompt, completion, label} records, and preference pairs unpaired as TRL
    unpairs them); its units are rows."""

    # the reference on its rows, policy and reference on the KL rows: 3; its rate not measured apart from SFT's
    name, pairs, reference_forward, default_lr = "kto", False, 3, NEXT_TOKEN_LR

    def check(self, train) -> None:
        _no_prefix_cache(train, self.name)

    def loss_sum(self, model, batch: dict, train) -> tuple[torch.Tensor, dict]:
        return kto_loss(
            model,
            batch,
            batch["label"],
            train.kto_beta,
            train.kto_desirable_weight,
            train.kto_undesirable_weight,
            train.logits_chunk_tokens,
        )

    def supervised_units(self, batch: dict) -> int:
        return batch["input_ids"].shape[0]

    def step_metrics(self, extras: list, supervised: int, total: Callable) -> dict:
        means = _means(extras, total)
        return {**means, "rewards/margins": means["rewards/chosen"] - means["rewards/rejected"]}


OBJECTIVES.register(NextToken())
OBJECTIVES.register(Preference())
OBJECTIVES.register(OddsRatio())
OBJECTIVES.register(SimplePreference())
OBJECTIVES.register(Unpaired())
