"""`train.recompute=auto`: recompute exactly when the planner's ledger says the activations would not fit.

The run's configuration is planned twice by `usaf.planner.ledger` (the ledger `usaf plan` prints): once without
recomputation (every layer's saved tensors) and, for the message, once with it. Recomputation goes on when the peak
without it exceeds the memory budget: `train.memory_limit` when given, else the GPU's memory, or on the CPU the
machine's RAM. The choice is for the whole model (every decoder layer or none); recomputing only as many layers as
the budget needs is not done.
"""

from __future__ import annotations

import dataclasses

import torch

from usaf.errors import UsafError
from usaf.planner.sizes import format_size
from usaf.train.memory_plan import RunPlan, run_plan


@dataclasses.dataclass(frozen=True)
class RecomputeChoice:
    recompute: bool
    line: str  # one line for the run's log: what was chosen and why


def choose_recompute(config, device: torch.device, dtype: torch.dtype) -> RecomputeChoice:
    """Resolve `config.train.recompute` (a RunConfig's): true and false as given, auto from the planner."""
    setting = config.train.recompute
    if setting is True or setting is False:
        return given_recompute(setting)
    try:
        run = run_plan(config, device, dtype)
    except UsafError as err:
        return RecomputeChoice(True, f"recompute: on (train.recompute=auto: {err})")
    return planned_recompute(run)


def given_recompute(setting: bool) -> RecomputeChoice:
    return RecomputeChoice(
        setting, f"recompute: {'on' if setting else 'off'} (train.recompute={str(setting).lower()})"
    )


def planned_recompute(run: RunPlan) -> RecomputeChoice:
    """train.recompute=auto on a run's plan (`usaf plan` decides by this too): its peak without recomputation
    against the run's budget."""
    without = run.plan(run.settings.replace(recompute=False))
    return decide(without.device_peak, _activations(without), run.budget, run.where)


def decide(peak_without: float, activations: float, budget: int, where: str) -> RecomputeChoice:
    """The rule: recompute when the planned peak without recomputation exceeds the budget."""

    planned = f"the planned peak without recomputation, {format_size(peak_without)} "
    planned += f"({format_size(activations)} of it activations),"
    if peak_without <= budget:
        return RecomputeChoice(False, f"recompute: off (train.recompute=auto: {planned} fits {where})")
    return RecomputeChoice(
        True, f"recompute: on, every layer (train.recompute=auto: {planned} exceeds {where})"
    )


def _activations(p) -> float:
    return sum(line.device for line in p.lines if line.name.startswith("activations"))
